"""A CPU stand-in for the torch_npu ops dsv4cli.kernels.npu calls, for tests only.

Each op takes the documented arguments (torch_npu 2.14.0's _op_plugin_docs.py: npu_dynamic_quant,
npu_quant_matmul, npu_rms_norm, npu_moe_init_routing_v2, npu_grouped_matmul, npu_rotary_mul,
npu_mhc_pre, npu_mhc_sinkhorn, npu_mhc_post; output shapes as in op_plugin/meta/_meta_registrations.py),
rejects the shapes and dtypes the docs rule out (for Atlas A2/A3; the mHC ops exist on Ascend 950
only, so they refuse other chips, see npu.py), and computes the documented formula in fp32/int32
(the mHC ops' formulas are not in the wheel's docs: they come from the ops' own docs in CANN's
ops-transformer, mhc/*/docs/aclnnMhc*.md). Outputs the docs call undefined come out as garbage (NaN,
or out-of-range indices), so callers that read them fail. `calls` counts the calls so tests can see
the fused path was taken.
"""
from collections import Counter

import torch

from . import npu

calls = Counter()
HALF = (torch.float16, torch.bfloat16)


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


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                            quant_mode=-1, active_expert_range=(), row_idx_type=0):
    """Dropless routing without quantisation (quant_mode -1), counts per expert (expert_tokens_num_type 1).

    The NUM_ROWS*K pairs p = row*K + slot whose expert lies in active_expert_range [start, end) are sorted
    by expert (ties in pair order) and expanded_x[i] = x[p_i // K], expanded_scale[i] = scale[p_i // K].
    Returns (expanded_x [NUM_ROWS*K, H] x's dtype, expanded_row_idx int32 [NUM_ROWS*K],
    counts int64 [end - start], expanded_scale fp32 [NUM_ROWS*K]). expanded_row_idx: row_idx_type 1
    (scatter) holds p_i at i; 0 (gather) holds i at p_i and -1 for pairs outside the range. Rows past
    the number of pairs in range are undefined (row_idx_type 1's indices too). The v2 doc gives no
    formula: the pair order row*K + slot is how vllm-ascend reads expanded_row_idx (with probs [rows, K])."""
    calls["npu_moe_init_routing_v2"] += 1
    _require(x.dim() == 2 and expert_idx.dim() == 2 and x.shape[0] == expert_idx.shape[0],
             "x [NUM_ROWS, H] and expert_idx [NUM_ROWS, K] must be 2-D with the same rows")
    _require(x.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int8), f"x dtype {x.dtype}")
    _require(expert_idx.dtype == torch.int32, f"expert_idx must be int32, got {expert_idx.dtype}")
    _require(0 < expert_num <= 10240, "expert_num must be in (0, 10240] in count mode")
    _require(bool(((expert_idx >= 0) & (expert_idx < expert_num)).all()), "expert ids must lie in [0, expert_num)")
    _require(drop_pad_mode == 0, "only dropless (drop_pad_mode 0) is supported")
    _require(expert_tokens_num_flag is True, "only expert_tokens_num_flag=True is supported")
    _require(expert_tokens_num_type == 1, "only count mode (1) is modelled (the op supports 1 and 2)")
    _require(quant_mode == -1, "only quant_mode -1 is modelled (the op supports -1 and 1)")
    _require(offset is None, "offset is not used without static quantisation")
    _require(active_num in (-1, 0), "only active_num -1/0 (every pair) is modelled")
    _require(row_idx_type in (0, 1), "row_idx_type must be 0 or 1")
    n, k = expert_idx.shape
    start, end = active_expert_range or (0, expert_num)
    _require(0 <= start < end <= expert_num, f"active_expert_range {active_expert_range} not within [0, expert_num]")
    if scale is not None:
        _require(scale.dtype == torch.float32 and scale.shape == (n,), "scale must be fp32 [NUM_ROWS] (unquantised)")
    e = expert_idx.flatten().long()
    active = (e >= start) & (e < end)
    order = torch.where(active, e, end).argsort(stable=True)
    valid = int(active.sum())
    expanded_x = x[order // k]
    expanded_x[valid:] = 0 if x.dtype == torch.int8 else float("nan")
    expanded_scale = scale[order // k] if scale is not None else torch.full((n * k,), float("nan"))
    expanded_scale[valid:] = float("nan")
    if row_idx_type == 1:
        row_idx = order.to(torch.int32)
        row_idx[valid:] = n * k + 12345
    else:
        row_idx = torch.full((n * k,), -1, dtype=torch.int32)
        row_idx[order[:valid]] = torch.arange(valid, dtype=torch.int32)
    counts = torch.bincount(e[active] - start, minlength=end - start)
    return expanded_x, row_idx, counts, expanded_scale


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                       per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                       output_dtype=None, tuning_config=None):
    """Per-token quantised grouped GEMM, single tensors split on m (group_type 0, split_item 2/3):
    x [[M, K]] int8, weight [[E, K, N]] int8 (any strides), group_list int64 [E] (counts for
    group_list_type 1, cumsum for 0), scale [[E, N]], per_token_scale [[M]] fp32. Group g's rows get
    y = (x @ weight[g]) * per_token_scale * scale[g]; returns [y [M, N] output_dtype]. (The doc's "1-D
    scale per tensor" is per 2-D weight of a list; with one [E, K, N] weight vllm-ascend passes [E, N].)

    The doc asks sum(group_list) == M. vllm-ascend's all-gather expert-parallel path passes fewer (the
    rows past the sum are other ranks' pairs), as the doc of npu_grouped_matmul_finalize_routing allows
    (sum <= m) and npu_grouped_matmul_swiglu_quant's describes (rows past group_list[-1] are dirty):
    so sum <= M is accepted here and the rows past it come out as NaN."""
    calls["npu_grouped_matmul"] += 1
    _require(all(isinstance(a, list) and len(a) == 1 for a in (x, weight, scale, per_token_scale)),
             "x, weight, scale and per_token_scale are modelled as one-tensor lists")
    _require(group_type == 0 and split_item in (2, 3), "one x/weight/y tensor needs group_type 0, split_item 2 or 3")
    _require(act_type == 0, "activations are not modelled")
    _require(all(a is None for a in (bias, offset, antiquant_scale, antiquant_offset, activation_input,
                                     activation_quant_scale, activation_quant_offset)),
             "bias/offset/antiquant/activation inputs are not modelled")
    x, weight, scale, pts = x[0], weight[0], scale[0], per_token_scale[0]
    _require(x.dtype == torch.int8 and weight.dtype == torch.int8, "per-token quantisation needs int8 x and weight")
    _require(x.dim() == 2 and weight.dim() == 3 and x.shape[1] == weight.shape[1],
             f"x {list(x.shape)} [M, K] and weight {list(weight.shape)} [E, K, N] do not multiply")
    m, (g, kk, n) = x.shape[0], weight.shape
    _require(kk < 65536 and n < 65536, "inner dimensions must be below 65536")
    _require(isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64
             and group_list.shape == (g,) and g <= 1024, f"group_list must be int64 [{g}] (at most 1024 groups)")
    _require(group_list_type in (0, 1), "group_list_type must be 0 (cumsum) or 1 (counts)")
    counts = group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
    _require(bool((counts >= 0).all()), "group sizes must be non-negative (cumsum non-decreasing)")
    _require(int(counts.sum()) <= m, "group_list covers more rows than x has")
    allowed = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float32}     # output_dtype: scale dtype
    _require(output_dtype in allowed and scale.dtype == allowed[output_dtype],
             f"per-token quantisation takes bf16 scale with bf16 output or fp32 scale with fp16 output, "
             f"got {scale.dtype} -> {output_dtype}")
    _require(scale.shape == (g, n), f"scale must be [{g}, {n}]")
    _require(pts.dtype == torch.float32 and pts.shape == (m,), f"per_token_scale must be fp32 [{m}]")
    group = torch.repeat_interleave(torch.arange(g), counts)
    rows = group.shape[0]
    acc = torch.bmm(x[:rows, None].to(torch.int32), weight[group].to(torch.int32)).squeeze(1).float()
    y = torch.full((m, n), float("nan"), dtype=output_dtype)
    y[:rows] = (acc * pts[:rows, None] * scale[group].float()).to(output_dtype)
    return [y]


def npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):
    """Interleave mode without rotate: output = r1 * input + r2 * x_new, x_new pairwise (-x[2i+1], x[2i]).
    The jit_compile=False constraints: 4-D input in BSND with B * N < 1000, D < 896 and even, r1/r2
    shaped 1S1D (one row per position, shared by batch and heads). Only interleave is modelled."""
    calls["npu_rotary_mul"] += 1
    _require(rotary_mode == "interleave" and rotate is None, "only interleave mode without rotate is modelled")
    _require(all(t.dtype in (*HALF, torch.float32) for t in (input, r1, r2)), "dtypes must be fp16/bf16/fp32")
    _require(input.dim() == 4, "input must be 4-D (BSND)")
    b, s, n, d = input.shape
    _require(b * n < 1000 and d < 896 and d % 2 == 0, f"input {list(input.shape)}: B*N < 1000, D < 896 and even")
    _require(r1.shape == r2.shape == (1, s, 1, d), f"interleave mode takes r1/r2 as 1S1D [1, {s}, 1, {d}]")
    _require(bool((r1.abs() <= 1).all() and (r2.abs() <= 1).all()), "r1/r2 must lie in [-1, 1]")
    x1, x2 = input[..., ::2], input[..., 1::2]
    x_new = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return r1 * input + r2 * x_new


