"""Torch reference backend: plain torch ops, exact semantics, runs anywhere.

Every other backend is tested against these functions.
"""
import functools

import torch
import torch.nn.functional as F

from . import native

# Activations whose |max| is below this quantise with this amax, so an all-zero row maps to zeros.
AMAX_FLOOR = 1e-4


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
    """x W^T computed in fp32 whatever the stored dtypes (the compressors and the LM head);
    `packed` = pack_linear_fp32(weight), which is then read instead of `weight`."""
    if packed is not None:
        return float_packed(x.reshape(-1, x.shape[-1]), packed).view(*x.shape[:-1], -1)
    return F.linear(x.float(), weight.float())


@torch.library.custom_op("dsv4::packed_float_mm", mutates_args=())
def packed_float_mm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [m, in] times a `pack_linear_fp32` weight, fp32 (a custom op: inductor can't lower the layout)."""
    return native.float_mm(x, packed)


@packed_float_mm.register_fake
def _(x, packed):
    return x.new_empty(x.shape[0], packed.shape[0] * native.BLOCK, dtype=torch.float32)


def float_packed(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """`packed_float_mm`: the custom op in a graph being compiled, the kernel itself in eager, where the
    op's dispatch cost ~20 us a call (a third of a small expert's GEMM)."""
    return packed_float_mm(x, packed) if torch.compiler.is_compiling() else native.float_mm(x, packed)


def grouped_projection(x: torch.Tensor, weight: torch.Tensor, packed=None) -> torch.Tensor:
    """Per-group low-rank projection: x [B,S,G,d], weight [G,r,d] -> [B,S,G,r] (attention's wo_a);
    `packed` = pack_linear_fp32(weight as [G*r, d], G), read instead of weight: group g's rows are
    its blocks g*r/32 .. (g+1)*r/32."""
    if packed is None:
        return torch.einsum("bsgd,grd->bsgr", x, weight.to(x.dtype))
    G, r = weight.shape[:2]
    rows, blocks = x.reshape(-1, G, x.shape[-1]), packed.chunk(G)
    y = torch.stack([float_packed(rows[:, g], blocks[g]) for g in range(G)], 1)
    return y.view(*x.shape[:-1], r).to(x.dtype)


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


# Smaller weights stay plain: they sit in cache, where a packed kernel's per-call cost (up to ~1 ms
# for oneDNN with a single row of a tiny weight) outweighs the bandwidth it saves; measured crossover 1-2 MiB.
PACK_MIN_BYTES = 2 << 20
CHECK_ROWS = 256      # rows per slice of pack_linear_fp32's bf16 check: no full-size temporaries at load


def pack_w8a8(weight: torch.Tensor):
    """The int8 weight [out, in] in a packed CPU kernel's layout, or None where none is available or the
    weight is small: the native few-row GEMM's (`native.py`, uint8), else oneDNN's blocked layout (an
    mkldnn tensor). Both give `torch._int_mm`'s int32 sums, so the same results, bit for bit.

    On the CPU `torch._int_mm` reads a weight at about 0.4 of the memory bandwidth for any row count,
    oneDNN's prepacked GEMM at 0.3-0.75 (bimodal from run to run), the native one at 0.8-1.0 for 1 to
    16 rows (`benchmarks/cpu_gemm.py`)."""
    if weight.device.type != "cpu" or weight.numel() < PACK_MIN_BYTES:
        return None
    if native.packable(weight):
        return native.pack_int8(weight)
    return torch.ops.onednn.qlinear_prepack(weight, [1, weight.shape[1]]) if _onednn_int8() else None


def is_packed(weight: torch.Tensor) -> bool:
    """Whether a linear's weight is `pack_w8a8`'s or `pack_linear_fp32`'s (a weight held plain is 2-D).
    Real tensors only: traced, an mkldnn tensor reads as a plain one (modules pass `packed` themselves)."""
    return weight.is_mkldnn or weight.dim() > 2


@functools.cache
def _onednn_int8() -> bool:
    try:
        w = torch.ones(2, 4, dtype=torch.int8)
        y = packed_int_mm(torch.ones(1, 4, dtype=torch.int8), torch.ops.onednn.qlinear_prepack(w, [1, 4]))
        return torch.equal(y, torch.full((1, 2), 4.0))
    except (AttributeError, RuntimeError):
        return False


@torch.library.custom_op("dsv4::packed_int_mm", mutates_args=())
def packed_int_mm(q: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """Exact int32 sums of q [m, in] int8 times a packed weight, as fp32 (unit scales, no zero points).
    A custom op: the compiler keeps the call as it is (inductor can't lower either packed weight)."""
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
    """`packed_int_mm`, the native kernel called directly in eager (as `float_packed`)."""
    if packed.dtype == torch.uint8 and not torch.compiler.is_compiling():
        return native.int8_mm(q, packed)
    return packed_int_mm(q, packed)


@functools.cache
def _ones(n: int) -> torch.Tensor:
    return torch.ones(n)


@functools.cache
def _zeros(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.long)


def unpack_w8a8(packed) -> torch.Tensor:
    """The plain int8 weight [out, in] back from `pack_w8a8`."""
    if packed.dtype == torch.uint8:
        return native.unpack_int8(packed)
    return packed.to_dense().t().contiguous()


def pack_linear_fp32(weight: torch.Tensor, groups: int = 1):
    """An fp32 weight [out, in] packed for the native few-row GEMM, or None (not the CPU, no native
    kernels, a small weight, or `groups` whose rows don't fill whole blocks). MKL's fp32 GEMM reads a
    weight at 0.9 of the memory bandwidth with 1-2 rows but 0.3-0.45 with 4-16; the native one at
    0.9-1.0 with 1-4 rows, 0.7 with 8 (`benchmarks/cpu_gemm.py`)."""
    if (weight.dtype != torch.float32 or weight.numel() * 4 < PACK_MIN_BYTES
            or (weight.shape[0] // groups) % native.BLOCK or not native.packable(weight)):
        return None
    # a weight the checkpoint stored in bf16 (the W8A8 layout's floats) is held in bf16: half the bytes
    # to read, and the kernel widens it exactly, so the sums are the fp32 copy's, bit for bit
    exact_bf16 = all(torch.equal(rows.bfloat16().float(), rows) for rows in weight.split(CHECK_ROWS))
    return native.pack_float(weight, torch.bfloat16 if exact_bf16 else torch.float32)


def unpack_linear_fp32(packed: torch.Tensor) -> torch.Tensor:
    return native.unpack_float(packed)


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, xq=None,
                packed=None) -> torch.Tensor:
    """int8 x int8 -> int32 GEMM; y = acc * token_scale * channel_scale. weight [out,in] int8, scale [out,1].

    `xq` = quantize_per_token(x rows), when the caller feeds the same x to several linears;
    `packed` = pack_w8a8(weight), which is then read instead of `weight`."""
    shape = x.shape
    q, sx = xq if xq is not None else quantize_per_token(x.reshape(-1, shape[-1]))
    if packed is not None:
        acc = int8_packed(q, packed)
    else:
        rows = q.shape[0]
        if q.is_cuda and rows <= 16:   # the cuBLAS int8 GEMM behind torch._int_mm needs more than 16 rows
            q = F.pad(q, (0, 0, 0, 17 - rows))
        acc = torch._int_mm(q, weight.t())[:rows].float()
    y = acc * sx * weight_scale.view(1, -1).float()
    return y.to(x.dtype).view(*shape[:-1], -1)


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
    # also keeps masked (-inf) logits fast, where a plain exp of them takes a slow path (~14x on the CPU)
    logits.append(sink.float().view(1, 1, -1, 1).expand(*qf.shape[:3], 1))
    p = torch.cat(logits, dim=-1).softmax(-1)
    parts = p.split([t.shape[-1] for t in logits], dim=-1)[:-1]
    o = sum(torch.einsum(eq, w, kv.float()) for (kv, eq), w in zip(values, parts))
    return o.to(q.dtype)


# Elements of the indexer's [batch x rows x heads x blocks] products held at once. On the CPU the scan
# goes through the keys in slices small enough that its intermediate stays in cache; on an accelerator
# each slice costs kernel launches (a 1M-token batch of 8 would take 128 slices), so there it is a
# bounded scratch (256 MB) instead.
INDEXER_SLICE = 1 << 20
INDEXER_SLICE_ACCELERATOR = 1 << 26


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer scores sum_h weights[h] * relu(q_h . k_t) of every block t.

    q [B,S,H,D], keys [B,T,D] (read in place, in slices), weights [B,S,H] fp32 -> [B,S,T] fp32.
    On a CPU with the native kernels, heads in whole AVX-512 vectors take `native.indexer_scores`
    (one pass, the relu and weighted sum in registers: 2-3x torch's bmm at V4 Flash's widths)."""
    if native.scannable(q, keys):
        return native_indexer_scores(q, keys, weights)
    return indexer_scores_bmm(q, keys, weights)


def indexer_scores_bmm(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`indexer_scores` in torch ops on any device: per slice of keys, a bmm into the [heads x keys]
    products, their relu, and a bmm for the weighted sum."""
    B, S, H, D = q.shape
    T = keys.shape[1]
    qf, w = q.float().reshape(B, S * H, D), weights.float().reshape(B * S, 1, H)
    out = torch.empty(B, S, T, device=q.device, dtype=torch.float32)
    step = max((INDEXER_SLICE if q.device.type == "cpu" else INDEXER_SLICE_ACCELERATOR) // (B * S * H), 1)
    for a in range(0, T, step):
        b = min(a + step, T)
        dots = torch.bmm(qf, keys[:, a:b].float().transpose(1, 2)).relu_()            # [B, S*H, n]
        out[:, :, a:b] = torch.bmm(w, dots.view(B * S, H, b - a)).view(B, S, b - a)
    return out


def indexer_scan_op(name: str, scan):
    """A platform's own scan `scan(q, keys, weights) -> [B,S,T] fp32`, called directly in eager and as the
    custom op `dsv4::<name>` inside a compiled graph (opaque to the compiler; in eager an op's dispatch
    would cost ~20 us a call)."""
    def run(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return scan(q, keys, weights)

    op = torch.library.custom_op(f"dsv4::{name}", run, mutates_args=())
    op.register_fake(lambda q, keys, weights: q.new_empty(*q.shape[:2], keys.shape[1], dtype=torch.float32))
    return lambda q, keys, weights: op(q, keys, weights) if torch.compiler.is_compiling() else scan(q, keys, weights)


native_indexer_scores = indexer_scan_op("native_indexer_scores", native.indexer_scores)


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
    # one int32 copy, where widening, shifting and or-ing int64s took 3 passes (1.4x at 160 x 896)
    key = torch.stack([(T - 1 - t).expand_as(ordered), ordered], -1).view(torch.int64)[..., 0]
    return key.topk(k, dim=-1).indices


def score(logits: torch.Tensor, func: str) -> torch.Tensor:
    if func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(-1)


def moe_gate(x, weight, bias, tid2eid, input_ids, topk: int, func: str, route_scale: float):
    """Router: scores from the gate, experts by hash table or by biased top-k; weights renormalised."""
    s = score(F.linear(x.float(), weight.float()), func)
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


def expert_table(experts, shared=None):
    """A MoE layer's experts (then the shared one, if given: objects with `kernel_tensors()`) as
    `routed_experts` runs them: the native kernel's table where they are W8A8 packed for it (a live
    one is found again), else None (the experts then run one by one in torch)."""
    first = experts[0].kernel_tensors()[0][0]
    if not (native.available() and first.dtype == torch.uint8):     # not packed for the native kernels
        return None
    found = native.ExpertTable.find(first, len(experts))
    if found is not None and found.shared >= (shared is not None):
        return found
    tensors = [e.kernel_tensors() for e in [*experts, *([shared] if shared is not None else [])]]
    weights, scales = [ws for ws, _ in tensors], [ss for _, ss in tensors]
    if not native.ExpertTable.usable(weights, scales):
        return None
    return native.ExpertTable(weights, scales, shared is not None)


def routed_experts(xq, weights, local, table, limit: float, dtype: torch.dtype, shared: bool) -> torch.Tensor:
    """`experts_on_host`'s sums (then the shared expert's, with `shared`) from one native call: the ~30
    small torch ops each expert costs around its GEMMs were a third of the MoE's time at V4 Flash's
    widths. xq: the rows quantised per token; dtype: the activations'. fp32 [T, dim]."""
    return native.routed_experts(xq[0], xq[1], weights, local, table, limit, dtype, shared)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale, offs: torch.Tensor, group: torch.Tensor,
                   xq=None) -> torch.Tensor:
    """Rows x [A, in] sorted by group; rows offs[g-1]:offs[g] are multiplied by weight[g] ([G, out, in]).
    Rows past offs[-1] come out undefined. `group` [A] is each row's group (used by the gather fallback).

    Float weights use torch's grouped GEMM, which reads each group's weight in place (it takes bf16
    only, but for eager calls on the CPU: its shape function, which compiling runs, refuses the rest).
    torch has no grouped int8 GEMM, so int8 rows (and other float dtypes) gather their weights: a copy
    per row, the fallback, exact while int8 sums stay below 2^24."""
    eager_cpu = x.device.type == "cpu" and not torch.compiler.is_compiling()
    if weight_scale is None and (x.dtype == torch.bfloat16 or eager_cpu):
        return torch._grouped_mm(x, weight.transpose(1, 2).to(x.dtype), offs=offs)
    g = group.clamp(max=weight.shape[0] - 1)
    if weight_scale is None:
        return torch.bmm(weight[g].to(x.dtype), x[:, :, None]).squeeze(-1)
    q, sx = xq if xq is not None else quantize_per_token(x)
    acc = torch.bmm(weight[g].float(), q.float()[:, :, None]).squeeze(-1)
    return (acc * sx * weight_scale[g, :, 0].float()).to(x.dtype)


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, local: torch.Tensor, experts, xq=None) -> torch.Tensor:
    """Routed experts with the routing on the device and static shapes, for graph capture.

    x [T, dim]; weights, local [T, k]: routing weights and expert indices relative to this rank's
    first expert; experts: an ExpertStack. The T*k (token, expert) pairs are sorted by expert, each
    projection is one grouped GEMM over the stacked weights, and the weighted rows are summed back
    per token. Pairs routed to another rank's experts sort last and add nothing. Returns fp32 [T, dim]."""
    T, k = local.shape
    E = experts.w13.shape[0]
    key = torch.where((local >= 0) & (local < E), local, E).flatten()
    order = key.argsort(stable=True)
    counts = torch.zeros(E + 1, dtype=torch.long, device=x.device).scatter_add_(0, key, torch.ones_like(key))
    offs = counts[:E].cumsum(0).to(torch.int32)
    group, token = key[order], order // k
    rows_q = None if xq is None else (xq[0][token], xq[1][token])
    h = grouped_linear(x[token], experts.w13, experts.s13, offs, group, rows_q)
    h = swiglu(*h.chunk(2, dim=-1), experts.limit) * weights.flatten()[order, None]   # weight before w2
    out = grouped_linear(h.to(x.dtype), experts.w2, experts.s2, offs, group).float()
    out = torch.where((group < E)[:, None], out, 0.0)
    return torch.zeros(T, out.shape[1], device=x.device, dtype=torch.float32).index_add_(0, token, out)


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
    # tokens, where an inner dim of n = 4 doesn't vectorise (2x at a 256-token chunk on the CPU)
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
