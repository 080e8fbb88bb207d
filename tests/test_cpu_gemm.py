"""The CPU's native few-row GEMMs (`kernels/native.py`): exact int8 sums, fp32 sums as accurate as
MKL's, a row's result independent of the rows beside it, packed modules that unpack to their weights,
a model with every linear packed that gives the plain model's tokens, the fused routed experts
that give the torch experts' sums, the indexer's scan that gives torch's scores, and sparse attention and
the compressors' pooling that give torch's outputs."""
import copy
from pathlib import Path

import pytest
import torch
from tiny import chunk_logits, prompts, random_model, tiny_config

from dsv4cli import platforms
from dsv4cli.config import BUNDLED_MODEL_DIR
from dsv4cli.engine import Engine, EngineOptions, SamplingParams
from dsv4cli.kernels import cpu, native, reference
from dsv4cli.model import DecodeState, load_model
from dsv4cli.model.model import Linear, PackedWeight, ParallelHead
from dsv4cli.model.quant import quantize_model, quantize_weight
from dsv4cli.platforms.cpu import HUGE_PAGE

NATIVE = pytest.mark.skipif(not native.available(), reason="no x86-64 CPU with AVX-512 VNNI, or no C compiler")
# the float GEMM: the native one, or without it the AVX2 op (`cpu_float.cpp`)
FLOAT = pytest.mark.skipif(not (native.available() or native.avx2_available()),
                           reason="no x86-64 CPU with AVX2 and FMA, or no C/C++ compiler")

# 7 blocks of 32 channels: whole groups of 4 and 2 blocks read side by side, and the blocks left over
CHANNELS = 7 * native.BLOCK


@NATIVE
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 13, 16, 37])
@pytest.mark.parametrize("k", [132, 192])
def test_int8_sums_are_exact(rows, k):
    """VNNI for every shape; with k a multiple of 64 and 8 rows or more, AMX where the CPU has it (16-row
    tiles in pairs: 37 rows fill a pair and part of another)."""
    g = torch.Generator().manual_seed(rows)
    weight = torch.randint(-128, 128, (CHANNELS, k), generator=g, dtype=torch.int8)
    q = torch.randint(-128, 128, (rows, k), generator=g, dtype=torch.int8)
    packed = native.pack_int8(weight)
    assert torch.equal(native.unpack_int8(packed), weight)
    assert torch.equal(native.int8_mm(q, packed), (q.long() @ weight.long().t()).float())
    assert native.int8_mm(q[:0], packed).shape == (0, CHANNELS)


@FLOAT
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11, 16, 49])
def test_float_sums_are_as_accurate_as_mkl_and_each_row_is_its_own(rows):
    """K = 600 spans 19 of the native kernel's 32-step partial sums, 10 of the AVX2 op's 64-step ones and
    two of its 512-step chunks; 49 rows two of its row groups. Every channel sums in the same order
    whatever the row count, so a row's result is the same bits alone or beside others."""
    g = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(CHANNELS, 600, generator=g), torch.randn(rows, 600, generator=g)
    packed = native.pack_float(weight)
    assert torch.equal(native.unpack_float(packed), weight)
    y = native.float_mm(x, packed)
    exact = x.double() @ weight.double().t()

    def rms_error(got):
        return (got.double() - exact).square().mean().sqrt()

    assert rms_error(y) <= 1.5 * rms_error(x @ weight.t())       # measured: 1.13x MKL's with one row (AVX2: 0.7x)
    for i in range(rows):
        assert torch.equal(native.float_mm(x[i:i + 1], packed), y[i:i + 1])
    assert native.float_mm(x[:0], packed).shape == (0, CHANNELS)


