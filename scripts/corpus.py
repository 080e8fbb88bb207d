"""Deterministic synthetic corpus for the bundled tiny DeepSeek-V4 model (no downloads).

Chat documents teach the V4 chat format on tiny question types (small sums, a few fact tables,
greetings) and on story requests; plain-text documents (short stories and template prose) teach
ordinary English. The held-out split uses unseen operand pairs for arithmetic, question frames never
seen with that fact table (though seen with the others), unseen opener + tail combinations for
greetings, and unseen frame + noun combinations for story requests.
"""

import random

from dsv4cli.encoding import BOS, EOS, THINK_END, encode_messages

# fmt: off
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "China": "Beijing", "Egypt": "Cairo", "Canada": "Ottawa", "Russia": "Moscow", "India": "New Delhi",
    "Kenya": "Nairobi", "Greece": "Athens", "Norway": "Oslo", "Sweden": "Stockholm", "Peru": "Lima",
    "Cuba": "Havana", "Ireland": "Dublin", "Poland": "Warsaw", "Portugal": "Lisbon", "Austria": "Vienna",
    "Chile": "Santiago", "Thailand": "Bangkok", "Australia": "Canberra", "Turkey": "Ankara",
}
COLORS = {
    "the sky": "blue", "grass": "green", "snow": "white", "coal": "black", "a banana": "yellow",
    "a tomato": "red", "a carrot": "orange", "milk": "white", "a strawberry": "red", "a frog": "green",
    "the sun": "yellow", "a cherry": "red", "chocolate": "brown", "a leaf": "green", "a pumpkin": "orange",
    "an elephant": "gray", "a lemon": "yellow", "the sea": "blue", "a crow": "black", "a cloud": "white",
}
OPPOSITES = {
    "hot": "cold", "big": "small", "up": "down", "fast": "slow", "happy": "sad", "light": "dark",
    "old": "young", "open": "closed", "wet": "dry", "early": "late", "full": "empty", "hard": "soft",
    "high": "low", "long": "short", "loud": "quiet", "rich": "poor", "strong": "weak", "thick": "thin",
    "day": "night", "left": "right", "good": "bad", "push": "pull", "win": "lose", "in": "out",
}
ANIMAL_SOUNDS = {
    "a dog": "woof", "a cat": "meow", "a cow": "moo", "a duck": "quack", "a sheep": "baa",
    "a pig": "oink", "a horse": "neigh", "a lion": "roar", "a bee": "buzz", "an owl": "hoot",
    "a frog": "ribbit", "a snake": "hiss", "a mouse": "squeak", "a rooster": "cock-a-doodle-doo",
    "a wolf": "awoo", "a donkey": "hee-haw",
}
# fmt: on

# Fact questions are built from frames shared by the relations ("Tell me the {rel} of {x}.") plus
# frames of their own ("What color is {x}?"). Each relation holds out two shared frames that training
# shows only with the other relations, so held-out questions test whether the model composes a known
# frame with a known relation, not whether it memorised one string.
SHARED_FRAMES = [
    "What is the {rel} of {x}?",
    "What's the {rel} of {x}?",
    "Tell me the {rel} of {x}.",
    "Name the {rel} of {x}.",
    "Do you know the {rel} of {x}?",
    "Can you tell me the {rel} of {x}?",
    "Please give the {rel} of {x}.",
    "I want to know the {rel} of {x}.",
]
FACTS = {  # kind: (table, relation noun, own frames, held-out shared frames)
    "capital": (CAPITALS, "capital", ["Which city is the capital of {x}?", "{x} has which capital?"], [2, 4]),
    "color": (COLORS, "color", ["What color is {x}?", "What colour is {x}?", "Which color is {x}?"], [0, 2]),
    "opposite": (OPPOSITES, "opposite", ["Give me the opposite of {x}.", "What word is the opposite of {x}?"],
                 [2, 5]),
    "animal_sound": (ANIMAL_SOUNDS, "sound", ["What sound does {x} make?", "What does {x} say?",
                                              "What noise does {x} make?"], [1, 6]),
}
ARITHMETIC = {
    "add": ["What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.", "{a} + {b} = ?",
            "How much is {a} plus {b}?", "Compute {a} + {b}.", "What do you get if you add {a} and {b}?"],
    "sub": ["What is {a} - {b}?", "What is {a} minus {b}?", "Subtract {b} from {a}.", "{a} - {b} = ?",
            "How much is {a} minus {b}?", "Compute {a} - {b}.", "What do you get if you take {b} from {a}?"],
}
# Greetings: an opener and a tail; a fixed share of the combinations is held out.
GREET_OPENERS = ["Hi", "Hello", "Hey", "Good morning", "Good afternoon", "Good evening", "Greetings"]
GREET_TAILS = ["", "!", " there!", " again!", ", how are you?", " friend!", ", nice to meet you!"]
GREETING_ANSWER = "Hello! How can I help you?"
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a friendly assistant.",
    "Answer in one short sentence.",
    "You are a tiny model. Be brief.",
]
SPLITS = ("train", "heldout")
# Arithmetic is the hardest type to generalise (unseen operand pairs), so it gets a larger share.
KIND_WEIGHTS = {"add": 3, "sub": 5, "capital": 1, "color": 1, "opposite": 1, "animal_sound": 1, "greet": 1}
# Story requests: a frame and a noun phrase, a fixed diagonal of the combinations held out, so every
# frame and every noun is seen in training but not each pairing. The answer is a fresh story, so these
# are scored by form (`is_story`), not by exact match, and are not among `question_types()`.
STORY_FRAMES = ["Tell me {s}.", "Can you tell me {s}?", "Please tell me {s}.", "Could you tell me {s}?",
                "I want to hear {s}.", "Write {s}.", "Write me {s}.", "I would like {s}.", "Give me {s}.",
                "Do you know {s}?"]
