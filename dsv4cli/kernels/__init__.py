"""One op set, several backends. The backend is picked from the tensor's device.

reference: plain torch, on any device (on CUDA its torch._int_mm is the cuBLAS int8 GEMM); npu:
torch_npu fused ops, falling back to the reference for the ops it doesn't override.
"""
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


def rms_norm(x, weight, eps):
    return backend(x.device.type).rms_norm(x, weight, eps)


def rope(x, cos, sin):
    return backend(x.device.type).rope(x, cos, sin)


def linear(x, weight):
    return backend(x.device.type).linear(x, weight)


def w8a8_linear(x, weight, weight_scale, xq=None):
    return backend(x.device.type).w8a8_linear(x, weight, weight_scale, xq)


def quantize_per_token(x):
    return backend(x.device.type).quantize_per_token(x)


def attention(q, kv, bias, sink, scale):
    return backend(q.device.type).attention(q, kv, bias, sink, scale)


def moe_gate(x, weight, bias, tid2eid, input_ids, topk, func, route_scale):
    return backend(x.device.type).moe_gate(x, weight, bias, tid2eid, input_ids, topk, func, route_scale)
