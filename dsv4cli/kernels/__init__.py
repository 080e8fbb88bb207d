"""One op set, several backends. The backend is picked from the tensor's device.

reference: plain torch (CPU and any device); npu: torch_npu fused ops; cuda: torch ops that map to
cuBLAS int8 GEMMs. Non-reference backends fall back to the reference for ops they don't override.
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


def w8a8_linear(x, weight, weight_scale):
    return backend(x.device.type).w8a8_linear(x, weight, weight_scale)


def quantize_per_token(x):
    return backend(x.device.type).quantize_per_token(x)


def attention(q, kv, bias, sink, scale):
    return backend(q.device.type).attention(q, kv, bias, sink, scale)


def moe_gate(x, weight, bias, tid2eid, input_ids, topk, func, route_scale):
    return backend(x.device.type).moe_gate(x, weight, bias, tid2eid, input_ids, topk, func, route_scale)
