"""Structured output on the bundled model: the issue's targets, measured.

`targets`: 200 chat requests (10 JSON schemas x 20 questions, the schema as `response_format`) through
`dsv4 batch` at --mtp 0 and auto, greedy and sampled: how many answers parse and validate (jsonschema), and
their finish reasons; 40 forced tool calls (tool_choice required and named, greedy and sampled): how many
are well-formed calls of an offered tool whose arguments validate.

`speed`: decode tokens/s of requests constrained by a JSON schema against unconstrained requests of the same
lengths (each generates, ignoring EOS, as many tokens as its constrained twin did), and of requests under a
grammar that allows every token against the same requests unconstrained (the same tokens: what masking costs
by itself), interleaved, at batch 1 and 8, eager and compiled (compiled in the foreground first), plain and
with drafts; the masks' time per masked call (computing them on the worker thread, and what the step waited
for them); the drafters' acceptance with and without the constraint (DSpark on dsv4-tiny, the MTP layer on
dsv4-tiny-mtp).

    python benchmarks/structured.py targets --out benchmarks/results/structured-targets-cpu.json
    python benchmarks/structured.py speed --out benchmarks/results/structured-speed-cpu-1thread.json
"""
import argparse
import collections
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Every string, array and number bounded (maxLength, a pattern of bounded length, an enum, maxItems,
# integer ranges): the bundled model writes nonsense, which only bounds close; a real model closes them itself.
SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age", "email"],
               "properties": {"name": {"type": "string", "maxLength": 16},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120},
                              "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}}},
    "city": {"type": "object", "additionalProperties": False, "required": ["city", "country", "population"],
             "properties": {"city": {"enum": ["Paris", "Rome", "Madrid", "Tokyo", "Cairo"]},
                            "country": {"type": "string", "maxLength": 12},
                            "population": {"type": "integer", "minimum": 0, "maximum": 40000000}}},
    "order": {"type": "object", "additionalProperties": False, "required": ["id", "items"],
              "properties": {"id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
                             "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                                 "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                                 "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                                                "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}}}},
    "weather": {"type": "object", "additionalProperties": False, "required": ["city", "unit", "temps"],
                "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]},
                               "temps": {"type": "array", "minItems": 1, "maxItems": 5,
                                         "items": {"type": "integer", "minimum": -30, "maximum": 50}}}},
    "colour": {"type": "object", "additionalProperties": False, "required": ["name", "hex", "dark"],
               "properties": {"name": {"enum": ["red", "green", "blue", "yellow", "orange", "white"]},
                              "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}, "dark": {"type": "boolean"}}},
    "sum": {"type": "object", "additionalProperties": False, "required": ["a", "b", "result", "correct"],
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 100},
                           "b": {"type": "integer", "minimum": 0, "maximum": 100},
                           "result": {"type": "integer", "minimum": 0, "maximum": 200},
                           "correct": {"type": "boolean"}}},
    "story": {"type": "object", "additionalProperties": False, "required": ["title", "mood", "words", "tags"],
              "properties": {"title": {"type": "string", "maxLength": 20},
                             "mood": {"enum": ["happy", "sad", "calm"]},
                             "words": {"type": "integer", "minimum": 1, "maximum": 500},
                             "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 8}}}},
    "account": {"type": "object", "additionalProperties": False, "required": ["user", "active"],
                "properties": {"active": {"type": "boolean"}, "user": {
                    "type": "object", "additionalProperties": False, "required": ["name", "address"],
                    "properties": {"name": {"type": "string", "maxLength": 12}, "address": {
                        "type": "object", "additionalProperties": False, "required": ["street", "zip"],
                        "properties": {"street": {"type": "string", "maxLength": 16},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}}},
    "task": {"type": "object", "additionalProperties": False, "required": ["title"],
             "properties": {"title": {"type": "string", "maxLength": 10}, "note": {"type": "string", "maxLength": 10},
                            "priority": {"type": "integer", "minimum": 1, "maximum": 5}}},
    "verdict": {"type": "object", "additionalProperties": False, "required": ["answer", "reasons", "source"],
                "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                               "reasons": {"type": "array", "maxItems": 2,
                                           "items": {"type": "string", "maxLength": 12}},
                               "source": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "null"}]}}},
}
# the bundled model's kinds of questions (capitals, colours, sums, stories, animals, greetings)
QUESTIONS = [f"What is the capital of {c}?" for c in ("France", "Spain", "Italy", "Japan", "Egypt")] + \
            [f"What is {a} plus {b}?" for a, b in ((3, 4), (7, 12), (9, 9), (5, 11))] + \
            [f"What colour is {x}?" for x in ("the sky", "grass", "snow", "a banana")] + \
            ["What is the opposite of hot?", "What sound does a cat make?", "Hello!", "Tell me a story.",
             "Tell me about a fox.", "Good morning!", "What does a cow say?"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": {
             "type": "object", "required": ["city", "days"], "additionalProperties": False,
             "properties": {"city": {"type": "string", "maxLength": 12},
                            "days": {"type": "integer", "minimum": 1, "maximum": 7}, "unit": {"enum": ["c", "f"]}}}}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
             "type": "object", "required": ["a", "b"], "additionalProperties": False,
             "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                            "b": {"type": "integer", "minimum": 0, "maximum": 999}}}}}]


