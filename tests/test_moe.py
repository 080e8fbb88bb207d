"""Routed-only experts: both ways of running them (host routing on the CPU, grouped GEMMs over stacked
experts for accelerators) equal the dense oracle, read only the routed experts' weights, and the
CPU's packed int8 GEMM gives the same sums as torch._int_mm."""
import copy

import pytest
import torch
import torch.nn.functional as F
from tiny import chunk_logits, mtp_chunk_logits, random_model, tiny_config

from dsv4cli.kernels import cpu, native, reference
from dsv4cli.model import DecodeState, ModelConfig
from dsv4cli.model.model import Gate, MoE, OpModule, PackedWeight
from dsv4cli.model.quant import quantize_model


def dense_oracle(moe: MoE, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The former decode path: every local expert on every token through a dense routing table
    (weight 0 for unrouted tokens), the shared expert alongside."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    weights, idx = moe.gate(x, input_ids)
    local = idx - moe.first
    ok = (local >= 0) & (local < moe.n_local)
    table = torch.zeros(x.shape[0], moe.n_local + 1)
    table.scatter_add_(1, torch.where(ok, local, moe.n_local), torch.where(ok, weights, 0.0))
    y = torch.zeros(x.shape)
    for e, expert in enumerate(moe.local_experts()):
        y += expert(x, table[:, e:e + 1]).float()
    y += moe.shared_experts(x).float()
    return y.view(shape)


def moe_layers(quantized: bool):
    model = random_model(tiny_config(n_routed_experts=16, num_experts_per_tok=3), seed=4)
    if quantized:
        quantize_model(model)
    return [layer.ffn for layer in model.layers] + [model.mtp[0].ffn]


def stacked(moe: MoE) -> MoE:
    moe = copy.deepcopy(moe)
    moe.stack_experts()
    return moe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_a_big_gate_is_packed_and_routes_as_the_reference(dtype):
    """V4 Flash's gate ([256, 4096] bf16) is big enough to pack: the CPU kernels then read it as stored (a plain
    weight was widened to fp32 at each call), hold no other copy, give it back whole in the state dict, and route
    as the reference's fp32 F.linear does (same experts; weights to fp32 sums' order). Layer 1: a biased top-k
    gate (layer 0 routes by hash)."""
    cfg = ModelConfig.from_dict(tiny_config(hidden_size=2048, n_routed_experts=256, num_experts_per_tok=6))
    gate = Gate(1, cfg)
    g = torch.Generator().manual_seed(0)
    torch.nn.init.normal_(gate.weight, std=0.02, generator=g)
    gate.weight.data = gate.weight.data.to(dtype)
    gate.bias.data.normal_(0, 0.01, generator=g)
    x = torch.randn(37, 2048, generator=g).to(dtype)
    ids = torch.randint(0, 256, (37,), generator=g)
    plain = gate.weight.detach().clone()
    expect_w, expect_idx = reference.moe_gate(F.linear(x.float(), plain.float()), gate.bias, None, ids, 6,
                                              cfg.score_func, cfg.route_scale)
    gate.ops = cpu
    gate.pack()
    assert gate.packed is not None and gate.weight.is_meta
    assert torch.equal(gate.state_dict()["weight"], plain)
    w, idx = gate(x, ids)
    assert torch.equal(idx, expect_idx)
    torch.testing.assert_close(w, expect_w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, 8, 130])
@torch.no_grad()
def test_host_and_grouped_paths_match_the_dense_oracle(quantized, tokens):
    g = torch.Generator().manual_seed(tokens)
    for moe in moe_layers(quantized):           # layer 0 routes by hash, the others by biased top-k
        x = torch.randn(1, tokens, 64, generator=g)
        ids = torch.randint(0, 256, (1, tokens), generator=g)
        want = dense_oracle(moe, x, ids)
        for run in (moe, stacked(moe)):
            torch.testing.assert_close(run(x, ids), want, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_grouped_experts_skip_other_ranks_experts():
    """Indices outside this rank's range (another rank's experts) add nothing, wherever they sort."""
    moe = stacked(moe_layers(True)[1])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g)
    weights = torch.rand(5, 3, generator=g)
    local = torch.tensor([[0, -3, 15], [16, 2, 2], [-1, -2, 20], [7, 15, 0], [3, 4, 5]])
    kept = torch.where((local >= 0) & (local < 16), weights, 0.0)
    want = sum(reference.grouped_experts(x, kept[:, j:j + 1], local[:, j:j + 1].clamp(0, 15), moe.stack)
               for j in range(3))
    torch.testing.assert_close(reference.grouped_experts(x, weights, local, moe.stack), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["host", "grouped", "fused"])
