"""The official release's FP8 (128x128 E8M0 tiles) and packed FP4 (1x32 E8M0 groups) weights."""
import pytest
import torch
from tiny import random_model, tiny_config

from dsv4cli.model import load_model
from dsv4cli.model import loader as loader_module
from dsv4cli.model import model as model_module
from dsv4cli.model.checkpoint import save_checkpoint
from dsv4cli.model.model import Linear
from dsv4cli.model.quant import FP4_VALUES, as_stored, fp4_to_float, fp8_to_float


def e8m0(exponents: torch.Tensor) -> torch.Tensor:
    return (exponents + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def encode_fp8(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 with a power-of-two scale per block x block tile (amax maps to at most 448)."""
    rows, cols = w.shape
    padded = torch.zeros(-(-rows // block) * block, -(-cols // block) * block)
    padded[:rows, :cols] = w
    amax = padded.unflatten(0, (-1, block)).unflatten(-1, (-1, block)).abs().amax(dim=(1, 3))
    exp = torch.ceil(torch.log2(amax.clamp(min=1e-4) / 448))
    scale = (2 ** exp).repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return (w / scale).to(torch.float8_e4m3fn), e8m0(exp)


def encode_fp4(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest E2M1 code per element with a power-of-two scale per 32 inputs, two codes per byte."""
    groups = w.unflatten(-1, (-1, block))
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-4) / 6))
    x = (groups / 2 ** exp[..., None]).flatten(-2)
    codes = (x[..., None] - FP4_VALUES).abs().argmin(-1)
    return (codes[:, 0::2] | codes[:, 1::2] << 4).to(torch.uint8).view(torch.int8), e8m0(exp)


def is_official_fp8(prefix: str) -> bool:
    """The release's FP8 linears: everything but compressors, weights_proj and DSpark's confidence head
    (bf16); routed experts FP4."""
    return not any(k in prefix for k in ("compressor", "weights_proj", "confidence_head"))


@torch.no_grad()
def write_official(path, cfg: dict, seed: int = 0, max_shard_bytes: int = 0):
    """A tiny checkpoint in the official release's layout; returns the float model it decodes to."""
    model = random_model(cfg, seed)
    modules = dict(model.named_modules())
    tensors = {}
    for name, t in model.state_dict().items():
        prefix, _, attr = name.rpartition(".")
        if attr == "weight" and isinstance(modules[prefix], Linear) and is_official_fp8(prefix):
            if ".experts." in prefix:
                q, scale = encode_fp4(t)
                t.copy_(fp4_to_float(q, scale))
            else:
                q, scale = encode_fp8(t)
                t.copy_(fp8_to_float(q, scale))
            tensors[name], tensors[f"{prefix}.scale"] = q, scale
        else:
            tensors[name] = as_stored(name, t)
            t.copy_(tensors[name])            # the model keeps exactly what the file holds
    config = {**cfg, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                             "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
              "expert_dtype": "fp4", "torch_dtype": "bfloat16"}
    save_checkpoint(tensors, config, path, max_shard_bytes=max_shard_bytes)
    return model


