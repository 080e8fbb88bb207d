"""The op seam: every op the model runs that an accelerator may replace, dispatched by the device
of its first tensor to that device's platform's kernel module (`dsv4cli.platforms`).

reference.py is the oracle and runs anywhere (on CUDA its torch._int_mm is the cuBLAS int8 GEMM);
npu.py runs torch_npu's fused ops and falls back to the reference for the rest. docs/design.md has
the op table (op, reference, NPU op, CUDA path).
"""
from dataclasses import dataclass

import torch

from dsv4cli import platforms

from . import reference


def backend(device_type: str):
    """The op module for a device type (torch_npu is imported only when an NPU is used)."""
    return platforms.kernels_for(device_type)


@dataclass
class ExpertStack:
    """A rank's routed experts stacked for grouped GEMMs, read in place.

    w13 [E, 2*inter, dim] (each expert's w1 rows, then its w3 rows), w2 [E, dim, inter]: int8 with
    fp32 per-channel scales s13 [E, 2*inter, 1] and s2 [E, dim, 1], or float with scales None.
    limit: the SwiGLU clamp (0 = none)."""
    w13: torch.Tensor
    w2: torch.Tensor
    s13: torch.Tensor | None
    s2: torch.Tensor | None
    limit: float


def rms_norm(x, weight, eps):
    return backend(x.device.type).rms_norm(x, weight, eps)


def rope(x, cos, sin):
    return backend(x.device.type).rope(x, cos, sin)


def linear(x, weight):
    return backend(x.device.type).linear(x, weight)


def linear_fp32(x, weight):
    return backend(x.device.type).linear_fp32(x, weight)


def grouped_projection(x, weight):
    return backend(x.device.type).grouped_projection(x, weight)


def compress_pool(kv, gate, valid, ratio):
    return backend(kv.device.type).compress_pool(kv, gate, valid, ratio)


def pack_w8a8(weight):
    return backend(weight.device.type).pack_w8a8(weight)


def unpack_w8a8(packed):
    return reference.unpack_w8a8(packed)


def w8a8_linear(x, weight, weight_scale, xq=None, packed=None):
    return backend(x.device.type).w8a8_linear(x, weight, weight_scale, xq, packed)


def quantize_per_token(x):
    return backend(x.device.type).quantize_per_token(x)


def swiglu(gate, up, limit):
    return backend(gate.device.type).swiglu(gate, up, limit)


def moe_gate(x, weight, bias, tid2eid, input_ids, topk, func, route_scale):
    return backend(x.device.type).moe_gate(x, weight, bias, tid2eid, input_ids, topk, func, route_scale)


def grouped_experts(x, weights, local, experts: ExpertStack, xq=None):
    return backend(x.device.type).grouped_experts(x, weights, local, experts, xq)


def experts_on_host(x, weights, local, experts, xq=None):
    return backend(x.device.type).experts_on_host(x, weights, local, experts, xq)


def sparse_attention(q, sources, sink, scale):
    return backend(q.device.type).sparse_attention(q, sources, sink, scale)


def indexer_scores(q, keys, weights):
    return backend(q.device.type).indexer_scores(q, keys, weights)


def topk_blocks(scores, closed, k):
    return backend(scores.device.type).topk_blocks(scores, closed, k)


def mhc_pre(h, fn, scale, base, norm_eps, hc_eps):
    return backend(h.device.type).mhc_pre(h, fn, scale, base, norm_eps, hc_eps)


def mhc_sinkhorn(logits, eps, iters):
    return backend(logits.device.type).mhc_sinkhorn(logits, eps, iters)


def mhc_post(x, res, post, comb):
    return backend(x.device.type).mhc_post(x, res, post, comb)


def mhc_head(h, fn, scale, base, norm_eps, hc_eps):
    return backend(h.device.type).mhc_head(h, fn, scale, base, norm_eps, hc_eps)
