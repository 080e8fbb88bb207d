"""Both bundled drafters, compiled, batch 1, in one process: plain decoding, DSpark (fixed K and auto) on
`dsv4-tiny`, the MTP chain at every depth on its preview-layout twin `dsv4-tiny-mtp` (the same trunk).

Each engine is loaded once (compile in the foreground, as `bench` does) and every configuration first
decodes every prompt once (auto a few times more, to measure its lengths' costs). Then, per round, each
prompt is decoded by every configuration in turn, so a busy spell on the shared machine falls on all of
them alike. Speed is the decode phase (tokens after the first over the time after the first, as `bench`),
summed over the prompts; ratios are taken per round against plain and against the MTP depth with the best
median. `--compare DIR` adds the DSpark drafter of another 0731-layout checkpoint (e.g. an earlier
training) as `compare<K>`. Every configuration's greedy tokens must equal plain's. Results: JSON on
stdout, or --out.
"""
import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch
from meta import stamp

PROMPTS = ["Tell me a story.", "What is the capital of France?", "What does a cow say?", "What is 7 plus 12?"]


def engines(configs: list[str], compare: str | None) -> dict:
    from dsv4cli.config import BUNDLED_MODEL_DIR, resolve
    from dsv4cli.loading import load_engine

    mtp_dir = str(Path(BUNDLED_MODEL_DIR).parent / "dsv4-tiny-mtp")
    out = {}
    for name in configs:
        kind, _, depth = name.rpartition("-")
        model = {"plain": None, "dspark": None, "mtp": mtp_dir, "compare": compare}[kind or depth]
        mtp = 0 if name == "plain" else depth if depth == "auto" else int(depth)
        settings = dataclasses.replace(resolve()[0], compile="on", max_batch=1, drafts=mtp,
                                       **({"model": model} if model else {}))
        out[name] = load_engine(settings, "bench", compile_in_background=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="plain,dspark-5,dspark-auto,mtp-1,mtp-2,mtp-3,mtp-4,mtp-5",
                    help="plain, dspark-<K|auto>, mtp-<K>, compare-<K> (with --compare)")
    ap.add_argument("--compare", help="another 0731-layout checkpoint whose drafter runs as compare-<K>")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from dsv4cli.encoding import encode_messages
    from dsv4cli.engine import SamplingParams

    eng = engines(args.configs.split(","), args.compare)
    tok = eng["plain"].tok
    prompts = [tok.encode(encode_messages([{"role": "user", "content": q}], encoding=tok.encoding)) for q in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    outputs = {}
    for name, e in eng.items():
        for _ in range(4 if name.endswith("auto") else 1):
            outputs[name] = [e.generate([ids], params)[0].output_ids for ids in prompts]
    speed = {n: [] for n in eng}
    acceptance = {}
    for r in range(args.rounds):
        tokens, seconds = dict.fromkeys(eng, 0), dict.fromkeys(eng, 0.0)
        for ids in prompts:
            for name, e in eng.items():
                m = e.generate([ids], params)[0].metrics
                tokens[name] += m.output_tokens - 1
                seconds[name] += m.t_last - m.t_first
                if r == 0:
                    acceptance.setdefault(name, []).append(round(m.mean_acceptance_length, 3))
        for name in eng:
            speed[name].append(round(tokens[name] / seconds[name], 1))
        print(f"round {r}: " + ", ".join(f"{n} {v[-1]:.0f}" for n, v in speed.items()), file=sys.stderr, flush=True)
    mtps = [n for n in eng if n.startswith("mtp")]
    best = max(mtps, key=lambda n: statistics.median(speed[n])) if mtps else None
    ratios = {}
    for name in (n for n in eng if n.startswith(("dspark", "compare"))):
        ratios[f"{name}/plain"] = [round(a / b, 3) for a, b in zip(speed[name], speed["plain"])]
        if best:
            ratios[f"{name}/{best}"] = [round(a / b, 3) for a, b in zip(speed[name], speed[best])]
    result = {"meta": {**stamp(vars(args)), "prompts": PROMPTS, "threads": 1, "torch": torch.__version__,
                       "unit": "decode tokens/s per round, the prompts together", "best_mtp": best},
              "same_tokens_as_plain": {n: o == outputs["plain"] for n, o in outputs.items()},
              "mean_acceptance_length": acceptance, "tokens_per_s": speed,
              "summary": {n: {"min": min(v), "median": statistics.median(v), "max": max(v)} for n, v in speed.items()},
              "ratios": {k: {"min": min(v), "median": statistics.median(v), "max": max(v), "rounds": v}
                         for k, v in ratios.items()}}
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