def schema_requests(n: int, max_tokens: int) -> list[dict]:
    """n batch lines: question i with schema i % 10 as its response format."""
    names = list(SCHEMAS)
    return [{"custom_id": f"{names[i % len(names)]}-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                      "max_tokens": max_tokens, "response_format": {
                          "type": "json_schema", "json_schema": {"name": names[i % len(names)], "strict": True,
                                                                 "schema": SCHEMAS[names[i % len(names)]]}}}}
            for i in range(n)]


def tool_requests(n: int, max_tokens: int) -> list[dict]:
    """n batch lines forcing a tool call: required (any offered tool) and each tool by name, in turn."""
    choices = ["required", *({"type": "function", "function": {"name": t["function"]["name"]}} for t in TOOLS)]
    return [{"custom_id": f"tool-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], "tools": TOOLS,
                      "tool_choice": choices[i % len(choices)], "max_tokens": max_tokens}} for i in range(n)]


def check_answers(records: list[dict], lines: dict[str, dict]) -> dict:
    """How many results parse and validate against their request's schema (or, for forced tool calls, are
    calls of an offered tool, the named one when named, with valid arguments); finish reasons."""
    import jsonschema

    valid, reasons, bad = 0, {}, []
    for r in records:
        body, choice = lines[r["custom_id"]]["body"], (r["response"] or {}).get("body", {}).get("choices", [{}])[0]
        reasons[choice.get("finish_reason")] = reasons.get(choice.get("finish_reason"), 0) + 1
        message = choice.get("message", {})
        try:
            if "tools" in body:
                calls = message["tool_calls"]
                tools = {t["function"]["name"]: t["function"]["parameters"] for t in body["tools"]}
                wanted = body["tool_choice"]["function"]["name"] if isinstance(body["tool_choice"], dict) else None
                assert calls and all(wanted in (None, c["function"]["name"]) for c in calls)
                for c in calls:
                    jsonschema.validate(json.loads(c["function"]["arguments"]), tools[c["function"]["name"]])
            else:
                jsonschema.validate(json.loads(message["content"]), body["response_format"]["json_schema"]["schema"])
            valid += 1
        except (AssertionError, KeyError, TypeError, ValueError, jsonschema.ValidationError) as e:
            bad.append({"custom_id": r["custom_id"], "error": f"{type(e).__name__}: {e}"[:200]})
    return {"requests": len(lines), "answered": len(records), "valid": valid, "finish_reasons": reasons,
            "invalid": bad[:5]}


