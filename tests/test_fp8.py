"""The official release's FP8 (128x128 E8M0 tiles) and packed FP4 (1x32 E8M0 groups) weights."""
from pathlib import Path

import pytest
import torch
from tiny import random_model, tiny_config

from dsv4cli.model import load_model, quant
from dsv4cli.model import loader as loader_module
from dsv4cli.model import model as model_module
from dsv4cli.model.checkpoint import save_checkpoint
from dsv4cli.model.model import Linear
from dsv4cli.model.quant import as_stored, fp4_to_float, fp8_to_float


def e8m0(exponents: torch.Tensor) -> torch.Tensor:
    return quant.e8m0(exponents)


encode_fp8, encode_fp4 = quant.quantize_fp8, quant.quantize_fp4
FP4_VALUES = torch.tensor(quant.FP4_VALUES)


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
    loaded = load_model(tmp_path, dtype=torch.float32, weights="float").state_dict()
    for name, t in ref.state_dict().items():
        assert torch.equal(loaded[name], t), name


def test_tensor_parallel_rank_reads_its_slice(tmp_path, monkeypatch):
    """Rank 1 of 2: heads, groups (a split inside a 128-row FP8 tile), experts and vocabulary rows."""
    cfg = tiny_config()
    ref = write_official(tmp_path, cfg, seed=4)
    for module in (model_module, loader_module):
        monkeypatch.setattr(module, "world", lambda: (1, 2))
    model = load_model(tmp_path, dtype=torch.float32, weights="float")
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
    model = load_model(tmp_path, dtype=torch.float32, weights="float")
    assert torch.equal(model.state_dict()["layers.3.ffn.gate.bias"], ref.state_dict()["layers.3.ffn.gate.bias"])


# ---- the release's bytes held as stored (`--weights native`) ----------------------------------------

def mapping_of(t: torch.Tensor) -> str | None:
    """The file whose mapping holds t's first byte (Linux /proc/self/maps), or None (anonymous memory)."""
    address = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split()
        lo, hi = (int(a, 16) for a in span.split("-"))
        if lo <= address < hi:
            return rest[4] if len(rest) > 4 and rest[4].startswith("/") else None
    return None


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="needs Linux's /proc/self/maps")
def test_native_weights_are_the_files_bytes_mapped_in_place(tmp_path):
    from safetensors.torch import load_file
    write_official(tmp_path, tiny_config(), seed=6)
    stored = load_file(tmp_path / "model.safetensors")
    model = load_model(tmp_path, dtype=torch.float32)          # auto: native on the CPU
    state = model.state_dict()
    for prefix, fmt in (("layers.1.attn.wq_a", "fp8"), ("layers.1.attn.wo_a", "fp8"), ("mtp.0.attn.wq_b", "fp8"),
                        ("layers.2.ffn.shared_experts.w3", "fp8"), ("layers.2.ffn.experts.3.w2", "fp4")):
        assert model.get_submodule(prefix).format == fmt
        weight, scale = state[f"{prefix}.weight"], state[f"{prefix}.scale"]       # the official names, as stored
        assert torch.equal(weight.view(torch.uint8), stored[f"{prefix}.weight"].view(torch.uint8)), prefix
        assert torch.equal(scale.float(), stored[f"{prefix}.scale"].float()), prefix
        assert mapping_of(weight) == str(tmp_path / "model.safetensors"), prefix
    assert model.layers[1].attn.compressor.wkv.format == "float"                  # bf16 in the release
    def in_file(m):
        return sum(p.nbytes for p in m.parameters() if mapping_of(p) == str(tmp_path / "model.safetensors"))

    lowbit = sum(p.nbytes for p in model.parameters() if p.dtype in (torch.float8_e4m3fn, torch.float4_e2m1fn_x2))
    assert model.mapped_bytes == in_file(model) > lowbit       # and what the file stores fp32 (mHC, sinks)
    assert mapping_of(model.embed.weight) is None              # bf16 in the file: an fp32 run copies it
    bf16 = load_model(tmp_path, dtype=torch.bfloat16)          # a bf16 run maps the file's bf16 tensors as they are
    assert mapping_of(bf16.embed.weight) == str(tmp_path / "model.safetensors")
    assert bf16.mapped_bytes == in_file(bf16) > model.mapped_bytes
    copied = load_model(tmp_path, dtype=torch.float32, mmap_weights=False)
    assert copied.mapped_bytes == 0 and mapping_of(copied.layers[1].attn.wq_a.weight) is None
    assert torch.equal(copied.layers[1].attn.wq_a.weight.view(torch.uint8),
                       stored["layers.1.attn.wq_a.weight"].view(torch.uint8))


