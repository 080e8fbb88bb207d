"""CUDA: the lightning indexer's scan as one Triton kernel (`triton_indexer.py`, where Triton is
installed: torch's CUDA wheels bring it); every other op is the reference's (there `torch._int_mm` is
cuBLAS's int8 GEMM and `torch._grouped_mm` its grouped GEMM)."""
import torch

from . import reference

try:
    from . import triton_indexer
except ImportError:          # no Triton: torch's scan
    triton_indexer = None


def __getattr__(name):
    return getattr(reference, name)


if triton_indexer is not None:
    triton_indexer_scores = reference.indexer_scan_op("triton_indexer_scores", triton_indexer.indexer_scores)


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    if triton_indexer is None or not triton_indexer.fits(q, keys):
        return reference.indexer_scores(q, keys, weights)
    return triton_indexer_scores(q, keys, weights)
