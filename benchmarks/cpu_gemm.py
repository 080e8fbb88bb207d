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
readings), and the multiply-adds per second.

    python benchmarks/cpu_gemm.py --lowbit [--rows 1,2,4,8,16,256] [--out results.json]

--lowbit: the official release's own formats read as stored (`native.fp8_mm`, `native.fp4_mm`) at V4 Flash's
widths, FP4 expert w1 [2048 x 4096] and w2 [4096 x 2048], FP8 wq_b [32768 x 1024] and wo_b [4096 x 8192], each
beside an int8 (the W8A8 native kernel) and an fp32 weight of its shape (the native kernel, MKL); where the CPU
has AVX-512 VNNI and BF16, the same FP4 and FP8 weights through the fast kernels too (`native.fp4_mm_q8`,
`native.fp8_mm_bf16`, bf16 x). A weight under 4x the last-level cache is held as copies that together are not
(experts taken in turn), each call sweeping them; its rows also give the time of one call on one weight. The
release-format and native int8 copies lie in one buffer per weight, on 2 MiB pages where Linux allows
(`platforms.cpu.weight_buffer`): on 4 KiB pages a plain read of such copies ran at 17-19 GB/s where 2 MiB pages gave 30
(a Zen 4 VM, one thread), and the fast FP4 kernel at one row read 18 GB/s from copies each in a buffer of its own
(half of each 4.25 MiB on 4 KiB pages) where one buffer gave 21.
"""
import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from meta import stamp
from real_width import StreamRead

from dsv4cli.kernels import cpu, native
from dsv4cli.platforms.cpu import weight_buffer


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def last_level_cache() -> int:
    for index in range(5, -1, -1):
        path = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size")
        if path.exists():
            text = path.read_text().strip()
            return int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text)
    return 32 << 20


# V4 Flash's widths: (name, format, out, in)
FLASH_WEIGHTS = [("w1", "fp4", 2048, 4096), ("w2", "fp4", 4096, 2048), ("wq_b", "fp8", 32768, 1024),
                 ("wo_b", "fp8", 4096, 8192)]


def flash_kernels(rows: int, kind: str, g: torch.Generator) -> dict:
    """Per V4 Flash weight, its release format read as stored and int8 and fp32 weights of its shape, each as
    copies that together pass 4x the last-level cache: name -> (bytes, multiply-adds a row, fn(m) sweeping the
    copies)."""
    least = 4 * last_level_cache()

    def swept(gemm, copies, x):
        return lambda m: [gemm(x[:m], w) for w in copies]

    def held(count, *shape):    # `count` copies in one buffer: all on 2 MiB pages where Linux allows
        return list(weight_buffer(count, *shape, dtype=torch.uint8))

    kernels, fast = {}, native.lowbit_fast_available()
    for name, fmt, n, k in FLASH_WEIGHTS:
        x = torch.randn(rows, k, generator=g)
        q = torch.randint(-127, 128, (rows, k), generator=g, dtype=torch.int8)
        if fmt == "fp4":
            size = n * k // 2 + n * k // 32
            count = -(-least // size)
            copies = [(w.random_(0, 256, generator=g), s.random_(120, 130, generator=g))
                      for w, s in zip(held(count, n, k // 2), held(count, n, k // 32))]
            exact, quick = native.fp4_mm, native.fp4_mm_q8
        else:
            size = n * k
            copies = [(w.random_(0, 255, generator=g).view(torch.float8_e4m3fn),
                       torch.rand(n // 128, k // 128, generator=g) / 448) for w in held(-(-least // size), n, k)]
            exact, quick = native.fp8_mm, native.fp8_mm_bf16
        kernels[f"{name} {fmt}"] = (size * len(copies), n * k * len(copies),
                                    swept(lambda x, w, exact=exact: exact(x, *w), copies, x))
        if fast:                    # a bf16 run's kernels, on the same weights
            kernels[f"{name} {fmt} fast"] = (size * len(copies), n * k * len(copies),
                                             swept(lambda x, w, quick=quick: quick(x, *w), copies, x.bfloat16()))
        if kind == "native":
            w8 = [w.copy_(native.pack_int8(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)))
                  for w in held(-(-least // (n * k)), n // native.BLOCK, k // 4, native.BLOCK, 4)]
        else:
            w8 = [native.pack_pairs(torch.randint(-127, 128, (1, n, k), generator=g, dtype=torch.int8))
                  for _ in range(-(-least // (n * k)))]
        int8 = native.int8_mm if kind == "native" else torch.ops.dsv4.pairs_linear
        kernels[f"{name} int8 {kind}"] = (n * k * len(w8), n * k * len(w8), swept(int8, w8, q))
        w32 = [torch.randn(n, k, generator=g) for _ in range(-(-least // (n * k * 4)))]
        packed = [native.pack_float(w) for w in w32]
        kernels[f"{name} fp32 {kind}"] = (n * k * 4 * len(w32), n * k * len(w32), swept(native.float_mm, packed, x))
        kernels[f"{name} fp32 mkl"] = (n * k * 4 * len(w32), n * k * len(w32), swept(F.linear, w32, x))
    return kernels


def big_kernels(rows: int, kind: str, g: torch.Generator) -> dict:
    """An int8 weight [32768 x 8192] and an fp32 one [65536 x 4096] through every kernel: name -> (bytes,
    multiply-adds a row, fn(m)), or None for a kernel this machine can't run well."""
    w8 = torch.randint(-127, 128, (32768, 8192), generator=g, dtype=torch.int8)
    w32 = torch.randn(65536, 4096, generator=g)
    packed8 = native.pack_int8(w8) if kind == "native" else native.pack_pairs(w8[None])
    packed32, packed16 = native.pack_float(w32), native.pack_float(w32.bfloat16().float(), torch.bfloat16)
    onednn = torch.ops.onednn.qlinear_prepack(w8, [1, w8.shape[1]]) if cpu._onednn_int8() else None
    q = torch.randint(-127, 128, (rows, w8.shape[1]), generator=g, dtype=torch.int8)
    x = torch.randn(rows, w32.shape[1], generator=g)
    n8 = w8.numel()
    return {
        "int8 native": (n8, n8, lambda m: native.int8_mm(q[:m], packed8)) if kind == "native" else None,
        "int8 avx2 pairs": (n8, n8, lambda m: torch.ops.dsv4.pairs_linear(q[:m], packed8)) if kind == "avx2"
        else None,
        "int8 onednn": (n8, n8, lambda m: cpu.packed_int_mm(q[:m], onednn)) if onednn is not None else None,
        # where int8 GEMMs are slow (`cpu.slow_int8`) torch._int_mm takes seconds a call here: left out
        "int8 torch._int_mm": (n8, n8, lambda m: torch._int_mm(q[:m], w8.t())) if not cpu.slow_int8() else None,
        f"fp32 {kind}": (w32.numel() * 4, w32.numel(), lambda m: native.float_mm(x[:m], packed32)),
        "fp32 mkl": (w32.numel() * 4, w32.numel(), lambda m: F.linear(x[:m], w32)),
        f"bf16-held {kind}": (w32.numel() * 2, w32.numel(), lambda m: native.float_mm(x[:m], packed16)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--lowbit", action="store_true",
                    help="the release's FP8 and FP4 weights at V4 Flash's widths, beside int8 and fp32 ones")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if not (native.available() or native.avx2_available()):
        raise SystemExit("cpu_gemm: no few-row kernels here (they need an x86-64 CPU with AVX2 and a C/C++ compiler)")
    kind = "native" if native.available() else "avx2"
    rows = [int(r) for r in a.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    if a.lowbit:
        if not native.lowbit_available():
            raise SystemExit("cpu_gemm: no FP8/FP4 kernels here (they need an x86-64 CPU with AVX2 and a C compiler)")
        kernels = flash_kernels(max(rows), kind, g)
    else:
        kernels = big_kernels(max(rows), kind, g)
    kernels = {k: v for k, v in kernels.items() if v is not None}
    speeds = {(k, m): [] for k in kernels for m in rows}
    reads, stream = [], StreamRead()
    for _ in range(a.reps):
        reads.append(stream(tries=2) / 1e9)
        for m in rows:
            for name, (nbytes, _, fn) in kernels.items():
                speeds[name, m].append(nbytes / timed(lambda fn=fn, m=m: fn(m)) / 1e9)
    bw = statistics.median(reads)
    print(f"streaming read {bw:.1f} GB/s (median of {a.reps}), {a.threads} thread(s)")
    results = []
    for (name, m), v in speeds.items():
        nbytes, macs, _ = kernels[name]
        med = statistics.median(v)
        gmac = med * macs * m / nbytes
        results.append({"kernel": name, "rows": m, "gb_s": {"median": round(med, 2), "max": round(max(v), 2)},
                        "of_stream": round(med / bw, 3), "gmac_s": round(gmac, 1)})
        print(f"{name:20s} rows {m:3d}: {med:6.2f} GB/s (best {max(v):6.2f}) = {med / bw:.2f} of the streaming read, "
              f"{gmac:5.1f} G multiply-adds/s")
    report = {"meta": stamp(vars(a)),
              "benchmark": "cpu_gemm", "machine": {"cpu": platform.processor() or platform.machine(),
                                                   "cores": os.cpu_count(), "threads": a.threads},
              "torch": torch.__version__, "stream_read_gb_s": round(bw, 2), "reps": a.reps, "results": results}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
