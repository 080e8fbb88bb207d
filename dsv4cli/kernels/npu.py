"""Ascend NPU backend: torch_npu's fused ops, called as vllm-ascend calls them for W8A8_DYNAMIC.

Ops not defined here are the reference ones (plain torch ops run on the NPU too). The router stays
there as well: npu_moe_gating_top_k scores with softmax or sigmoid, not DeepSeek V4's sqrt-softplus.
Int8 weights stay [out, in] in ND layout and are passed transposed; converting them to FRACTAL_NZ
at load time would make the GEMMs faster.
"""
import torch
import torch_npu

from . import reference

HALF = (torch.float16, torch.bfloat16)   # the activation dtypes npu_dynamic_quant / npu_quant_matmul take


def __getattr__(name):
    return getattr(reference, name)


def pack_w8a8(weight: torch.Tensor):
    """NPU int8 weights stay [out, in] in ND layout (FRACTAL_NZ would be this backend's packed layout)."""
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    gamma = x.new_ones(x.shape[-1]) if weight is None else weight.to(x.dtype)   # gamma must match x's dtype
    return torch_npu.npu_rms_norm(x, gamma, epsilon=eps)[0]


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row. Unlike the reference, rows with max |x| < 1e-4 use their own max."""
    if x.dtype not in HALF:
        return reference.quantize_per_token(x)
    q, scale = torch_npu.npu_dynamic_quant(x)
    return q, scale.unsqueeze(-1)


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, xq=None,
                packed=None) -> torch.Tensor:
    """y = (int8(x) @ weight^T) * token_scale * channel_scale; weight [out,in] int8, scale [out,1] fp32.

    `xq` = quantize_per_token(x rows), when the caller feeds the same x to several linears; NPU
    weights are never packed (`packed` is always None here)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    q, sx = xq if xq is not None else quantize_per_token(x)
    if x.dtype in HALF:
        y = torch_npu.npu_quant_matmul(q, weight.t(), weight_scale.view(-1), pertoken_scale=sx.view(-1),
                                       output_dtype=x.dtype)
    else:   # fp32 activations (debug runs): the same integers, multiplied in fp32
        y = (q.float() @ weight.t().float() * sx * weight_scale.view(1, -1)).to(x.dtype)
    return y.view(*shape[:-1], -1)
