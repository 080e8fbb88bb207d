"""What a reply must look like, as the engine's Grammar: JSON (any object, or one matching a JSON schema:
OpenAI's `response_format`), a forced tool call (`tool_choice` "required" or a named function: a DSML
call of an offered tool whose arguments fit its parameters schema), a Lark grammar or a regular expression
(`generate --grammar`, chat's `/set format`). In thinking mode the grammar starts after `</think>`: the
reasoning stays free. A grammar that cannot constrain a reply (a bad schema, an unsupported keyword, no
token it allows) is a ValueError naming the problem; the front ends make it a 400 or a usage error."""
import json
import re
from pathlib import Path

from dsv4cli.encoding import DSML, THINK_END, TOOL_CALLS_END, TOOL_CALLS_OPENING
from dsv4cli.engine.grammar import JSON_OPTIONS, Grammar
from dsv4cli.tokenizer import Tokenizer

ANY_OBJECT = {"type": "object"}
ENDLESS = "no finite JSON value matches it (a required property, item or branch only its own recursion satisfies)"
# a string parameter with nothing but these keys is written as text (string="true"), as the model was trained
# (an enum of strings: one of them); any other parameter as JSON (string="false"), its schema constraining it
PLAIN_STRING_KEYS = {"type", "title", "description", "examples", "enum"}
FORMATS = ("text", "json", "json-schema FILE", "grammar FILE")      # chat's `format` setting
LARK_START = re.compile(r"^\s*start\s*:", re.M)     # a Lark grammar defines its start rule; anything else is a regex


def checked(grammar: Grammar, tok: Tokenizer, vocab: int) -> Grammar:
    if problem := grammar.problem(tok, vocab):
        raise ValueError(problem)
    return grammar


def free_until(tok: Tokenizer, thinking: bool) -> int | None:
    """The token that ends the free part of a reply: `</think>` in thinking mode."""
    return tok.special_ids[THINK_END] if thinking else None


def finite(schema: dict) -> bool:
    """Whether some finite JSON value matches `schema`: not so where a required property, item or branch only its
    own recursion satisfies (`{"properties": {"x": {"$ref": "#"}}, "required": ["x"]}`), which a grammar accepts
    but no reply can end. A least fixpoint over the subschemas: one holds once some value of it needs only
    subschemas that hold. Keywords it does not model (bounds, patterns, ...) count as satisfiable: llguidance
    judges those."""
    nodes, todo = {}, [schema]          # every subschema by id (all alive while this runs): what a $ref can name
    while todo:
        node = todo.pop()
        if isinstance(node, dict) and id(node) not in nodes:
            nodes[id(node)] = node
            for key in ("properties", "$defs", "definitions"):
                todo += node[key].values() if isinstance(node.get(key), dict) else []
            for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
                todo += node[key] if isinstance(node.get(key), list) else []
            todo += [node[k] for k in ("items", "additionalProperties") if isinstance(node.get(k), dict)]
    held: set[int] = set()

    def holds(sub) -> bool:
        if not isinstance(sub, dict):
            return sub is not False
        if isinstance(ref := sub.get("$ref"), str) and ref.startswith("#"):
            target = schema
            for part in filter(None, ref[1:].split("/")):
                target = target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
            if isinstance(target, bool):
                return target
            if isinstance(target, dict) and id(target) not in held:     # a missing one: llguidance says so
                return False
        branches = [s for key in ("anyOf", "oneOf") for s in sub.get(key, [])]
        return all(holds(s) for s in sub.get("allOf", [])) and (not branches or any(holds(s) for s in branches)) \
            and ("enum" in sub or "const" in sub or any(kind_holds(sub, kind) for kind in kinds(sub)))

    def kind_holds(sub: dict, kind: str) -> bool:
        if kind == "object":
            props = sub.get("properties", {})
            return all(holds(props.get(k, sub.get("additionalProperties", True))) for k in sub.get("required", []))
        if kind == "array":
            prefix, least = sub.get("prefixItems", []), sub.get("minItems", 0)
            return all(holds(prefix[i] if i < len(prefix) else sub.get("items", True))
                       for i in range(min(least, len(prefix) + 1)))
        return True

    try:
        while grown := [i for i, node in nodes.items() if i not in held and holds(node)]:
            held.update(grown)
    except (RecursionError, TypeError, AttributeError):     # too deep, or keywords of odd types: llguidance judges
        return True
    return id(schema) in held


