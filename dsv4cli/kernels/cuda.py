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


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    if triton_indexer is None or not triton_indexer.fits(q, keys):
        return reference.indexer_scores(q, keys, weights)
    if torch.compiler.is_compiling():
        return triton_indexer_scores(q, keys, weights)
    return triton_indexer.indexer_scores(q, keys, weights)


@torch.library.custom_op("dsv4::triton_indexer_scores", mutates_args=())
def triton_indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The Triton scan as one op of a compiled graph."""
    return triton_indexer.indexer_scores(q, keys, weights)


@triton_indexer_scores.register_fake
def _(q, keys, weights):
    return q.new_empty(*q.shape[:2], keys.shape[1], dtype=torch.float32)
