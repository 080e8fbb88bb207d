import random
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for `scripts.*`
from scripts.corpus import (
    FACTS,
    GREET_OPENERS,
    GREET_TAILS,
    SHARED_FRAMES,
    STORY_FRAMES,
    STORY_NOUNS,
    build_corpus,
    heldout_set,
    is_story,
    make_qa,
    make_story,
    question_types,
    story_requests,
)

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(seed=0, n_chat=3000, n_text=500)


def test_deterministic(corpus):
    assert build_corpus(seed=0, n_chat=3000, n_text=500) == corpus
    assert build_corpus(seed=1, n_chat=3000, n_text=500) != corpus
    assert heldout_set(seed=1, n=30) == heldout_set(seed=1, n=30)


def test_documents_are_framed(corpus):
    assert len(corpus) == 3500
    assert all(doc.startswith(BOS) and doc.endswith(EOS) for doc in corpus)
    chats = [doc for doc in corpus if "<｜User｜>" in doc]
    assert len(chats) == 3000
    assert all(doc.count(BOS) == 1 for doc in corpus)
    # Mostly chat mode, a small share in thinking mode, some with a system prompt or two turns.
    thinking = sum("<｜Assistant｜><think>" in doc for doc in chats)
    assert 0.05 * len(chats) < thinking < 0.2 * len(chats)
    assert any(not doc.startswith(BOS + "<｜User｜>") for doc in chats)
    assert any(doc.count("<｜User｜>") == 2 for doc in chats)


def test_every_type_present(corpus):
    kinds = question_types()
    assert 4 <= len(kinds) <= 8
    items = heldout_set(seed=1, n=70)
    assert {item["kind"] for item in items} == set(kinds)
    rng = random.Random(0)
    text = "".join(corpus)
    for kind in kinds:
        question, answer = make_qa(kind, rng, "train")
        assert question and answer.endswith((".", "?"))
    # Each type shows up in the training conversations.
    for sample in ["+", " - ", "capital of", "color", "opposite", "says", "Hello! How can I help you?"]:
        assert sample in text


def test_answers_are_deterministic():
    rng = random.Random(0)
    answers = {}
    for kind in question_types():
        for split in ("train", "heldout"):
            for _ in range(200):
                question, answer = make_qa(kind, rng, split)
                assert answers.setdefault(question, answer) == answer
    # Arithmetic answers are right and use small operands.
    for answer in answers.values():
        if match := re.fullmatch(r"(\d+) ([-+]) (\d+) = (\d+)\.", answer):
            a, op, b, result = match.groups()
            assert int(a) <= 20 and int(b) <= 20
            assert int(result) == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_train_and_heldout_are_disjoint(corpus):
    rng = random.Random(0)
    for kind in question_types():
        train = {make_qa(kind, rng, "train")[0] for _ in range(2000)}
        heldout = {make_qa(kind, rng, "heldout")[0] for _ in range(500)}
        assert train.isdisjoint(heldout), kind
        if kind in ("add", "sub"):  # held-out arithmetic uses unseen operand pairs
            pairs = re.compile(r"(\d+) [-+] (\d+) =")
            train_pairs = {pairs.match(make_qa(kind, rng, "train")[1]).groups() for _ in range(2000)}
            heldout_pairs = {pairs.match(make_qa(kind, rng, "heldout")[1]).groups() for _ in range(500)}
            assert train_pairs.isdisjoint(heldout_pairs), kind
    text = "".join(corpus)
    for item in heldout_set(seed=1, n=70):
        assert f"<｜User｜>{item['question']}<｜Assistant｜>" not in text


def test_heldout_set_has_no_repeats():
    items = heldout_set(seed=1, n=50)
    assert len(items) == 50
    assert len({item["question"] for item in items}) == 50
    assert all(set(item) == {"kind", "question", "answer"} for item in items)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown question type"):
        make_qa("poetry", random.Random(0), "train")
    with pytest.raises(ValueError, match="unknown split"):
        make_qa("add", random.Random(0), "test")


def test_heldout_questions_compose_seen_parts():
    """A held-out fact frame is seen in training with other relations; a held-out greeting's opener and
    tail are both seen in training greetings. Only the combination is new."""
    rng = random.Random(0)
    train = {kind: {make_qa(kind, rng, "train")[0] for _ in range(3000)} for kind in question_types()}
    for kind, (table, rel, _, heldout) in FACTS.items():
        x = next(iter(table))
        for i in heldout:
            frame = SHARED_FRAMES[i]
            assert frame.replace("{rel}", rel).format(x=x) not in train[kind]
            others = [(k, r) for k, (_, r, _, h) in FACTS.items() if k != kind and i not in h]
            assert others, (kind, frame)
            for other, other_rel in others:
                prefix = frame.replace("{rel}", other_rel).split("{x}")[0]
                assert any(q.startswith(prefix) for q in train[other]), (other, frame)
    heldout_greetings = {make_qa("greet", rng, "heldout")[0] for _ in range(500)}
    assert len(heldout_greetings) >= 5
    for greeting in heldout_greetings:
        opener = max((o for o in GREET_OPENERS if greeting.startswith(o)), key=len)
        tail = greeting[len(opener):]
        assert tail in GREET_TAILS
        assert any(g.startswith(opener) for g in train["greet"])
        assert any(g.endswith(tail) and g != greeting for g in train["greet"])


def test_story_requests_are_answered_with_stories(corpus):
    """Chat documents ask for stories in trained phrasings and answer with a corpus story."""
    requests = story_requests("train")
    answered = 0
    for doc in corpus:
        for request in requests:
            marker = f"<｜User｜>{request}<｜Assistant｜>"
            if marker in doc:
                reply = doc.split(marker, 1)[1].split(EOS, 1)[0].removeprefix("</think>")
                reply = reply.split("</think>", 1)[-1]  # thinking mode: after the reasoning
                assert is_story(reply), reply
                answered += 1
    assert 0.03 * len(corpus) < answered < 0.15 * len(corpus)
    for request in story_requests("heldout"):
        assert f"<｜User｜>{request}<｜Assistant｜>" not in "".join(corpus)


def test_heldout_story_requests_compose_seen_parts():
    """Every held-out request pairs a frame and a noun that training shows, each with other partners."""
    train, heldout = story_requests("train"), story_requests("heldout")
    assert len(heldout) == 10 and len(train) == 30 and set(train).isdisjoint(heldout)
    assert "Tell me a story." in train and "Can you tell me a short story?" in train  # the README's examples
    for frame in STORY_FRAMES:
        for noun in STORY_NOUNS:
            if frame.format(s=noun) in heldout:
                assert any(frame.format(s=other) in train for other in STORY_NOUNS)
                assert any(other.format(s=noun) in train for other in STORY_FRAMES)


def test_is_story():
    rng = random.Random(0)
    assert all(is_story(make_story(rng)) for _ in range(500))
    story = make_story(rng)
    assert not is_story(story[: len(story) // 2])        # cut off
    assert not is_story("The color of the sky is blue.")
    assert not is_story("Once upon a time, there was a cat.")  # too short