def kinds(sub: dict) -> list[str]:
    """The JSON types a subschema admits, as a grammar built from it reads them: its `type`, else what its
    keywords imply (properties: an object; items: an array), else any."""
    kind = sub.get("type")
    if kind is not None:
        return [kind] if isinstance(kind, str) else list(kind)
    if any(k in sub for k in ("properties", "required", "additionalProperties")):
        return ["object"]
    if any(k in sub for k in ("items", "prefixItems", "minItems")):
        return ["array"]
    return ["any"]


def json_grammar(schema: dict | None, tok: Tokenizer, vocab: int, thinking: bool) -> Grammar:
    """JSON matching `schema` (None: any JSON object)."""
    if schema is not None and not isinstance(schema, dict):
        raise ValueError("a JSON schema must be an object")
    grammar = checked(Grammar.json_schema(ANY_OBJECT if schema is None else schema, free_until(tok, thinking)), tok,
                      vocab)
    if schema is not None and not finite(schema):
        raise ValueError(ENDLESS)
    return grammar


def text_grammar(text: str, tok: Tokenizer, vocab: int, thinking: bool) -> Grammar:
    """A Lark grammar (one that defines `start`) or else a regular expression the whole reply matches."""
    after = free_until(tok, thinking)
    grammar = Grammar.lark(text, after) if LARK_START.search(text) else Grammar.regex(text, after)
    return checked(grammar, tok, vocab)


def regex_grammar(pattern: str, tok: Tokenizer, vocab: int, thinking: bool) -> Grammar:
    """A regular expression the whole reply matches."""
    return checked(Grammar.regex(pattern, free_until(tok, thinking)), tok, vocab)


def choice_grammar(choices: list[str], tok: Tokenizer, vocab: int, thinking: bool) -> Grammar:
    """Exactly one of `choices` (vLLM's guided_choice): an alternation of the literal texts."""
    start = " | ".join(_text(choice, tok) for choice in choices)
    return checked(Grammar.lark(f"start: {start}", free_until(tok, thinking)), tok, vocab)


