"""Structured output: a grammar masks every row a step commits, drafts' rows included. Constrained greedy
output is the same with drafts as without (both drafter kinds, every depth), sampled output follows the
masked distribution, a step reads the host once, a dead end ends its request, unconstrained requests and
steps are untouched, the compiled step masks as the eager one; the grammars of JSON schemas, DSML tool
calls, Lark and regular expressions; the streaming DSML parser; generate --json-schema / --grammar and
chat's format setting."""
import json
import math
import re
import subprocess
import sys

import jsonschema
import pytest
import torch
from test_engine import spy
from tiny import random_model, tiny_config, tiny_dspark_config

from benchmarks.structured import TOOLS, check_answers, schema_requests, tool_requests
from dsv4cli import platforms
from dsv4cli.config import BUNDLED_MODEL_DIR
from dsv4cli.encoding import DSML, TOOL_CALLS_END, TOOL_CALLS_OPENING, parse_completion, tool_calls_so_far
from dsv4cli.engine import Engine, EngineOptions, SamplingParams, Sequence
from dsv4cli.engine.grammar import Grammar, new_matcher
from dsv4cli.kernels import cpu
from dsv4cli.model import load_model
from dsv4cli.openai import anthropic
from dsv4cli.openai.requests import BodyParser, BodyRules
from dsv4cli.openai.responses import ChunkStream, completion
from dsv4cli.structured import json_grammar, text_grammar, tool_grammar
from dsv4cli.tokenizer import Tokenizer

MTP_DIR = BUNDLED_MODEL_DIR.parent / "dsv4-tiny-mtp"
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "population", "tags"],
        "properties": {"city": {"type": "string", "maxLength": 12},
                       "population": {"type": "integer", "minimum": 0, "maximum": 100000},
                       "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["big", "old", "sunny"]}}}}
QUESTIONS = ["What is the capital of France?", "Tell me a story.", "What is 7 plus 12?", "What colour is grass?"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string", "description": "a city"}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["c", "f"]}, "options": {"$ref": "#/$defs/Options"}},
    "$defs": {"Options": {"type": "object", "properties": {"hourly": {"type": "boolean"}}, "required": ["hourly"],
                          "additionalProperties": False}}}}}
NOW = {"type": "function", "function": {"name": "now"}}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(BUNDLED_MODEL_DIR)


@pytest.fixture(scope="module")
def dspark():
    return load_model(BUNDLED_MODEL_DIR, dtype=torch.float32)


@pytest.fixture(scope="module")
def mtp_model():
    return load_model(MTP_DIR, dtype=torch.float32)


def chat_request(tok, question: str, fmt=None, thinking=False, **body):
    """A chat body's prompt and params as `dsv4 serve` and `dsv4 batch` parse it (the response format rendered
    into the prompt as DSV4's template renders it)."""
    body = {"messages": [{"role": "user", "content": question}], **body}
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": fmt}}
    parser = BodyParser(tok, SamplingParams(temperature=0, max_tokens=160), 1024, BodyRules(thinking=thinking))
    req = parser.parse(body, True)
    return req.prompt_ids, req.params


def answer(seq: Sequence, thinking: bool) -> str:
    return parse_completion(seq.text, thinking)["content"]


# ---- the engine ------------------------------------------------------------------------------------

@torch.no_grad()
@pytest.mark.parametrize("kind", ["dspark", "mtp"])
def test_constrained_greedy_is_the_same_with_drafts_as_without(kind, tok, dspark, mtp_model):
    """Four requests (one thinking: its reasoning free, the answer after </think> constrained) through 3 slots
    (so one joins later), plain and at every draft depth: token for token the same, every answer valid JSON of
    the schema, and the drafts the grammar forced accepted (acceptance well above what unforced drafts of
    JSON get from this model)."""
    model, depths = (dspark, (1, 5, "auto")) if kind == "dspark" else (mtp_model, (1, 3))
    requests = [chat_request(tok, q, CITY, thinking=i == 3) for i, q in enumerate(QUESTIONS)]
    params = [p for _, p in requests]
    assert params[3].grammar.after == tok.special_ids["</think>"] and params[0].grammar.after is None

    def run(mtp):
        eng = Engine(model, tok, EngineOptions(max_batch=3, max_seq_len=1024, drafts=mtp))
        seqs = [eng.submit(ids, p) for ids, p in requests]
        while eng.has_work():
            eng.step()
        return seqs, eng

    plain, _ = run(0)
    for seq, thinking in zip(plain, [False, False, False, True]):
        assert seq.finish_reason == "stop", seq.text
        jsonschema.validate(json.loads(answer(seq, thinking)), CITY)
    assert parse_completion(plain[3].text, True)["reasoning_content"]        # it reasoned, freely
    for mtp in depths:
        seqs, eng = run(mtp)
        assert [s.output_ids for s in seqs] == [s.output_ids for s in plain], mtp
        assert eng.constraints.forced > 0 and eng.totals.acceptance_rate > 0.3, (mtp, eng.totals.acceptance_rate)


