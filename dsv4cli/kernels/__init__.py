"""One op set, several backends. The backend is picked from the tensor's device.

reference: plain torch, on any device (on CUDA its torch._int_mm is the cuBLAS int8 GEMM); npu:
torch_npu fused ops, falling back to the reference for the ops it doesn't override.
"""
from dataclasses import dataclass

import torch

from . import reference

_BACKENDS = {}


def backend(device_type: str):
    """The op module for a device type; torch_npu is imported only when an NPU is used."""
    if device_type not in _BACKENDS:
        if device_type == "npu":
            from . import npu as mod
        else:
            mod = reference
        _BACKENDS[device_type] = mod
    return _BACKENDS[device_type]


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


def routes_on_host(device: torch.device) -> bool:
    """Whether routed experts read their routing on the host. On the CPU the tensors already live
    there, so reading it costs no device sync and each expert runs on its own rows with its own
    weights; accelerators keep routing on the device (grouped GEMMs over stacked experts)."""
    return device.type == "cpu"


def rms_norm(x, weight, eps):
    return backend(x.device.type).rms_norm(x, weight, eps)


def rope(x, cos, sin):
    return backend(x.device.type).rope(x, cos, sin)


def linear(x, weight):
    return backend(x.device.type).linear(x, weight)


def pack_w8a8(weight):
    return backend(weight.device.type).pack_w8a8(weight)


def unpack_w8a8(packed):
    return reference.unpack_w8a8(packed)


def w8a8_linear(x, weight, weight_scale, xq=None, packed=None):
    return backend(x.device.type).w8a8_linear(x, weight, weight_scale, xq, packed)


def quantize_per_token(x):
    return backend(x.device.type).quantize_per_token(x)


def grouped_experts(x, weights, local, experts: ExpertStack, xq=None):
    return backend(x.device.type).grouped_experts(x, weights, local, experts, xq)


def attention(q, kv, bias, sink, scale):
    return backend(q.device.type).attention(q, kv, bias, sink, scale)


def moe_gate(x, weight, bias, tid2eid, input_ids, topk, func, route_scale):
    return backend(x.device.type).moe_gate(x, weight, bias, tid2eid, input_ids, topk, func, route_scale)