def batch_run(lines: list[dict], args: list[str]) -> tuple[list[dict], float, str]:
    """`dsv4 batch` over the lines with extra flags: its records, wall seconds and summary line."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
        src.write_text("".join(json.dumps(line) + "\n" for line in lines))
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "dsv4cli", "batch", str(src), "-o", str(out), *args],
                              capture_output=True, text=True, cwd=ROOT)
        seconds = time.perf_counter() - t0
        if done.returncode:
            raise SystemExit(f"dsv4 batch failed: {done.stderr[-2000:]}")
        records = [json.loads(line) for line in out.read_text().splitlines()]
    return records, seconds, done.stderr.strip().splitlines()[-1]


def targets(args) -> list[dict]:
    rows = []
    for mtp in ("0", "auto"):
        for sampling in (["--temperature", "0"], ["--temperature", "0.8", "--seed", "1"]):
            for kind, lines in (("json_schema", schema_requests(args.requests, args.max_tokens)),
                                ("tool_calls", tool_requests(args.tool_requests, args.max_tokens))):
                records, seconds, summary = batch_run(lines, ["--mtp", mtp, "--max-batch", "8", *sampling])
                row = {"kind": kind, "mtp": mtp, "temperature": float(sampling[1]), "seconds": round(seconds, 1),
                       **check_answers(records, {line["custom_id"]: line for line in lines}), "summary": summary}
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    return rows


def speed(args) -> list[dict]:
    import dataclasses

    import torch

    from dsv4cli.config import resolve
    from dsv4cli.engine import SamplingParams
    from dsv4cli.loading import load_engine
    from dsv4cli.structured import json_grammar, text_grammar

    torch.set_num_threads(1)
    rows = []
    for model, mtps in ((None, args.mtp.split(",")), ("dsv4cli/assets/dsv4-tiny-mtp", ["0", "1"])):
        for compile in args.compile.split(","):
            if model is not None and compile == "on":
                continue                        # the MTP layer's acceptance, eager: enough for the comparison
            for batch in map(int, args.batch.split(",")):
                for mtp in mtps:
                    settings = dataclasses.replace(resolve(None, {"model": model} if model else {})[0],
                                                   compile=compile, max_batch=batch,
                                                   drafts=mtp if mtp == "auto" else int(mtp))
                    engine = load_engine(settings, "bench", compile_in_background=False)
                    rows.append(compare(engine, batch, compile, mtp, model or "dsv4cli/assets/dsv4-tiny", args,
                                        text_grammar, json_grammar, SamplingParams))
                    print(json.dumps({k: v for k, v in rows[-1].items() if k != "runs"}), file=sys.stderr, flush=True)
    return rows


def compare(engine, batch: int, compile: str, mtp: str, model: str, args, text_grammar, json_grammar,
            SamplingParams) -> dict:
    """Four kinds of pass over the same prompts, interleaved, after a warm-up pass of each (which compiles every
    shape when compiled): `json` (each request constrained by a schema), `twins` (unconstrained, each as many
    tokens as its json twin, ignoring EOS), `free` (unconstrained) and `any` (a grammar that allows every token:
    the same tokens as `free`, so their ratio is what the masking costs by itself)."""
    import torch

    from dsv4cli.encoding import encode_messages

    tok, vocab = engine.tok, engine.model_info.vocab_size
    prompts = [tok.encode(encode_messages([{"role": "user", "content": q}], encoding=tok.encoding))
               for q in QUESTIONS[: batch * args.rounds]]
    names = list(SCHEMAS)
    schemas = [SCHEMAS[names[i % len(names)]] for i in range(len(prompts))]
    anything = text_grammar("start: token*\ntoken: <[*]>", tok, vocab, False)
    kinds = {"json": [SamplingParams(temperature=0, max_tokens=args.max_tokens, grammar=json_grammar(s, tok, vocab,
                                                                                                      False))
                      for s in schemas],
             "free": [SamplingParams(temperature=0, max_tokens=args.max_tokens)] * len(prompts),
             "any": [SamplingParams(temperature=0, max_tokens=args.max_tokens, grammar=anything)] * len(prompts)}

    def one_pass(params):
        constraints, totals = engine.constraints, engine.totals
        before = (constraints.mask_s, constraints.wait_s, constraints.calls, constraints.forced)
        drafts0, accepted0 = totals.draft_tokens, totals.accepted_tokens
        with torch.no_grad():
            seqs = [engine.submit(p, q) for p, q in zip(prompts, params)]
            t0 = time.perf_counter()
            while engine.has_work():
                engine.step()
            seconds = time.perf_counter() - t0
        calls = constraints.calls - before[2]
        tokens = sum(len(s.output_ids) for s in seqs)
        return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
                "outputs": [s.output_ids for s in seqs],
                "acceptance": (totals.accepted_tokens - accepted0) / max(totals.draft_tokens - drafts0, 1),
                "masked_calls": calls, "forced_drafts": constraints.forced - before[3],
                "mask_ms_per_call": 1e3 * (constraints.mask_s - before[0]) / calls if calls else 0.0,
                "wait_ms_per_call": 1e3 * (constraints.wait_s - before[1]) / calls if calls else 0.0,
                "valid": sum(_valid(s.text, schema) for s, schema in zip(seqs, schemas)),
                "finish_reasons": dict(collections.Counter(s.finish_reason for s in seqs))}

    warm = {kind: one_pass(params) for kind, params in kinds.items()}
    kinds["twins"] = [SamplingParams(temperature=0, max_tokens=max(len(o), 1), ignore_eos=True)
                      for o in warm["json"]["outputs"]]
    one_pass(kinds["twins"])
    runs = {kind: [] for kind in kinds}
    for _ in range(args.repeat):
        for kind, params in kinds.items():
            runs[kind].append(one_pass(params))
    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    for v in runs.values():
        for r in v:
            del r["outputs"]
    j = runs["json"]
    compiled = getattr(engine, "compiled", None)
    return {"model": model, "compile": compile, "batch": batch, "mtp": mtp, "requests": len(prompts),
            "json_tokens": j[0]["tokens"], "json_valid": j[0]["valid"], "json_finish_reasons": j[0]["finish_reasons"],
            "any_same_tokens_as_free": warm["any"]["outputs"] == warm["free"]["outputs"],
            "tokens_per_s": {k: {"min": min(r["tokens_per_s"] for r in v), "median": med[k]} for k, v in runs.items()},
            "ratio_json_to_twins": med["json"] / med["twins"], "ratio_any_to_free": med["any"] / med["free"],
            "acceptance": {k: statistics.median(r["acceptance"] for r in v) for k, v in runs.items()},
            "mask_ms_per_call": {k: statistics.median(r["mask_ms_per_call"] for r in runs[k]) for k in ("json", "any")},
            "wait_ms_per_call": {k: statistics.median(r["wait_ms_per_call"] for r in runs[k]) for k in ("json", "any")},
            "json_step_ms": 1e3 * statistics.median(r["seconds"] for r in j) / max(j[0]["masked_calls"], 1),
            "json_forced_drafts": j[0]["forced_drafts"],
            "recompiles": compiled.recompiles if compiled is not None else None, "runs": runs}


def _valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("targets", "speed"))
    ap.add_argument("--requests", type=int, default=200, help="targets: JSON-schema requests per configuration")
    ap.add_argument("--tool-requests", type=int, default=40, help="targets: forced tool calls per configuration")
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--batch", default="1,8", help="speed: batch sizes")
    ap.add_argument("--compile", default="off,on", help="speed: eager, compiled")
    ap.add_argument("--mtp", default="0,3,auto", help="speed: drafts verified (dsv4-tiny's DSpark)")
    ap.add_argument("--rounds", type=int, default=2, help="speed: requests per pass = batch x rounds")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from meta import stamp

    rows = targets(args) if args.what == "targets" else speed(args)
    text = json.dumps({"meta": stamp(vars(args)), "results": rows}, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
