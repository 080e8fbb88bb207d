"""Sparse attention on the CPU at V4 Flash's widths: the native pass against torch's reference.

    python benchmarks/attention.py [--rows 1,6] [--batches 1,8] [--reps 9] [--threads 1] [--out results.json]

A layer's attention core as a decode or verify step runs it: 64 heads x 512 dims in bf16, each query row
against the window ring (128 rows), the chunk's own rows (causal), and the compressed blocks: a CSA layer's
indexer top-512 of 2,048 blocks (read by index), or an HCA layer's 8 closed blocks (a 1,024-token context),
read whole. For each layer kind, batch and rows per sequence (1: plain decoding; 6: DSpark verifying 5 drafts),
the native kernel (`native.sparse_attention`) and the reference (`reference.sparse_attention`: gathers, fp32
copies, einsums, one softmax) interleaved rep by rep in one process: milliseconds (best and median), the speedup
of the medians, and the native kernel's fp32 multiply-adds per second (2 x heads x dims per key a row).
"""
import argparse
import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from meta import stamp

from dsv4cli.kernels import native, reference

HEADS, DIM, RING = 64, 512, 128
KINDS = {"csa": (2048, 512), "hca": (8, None)}      # compressed blocks held, and blocks a query reads by index


def layer(kind: str, batch: int, rows: int, g: torch.Generator):
    blocks, topk = KINDS[kind]
    q = torch.randn(batch, rows, HEADS, DIM, generator=g).bfloat16()
    ring = torch.randn(batch, RING, DIM, generator=g).bfloat16()
    chunk = torch.randn(batch, rows, DIM, generator=g).bfloat16()
    compressed = torch.randn(batch, blocks, DIM, generator=g).bfloat16()
    sources = [(ring, torch.ones(batch, rows, RING, dtype=torch.bool), None),
               (chunk, torch.ones(rows, rows, dtype=torch.bool).tril().expand(batch, rows, rows), None)]
    if topk:
        idx = torch.stack([torch.randperm(blocks, generator=g)[:topk] for _ in range(batch * rows)])
        sources.append((compressed, torch.ones(batch, rows, topk, dtype=torch.bool), idx.view(batch, rows, topk)))
    else:
        sources.append((compressed, torch.ones(batch, rows, blocks, dtype=torch.bool), None))
    keys = RING + (rows + 1) / 2 + (topk or blocks)              # mean keys a row sees
    return q, sources, torch.randn(HEADS, generator=g), keys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,6")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not native.available():
        raise SystemExit("the native kernels can't run here (no x86-64 CPU with AVX-512 VNNI, or no C compiler)")
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    results = []
    for kind in KINDS:
        for batch in [int(b) for b in a.batches.split(",")]:
            for rows in [int(r) for r in a.rows.split(",")]:
                q, sources, sink, keys = layer(kind, batch, rows, g)
                calls = {name: functools.partial(op.sparse_attention, q, sources, sink, DIM ** -0.5)
                         for name, op in (("reference", reference), ("native", native))}
                times = {name: [] for name in calls}
                for rep in range(a.reps + 1):                    # the first warms up
                    for name, call in (calls.items() if rep % 2 else reversed(calls.items())):
                        t = time.perf_counter()
                        call()
                        if rep:
                            times[name].append(time.perf_counter() - t)
                med = {name: statistics.median(t) for name, t in times.items()}
                r = {"kind": kind, "batch": batch, "rows": rows, "keys_per_row": keys,
                     **{f"{name}_ms": {"min": round(min(t) * 1e3, 3), "median": round(med[name] * 1e3, 3)}
                        for name, t in times.items()},
                     "speedup": round(med["reference"] / med["native"], 2),
                     "native_gmac_s": round(2 * HEADS * DIM * keys * batch * rows / med["native"] / 1e9, 1)}
                results.append(r)
                print(f"{kind} batch {batch} rows {rows}: reference {r['reference_ms']['median']} ms, native "
                      f"{r['native_ms']['median']} ms ({r['speedup']}x, {r['native_gmac_s']} G multiply-adds/s)")
    report = {"benchmark": "attention", "machine": platform.processor() or platform.machine(),
              "cpu_count": os.cpu_count(), "threads": a.threads, "results": results, "meta": stamp(vars(a))}
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
