"""The reference kernels: the seam's every op in plain torch, exact semantics, on any device.

This is the oracle every platform's kernel module is tested against, and the module a platform without
kernels of its own runs. It has no device branch and imports no backend: a platform's module
(`cpu.py`, `cuda.py`, `npu.py`) takes these ops (`from .reference import *`) and replaces what it runs
faster. The reference has no packed weight layouts: its `pack_*` return None, so `packed` is always None
here.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["AMAX_FLOOR", "ExpertStack", "rms_norm", "rope", "quantize_per_token", "linear", "linear_fp32",
           "pack_linear_fp32", "unpack_linear_fp32", "grouped_projection", "compress_pool", "compress_blocks",
           "pack_w8a8", "unpack_w8a8", "is_packed", "w8a8_linear", "sparse_attention", "indexer_scores", "topk_blocks",
           "moe_gate", "swiglu", "routed_experts", "expert_table", "grouped_linear", "grouped_experts", "widen_experts",
           "mhc_pre", "mhc_sinkhorn", "mhc_post", "mhc_head",
           "FP8_BLOCK", "FP4_BLOCK", "fp8_to_float", "fp4_to_float", "fp8_linear", "fp8_by_groups",
           "fp8_grouped_projection", "fp4_linear", "fp4_grouped_linear"]

# Activations whose |max| is below this quantise with this amax, so an all-zero row maps to zeros.
AMAX_FLOOR = 1e-4


@dataclass
class ExpertStack:
    """A rank's routed experts stacked for grouped GEMMs, read in place.

    w13 [E, 2*inter, dim] (each expert's w1 rows, then its w3 rows), w2 [E, dim, inter]: int8 with
    fp32 per-channel scales s13 [E, 2*inter, 1] and s2 [E, dim, 1], float with scales None, or the release's
    packed FP4 ([E, ., in/2] float4_e2m1fn_x2) with E8M0 scales per 32 inputs ([E, ., in/32]).
    limit: the SwiGLU clamp (0 = none). wide: (w13, w2) also held in a layout of the platform's own (as
    fp32 of the same values, or repacked), where its kernels read them so (`widen_experts`)."""
    w13: torch.Tensor
    w2: torch.Tensor
    s13: torch.Tensor | None
    s2: torch.Tensor | None
    limit: float
    wide: tuple[torch.Tensor, torch.Tensor] | None = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of the last 2*cos.shape[-1] dims.

    cos/sin broadcast against x[..., :rd/2]; pass -sin for the inverse rotation.
    """
    rd = cos.shape[-1] * 2
    head, tail = x[..., :-rd], x[..., -rd:].float()
    a, b = tail[..., 0::2], tail[..., 1::2]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((head, rotated.to(x.dtype)), dim=-1)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: scale = amax/127, q = round(x/scale)."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp(min=AMAX_FLOOR) / 127.0
    q = torch.round(xf / scale).clamp(-127, 127).to(torch.int8)
    return q, scale


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight.to(x.dtype))


def linear_fp32(x: torch.Tensor, weight: torch.Tensor, packed=None) -> torch.Tensor:
    """x W^T computed in fp32 whatever the stored dtypes (the compressors and the LM head)."""
    return F.linear(x.float(), weight.float())


def pack_linear_fp32(weight: torch.Tensor, groups: int = 1):
    """A float weight in a packed layout of the platform's own, or None (the reference has none)."""
    return None


def unpack_linear_fp32(packed):
    """The plain weight back from `pack_linear_fp32`'s layout: the reference has none to read."""
    raise TypeError("the reference kernels hold no packed weights: unpack with the kernels that packed it")


def grouped_projection(x: torch.Tensor, weight: torch.Tensor, packed=None) -> torch.Tensor:
    """Per-group low-rank projection: x [B,S,G,d], weight [G,r,d] -> [B,S,G,r] (attention's wo_a)."""
    return torch.einsum("bsgd,grd->bsgr", x, weight.to(x.dtype))


