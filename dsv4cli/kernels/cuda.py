"""The CUDA kernel module: the reference's ops (`torch._int_mm` is cuBLAS's int8 GEMM there, `torch._grouped_mm`
its grouped GEMM), the int8 GEMM's rows padded to what cuBLAS takes, and, where Triton is installed (torch's CUDA
wheels bring it), the lightning indexer's scan as one Triton kernel (`triton_indexer.py`) and the official FP8 and
FP4 linears decoded in registers from the release's bytes (`triton_lowbit.py`)."""
import torch
import torch.nn.functional as F

from . import reference
from .reference import *  # noqa: F403 - the seam: every op, then what CUDA runs its own way

try:
    from . import triton_indexer, triton_lowbit
except ImportError:          # no Triton: torch's scan and the reference's decoding linears
    triton_indexer = triton_lowbit = None

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


def graph_op(name: str, run, fake):
    """`run` called directly in eager and as the custom op `dsv4::<name>` inside a compiled graph (opaque to the
    compiler, which takes its output's shape from `fake`); in eager it is called directly, without an op's
    dispatch cost (docs/decisions.md: Eager steps call the native kernels directly)."""
    op = torch.library.custom_op(f"dsv4::{name}", run, mutates_args=())
    op.register_fake(fake)
    return lambda *args: op(*args) if torch.compiler.is_compiling() else run(*args)


if triton_lowbit is not None:
    def _fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, row0: int, col0: int) -> torch.Tensor:
        return triton_lowbit.fp8_linear(x, weight, scale, (row0, col0))

    triton_fp8_linear = graph_op("triton_fp8_linear", _fp8_linear,
                                 lambda x, weight, scale, row0, col0: x.new_empty(*x.shape[:-1], weight.shape[0]))
    triton_fp4_linear = graph_op("triton_fp4_linear", triton_lowbit.fp4_linear,
                                 lambda x, weight, scale: x.new_empty(*x.shape[:-1], weight.shape[0]))
    triton_fp4_grouped_linear = graph_op(
        "triton_fp4_grouped_linear", triton_lowbit.fp4_grouped_linear,
        lambda x, weight, scale, group: x.new_empty(x.shape[0], weight.shape[1], dtype=torch.float32))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offset: tuple[int, int] = (0, 0)):
    if triton_lowbit is None or not triton_lowbit.fp8_fits(x, weight, scale, offset):
        return reference.fp8_linear(x, weight, scale, offset)
    return triton_fp8_linear(x, weight, scale, *offset)


def fp8_grouped_projection(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offset: tuple[int, int],
                           groups: int) -> torch.Tensor:
    return reference.fp8_by_groups(fp8_linear, x, weight, scale, offset, groups)


def fp4_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if triton_lowbit is None or not triton_lowbit.fp4_fits(x, weight, scale):
        return reference.fp4_linear(x, weight, scale)
    return triton_fp4_linear(x, weight, scale)


def fp4_grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """The reference's op; rows of another rank's expert (group = G) come out zeros from the Triton kernel."""
    if triton_lowbit is None or not triton_lowbit.fp4_grouped_fits(x, weight, scale, group):
        return reference.fp4_grouped_linear(x, weight, scale, group)
    return triton_fp4_grouped_linear(x, weight, scale, group)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale, offs: torch.Tensor, group: torch.Tensor,
                   xq=None) -> torch.Tensor:
    """The reference's, with the release's FP4 experts on the Triton kernel (each row's expert read in place)."""
    if weight.dtype == torch.float4_e2m1fn_x2:
        return fp4_grouped_linear(x, weight, weight_scale, group).to(x.dtype)
    return reference.grouped_linear(x, weight, weight_scale, offs, group, xq)


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, local: torch.Tensor, experts, xq=None) -> torch.Tensor:
    return reference.grouped_experts(x, weights, local, experts, xq, linear=grouped_linear)