@torch.no_grad()
def test_native_weights_give_the_decoded_models_logits(tmp_path):
    """fp32: within 1e-4 of the same release decoded to float (measured ~1e-6: the GEMMs' summation order), the
    same argmax everywhere; bf16 activations: within what bf16 costs the float model itself."""
    cfg = tiny_config(index_n_heads=16)
    write_official(tmp_path, cfg, seed=7)
    ids = torch.randint(0, cfg["vocab_size"], (2, 200), generator=torch.Generator().manual_seed(3))
    ref = load_model(tmp_path, dtype=torch.float32, weights="float")(ids)

    def rel(a):
        return ((a.float() - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item()

    got = load_model(tmp_path, dtype=torch.float32, weights="native")(ids)
    assert rel(got) <= 1e-4 and torch.equal(got.argmax(-1), ref.argmax(-1))
    native_bf16 = rel(load_model(tmp_path, dtype=torch.bfloat16, weights="native")(ids))
    float_bf16 = rel(load_model(tmp_path, dtype=torch.bfloat16, weights="float")(ids))
    print(f"fp32 {rel(got):.1e}; bf16 native {native_bf16:.1e}, bf16 float {float_bf16:.1e}")
    assert native_bf16 <= max(2 * float_bf16, 1e-2)


def test_native_tensor_parallel_rank_reads_its_tiles(tmp_path, monkeypatch):
    """Rank 1 of 2 holds its rows and columns of each FP8 weight with the tiles that cover them, also where its
    part starts inside a 128-row tile; decoded, they are the full weight's slice."""
    cfg = tiny_config()
    ref = write_official(tmp_path, cfg, seed=4).state_dict()
    for module in (model_module, loader_module):
        monkeypatch.setattr(module, "world", lambda: (1, 2))
    model = load_model(tmp_path, dtype=torch.float32, weights="native")

    def decoded(prefix):
        lin = model.get_submodule(prefix)
        return fp8_to_float(lin.weight, lin.scale, lin.scale_offset)

    assert model.layers[1].attn.wq_b.scale_offset == (64, 0)
    assert torch.equal(decoded("layers.1.attn.wq_b"), ref["layers.1.attn.wq_b.weight"][64:])
    assert torch.equal(decoded("layers.1.attn.wo_b"), ref["layers.1.attn.wo_b.weight"][:, 24:])
    assert torch.equal(decoded("layers.1.attn.wo_a"), ref["layers.1.attn.wo_a.weight"][24:])
    expert = model.layers[2].ffn.experts[5].w2
    assert expert.format == "fp4"
    assert torch.equal(fp4_to_float(expert.weight, expert.scale), ref["layers.2.ffn.experts.5.w2.weight"])


@pytest.mark.parametrize("weights", ["native", "w8a8", "float"])
def test_every_weights_mode_keeps_what_inspect_says(tmp_path, weights):
    from dsv4cli.tools.inspect import describe
    write_official(tmp_path, tiny_config(), seed=8)
    model = load_model(tmp_path, weights=weights)
    kept = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert sum(describe(tmp_path)["weights"][weights].values()) == kept
    formats = {lin.format for lin in model.modules() if isinstance(lin, Linear)}
    assert formats == {"native": {"fp8", "fp4", "float"}, "w8a8": {"int8", "float"}, "float": {"float"}}[weights]


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_greedy_speculative_output_is_plain_greedy(tmp_path, dtype):
    """The release's kernels give each row what it gets alone (bf16: the fast kernels, int8 activations for FP4),
    so verifying drafts reproduces plain decoding's tokens at every depth."""
    from dsv4cli.config import BUNDLED_MODEL_DIR
    from dsv4cli.engine import Engine, EngineOptions, SamplingParams
    from dsv4cli.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    write_official(tmp_path, tiny_config(vocab_size=tok.vocab_size, index_n_heads=16), seed=3)
    model = load_model(tmp_path, dtype=dtype)
    prompts = [torch.randint(21, tok.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 40)]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = {k: [s.output_ids for s in Engine(model, tok,
                                             EngineOptions(max_batch=1, max_seq_len=256, drafts=k)).generate(prompts,
                                                                                                          greedy)]
            for k in (0, 1, 3)}
    assert outs[1] == outs[0] and outs[3] == outs[0]
