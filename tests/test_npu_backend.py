"""The NPU backend's plumbing, run on the CPU through a stand-in torch_npu (tests/fake_torch_npu)."""
import sys
from pathlib import Path

import pytest
import torch
from tiny import random_model, tiny_config

from dsv4cli import kernels
from dsv4cli.kernels import ExpertStack, reference
from dsv4cli.model.loader import keep_fp32
from dsv4cli.model.quant import quantize_model


@pytest.fixture
def npu(monkeypatch):
    """dsv4cli.kernels.npu imported against the stand-in; both modules are dropped afterwards."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "fake_torch_npu"))
    for name in ("torch_npu", "dsv4cli.kernels.npu"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(kernels, "_BACKENDS", {})
    module = kernels.backend("npu")
    sys.modules["torch_npu"].calls.clear()
    yield module
    for name in ("torch_npu", "dsv4cli.kernels.npu"):
        sys.modules.pop(name, None)
    kernels.__dict__.pop("npu", None)


def test_npu_device_selects_the_npu_backend(npu):
    assert npu.__name__ == "dsv4cli.kernels.npu" and kernels.backend("npu") is npu
    assert npu.rope is reference.rope and npu.moe_gate is reference.moe_gate
    assert npu.sparse_attention is reference.sparse_attention
    assert kernels.backend("cpu") is reference


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
    monkeypatch.setitem(kernels._BACKENDS, "cpu", npu)       # route every op of this CPU model to the NPU backend
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


def test_w8a8_model_with_stacked_experts_runs_on_the_npu_backend(npu, monkeypatch):
    cfg = tiny_config()
    model = quantize_model(random_model(cfg)).to(torch.bfloat16)
    for name, p in model.named_parameters():         # what load_model keeps in fp32
        if keep_fp32(name) or name.endswith("weight_scale"):
            p.data = p.data.float()
    for block in [*model.layers, *model.mtp]:         # what prepare() does on an accelerator
        block.ffn.stack_experts()
    ids = torch.randint(0, cfg["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(0))
    want = model(ids)
    monkeypatch.setitem(kernels._BACKENDS, "cpu", npu)
    got = model(ids)
    calls = sys.modules["torch_npu"].calls
    assert calls["npu_moe_init_routing_v2"] == cfg["num_hidden_layers"] and calls["npu_grouped_matmul"] > 0
    # weight scales hold bf16 values (the model was cast to bf16), so the GEMMs' bf16 scales are exact
    assert torch.equal(got, want)