@pytest.mark.parametrize("batch", [1, 8])
@torch.no_grad()
def test_a_decode_step_reads_only_the_routed_experts_weights(batch, path, monkeypatch):
    """A spy on the expert GEMMs' weight arguments (the fused CPU kernel: on its call, which returns the
    experts it ran): the expert-weight bytes a step reads are those of the experts its tokens are routed
    to, on every path."""
    model = quantize_model(random_model(tiny_config(n_routed_experts=16, num_experts_per_tok=2), seed=5))
    moes = [layer.ffn for layer in [*model.layers, *model.mtp]]
    if path == "grouped":
        for moe in moes:
            moe.stack_experts()
    ran = []
    if path == "fused":
        if not native.available():
            pytest.skip("no native kernels on this machine")
        monkeypatch.setattr(cpu, "PACK_MIN_BYTES", 0)        # the tiny experts pack, as real ones do
        model.prepare()
        assert all(moe.table is not None and moe.table.shared for moe in moes)
        lib, kernel = native.library(), native.library().dsv4_routed_experts
        monkeypatch.setattr(lib, "dsv4_routed_experts", lambda *args: ran.append(kernel(*args)) or ran[-1])
    expert_bytes = {lin.weight.data_ptr(): lin.weight.numel()
                    for moe in moes for e in moe.local_experts() for lin in (e.w1, e.w2, e.w3)}
    routed, read = [], []
    gate, w8a8, grouped = reference.moe_gate, reference.w8a8_linear, reference.grouped_linear

    def spy_gate(*args, **kw):
        weights, idx = gate(*args, **kw)
        routed.append(set(idx.flatten().tolist()))
        return weights, idx

    def spy_w8a8(x, weight, *args, **kw):
        read.append(expert_bytes.get(weight.data_ptr(), 0))
        return w8a8(x, weight, *args, **kw)

    def spy_grouped(x, weight, scale, offs, group, xq=None):
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        read.append(int((counts > 0).sum()) * weight[0].numel())
        return grouped(x, weight, scale, offs, group, xq)

    ops = cpu if path == "fused" else reference       # the unprepared models run the reference
    monkeypatch.setattr(ops, "moe_gate", spy_gate)
    monkeypatch.setattr(ops, "w8a8_linear", spy_w8a8)
    monkeypatch.setattr(reference, "grouped_linear", spy_grouped)
    ids = torch.randint(0, 256, (batch, 1), generator=torch.Generator().manual_seed(batch))
    start = torch.zeros(batch, dtype=torch.long)
    _, hidden = chunk_logits(model, ids, start, DecodeState(model, batch, 64, max_draft=0))
    mtp_chunk_logits(model, hidden, ids, start, DecodeState(model, batch, 64, max_draft=0))
    per_expert = 3 * 32 * 64                    # w1, w3 [32, 64] and w2 [64, 32] int8
    assert len(routed) == len(moes)
    if path == "fused":                         # each call ran its routed experts, then the shared one
        assert ran == [len(r) + 1 for r in routed]
    else:
        assert sum(read) == sum(len(r) for r in routed) * per_expert
    assert sum(len(r) for r in routed) < len(moes) * 16     # fewer than all experts


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 64, 300])
def test_packed_int8_gemm_equals_int_mm(rows, monkeypatch):
    monkeypatch.setattr(cpu, "PACK_MIN_BYTES", 0)       # small weights stay plain by default
    g = torch.Generator().manual_seed(rows)
    weight = torch.randint(-127, 128, (96, 320), generator=g, dtype=torch.int8)
    scale = torch.rand(96, 1, generator=g) / 50
    packed = cpu.pack_w8a8(weight)
    if packed is None:
        pytest.skip("no exact packed int8 GEMM on this CPU (oneDNN without VNNI saturates)")
    x = torch.randn(rows, 320, generator=g) * 4
    assert torch.equal(cpu.w8a8_linear(x, weight, scale, packed=packed), reference.w8a8_linear(x, weight, scale))
    assert torch.equal(cpu.unpack_w8a8(packed), weight)


