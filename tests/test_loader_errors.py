"""Each kind of broken checkpoint fails with one LoadError line that names the file or tensor."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import random_model, tiny_config, write_checkpoint

from dsv4cli.model import LoadError, load_model
from dsv4cli.model.quant import save_w8a8

CFG = tiny_config()


def load_error(path) -> str:
    with pytest.raises(LoadError) as e:
        load_model(path, dtype=torch.float32)
    message = str(e.value)
    assert "\n" not in message
    return message


def edit(path, fn):
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)


@pytest.fixture
def float_ckpt(tmp_path):
    write_checkpoint(tmp_path, CFG)
    return tmp_path


@pytest.fixture
def w8a8_ckpt(tmp_path):
    save_w8a8(random_model(CFG), CFG, tmp_path, max_shard_bytes=200_000)
    return tmp_path


def w8a8_shard_of(path, name):
    weight_map = json.loads((path / "quant_model_weights.safetensors.index.json").read_text())["weight_map"]
    return path / weight_map[name]


def test_missing_tensor(float_ckpt):
    edit(float_ckpt / "model.safetensors", lambda t: t.pop("layers.1.attn.wkv.weight"))
    assert "missing tensor 'layers.1.attn.wkv.weight'" in load_error(float_ckpt)


def test_missing_scale(w8a8_ckpt):
    name = "layers.2.ffn.experts.3.w1.weight_scale"
    edit(w8a8_shard_of(w8a8_ckpt, name), lambda t: t.pop(name))
    assert f"missing tensor '{name}'" in load_error(w8a8_ckpt)


def test_extra_tensor(float_ckpt):
    edit(float_ckpt / "model.safetensors", lambda t: t.update({"layers.0.attn.bogus": torch.zeros(3)}))
    assert "unexpected tensor 'layers.0.attn.bogus'" in load_error(float_ckpt)


def test_wrong_shape(float_ckpt):
    edit(float_ckpt / "model.safetensors", lambda t: t.update({"norm.weight": torch.ones(65)}))
    assert "tensor 'norm.weight': shape [65], expected [64]" in load_error(float_ckpt)


def test_wrong_scale_shape(w8a8_ckpt):
    name = "layers.0.attn.wq_a.weight_scale"
    edit(w8a8_shard_of(w8a8_ckpt, name), lambda t: t.update({name: torch.ones(48)}))
    assert f"tensor '{name}': shape [48], expected [48, 1]" in load_error(w8a8_ckpt)


def test_wrong_dtype(float_ckpt):
    edit(float_ckpt / "model.safetensors", lambda t: t.update({"norm.weight": torch.ones(64, dtype=torch.int32)}))
    assert "tensor 'norm.weight': dtype I32, expected F32 or BF16 or F16" in load_error(float_ckpt)


def test_int8_weight_labelled_float(w8a8_ckpt):
    desc_file = w8a8_ckpt / "quant_model_description.json"
    desc = json.loads(desc_file.read_text())
    desc["layers.0.attn.wkv.weight"] = "FLOAT"
    desc_file.write_text(json.dumps(desc))
    assert "tensor 'layers.0.attn.wkv.weight': dtype I8, expected F32 or BF16 or F16" in load_error(w8a8_ckpt)


def test_float_weight_labelled_int8(w8a8_ckpt):
    """The label decides how a tensor is read (recipes differ: 0731's drafter stores wo_a in int8), so a float
    tensor labelled W8A8_DYNAMIC is a tensor of the wrong dtype."""
    desc_file = w8a8_ckpt / "quant_model_description.json"
    desc = json.loads(desc_file.read_text())
    desc["layers.0.attn.wo_a.weight"] = "W8A8_DYNAMIC"
    desc_file.write_text(json.dumps(desc))
    assert "tensor 'layers.0.attn.wo_a.weight': dtype BF16, expected I8" in load_error(w8a8_ckpt)


def test_nonzero_weight_offset(w8a8_ckpt):
    name = "layers.3.attn.wq_b.weight_offset"
    edit(w8a8_shard_of(w8a8_ckpt, name), lambda t: t[name].fill_(1.0))
    assert f"tensor '{name}' is not all zeros" in load_error(w8a8_ckpt)


def test_truncated_shard(w8a8_ckpt):
    shard = w8a8_shard_of(w8a8_ckpt, "layers.1.attn.wq_a.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    message = load_error(w8a8_ckpt)
    assert str(shard) in message and "truncated" in message


def test_corrupt_header(float_ckpt):
    shard = float_ckpt / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:20] = b"\xff" * 12
    shard.write_bytes(bytes(data))
    message = load_error(float_ckpt)
    assert str(shard) in message and "not a valid safetensors file" in message


def test_missing_shard(w8a8_ckpt):
    shard = w8a8_shard_of(w8a8_ckpt, "norm.weight")
    shard.unlink()
    assert f"{shard}: listed in quant_model_weights.safetensors.index.json but missing" in load_error(w8a8_ckpt)


def test_config_layer_count_mismatch(float_ckpt):
    cfg = {**CFG, "num_hidden_layers": 3, "compress_ratios": [0, 4, 128, 0]}
    (float_ckpt / "config.json").write_text(json.dumps(cfg))
    assert "config.json: num_hidden_layers is 3 but the checkpoint has layers 0..3 (4)" in load_error(float_ckpt)


def test_config_hidden_size_mismatch(float_ckpt):
    (float_ckpt / "config.json").write_text(json.dumps({**CFG, "hidden_size": 96}))
    assert "config.json: vocab_size x hidden_size is [256, 96] but embed.weight is [256, 64]" in \
        load_error(float_ckpt)


def test_config_says_fp8_but_tensors_are_not(float_ckpt):
    (float_ckpt / "config.json").write_text(json.dumps({**CFG, "quantization_config": {"quant_method": "fp8"}}))
    assert "quantization_config says fp8 but the checkpoint is float" in load_error(float_ckpt)


def test_invalid_config(float_ckpt):
    (float_ckpt / "config.json").write_text(json.dumps({**CFG, "compress_ratios": [0, 4]}))
    assert "compress_ratios has 2 entries" in load_error(float_ckpt)


def test_w8a8_mixed_with_fp8(w8a8_ckpt):
    name = "layers.0.attn.wo_a.weight"
    scale = torch.ones(1, 1).to(torch.float8_e8m0fnu)
    edit(w8a8_shard_of(w8a8_ckpt, name), lambda t: t.update({"layers.0.attn.wo_a.scale": scale}))
    assert "mixes W8A8 tensors" in load_error(w8a8_ckpt)


def test_several_problems_are_counted(float_ckpt):
    edit(float_ckpt / "model.safetensors", lambda t: [t.pop(k) for k in ("norm.weight", "head.weight")])
    assert "(+1 more; `dsv4 inspect --check` lists them)" in load_error(float_ckpt)


def test_not_a_directory(tmp_path):
    assert f"{tmp_path / 'nope'}: model directory not found" in load_error(tmp_path / "nope")


# ---- the official release's FP8 / FP4 tensors, held as stored -------------------------------------

@pytest.fixture
def release_ckpt(tmp_path):
    from test_fp8 import write_official
    write_official(tmp_path, CFG, seed=2)
    return tmp_path


@pytest.mark.parametrize("name", ["layers.1.attn.wq_b.scale", "layers.2.ffn.experts.4.w3.scale"])
def test_release_missing_scale(release_ckpt, name):
    edit(release_ckpt / "model.safetensors", lambda t: t.pop(name))
    assert load_error(release_ckpt).endswith(f"missing tensor '{name}'")


def test_release_scale_of_the_wrong_shape(release_ckpt):
    name = "layers.2.ffn.experts.4.w3.scale"             # one E8M0 per 32 inputs: [32, 2] here
    edit(release_ckpt / "model.safetensors", lambda t: t.update({name: t[name][:, :1].contiguous()}))
    assert load_error(release_ckpt).endswith(f"tensor '{name}': shape [32, 1], expected [32, 2]")


def test_release_fp4_tensor_of_the_wrong_width(release_ckpt):
    name = "layers.2.ffn.experts.4.w1.weight"             # 64 inputs packed two a byte: [32, 32]
    edit(release_ckpt / "model.safetensors", lambda t: t.update({name: t[name][:, :31].contiguous()}))
    assert load_error(release_ckpt).endswith(f"tensor '{name}': shape [32, 31], expected [32, 32]")


def test_release_truncated_shard(release_ckpt):
    shard = release_ckpt / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    message = load_error(release_ckpt)
    assert str(shard) in message and "truncated" in message
