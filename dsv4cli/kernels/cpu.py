"""The CPU's kernel module: the reference's ops, with weights of 2 MiB and more packed for the project's
few-row GEMMs (`native.py`, built on first use) or oneDNN's, the indexer's scan in one native pass, the small
ops torch runs as many (mHC in three native calls, RoPE and per-token quantisation in one each), and each MoE
layer's experts routed on the host.

On the CPU a decode step's GEMMs have 1-16 rows against weights far larger than the caches: their cost
is one read of the weight. torch's kernels read it well for one or two rows only, so big weights are
packed at load (`pack_w8a8`, `pack_linear_fp32`) and the packed copy is the only one held. Where the
native kernels can't be built (no C compiler, no AVX-512 VNNI, `DSV4_NATIVE_KERNELS=0`), int8 weights
take oneDNN's prepacked layout where torch has it, else `cpu_pairs.cpp`'s pair GEMMs read them
(`torch._int_mm` is slow there: small experts as a stack, the rest weight by weight), float weights
`cpu_float.cpp`'s few-row GEMM (AVX2), and the reference's ops run the rest. Inside a compiled graph every
native call is a custom op (inductor can't lower the layouts); in eager the kernel is called directly, saving
an op's dispatch on every call (docs/decisions.md). The AVX2 ops are C++ ops, called the same way in both.
"""
import dataclasses
import functools

import torch

from . import native
from .reference import *  # noqa: F403 - the seam: every op, then what the CPU runs its own way
from .reference import AMAX_FLOOR, ExpertStack, fp8_by_groups, indexer_scan_op, sort_pairs, sum_pairs, swiglu
from .reference import compress_blocks as reference_compress_blocks
from .reference import fp4_linear as reference_fp4_linear
from .reference import fp8_linear as reference_fp8_linear
from .reference import grouped_experts as reference_grouped_experts
from .reference import indexer_scores as indexer_scores_bmm
from .reference import mhc_post as reference_mhc_post
from .reference import mhc_pre as reference_mhc_pre
from .reference import mhc_sinkhorn as reference_mhc_sinkhorn
from .reference import quantize_per_token as reference_quantize_per_token
from .reference import rope as reference_rope
from .reference import routed_experts as reference_routed_experts
from .reference import sparse_attention as reference_sparse_attention

# Smaller weights stay plain: they sit in cache, where a packed kernel's per-call cost outweighs the bandwidth
# it saves (the crossover: docs/decisions.md, Big weights are packed at load).
PACK_MIN_BYTES = 2 << 20
# int8 x int8 sums of at most this many products are exact in fp32: |sum| <= 128 * 128 * 1024 = 2^24
EXACT_FP32_IN = 1024
CHECK_ROWS = 256      # rows per slice of pack_linear_fp32's bf16 check: no full-size temporaries at load
# The indexer's [batch x rows x heads x blocks] products held at once by torch's scan: small enough to stay
# in cache.
INDEXER_SLICE = 1 << 20


# ---- packed weights ----------------------------------------------------------------------------

def pack_w8a8(weight: torch.Tensor):
    """The int8 weight [out, in] in a packed layout, or None where none is available: the native few-row
    GEMM's (uint8), else oneDNN's blocked layout (an mkldnn tensor); a small weight stays plain; where int8
    GEMMs are slow (an AVX2-only CPU) every weight takes `widen_w8a8`'s form. All give `torch._int_mm`'s
    int32 sums, so the same results, bit for bit.

    `torch._int_mm` and oneDNN's prepacked GEMM read a weight well below the memory bandwidth at decode's few
    rows, the native one near it (benchmarks/README.md: `cpu_gemm.py`)."""
    if weight.numel() < PACK_MIN_BYTES or slow_int8():
        return widen_w8a8(weight)
    if native.packable(weight):
        return native.pack_int8(weight)
    return torch.ops.onednn.qlinear_prepack(weight, [1, weight.shape[1]]) if _onednn_int8() else None


