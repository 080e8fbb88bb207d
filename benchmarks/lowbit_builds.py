"""The real-width decode step on two builds of the release's kernels (`cpu_lowbit.c`): this tree's and a git
revision's, alternating step by step in one process.

    python benchmarks/lowbit_builds.py --old REV [--experts 256] [--batches 1,8] [--reps 12] [--threads 1]
        [--huge-pages] [--out results.json]

A 2-layer model at V4 Flash's widths (one CSA and one HCA layer, the LM head; `real_width.py`'s, release weights
in bf16) steps with each build in turn, the order swapped every rep, so both see the same spells of a noisy
machine. A timer on each native FP8/FP4 call (and the packed LM head's) splits each step: medians in ms per
kernel and shape, and old / new. The builds are the same function for function (same bits: the kernel tests),
so the timing is all that differs.
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

import real_width as rw
import torch
from meta import stamp

from dsv4cli.kernels import native
from dsv4cli.model import ModelConfig

TIMED = ("fp8_mm_bf16", "fp8_mm_bf16_groups", "fp4_routed_experts", "float_mm")


def old_build(rev: str, tmp: Path):
    """The fast lowbit library built from `rev`'s sources (the kernel files it includes beside them)."""
    for name in ("cpu_lowbit.c", "cpu_quant.c", *(h.name for h in native.HEADERS)):
        text = subprocess.run(["git", "show", f"{rev}:dsv4cli/kernels/{name}"], capture_output=True, check=False)
        if text.returncode == 0:
            (tmp / name).write_bytes(text.stdout)
    source, quant = native.LOWBIT_SOURCE, native.QUANT_SOURCE
    native.LOWBIT_SOURCE, native.QUANT_SOURCE = tmp / "cpu_lowbit.c", tmp / "cpu_quant.c"
    try:
        return native.lowbit_library.__wrapped__()
    finally:
        native.LOWBIT_SOURCE, native.QUANT_SOURCE = source, quant


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="git revision of the build to compare against")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--huge-pages", action="store_true", help="the release's weights on 2 MiB pages")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    new = native.lowbit_library()
    if new is None or not new.fast:
        sys.exit("the fast FP8/FP4 kernels don't run here (AVX-512 VNNI and BF16)")
    with tempfile.TemporaryDirectory() as tmp:
        old = old_build(a.old, Path(tmp))
    if old is None:
        sys.exit(f"{a.old}'s cpu_lowbit.c doesn't build here")
    builds = {"old": old, "new": new}
    rw.HUGE_PAGES = a.huge_pages
    cfg = ModelConfig.from_dict({**rw.V4_FLASH, "num_hidden_layers": 2, "compress_ratios": [4, 128, 0],
                                 "n_routed_experts": a.experts, "vocab_size": 129280})
    model = rw.build_model(cfg, torch.bfloat16, "native")
    spent, timing = collections.defaultdict(float), [False]

    def timer(name: str, kernel):
        def timed(*args, **kw):
            t = time.perf_counter()
            out = kernel(*args, **kw)
            if timing[0]:
                shape = "x".join(map(str, args[1].shape[:2]))
                spent[name] += time.perf_counter() - t
                spent[f"{name} {shape}"] += time.perf_counter() - t
            return out
        return timed

    for name in TIMED:
        setattr(native, name, timer(name, getattr(native, name)))
    batches = [int(b) for b in a.batches.split(",")]
    steps = {b: rw.FilledStep(model, b, 0, 1024) for b in batches}
    times = collections.defaultdict(list)
    for rep in range(a.reps + 1):                       # rep 0 warms both builds up
        for b, step in steps.items():
            for which in ("old", "new") if rep % 2 else ("new", "old"):
                native.lowbit_library = (lambda lib: lambda isa=None: lib)(builds[which])
                step.refill()
                spent.clear()
                timing[0] = True
                t = time.perf_counter()
                with torch.no_grad():
                    step.step()
                timing[0] = False
                if rep:
                    times[b, which, "step"].append(time.perf_counter() - t)
                    for part, s in spent.items():
                        times[b, which, part].append(s)
    results = []
    for b in batches:
        for part in ["step", *sorted({p for (bb, _, p) in times if bb == b and p != "step"})]:
            old_ms, new_ms = (statistics.median(times[b, w, part]) * 1e3 for w in ("old", "new"))
            results.append({"batch": b, "part": part, "old_ms": round(old_ms, 3), "new_ms": round(new_ms, 3),
                            "speedup": round(old_ms / new_ms, 3)})
            print(f"batch {b} {part:36s} old {old_ms:8.2f} ms  new {new_ms:8.2f} ms  {old_ms / new_ms:.3f}x")
    if a.out:
        Path(a.out).write_text(json.dumps({"benchmark": "lowbit_builds", "results": results,
                                           "meta": stamp(vars(a))}, indent=1) + "\n")


if __name__ == "__main__":
    main()