def _require_mhc_chip(op):
    _require(npu.get_soc_version() >= 260, f"{op} runs on Ascend 950 only (soc_version {npu.get_soc_version()})")


def npu_mhc_pre(x, phi, alpha, bias, *, gamma=None, norm_eps=1e-6, hc_eps=1e-6, out_flag=0, inner_precise=0):
    """MhcPre, x [B,S,n,D] or [T,n,D] bf16/fp16, phi fp32 [n^2+2n, nD] (pre, post, res rows), alpha fp32
    [3], bias fp32 [n^2+2n]. ops-transformer's formula (aclnnMhcPre.md; hc_eps from MhcPreBackward's):
    h_mix = x phi^T (x flattened to nD), inv_rms = 1/sqrt(mean(x^2) + norm_eps) over nD,
    H = alpha * (h_mix * inv_rms) + bias per part, h_pre = sigmoid(H_pre) + hc_eps, h_post = 2 sigmoid(H_post),
    h_res = H_res as [n, n] (not Sinkhorn-normalised), h_in = sum_i x_i h_pre_i in x's dtype.
    Returns (h_in, h_post, h_res, inv_rms, h_mix, h_pre); the last three are NaN unless out_flag is 1."""
    calls["npu_mhc_pre"] += 1
    _require_mhc_chip("npu_mhc_pre")
    _require(x.dtype in HALF and x.dim() in (3, 4), f"x must be bf16/fp16 [T,n,D] or [B,S,n,D], got {x.dtype} "
             f"{list(x.shape)}")
    n, d = x.shape[-2:]
    mix = n * n + 2 * n
    _require(phi.dtype == torch.float32 and phi.shape == (mix, n * d), f"phi must be fp32 [{mix}, {n * d}]")
    _require(alpha.dtype == torch.float32 and alpha.numel() == 3, "alpha must be fp32 [3] ([2] is not modelled)")
    _require(bias.dtype == torch.float32 and bias.shape == (mix,), f"bias must be fp32 [{mix}]")
    _require(gamma is None, "gamma is not modelled")
    _require(out_flag in (0, 1) and inner_precise in (0, 1), "out_flag and inner_precise must be 0 or 1")
    xf = x.flatten(-2).float()
    h_mix = torch.nn.functional.linear(xf, phi)
    inv_rms = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    mix = h_mix * inv_rms
    h_pre = torch.sigmoid(mix[..., :n] * alpha[0] + bias[:n]) + hc_eps
    h_post = 2 * torch.sigmoid(mix[..., n:2 * n] * alpha[1] + bias[n:2 * n])
    h_res = (mix[..., 2 * n:] * alpha[2] + bias[2 * n:]).unflatten(-1, (n, n))
    h_in = (h_pre.unsqueeze(-1) * x.float()).sum(-2).to(x.dtype)
    inv_rms = inv_rms.squeeze(-1)
    if not out_flag:
        h_mix, h_pre, inv_rms = (torch.full_like(t, float("nan")) for t in (h_mix, h_pre, inv_rms))
    return h_in, h_post, h_res, inv_rms, h_mix, h_pre


