"""Torch reference backend: plain torch ops, exact semantics, runs anywhere.

Every other backend is tested against these functions.
"""
import functools

import torch
import torch.nn.functional as F

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


def pack_w8a8(weight: torch.Tensor):
    """The int8 weight [out, in] in oneDNN's blocked layout, or None where that isn't available.

    On the CPU `torch._int_mm` streams a weight at about half the memory bandwidth and slows further
    with more than one row; oneDNN's prepacked int8 GEMM reads it near the bandwidth for 1 to 256
    rows and gives the same int32 sums (so the same results, bit for bit)."""
    if weight.device.type != "cpu" or not _onednn_int8():
        return None
    return torch.ops.onednn.qlinear_prepack(weight, [1, weight.shape[1]])


@functools.cache
def _onednn_int8() -> bool:
    try:
        w = torch.ones(2, 4, dtype=torch.int8)
        y = _packed_int_mm(torch.ones(1, 4, dtype=torch.int8), torch.ops.onednn.qlinear_prepack(w, [1, 4]))
        return torch.equal(y, torch.full((1, 2), 4.0))
    except (AttributeError, RuntimeError):
        return False


def _packed_int_mm(q: torch.Tensor, packed) -> torch.Tensor:
    """Exact int32 sums of q [m, in] int8 times a packed weight, as fp32 (unit scales, no zero points)."""
    n = packed.shape[1]
    return torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, packed, _ones(n), _zeros(n), None, 1.0, 0,
                                              torch.float32, "none", [None], "")


@functools.cache
def _ones(n: int) -> torch.Tensor:
    return torch.ones(n)


@functools.cache
def _zeros(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.long)


def unpack_w8a8(packed) -> torch.Tensor:
    """The plain int8 weight [out, in] back from `pack_w8a8`."""
    return packed.to_dense().t().contiguous()


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, xq=None,
                packed=None) -> torch.Tensor:
    """int8 x int8 -> int32 GEMM; y = acc * token_scale * channel_scale. weight [out,in] int8, scale [out,1].

    `xq` = quantize_per_token(x rows), when the caller feeds the same x to several linears;
    `packed` = pack_w8a8(weight), which is then read instead of `weight`."""
    shape = x.shape
    q, sx = xq if xq is not None else quantize_per_token(x.reshape(-1, shape[-1]))
    if packed is not None:
        acc = _packed_int_mm(q, packed)
    else:
        rows = q.shape[0]
        if q.is_cuda and rows <= 16:   # the cuBLAS int8 GEMM behind torch._int_mm needs more than 16 rows
            q = F.pad(q, (0, 0, 0, 17 - rows))
        acc = torch._int_mm(q, weight.t())[:rows].float()
    y = acc * sx * weight_scale.view(1, -1).float()
    return y.to(x.dtype).view(*shape[:-1], -1)


def attention(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sink: torch.Tensor, scale: float):
    """Multi-query attention with a per-head sink logit in the denominator.

    q [B,S,H,D], kv [B,N,D] (K = V), bias [B,S,N] (0 or -inf), sink [H]. The sink adds
    exp(sink) to the softmax denominator and contributes no value.
    """
    s = torch.einsum("bshd,bnd->bshn", q.float(), kv.float()) * scale + bias.unsqueeze(2)
    sink = sink.float().view(1, 1, -1, 1)
    m = torch.maximum(s.amax(-1, keepdim=True), sink)
    p = torch.exp(s - m)
    p = p / (p.sum(-1, keepdim=True) + torch.exp(sink - m))
    return torch.einsum("bshn,bnd->bshd", p, kv.float()).to(q.dtype)


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


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale, offs: torch.Tensor, group: torch.Tensor,
                   xq=None) -> torch.Tensor:
    """Rows x [A, in] sorted by group; rows offs[g-1]:offs[g] are multiplied by weight[g] ([G, out, in]).
    Rows past offs[-1] come out undefined. `group` [A] is each row's group (used by the int8 path).

    Float weights use torch's grouped GEMM, which reads each group's weight in place. torch has no
    grouped int8 GEMM, so int8 rows gather their weights (a copy per row: the fallback, exact while
    the int8 sums stay below 2^24) and scale like `w8a8_linear`."""
    if weight_scale is None:
        return torch._grouped_mm(x, weight.transpose(1, 2).to(x.dtype), offs=offs)
    q, sx = xq if xq is not None else quantize_per_token(x)
    g = group.clamp(max=weight.shape[0] - 1)
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
    h = grouped_linear(x[token], experts.w13, experts.s13, offs, group, rows_q).float()
    gate, up = h.chunk(2, dim=-1)
    if experts.limit > 0:
        gate, up = gate.clamp(max=experts.limit), up.clamp(-experts.limit, experts.limit)
    h = F.silu(gate) * up * weights.flatten()[order, None]     # the routing weight scales the intermediate
    out = grouped_linear(h.to(x.dtype), experts.w2, experts.s2, offs, group).float()
    out = torch.where((group < E)[:, None], out, 0.0)
    return torch.zeros(T, out.shape[1], device=x.device, dtype=torch.float32).index_add_(0, token, out)
