"""A batch of short requests on the bundled model with compile off and on: where prefill chunks weigh.

With many short requests a compiled engine spends much of its time in prefill: every request's prompt
runs one chunk (with the MTP layer) and then only a few decode steps, each shared by the batch. The
engine is loaded once per mode (compile in the foreground, as `bench` does); a first pass over the same
requests compiles (or loads) every step and chunk shape, the timed passes run them. Reports requests/s,
output tokens/s and the mean TTFT per pass (min / median over `--repeat` passes), each request's greedy
output, and how many are the first mode's. Runs on any tree with `load_engine` and `Engine.generate`, so
it compares commits too (PYTHONPATH). Results: JSON on stdout, or --out.
"""
import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch
from meta import stamp


def passes(mode: str, requests: int, max_tokens: int, batch: int, repeat: int) -> dict:
    from dsv4cli.config import resolve
    from dsv4cli.engine import SamplingParams
    from dsv4cli.loading import load_engine

    settings = dataclasses.replace(resolve()[0], compile=mode, max_batch=batch)
    engine = load_engine(settings, "bench", compile_in_background=False)
    base = engine.tok.encode("Once upon a time, a little fox named Ben lived by the river.")
    # prompts of 9 to 40 tokens: chunk buckets of 16, 32 and 64 rows
    prompts = [(base * 4)[: 9 + (7 * i) % 32] for i in range(requests)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with torch.no_grad():
        t0 = time.perf_counter()
        want = [s.output_ids for s in engine.generate(prompts, params)]      # compiles every shape
        warmup = time.perf_counter() - t0
        runs = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            seqs = engine.generate(prompts, params)
            dt = time.perf_counter() - t0
            assert [s.output_ids for s in seqs] == want
            runs.append({"s": dt, "requests_per_s": requests / dt,
                         "tokens_per_s": sum(len(s.output_ids) for s in seqs) / dt,
                         "ttft_ms": 1000 * statistics.mean(s.metrics.ttft for s in seqs)})
    compiled = getattr(engine, "compiled", None)
    return {"compile": mode, "warmup_s": warmup, "passes": runs,
            "requests_per_s": {"min": min(r["requests_per_s"] for r in runs),
                               "median": statistics.median(r["requests_per_s"] for r in runs)},
            "ttft_ms": {"min": min(r["ttft_ms"] for r in runs),
                        "median": statistics.median(r["ttft_ms"] for r in runs)},
            "compiled_keys": [list(k) for k in compiled.ready] if compiled is not None else [],
            "recompiles": compiled.recompiles if compiled is not None else None,
            "outputs": want}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--modes", default="off,on")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [passes(m, args.requests, args.max_tokens, args.batch, args.repeat) for m in args.modes.split(",")]
    for r in rows:         # greedy outputs against the first mode's, request by request
        r["outputs_as_first_mode"] = sum(a == b for a, b in zip(r["outputs"], rows[0]["outputs"]))
    result = {"meta": {**stamp(vars(args)),
                       "requests": args.requests, "max_tokens": args.max_tokens, "batch": args.batch,
                       "threads": 1, "torch": torch.__version__}, "results": rows}
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text, file=sys.stdout)


if __name__ == "__main__":
    main()