def test_e8m0_is_a_power_of_two():
    codes = torch.tensor([127, 128, 126, 0, 254], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert fp8_to_float(torch.ones(1, 5, dtype=torch.float8_e4m3fn), codes[None], block=1).tolist() == \
        [[1.0, 2.0, 0.5, 2.0 ** -127, 2.0 ** 127]]


def test_fp8_tiles_hand_made():
    # 3x3 weight, 2x2 tiles (ragged at the edge): tile scales 2, 1/4, 8, 1
    w = torch.tensor([[1.5, -2.0, 0.875], [448.0, 0.0, -0.5], [3.0, 0.125, -6.0]]).to(torch.float8_e4m3fn)
    scale = e8m0(torch.tensor([[1.0, -2.0], [3.0, 0.0]]))
    want = torch.tensor([[3.0, -4.0, 0.875 / 4], [896.0, 0.0, -0.5 / 4], [24.0, 1.0, -6.0]])
    assert torch.equal(fp8_to_float(w, scale, block=2), want)
    # one rank's slice decodes like the same slice of the whole tensor
    assert torch.equal(fp8_to_float(w[1:, 1:], scale, offset=(1, 1), block=2), want[1:, 1:])


def test_fp8_ragged_blocks_and_slices_at_release_block_size():
    w = torch.randn(300, 200) * 3
    q, scale = encode_fp8(w)
    assert scale.shape == (3, 2) and scale.dtype == torch.float8_e8m0fnu
    full = fp8_to_float(q, scale)
    assert torch.allclose(full, w, rtol=0.07, atol=1e-3)       # 3 mantissa bits; subnormals near 0
    assert torch.equal(fp8_to_float(q[100:250], scale, offset=(100, 0)), full[100:250])
    assert torch.equal(fp8_to_float(q[:, 64:192], scale, offset=(0, 64)), full[:, 64:192])


def test_fp4_packing_hand_made():
    # byte 0x21: low nibble 1 (0.5) is element 0, high nibble 2 (1.0) is element 1;
    # byte 0xF8: low 8 (-0.0), high 15 (-6.0); every other byte 0x70: 0, then 6
    row = torch.full((32,), 0x70, dtype=torch.uint8)
    row[0], row[1] = 0x21, 0xF8
    packed = row.view(torch.int8)[None]                               # [1, 32] bytes = 64 inputs
    scale = e8m0(torch.tensor([[1.0, -1.0]]))                         # inputs 0-31 x2, 32-63 x0.5
    got = fp4_to_float(packed, scale)
    assert got.shape == (1, 64)
    assert got[0, :4].tolist() == [1.0, 2.0, -0.0, -12.0]
    assert got[0, 4:32].tolist() == [0.0, 12.0] * 14
    assert got[0, 32:].tolist() == [0.0, 3.0] * 16


def test_fp4_round_trip_of_representable_values():
    values = FP4_VALUES[torch.randint(0, 16, (4, 64), generator=torch.Generator().manual_seed(0))] * 4
    values[:, ::32] = 6 * 4                               # every group's amax is 24 -> scale exactly 4
    q, scale = encode_fp4(values)
    assert q.shape == (4, 32) and scale.shape == (4, 2)
    assert torch.equal(fp4_to_float(q, scale), values)


def test_official_release_loads_as_its_decoded_float_model(tmp_path):
    cfg = tiny_config()
    ref = write_official(tmp_path, cfg, seed=3, max_shard_bytes=100_000)
    loaded = load_model(tmp_path, dtype=torch.float32).state_dict()
    for name, t in ref.state_dict().items():
        assert torch.equal(loaded[name], t), name


def test_tensor_parallel_rank_reads_its_slice(tmp_path, monkeypatch):
    """Rank 1 of 2: heads, groups (a split inside a 128-row FP8 tile), experts and vocabulary rows."""
    cfg = tiny_config()
    ref = write_official(tmp_path, cfg, seed=4)
    for module in (model_module, loader_module):
        monkeypatch.setattr(module, "world", lambda: (1, 2))
    model = load_model(tmp_path, dtype=torch.float32)
    full = ref.state_dict()
    part = model.state_dict()
    assert torch.equal(part["layers.1.attn.wq_b.weight"], full["layers.1.attn.wq_b.weight"][64:])
    assert torch.equal(part["layers.1.attn.wo_b.weight"], full["layers.1.attn.wo_b.weight"][:, 24:])
    assert torch.equal(part["layers.1.attn.indexer.wq_b.weight"], full["layers.1.attn.indexer.wq_b.weight"][64:])
    assert torch.equal(part["embed.weight"], full["embed.weight"][128:])
    assert torch.equal(part["layers.2.ffn.experts.5.w2.weight"], full["layers.2.ffn.experts.5.w2.weight"])
    assert "layers.2.ffn.experts.1.w2.weight" not in part
    assert torch.equal(part["layers.2.ffn.shared_experts.w1.weight"], full["layers.2.ffn.shared_experts.w1.weight"])


@pytest.mark.parametrize("legacy", [False, True])
def test_legacy_names_are_renamed(tmp_path, legacy):
    from safetensors.torch import load_file, save_file
    cfg = tiny_config()
    ref = write_official(tmp_path, cfg, seed=5)
    if legacy:   # HF-style names as the official convert.py accepts them
        tensors = load_file(tmp_path / "model.safetensors")
        renamed = {"model." + k.replace(".attn.", ".self_attn.").replace(".ffn.", ".mlp.")
                   .replace(".scale", ".weight_scale_inv").replace("gate.bias", "gate.e_score_correction_bias"): v
                   for k, v in tensors.items()}
        save_file(renamed, tmp_path / "model.safetensors")
    model = load_model(tmp_path, dtype=torch.float32)
    assert torch.equal(model.state_dict()["layers.3.ffn.gate.bias"], ref.state_dict()["layers.3.ffn.gate.bias"])
