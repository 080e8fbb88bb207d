"""Ascend NPU backend: torch_npu's fused ops (torch_npu 2.14.0's documented schemas), called as
vllm-ascend calls them for W8A8_DYNAMIC.

Ops not defined here, and shapes or dtypes an op does not take, run the reference (plain torch ops
run on the NPU too). What stays in the reference and why (docs/decisions.md has the op table):
- the router: npu_moe_gating_top_k always applies its own softmax or sigmoid to x (renorm 0 only),
  so neither DeepSeek V4's sqrt-softplus scores nor precomputed scores can be passed, in hash
  mode (input_ids + tid2eid) either: its weights would be softmax/sigmoid of the logits;
- attention: npu_sparse_flash_attention / npu_block_sparse_attention have no sink logit;
- the clamped SwiGLU: npu_swiglu and the fused grouped GEMM + SwiGLU ops have no clamp;
- mhc_head: npu_mhc_pre documents only the three-weight (alpha [3]) form.
Int8 weights stay [out, in] in ND layout and are passed transposed; converting them to FRACTAL_NZ
at load time would make the GEMMs faster.
"""
import functools

import torch
import torch_npu

from . import reference
from .reference import *  # noqa: F403 - the seam: every op, then what torch_npu runs fused

HALF = (torch.float16, torch.bfloat16)   # the activation dtypes npu_dynamic_quant / npu_quant_matmul take
# torch_npu.npu.get_soc_version() of Ascend 950, the first chip with the mHC ops (npu_mhc_pre/post:
# "昇腾950", npu_mhc_sinkhorn: "Atlas A5"); the wheel's own meta registrations compare against 260.
ASCEND950 = 260
SINKHORN_STREAMS = (4, 6, 8)             # the n npu_mhc_sinkhorn takes


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


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, local: torch.Tensor, experts, xq=None) -> torch.Tensor:
    """Routed int8 experts as vllm-ascend runs W8A8_DYNAMIC MoE: routing on the device, static shapes.

    npu_moe_init_routing_v2 sorts the T*k (token, expert) pairs by expert and gathers each pair's int8
    row of x and its scale (x is already quantised, once for all experts). Another rank's expert gets
    id E, outside active_expert_range [0, E): its pairs sort last and stay out of the per-expert counts,
    so the two npu_grouped_matmul skip them (fewer counted rows than x has, as vllm-ascend's all-gather
    expert-parallel path passes; the GEMM's doc asks for equality) and they are masked before the sum.
    Between the GEMMs the clamped SwiGLU and the routing weight run in fp32 as in the reference (no
    fused op has V4's clamp with the weight before w2), then npu_dynamic_quant requantises. The
    un-permute is index_add_ in sorted order, as the reference sums (npu_moe_finalize_routing sums the
    k slots in slot order and takes no -1 rows). Float experts and fp32 activations use the reference.

    Equal to the reference except: bf16 runs round the weight scales to bf16, and rows with
    max |x| < 1e-4 quantise with their own max (see quantize_per_token)."""
    if x.dtype not in HALF or experts.s13 is None:
        return reference.grouped_experts(x, weights, local, experts, xq)
    T, k = local.shape
    E = experts.w13.shape[0]
    q, sx = xq if xq is not None else quantize_per_token(x)
    key = torch.where((local >= 0) & (local < E), local, E).to(torch.int32)
    rows, src, counts, rows_scale = torch_npu.npu_moe_init_routing_v2(
        q, key, scale=sx.view(-1), expert_num=E + 1, expert_tokens_num_type=1, expert_tokens_num_flag=True,
        quant_mode=-1, active_expert_range=[0, E], row_idx_type=1)     # -1: x is int8; 1: src of each row
    valid = torch.arange(T * k, device=x.device) < counts.sum()        # rows past it are undefined
    src = torch.where(valid, src, 0).long()                             # row i holds pair src[i] = t*k + j
    # the per-token grouped GEMM takes bf16 scales for bf16 output and fp32 scales for fp16 output
    scale_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32

    def gmm(a, a_scale, w, w_scale):     # w [E, out, in] read transposed, in place
        return torch_npu.npu_grouped_matmul(
            [a], [w.transpose(1, 2)], scale=[w_scale.view(E, -1).to(scale_dtype)], per_token_scale=[a_scale],
            group_list=counts, split_item=2, group_type=0, group_list_type=1, output_dtype=x.dtype)[0]

    h = gmm(rows, rows_scale, experts.w13, experts.s13)
    h = reference.swiglu(*h.chunk(2, dim=-1), experts.limit) * weights.flatten()[src, None]   # weight before w2
    hq, h_scale = torch_npu.npu_dynamic_quant(h.to(x.dtype))
    out = torch.where(valid[:, None], gmm(hq, h_scale, experts.w2, experts.s2).float(), 0.0)
    return torch.zeros(T, out.shape[1], device=x.device, dtype=torch.float32).index_add_(0, src // k, out)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """npu_rotary_mul in interleave mode: out = r1 * x + r2 * (-x[2i+1], x[2i]) pairwise, with r1/r2
    the cos/sin repeated per pair. That mode takes r1/r2 only as [1, S, 1, D] for x [B, S, N, D]
    (one position row per token, shared by batch and heads), so the batch goes into S: x's rotated
    tail as [1, tokens, heads, rd]. Run in fp32 like the reference (a*cos + (-b)*sin is a*cos - b*sin
    exactly). Other layouts (cos not one row per token) use the reference."""
    rd = 2 * cos.shape[-1]
    if cos.shape[:-1] == x.shape[:-2] + (1,):
        heads = x.shape[-2]                     # x [..., heads, D], cos [..., 1, rd/2]
    elif cos.shape[:-1] == x.shape[:-1]:
        heads = 1                               # x [..., D], cos [..., rd/2]
    else:
        return reference.rope(x, cos, sin)
    tokens = cos[..., 0].numel()
    tail = x[..., -rd:].float().reshape(1, tokens, heads, rd).contiguous()   # the doc promises no strided input
    r1 = cos.float().repeat_interleave(2, dim=-1).reshape(1, tokens, 1, rd)
    r2 = sin.float().repeat_interleave(2, dim=-1).reshape(1, tokens, 1, rd)
    rotated = torch_npu.npu_rotary_mul(tail, r1, r2, rotary_mode="interleave")
    return torch.cat((x[..., :-rd], rotated.view(*x.shape[:-1], rd).to(x.dtype)), dim=-1)


@functools.cache
def _has_mhc_ops() -> bool:
    return torch_npu.npu.get_soc_version() >= ASCEND950


def mhc_pre(h, fn, scale, base, norm_eps, hc_eps):
    """npu_mhc_pre: h_in, h_post, h_res are the reference's x, post and comb logits (ops-transformer's
    MhcPre formula: mix = alpha * (RMSNorm(h) phi) + bias, pre = sigmoid + hc_eps, post = 2 sigmoid,
    h_in = sum_i h_i pre_i); no gamma (V4's norm has no weight); out_flag 0, so the other three
    outputs are not computed. h must be bf16/fp16."""
    if not (_has_mhc_ops() and h.dtype in HALF):
        return reference.mhc_pre(h, fn, scale, base, norm_eps, hc_eps)
    x, post, comb = torch_npu.npu_mhc_pre(h, fn, scale, base, norm_eps=norm_eps, hc_eps=hc_eps)[:3]
    return x, post, comb


def mhc_sinkhorn(logits, eps, iters):
    """npu_mhc_sinkhorn: ops-transformer's MhcSinkhorn formula is V4's step for step (softmax + eps,
    a column normalisation, then num_iters-1 row/column rounds, every sum + eps)."""
    if not (_has_mhc_ops() and logits.shape[-1] in SINKHORN_STREAMS and 1 <= iters <= 100):
        return reference.mhc_sinkhorn(logits, eps, iters)
    return torch_npu.npu_mhc_sinkhorn(logits, eps=eps, num_iters=iters)[0]


def mhc_post(x, res, post, comb):
    """npu_mhc_post(x=streams, h_res=comb, h_out=sub-layer output, h_post=post):
    y = h_res^T x + h_out (x) h_post, the reference's h_k = post_k * out + sum_j comb[j,k] res_j."""
    if not (_has_mhc_ops() and x.dtype in HALF and res.dtype == x.dtype):
        return reference.mhc_post(x, res, post, comb)
    return torch_npu.npu_mhc_post(res, comb, x, post)
