"""The prefill budget under load: streams decode while prompts arrive.

    python benchmarks/scheduler.py [--model PATH] [--budgets 128 256 512] [--repeat 3] [--out F]
    python benchmarks/scheduler.py --pace [--streams 4] [--arrivals 3] [--prompt-tokens 1000] [--mtp 0 auto]

`--pace`: the budget in time (`engine/pace.py`: a chunk takes about 1.5 decode steps) against the fixed token
budget (160, `pace.share` set to infinity), alternating run by run on one loaded model, at each --mtp: the
streams' worst gap over their median and the arriving prompts' TTFT (the slowest's), min and median over
--repeat runs. Without it:

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
import math
import statistics
import sys
from pathlib import Path

import torch
from meta import stamp

from dsv4cli.bench import LOAD_TEXT, first_token_s, under_load
from dsv4cli.config import BUNDLED_MODEL_DIR
from dsv4cli.engine import Engine, EngineOptions
from dsv4cli.engine.pace import SHARE as PACE_SHARE
from dsv4cli.model import load_model
from dsv4cli.tokenizer import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(BUNDLED_MODEL_DIR))
    ap.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--prompt-tokens", type=int, default=3500)
    ap.add_argument("--mtp", nargs="+", default=["1"], help="drafts per step, or auto (--pace: several)")
    ap.add_argument("--around", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--pace", action="store_true", help="the time budget against the token budget")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--arrivals", type=int, default=1)
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(args.model, "cpu", torch.float32), Tokenizer.from_dir(args.model)
    mtps = [m if m == "auto" else int(m) for m in args.mtp]
    if args.pace:
        return pace(model, tok, args, mtps)
    args.mtp = mtps[0]
    ids = tok.encode(LOAD_TEXT * (args.prompt_tokens // 10))
    prompt = ids[: args.prompt_tokens]
    streams = [tok.encode(f"Story {i}: " + LOAD_TEXT) for i in range(8)]
    result = {"meta": stamp(vars(args)),
              "prompt_tokens": len(prompt), "streams": len(streams), "mtp": args.mtp, "threads": 1,
              "prefill_chunk": 256, "repeat": args.repeat, "budgets": {}}
    idle_engine = Engine(model, tok, EngineOptions(max_batch=9, max_seq_len=4608, drafts=args.mtp, prefill_budget=512))
    first_token_s(idle_engine, streams[0][:8])                                 # warm-up
    with torch.no_grad():
        runs = {b: [] for b in args.budgets}
        for _ in range(args.repeat):
            for budget in args.budgets:
                idle = first_token_s(idle_engine, prompt)
                engine = Engine(model, tok,
                                EngineOptions(max_batch=9, max_seq_len=4608, drafts=args.mtp, prefill_budget=budget))
                run = under_load(engine, streams, [prompt], args.around)
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


def pace(model, tok, args, mtps) -> None:
    """The time budget against the token budget, alternating run by run."""
    text = tok.encode(LOAD_TEXT * (args.prompt_tokens // 5))
    arriving = [text[i * 7: i * 7 + args.prompt_tokens] for i in range(args.arrivals)]
    streams = [tok.encode(f"Story {i}: " + LOAD_TEXT) for i in range(args.streams)]
    result = {"meta": stamp(vars(args)), "streams": args.streams, "arrivals": args.arrivals,
              "prompt_tokens": args.prompt_tokens, "budget": 160, "threads": 1, "mtp": {}}
    with torch.no_grad():
        for mtp in mtps:
            engine = Engine(model, tok,
                            EngineOptions(max_batch=args.streams + args.arrivals, max_seq_len=4608, drafts=mtp))
            under_load(engine, streams, arriving[:1], 4)                         # warm-up, and the costs measured
            runs = {"tokens": [], "time": []}
            for _ in range(args.repeat):
                for budget in runs:
                    engine.pace.share = math.inf if budget == "tokens" else PACE_SHARE
                    runs[budget].append(under_load(engine, streams, arriving, args.around))
                    print(mtp, budget, json.dumps(runs[budget][-1]), file=sys.stderr, flush=True)
            result["mtp"][str(mtp)] = {budget: {f"{key}_{name}": f([r[key] for r in rs]) for key in rs[0]
                                                for name, f in (("min", min), ("median", statistics.median))}
                                       for budget, rs in runs.items()}
            time_, tokens = result["mtp"][str(mtp)]["time"], result["mtp"][str(mtp)]["tokens"]
            result["mtp"][str(mtp)]["ttft_time_over_tokens_median"] = time_["ttft_s_median"] / tokens["ttft_s_median"]
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
