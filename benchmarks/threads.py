"""Decode speed of `dsv4 generate` by intra-op thread count and OpenMP wait policy, on idle cores and with
one core kept busy by another process (`python3 -c "while True: pass"`).

    python benchmarks/threads.py [--model PATH] [--tokens 100] [--repeats 3] [--policies ,PASSIVE,ACTIVE] [--out FILE]

Each run is the CLI as a user runs it: `dsv4 generate --raw -p "Once upon a time" -n N --ignore-eos --json`,
greedy, reading decode tokens/s from its stats. `--threads` unset is the CLI's own choice. The wait policy
"" is libgomp's default (spin a while, then sleep); the CLI sets PASSIVE unless the user set one. Every
configuration runs `--repeats` times, interleaved, and reports min / median / max; ratios are against
the best fixed configuration measured in the same run.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from meta import stamp

DSV4 = Path(sys.executable).parent / "dsv4"
BUSY = [sys.executable, "-c", "while True: pass"]


def decode_speed(model: str | None, threads: int | None, policy: str | None, tokens: int) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSV4_", "OMP_"))}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    args = [str(DSV4), "generate", "--raw", "-p", "Once upon a time", "-n", str(tokens), "--ignore-eos", "--json",
            "--temperature", "0", *(["--model", model] if model else []),
            *(["--threads", str(threads)] if threads else [])]
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["stats"]["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: the bundled dsv4-tiny)")
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policies", default=",PASSIVE,ACTIVE", help="OMP_WAIT_POLICY values to try ('' = unset)")
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args()

    cores = len(os.sched_getaffinity(0))
    configs = [(None, None)]     # the CLI's default: its thread choice and wait policy
    configs += [(t, p) for t in range(1, cores + 1) for p in args.policies.split(",")]
    runs = {(busy, t, p): [] for busy in (False, True) for t, p in configs}
    for busy in (False, True):
        for _ in range(args.repeats):
            for t, p in configs:
                hog = subprocess.Popen(BUSY) if busy else None
                try:
                    time.sleep(0.2 if busy else 0)
                    runs[busy, t, p].append(decode_speed(args.model, t, p, args.tokens))
                finally:
                    if hog:
                        hog.kill()
                        hog.wait()
                print(f"busy={busy} threads={t or 'default'} policy={p if p is not None else 'default'}: "
                      f"{runs[busy, t, p][-1]:.1f} tok/s", file=sys.stderr)

    def summary(values):
        return {"min": min(values), "median": statistics.median(values), "max": max(values), "runs": values}

    rows = [{"busy_core": busy, "threads": t or "default", "wait_policy": "default" if p is None else p or "unset",
             **summary(v)} for (busy, t, p), v in runs.items()]
    best_fixed_idle = max(r["median"] for r in rows if not r["busy_core"] and r["threads"] != "default")
    default_idle = next(r["median"] for r in rows if not r["busy_core"] and r["threads"] == "default")
    default_busy = next(r["median"] for r in rows if r["busy_core"] and r["threads"] == "default")
    result = {"meta": {**stamp(vars(args)),
                       "model": args.model or "dsv4-tiny (bundled)", "cores": cores, "tokens": args.tokens,
                       "repeats": args.repeats, "load_average_at_end": os.getloadavg()[0]},
              "default_idle_vs_best_fixed_idle": default_idle / best_fixed_idle,
              "default_busy_vs_default_idle": default_busy / default_idle,
              "results": rows}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