@torch.no_grad()
def test_sampled_constrained_tokens_follow_the_masked_distribution(tok):
    """Three sampled tokens of 1,000 seeded requests under a grammar, with DSpark drafting 5 a step: the first
    follows the model's distribution masked to what the grammar allows first (four special tokens); the second
    is forced (" says": the only token llguidance allows for forced text, which replaces the first draft with a
    one-hot q); the third, verified against a draft DSpark drew after its own first draft, not the forced one,
    follows the masked distribution after the two (chi-square). A random model: its distributions are spread."""
    model = random_model(tiny_dspark_config(vocab_size=tok.vocab_size), seed=0)
    grammar = text_grammar('start: (<[3]> | <[4]> | <[5]> | <[8]>) " says " /[a-z]+/', tok, tok.vocab_size, False)
    prompt = tok.encode("Once upon a time")
    params = [SamplingParams(temperature=1.5, seed=s, max_tokens=3, grammar=grammar) for s in range(1000)]
    eng = Engine(model, tok, EngineOptions(max_batch=16, max_seq_len=64, drafts=5))
    seqs = [eng.submit(prompt, p) for p in params]
    while eng.has_work():
        eng.step()
    assert eng.constraints.forced > 900 and eng.totals.accepted_tokens > 1000     # (a draft may be right already)

    def masked(prefix: list[int]) -> torch.Tensor:
        matcher = new_matcher(tok, tok.vocab_size, grammar)
        assert matcher.try_consume_tokens(prefix) == len(prefix)
        bits = torch.tensor(list(matcher.compute_bitmask()), dtype=torch.uint8)
        allowed = ((bits[:, None] >> torch.arange(8)) & 1).flatten()[: tok.vocab_size].bool()
        logits = model(torch.tensor([prompt + prefix]))[0, -1] / 1.5
        return logits.masked_fill(~allowed, float("-inf")).softmax(-1)

    first = torch.tensor([s.output_ids[0] for s in seqs])
    top = int(first.mode().values)
    says = tok.encode(" says")
    assert all(s.output_ids[1:2] == says for s in seqs)
    third = torch.tensor([s.output_ids[2] for s in seqs if s.output_ids[0] == top])
    for samples, want in ((first, masked([])), (third, masked([top, *says]))):
        assert (want > 0.02).sum() >= 3                                     # a distribution worth testing
        counts, expected = torch.bincount(samples, minlength=len(want)).double(), want.double() * samples.numel()
        assert counts[want == 0].sum() == 0                                 # nothing the grammar forbids
        big = expected >= 5
        stat = (((counts - expected) ** 2) / expected)[big].sum() + \
            (counts[~big].sum() - expected[~big].sum()) ** 2 / expected[~big].sum().clamp(min=1e-9)
        bins = int(big.sum())
        assert stat < bins + 3.3 * math.sqrt(2 * bins), (stat, bins)        # about the 99.9% quantile