@pytest.mark.parametrize("form", ["fp32", "pairs"])
@pytest.mark.parametrize("rows", [1, 4, 5, 64])
def test_widened_int8_weights_give_int_mms_sums(rows, form):
    """A small int8 weight held as fp32 or packed for the pair GEMMs (`widen_w8a8`: CPUs where int8 GEMMs
    are slow) gives torch._int_mm's sums bit for bit, at the widest input it is used for and with extreme
    values."""
    if form == "pairs" and not native.avx2_available():
        pytest.skip("the AVX2 pair GEMMs can't be built or run here")
    g = torch.Generator().manual_seed(rows)
    n = cpu.EXACT_FP32_IN
    weight = torch.randint(-128, 128, (96, n), generator=g, dtype=torch.int8)
    weight[0], weight[1] = -128, 127
    scale = torch.rand(96, 1, generator=g) / 50
    x = torch.randn(rows, n, generator=g) * 4
    x[0] = x[0].abs()                       # row 0 quantises to 127s where it is largest
    want = reference.w8a8_linear(x, weight, scale)
    packed = weight.float() if form == "fp32" else native.pack_pairs(weight[None])
    assert torch.equal(cpu.w8a8_linear(x, weight, scale, packed=packed), want)
    assert torch.equal(cpu.unpack_w8a8(packed), weight)


@pytest.mark.skipif(not native.avx2_available(), reason="the AVX2 pair GEMMs can't be built or run here")
@pytest.mark.parametrize("pairs", [1, 7, 40])
def test_pair_gemms_give_int_mms_sums(pairs):
    """The native pair GEMMs: every pair's row against its expert's slice of a widened stack, exactly
    torch._int_mm's sums at the widest input a stack is widened for, extreme values included, runs of
    pairs longer and shorter than a tile, rows taken in any order."""
    g = torch.Generator().manual_seed(pairs)
    E, n, k = 5, 48, cpu.EXACT_FP32_IN
    weights = torch.randint(-128, 128, (E, n, k), generator=g, dtype=torch.int8)
    weights[:, 0], x = -128, torch.randint(-128, 128, (9, k), generator=g, dtype=torch.int8)
    x[0] = -128                              # 2^24 in channel 0: the largest exact sum
    rows = torch.randint(0, 9, (pairs,), generator=g)
    group = torch.randint(0, E, (pairs,), generator=g).sort().values
    packed = native.pack_pairs(weights)
    assert torch.equal(native.unpack_pairs(packed), weights)
    got = torch.ops.dsv4.expert_pairs_mm(x, rows, group, packed)
    want = torch.stack([torch._int_mm(x[r].view(1, k).expand(17, k).contiguous(), weights[e].t())[0]
                        for r, e in zip(rows.tolist(), group.tolist())]).float()
    assert torch.equal(got, want)


@pytest.mark.skipif(not native.avx2_available(), reason="the AVX2 pair GEMMs can't be built or run here")
@pytest.mark.parametrize("rows", [1, 6, 48])
def test_pair_gemms_at_real_widths(rows):
    """At V4 Flash's 4096-wide inputs (int32 sums past 2^24, so their fp32 conversion rounds) the pair GEMMs
    still give torch._int_mm's sums as `.float()` converts them, extreme values included; and where int8
    GEMMs are slow a weight that size is packed for them and its W8A8 linear is the reference's."""
    g = torch.Generator().manual_seed(rows)
    k = 4096
    weight = torch.randint(-128, 128, (512, k), generator=g, dtype=torch.int8)     # 2 MiB: a large weight
    weight[0] = -128
    q = torch.randint(-128, 128, (rows, k), generator=g, dtype=torch.int8)
    q[0] = -128                              # 2^26 in channel 0
    padded = torch.cat([q, q.new_zeros(max(0, 17 - rows), k)])
    want = torch._int_mm(padded, weight.t())[:rows].float()
    assert torch.equal(torch.ops.dsv4.pairs_linear(q, native.pack_pairs(weight[None])), want)
    if cpu.slow_int8():
        packed = cpu.pack_w8a8(weight)
        assert packed.dtype == torch.int8 and packed.dim() == 5
        scale = torch.rand(512, 1, generator=g) / 50
        x = torch.randn(rows, k, generator=g)
        assert torch.equal(cpu.w8a8_linear(x, weight, scale, packed=packed), reference.w8a8_linear(x, weight, scale))


