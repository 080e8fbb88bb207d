"""The token-budget scheduler under load: 8 streams decode while a ~3.5k-token prompt arrives.

    python benchmarks/scheduler.py [--model PATH] [--budgets 128 256 512] [--repeat 3] [--out F]

Per budget, with the prefill chunks in the decode step's forward pass: the running streams' inter-token
gaps (time between a stream's consecutive events, each a step's committed tokens) over the steps before,
during and after the prefill, and the new request's TTFT, against the TTFT of the same prompt on an idle
engine (budget 512) measured right before each run: the shared cores change speed for seconds at a time,
so a ratio holds only between measurements taken together. With `--repeat N` every budget runs N times,
interleaved, and each figure is reported as the min and median over the runs (a busy neighbour inflates
single steps, so the worst gap is the noisiest figure).
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from meta import stamp

from dsv4cli.bench import LOAD_TEXT, first_token_s, under_load
from dsv4cli.config import BUNDLED_MODEL_DIR
from dsv4cli.engine import Engine
from dsv4cli.model import load_model
from dsv4cli.tokenizer import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(BUNDLED_MODEL_DIR))
    ap.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--prompt-tokens", type=int, default=3500)
    ap.add_argument("--mtp", type=int, default=1)
    ap.add_argument("--around", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(args.model, "cpu", torch.float32), Tokenizer.from_dir(args.model)
    ids = tok.encode(LOAD_TEXT * (args.prompt_tokens // 10))
    prompt = ids[: args.prompt_tokens]
    streams = [tok.encode(f"Story {i}: " + LOAD_TEXT) for i in range(8)]
    result = {"meta": stamp(vars(args)),
              "prompt_tokens": len(prompt), "streams": len(streams), "mtp": args.mtp, "threads": 1,
              "prefill_chunk": 256, "repeat": args.repeat, "budgets": {}}
    idle_engine = Engine(model, tok, max_batch=9, max_seq_len=4608, mtp=args.mtp, prefill_budget=512)
    first_token_s(idle_engine, streams[0][:8])                                 # warm-up
    with torch.no_grad():
        runs = {b: [] for b in args.budgets}
        for _ in range(args.repeat):
            for budget in args.budgets:
                idle = first_token_s(idle_engine, prompt)
                engine = Engine(model, tok, max_batch=9, max_seq_len=4608, mtp=args.mtp, prefill_budget=budget)
                run = under_load(engine, streams, prompt, args.around)
                run.update(idle_ttft_s=idle, ttft_vs_idle=run["ttft_s"] / idle)
                runs[budget].append(run)
                print(budget, json.dumps(run), file=sys.stderr, flush=True)
    for budget, rs in runs.items():
        result["budgets"][budget] = {f"{key}_{name}": f([r[key] for r in rs]) for key in rs[0]
                                     for name, f in (("min", min), ("median", statistics.median))}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