@FLOAT
def test_a_weight_whose_values_are_bf16_is_held_in_bf16_and_gives_the_fp32_bits(monkeypatch):
    """The W8A8 checkpoints store the float linears in bf16: held so, the kernel reads half the bytes and
    widens them exactly, so every row count gives the bits of the fp32 copy. Other weights stay fp32."""
    monkeypatch.setattr(cpu, "PACK_MIN_BYTES", 0)
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(CHANNELS, 600, generator=g).bfloat16().float(), torch.randn(16, 600, generator=g)
    held = cpu.pack_linear_fp32(weight)
    assert held.dtype == torch.bfloat16 and torch.equal(native.unpack_float(held), weight)
    fp32 = native.pack_float(weight)
    for rows in (1, 2, 3, 4, 5, 6, 8, 16):
        assert torch.equal(native.float_mm(x[:rows], held), native.float_mm(x[:rows], fp32))
    assert cpu.pack_linear_fp32(weight + 1e-3).dtype == torch.float32


def split_across_threads(run):
    """run() with one thread, then with two."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        return one, run()
    finally:
        torch.set_num_threads(threads)


@NATIVE
def test_threads_split_the_int8_blocks_and_give_the_same_bits():
    g = torch.Generator().manual_seed(0)
    weight = torch.randint(-128, 128, (CHANNELS, 192), generator=g, dtype=torch.int8)
    q = torch.randint(-128, 128, (37, 192), generator=g, dtype=torch.int8)
    packed = native.pack_int8(weight)
    one, two = split_across_threads(lambda: [native.int8_mm(q[:m], packed) for m in (1, 8, 37)])
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@FLOAT
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_split_the_float_blocks_and_give_the_same_bits(dtype):
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(CHANNELS, 600, generator=g), torch.randn(11, 600, generator=g)
    packed = native.pack_float(weight.to(dtype).float(), dtype)
    one, two = split_across_threads(lambda: [native.float_mm(x[:m], packed) for m in (1, 3, 11)])
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@FLOAT
def test_packed_modules_compute_the_same_and_unpack_to_their_weights(monkeypatch):
    monkeypatch.setattr(cpu, "PACK_MIN_BYTES", 0)       # small weights stay plain by default
    g = torch.Generator().manual_seed(0)
    int8 = Linear(96, CHANNELS)
    weight, scale = quantize_weight(torch.randn(CHANNELS, 96, generator=g))
    int8.weight = torch.nn.Parameter(weight, requires_grad=False)
    int8.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    fp32 = Linear(96, CHANNELS)
    grouped = Linear(96, 4 * 64, groups=4)                    # attention's wo_a: 4 groups of 64 rows
    head = ParallelHead(CHANNELS, 96)
    for module in (fp32, grouped, head):
        module.weight = torch.nn.Parameter(torch.randn(module.weight.shape, generator=g), requires_grad=False)
    x = torch.randn(3, 5, 96, generator=g)
    xg = torch.randn(3, 5, 4, 96, generator=g)

    for module in (int8, fp32, grouped, head):
        module.ops = cpu                      # what `Transformer.prepare` binds on the CPU

    def outputs():
        return [int8(x), fp32(x), head(x), cpu.grouped_projection(xg, grouped.weight.view(4, 64, 96), grouped.packed)]

    before, weights = outputs(), [m.state_dict()["weight"].clone() for m in (int8, fp32, grouped, head)]
    for module in (int8, fp32, grouped, head):
        module.pack()
        assert module.packed is not None and module.weight.is_meta
    after = outputs()
    assert torch.equal(after[0], before[0])                    # int8 sums are exact
    for got, want in zip(after[1:], before[1:]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for module, weight in zip((int8, fp32, grouped, head), weights):
        assert torch.equal(module.state_dict()["weight"], weight)
    assert Linear(96, 4 * 24, groups=4)._pack(torch.randn(96, 96)) is None   # 24-row groups: not whole blocks


@FLOAT
def test_a_model_with_every_linear_packed_gives_the_plain_models_tokens(tok, monkeypatch):
    """W8A8 tiny model whose widths are multiples of 32, so the linears and the head pack: its logits
    against the same model held plain, and its speculative greedy output against its plain greedy."""
    cfg = tiny_config(vocab_size=320, q_lora_rank=64, o_lora_rank=32)
    plain = quantize_model(random_model(cfg, seed=1))
    model = copy.deepcopy(plain)
    plain.prepare()
    monkeypatch.setattr(cpu, "PACK_MIN_BYTES", 0)
    model.prepare()
    held = [m for m in model.modules() if isinstance(m, PackedWeight)]
    # all but the indexer's 4-head weights_proj and the 8-expert gates (4 and 8 rows: not whole blocks; a gate
    # that packs: test_moe)
    assert sorted(tuple(m.weight.shape) for m in held if m.packed is None) == [(4, 64)] * 2 + [(8, 64)] * 5
    kinds = [m.packed.dtype for m in held if m.packed is not None]
    int8 = torch.uint8 if native.available() else torch.int8        # the native layout, or the pair GEMMs'
    assert kinds.count(int8) > kinds.count(torch.float32) > 0
    ids = torch.tensor(prompts([60], 320, seed=2))
    with torch.no_grad():
        logits = [chunk_logits(m, ids, torch.tensor([0]), DecodeState(m, 1, 128))[0] for m in (plain, model)]
    # fp32 sums in another order move an activation across an int8 rounding step now and then (test_w8a8)
    assert ((logits[1] - logits[0]).norm() / logits[0].norm()) < 5e-3
    assert (logits[1].argmax(-1) == logits[0].argmax(-1)).float().mean() > 0.95
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = prompts([5, 31, 12], 320, seed=4)
    with torch.no_grad():
        want = [s.output_ids for s in Engine(model, tok,
                                             EngineOptions(max_batch=3, max_seq_len=128, drafts=0)).generate(runs,
                                                                                                  params)]
        got = [s.output_ids for s in Engine(model, tok,
                                            EngineOptions(max_batch=3, max_seq_len=128, drafts=2)).generate(runs,
                                                                                                  params)]
    assert got == want



@NATIVE
def test_an_fp32_run_packs_a_bf16_weight_from_the_files_bytes(monkeypatch):
    """The bundled model's LM head is stored in bf16: an fp32 run packs it from the file's bytes (widened first,
    V4 Flash's head took 2 s and 2 GB more to load), to the bits the widened copy packs to; a weight the kernels
    keep no packed copy of (under 2 MiB) is held widened to fp32."""
    plain = load_model(BUNDLED_MODEL_DIR, "cpu", torch.float32, progress=False)
    assert plain.head.packed is None and plain.head.weight.dtype == torch.float32
    packing, seen = cpu.pack_linear_fp32, []
    monkeypatch.setattr(cpu, "pack_linear_fp32",
                        lambda weight, groups=1: seen.append(weight) or packing(weight, groups))
    monkeypatch.setattr(cpu, "PACK_MIN_BYTES", 0)
    packed = load_model(BUNDLED_MODEL_DIR, "cpu", torch.float32, progress=False)
    heads = [w.dtype for w in seen if w.shape == plain.head.weight.shape]
    assert heads and set(heads) == {torch.bfloat16} and packed.head.packed.dtype == torch.bfloat16
    assert torch.equal(packed.head.packed, native.pack_float(plain.head.weight, torch.bfloat16))

def packed_and_plain_moes(dtype, limit):
    """The MoE layers of a W8A8 model prepared for the CPU (experts packed, so each layer runs them in one
    native call) and of the same model held plain (experts one by one in torch, torch._int_mm)."""
    cfg = tiny_config(n_routed_experts=16, num_experts_per_tok=3, moe_intermediate_size=64, swiglu_limit=limit)
    plain = quantize_model(random_model(cfg, seed=4)).to(dtype)
    model = copy.deepcopy(plain)
    cpu.PACK_MIN_BYTES, before = 0, cpu.PACK_MIN_BYTES
    try:
        model.prepare()
    finally:
        cpu.PACK_MIN_BYTES = before
    return [(a.ffn, b.ffn) for a, b in zip([*model.layers, *model.mtp], [*plain.layers, *plain.mtp])]


@NATIVE
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [10.0, 0.3])            # 0.3: the SwiGLU clamps bite
@torch.no_grad()
def test_the_fused_experts_give_the_torch_experts_sums(dtype, limit):
    """One native call per MoE layer (routed experts, then the shared one) against each expert in torch:
    the same arithmetic in the same order, so bf16 activations give the same bits; fp32 ones differ only
    where libm's exp and torch's differ in SwiGLU (an ulp). 40 rows: experts with 8+ rows take AMX."""
    for tokens in (1, 3, 8, 40):
        g = torch.Generator().manual_seed(tokens)
        x = (torch.randn(2, tokens, 64, generator=g) * 3).to(dtype)
        ids = torch.randint(0, 256, (2, tokens), generator=g)
        for fused, plain in packed_and_plain_moes(dtype, limit):   # layer 0 routes by hash, the others by top-k
            assert fused.table is not None and fused.table.shared and plain.table is None
            got, want = fused(x, ids), plain(x, ids)
            if dtype == torch.bfloat16:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@NATIVE
@torch.no_grad()
def test_the_fused_experts_skip_other_ranks_experts_and_never_use_unrouted_ones():
    """Pairs outside this rank's experts add nothing; an expert no row is routed to is never used
    (its scales poisoned with NaN leave every output finite and unchanged); 2 threads give 1's bits."""
    fused, plain = packed_and_plain_moes(torch.float32, 10.0)[1]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g)
    xq = reference.quantize_per_token(x)
    weights = torch.rand(5, 3, generator=g)
    local = torch.tensor([[0, -3, 15], [16, 2, 2], [-1, -2, 20], [7, 15, 0], [3, 4, 5]])
    want = reference.routed_experts(x, weights, local, plain.local_experts(), None, xq)

    def fused_call(local, shared=False):
        return native.routed_experts(*xq, weights, local, fused.table, fused.limit, x.dtype, shared)

    got = fused_call(local)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for e in set(range(16)) - set(local.flatten().tolist()):
        for linear in (fused.experts[e].w1, fused.experts[e].w2, fused.experts[e].w3):
            linear.weight_scale.fill_(float("nan"))      # the table reads these very tensors
    assert torch.equal(fused_call(local), got)
    with_shared = fused_call(local, shared=True)
    torch.testing.assert_close(with_shared, got + plain.shared_experts(x, xq=xq).float(), rtol=1e-6, atol=1e-6)
    elsewhere = torch.full_like(local, 16)          # every pair on another rank's experts
    assert torch.equal(fused_call(elsewhere), torch.zeros(5, 64))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)                        # the GEMMs split their blocks: the same bits
    try:
        assert torch.equal(fused_call(local), got)
    finally:
        torch.set_num_threads(threads)