def widen_w8a8(weight: torch.Tensor) -> torch.Tensor | None:
    """An int8 weight where int8 GEMMs are slow (`slow_int8`): packed as a one-expert stack for the pair
    GEMMs where they run (int8 [1, N/16, K/2, 16, 2], any width: exact int32 sums; faster than a small weight's
    fp32 copy for MKL at a few rows, and than torch._int_mm on a large one: docs/decisions.md), else, if small
    and its sums are exact in fp32, held as fp32 of the same values. All give `torch._int_mm`'s sums, bit for
    bit. Else None."""
    if not slow_int8():
        return None
    if native.avx2_available() and weight.shape[0] % native.PAIRS_COLS == 0 and weight.shape[1] % 2 == 0:
        return native.pack_pairs(weight[None])
    if weight.shape[-1] > EXACT_FP32_IN or weight.numel() >= PACK_MIN_BYTES:
        return None
    return weight.float()


@functools.cache
def slow_int8() -> bool:
    """No native kernels and no exact oneDNN int8 (an AVX2-only CPU): `torch._int_mm` is all there is, and
    its time grows linearly in the rows, several times an fp32 GEMM's at a DSpark step's 4-5 rows
    (docs/decisions.md: Small int8 weights widened where int8 GEMMs are slow)."""
    return not native.available() and not _onednn_int8()


def unpack_w8a8(packed) -> torch.Tensor:
    """The plain int8 weight [out, in] back from `pack_w8a8`."""
    if packed.dtype == torch.float32:
        return packed.to(torch.int8)
    if packed.dtype == torch.int8:
        return native.unpack_pairs(packed)[0]
    if packed.dtype == torch.uint8:
        return native.unpack_int8(packed)
    return packed.to_dense().t().contiguous()


def pack_linear_fp32(weight: torch.Tensor, groups: int = 1):
    """A float weight [out, in] packed for the few-row GEMM (the native one, or the AVX2 op), or None (neither
    here, a small weight, or `groups` whose rows don't fill whole blocks). MKL's fp32 GEMM reads a weight near
    the memory bandwidth with 1-2 rows only; the packed kernels stay closer to it at decode's few rows
    (benchmarks/README.md: `cpu_gemm.py`).
    A bf16 weight (a bf16 run's) is packed as bf16: unpacked, each call widened all of it (a V4 Flash head's
    cost: benchmarks/README.md, The official release's bytes held as stored)."""
    if (weight.dtype not in (torch.float32, torch.bfloat16) or weight.numel() * 4 < PACK_MIN_BYTES
            or not native.float_packable(weight, groups)):
        return None
    # a weight the checkpoint stored in bf16 (the W8A8 layout's floats) is held in bf16: half the bytes
    # to read, and the kernel widens it exactly, so the sums are the fp32 copy's, bit for bit
    exact_bf16 = weight.dtype == torch.bfloat16 or all(torch.equal(rows.bfloat16().float(), rows)
                                                       for rows in weight.split(CHECK_ROWS))
    return native.pack_float(weight, torch.bfloat16 if exact_bf16 else torch.float32)


def unpack_linear_fp32(packed: torch.Tensor) -> torch.Tensor:
    return native.unpack_float(packed)


def is_packed(weight: torch.Tensor) -> bool:
    """Whether a linear's weight is packed by `pack_w8a8` or `pack_linear_fp32` for kernels that read it in
    place (a weight held plain is 2-D; a small one widened, or packed as a one-expert stack, counts as
    plain: an expert's stays in its stack, whose pair GEMMs run all its pairs in one call; a large one
    packed so is read in place, as a stack's second copy would double the experts' bytes). Real tensors
    only: traced, an mkldnn tensor reads as a plain one (modules pass `packed` themselves)."""
    return weight.is_mkldnn or (weight.dim() > 2 and (weight.dtype != torch.int8 or weight.numel() >= PACK_MIN_BYTES))


@functools.cache
def _onednn_int8() -> bool:
    """Whether oneDNN's int8 GEMM gives exact int32 sums here. Without VNNI (AVX2 only) it multiplies
    u8 x s8 pairs into saturating int16 sums (vpmaddubsw), so full-range weights come out wrong: the
    probe's extreme and random values catch that, and such a CPU keeps `torch._int_mm`."""
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.cat([torch.full((1, 64), 127, dtype=torch.int8), torch.full((1, 64), -128, dtype=torch.int8),
                       torch.randint(-128, 128, (6, 64), generator=g, dtype=torch.int8)])
        w = torch.cat([torch.full((16, 64), 127, dtype=torch.int8), torch.full((16, 64), -127, dtype=torch.int8),
                       torch.randint(-127, 128, (32, 64), generator=g, dtype=torch.int8)])
        y = packed_int_mm(x, torch.ops.onednn.qlinear_prepack(w, [1, 64]))
        return torch.equal(y, torch._int_mm(x, w.t()).float())
    except (AttributeError, RuntimeError):
        return False


