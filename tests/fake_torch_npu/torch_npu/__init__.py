"""A CPU stand-in for the torch_npu ops dsv4cli.kernels.npu calls, for tests only.

Each op takes the documented arguments (torch_npu 2.14.0's _op_plugin_docs.py: npu_dynamic_quant,
npu_quant_matmul, npu_rms_norm, npu_moe_init_routing_v2, npu_grouped_matmul; output shapes as in
op_plugin/meta/_meta_registrations.py), rejects the shapes and dtypes the docs rule out for Atlas
A2/A3, and computes the documented formula in fp32/int32. Outputs the docs call undefined come out
as garbage (NaN, or out-of-range indices), so callers that read them fail. `calls` counts the calls
so tests can see the fused path was taken.
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