@torch.no_grad()
def test_one_host_read_per_masked_step(tok, dspark, monkeypatch):
    """A masked step (its drafts in the packed tensor, the masks computed beside it) reads the host once, plus,
    on the CPU, once per MoE call that reads its routing on the host (not on a paired or widened stack)."""
    moe_calls, static = [], []
    monkeypatch.setattr(cpu, "routed_experts", spy(cpu.routed_experts, moe_calls))
    monkeypatch.setattr(cpu, "grouped_experts", spy(cpu.grouped_experts, moe_calls))
    monkeypatch.setattr(cpu, "wide_grouped_experts", spy(cpu.wide_grouped_experts, static))
    eng = Engine(dspark, tok, EngineOptions(max_batch=2, max_seq_len=512, drafts=3))
    for question in QUESTIONS[:2]:
        ids, params = chat_request(tok, question, CITY)
        eng.submit(ids, params)
    while eng.waiting or eng.prefilling:             # the prompts (with the schema) take a few prefill steps
        eng.step()
    syncs = []
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
            m.setattr(torch.Tensor, name, spy(getattr(torch.Tensor, name), syncs, name))
        for _ in range(3):
            syncs.clear()
            moe_calls.clear()
            static.clear()
            eng.step()
            assert syncs == ["tolist"] * (1 + len(moe_calls) - len(static)), syncs
    assert eng.constraints.calls >= 4


@torch.no_grad()
def test_a_dead_end_ends_the_request_with_finish_reason_constraint(tok, dspark):
    """A grammar with no way on after 3 tokens (40 letters are wanted; llguidance then allows only the end):
    the request ends there with finish reason "constraint", without the end token, with drafts as without."""
    grammar = Grammar(json.dumps({"grammars": [{"lark_grammar": "start: /[a-z]{40}/"}], "max_tokens": 3}))
    assert grammar.problem(tok, dspark.cfg.vocab_size) is None
    outs = []
    for mtp in (0, 3, "auto"):
        eng = Engine(dspark, tok, EngineOptions(max_batch=2, max_seq_len=256, drafts=mtp))
        seq = eng.generate([tok.encode("hello there")], SamplingParams(temperature=0, max_tokens=20,
                                                                       grammar=grammar))[0]
        assert seq.finish_reason == "constraint" and len(seq.output_ids) == 3 and seq.text.isalpha()
        outs.append(seq.output_ids)
    assert outs[0] == outs[1] == outs[2]


@torch.no_grad()
def test_unconstrained_requests_and_steps_are_untouched(tok, dspark):
    """Beside a constrained request an unconstrained one gives the tokens it gives alone, and once no
    constrained request commits, the steps are unmasked ones again (the same key as without grammars)."""
    ids, params = chat_request(tok, QUESTIONS[0], CITY)
    free = tok.encode("Once upon a time")
    alone = Engine(dspark, tok, EngineOptions(max_batch=2, max_seq_len=1024, drafts=3)).generate(
        [free], SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))[0].output_ids
    eng = Engine(dspark, tok, EngineOptions(max_batch=2, max_seq_len=1024, drafts=3))
    keys, run = [], eng.runner.run
    eng.runner.run = lambda key, *chunks, **kw: keys.append(key) or run(key, *chunks, **kw)
    constrained = eng.submit(ids, params)
    unconstrained = eng.submit(free, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))
    while eng.has_work():
        eng.step()
    assert unconstrained.output_ids == alone
    # prefill chunks commit nothing (unmasked), then masked steps while the constrained request commits, then not
    masked = "".join("m" if k.sampling.masked else "." for k in keys)
    assert re.fullmatch(r"\.+m+\.+", masked), masked
    assert len(constrained.output_ids) < 80                  # it ended first: the later steps had no grammar