def indexer_inputs(g, batch, rows, heads, dim, keys, dtype):
    """Query rows, head weights (negative ones too), and keys as a cache's slice (rows past them unused)."""
    q = torch.randn(batch, rows, heads, dim, generator=g)
    cache = torch.randn(batch, keys + 5, dim, generator=g).to(dtype)
    return q, cache[:, :keys], torch.randn(batch, rows, heads, generator=g)


@NATIVE
@pytest.mark.parametrize("heads", [16, 32, 48, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_indexer_scan_gives_torchs_scores(heads, dtype):
    """Every group size (24, 12, 8 and 6 keys by heads) with keys left over (203 keys: two chunks of
    96 and a partial one), keys read in place from a slice, bf16 keys widened exactly."""
    g = torch.Generator().manual_seed(heads)
    q, keys, w = indexer_inputs(g, 2, 3, heads, 128, 203, dtype)
    assert native.scannable(q, keys)
    got, want = native.indexer_scores(q, keys, w), reference.indexer_scores(q, keys, w)
    assert got.shape == (2, 3, 203)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(cpu.indexer_scores(q, keys, w), got)      # the CPU's indexer takes it
    assert native.indexer_scores(q, keys[:, :0], w).shape == (2, 3, 0)


@NATIVE
def test_a_native_indexer_score_depends_on_its_row_and_key_alone():
    """The chunked prefill and the full forward pick the same blocks only if a key's score is the
    same whatever the call: fewer keys, one row, one sequence, more threads give the same bits."""
    g = torch.Generator().manual_seed(5)
    q, keys, w = indexer_inputs(g, 3, 4, 64, 128, 250, torch.float32)
    full = native.indexer_scores(q, keys, w)
    assert torch.equal(native.indexer_scores(q, keys[:, :101], w), full[..., :101])
    assert torch.equal(native.indexer_scores(q[1:2, 2:3], keys[1:2], w[1:2, 2:3]), full[1:2, 2:3])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(native.indexer_scores(q, keys, w), full)
    finally:
        torch.set_num_threads(threads)
    assert not native.scannable(q[..., :8, :], keys)              # 8 heads: not whole vectors, torch's bmm


def attention_inputs(g, batch, rows, heads, dim, dtype):
    """Query rows and three sources as a layer's step reads them: a window ring (rows masked off), the chunk's own
    rows (causal), and compressed blocks twice, by an index (out of range and masked entries among it) and whole
    (each sequence sees a prefix); the blocks a slice of a longer cache of another batch size."""
    q = torch.randn(batch, rows, heads, dim, generator=g).to(dtype)
    ring, chunk = torch.randn(batch, 16, dim, generator=g).to(dtype), torch.randn(batch, rows, dim, generator=g)
    blocks = torch.randn(batch + 1, 45, dim, generator=g)[:batch, :40]
    idx = torch.randint(-2, 45, (batch, rows, 24), generator=g)
    seen = torch.randint(0, 41, (batch, 1, 1), generator=g)
    sources = [(ring, torch.rand(batch, rows, 16, generator=g) < 0.8, None),
               (chunk, torch.ones(rows, rows, dtype=torch.bool).tril()[None], None),
               (blocks.to(dtype), torch.rand(batch, rows, 24, generator=g) < 0.7, idx),
               (blocks, torch.arange(40) < seen, None)]
    return q, sources, torch.randn(heads, generator=g)


@NATIVE
@pytest.mark.parametrize("heads,dim", [(64, 512), (8, 512), (20, 32), (4, 16), (128, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_sparse_attention_gives_torchs_outputs(heads, dim, dtype):
    """V4 Flash's 64 heads x 512 (and a rank's 8 of them under --tp 8, heads in part of a vector, 128 heads in two
    work items), fp32 and bf16 rows read in place, by index and whole, and the CPU's attention takes it."""
    g = torch.Generator().manual_seed(heads + dim)
    q, sources, sink = attention_inputs(g, 2, 3, heads, dim, dtype)
    assert native.attention_fits(q, sources)
    got, want = native.sparse_attention(q, sources, sink, dim ** -0.5), reference.sparse_attention(
        q, sources, sink, dim ** -0.5)
    assert got.dtype == dtype and got.shape == q.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:       # the same fp32 sums in another order, then each rounded to bf16: one bf16 step apart at most
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-6).all()
    assert torch.equal(cpu.sparse_attention(q, sources, sink, dim ** -0.5), got)


@NATIVE
def test_a_native_attention_row_depends_on_its_own_inputs_alone():
    """Verifying drafts gives plain decoding's numbers only if a query row's output is the same whatever the call:
    one row alone, one sequence alone, and 2 threads (which split a row's heads) give the same bits."""
    g = torch.Generator().manual_seed(7)
    q, sources, sink = attention_inputs(g, 2, 5, 64, 128, torch.float32)
    full = native.sparse_attention(q, sources, sink, 0.1)
    for b, s in ((1, 3), (0, 0)):
        alone = [(kv[b:b + 1], mask.expand(2, 5, -1)[b:b + 1, s:s + 1],
                  None if idx is None else idx[b:b + 1, s:s + 1]) for kv, mask, idx in sources]
        assert torch.equal(native.sparse_attention(q[b:b + 1, s:s + 1], alone, sink, 0.1), full[b:b + 1, s:s + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(native.sparse_attention(q, sources, sink, 0.1), full)
        assert torch.equal(native.sparse_attention(q[:1, :1], [(kv[:1], mask.expand(2, 5, -1)[:1, :1],
                                                                None if idx is None else idx[:1, :1])
                                                               for kv, mask, idx in sources], sink, 0.1), full[:1, :1])
    finally:
        torch.set_num_threads(threads)


@NATIVE
def test_native_attention_of_a_row_that_sees_nothing_is_zero():
    """Every key masked: the sink alone takes the softmax's mass, as in torch's (exp(-inf) = 0)."""
    g = torch.Generator().manual_seed(8)
    q, sources, sink = attention_inputs(g, 1, 2, 16, 32, torch.float32)
    hidden = [(kv, torch.zeros_like(mask), idx) for kv, mask, idx in sources]
    assert torch.equal(native.sparse_attention(q, hidden, sink, 0.2), torch.zeros_like(q))
    assert torch.equal(reference.sparse_attention(q, hidden, sink, 0.2), torch.zeros_like(q))


@NATIVE
@pytest.mark.parametrize("ratio,rows", [(4, 1), (4, 7), (4, 300), (128, 1), (128, 300)])
def test_native_compressor_pooling_gives_torchs_blocks(ratio, rows):
    """The blocks a call closes (ratio 4's overlapping halves, HCA's 128 rows; candidates from the ring and the
    chunk, some before position 0), as torch pools them; the slots whose block does not close (the sink's) are
    zeros, where torch pools whatever their candidates hold."""
    from dsv4cli.model.model import CompressPlan
    g = torch.Generator().manual_seed(ratio + rows)
    state = DecodeState(random_model(tiny_config()), 3, 2048, max_draft=2)
    start = torch.tensor([2, 127, 1001])
    plan = CompressPlan(ratio, start, start[:, None] + torch.arange(rows), state, 2048)
    C = 64 * (2 if ratio == 4 else 1)
    ring_kv, ring_gate = (torch.randn(4, state.ring, C, generator=g)[:3] for _ in range(2))
    kv, gate = (torch.randn(3, rows, C, generator=g) for _ in range(2))
    assert native.compress_fits(ring_kv, ring_gate, kv, gate, plan)
    got = native.compress_blocks(ring_kv, ring_gate, kv, gate, plan, ratio)
    want = reference.compress_blocks(ring_kv, ring_gate, kv, gate, plan, ratio)
    closes = plan.closes
    assert got.shape == want.shape == (3, -(-rows // ratio), 64) and closes.any()
    torch.testing.assert_close(got[closes], want[closes], rtol=1e-5, atol=1e-6)
    assert (got[~closes] == 0).all()
    assert torch.equal(cpu.compress_blocks(ring_kv, ring_gate, kv, gate, plan, ratio), got)


@NATIVE
def test_a_compiled_graph_calls_the_native_indexer_scan():
    g = torch.Generator().manual_seed(6)
    q, keys, w = indexer_inputs(g, 1, 2, 16, 32, 40, torch.float32)
    compiled = torch.compile(cpu.indexer_scores, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(q, keys, w), native.indexer_scores(q, keys, w))


@NATIVE
@pytest.mark.parametrize("shape", [(1, 1, 4, 4), (2, 5, 4, 4), (1, 300, 4, 4), (3, 2, 2), (6, 8, 8)])
def test_the_native_sinkhorn_gives_the_references_comb(shape):
    """Decode's few rows and a prefill chunk's hundreds, n = 2, 4, 8: within a few fp32 ulps of the reference
    (libm's exp against torch's), doubly stochastic to the reference's precision; each token its own."""
    g = torch.Generator().manual_seed(len(shape) * shape[-1])
    logits = torch.randn(*shape, generator=g) * 3
    got, want = native.mhc_sinkhorn(logits, 1e-6, 20), reference.mhc_sinkhorn(logits, 1e-6, 20)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.equal(got, reference.mhc_sinkhorn(logits, 1e-6, 3))        # the iterations count
    torch.testing.assert_close(got.sum(-2), torch.ones(shape[:-1]), rtol=0, atol=1e-5)
    tokens = logits.reshape(-1, *shape[-2:])
    assert torch.equal(native.mhc_sinkhorn(tokens[-1:], 1e-6, 20), got.reshape(-1, *shape[-2:])[-1:])
    assert torch.equal(cpu.mhc_sinkhorn(logits, 1e-6, 20), got)           # the CPU's mHC takes it
    grad = logits.clone().requires_grad_()                                # training keeps autograd's
    assert cpu.mhc_sinkhorn(grad, 1e-6, 20).grad_fn is not None


@NATIVE
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead, n, dim", [((1, 1), 4, 4096), ((2, 5), 4, 64), ((1, 300), 4, 128), ((3,), 2, 32)])
def test_the_native_mhc_gives_the_references_streams(dtype, lead, n, dim):
    """mhc_pre's outputs and mhc_post's new streams against the reference: fp32 within a few ulps, bf16 within
    one bf16 rounding; a token's new streams its own (mhc_pre's mixing GEMM is torch's, as in the reference);
    the CPU's mHC takes them, and keeps autograd's."""
    g = torch.Generator().manual_seed(dim + n)
    m = (2 + n) * n
    h = torch.randn(*lead, n, dim, generator=g).to(dtype)
    fn = torch.randn(m, n * dim, generator=g) / (n * dim) ** 0.5
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(m, generator=g) * 0.1
    x = torch.randn(*lead, dim, generator=g).to(dtype)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-5}
    got, want = native.mhc_pre(h, fn, scale, base, 1e-6, 1e-6), reference.mhc_pre(h, fn, scale, base, 1e-6, 1e-6)
    assert [t.dtype for t in got] == [dtype, torch.float32, torch.float32]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    comb = reference.mhc_sinkhorn(want[2], 1e-6, 20)
    new = native.mhc_post(x, h, want[1], comb)
    assert new.dtype == dtype
    torch.testing.assert_close(new, reference.mhc_post(x, h, want[1], comb), **tol)
    last = (slice(None),) * (len(lead) - 1) + (slice(-1, None),)
    assert torch.equal(native.mhc_post(x[last], h[last], want[1][last], comb[last]), new[last])
    assert torch.equal(cpu.mhc_pre(h, fn, scale, base, 1e-6, 1e-6)[0], got[0])
    assert torch.equal(cpu.mhc_post(x, h, want[1], comb), new)
    assert cpu.mhc_post(x, h.clone().requires_grad_(dtype.is_floating_point), want[1], comb).grad_fn is not None


@NATIVE
@pytest.mark.parametrize("x_shape, table_shape", [((2, 3, 8, 64), (2, 3, 1, 16)), ((2, 3, 64), (2, 3, 16)),
                                                  ((1, 5, 64, 512), (1, 5, 1, 32)), ((1, 0, 4, 64), (1, 0, 1, 32))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_rope_gives_the_references_bits(x_shape, table_shape, dtype):
    """Queries (heads sharing a row of the tables) and keys (one row each), the inverse rotation (-sin), an
    empty chunk, fp32 and bf16 rows (rounded to nearest even, ties among them): the reference's bits, the dims
    before the rotated ones untouched. Tables that broadcast otherwise, bf16 tables, tables of two shapes and
    autograd take the reference."""
    g = torch.Generator().manual_seed(x_shape[-1])
    x = torch.randn(*x_shape, generator=g).to(dtype)
    cos, sin = torch.randn(*table_shape, generator=g), torch.randn(*table_shape, generator=g)
    if dtype == torch.bfloat16:         # rotations whose fp32 results lie halfway between two bf16 values
        cos, sin = cos.bfloat16().float(), sin.bfloat16().float()
        cos.view(-1)[::3], sin.view(-1)[::3] = 1.0 + 2 ** -8, 0.0
    assert native.rope_rows(x, cos, sin) is not None
    for s in (sin, -sin):
        got = native.rope(x, cos, s)
        assert got.dtype == dtype and torch.equal(got, reference.rope(x, cos, s))
        assert torch.equal(cpu.rope(x, cos, s), got)
        assert torch.equal(got[..., :-2 * cos.shape[-1]], x[..., :-2 * cos.shape[-1]])
    assert native.rope_rows(x, cos[:1], sin[:1]) is None or x_shape[0] == 1
    assert native.rope_rows(x.half(), cos, sin) is None
    assert native.rope_rows(x, cos, sin.bfloat16()) is None and native.rope_rows(x, cos, sin[..., :-1]) is None
    assert cpu.rope(x.clone().requires_grad_(), cos, sin).grad_fn is not None


@NATIVE
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 4096), (5, 1024), (300, 128), (3, 2, 32), (0, 64)])
def test_the_native_quantisation_gives_the_references_bits(dtype, shape):
    """Rows at every magnitude (the amax floor included), values landing on halves of a step (rounded to
    even): the reference's int8 codes and scales, bit for bit; the CPU's W8A8 linears take it."""
    g = torch.Generator().manual_seed(shape[-1])
    for magnitude in (1e-7, 1e-3, 1.0, 1e3):
        x = torch.randn(*shape, generator=g) * magnitude
        steps = torch.randint(-254, 255, x.shape, generator=g).float()
        halves = x.abs().amax(-1, keepdim=True).clamp(min=reference.AMAX_FLOOR) / 127 * steps / 2
        x = torch.where(torch.rand(x.shape, generator=g) < 0.3, halves, x).to(dtype)
        got, want = native.quantize_per_token(x, reference.AMAX_FLOOR), reference.quantize_per_token(x)
        assert got[0].dtype == torch.int8 and got[0].shape == x.shape and got[1].shape == (*x.shape[:-1], 1)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert all(torch.equal(a, b) for a, b in zip(cpu.quantize_per_token(x), got))


def test_without_the_native_kernels_torchs_stay(monkeypatch, tmp_path):
    """Switched off, or the compiler fails: nothing packs for them (their uint8 layout); int8 weights pack
    for oneDNN, or for the AVX2 pair GEMMs (int8) where int8 GEMMs are slow, and float weights for the AVX2
    float op where it runs (built and loaded once a process, by its own C++ compiler)."""
    weight = torch.randint(-127, 128, (CHANNELS, 132), dtype=torch.int8)
    monkeypatch.setattr(cpu, "PACK_MIN_BYTES", 0)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    try:
        for env, value in (("DSV4_NATIVE_KERNELS", "0"), ("CC", "false")):
            native.library.cache_clear()
            with monkeypatch.context() as m:
                m.setenv(env, value)
                assert not native.available()
                fpacked = cpu.pack_linear_fp32(weight.float())
                assert fpacked is None if not native.avx2_available() else fpacked.shape == (7, 132, native.BLOCK)
                packed = cpu.pack_w8a8(weight)
                assert packed is None or packed.is_mkldnn or packed.dtype == torch.int8
    finally:
        native.library.cache_clear()


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def huge_page_eligible(t: torch.Tensor) -> str | None:
    """smaps' THPeligible for the first whole 2 MiB page inside `t`'s memory."""
    first = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    eligible, inside = None, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= first < hi
            elif inside and line.startswith("THPeligible:"):
                eligible = line.split()[1]
    return eligible


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="no transparent huge pages on this machine")
def test_packed_weights_ask_for_huge_pages():
    """A packed weight's whole 2 MiB pages are marked for huge pages before they are written (what lets a
    1-row GEMM read experts chosen at random at the bandwidth); the values are the weight's."""
    weight = torch.randint(-128, 128, (1024, 8192), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    packed = native.pack_int8(weight)
    assert torch.equal(native.unpack_int8(packed), weight)
    assert huge_page_eligible(packed) == "1"


@pytest.mark.skipif(_thp_mode() != "madvise", reason="huge pages only where asked for: Linux's madvise mode")
def test_release_weights_copied_at_load_ask_for_huge_pages():
    """`--no-mmap` copies the release's FP4 experts and FP8 linears as stored; on the CPU onto 2 MiB pages where
    Linux allows, as the packed weights (4 MiB each: a whole huge page inside wherever they start)."""
    cpu = platforms.for_device("cpu")
    g = torch.Generator().manual_seed(1)
    for t in (torch.randint(0, 256, (2048, 2048), generator=g, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
              torch.randn(8192, 1024, generator=g).to(torch.float8_e4m3fn)[:, :512]):    # a rank's columns
        held = cpu.weight_copy(t, torch.device("cpu"))
        assert held.dtype == t.dtype and torch.equal(held.view(torch.uint8), t.view(torch.uint8))
        assert huge_page_eligible(held) == "1"