def compress_pool(kv: torch.Tensor, gate: torch.Tensor, valid: torch.Tensor, ratio: int) -> torch.Tensor:
    """One compressed KV entry per closing block: candidates kv, gate [B,n,c,C] fp32 (c = span*ratio
    rows, C = span*d channels), valid [B,n,c]; the channels pooled with a per-channel softmax of the
    gate over the rows. With span = 2 (ratio 4) the earlier block's rows give their first d channels
    and this block's rows their second d. Returns [B,n,d] fp32."""
    gate = gate.masked_fill(~valid[..., None], float("-inf"))
    if kv.shape[2] == 2 * ratio:
        d = kv.shape[-1] // 2
        kv = torch.cat([kv[:, :, :ratio, :d], kv[:, :, ratio:, d:]], dim=2)
        gate = torch.cat([gate[:, :, :ratio, :d], gate[:, :, ratio:, d:]], dim=2)
    return (kv * gate.softmax(dim=2)).sum(dim=2)


def compress_blocks(ring_kv, ring_gate, kv, gate, plan, ratio: int) -> torch.Tensor:
    """Every block slot of a call's compress plan (`model.CompressPlan`) pooled from its candidate rows (the ring's
    of earlier calls, this call's kv and gate rows) -> [B,n,d] fp32. A slot whose block does not close is pooled
    too (its entry goes to the sink slot, never read): static shapes, no host read."""
    return compress_pool(plan.candidates(ring_kv, kv), plan.candidates(ring_gate, gate), plan.cand_valid, ratio)


def pack_w8a8(weight: torch.Tensor):
    """An int8 weight in a packed layout of the platform's own, or None (the reference has none)."""
    return None


def unpack_w8a8(packed):
    """The plain int8 weight back from `pack_w8a8`'s layout: the reference has none to read."""
    raise TypeError("the reference kernels hold no packed weights: unpack with the kernels that packed it")


def is_packed(weight: torch.Tensor) -> bool:
    """Whether a linear's packed weight is in a layout its kernels read in place (the reference has none)."""
    return False


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, xq=None,
                packed=None) -> torch.Tensor:
    """int8 x int8 -> int32 GEMM; y = acc * token_scale * channel_scale. weight [out,in] int8, scale [out,1].

    `xq` = quantize_per_token(x rows), when the caller feeds the same x to several linears."""
    shape = x.shape
    q, sx = xq if xq is not None else quantize_per_token(x.reshape(-1, shape[-1]))
    y = torch._int_mm(q, weight.t()).float() * sx * weight_scale.view(1, -1).float()
    return y.to(x.dtype).view(*shape[:-1], -1)


# --------------------------------------------------------------------------------------------------
# The official release's own formats, read as stored: FP8 E4M3 linears with an E8M0 (or fp32) scale per
# 128 x 128 tile, routed experts as packed FP4 E2M1 (two per byte) with an E8M0 scale per 32 inputs.
# --------------------------------------------------------------------------------------------------

FP8_BLOCK = 128
FP4_BLOCK = 32
FP4_VALUES = (0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6)


def fp8_to_float(w: torch.Tensor, scale: torch.Tensor, offset: tuple[int, int] = (0, 0),
                 block: int = FP8_BLOCK) -> torch.Tensor:
    """W[i,j] = e4m3(w[i,j]) * scale[(r+i)//block, (c+j)//block], in fp32, (r, c) = `offset`.

    `scale` is a grid of tiles (E8M0 = 2^(e-127), or fp32) whose tile (0, 0) starts `offset` rows and
    columns before w's first element: the whole tensor's grid with w a slice starting at (r, c), or the
    grid's tiles that cover the slice with the offset taken modulo `block`."""
    (r, c), (rows, cols) = offset, w.shape
    s = scale[r // block: -(-(r + rows) // block), c // block: -(-(c + cols) // block)].float()
    s = s.repeat_interleave(block, 0)[r % block: r % block + rows]
    s = s.repeat_interleave(block, 1)[:, c % block: c % block + cols]
    return w.float() * s


def fp4_to_float(packed: torch.Tensor, scale: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """Packed E2M1 [..., out, in/2] (low nibble = element 2k, high nibble = 2k+1; any 1-byte dtype) -> fp32
    [..., out, in], each group of `block` inputs times its E8M0 (or fp32) scale [..., out, in/block]."""
    b = packed.view(torch.uint8)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2).long()
    values = torch.tensor(FP4_VALUES, device=b.device)[codes]
    return (values.unflatten(-1, (-1, block)) * scale.float()[..., None]).flatten(-2)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offset: tuple[int, int] = (0, 0)):
    """x W^T with W the FP8 weight [out, in] decoded with its tile scales (`fp8_to_float`), in fp32; x's dtype
    out."""
    return F.linear(x.float(), fp8_to_float(weight, scale, offset)).to(x.dtype)