@torch.no_grad()
@pytest.mark.skipif(platforms.get("cpu").compile_unavailable_reason() is not None, reason="no C++ compiler")
def test_the_compiled_step_masks_as_the_eager_one(tok, tmp_path, monkeypatch):
    """A constrained request through compiled steps (the masks awaited inside the graph, a custom op): the eager
    tokens, valid JSON, no step eager, no recompile; a later engine loads the saved masked steps."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))      # a cold cache: this test compiles
    cfg = tiny_config(num_hidden_layers=2, compress_ratios=[4, 128, 0], hc_sinkhorn_iters=3, vocab_size=tok.vocab_size)
    model = random_model(cfg, seed=3).prepare()
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"enum": ["x", "yy"]}}, "required": ["a", "b"]}
    params = SamplingParams(temperature=0, max_tokens=30, grammar=json_grammar(schema, tok, tok.vocab_size, False))
    want = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=512, drafts=2)).generate([[5, 6, 7, 8, 9]],
                                                                                                params)[0]
    jsonschema.validate(json.loads(want.text), schema)
    for how in ("compiled", "loaded"):
        engine = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=512, drafts=2, compile=True))
        assert engine.generate([[5, 6, 7, 8, 9]], params)[0].output_ids == want.output_ids
        assert all(k.sampling.masked for k in engine.compiled.ready) and len(engine.compiled.ready) == 2
        assert {b[0] for b in engine.compiled.built.values()} == {how}
        assert engine.compiled.eager_steps == 0 and engine.compiled.recompiles == 0


# ---- grammars --------------------------------------------------------------------------------------

def test_tool_call_grammar_takes_the_offered_calls_and_nothing_else(tok):
    """The DSML of a call (as DSV4's template renders one) of an offered tool, arguments fitting its schema:
    required takes one or more calls of any tool (one without parallel calls), a named function one call of it,
    auto the calls or the answer; a missing required argument, an unknown tool or text before the calls is
    refused."""
    from dsv4cli.encoding import _render_tool_calls

    def call(name, **args):
        return {"function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}

    def takes(grammar, text):
        ids = tok.encode(text) + [tok.eos_id]
        matcher = new_matcher(tok, tok.vocab_size, grammar)
        return matcher.try_consume_tokens(ids) == len(ids) - 1 and matcher.is_accepting()

    weather = call("get_weather", city='Pa"ris\nFrance é', days=3, unit="f", options={"hourly": True})
    both = _render_tool_calls([weather, call("now")])
    required = tool_grammar([WEATHER, NOW], "required", tok, tok.vocab_size, False)
    named = tool_grammar([WEATHER, NOW], {"type": "function", "function": {"name": "now"}}, tok, tok.vocab_size,
                         False)
    auto = tool_grammar([WEATHER, NOW], "auto", tok, tok.vocab_size, False, CITY)
    assert takes(required, both) and takes(required, _render_tool_calls([call("now")]))
    assert takes(named, _render_tool_calls([call("now")])) and not takes(named, both)
    assert takes(auto, both) and takes(auto, '{"city": "Rome", "population": 3, "tags": []}')
    for choice, answer in (("required", None), ("auto", CITY)):         # parallel_tool_calls false: one call
        one = tool_grammar([WEATHER, NOW], choice, tok, tok.vocab_size, False, answer, parallel=False)
        assert takes(one, _render_tool_calls([call("now")])) and takes(one, _render_tool_calls([weather]))
        assert not takes(one, both)
    assert not takes(required, _render_tool_calls([call("get_weather", days=3)]))          # city missing
    assert not takes(required, _render_tool_calls([call("get_weather", city="x", days=9)]))     # days > 7
    assert not takes(required, _render_tool_calls([call("get_time")]))
    assert not takes(required, "Sure." + both)
    parsed = parse_completion(both, False)["tool_calls"]
    assert json.loads(parsed[0]["function"]["arguments"]) == json.loads(weather["function"]["arguments"])


@pytest.mark.parametrize("bad, says", [
    ({"type": "strin"}, "Invalid type"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "Unimplemented keys"),
    ({"type": "integer", "minimum": 5, "maximum": 3}, "Unsatisfiable"),
    ({"$ref": "#/$defs/missing"}, "does not exist")])
def test_a_schema_that_cannot_constrain_is_one_message(bad, says, tok):
    with pytest.raises(ValueError, match=says) as e:
        json_grammar(bad, tok, tok.vocab_size, False)
    assert "\n" not in str(e.value)


ENDLESS = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}


@pytest.mark.parametrize("schema, ends", [
    (ENDLESS, False),
    ({"properties": {"x": {"$ref": "#"}}}, True),                                   # x may be left out
    ({"type": ["object", "null"], "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, True),    # {"x": null}
    ({"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]},
     True),                                                                          # a tree: kids may be []
    ({"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}},
      "required": ["kids"]}, False),
    ({"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                "b": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}}, "$ref": "#/$defs/a"}, True),
    ({"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                "b": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}, False)])
def test_a_schema_only_recursion_satisfies_is_refused(schema, ends, tok):
    """A schema no finite value matches (a required property, item or branch that only its own recursion
    satisfies) is refused, as a response format and as a forced tool's parameters; recursion with a way out
    is not."""
    tool = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    if ends:
        json_grammar(schema, tok, tok.vocab_size, False)
        if schema.get("type", "object") == "object":            # a tool's parameters are an object
            tool_grammar(tool, "required", tok, tok.vocab_size, False)
        return
    with pytest.raises(ValueError, match="no finite JSON value"):
        json_grammar(schema, tok, tok.vocab_size, False)
    with pytest.raises(ValueError, match="f: its parameters: no finite JSON value"):
        tool_grammar(tool, "required", tok, tok.vocab_size, False)
    with pytest.raises(ValueError, match="no finite JSON value"):
        tool_grammar(tool, "auto", tok, tok.vocab_size, False, schema)


def test_a_grammar_that_allows_no_token_is_refused(tok):
    for text in ("[^\\s\\S]", "start: <[5]> <[5]>\n%llguidance {}\nstart: foo"):
        with pytest.raises(ValueError):
            text_grammar(text, tok, tok.vocab_size, False)
    with pytest.raises(ValueError, match="allows no token"):
        text_grammar("[^\\s\\S]", tok, tok.vocab_size, False)
    assert text_grammar("start: /[0-9]+/ \"!\"", tok, tok.vocab_size, True).after == tok.special_ids["</think>"]


# ---- streaming tool calls --------------------------------------------------------------------------

ARGUMENTS = [{"city": 'He said "hi"\nthen </b> left', "days": 2},
             {"query": {"nested": [1, {"deep": "x"}], "flag": None}, "text": "naïve café – 東京 😀"}]
MARKUP = ("DSML", "｜", "<invoke", "parameter", "tool_calls", "</")


def dsml(calls: list[tuple[str, dict]], before: str = "I will look.", opening: str = TOOL_CALLS_OPENING) -> str:
    """Tool calls as DSV4 writes them: strings as text (string="true"), other values as JSON."""
    invokes = []
    for name, args in calls:
        params = [f'<{DSML}parameter name="{k}" string="true">{v}</{DSML}parameter>' if isinstance(v, str) else
                  f'<{DSML}parameter name="{k}" string="false">{json.dumps(v, ensure_ascii=False)}</{DSML}parameter>'
                  for k, v in args.items()]
        invokes.append(f'<{DSML}invoke name="{name}">\n' + "\n".join(params) + f"\n</{DSML}invoke>")
    return before + opening + "\n" + "\n".join(invokes) + "\n" + TOOL_CALLS_END


def streamed(tok, text: str, finish: str = "stop", step: int = 1) -> list[dict]:
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER], "stream": True}
    req = BodyParser(tok, SamplingParams(), 4096).parse(body, chat=True, server=True)
    stream = ChunkStream(req, tok, "tiny", "7")
    chunks = stream.first()
    for i in range(0, len(text), step):
        chunks += stream.update(text[i:i + step], [])
    return chunks + stream.finish(Sequence("x", [0], req.params, 0, output_ids=[1], text=text, finish_reason=finish))


@pytest.mark.parametrize("step", [1, 3, 7])
def test_tool_call_arguments_stream_as_they_are_written(tok, step):
    """Two calls whose arguments hold quotes, newlines, a closing-tag look-alike, nested JSON and non-ASCII, fed
    a few characters at a time: content is the text before the calls; each call's id and name come once, then
    its arguments in several deltas that join into the whole arguments; no delta holds any markup."""
    from openai.types.chat import ChatCompletionChunk

    calls = [("get_weather", ARGUMENTS[0]), ("search", ARGUMENTS[1])]
    chunks = [ChatCompletionChunk.model_validate(c) for c in streamed(tok, dsml(calls), step=step)]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    deltas = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert content == "I will look."
    for i, (name, args) in enumerate(calls):
        mine = [d for d in deltas if d.index == i]
        assert len(mine) > 3 and mine[0].id == f"call_7_{i}" and mine[0].function.name == name
        assert all(d.id is None and d.function.name is None for d in mine[1:])
        joined = "".join(d.function.arguments for d in mine)
        assert json.loads(joined) == args
        assert all(m not in d.function.arguments for d in mine for m in ("DSML", "｜", "parameter>"))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_cut_off_or_untidy_call_never_shows_markup(tok):
    """A reply cut off inside a string argument at every character: the arguments so far are a prefix of the
    whole ones and hold no markup; a block opened without its blank line still ends the content."""
    text = dsml([("get_weather", ARGUMENTS[0])])
    block = text.partition(TOOL_CALLS_OPENING)[2]
    whole = tool_calls_so_far(block)[0]["arguments"]
    for n in range(len(block)):
        for call in tool_calls_so_far(block[:n]):
            assert whole.startswith(call["arguments"]) and not any(m in call["arguments"] for m in MARKUP[:3])
    untidy = parse_completion(dsml([("now", {})], before="Sure", opening=TOOL_CALLS_OPENING.lstrip("\n")), False)
    assert untidy["content"] == "Sure" and untidy["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}
    chunks = streamed(tok, text[: text.index("left")], finish="length")
    args = "".join(t["function"]["arguments"] for c in chunks for t in c["choices"][0]["delta"].get("tool_calls", []))
    assert args == '{"city": "He said \\"hi\\"\\nthen </b> ' and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_streamed_and_whole_replies_agree_at_the_edges(tok):
    """A call cut by max_tokens: the body has it with the arguments so far, as they streamed, finish reason
    length; with ignore_eos the reply goes on past an EOS in both forms; a reasoning effort alone turns thinking
    on (an effort means "reason") but for Anthropic's, which shapes a reply without turning thinking on."""
    def both(text: str, finish: str, **fields) -> tuple[list[dict], dict]:
        body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER], **fields}
        req = BodyParser(tok, SamplingParams(), 4096).parse(body | {"stream": True}, chat=True, server=True)
        seq = Sequence("x", [0], req.params, 0, [1], text, finish_reason=finish)
        stream = ChunkStream(req, tok, "tiny", "7")
        chunks = stream.first() + stream.update(text, []) + stream.finish(seq)
        whole = BodyParser(tok, SamplingParams(), 4096).parse(body, True, server=True)
        return chunks, completion(whole, seq, "tiny", tok, "7")["choices"][0]

    text = dsml([("get_weather", ARGUMENTS[0])])
    chunks, whole = both(text[: text.index("left")], "length")
    args = "".join(t["function"]["arguments"] for c in chunks for t in c["choices"][0]["delta"].get("tool_calls", []))
    assert whole["message"]["tool_calls"][0]["function"]["arguments"] == args
    assert args == '{"city": "He said \\"hi\\"\\nthen </b> '
    assert whole["finish_reason"] == "length" and whole["message"]["content"] == "I will look."
    eos = tok.decode([tok.eos_id])
    for ignore_eos, want in ((True, "Hi there. And more."), (False, "Hi there.")):
        chunks, whole = both(f"Hi there.{eos} And more.", "length", ignore_eos=ignore_eos)
        streamed_text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert whole["message"]["content"] == streamed_text == want
    parser = BodyParser(tok, SamplingParams(), 4096)
    ask = {"messages": [{"role": "user", "content": "Hi"}]}
    assert parser.parse(ask | {"reasoning_effort": "high"}, True).thinking
    assert not parser.parse(ask | {"reasoning_effort": "high", "thinking": False}, True).thinking
    assert not parser.parse(ask, True).thinking
    effort = {"max_tokens": 8, "messages": ask["messages"], "output_config": {"effort": "high"}}
    assert not anthropic.parse(parser, effort).thinking
    assert anthropic.parse(parser, effort | {"thinking": {"type": "enabled", "budget_tokens": 1024}}).thinking