def tool_grammar(tools: list[dict], choice, tok: Tokenizer, vocab: int, thinking: bool,
                 answer: dict | None = None, parallel: bool = True) -> Grammar:
    """Tool calls in DSML: with `choice` "required" one or more calls of the offered tools (one without
    `parallel`), with a named function ({"type": "function", "function": {"name": ...}}) one call of it,
    with "auto" either the calls or an answer matching the JSON schema `answer`. Each call's arguments fit
    its parameters schema: the properties in the schema's order, the required ones present, no others."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise ValueError(f"{name!r} is not one of the offered tools")
        calls = f'{_text(TOOL_CALLS_OPENING + chr(10), tok)} invoke_0 {_text(chr(10) + TOOL_CALLS_END, tok)}'
        tools = chosen
    else:
        invoke = " | ".join(f"invoke_{i}" for i in range(len(tools)))
        more = f' ("\\n" ({invoke}))*' if parallel else ""
        calls = f'{_text(TOOL_CALLS_OPENING + chr(10), tok)} ({invoke}){more} {_text(chr(10) + TOOL_CALLS_END, tok)}'
    rules = [f"start: {'answer | calls' if choice == 'auto' else 'calls'}", f"calls: {calls}"]
    if choice == "auto":
        if answer is not None and not finite(answer):
            raise ValueError(ENDLESS)
        rules.append(f"answer: %json {json.dumps(_with_options(answer), ensure_ascii=False)}")
    for i, tool in enumerate(tools):
        rules += _invoke(f"invoke_{i}", tool["function"], tok)
    rules.append(r"TEXT: /(?s:.)*<\//")        # a string value, up to the closing tag's "</"
    return checked(Grammar.lark("\n".join(rules), free_until(tok, thinking)), tok, vocab)


def _invoke(rule: str, function: dict, tok: Tokenizer) -> list[str]:
    """The Lark rules of one call of `function`: rendered as encoding.py renders a call."""
    name, schema = function["name"], function.get("parameters") or ANY_OBJECT
    if not isinstance(schema, dict) or schema.get("type", "object") != "object" or \
            not isinstance(schema.get("properties", {}), dict):
        raise ValueError(f"{name}: its parameters must be an object schema with properties")
    if not all(isinstance(sub, dict) for sub in schema.get("properties", {}).values()) or \
            not isinstance(schema.get("required", []), list):
        raise ValueError(f"{name}: its parameters' properties must each be a schema (an object), its required a list")
    if not finite(schema):
        raise ValueError(f"{name}: its parameters: {ENDLESS}")
    shared = {k: schema[k] for k in ("$defs", "definitions") if k in schema}     # what the properties' $refs name
    required, rules, params = schema.get("required", []), [], []
    for j, (key, sub) in enumerate(schema.get("properties", {}).items()):
        value = _as_text(sub)
        opening = _text(f'<{DSML}parameter name="{key}" string="{"true" if value else "false"}">', tok)
        value = value or f'%json {json.dumps(_with_options({**sub, **shared}), ensure_ascii=False)} "</"'
        rules.append(f"{rule}_{j}: {opening} {value} {_text(f'{DSML}parameter>', tok)}")
        params.append(f'{rule}_{j} "\\n"' if key in required else f'({rule}_{j} "\\n")?')
    # as encoding.py renders it: `name">`, a line per parameter, `</invoke>` on a line of its own
    head = _text(f'<{DSML}invoke name="{name}">' + ("\n" if params else "\n\n"), tok)
    return [f"{rule}: {head} {' '.join(params)} {_text(f'</{DSML}invoke>', tok)}", *rules]


def _as_text(schema) -> str | None:
    """The Lark of a parameter's value written as text, up to its closing tag's "</": any text for a plain
    string, one of an enum's strings; None: it is written as JSON."""
    if not isinstance(schema, dict) or not set(schema) <= PLAIN_STRING_KEYS or schema.get("type", "string") != "string":
        return None
    enum = schema.get("enum")
    if enum is None:
        return "TEXT" if "type" in schema else None
    if not (isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum)):
        return None
    return "(" + " | ".join(json.dumps(v + "</", ensure_ascii=False) for v in enum) + ")"


def _with_options(schema: dict) -> dict:
    """A schema inlined in Lark, written as `json_grammar` writes JSON."""
    return {**schema, "x-guidance": JSON_OPTIONS}


def _text(text: str, tok: Tokenizer) -> str:
    """Literal text as Lark: string literals, and the special tokens in it by id (a special token is no
    text a string literal can match)."""
    specials = sorted((t for t in tok.special_ids if t in text), key=len, reverse=True)
    if not specials:
        return json.dumps(text, ensure_ascii=False)
    parts = re.split(f"({'|'.join(map(re.escape, specials))})", text)
    return " ".join(f"<[{tok.special_ids[p]}]>" if p in tok.special_ids else json.dumps(p, ensure_ascii=False)
                    for p in parts if p)


def format_grammar(value: str, tok: Tokenizer, vocab: int, thinking: bool) -> Grammar | None:
    """The grammar of chat's `format` setting: text (none), json, json-schema FILE, grammar FILE."""
    kind, _, path = value.strip().partition(" ")
    path = path.strip()
    if kind == "text" and not path:
        return None
    if kind == "json" and not path:
        return json_grammar(None, tok, vocab, thinking)
    if kind not in ("json-schema", "grammar") or not path:
        raise ValueError(f"must be one of: {', '.join(FORMATS)}; got {value!r}")
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror}") from None
    if kind == "grammar":
        return text_grammar(text.removesuffix("\n"), tok, vocab, thinking)
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path}: not JSON: {e}") from None
    return json_grammar(schema, tok, vocab, thinking)