def npu_mhc_sinkhorn(x, *, eps=1e-6, num_iters=20, out_flag=0):
    """MhcSinkhorn on fp32 x [T,n,n] or [B,S,n,n], n in {4, 6, 8}, num_iters in [1, 100].
    ops-transformer's formula (aclnnMhcSinkhorn.md): norm[0] = softmax(x, -1) + eps; norm[1] =
    norm[0] / (column sums + eps); then for i = 1..num_iters-1 a row normalisation and a column
    normalisation, each dividing by its sums + eps; the output is the last norm. Returns (y, None, None)
    (out_flag 1's saved norms and sums for the backward are not modelled)."""
    calls["npu_mhc_sinkhorn"] += 1
    _require_mhc_chip("npu_mhc_sinkhorn")
    _require(x.dtype == torch.float32 and x.dim() in (3, 4), "x must be fp32 [T,n,n] or [B,S,n,n]")
    _require(x.shape[-1] == x.shape[-2] and x.shape[-1] in (4, 6, 8),
             f"x's last dims must be n x n, n in 4/6/8: {list(x.shape)}")
    _require(1 <= num_iters <= 100, f"num_iters must be in [1, 100], got {num_iters}")
    _require(out_flag == 0, "out_flag 1 is not modelled")
    # the softmax over a tokens-last view, as the reference lays it out: torch's CPU softmax
    # rounds differently by layout on some CPUs (AVX-512 on AMD Zen 4), and the tests compare bit for bit
    n = x.shape[-1]
    y = x.reshape(-1, n, n).permute(1, 2, 0).softmax(1).permute(2, 0, 1).reshape(x.shape) + eps
    y = y / (y.sum(-2, keepdim=True) + eps)
    for _ in range(num_iters - 1):
        y = y / (y.sum(-1, keepdim=True) + eps)
        y = y / (y.sum(-2, keepdim=True) + eps)
    return y, None, None


def npu_mhc_post(x, h_res, h_out, h_post):
    """MhcPost: x_{l+1} = h_res^T x + h_out (x) h_post (the wheel's doc formula), per token
    y_k = h_post_k * h_out + sum_j h_res[j, k] * x_j, computed in fp32, in x's dtype and shape.
    x [B,S,n,D] / [T,n,D] bf16/fp16, h_res fp32 [..., n, n] (None: x + h_out (x) h_post, Ascend 950),
    h_out [B,S,D] / [T,D] in x's dtype, h_post fp32 [..., n]."""
    calls["npu_mhc_post"] += 1
    _require_mhc_chip("npu_mhc_post")
    _require(x.dtype in HALF and x.dim() in (3, 4), "x must be bf16/fp16 [T,n,D] or [B,S,n,D]")
    lead, (n, d) = x.shape[:-2], x.shape[-2:]
    _require(h_out.dtype == x.dtype and h_out.shape == (*lead, d), f"h_out must be {x.dtype} {[*lead, d]}")
    _require(h_post.dtype == torch.float32 and h_post.shape == (*lead, n), f"h_post must be fp32 {[*lead, n]}")
    _require(h_res is None or (h_res.dtype == torch.float32 and h_res.shape == (*lead, n, n)),
             f"h_res must be fp32 {[*lead, n, n]}")
    four = (lambda t: t) if x.dim() == 4 else (lambda t: t.unsqueeze(0))    # one formula for both layouts
    xs, out, post = four(x).float(), four(h_out).float(), four(h_post)
    mixed = xs if h_res is None else torch.einsum("bsjk,bsjd->bskd", four(h_res), xs)
    y = post.unsqueeze(-1) * out.unsqueeze(2) + mixed
    return y.to(x.dtype).view(x.shape)