# ---- the front ends --------------------------------------------------------------------------------

def dsv4(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsv4cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=300)


def test_generate_json_schema_and_grammar(tmp_path):
    """--json-schema: the answer is JSON of the schema, after free reasoning with --thinking; --grammar: a
    regular expression or a Lark grammar; a bad schema, a grammar no token can start, or both flags: one
    `error:` line, exit 2."""
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps(CITY))
    out = dsv4("generate", "-p", QUESTIONS[0], "--json-schema", str(schema), "--temp", "0", "--thinking", "--json")
    result = json.loads(out.stdout)
    jsonschema.validate(json.loads(result["text"]), CITY)
    assert result["reasoning_content"] and result["finish_reason"] == "stop"
    regex, lark = tmp_path / "id.txt", tmp_path / "sum.lark"
    regex.write_text("[0-9]{3}-[a-z]{2,5}\n")
    lark.write_text('start: NUM " + " NUM " = " NUM\nNUM: /[0-9]{1,2}/\n')
    out = dsv4("generate", "-p", QUESTIONS[2], "--grammar", str(regex), "--temp", "0", "--drafts", "3")
    assert out.returncode == 0 and re.fullmatch("[0-9]{3}-[a-z]{2,5}\n", out.stdout), out.stdout
    out = dsv4("generate", "-p", QUESTIONS[2], "--grammar", str(lark), "--temp", "0")
    assert out.returncode == 0 and re.fullmatch(r"\d{1,2} \+ \d{1,2} = \d{1,2}\n", out.stdout)
    bad, empty = tmp_path / "bad.json", tmp_path / "empty.txt"
    bad.write_text(json.dumps({"type": "object", "properties": {"a": {"not": {}}}}))
    empty.write_text("[^\\s\\S]")
    for args, says in ((["--json-schema", str(bad)], "Unimplemented keys"),
                       (["--grammar", str(empty)], "allows no token"),
                       (["--json-schema", str(schema), "--grammar", str(regex)], "give one of them"),
                       (["--json-schema", str(regex)], "not JSON")):
        out = dsv4("generate", "-p", "Hi", *args)
        assert out.returncode == 2 and out.stderr.startswith("error: ") and says in out.stderr, out.stderr
        assert len(out.stderr.splitlines()) == 1


