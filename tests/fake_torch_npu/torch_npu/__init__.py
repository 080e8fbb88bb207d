"""A CPU stand-in for the torch_npu ops dsv4cli.kernels.npu calls, for tests only.

Each op takes the documented arguments (Ascend op-plugin docs: torch_npu.npu_dynamic_quant,
npu_quant_matmul, npu_rms_norm), rejects the shapes and dtypes the docs rule out for Atlas A2/A3,
and computes the documented formula in fp32. `calls` counts the calls so tests can see the fused
path was taken.
"""
from collections import Counter

import torch

calls = Counter()


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise RuntimeError(f"torch_npu stand-in: {msg}")


def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None):
    """Per-row symmetric quantisation: scale = rowmax(|x|) / 127, y = round(x / scale).
    Returns (y int8 shaped like x, scale fp32 shaped like x without its last dim)."""
    calls["npu_dynamic_quant"] += 1
    _require(x.dtype in (torch.float16, torch.bfloat16), f"x must be float16/bfloat16, got {x.dtype}")
    _require(x.dim() > 1, "x must have more than one dimension")
    _require(smooth_scales is None and group_index is None, "smooth_scales/group_index not modelled")
    _require(dst_type in (None, torch.int8), "only int8 output is modelled")
    xf = x.float()
    scale = xf.abs().amax(-1) / 127.0
    y = torch.where(scale[..., None] > 0, xf / scale[..., None], 0.0)
    return torch.round(y).clamp(-128, 127).to(torch.int8), scale


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                     group_sizes=None):
    """out = (x1 @ x2) * scale * pertoken_scale with x1 [m,k] int8, x2 [k,n] int8 (any strides),
    scale [n] or [1], pertoken_scale [m] fp32; the A2/A3 combinations with a per-token scale."""
    calls["npu_quant_matmul"] += 1
    _require(x1.dtype == torch.int8 and x2.dtype == torch.int8, "x1 and x2 must both be int8")
    _require(2 <= x1.dim() <= 6 and 2 <= x2.dim() <= 6, "x1/x2 must have 2 to 6 dimensions")
    _require(x1.shape[-1] == x2.shape[-2], f"x1 {list(x1.shape)} and x2 {list(x2.shape)} do not multiply")
    _require(x1.shape[-1] <= 65535 and x2.shape[-1] <= 65535, "last dimension above 65535")
    n = x2.shape[-1]
    _require(scale.dim() == 1 and scale.shape[0] in (1, n), f"scale must be 1-D of size 1 or {n}")
    _require(offset is None and bias is None and group_sizes is None, "offset/bias/group_sizes not modelled")
    _require(pertoken_scale is not None, "only the per-token-scale path is modelled")
    _require(pertoken_scale.dtype == torch.float32 and pertoken_scale.dim() == 1
             and pertoken_scale.shape[0] == x1.shape[-2], "pertoken_scale must be fp32 [m]")
    allowed = {torch.bfloat16: (torch.float32, torch.bfloat16), torch.float16: (torch.float32,)}
    _require(output_dtype in allowed, f"output_dtype {output_dtype} is not allowed with pertoken_scale")
    _require(scale.dtype in allowed[output_dtype], f"scale {scale.dtype} not allowed for {output_dtype} output")
    acc = (x1.to(torch.int32) @ x2.to(torch.int32)).float()
    return (acc * pertoken_scale[:, None] * scale.float()).to(output_dtype)


def npu_rms_norm(x, gamma, epsilon=1e-6):
    """(x / sqrt(mean(x^2) + eps) * gamma, 1 / sqrt(mean(x^2) + eps)); gamma's dtype must be x's."""
    calls["npu_rms_norm"] += 1
    _require(x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported dtype {x.dtype}")
    _require(2 <= x.dim() <= 8, "x must have 2 to 8 dimensions")
    _require(gamma.dtype == x.dtype, f"gamma dtype {gamma.dtype} differs from x dtype {x.dtype}")
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd
