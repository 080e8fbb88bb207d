"""The NPU backend's plumbing, run on the CPU through a stand-in torch_npu (tests/fake_torch_npu)."""
import sys
from pathlib import Path

import pytest
import torch
from tiny import random_model, tiny_config

from dsv4cli import kernels, loading, platforms
from dsv4cli.config import Settings
from dsv4cli.kernels import reference
from dsv4cli.kernels.reference import ExpertStack
from dsv4cli.model import load_model
from dsv4cli.model.loader import keep_fp32
from dsv4cli.model.model import OpModule
from dsv4cli.model.quant import quantize_model, save_w8a8
from dsv4cli.platforms.cpu import CpuPlatform
from dsv4cli.platforms.npu import NpuPlatform

STAND_IN = ("torch_npu", "torch_npu.npu", "dsv4cli.kernels.npu")


@pytest.fixture
def npu(monkeypatch):
    """dsv4cli.kernels.npu imported against the stand-in (an Atlas A2 unless a test sets its SoC) by a
    fresh NPU platform; the modules and the registration are dropped afterwards."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "fake_torch_npu"))
    for name in STAND_IN:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(platforms._REGISTRY, "npu", NpuPlatform())
    module = kernels.module_for("npu")
    sys.modules["torch_npu"].calls.clear()
    yield module
    for name in STAND_IN:
        sys.modules.pop(name, None)
    kernels.__dict__.pop("npu", None)


@pytest.fixture
def npu950(npu, monkeypatch):
    """The stand-in as an Ascend 950, the chip with the mHC ops."""
    monkeypatch.setattr(sys.modules["torch_npu.npu"], "SOC_VERSION", 260)
    npu._has_mhc_ops.cache_clear()
    return npu


def run_ops_on(model, module):
    """Bind `module` to every module of `model`, as `Transformer.prepare` binds a platform's kernels: every
    op of the model then runs there."""
    for m in model.modules():
        if isinstance(m, OpModule):
            m.ops = module


def test_npu_device_selects_the_npu_backend(npu):
    assert npu.__name__ == "dsv4cli.kernels.npu" and kernels.module_for("npu") is npu
    assert npu.sparse_attention is reference.sparse_attention and npu.moe_gate is reference.moe_gate
    assert set(reference.__all__) <= set(vars(npu))            # every op of the seam


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_w8a8_linear_and_quantisation_match_reference(npu, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 5, 64, generator=g) * 3).to(dtype)
    weight = torch.randint(-127, 128, (48, 64), generator=g, dtype=torch.int8)
    scale = torch.rand(48, 1, generator=g) / 100
    got, want = npu.w8a8_linear(x, weight, scale), reference.w8a8_linear(x, weight, scale)
    assert got.shape == (2, 5, 48) and got.dtype == dtype
    if dtype == torch.float32:      # integer products summed in fp32 instead of int32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got, want)
        assert sys.modules["torch_npu"].calls["npu_quant_matmul"] == 1
    q, s = npu.quantize_per_token(x)
    q_ref, s_ref = reference.quantize_per_token(x)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_matches_reference(npu, dtype):
    x = torch.randn(3, 4, 64).to(dtype)
    weight = torch.rand(64) + 0.5                        # fp32, as the model keeps norm weights
    assert torch.equal(npu.rms_norm(x, None, 1e-6), reference.rms_norm(x, None, 1e-6))
    got, want = npu.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:                                                # gamma is rounded to bf16 for the fused op
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert sys.modules["torch_npu"].calls["npu_rms_norm"] == 2


def test_w8a8_model_runs_on_the_npu_backend(npu, monkeypatch):
    cfg = tiny_config()
    model = quantize_model(random_model(cfg)).to(torch.bfloat16)
    for name, p in model.named_parameters():         # what load_model keeps in fp32
        if keep_fp32(name) or name.endswith("weight_scale"):
            p.data = p.data.float()
    ids = torch.randint(0, cfg["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(0))
    want = model(ids)
    run_ops_on(model, npu)
    got = model(ids)
    calls = sys.modules["torch_npu"].calls
    assert calls["npu_quant_matmul"] > 0 and calls["npu_rms_norm"] > 0
    assert torch.equal(got, want)    # norm weights hold bf16 values, so the fused norm's bf16 gamma is exact


def random_stack(g, experts=8, dim=64, inter=32, limit=7.0, scale_dtype=torch.float32):
    """Stacked int8 experts; scales rounded to scale_dtype's values (held in fp32)."""
    def scales(*shape):
        return (torch.rand(*shape, 1, generator=g) / 100 + 1e-3).to(scale_dtype).float()
    return ExpertStack(torch.randint(-127, 128, (experts, 2 * inter, dim), generator=g, dtype=torch.int8),
                       torch.randint(-127, 128, (experts, dim, inter), generator=g, dtype=torch.int8),
                       scales(experts, 2 * inter), scales(experts, dim), limit)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("limit", [0.0, 7.0])
@pytest.mark.parametrize("k", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("tokens", [1, 8, 40])
def test_grouped_experts_match_reference(npu, tokens, k, limit, dtype):
    """The routing/GEMM ops equal the reference bit for bit, other ranks' experts (indices < 0 or >= E)
    included. bf16 GEMMs take bf16 weight scales, so the bf16 case uses scales with bf16 values; fp16
    GEMMs take the fp32 scales as they are."""
    g = torch.Generator().manual_seed(tokens * 10 + k)
    stack = random_stack(g, limit=limit, scale_dtype=dtype if dtype == torch.bfloat16 else torch.float32)
    x = (torch.randn(tokens, 64, generator=g) * 3).to(dtype)
    weights = torch.rand(tokens, k, generator=g)
    local = torch.randint(-3, 11, (tokens, k), generator=g)
    local[-1, :2] = torch.tensor([-1, 8])                  # experts of the ranks below and above this one
    got = npu.grouped_experts(x, weights, local, stack)
    assert got.dtype == torch.float32 and got.shape == (tokens, 64)
    assert torch.equal(got, reference.grouped_experts(x, weights, local, stack))
    calls = sys.modules["torch_npu"].calls
    assert calls["npu_moe_init_routing_v2"] == 1 and calls["npu_grouped_matmul"] == 2
    local.fill_(9)                                          # only other ranks' experts: nothing added
    assert torch.equal(npu.grouped_experts(x, weights, local, stack), torch.zeros(tokens, 64))


@pytest.mark.parametrize("soc", [220, 260])
def test_w8a8_model_with_stacked_experts_runs_on_the_npu_backend(npu, monkeypatch, soc):
    """Bit-exact on an A2 and on a 950 (mHC through npu_mhc_pre / npu_mhc_sinkhorn / npu_mhc_post)."""
    monkeypatch.setattr(sys.modules["torch_npu.npu"], "SOC_VERSION", soc)
    npu._has_mhc_ops.cache_clear()
    cfg = tiny_config()
    model = quantize_model(random_model(cfg)).to(torch.bfloat16)
    for name, p in model.named_parameters():         # what load_model keeps in fp32
        if keep_fp32(name) or name.endswith("weight_scale"):
            p.data = p.data.float()
    for block in [*model.layers, *model.mtp]:         # what prepare() does on an accelerator
        block.ffn.stack_experts()
    ids = torch.randint(0, cfg["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(0))
    want = model(ids)
    run_ops_on(model, npu)
    got = model(ids)
    calls = sys.modules["torch_npu"].calls
    assert calls["npu_moe_init_routing_v2"] == cfg["num_hidden_layers"] and calls["npu_grouped_matmul"] > 0
    assert calls["npu_rotary_mul"] > 0
    mhc_calls = 2 * cfg["num_hidden_layers"] if soc >= 260 else 0      # two sub-layers per block
    assert calls["npu_mhc_pre"] == calls["npu_mhc_sinkhorn"] == calls["npu_mhc_post"] == mhc_calls
    # weight scales hold bf16 values (the model was cast to bf16), so the GEMMs' bf16 scales are exact
    assert torch.equal(got, want)


def random_mhc(g, n=4, d=32, batch=2, seq=5, dtype=torch.bfloat16):
    """Streams h [B,S,n,D], mHC weights as a checkpoint holds them (fp32), and a sub-layer output."""
    h = (torch.randn(batch, seq, n, d, generator=g) * 2).to(dtype)
    fn = torch.randn(n * n + 2 * n, n * d, generator=g) / (n * d) ** 0.5
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(n * n + 2 * n, generator=g) / 4
    return h, fn, scale, base, torch.randn(batch, seq, d, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [4, 8])
def test_mhc_ops_match_reference(npu950, dtype, n):
    g = torch.Generator().manual_seed(n)
    h, fn, scale, base, out = random_mhc(g, n=n, dtype=dtype)
    got, want = npu950.mhc_pre(h, fn, scale, base, 1e-6, 1e-6), reference.mhc_pre(h, fn, scale, base, 1e-6, 1e-6)
    assert [t.dtype for t in got] == [dtype, torch.float32, torch.float32]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    comb = npu950.mhc_sinkhorn(got[2], 1e-6, 20)
    # same formula; the reference sums tokens-last, so a sum's rounding may differ in the last bit
    torch.testing.assert_close(comb, reference.mhc_sinkhorn(want[2], 1e-6, 20), rtol=0, atol=1e-6)
    assert torch.allclose(comb.sum(-1), torch.ones(()), atol=1e-3) and torch.allclose(comb.sum(-2), torch.ones(()))
    new = npu950.mhc_post(out, h, got[1], comb)
    assert new.dtype == dtype and new.shape == h.shape
    assert torch.equal(new, reference.mhc_post(out, h, got[1], comb))
    calls = sys.modules["torch_npu"].calls
    assert calls["npu_mhc_pre"] == calls["npu_mhc_sinkhorn"] == calls["npu_mhc_post"] == 1


def test_mhc_uses_the_reference_where_the_fused_ops_do_not_apply(npu, monkeypatch):
    """An A2 has no mHC ops; on a 950, fp32 streams and a Sinkhorn over n = 2 are outside the ops' specs."""
    g = torch.Generator().manual_seed(0)
    h, fn, scale, base, out = random_mhc(g)
    x, post, comb = npu.mhc_pre(h, fn, scale, base, 1e-6, 1e-6)
    npu.mhc_post(out, h, post, npu.mhc_sinkhorn(comb, 1e-6, 20))
    monkeypatch.setattr(sys.modules["torch_npu.npu"], "SOC_VERSION", 260)
    npu._has_mhc_ops.cache_clear()
    h32, fn2, scale2, base2, out32 = random_mhc(g, n=2, dtype=torch.float32)
    x, post, comb = npu.mhc_pre(h32, fn2, scale2, base2, 1e-6, 1e-6)
    npu.mhc_post(out32, h32, post, npu.mhc_sinkhorn(comb, 1e-6, 20))
    calls = sys.modules["torch_npu"].calls
    assert calls["npu_mhc_pre"] == calls["npu_mhc_sinkhorn"] == calls["npu_mhc_post"] == 0


def test_stand_in_refuses_what_the_docs_rule_out(npu950):
    torch_npu = sys.modules["torch_npu"]
    g = torch.Generator().manual_seed(0)
    h, fn, scale, base, out = random_mhc(g)
    with pytest.raises(RuntimeError, match="bf16/fp16"):
        torch_npu.npu_mhc_pre(h.float(), fn, scale, base)
    with pytest.raises(RuntimeError, match="phi must be fp32"):
        torch_npu.npu_mhc_pre(h, fn[:-1], scale, base)
    with pytest.raises(RuntimeError, match="n in 4/6/8"):
        torch_npu.npu_mhc_sinkhorn(torch.rand(2, 3, 3))
    with pytest.raises(RuntimeError, match="num_iters"):
        torch_npu.npu_mhc_sinkhorn(torch.rand(2, 4, 4), num_iters=101)
    with pytest.raises(RuntimeError, match="h_out must be"):
        torch_npu.npu_mhc_post(h, torch.rand(2, 5, 4, 4), out.half(), torch.rand(2, 5, 4))
    x = torch.randn(2, 5, 3, 8)
    with pytest.raises(RuntimeError, match="1S1D"):       # a position row per sequence: not in interleave mode
        torch_npu.npu_rotary_mul(x, torch.rand(2, 5, 1, 8), torch.rand(2, 5, 1, 8), rotary_mode="interleave")
    torch_npu.npu.SOC_VERSION = 250
    with pytest.raises(RuntimeError, match="Ascend 950 only"):
        torch_npu.npu_mhc_post(h, torch.rand(2, 5, 4, 4), out, torch.rand(2, 5, 4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rope_matches_reference(npu, dtype):
    """The layouts the model rotates: per-head q [B,S,H,D] with cos [B,S,1,rd/2], one row per token
    [B,S,D] with cos [B,S,rd/2] (KV, compressed blocks), and the inverse rotation (-sin)."""
    g = torch.Generator().manual_seed(0)
    angles = torch.rand(3, 7, 8, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    q = torch.randn(3, 7, 4, 40, generator=g).to(dtype)
    kv = torch.randn(3, 7, 40, generator=g).to(dtype)
    for x, c, s in ((q, cos[:, :, None], sin[:, :, None]), (q, cos[:, :, None], -sin[:, :, None]), (kv, cos, sin)):
        got = npu.rope(x, c, s)
        assert got.dtype == dtype and torch.equal(got, reference.rope(x, c, s))
    assert sys.modules["torch_npu"].calls["npu_rotary_mul"] == 3


@torch.no_grad()
def test_a_platform_registered_here_runs_the_whole_w8a8_model(npu950, monkeypatch, tmp_path):
    """A new platform is one Platform subclass and a registration: here a host that runs the NPU
    kernels (stand-in Ascend 950), bf16 by default, routing on the device, preferred by `auto`.
    Device choice, dtype, the expert layout and every op follow it with the model unedited. Its
    logits (trunk and MTP) differ from the reference kernels' on the same loaded W8A8 model only
    by the grouped GEMMs' bf16 weight scales: with scales holding bf16 values they are equal."""
    class HostWithNpuKernels(CpuPlatform):
        priority = 100
        default_dtype = "bfloat16"
        routes_on_host = False
        kernels = "npu"             # the stand-in's module (the fixture imported it)

    class HostWithReferenceKernels(CpuPlatform):
        kernels = "reference"       # (the CPU's own module sums mHC in another order)

    cfg = tiny_config()
    save_w8a8(random_model(cfg, seed=1), cfg, tmp_path)
    monkeypatch.setitem(platforms._REGISTRY, "cpu", HostWithNpuKernels())
    device = loading.pick_device("auto")
    dtype = loading.pick_dtype(Settings(model=str(tmp_path)), device)
    assert dtype == torch.bfloat16
    model = load_model(tmp_path, device=device, dtype=dtype)
    blocks = [*model.layers, *model.mtp]
    assert all(block.ffn.stack is not None for block in blocks)      # prepare() asked the platform
    ids = torch.randint(0, cfg["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(0))

    def logits(platform):
        monkeypatch.setitem(platforms._REGISTRY, "cpu", platform)
        model.prepare()                                  # binds the platform's kernels
        out, hidden = model(ids, return_hidden=True)
        return out, model.mtp_forward(hidden, ids)

    npu_platform = platforms.get("cpu")
    got = logits(npu_platform)
    calls = sys.modules["torch_npu"].calls
    for op in ("npu_quant_matmul", "npu_dynamic_quant", "npu_rms_norm", "npu_rotary_mul", "npu_moe_init_routing_v2",
               "npu_grouped_matmul", "npu_mhc_pre", "npu_mhc_sinkhorn", "npu_mhc_post"):
        assert calls[op] > 0, op
    want = logits(HostWithReferenceKernels())
    for label, a, b in zip(("trunk", "MTP"), got, want):
        rel = (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        print(f"stand-in NPU vs reference, W8A8 {label}: relative error {rel:.2e}, max abs {(a - b).abs().max():.2e} "
              f"(logits up to {b.abs().max():.1f}), argmax agreement {agree:.3f}")
        assert rel < 5e-2 and agree > 0.95
    for block in blocks:                        # the scales the bf16 grouped GEMMs take
        block.ffn.stack.s13.copy_(block.ffn.stack.s13.bfloat16())
        block.ffn.stack.s2.copy_(block.ffn.stack.s2.bfloat16())
    got, want = logits(npu_platform), logits(HostWithReferenceKernels())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
