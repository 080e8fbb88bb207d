"""The token-budget scheduler under load: 8 streams decode while a ~3.5k-token prompt arrives.

    python benchmarks/scheduler.py [--model PATH] [--budgets 128 256 512] [--out scheduler.json]

Per budget: the running streams' inter-token gaps (time between a stream's consecutive events, each a
step's committed tokens) over the steps before, during and after the prefill, and the new request's
TTFT, against the TTFT of the same prompt on an idle engine with the default budget (512).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dsv4cli.config import BUNDLED_MODEL_DIR
from dsv4cli.engine import Engine, SamplingParams
from dsv4cli.model import load_model
from dsv4cli.tokenizer import Tokenizer

TEXT = "Once upon a time, a little fox named Ben lived by the river. Every morning he looked for berries. "


def ttft(engine: Engine, prompt: list[int]) -> float:
    seq = engine.submit(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while not seq.output_ids:
        engine.step()
    return seq.metrics.ttft


def under_load(engine: Engine, streams: list[list[int]], prompt: list[int], around: int) -> dict:
    """`around` decode steps before the prompt arrives and after its first token."""
    params = SamplingParams(temperature=0, max_tokens=engine.max_seq_len, ignore_eos=True)
    running = [engine.submit(p, params) for p in streams]
    while any(not s.output_ids for s in running):
        engine.step()
    times = {s.id: [] for s in running}

    def step() -> None:
        events = engine.step()
        now = time.perf_counter()
        for e in events:
            if e.seq.id in times:
                times[e.seq.id].append(now)

    for _ in range(around):
        step()
    new = engine.submit(prompt, SamplingParams(temperature=0, max_tokens=around, ignore_eos=True))
    steps = 0
    while not new.output_ids:
        step()
        steps += 1
    for _ in range(around):
        step()
    for s in running:
        engine.cancel(s)
    gaps = [b - a for t in times.values() for a, b in zip(t, t[1:])]
    return {"ttft_s": new.metrics.ttft, "prefill_steps": steps, "gap_max_ms": 1000 * max(gaps),
            "gap_median_ms": 1000 * statistics.median(gaps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(BUNDLED_MODEL_DIR))
    ap.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--prompt-tokens", type=int, default=3500)
    ap.add_argument("--mtp", type=int, default=1)
    ap.add_argument("--around", type=int, default=30)
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(args.model, "cpu", torch.float32), Tokenizer.from_dir(args.model)
    ids = tok.encode(TEXT * (args.prompt_tokens // 10))
    prompt = ids[: args.prompt_tokens]
    streams = [tok.encode(f"Story {i}: " + TEXT) for i in range(8)]
    result = {"prompt_tokens": len(prompt), "streams": len(streams), "mtp": args.mtp, "threads": 1,
              "prefill_chunk": 256, "budgets": {}}
    idle_engine = Engine(model, tok, max_batch=9, max_seq_len=4608, mtp=args.mtp)
    ttft(idle_engine, streams[0][:8])                                 # warm-up
    idle = min(ttft(idle_engine, prompt) for _ in range(3))
    for budget in args.budgets:
        engine = Engine(model, tok, max_batch=9, max_seq_len=4608, mtp=args.mtp, prefill_budget=budget)
        run = under_load(engine, streams, prompt, args.around)
        run.update(gap_max_vs_median=run["gap_max_ms"] / run["gap_median_ms"])
        result["budgets"][budget] = run
        print(budget, json.dumps(run), file=sys.stderr, flush=True)
    # the machine's cores are shared: the idle TTFT again after the runs, the best of both
    result["idle_ttft_s"] = idle = min(idle, min(ttft(idle_engine, prompt) for _ in range(3)))
    for run in result["budgets"].values():
        run["ttft_vs_idle"] = run["ttft_s"] / idle
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