@pytest.mark.skipif(not native.avx2_available(), reason="the AVX2 pair GEMMs can't be built or run here")
def test_pair_gemms_split_across_threads_give_the_same_bits():
    """A run of pairs on one expert splits its blocks across torch's threads (4096-wide inputs: 4 blocks of 16
    outputs a thread at least): each block is computed alone, so the sums are the same bits for any thread
    count, as is an expert stack's run pair by pair."""
    g = torch.Generator().manual_seed(0)
    k = 4096
    weights = torch.randint(-128, 128, (3, 256, k), generator=g, dtype=torch.int8)
    x = torch.randint(-128, 128, (9, k), generator=g, dtype=torch.int8)
    rows, group = torch.randint(0, 9, (14,), generator=g), torch.randint(0, 3, (14,), generator=g).sort().values
    packed, linear = native.pack_pairs(weights), native.pack_pairs(weights[:1])
    threads = torch.get_num_threads()
    outputs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outputs.append([torch.ops.dsv4.expert_pairs_mm(x, rows, group, packed),
                            torch.ops.dsv4.pairs_linear(x[:7], linear)])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for out in outputs[1:] for a, b in zip(outputs[0], out))
    assert torch.equal(outputs[0][1], torch._int_mm(torch.cat([x[:7], x.new_zeros(10, k)]), weights[0].t())[:7].float())


@pytest.mark.skipif(not (native.avx2_available() and cpu.slow_int8()), reason="for CPUs where int8 GEMMs are slow")
@torch.no_grad()
def test_large_int8_experts_run_in_place_on_the_pair_gemms(monkeypatch):
    """Where int8 GEMMs are slow, experts too large to also hold as a stack's pair copy (every one, here) are
    packed linear by linear for the pair GEMMs and run routed, each read in place: the dense oracle's
    output, and state_dict gives the int8 weights back."""
    monkeypatch.setattr(cpu, "PACK_MIN_BYTES", 0)
    moe = moe_layers(True)[1]
    g = torch.Generator().manual_seed(0)
    x, ids = torch.randn(1, 6, 64, generator=g), torch.randint(0, 256, (1, 6), generator=g)
    want = dense_oracle(moe, x, ids)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    for module in moe.modules():
        if isinstance(module, OpModule):
            module.ops = cpu
        if isinstance(module, PackedWeight):
            module.pack()
    moe.prepare_experts(on_host=True)
    assert moe.stack is None
    assert all(lin.packed.dtype == torch.int8 and lin.packed.dim() == 5
               for e in moe.local_experts() for lin in (e.w1, e.w2, e.w3))
    torch.testing.assert_close(moe(x, ids), want, rtol=1e-5, atol=1e-5)
    after = moe.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("form", ["paired", "widened"])
@pytest.mark.parametrize("tokens", [1, 2, 5, 8, 130])
@torch.no_grad()
def test_widened_stack_gives_the_reference_grouped_experts(tokens, form):
    """The grouped experts where int8 GEMMs are slow, on a stack paired for the native pair GEMMs and on a
    widened one (every expert over every row; with 1-2 tokens a gather per pair), directly and through
    `grouped_experts`: the reference's sums bit for bit, other ranks' experts adding nothing."""
    if form == "paired" and not native.avx2_available():
        pytest.skip("the AVX2 pair GEMMs can't be built or run here")
    moe = stacked(moe_layers(True)[1])
    stack = getattr(cpu, form)(moe.stack)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=g)
    weights = torch.rand(tokens, 3, generator=g)
    local = torch.stack([torch.randperm(20, generator=g)[:3] - 2 for _ in range(tokens)])    # -2 .. 17 of 16
    want = reference.grouped_experts(x, weights, local, moe.stack)
    assert torch.equal(cpu.wide_grouped_experts(x, weights, local, stack), want)
    assert torch.equal(cpu.grouped_experts(x, weights, local, stack), want)