def fp8_grouped_projection(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offset: tuple[int, int],
                           groups: int) -> torch.Tensor:
    """x [..., G, d] through the G projections an FP8 weight's rows hold (attention's wo_a) -> [..., G, out/G]."""
    return fp8_by_groups(fp8_linear, x, weight, scale, offset, groups)


def fp8_by_groups(linear, x, weight, scale, offset, groups: int) -> torch.Tensor:
    """`fp8_grouped_projection` group by group through `linear` (a platform's `fp8_linear`): each group its rows,
    the scale tiles covering them and where they start in their first tile."""
    r = weight.shape[0] // groups
    out = []
    for g in range(groups):
        first, last = offset[0] + g * r, offset[0] + (g + 1) * r
        out.append(linear(x[..., g, :], weight[g * r:(g + 1) * r], scale[first // FP8_BLOCK: -(-last // FP8_BLOCK)],
                          (first % FP8_BLOCK, offset[1])))
    return torch.stack(out, -2)


def fp4_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x W^T with W the packed FP4 weight [out, in/2] decoded with its group scales [out, in/32], in fp32; x's
    dtype out."""
    return F.linear(x.float(), fp4_to_float(weight, scale)).to(x.dtype)


def fp4_grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Row a of x [A, in] times expert group[a]'s packed FP4 weight (weight [G, out, in/2], scale [G, out, in/32]),
    in fp32; a row whose group is G (another rank's expert) comes out undefined. Returns fp32 [A, out]. The
    reference decodes each row's weight (a copy per row): the oracle, and the fallback."""
    g = group.clamp(max=weight.shape[0] - 1)
    rows = fp4_to_float(weight.view(torch.uint8)[g], scale.view(torch.uint8)[g].view(scale.dtype))
    return torch.bmm(rows, x.float()[:, :, None]).squeeze(-1)


def sparse_attention(q: torch.Tensor, sources, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """Multi-query attention over several KV sources read in place, one softmax across them all, with
    a per-head sink logit in the denominator (it adds exp(sink) there and contributes no value).

    q [B,S,H,D]; each source is (kv [B,N,D] (K = V), mask, idx): with idx None the whole of kv is
    read and mask [B,S,N] says which rows each query sees; with idx [B,S,M] each query reads only the
    rows idx of kv, and mask [B,S,M] says which of those count. Only the small logits are joined,
    never the caches."""
    qf = q.float() * scale
    logits, values = [], []
    for kv, mask, idx in sources:
        if idx is None:
            s = torch.einsum("bshd,bnd->bshn", qf, kv.float())
            values.append((kv, "bshn,bnd->bshd"))
        else:
            rows = kv[torch.arange(kv.shape[0], device=kv.device)[:, None, None], idx.clamp(0, kv.shape[1] - 1)]
            s = torch.einsum("bshd,bsmd->bshm", qf, rows.float())
            values.append((rows, "bshm,bsmd->bshd"))
        # the mask as an additive bias over [B,S,N], broadcast over the heads: a broadcast masked_fill
        # of the logits costs several times more on the CPU
        logits.append(s.add_(torch.where(mask, 0.0, float("-inf"))[:, :, None]))
    # the sink is one more logit with no value: a single softmax over [logits; sink]. torch's softmax
    # also keeps masked (-inf) logits fast, where a plain exp of them takes a slow path on the CPU
    # (docs/decisions.md: One softmax over [logits; sink])
    logits.append(sink.float().view(1, 1, -1, 1).expand(*qf.shape[:3], 1))
    p = torch.cat(logits, dim=-1).softmax(-1)
    parts = p.split([t.shape[-1] for t in logits], dim=-1)[:-1]
    o = sum(torch.einsum(eq, w, kv.float()) for (kv, eq), w in zip(values, parts))
    return o.to(q.dtype)


# Elements of the indexer's [batch x rows x heads x blocks] products held at once: a bounded scratch
# (256 MB), so even a 1M-token batch of 8 takes a few slices (each slice costs kernel launches).
INDEXER_SLICE = 1 << 26


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, slice_elems: int = INDEXER_SLICE):
    """Lightning-indexer scores sum_h weights[h] * relu(q_h . k_t) of every block t, per slice of keys a bmm
    into the [heads x keys] products, their relu, and a bmm for the weighted sum.

    q [B,S,H,D], keys [B,T,D] (read in place, in slices of `slice_elems` products), weights [B,S,H] fp32
    -> [B,S,T] fp32."""
    B, S, H, D = q.shape
    T = keys.shape[1]
    qf, w = q.float().reshape(B, S * H, D), weights.float().reshape(B * S, 1, H)
    out = torch.empty(B, S, T, device=q.device, dtype=torch.float32)
    step = max(slice_elems // (B * S * H), 1)
    for a in range(0, T, step):
        b = min(a + step, T)
        dots = torch.bmm(qf, keys[:, a:b].float().transpose(1, 2)).relu_()            # [B, S*H, n]
        out[:, :, a:b] = torch.bmm(w, dots.view(B * S, H, b - a)).view(B, S, b - a)
    return out


def indexer_scan_op(name: str, scan):
    """A platform's own scan `scan(q, keys, weights) -> [B,S,T] fp32`, called directly in eager and as the
    custom op `dsv4::<name>` inside a compiled graph (opaque to the compiler; in eager it is called directly,
    without an op's dispatch cost: docs/decisions.md, Eager steps call the native kernels directly)."""
    def run(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return scan(q, keys, weights)

    op = torch.library.custom_op(f"dsv4::{name}", run, mutates_args=())
    op.register_fake(lambda q, keys, weights: q.new_empty(*q.shape[:2], keys.shape[1], dtype=torch.float32))
    return lambda q, keys, weights: op(q, keys, weights) if torch.compiler.is_compiling() else scan(q, keys, weights)


def topk_blocks(scores: torch.Tensor, closed: torch.Tensor, k: int) -> torch.Tensor:
    """The k best blocks per query, best first, among blocks t < closed[b,s]; ties go to the lower
    block index, so the choice depends neither on how many blocks the cache holds nor on the call's
    other rows. Where fewer than k blocks are closed, the rest of the row is the lowest unclosed ones.

    scores [B,S,T] fp32, closed [B,S] -> [B,S,k] int64. One exact top-k over int64 keys: the score's
    bits mapped to an order-preserving integer, then the reversed block index."""
    T = scores.shape[-1]
    t = torch.arange(T, device=scores.device, dtype=torch.int32)
    scores = torch.where(t < closed[..., None], scores + 0.0, float("-inf"))       # + 0.0: -0.0 ties +0.0
    bits = scores.view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)                        # monotone in the score
    # the key's two 32-bit halves side by side, read as one little-endian int64 (every torch device):
    # one int32 copy, where widening, shifting and or-ing int64s took 3 passes
    # (docs/decisions.md: Deterministic top-k)
    key = torch.stack([(T - 1 - t).expand_as(ordered), ordered], -1).view(torch.int64)[..., 0]
    return key.topk(k, dim=-1).indices


def score(logits: torch.Tensor, func: str) -> torch.Tensor:
    if func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(-1)


def moe_gate(logits, bias, tid2eid, input_ids, topk: int, func: str, route_scale: float):
    """Router: scores from the gate's fp32 logits (x W^T, `linear_fp32`), experts by hash table or by biased top-k;
    weights renormalised."""
    s = score(logits, func)
    if tid2eid is not None:
        idx = tid2eid[input_ids.reshape(-1)].long()
    else:
        idx = (s + bias.float() if bias is not None else s).topk(topk, dim=-1).indices
    w = s.gather(-1, idx)
    if func != "softmax":
        w = w / w.sum(-1, keepdim=True)
    return w * route_scale, idx


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek V4's SwiGLU in fp32: the gate clamped from above and the up projection both ways
    (limit 0: no clamp)."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


def sort_pairs(local: torch.Tensor, n_local: int):
    """The T*k (token, expert) pairs of routing `local` [T, k] sorted by expert, stably: (key [T*k], each
    pair's expert with n_local for another rank's, and order, the sorted pairs' flat indices)."""
    key = torch.where((local >= 0) & (local < n_local), local, n_local).flatten()
    return key, key.argsort(stable=True)


def sum_pairs(out: torch.Tensor, group: torch.Tensor, token: torch.Tensor, T: int, n_local: int) -> torch.Tensor:
    """Sorted pairs' outputs `out` summed back per token in fp32 [T, dim], in sorted order; pairs of
    another rank's experts (group == n_local) add nothing."""
    out = torch.where((group < n_local)[:, None], out, 0.0)
    return torch.zeros(T, out.shape[1], device=out.device, dtype=torch.float32).index_add_(0, token, out)


def routed_experts(x, weights, local, experts, shared=None, xq=None) -> torch.Tensor:
    """Routed experts one at a time, each on its own rows (then the `shared` expert, if given, on every row),
    each expert's weights read in place; the rows per expert are read on the host (a device sync where
    tensors aren't in host memory).

    x [T, dim]; weights, local [T, k]: routing weights and expert indices relative to this rank's first
    expert; experts: callables expert(rows, routing_weight [n,1], rows_q) with `xq` = x quantised per
    token. Pairs routed to another rank's experts add nothing. Returns fp32 [T, dim]."""
    n_local, k = len(experts), local.shape[1]
    key, order = sort_pairs(local, n_local)
    counts = torch.bincount(key, minlength=n_local + 1).tolist()
    y = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
    start = 0
    for expert, n in zip(experts, counts[:-1]):
        if n:
            sel = order[start: start + n]
            rows = sel // k
            rows_q = None if xq is None else (xq[0][rows], xq[1][rows])
            y.index_add_(0, rows, expert(x[rows], weights.flatten()[sel, None], rows_q).float())
        start += n
    if shared is not None:
        y += shared(x, None, xq).float()
    return y


def release_dtype() -> str | None:
    """The activations' dtype `--dtype auto` takes where the official release's FP8/FP4 are held as stored, when
    it is not the platform's default (its kernels are faster in it), or None."""
    return None


def expert_table(experts, shared=None):
    """A MoE layer's experts (then the shared one, if given) as a fused kernel of the platform's holds them,
    or None (the reference has none: `routed_experts` runs them one by one)."""
    return None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale, offs: torch.Tensor, group: torch.Tensor,
                   xq=None) -> torch.Tensor:
    """Rows x [A, in] sorted by group; rows offs[g-1]:offs[g] are multiplied by weight[g] ([G, out, in]).
    Rows past offs[-1] come out undefined. `group` [A] is each row's group (used by the gather fallback).

    bf16 weights use torch's grouped GEMM, which reads each group's weight in place (it takes bf16 only).
    torch has no grouped int8 GEMM, so int8 rows (and other float dtypes) gather their weights: a copy
    per row, the fallback, exact while int8 sums stay below 2^24. The release's FP4 experts take
    `fp4_grouped_linear`."""
    if weight.dtype == torch.float4_e2m1fn_x2:
        return fp4_grouped_linear(x, weight, weight_scale, group).to(x.dtype)
    if weight_scale is None and x.dtype == torch.bfloat16:
        return torch._grouped_mm(x, weight.transpose(1, 2).to(x.dtype), offs=offs)
    g = group.clamp(max=weight.shape[0] - 1)
    if weight_scale is None:
        return torch.bmm(weight[g].to(x.dtype), x[:, :, None]).squeeze(-1)
    q, sx = xq if xq is not None else quantize_per_token(x)
    acc = torch.bmm(weight[g].float(), q.float()[:, :, None]).squeeze(-1)
    return (acc * sx * weight_scale[g, :, 0].float()).to(x.dtype)


def widen_experts(stack: ExpertStack) -> ExpertStack:
    """The stack as this platform's grouped experts read it (the reference: as it is)."""
    return stack


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, local: torch.Tensor, experts, xq=None,
                    linear=None) -> torch.Tensor:
    """Routed experts with the routing on the device and static shapes, for graph capture.

    x [T, dim]; weights, local [T, k]: routing weights and expert indices relative to this rank's
    first expert; experts: an ExpertStack. The T*k (token, expert) pairs are sorted by expert, each
    projection is one grouped GEMM over the stacked weights, and the weighted rows are summed back
    per token. Pairs routed to another rank's experts sort last and add nothing. Returns fp32 [T, dim].
    `linear`: a platform's `grouped_linear` (default the reference's)."""
    grouped = linear or grouped_linear
    T, k = local.shape
    E = experts.w13.shape[0]
    key, order = sort_pairs(local, E)
    counts = torch.zeros(E + 1, dtype=torch.long, device=x.device).scatter_add_(0, key, torch.ones_like(key))
    offs = counts[:E].cumsum(0).to(torch.int32)
    group, token = key[order], order // k
    rows_q = None if xq is None else (xq[0][token], xq[1][token])
    h = grouped(x[token], experts.w13, experts.s13, offs, group, rows_q)
    h = swiglu(*h.chunk(2, dim=-1), experts.limit) * weights.flatten()[order, None]   # weight before w2
    return sum_pairs(grouped(h.to(x.dtype), experts.w2, experts.s2, offs, group).float(), group, token, T, E)


