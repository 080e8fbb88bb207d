"""Ascend NPU backend: torch_npu's fused ops, called as vllm-ascend calls them for W8A8_DYNAMIC.

Ops not defined here are the reference ones (plain torch ops run on the NPU too). The router stays
there as well: npu_moe_gating_top_k scores with softmax or sigmoid, not DeepSeek V4's sqrt-softplus.
Int8 weights stay [out, in] in ND layout and are passed transposed; converting them to FRACTAL_NZ
at load time would make the GEMMs faster.
"""
import torch
import torch.nn.functional as F
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

    h = gmm(rows, rows_scale, experts.w13, experts.s13).float()
    gate, up = h.chunk(2, dim=-1)
    if experts.limit > 0:
        gate, up = gate.clamp(max=experts.limit), up.clamp(-experts.limit, experts.limit)
    h = F.silu(gate) * up * weights.flatten()[src, None]     # the routing weight scales the intermediate
    hq, h_scale = torch_npu.npu_dynamic_quant(h.to(x.dtype))
    out = torch.where(valid[:, None], gmm(hq, h_scale, experts.w2, experts.s2).float(), 0.0)
    return torch.zeros(T, out.shape[1], device=x.device, dtype=torch.float32).index_add_(0, src // k, out)