@torch.library.custom_op("dsv4::packed_int_mm", mutates_args=())
def packed_int_mm(q: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """Exact int32 sums of q [m, in] int8 times a packed weight, as fp32 (unit scales, no zero points)."""
    if packed.dtype == torch.uint8:
        return native.int8_mm(q, packed)
    n = packed.shape[1]
    return torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, packed, _ones(n), _zeros(n), None, 1.0, 0,
                                              torch.float32, "none", [None], "")


@packed_int_mm.register_fake
def _(q, packed):
    n = packed.shape[0] * native.BLOCK if packed.dtype == torch.uint8 else packed.shape[1]
    return q.new_empty(q.shape[0], n, dtype=torch.float32)


def int8_packed(q: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """`packed_int_mm`, the native kernel called directly in eager; a widened weight's fp32 GEMM, or a
    weight's pair GEMMs."""
    if packed.dtype == torch.float32:
        return torch.nn.functional.linear(q.float(), packed)
    if packed.dtype == torch.int8:
        return torch.ops.dsv4.pairs_linear(q, packed)
    if packed.dtype == torch.uint8 and not torch.compiler.is_compiling():
        return native.int8_mm(q, packed)
    return packed_int_mm(q, packed)


@functools.cache
def _ones(n: int) -> torch.Tensor:
    return torch.ones(n)


@functools.cache
def _zeros(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.long)


@torch.library.custom_op("dsv4::packed_float_mm", mutates_args=())
def packed_float_mm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [m, in] times a `pack_linear_fp32` weight, fp32."""
    return native.float_mm(x, packed)


@packed_float_mm.register_fake
def _(x, packed):
    return x.new_empty(x.shape[0], packed.shape[0] * native.BLOCK, dtype=torch.float32)


def float_packed(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """`packed_float_mm`: the custom op in a graph being compiled, the kernel itself in eager; without the
    native kernels the AVX2 op, a C++ op in both."""
    if not native.available():
        return torch.ops.dsv4.float_linear(x.float(), packed)
    return packed_float_mm(x, packed) if torch.compiler.is_compiling() else native.float_mm(x, packed)


# ---- the ops that read packed weights ----------------------------------------------------------

def linear_fp32(x: torch.Tensor, weight: torch.Tensor, packed=None) -> torch.Tensor:
    """x W^T in fp32; `packed` = pack_linear_fp32(weight), which is then read instead of `weight`."""
    if packed is not None:
        return float_packed(x.reshape(-1, x.shape[-1]), packed).view(*x.shape[:-1], -1)
    return torch.nn.functional.linear(x.float(), weight.float())


def grouped_projection(x: torch.Tensor, weight: torch.Tensor, packed=None) -> torch.Tensor:
    """The reference's per-group projection; `packed` = pack_linear_fp32(weight as [G*r, d], G), read
    instead of weight: group g's rows are its blocks g*r/32 .. (g+1)*r/32."""
    if packed is None:
        return torch.einsum("bsgd,grd->bsgr", x, weight.to(x.dtype))
    G, r = weight.shape[:2]
    rows, blocks = x.reshape(-1, G, x.shape[-1]), packed.chunk(G)
    y = torch.stack([float_packed(rows[:, g], blocks[g]) for g in range(G)], 1)
    return y.view(*x.shape[:-1], r).to(x.dtype)


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, xq=None,
                packed=None) -> torch.Tensor:
    """The reference's W8A8 linear; `packed` = pack_w8a8(weight), which is then read instead of `weight`."""
    shape = x.shape
    q, sx = xq if xq is not None else quantize_per_token(x.reshape(-1, shape[-1]))
    acc = int8_packed(q, packed) if packed is not None else torch._int_mm(q, weight.t()).float()
    y = acc * sx * weight_scale.view(1, -1).float()
    return y.to(x.dtype).view(*shape[:-1], -1)


# ---- the release's FP8 linears and FP4 experts, read as stored -------------------------------------

