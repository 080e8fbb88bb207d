"""Torch reference backend: plain torch ops, exact semantics, runs anywhere.

Every other backend is tested against these functions.
"""
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


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, xq=None) -> torch.Tensor:
    """int8 x int8 -> int32 GEMM; y = acc * token_scale * channel_scale. weight [out,in] int8, scale [out,1].

    `xq` = quantize_per_token(x rows), when the caller feeds the same x to several linears."""
    shape = x.shape
    q, sx = xq if xq is not None else quantize_per_token(x.reshape(-1, shape[-1]))
    rows = q.shape[0]
    if q.is_cuda and rows <= 16:   # the cuBLAS int8 GEMM behind torch._int_mm needs more than 16 rows
        q = F.pad(q, (0, 0, 0, 17 - rows))
    acc = torch._int_mm(q, weight.t())[:rows]
    y = acc.float() * sx * weight_scale.view(1, -1).float()
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
