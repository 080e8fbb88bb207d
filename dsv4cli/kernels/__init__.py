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


def linear_fp32(x, weight, packed=None):
    return backend(x.device.type).linear_fp32(x, weight, packed)


def pack_linear_fp32(weight, groups=1):
    return backend(weight.device.type).pack_linear_fp32(weight, groups)


def unpack_linear_fp32(packed):
    return reference.unpack_linear_fp32(packed)


def grouped_projection(x, weight, packed=None):
    return backend(x.device.type).grouped_projection(x, weight, packed)


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


def expert_table(experts, shared=None):
    """The experts (and the shared one, if given) as this backend's fused host-expert kernel takes
    them (`routed_experts`), or None where it has none or they aren't laid out for it. experts: Expert
    modules or TensorExperts (read through their `kernel_tensors()`)."""
    return backend(experts[0].kernel_tensors()[0][0].device.type).expert_table(experts, shared)


def routed_experts(xq, weights, local, table, limit, dtype, shared=False):
    """The routed experts (then the shared one, with `shared`: the table must hold it) of rows
    quantised per token, in one call over an `expert_table`: `experts_on_host`'s sums. fp32 [T, dim]."""
    return backend(xq[0].device.type).routed_experts(xq, weights, local, table, limit, dtype, shared)


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


# ---- composites: seam ops put together, the same on every platform ---------------------------

def projection(x, weight, scale, xq=None):
    """A float linear (scale None), or W8A8; the weight plain or packed (`pack_w8a8`, `pack_linear_fp32`)."""
    packed = weight if reference.is_packed(weight) else None
    if scale is None:
        return linear(x, weight) if packed is None else linear_fp32(x, weight, packed).to(x.dtype)
    return w8a8_linear(x, weight, scale, xq, packed)


def expert_ffn(x, w1, w3, w2, limit, routing_weight=None, xq=None):
    """One expert: w2(swiglu(w1 x, w3 x) * routing_weight). w1, w3, w2: its projections, callables
    p(x, xq=None) (the expert's Linear modules, or a TensorExpert's); xq = x quantised per token."""
    h = swiglu(w1(x, xq), w3(x, xq), limit)
    if routing_weight is not None:       # the routing weight scales the intermediate, before w2
        h = h * routing_weight
    return w2(h.to(x.dtype))


class TensorExpert:
    """An expert made of its tensors: weights [w1, w3, w2] (float, int8 or packed) and their scales."""

    def __init__(self, weights, scales, limit: float):
        self.tensors = (list(weights), list(scales))
        self.limit = limit

    def kernel_tensors(self) -> tuple[list, list]:
        return self.tensors

    def __call__(self, x, routing_weight=None, xq=None):
        # the projections made per call: a compiled step's host-experts op makes every local expert each
        # step, and with a fused-kernel table none of them is called
        projections = [lambda x, xq=None, w=w, s=s: projection(x, w, s, xq) for w, s in zip(*self.tensors)]
        return expert_ffn(x, *projections, self.limit, routing_weight, xq)


def experts_on_host(x, weights, local, experts, xq=None):
    """Routed experts one at a time, each on its own tokens, for tensors in host memory (reading the
    routing there costs no device sync), each expert's weights read in place (packed or not).

    x [T, dim]; weights, local [T, k]: routing weights and expert indices relative to this rank's
    first expert; experts: this rank's experts, callables expert(rows, routing_weight [n,1], rows_q)
    (a compiled graph takes their `kernel_tensors()` and `limit`). Pairs routed to another rank's
    experts add nothing. Experts laid out for the backend's fused kernel run in one call of it
    (`routed_experts`: the same sums), the others one by one. Returns fp32 [T, dim]."""
    if torch.compiler.is_compiling():    # a graph can't read the routing: one opaque op in it
        tensors = [e.kernel_tensors() for e in experts]
        q, sx = xq if xq is not None else (None, None)
        return experts_on_host_op(x, weights, local, q, sx, [w for ws, _ in tensors for w in ws],
                                  [s for _, ss in tensors for s in ss], experts[0].limit)
    if xq is not None and (table := expert_table(experts)) is not None:
        return routed_experts(xq, weights, local, table, experts[0].limit, x.dtype)
    n_local, k = len(experts), local.shape[1]
    key = torch.where((local >= 0) & (local < n_local), local, n_local).flatten()
    order = key.argsort(stable=True)
    counts = torch.bincount(key, minlength=n_local + 1).tolist()
    y = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
    start = 0
    for expert, n in zip(experts, counts[:-1]):
        if n:
            sel = order[start: start + n]
            rows = sel // k
            rows_q = None if xq is None else (xq[0][rows], xq[1][rows])
            y.index_add_(0, rows, expert(x[rows], weights.flatten()[sel, None], rows_q).float())
        start += n
    return y


@torch.library.custom_op("dsv4::experts_on_host", mutates_args=())
def experts_on_host_op(x: torch.Tensor, weights: torch.Tensor, local: torch.Tensor, xq: torch.Tensor | None,
                       xs: torch.Tensor | None, expert_weights: list[torch.Tensor],
                       expert_scales: list[torch.Tensor | None], limit: float) -> torch.Tensor:
    """`experts_on_host` as one op of a compiled graph; the experts' tensors come flat, three each."""
    experts = [TensorExpert(expert_weights[i: i + 3], expert_scales[i: i + 3], limit)
               for i in range(0, len(expert_weights), 3)]
    return experts_on_host(x, weights, local, experts, None if xq is None else (xq, xs))


@experts_on_host_op.register_fake
def _(x, weights, local, xq, xs, expert_weights, expert_scales, limit):
    return x.new_empty(x.shape, dtype=torch.float32)