# An fp32 run reads the release's bytes in exact fp32 sums (`native.fp8_mm`, `fp4_mm`: bound by decoding and
# multiply-adds on a CPU core, docs/decisions.md); a bf16 run, whose activations are bf16 already, takes the fast
# kernels where the CPU has AVX-512 VNNI and BF16: FP8 in bf16 pair products (`fp8_mm_bf16`: the same products,
# E4M3 subnormals read as 0), FP4 against activations quantised per token to int8 as W8A8's are (`fp4_mm_q8`).
# Both keep each row's result independent of the other rows: verification gives plain decoding's numbers.

def _fast(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and native.lowbit_fast_available()


def release_dtype() -> str | None:
    """bf16 where the fast kernels run: V4 Flash's decode step 1.3-1.5x faster than with fp32's exact kernels, at
    the KL against the float model W8A8 has in fp32 (docs/decisions.md: The release's FP8 and FP4 are multiplied
    as stored)."""
    return "bfloat16" if native.lowbit_fast_available() else None


@torch.library.custom_op("dsv4::lowbit_fp8_mm", mutates_args=())
def lowbit_fp8_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, row0: int, col0: int,
                  fast: bool) -> torch.Tensor:
    """`native.fp8_mm` (or `fp8_mm_bf16`) as an op of a compiled graph (inductor can't lower the release's
    formats)."""
    return (native.fp8_mm_bf16 if fast else native.fp8_mm)(x, weight, scale, (row0, col0))


@lowbit_fp8_mm.register_fake
def _(x, weight, scale, row0, col0, fast):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


@torch.library.custom_op("dsv4::lowbit_fp4_mm", mutates_args=())
def lowbit_fp4_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fast: bool) -> torch.Tensor:
    """`native.fp4_mm` (or `fp4_mm_q8`) as an op of a compiled graph."""
    return (native.fp4_mm_q8 if fast else native.fp4_mm)(x, weight, scale)


@lowbit_fp4_mm.register_fake
def _(x, weight, scale, fast):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offset: tuple[int, int] = (0, 0)):
    """The reference's FP8 linear on the native kernels (the weight read once for all rows)."""
    if not native.lowbit_available():
        return reference_fp8_linear(x, weight, scale, offset)
    rows, fast = x.reshape(-1, x.shape[-1]), _fast(x)
    if torch.compiler.is_compiling():
        y = lowbit_fp8_mm(rows, weight, scale, *offset, fast)
    else:
        y = (native.fp8_mm_bf16 if fast else native.fp8_mm)(rows, weight, scale, offset)
    return y.to(x.dtype).view(*x.shape[:-1], -1)


def fp8_grouped_projection(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offset: tuple[int, int],
                           groups: int) -> torch.Tensor:
    """The reference's grouped FP8 projection: in a bf16 run's eager step, one native call for every group (wo_a's
    8 calls were ~25 us of Python each); else `fp8_linear` group by group."""
    if native.lowbit_available() and _fast(x) and not torch.compiler.is_compiling():
        return native.fp8_mm_bf16_groups(x, weight, scale, offset, groups).to(x.dtype)
    return fp8_by_groups(fp8_linear, x, weight, scale, offset, groups)


def fp4_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference's FP4 linear on the native kernels (in a bf16 run, int8 activations)."""
    if not native.lowbit_available():
        return reference_fp4_linear(x, weight, scale)
    rows, fast = x.reshape(-1, x.shape[-1]), _fast(x)
    if torch.compiler.is_compiling():
        y = lowbit_fp4_mm(rows, weight, scale, fast)
    else:
        y = (native.fp4_mm_q8 if fast else native.fp4_mm)(rows, weight, scale)
    return y.to(x.dtype).view(*x.shape[:-1], -1)


# ---- the indexer's scan ------------------------------------------------------------------------

