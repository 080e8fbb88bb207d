"""Few-row GEMMs on the CPU: each kernel's weight bandwidth for 1-16 rows against the streaming read.

    python benchmarks/cpu_gemm.py [--rows 1,2,4,8,16] [--reps 7] [--threads 1] [--out results.json]

A decode step's GEMMs multiply 1-16 rows (batch x (K+1)) by weights far larger than the caches, so
each should cost one read of its weight. For an int8 weight [32768 x 8192] (256 MiB) and an fp32 one
[65536 x 4096] (1 GiB), both over 4x the last-level cache, this times, in one process and interleaved
rep by rep: the native kernels (`dsv4cli/kernels/native.py`; fp32 sums over fp32 or bf16-held weights) or,
on a CPU without AVX-512 VNNI, the AVX2 ops (the int8 pair GEMM, the float GEMM), oneDNN's prepacked int8
GEMM where its sums are exact, `torch._int_mm` (where it isn't slow) and MKL's fp32 GEMM (`F.linear`), and
the streaming read `real_width.py` measures (the best of four plain reads of 1 GiB). Reported: GB/s of
weight read (median and best of the reps) and its fraction of the streaming read (the median of the reps'
readings).
"""
import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from meta import stamp
from real_width import StreamRead

from dsv4cli.kernels import cpu, native


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if not (native.available() or native.avx2_available()):
        raise SystemExit("cpu_gemm: no few-row kernels here (they need an x86-64 CPU with AVX2 and a C/C++ compiler)")
    kind = "native" if native.available() else "avx2"
    rows = [int(r) for r in a.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    w8 = torch.randint(-127, 128, (32768, 8192), generator=g, dtype=torch.int8)
    w32 = torch.randn(65536, 4096, generator=g)
    packed8 = native.pack_int8(w8) if kind == "native" else native.pack_pairs(w8[None])
    packed32, packed16 = native.pack_float(w32), native.pack_float(w32.bfloat16().float(), torch.bfloat16)
    onednn = torch.ops.onednn.qlinear_prepack(w8, [1, w8.shape[1]]) if cpu._onednn_int8() else None
    q = torch.randint(-127, 128, (max(rows), w8.shape[1]), generator=g, dtype=torch.int8)
    x = torch.randn(max(rows), w32.shape[1], generator=g)
    kernels = {
        "int8 native": (w8.numel(), lambda m: native.int8_mm(q[:m], packed8)) if kind == "native" else None,
        "int8 avx2 pairs": (w8.numel(), lambda m: torch.ops.dsv4.pairs_linear(q[:m], packed8)) if kind == "avx2"
        else None,
        "int8 onednn": (w8.numel(), lambda m: cpu.packed_int_mm(q[:m], onednn)) if onednn is not None else None,
        # where int8 GEMMs are slow (`cpu.slow_int8`) torch._int_mm takes seconds a call here: left out
        "int8 torch._int_mm": (w8.numel(), lambda m: torch._int_mm(q[:m], w8.t())) if not cpu.slow_int8() else None,
        f"fp32 {kind}": (w32.numel() * 4, lambda m: native.float_mm(x[:m], packed32)),
        "fp32 mkl": (w32.numel() * 4, lambda m: F.linear(x[:m], w32)),
        f"bf16-held {kind}": (w32.numel() * 2, lambda m: native.float_mm(x[:m], packed16)),
    }
    kernels = {k: v for k, v in kernels.items() if v is not None}
    speeds = {(k, m): [] for k in kernels for m in rows}
    reads, stream = [], StreamRead()
    for _ in range(a.reps):
        reads.append(stream(tries=2) / 1e9)
        for m in rows:
            for name, (nbytes, fn) in kernels.items():
                speeds[name, m].append(nbytes / timed(lambda fn=fn, m=m: fn(m)) / 1e9)
    bw = statistics.median(reads)
    print(f"streaming read {bw:.1f} GB/s (median of {a.reps}), {a.threads} thread(s)")
    results = []
    for (name, m), v in speeds.items():
        med = statistics.median(v)
        results.append({"kernel": name, "rows": m, "gb_s": {"median": round(med, 2), "max": round(max(v), 2)},
                        "of_stream": round(med / bw, 3)})
        print(f"{name:20s} rows {m:2d}: {med:6.2f} GB/s (best {max(v):6.2f}) = {med / bw:.2f} of the streaming read")
    report = {"meta": stamp(vars(a)),
              "benchmark": "cpu_gemm", "machine": {"cpu": platform.processor() or platform.machine(),
                                                   "cores": os.cpu_count(), "threads": a.threads},
              "torch": torch.__version__, "stream_read_gb_s": round(bw, 2), "reps": a.reps, "results": results}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