STORY_NOUNS = ["a story", "a short story", "a little story", "a bedtime story"]
STORY_OPENING = "Once upon a time, there was a "
STORY_MIN_WORDS = 30  # the shortest story of `make_story` has 33
CHAT_WEIGHTS = {**KIND_WEIGHTS, "story": 1}


def question_types() -> list[str]:
    return list(KIND_WEIGHTS)


def make_qa(kind: str, rng: random.Random, split: str) -> tuple[str, str]:
    """One (question, answer) pair of the given type from the given split."""
    question, answer, _ = _make(kind, rng, split)
    return question, answer


def story_requests(split: str) -> list[str]:
    """The story-request phrasings of a split (10 of the 40 are held out)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    return [frame.format(s=noun) for f, frame in enumerate(STORY_FRAMES) for n, noun in enumerate(STORY_NOUNS)
            if ((f + n) % 4 == 3) == (split == "heldout")]


def is_story(reply: str) -> bool:
    """A reply counts as a story when it opens like the corpus's stories, has at least
    STORY_MIN_WORDS words and ends a sentence (so it was not cut off)."""
    return reply.startswith(STORY_OPENING) and len(reply.split()) >= STORY_MIN_WORDS and reply.endswith(".")


def _is_heldout_pair(a, b):
    # A fixed ~10% of operand pairs is reserved for evaluation.
    return (a * 7 + b) % 10 == 3


def _frames(kind, split):
    table, rel, own, heldout = FACTS[kind]
    if split == "heldout":
        return [SHARED_FRAMES[i].replace("{rel}", rel) for i in heldout]
    shared = [f.replace("{rel}", rel) for i, f in enumerate(SHARED_FRAMES) if i not in heldout]
    return shared + own


def _greetings(split):
    combos = [opener + tail for opener in GREET_OPENERS for tail in GREET_TAILS]
    return [g for i, g in enumerate(combos) if (i % 6 == 4) == (split == "heldout")]


def _make(kind, rng, split):
    """(question, answer, short reasoning) for one instance."""
    if kind not in CHAT_WEIGHTS:
        raise ValueError(f"unknown question type {kind!r}; expected one of {list(CHAT_WEIGHTS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")

    if kind in ARITHMETIC:
        while True:
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            if kind == "sub" and b > a:
                a, b = b, a
            if _is_heldout_pair(a, b) == (split == "heldout"):
                break
        op, word, result = ("+", "plus", a + b) if kind == "add" else ("-", "minus", a - b)
        question = rng.choice(ARITHMETIC[kind]).format(a=a, b=b)
        return question, f"{a} {op} {b} = {result}.", f"{a} {word} {b} is {result}."
    if kind == "greet":
        return rng.choice(_greetings(split)), GREETING_ANSWER, "The user greets me."
    if kind == "story":
        return rng.choice(story_requests(split)), make_story(rng), "The user wants a story."

    table = FACTS[kind][0]
    x, y = rng.choice(list(table.items()))
    if kind == "opposite" and rng.random() < 0.5:
        x, y = y, x
    question = rng.choice(_frames(kind, split)).format(x=x)
    if kind == "capital":
        return question, f"The capital of {x} is {y}.", f"{x} has the capital {y}."
    if kind == "color":
        return question, f"The color of {x} is {y}.", f"{_cap(x)} looks {y}."
    if kind == "opposite":
        return question, f"The opposite of {x} is {y}.", f"{_cap(x)} and {y} are opposites."
    return question, f"{_cap(x)} says {y}.", f"{_cap(x)} makes the sound {y}."


def _cap(text):
    return text[0].upper() + text[1:]


def heldout_set(seed: int = 1, n: int = 70) -> list[dict]:
    """Evaluation items, spread evenly over the question types, without repeated questions."""
    rng = random.Random(seed)
    kinds, items, seen = question_types(), [], set()
    for attempt in range(50 * n):
        if len(items) == n:
            break
        kind = kinds[attempt % len(kinds)]
        question, answer = make_qa(kind, rng, "heldout")
        if question not in seen:
            seen.add(question)
            items.append({"kind": kind, "question": question, "answer": answer})
    return items


# --- plain text: short stories from a small grammar and template prose ---

# fmt: off
NAMES = {"Tom": "he", "Lily": "she", "Max": "he", "Mia": "she", "Ben": "he", "Anna": "she", "Sam": "he",
         "Lucy": "she", "Leo": "he", "Emma": "she"}
# fmt: on
ANIMALS = ["cat", "dog", "bird", "rabbit", "fox", "bear", "duck", "frog", "mouse", "turtle"]
ADJECTIVES = ["little", "happy", "small", "brave", "kind", "shy", "curious", "sleepy"]
PLACES = ["park", "forest", "garden", "house", "river", "field", "town", "hill"]
OBJECTS = ["ball", "box", "hat", "kite", "red apple", "stick", "book", "shiny stone", "blue cup"]
FEELINGS = ["happy", "surprised", "excited", "proud", "glad"]
ACTIVITIES = ["run", "sing", "play in the sun", "read books", "jump", "swim", "dance", "look at the stars"]
FOODS = ["bread", "an apple", "rice", "soup", "an egg", "a banana", "cheese"]
DRINKS = ["milk", "water", "tea", "juice"]


def make_story(rng: random.Random) -> str:
    name, friend = rng.sample(list(NAMES), 2)
    pron = NAMES[name]
    animal, friend_animal = rng.sample(ANIMALS, 2)
    obj, place = rng.choice(OBJECTS), rng.choice(PLACES)
    sentences = [
        f"Once upon a time, there was a {rng.choice(ADJECTIVES)} {animal} named {name}.",
        f"{name} loved to {rng.choice(ACTIVITIES)}.",
        f"One day, {name} found a {obj} in the {place}.",
        f"{_cap(pron)} was very {rng.choice(FEELINGS)}.",
    ]
    if rng.random() < 0.6:
        sentences += [
            f"{name} showed the {obj} to {friend}, a {rng.choice(ADJECTIVES)} {friend_animal}.",
            f"They played with the {obj} all day.",
        ]
        endings = [
            f"From that day on, {name} and {friend} were best friends.",
            f"At night, {name} and {friend} went home and slept.",
        ]
    else:
        endings = [f"At night, {name} went home and slept.", f"{name} took the {obj} home and smiled."]
    sentences.append(rng.choice(endings))
    return " ".join(sentences)


def make_prose(rng: random.Random) -> str:
    kind = rng.choice(["facts", "day", "weather"])
    if kind == "facts":
        facts = [f"The capital of {c} is {city}." for c, city in rng.sample(list(CAPITALS.items()), 2)]
        facts += [f"The color of {t} is {c}." for t, c in rng.sample(list(COLORS.items()), 2)]
        facts += [f"{_cap(a)} says {s}." for a, s in rng.sample(list(ANIMAL_SOUNDS.items()), 1)]
        facts += [f"The opposite of {w} is {o}." for w, o in rng.sample(list(OPPOSITES.items()), 1)]
        rng.shuffle(facts)
        return " ".join(facts)
    name = rng.choice(list(NAMES))
    pron = NAMES[name]
    if kind == "day":
        return (
            f"Every morning, {name} wakes up early. {_cap(pron)} eats {rng.choice(FOODS)} and drinks "
            f"{rng.choice(DRINKS)}. Then {pron} walks to the {rng.choice(PLACES)}. In the afternoon, "
            f"{pron} likes to {rng.choice(ACTIVITIES)}. In the evening, {pron} goes to bed."
        )
    season, weather = rng.choice(
        [
            ("winter", "cold and there is snow"),
            ("summer", "hot and sunny"),
            ("spring", "warm and the flowers grow"),
            ("autumn", "cool and the leaves fall"),
        ]
    )
    return (
        f"In {season}, it is {weather}. {name} likes {season}. "
        f"{_cap(pron)} goes to the {rng.choice(PLACES)} with a {rng.choice(ANIMALS)}."
    )


# --- documents ---


def make_chat_document(rng: random.Random) -> str:
    """A full conversation in chat mode (sometimes thinking mode), ending with the answer and EOS."""
    kinds, weights = list(CHAT_WEIGHTS), list(CHAT_WEIGHTS.values())
    thinking = rng.random() < 0.1
    messages = []
    if rng.random() < 0.25:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    if rng.random() < 0.25:
        question, answer, reasoning = _make(rng.choices(kinds, weights)[0], rng, "train")
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer, "reasoning_content": reasoning},
        ]
    question, answer, reasoning = _make(rng.choices(kinds, weights)[0], rng, "train")
    messages.append({"role": "user", "content": question})
    completion = (reasoning + THINK_END if thinking else "") + answer + EOS
    return encode_messages(messages, thinking=thinking) + completion


def build_corpus(seed: int = 0, n_chat: int = 20000, n_text: int = 5000) -> list[str]:
    """Shuffled chat and plain-text documents; every document starts with BOS and ends with EOS."""
    rng = random.Random(seed)
    docs = [make_chat_document(rng) for _ in range(n_chat)]
    docs += [BOS + (make_story(rng) if rng.random() < 0.5 else make_prose(rng)) + EOS for _ in range(n_text)]
    rng.shuffle(docs)
    return docs
