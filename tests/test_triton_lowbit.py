"""The CUDA kernel module's FP8 / FP4 linears (`kernels/triton_lowbit.py`), run by Triton's interpreter on the CPU
(TRITON_INTERPRET=1 is read when a kernel is defined, so each check runs in a process of its own) against the
reference's decoding ops: decode-sized and prefill-sized row counts, ragged outputs, inputs a multiple of 32 but not
of 128, FP8 slices at nonzero offsets and read in place from a wider weight, E8M0 exponents far from 1 (and the
subnormal 2^-127), fp32 scales, grouped rows in any order with another rank's expert among them.
Half precision is checked in fp16: the interpreter computes numpy dots and numpy has no bf16; bf16 runs the same
code on a GPU."""
import os
import subprocess
import sys

import pytest

PRELUDE = r"""
import torch
from dsv4cli.kernels import cuda, reference, triton_lowbit as lowbit

g = torch.Generator().manual_seed(0)
cases = 0

def e8m0(exponents):
    return (exponents + 127).to(torch.uint8).view(torch.float8_e8m0fnu)

def exponents(lo, hi, *shape):
    return torch.randint(lo, hi + 1, shape, generator=g)

def fp4_bytes(*shape, dtype=torch.float4_e2m1fn_x2):
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dtype)

def check(got, want, x, weight):
    # within fp32 rounding of the sum of |products| (weight [n, k], or [rows, n, k]: each row's own), plus one
    # rounding of each side to a half-precision output
    global cases
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    x = x.float().abs().reshape(-1, x.shape[-1])
    bound = x @ weight.abs().T if weight.dim() == 2 else torch.einsum("ak,ank->an", x, weight.abs())
    tol = 1e-5 * bound.view(want.shape)
    if want.dtype == torch.float16:
        tol = tol + 2e-3 * want.float().abs() + 2.0 ** -24
    err = (got.float() - want.float()).abs()
    assert (err <= tol).all(), (err / tol).max()
    cases += 1
"""

FP8 = r"""
full = (torch.randn(300, 384, generator=g) * 3).to(torch.float8_e4m3fn)
for dtype, lo, hi in ((torch.float32, -100, 100), (torch.float16, -8, 4)):
    grid = e8m0(exponents(lo, hi, 3, 3))
    fp32_grid = torch.rand(3, 3, generator=g) * 2.0 ** exponents(lo, hi, 3, 3) + 1e-3
    layouts = (
        (full[:50, :160], grid, (0, 0)),                          # ragged n, k a multiple of 32 but not of 128
        (full[37:237, 90:250], grid[:2, :2], (37, 90)),           # the tiles covering a slice, offsets in [0, 128)
        (full[150:200, 96:256], grid, (150, 96)),                 # a slice of the whole grid: offsets past a tile
        (full[37:237, 90:250], fp32_grid[:2, :2], (37, 90)),      # fp32 scales
    )
    for weight, scale, offset in layouts:
        assert weight.stride(0) == 384 and lowbit.fp8_fits(torch.empty(0, 160, dtype=dtype), weight, scale, offset)
        decoded = reference.fp8_to_float(weight, scale, offset)
        for m in (1, 3, 16, 40):
            x = torch.randn(m, 160, generator=g).to(dtype)
            check(lowbit.fp8_linear(x, weight, scale, offset), reference.fp8_linear(x, weight, scale, offset), x,
                  decoded)
    weight, scale, offset = layouts[1]
    x = torch.randn(2, 3, 160, generator=g).to(dtype)                             # leading dims kept
    check(lowbit.fp8_linear(x, weight, scale, offset), reference.fp8_linear(x, weight, scale, offset), x,
          reference.fp8_to_float(weight, scale, offset))
codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)     # every E4M3 but NaN
weight, unit = codes.view(2, 127).view(torch.float8_e4m3fn), e8m0(torch.zeros(1, 1, dtype=torch.long))
assert torch.equal(lowbit.fp8_linear(torch.eye(127), weight, unit), weight.float().T)
assert lowbit.fp8_linear(torch.empty(0, 160), full[:50, :160], grid, (0, 0)).shape == (0, 50)
assert not lowbit.fp8_fits(torch.empty(1, 160), full[:160, :50].T, grid)             # a column stride of 300
assert not lowbit.fp8_fits(torch.empty(1, 160), full[:50, :160], grid[:1, :1])       # a grid that doesn't cover it
print("cases", cases)
"""

FP4 = r"""
for dtype, lo, hi in ((torch.float32, -100, 100), (torch.float16, -12, 4)):
    for n, k in ((50, 160), (70, 96)):
        weight = fp4_bytes(n, k // 2)
        scale = e8m0(exponents(lo, hi, n, k // 32))
        if dtype == torch.float32:
            scale[0] = e8m0(torch.tensor(-127))      # an output of subnormal 2^-127 scales only
        for m in (1, 3, 16, 40):
            x = torch.randn(m, k, generator=g).to(dtype)
            check(lowbit.fp4_linear(x, weight, scale), reference.fp4_linear(x, weight, scale), x,
                  reference.fp4_to_float(weight, scale))
codes = torch.arange(256, dtype=torch.uint8).view(8, 32)                          # every pair of E2M1 codes
unit = e8m0(torch.zeros(8, 2, dtype=torch.long))
assert torch.equal(lowbit.fp4_linear(torch.eye(64), codes, unit), reference.fp4_to_float(codes, unit).T)
x = torch.randn(3, 160, generator=g)
weight = fp4_bytes(50, 80, dtype=torch.int8)                                     # the writer's packed int8
scale = torch.rand(50, 5, generator=g) * 2.0 ** exponents(-30, 30, 50, 5)         # fp32 scales
check(lowbit.fp4_linear(x, weight, scale), reference.fp4_linear(x, weight, scale), x,
      reference.fp4_to_float(weight, scale))
assert lowbit.fp4_linear(x[:0], weight, scale).shape == (0, 50)
assert not lowbit.fp4_fits(x.double(), weight, scale)
assert not lowbit.fp4_fits(x[:, :144], weight[:, :72], scale)                    # scales that don't match k
print("cases", cases)
"""