def test_batch_answers_fit_their_schemas_and_tool_calls_their_tools(tmp_path):
    """`dsv4 batch`, sampled, DSpark drafting: 20 requests over the 10 schemas of benchmarks/structured.py all
    parse and validate; 6 forced tool calls (required, and each tool by name) are calls of an offered tool, the
    named one when named, with valid arguments; an invalid schema, an unsupported keyword, a named tool not
    offered and ignore_eos with a response format are error records naming the field; the run goes on."""
    lines = schema_requests(20, 300) + tool_requests(6, 300)
    bad = [{"custom_id": "bad-type", "body": {"messages": [{"role": "user", "content": "Hi"}], "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}},
           {"custom_id": "bad-keyword", "body": {"messages": [{"role": "user", "content": "Hi"}], "response_format": {
               "type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}}},
           {"custom_id": "bad-tool", "body": {"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS,
                                              "tool_choice": {"type": "function", "function": {"name": "fly"}}}},
           {"custom_id": "bad-eos", "body": {"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True,
                                             "response_format": {"type": "json_object"}}}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"method": "POST", "url": "/v1/chat/completions", **line}) + "\n"
                           for line in lines + bad))
    done = dsv4("batch", str(src), "-o", str(out), "--mtp", "auto", "--temperature", "0.8", "--seed", "1")
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    errors = {r["custom_id"]: r["error"]["message"] for r in records if r["error"]}
    assert errors.keys() == {"bad-type", "bad-keyword", "bad-tool", "bad-eos"}
    assert errors["bad-eos"].startswith("body.ignore_eos: not with response_format")
    assert errors["bad-type"].startswith("body.response_format: Invalid type")
    assert errors["bad-keyword"].startswith("body.response_format: Unimplemented keys")
    assert errors["bad-tool"].startswith("body.tool_choice: 'fly' is not one of the offered tools")
    checked = check_answers([r for r in records if not r["error"]], {line["custom_id"]: line for line in lines})
    assert checked["valid"] == len(lines), checked


def test_chat_format_setting(tmp_path):
    """/set format json-schema FILE constrains the next answers (one JSON line each, on a pipe); a format it
    cannot make is one error line and leaves the format as it was."""
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps(CITY))
    lines = [f"/set format json-schema {schema}", QUESTIONS[0], "/set format yaml", QUESTIONS[3], "/set format text",
             QUESTIONS[0]]
    out = dsv4("chat", "--temp", "0", "-n", "120", stdin="\n".join(lines) + "\n")
    replies = out.stdout.splitlines()
    assert out.returncode == 0 and len(replies) == 3, out
    for reply in replies[:2]:
        jsonschema.validate(json.loads(reply), CITY)
    assert replies[2] == "The capital of France is Paris."
    assert "error: format: must be one of: text, json, json-schema FILE, grammar FILE" in out.stderr