# --------------------------------------------------------------------------------------------------
# mHC (manifold-constrained hyper-connections), split as torch_npu's npu_mhc_pre / npu_mhc_sinkhorn /
# npu_mhc_post split it: the sub-layer runs between pre and post.
# --------------------------------------------------------------------------------------------------

def mhc_pre(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
            hc_eps: float):
    """Collapse the n streams h [..., n, D] into the sub-layer's input, and the mixing weights.

    mix = (h flattened @ fn^T) / rms(h flattened); pre = sigmoid(mix_pre * scale[0] + base_pre) + hc_eps;
    post = 2 * sigmoid(mix_post * scale[1] + base_post); comb logits = mix_res * scale[2] + base_res
    as [n, n] (row-major). fn [n*n + 2n, n*D] holds the pre, post and res rows in that order.
    Returns (x = sum_i pre_i * h_i in h's dtype, post fp32 [..., n], comb logits fp32 [..., n, n])."""
    n = h.shape[-2]
    xf = h.flatten(-2).float()
    mix = F.linear(xf, fn.float()) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(mix[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb = (mix[..., 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n))
    x = (pre.unsqueeze(-1) * h.float()).sum(-2).to(h.dtype)
    return x, post, comb


def mhc_sinkhorn(logits: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    """DeepSeek V4's Sinkhorn of the comb logits [..., n, n] (fp32): softmax over the last dim + eps,
    a column normalisation, then iters-1 rounds of row then column normalisation, every
    denominator + eps."""
    # tokens last ([n, n, tokens]): each of the ~120 small ops then runs over contiguous vectors of
    # tokens, where an inner dim of n = 4 doesn't vectorise (docs/decisions.md: mHC on the CPU tokens-last)
    shape = logits.shape
    comb = logits.reshape(-1, *shape[-2:]).permute(1, 2, 0).softmax(1).contiguous() + eps
    comb = comb / (comb.sum(0, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(1, keepdim=True) + eps)
        comb = comb / (comb.sum(0, keepdim=True) + eps)
    return comb.permute(2, 0, 1).reshape(shape).contiguous()      # mhc_post's bmm wants it contiguous


def mhc_post(x: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams from the sub-layer output x [B,S,D] and the old streams res [B,S,n,D]:
    h_k = post_k * x + sum_j comb[j,k] * res_j, in x's dtype."""
    *lead, n, D = res.shape
    out = torch.baddbmm((post.unsqueeze(-1) * x.float().unsqueeze(-2)).view(-1, n, D),
                        comb.transpose(-1, -2).reshape(-1, n, n), res.float().reshape(-1, n, D))
    return out.view(*lead, n, D).to(x.dtype)


def mhc_head(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
             hc_eps: float) -> torch.Tensor:
    """The final collapse of the streams h [..., n, D] before the norm and head: mhc_pre's pre
    weights alone (fn [n, n*D], scale [1], base [n])."""
    xf = h.flatten(-2).float()
    mix = F.linear(xf, fn.float()) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(mix * scale + base) + hc_eps
    return (pre.unsqueeze(-1) * h.float()).sum(-2).to(h.dtype)