GROUPED = r"""
n, k = 50, 160
for G, rows_and_order in ((3, ((1, "any"), (3, "any"), (16, "any"), (40, "sorted"), (200, "any"))),  # 200: 2 slots
                          (20, ((40, "any"), (40, "sorted")))):                                      # 16 slots
    weight = fp4_bytes(G, n, k // 2)
    stored = weight.view(torch.uint8)      # the reference's row gather can't index float4_e2m1fn_x2 on the CPU
    for dtype, lo, hi in ((torch.float32, -100, 100), (torch.float16, -12, 4)):
        scale = e8m0(exponents(lo, hi, G, n, k // 32))
        decoded = reference.fp4_to_float(weight, scale)
        for rows, order in rows_and_order:
            x = torch.randn(rows, k, generator=g).to(dtype)
            group = torch.randint(0, G + 1, (rows,), generator=g)          # G: another rank's expert
            group[0] = G if rows > 1 else 0
            if order == "sorted":
                group = group.sort().values.to(torch.int32)
            assert lowbit.fp4_grouped_fits(x, weight, scale, group)
            got = lowbit.fp4_grouped_linear(x, weight, scale, group)
            want = reference.fp4_grouped_linear(x, stored, scale, group)
            mine = group < G
            assert got.dtype == torch.float32 and torch.equal(got[~mine], torch.zeros_like(got[~mine]))
            check(got[mine], want[mine], x[mine], decoded[group[mine].long()])
print("cases", cases)
"""

DISPATCH = r"""
x = torch.randn(3, 160, generator=g)
w8 = (torch.randn(300, 384, generator=g) * 3).to(torch.float8_e4m3fn)[37:237, 90:250]
grid = e8m0(exponents(-10, 10, 2, 2))
w4, s4 = fp4_bytes(50, 80), e8m0(exponents(-10, 10, 50, 5))
# uint8 bytes: the reference (the fallback) can't gather float4_e2m1fn_x2 rows on the CPU
W, S = fp4_bytes(3, 50, 80, dtype=torch.uint8), e8m0(exponents(-10, 10, 3, 50, 5))
group = torch.tensor([2, 0, 3])

def run(ops, x):
    return (ops.fp8_linear(x, w8, grid, (37, 90)), ops.fp4_linear(x, w4, s4),
            ops.fp4_grouped_linear(x, W, S, group)[:2])

kernels = (lowbit.fp8_linear(x, w8, grid, (37, 90)), lowbit.fp4_linear(x, w4, s4),
           lowbit.fp4_grouped_linear(x, W, S, group)[:2])
for got, want in zip(run(cuda, x), kernels):                   # what fits runs the Triton kernels
    assert torch.equal(got, want)
for got, want in zip(run(cuda, x.double()), run(reference, x.double())):   # what doesn't, the reference
    assert torch.equal(got, want)
# the routed experts' grouped GEMMs: an FP4 stack runs the grouped kernel, against the same experts decoded to fp32
E, dim, inter = 3, 64, 32
w13, w2 = fp4_bytes(E, 2 * inter, dim // 2), fp4_bytes(E, dim, inter // 2)
s13, s2 = e8m0(exponents(-3, 3, E, 2 * inter, dim // 32)), e8m0(exponents(-3, 3, E, dim, inter // 32))
stack = reference.ExpertStack(w13, w2, s13, s2, limit=0.0)
decoded = reference.ExpertStack(reference.fp4_to_float(w13, s13), reference.fp4_to_float(w2, s2), None, None, 0.0)
tokens, routing = torch.randn(5, dim, generator=g), torch.rand(5, 2, generator=g)
local = torch.tensor([[0, 2], [1, 5], [2, 0], [-1, 1], [2, 1]])                    # -1, 5: another rank's
got = cuda.grouped_experts(tokens, routing, local, stack)
want = reference.grouped_experts(tokens, routing, local, decoded)
torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
# a compiled graph calls them as custom ops (dsv4::triton_*), shapes from their fake kernels
compiled = torch.compile(lambda x: run(cuda, x), backend="eager", fullgraph=True)
for got, want in zip(compiled(x), kernels):
    assert torch.equal(got, want)
print("dispatch ok")
"""


def interpret(checks: str) -> str:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", PRELUDE + checks], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_fp8_linear_gives_the_references_product_at_offsets_and_in_place_slices():
    assert "cases 34" in interpret(FP8)


def test_fp4_linear_gives_the_references_product():
    assert "cases 17" in interpret(FP4)


def test_fp4_grouped_linear_gives_each_row_its_experts_product_and_zeros_for_another_ranks():
    assert "cases 14" in interpret(GROUPED)


def test_cuda_runs_the_kernels_where_they_fit_eager_and_compiled_and_the_reference_elsewhere():
    assert "dispatch ok" in interpret(DISPATCH)
