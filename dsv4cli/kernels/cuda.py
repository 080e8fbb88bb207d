"""The CUDA kernel module: the reference's ops (`torch._int_mm` is cuBLAS's int8 GEMM there, `torch._grouped_mm`
its grouped GEMM), the int8 GEMM's rows padded to what cuBLAS takes, and the lightning indexer's scan as one
Triton kernel (`triton_indexer.py`, where Triton is installed: torch's CUDA wheels bring it)."""
import torch
import torch.nn.functional as F

from . import reference
from .reference import *  # noqa: F403 - the seam: every op, then what CUDA runs its own way

try:
    from . import triton_indexer
except ImportError:          # no Triton: torch's scan
    triton_indexer = None

CUBLAS_INT8_MIN_ROWS = 17    # the cuBLAS int8 GEMM behind torch._int_mm needs more than 16 rows


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, xq=None,
                packed=None) -> torch.Tensor:
    """The reference's W8A8 linear with the activations padded to at least CUBLAS_INT8_MIN_ROWS rows."""
    shape = x.shape
    q, sx = xq if xq is not None else reference.quantize_per_token(x.reshape(-1, shape[-1]))
    rows = q.shape[0]
    acc = torch._int_mm(F.pad(q, (0, 0, 0, max(CUBLAS_INT8_MIN_ROWS - rows, 0))), weight.t())[:rows].float()
    y = acc * sx * weight_scale.view(1, -1).float()
    return y.to(x.dtype).view(*shape[:-1], -1)


if triton_indexer is not None:
    triton_indexer_scores = reference.indexer_scan_op("triton_indexer_scores", triton_indexer.indexer_scores)


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    if triton_indexer is None or not triton_indexer.fits(q, keys):
        return reference.indexer_scores(q, keys, weights)
    return triton_indexer_scores(q, keys, weights)
