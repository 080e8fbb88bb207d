"""Linears read from the official release's bytes, for CUDA: FP8 E4M3 weights with a scale per 128 x 128 tile, and
packed FP4 E2M1 experts with an E8M0 scale per 32 inputs, decoded in registers tile by tile (never a widened copy in
memory), so a GPU holds V4 Flash as shipped (~160 GB) instead of its bf16 widening.

Each program computes a tile of outputs for a tile of rows, looping over the inputs: the weight tile is decoded and
multiplied with `tl.dot`, accumulated in fp32. Up to 16 rows are one tile of 16 (the dot's minimum; the missing rows
are masked zeros, never loaded), so a decode or verify step reads each weight byte once, in programs split over
the outputs only (a GEMV, its output tiles sized to give the GPU a few hundred programs); prefill takes larger row
tiles. No split-K: it needs a workspace or atomics, and atomics would make the sums' order, so the greedy output,
vary from run to run. Launches are static in the shapes: no host sync, graph-capturable, the output the one
allocation.

Numerics, against the reference's fp32 math (`reference.fp8_linear`, `fp4_linear`, `fp4_grouped_linear`):
- FP8: the dot multiplies the raw E4M3 values (exact in bf16, fp16 and fp32) and each 128-input tile's fp32
  partial sum is multiplied by the weight rows' scales for that tile (the input tiles follow the scale grid,
  whatever the offset). Products are exact and the scales apply in fp32, so E8M0 and fp32 scales alike give the
  reference's sum up to the order of fp32 additions.
- FP4: codes times their power-of-two scale are exact in bf16 (fp32's exponent range) and fp32, so they are scaled
  before the dot (a dot per 32 inputs would leave the tensor cores idle). fp16 activations take fp16 weights:
  exact for scales 2^-23..2^13 (the release's are near 2^-8), overflowing beyond. An fp32 scale rounds there to
  the dot's dtype.
- fp32 activations multiply with `input_precision="ieee"` (exact fp32, not TF32); bf16 and fp16 on tensor cores.
- E4M3 and E2M1 are decoded by moving their bits into an fp16's: exact, a few integer ops, and portable (Triton
  converts FP8 only from sm89 on; this runs on an A100 too).

Why not `torch._scaled_mm`: it multiplies FP8 by FP8, so the activations would be quantised to E4M3 (per row or
per 128 inputs), a lossy step the reference and DeepSeek's bf16 activations don't take; per-tensor and per-row
scales can't express a scale per 128 x 128 weight tile without rescaling the weight; and H100 has no FP4 MMA.
The block sizes are set from the shapes alone (no autotuning, which would time kernels on first use, inside a
CUDA graph capture too) and are untuned: no GPU has measured them yet.
"""
import torch
import triton
import triton.language as tl

FP8_TILE = 128       # the FP8 scale grid's tile, and the input tile of the FP8 loop
FP4_GROUP = 32       # inputs per FP4 scale
FP4_INPUTS = 128     # inputs per step of the FP4 loop: 64 bytes of each weight row
ACTIVATIONS = (torch.bfloat16, torch.float16, torch.float32)
SCALES = (torch.float8_e8m0fnu, torch.float32)
PACKED = (torch.float4_e2m1fn_x2, torch.uint8, torch.int8)     # two E2M1 codes a byte


@triton.jit
def _e8m0(e):
    """E8M0 bytes -> fp32 2^(e-127): the byte as an fp32's exponent, e = 0 as the subnormal 2^-127 (and 255, E8M0's
    NaN, which no release stores, as inf)."""
    e = e.to(tl.int32)
    bits = tl.where(e == 0, 0x400000, e << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(b):
    """E4M3 bytes -> fp32 values: the exponent and mantissa bits placed as an fp16's low ones give the value times
    2^-8 (exact, subnormals included); E4M3's NaN, which no weight holds, reads as 480."""
    b = b.to(tl.int32)
    bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _e2m1(c):
    """E2M1 codes (0..15) -> fp32 values: the code's 3 magnitude bits placed as an fp16's low exponent bits and top
    mantissa bit give the value times 2^-14 (exact, subnormals included), and the sign bit as the fp16's sign."""
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _dot(x, w_t, acc):
    """acc + x @ w_t, w_t [inputs, outputs] in x's dtype: exact fp32 for fp32 x (no TF32)."""
    if x.dtype == tl.float32:
        return tl.dot(x, w_t, acc, input_precision="ieee")
    return tl.dot(x, w_t, acc)


@triton.jit
def _fp8_matmul(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, row0, col0, sx, sw, ss_r, ss_c,
                BM: tl.constexpr, BN: tl.constexpr, E8M0: tl.constexpr):
    """out[m, i] = sum_j x[m, j] e4m3(w[i, j]) scale[(row0+i)//128, (col0+j)//128]."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rows_in, cols_in = rows < M, cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * sx
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * sw
    s_rows = s_ptr + ((row0 + cols) // 128).to(tl.int64) * ss_r
    t = tl.arange(0, 128)
    acc = tl.zeros((BM, BN), tl.float32)
    # input tiles aligned to the scale grid: tile a covers the weight's columns a - col0 + t
    for a in range(col0 - col0 % 128, col0 + K, 128):
        j = a - col0 + t
        j_in = (j >= 0) & (j < K)
        x = tl.load(x_rows + j[None, :], mask=rows_in[:, None] & j_in[None, :], other=0.0)
        w = tl.load(w_rows + j[None, :], mask=cols_in[:, None] & j_in[None, :], other=0)
        w = _e4m3(w).to(x.dtype)
        s = tl.load(s_rows + (a // 128) * ss_c, mask=cols_in, other=0)
        if E8M0:
            s = _e8m0(s)
        acc += _dot(x, tl.trans(w), tl.zeros((BM, BN), tl.float32)) * s[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=rows_in[:, None] & cols_in[None, :])


@triton.jit
def _fp4_dot(x_rows, x_in, w_rows, s_rows, cols_in, K, ss_k,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E8M0: tl.constexpr):
    """x [BM rows] times one weight's BN rows over all K inputs: packed bytes and scales decoded per BK inputs."""
    t = tl.arange(0, BK)
    half = tl.arange(0, BK // 2)
    groups = tl.arange(0, BK // 32)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):                        # K is a multiple of 32, so every 32-input group is whole
        x = tl.load(x_rows + (k0 + t)[None, :], mask=x_in[:, None] & (k0 + t < K)[None, :], other=0.0)
        b = tl.load(w_rows + (k0 // 2 + half)[None, :], mask=cols_in[:, None] & (k0 + 2 * half < K)[None, :],
                    other=0).to(tl.int32)
        w = tl.join(_e2m1(b & 15), _e2m1(b >> 4)).reshape(BN, BK)      # low nibble input 2j, high 2j+1
        s = tl.load(s_rows + (k0 // 32 + groups)[None, :] * ss_k,
                    mask=cols_in[:, None] & (k0 + 32 * groups < K)[None, :], other=0)
        if E8M0:
            s = _e8m0(s)
        w = (w.reshape(BN, BK // 32, 32) * s[:, :, None]).reshape(BN, BK)
        acc = _dot(x, tl.trans(w.to(x.dtype)), acc)
    return acc


@triton.jit
def _fp4_matmul(x_ptr, w_ptr, s_ptr, group_ptr, out_ptr, M, N, K, G, sx, sw_g, sw_n, ss_g, ss_n, ss_k,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SLOTS: tl.constexpr,
                E8M0: tl.constexpr, GROUPED: tl.constexpr):
    """out[m] = x[m] W_g^T with W_g weight g's decoded FP4: g = group[m] when GROUPED (rows whose g is outside
    [0, G) get zeros), else 0. A grouped program takes the distinct groups of its row tile ranked slot, slot +
    SLOTS, ...: it reads each of their weights once for all the tile's rows, and writes the rows of that group."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rows_in, cols_in = rows < M, cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * sx
    out = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    w_cols = cols.to(tl.int64)[:, None] * sw_n
    s_cols = cols.to(tl.int64)[:, None] * ss_n
    if GROUPED:
        g = tl.load(group_ptr + rows, mask=rows_in, other=-1).to(tl.int32)
        valid = (g >= 0) & (g < G)
        g = tl.where(valid, g, G)
        i = tl.arange(0, BM)
        # the tile's distinct groups, any order of rows: a row is its group's first if no earlier row has it,
        # and its rank is the count of first rows with a smaller group
        first = (tl.max(((g[None, :] == g[:, None]) & (i[None, :] < i[:, None])).to(tl.int32), axis=1) == 0) & valid
        rank = tl.sum((first[None, :] & (g[None, :] < g[:, None])).to(tl.int32), axis=1)
        if tl.program_id(2) == 0:
            tl.store(out, tl.zeros((BM, BN), tl.float32), mask=(rows_in & ~valid)[:, None] & cols_in[None, :])
        for slot in range(tl.program_id(2), tl.sum(first.to(tl.int32)), SLOTS):
            e = tl.max(tl.where(first & (rank == slot), g, -1)).to(tl.int64)
            mine = g == e
            acc = _fp4_dot(x_rows, mine, w_ptr + e * sw_g + w_cols, s_ptr + e * ss_g + s_cols, cols_in, K, ss_k,
                           BM, BN, BK, E8M0)
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mine[:, None] & cols_in[None, :])
    else:
        acc = _fp4_dot(x_rows, rows_in, w_ptr + w_cols, s_ptr + s_cols, cols_in, K, ss_k, BM, BN, BK, E8M0)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rows_in[:, None] & cols_in[None, :])


def _tiles(rows: int, n: int) -> tuple[int, int, int]:
    """(row tile, output tile, warps) for `rows` rows per weight: up to 16 rows one tile of 16 and output tiles that
    give a few hundred programs (n / 256, from 16 to 64), so the weight streams from many SMs at once."""
    if rows <= 16:
        return 16, min(64, max(16, triton.next_power_of_2(n // 256))), 4
    if rows <= 128:
        return 32, 64, 4
    return 64, 128, 8


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., k] as [m, k] with unit stride along k (a view where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _scale(scale: torch.Tensor) -> torch.Tensor:
    return scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale


def fp8_fits(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offset: tuple[int, int] = (0, 0)) -> bool:
    """Whether the FP8 kernel takes these: float activations, a 2-D E4M3 weight with unit column stride (a column
    slice is fine), and an E8M0 or fp32 scale grid that covers it from `offset`."""
    (r, c), (n, k) = offset, weight.shape
    return (x.dtype in ACTIVATIONS and weight.dtype == torch.float8_e4m3fn and weight.dim() == 2
            and weight.stride(1) == 1 and x.shape[-1] == k and scale.dtype in SCALES and scale.dim() == 2
            and r >= 0 and c >= 0 and scale.shape[0] * FP8_TILE >= r + n and scale.shape[1] * FP8_TILE >= c + k)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """x [..., k] times the FP8 weight [n, k] (read in place) decoded with its tile scales from `offset` (as
    `reference.fp8_to_float`), summed in fp32; x's dtype out, [..., n]."""
    (r, c), (n, k) = offset, weight.shape
    x2 = _rows(x)
    m = x2.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m and n:
        bm, bn, warps = _tiles(m, n)
        s = _scale(scale)
        _fp8_matmul[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x2, weight.view(torch.uint8), s, out, m, n, k, r, c, x2.stride(0), weight.stride(0), s.stride(0),
            s.stride(1), BM=bm, BN=bn, E8M0=scale.dtype == torch.float8_e8m0fnu, num_warps=warps)
    return out.view(*x.shape[:-1], n)


def fp4_fits(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether the FP4 kernel takes these: float activations, a packed 1-byte weight [..., n, k/2] with k a
    multiple of 32 and unit stride along its bytes, and an E8M0 or fp32 scale [..., n, k/32]."""
    k = x.shape[-1]
    return (x.dtype in ACTIVATIONS and weight.dtype in PACKED and k % FP4_GROUP == 0 and weight.shape[-1] * 2 == k
            and weight.stride(-1) == 1 and scale.dtype in SCALES
            and scale.shape == (*weight.shape[:-1], k // FP4_GROUP))


def _fp4_launch(x2, weight, scale, group, out, grouped: bool):
    """Launch over x2 [m, k] -> out [m, n] with weight [G, n, k/2], scale [G, n, k/32] (G = 1 ungrouped)."""
    (m, k), (G, n, _) = x2.shape, weight.shape
    if not (m and n):
        return out
    bm, bn, warps = _tiles(triton.cdiv(m, G) if grouped else m, n)
    # program slots per row tile: about the distinct groups a tile of sorted rows spans
    slots = min(bm, G, triton.next_power_of_2(triton.cdiv(bm * G, m) + 1)) if grouped else 1
    s = _scale(scale)
    _fp4_matmul[(triton.cdiv(m, bm), triton.cdiv(n, bn), slots)](
        x2, weight.view(torch.uint8), s, group, out, m, n, k, G, x2.stride(0), weight.stride(0), weight.stride(1),
        s.stride(0), s.stride(1), s.stride(2), BM=bm, BN=bn, BK=FP4_INPUTS, SLOTS=slots,
        E8M0=scale.dtype == torch.float8_e8m0fnu, GROUPED=grouped, num_warps=warps)
    return out


def fp4_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., k] times the packed FP4 weight [n, k/2] decoded with its group scales [n, k/32], summed in fp32; x's
    dtype out, [..., n]."""
    x2 = _rows(x)
    n = weight.shape[0]
    out = torch.empty(x2.shape[0], n, device=x.device, dtype=x.dtype)
    _fp4_launch(x2, weight[None], scale[None], None, out, grouped=False)
    return out.view(*x.shape[:-1], n)


def fp4_grouped_fits(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group: torch.Tensor) -> bool:
    """Whether the grouped kernel takes these: x [A, k], weight [G, n, k/2], scale [G, n, k/32], group [A] integer."""
    return (x.dim() == 2 and weight.dim() == 3 and weight.shape[0] > 0 and fp4_fits(x, weight, scale)
            and group.shape == x.shape[:1] and group.dtype in (torch.int32, torch.int64))


def fp4_grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Row a of x [A, k] times weight group[a]'s packed FP4 [G, n, k/2] (scales [G, n, k/32]), summed in fp32 ->
    fp32 [A, n]. A row whose group is outside [0, G) (another rank's expert) comes out zeros. Rows may come in any
    order; sorted by group, each weight byte is read about once per row tile its rows span."""
    x2 = _rows(x)
    out = torch.empty(x2.shape[0], weight.shape[1], device=x.device, dtype=torch.float32)
    return _fp4_launch(x2, weight, scale, group, out, grouped=True)
