"""The CUDA kernel module's Triton scan, run by Triton's interpreter on the CPU (TRITON_INTERPRET=1 is
read when a kernel is defined, so the checks run in a process of their own): the reference's scores
for padded and whole head counts, fp32, fp16 and mixed inputs, keys read in place from a cache's slice.
Half precision is checked in fp16: the interpreter computes numpy dots and numpy has no bf16 (its bf16
dot is garbage); bf16 runs the same code on a GPU, where `scripts/device_check.py` checks it."""
import os
import subprocess
import sys

import pytest

CHECKS = r"""
import torch
from dsv4cli.kernels import cuda, reference, triton_indexer

def inputs(g, heads, dim, q_dtype, k_dtype, batch=2, rows=3, keys=150):
    q = torch.randn(batch, rows, heads, dim, generator=g).to(q_dtype)
    cache = torch.randn(batch, keys + 7, dim, generator=g).to(k_dtype)
    return q, cache[:, :keys], torch.randn(batch, rows, heads, generator=g)

g = torch.Generator().manual_seed(0)
cases = 0
for heads in (4, 16, 64):             # 4: padded to the dot's 16 rows
    for dim in (32, 128):
        for q_dtype, k_dtype in ((torch.float32, torch.float32), (torch.float16, torch.float16),
                                 (torch.float32, torch.bfloat16)):
            q, keys, w = inputs(g, heads, dim, q_dtype, k_dtype)
            assert triton_indexer.fits(q, keys)
            got, want = triton_indexer.indexer_scores(q, keys, w), reference.indexer_scores(q, keys, w)
            assert got.shape == (2, 3, 150) and got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
            cases += 1
q, keys, w = inputs(g, 16, 32, torch.float32, torch.float32)
assert triton_indexer.indexer_scores(q, keys[:, :0], w).shape == (2, 3, 0)
assert not triton_indexer.fits(q[..., :24], keys[..., :24])      # a head dim that isn't a power of two
assert cuda.indexer_scores is not reference.indexer_scores and cuda.topk_blocks is reference.topk_blocks
print("cases", cases)
"""


def test_the_triton_indexer_scan_gives_the_reference_scores():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "cases 18" in run.stdout