native_indexer_scores = indexer_scan_op("native_indexer_scores", native.indexer_scores)


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Heads in whole AVX-512 vectors take `native.indexer_scores` (one pass, the relu and weighted sum in
    registers, faster than torch's bmm: docs/decisions.md); the rest torch's scan in cache-sized slices."""
    if native.scannable(q, keys):
        return native_indexer_scores(q, keys, weights)
    return indexer_scores_bmm(q, keys, weights, INDEXER_SLICE)


# ---- attention ------------------------------------------------------------------------------------

def sparse_attention(q: torch.Tensor, sources, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """`native.sparse_attention` (one pass, indexed rows read in place) in eager inference; else the reference."""
    if _eager(q, sink, *(kv for kv, _, _ in sources)) and native.attention_fits(q, sources):
        return native.sparse_attention(q, sources, sink, scale)
    return reference_sparse_attention(q, sources, sink, scale)


def compress_blocks(ring_kv, ring_gate, kv, gate, plan, ratio: int) -> torch.Tensor:
    """`native.compress_blocks` (closing blocks only, candidates read in place) in eager inference; else the
    reference."""
    if _eager(kv, gate) and native.compress_fits(ring_kv, ring_gate, kv, gate, plan):
        return native.compress_blocks(ring_kv, ring_gate, kv, gate, plan, ratio)
    return reference_compress_blocks(ring_kv, ring_gate, kv, gate, plan, ratio)


# ---- small ops in one native call ---------------------------------------------------------------
# mHC (~150 torch ops a sub-layer), RoPE and per-token quantisation run as `native`'s calls in eager inference;
# a graph being compiled (inductor fuses them) and autograd keep the reference.

def _eager(*tensors: torch.Tensor) -> bool:
    return not torch.compiler.is_compiling() and not any(t.requires_grad for t in tensors)


def mhc_pre(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
            hc_eps: float):
    if _eager(h, fn, scale, base) and native.mhc_fits(h):
        return native.mhc_pre(h, fn, scale, base, norm_eps, hc_eps)
    return reference_mhc_pre(h, fn, scale, base, norm_eps, hc_eps)


def mhc_sinkhorn(logits: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    if _eager(logits) and native.sinkhorn_fits(logits):
        return native.mhc_sinkhorn(logits, eps, iters)
    return reference_mhc_sinkhorn(logits, eps, iters)


def mhc_post(x: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    if _eager(x, res, post, comb) and x.dtype == res.dtype and native.mhc_fits(res):
        return native.mhc_post(x, res, post, comb)
    return reference_mhc_post(x, res, post, comb)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`native.rope` (one pass, the reference's bits) in eager inference; else the reference."""
    if _eager(x, cos, sin) and native.rope_rows(x, cos, sin) is not None:
        return native.rope(x, cos, sin)
    return reference_rope(x, cos, sin)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`native.quantize_per_token` (one pass, the reference's bits) in eager inference; else the reference."""
    if _eager(x) and native.quantize_fits(x):
        return native.quantize_per_token(x, AMAX_FLOOR)
    return reference_quantize_per_token(x)


# ---- routed experts on the host ----------------------------------------------------------------

def projection(x, weight, scale, xq=None):
    """A float linear (scale None), W8A8, or the release's FP4 / FP8 (a shared expert's, whole: no tile offset);
    the weight plain or packed (`pack_w8a8`, `pack_linear_fp32`)."""
    if weight.dtype == torch.float4_e2m1fn_x2:
        return fp4_linear(x, weight, scale)
    if weight.dtype == torch.float8_e4m3fn:
        return fp8_linear(x, weight, scale)
    packed = weight if weight.is_mkldnn or weight.dim() > 2 or (scale is not None and weight.dtype != torch.int8) \
        else None
    if scale is None:
        return torch.nn.functional.linear(x, weight.to(x.dtype)) if packed is None \
            else linear_fp32(x, weight, packed).to(x.dtype)
    return w8a8_linear(x, weight, scale, xq, packed)


class TensorExpert:
    """An expert made of its tensors: weights [w1, w3, w2] (float, int8, packed, FP4 or FP8) and their scales."""

    def __init__(self, weights, scales, limit: float):
        self.tensors = (list(weights), list(scales))
        self.limit = limit

    def kernel_tensors(self) -> tuple[list, list]:
        return self.tensors

    def __call__(self, x, routing_weight=None, xq=None):
        """`model.Expert`'s arithmetic on these tensors."""
        (w1, w3, w2), (s1, s3, s2) = self.tensors
        h = swiglu(projection(x, w1, s1, xq), projection(x, w3, s3, xq), self.limit)
        return projection((h if routing_weight is None else h * routing_weight).to(x.dtype), w2, s2)


def routed_experts(x, weights, local, experts, shared=None, xq=None):
    """The reference's `routed_experts`, the routing read on the host at no sync. Experts in a fused-kernel
    table (`expert_table`, built at load) run in one native call: the ~30 small torch ops each expert
    costs around its GEMMs were a third of the MoE's time at V4 Flash's widths. A compiled graph can't
    read the routing: there this is one opaque op (`routed_experts_op`), which finds the table again."""
    if torch.compiler.is_compiling():
        tensors = [e.kernel_tensors() for e in [*experts, *([shared] if shared is not None else [])]]
        q, sx = xq if xq is not None else (None, None)
        return routed_experts_op(x, weights, local, q, sx, [w for ws, _ in tensors for w in ws],
                                 [s for _, ss in tensors for s in ss], experts[0].limit, shared is not None)
    table = find_table(experts, shared is not None)
    if table is not None and table.format == "int8" and xq is not None:
        return native.routed_experts(xq[0], xq[1], weights, local, table, experts[0].limit, x.dtype,
                                     shared is not None)
    if table is not None and table.format == "fp4" and _fast(x):
        return native.fp4_routed_experts(x, weights, local, table, experts[0].limit)
    return reference_routed_experts(x, weights, local, experts, shared, xq)


@torch.library.custom_op("dsv4::routed_experts", mutates_args=())
def routed_experts_op(x: torch.Tensor, weights: torch.Tensor, local: torch.Tensor, xq: torch.Tensor | None,
                    xs: torch.Tensor | None, expert_weights: list[torch.Tensor],
                    expert_scales: list[torch.Tensor | None], limit: float, shared: bool) -> torch.Tensor:
    """`routed_experts` as one op of a compiled graph; the experts' tensors come flat, three each (the
    shared expert's last, with `shared`)."""
    experts = [TensorExpert(expert_weights[i: i + 3], expert_scales[i: i + 3], limit)
               for i in range(0, len(expert_weights), 3)]
    routed, common = (experts[:-1], experts[-1]) if shared else (experts, None)
    return routed_experts(x, weights, local, routed, common, None if xq is None else (xq, xs))


@routed_experts_op.register_fake
def _(x, weights, local, xq, xs, expert_weights, expert_scales, limit, shared):
    return x.new_empty(x.shape, dtype=torch.float32)


def widen_experts(stack: ExpertStack) -> ExpertStack:
    """The stack as the grouped experts read it where int8 GEMMs are slow and `widen_w8a8` would widen each
    expert's weights: packed for the native pair GEMMs (`paired`) where they run, else `widened`. Without
    it a compiled step widens every (row, expert) pair's weight, a DSpark step of the bundled model 78."""
    small = max(stack.w13[0].numel(), stack.w2[0].numel()) < PACK_MIN_BYTES
    if (stack.s13 is None or stack.wide is not None or not small
            or max(stack.w13.shape[-1], stack.w2.shape[-1]) > EXACT_FP32_IN or not slow_int8()):
        return stack
    pairs = native.avx2_available() and all(w.shape[1] % native.PAIRS_COLS == 0 and w.shape[2] % 2 == 0
                                             for w in (stack.w13, stack.w2))
    return paired(stack) if pairs else widened(stack)


def paired(stack: ExpertStack) -> ExpertStack:
    """The stack with its int8 weights also held as the native pair GEMMs read them (`native.pack_pairs`)."""
    return dataclasses.replace(stack, wide=(native.pack_pairs(stack.w13), native.pack_pairs(stack.w2)))


def widened(stack: ExpertStack) -> ExpertStack:
    """The stack with its int8 weights also held as fp32 of their values, [in, E*out]: a GEMM of a few rows
    reads that layout faster than its transpose (docs/decisions.md)."""
    wide = tuple(w.float().flatten(0, 1).t().contiguous() for w in (stack.w13, stack.w2))
    return dataclasses.replace(stack, wide=wide)


def wide_grouped_experts(x, weights, local, experts: ExpertStack, xq=None) -> torch.Tensor:
    """The reference's grouped experts on a paired or widened stack, the same sums bit for bit (int8
    products summed exactly). Paired: each (row, expert) pair multiplied by its expert's int8 weight alone
    (`native.avx2_library`'s op). Widened (no pair op here): with at least half as many pairs as experts,
    one GEMM of the rows against every expert's weight a projection (a read of the stack, [E*out, in], E/k
    times the work), each pair taking its expert's part of its row; with fewer (plain decoding's 1-2 rows),
    each pair's weight gathered (a copy)."""
    T, k = local.shape
    E = experts.w13.shape[0]
    key, order = sort_pairs(local, E)
    group, token = key[order], order // k
    g, pairs = group.clamp(max=E - 1), torch.arange(T * k, device=x.device)
    paired_stack = experts.wide[0].dtype == torch.int8

    def project(rows, rows_of, which):     # each pair's row rows[rows_of[p]] times its expert's weight
        wide = experts.wide[which]
        if paired_stack:
            return torch.ops.dsv4.expert_pairs_mm(rows, rows_of, g, wide)
        if 2 * T * k >= E:
            return torch.mm(rows.float(), wide).view(len(rows), E, -1)[rows_of, g]
        gathered = wide.view(wide.shape[0], E, -1)[:, g].transpose(0, 1)          # [pairs, in, out]
        return torch.bmm(rows.float()[rows_of, None, :], gathered).squeeze(1)

    q, sx = xq if xq is not None else quantize_per_token(x)
    h = (project(q, token, 0) * sx[token] * experts.s13[g, :, 0].float()).to(x.dtype)
    h = swiglu(*h.chunk(2, dim=-1), experts.limit) * weights.flatten()[order, None]   # weight before w2
    q, sx = quantize_per_token(h.to(x.dtype))
    return sum_pairs((project(q, pairs, 1) * sx * experts.s2[g, :, 0].float()).to(x.dtype).float(), group, token, T, E)


def grouped_experts(x, weights, local, experts: ExpertStack, xq=None) -> torch.Tensor:
    """The reference's grouped experts, the same sums. Eager, with the routing read on the host at no sync,
    each expert's rows go through its own slice of the stack in one GEMM a projection: the reference's
    int8 path gathers an expert's weight for every row (a 2,048-row prefill copied 670 MB a projection
    of the bundled model). A compiled graph keeps static shapes: the reference's path. A widened stack
    takes its own path in both."""
    if experts.wide is not None:
        return wide_grouped_experts(x, weights, local, experts, xq)
    if torch.compiler.is_compiling():
        return reference_grouped_experts(x, weights, local, experts, xq)
    T, k = local.shape
    E = experts.w13.shape[0]
    key, order = sort_pairs(local, E)
    counts = torch.bincount(key, minlength=E + 1).tolist()
    y = torch.zeros(T, experts.w2.shape[1], device=x.device, dtype=torch.float32)
    w13, w2 = experts.w13, experts.w2
    start = 0
    for e, n in enumerate(counts[:-1]):
        if n:
            sel = order[start: start + n]
            rows = sel // k
            rows_q = None if xq is None else (xq[0][rows], xq[1][rows])
            s13, s2 = (None, None) if experts.s13 is None else (experts.s13[e], experts.s2[e])
            h = projection(x[rows], w13[e], s13, rows_q)
            h = swiglu(*h.chunk(2, dim=-1), experts.limit) * weights.flatten()[sel, None]    # weight before w2
            y.index_add_(0, rows, projection(h.to(x.dtype), w2[e], s2).float())
        start += n
    return y


def expert_table(experts, shared=None):
    """A MoE layer's experts (then the shared one, if given: objects with `kernel_tensors()`) as the native
    kernels run them in one call, or None where they aren't W8A8 packed for it or the release's FP4 with the
    fast kernels here (they then run one by one). The table holds their tensors' addresses; a live one is
    found again by its first weight (`find_table`)."""
    if native.ExpertTable.format_of(experts[0].kernel_tensors()[0][0]) is None:
        return None
    if (found := find_table(experts, shared is not None)) is not None:
        return found
    tensors = [e.kernel_tensors() for e in [*experts, *([shared] if shared is not None else [])]]
    weights, scales = [ws for ws, _ in tensors], [ss for _, ss in tensors]
    if not native.ExpertTable.usable(weights, scales, shared is not None):
        return None
    return native.ExpertTable(weights, scales, shared is not None)


def find_table(experts, shared: bool):
    """The live table of these experts (holding the shared expert too, with `shared`), or None."""
    first = experts[0].kernel_tensors()[0][0]
    found = native.ExpertTable.find(first, len(experts)) if native.ExpertTable.format_of(first) else None
    return found if found is not None and found.shared >= shared else None
