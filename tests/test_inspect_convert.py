"""`dsv4 convert` (official release -> W8A8 / bf16, streamed) and `dsv4 inspect` (headers only)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_fp8 import write_official
from test_w8a8 import assert_matches_fake_quant, fake_quant_reference
from tiny import random_model, tiny_config, write_checkpoint

from dsv4cli.cli import main
from dsv4cli.config import Settings
from dsv4cli.model import LoadError, ModelConfig, Transformer, load_model
from dsv4cli.model import loader as loader_module
from dsv4cli.model import model as model_module
from dsv4cli.model.quant import save_w8a8
from dsv4cli.tools.convert import convert
from dsv4cli.tools.inspect import check, count_parameters, describe

CFG = tiny_config()
IDS = torch.randint(0, CFG["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    """A tiny official FP8/FP4 release with tokenizer files, and the float model it decodes to."""
    path = tmp_path_factory.mktemp("official")
    model = write_official(path, CFG, seed=2, max_shard_bytes=150_000)
    (path / "tokenizer.json").write_text('{"tiny": true}')
    (path / "generation_config.json").write_text('{"do_sample": false}')
    return path, model


def test_convert_to_bf16_is_lossless(official, tmp_path):
    src, ref = official
    convert(src, tmp_path / "bf16", to="bf16", progress=False, max_shard_bytes=200_000)
    out = tmp_path / "bf16"
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and "expert_dtype" not in config
    assert (out / "tokenizer.json").read_text() == '{"tiny": true}' and (out / "generation_config.json").exists()
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").exists()
    assert not (tmp_path / "bf16.partial").exists()
    loaded = load_model(out, dtype=torch.float32).state_dict()
    for name, t in ref.state_dict().items():             # FP8 and FP4 values fit bf16 exactly
        assert torch.equal(loaded[name], t), name


def test_convert_to_w8a8_matches_fake_quantised_release(official, tmp_path):
    src, ref = official
    convert(src, tmp_path / "w8a8", to="w8a8", progress=False, max_shard_bytes=200_000)
    out = tmp_path / "w8a8"
    assert len(list(out.glob("quant_model_weights-*-of-*.safetensors"))) > 1
    desc = json.loads((out / "quant_model_description.json").read_text())
    assert desc["layers.0.ffn.experts.3.w1.weight"] == "W8A8_DYNAMIC" and desc["layers.0.attn.wo_a.weight"] == "FLOAT"
    assert "mtp.0.emb.tok_emb.weight" in desc and (out / "tokenizer.json").exists()
    assert describe(out)["format"] == "w8a8" and check(out) == []
    got = load_model(out, dtype=torch.float32)(IDS)
    assert_matches_fake_quant(got, fake_quant_reference(ref)(IDS), "converted W8A8 vs fake-quantised release")


def test_convert_float_checkpoint_and_refusals(tmp_path):
    write_checkpoint(tmp_path / "float", CFG)
    convert(tmp_path / "float", tmp_path / "w8a8", progress=True)          # the bar goes to stderr
    assert load_model(tmp_path / "w8a8", dtype=torch.float32).layers[0].attn.wq_a.quantized
    with pytest.raises(LoadError, match="already W8A8"):
        convert(tmp_path / "w8a8", tmp_path / "again", progress=False)
    with pytest.raises(LoadError, match="already exists"):
        convert(tmp_path / "float", tmp_path / "w8a8", progress=False)
    with pytest.raises(ValueError, match="to must be one of w8a8, bf16"):
        convert(tmp_path / "float", tmp_path / "fp16", to="fp16", progress=False)


def kept_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def test_describe(tmp_path, monkeypatch):
    save_w8a8(random_model(CFG), CFG, tmp_path)
    info = describe(tmp_path, tp=2)
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_dict(CFG))
    total = sum(p.numel() for p in model.parameters())
    expert = 3 * CFG["hidden_size"] * CFG["moe_intermediate_size"]
    assert info["format"] == "w8a8" and info["parameters"] == total
    assert info["active_parameters"] == total - 5 * (8 - 2) * expert       # 4 layers + MTP, top-2 of 8
    assert info["schedule"] == {"SWA": 1, "CSA": 2, "HCA": 1} and info["mtp_layers"] == 1
    desc = json.loads((tmp_path / "quant_model_description.json").read_text())
    n_quant = sum(v == "W8A8_DYNAMIC" for k, v in desc.items() if k != "model_quant_type")
    assert info["quantized_tensors"] == n_quant and info["tensors"] == info["float_tensors"] + n_quant
    assert info["bytes_on_disk"] == (tmp_path / "quant_model_weights.safetensors").stat().st_size
    assert info["kv_bytes_per_token"] == ModelConfig.from_dict(CFG).kv_bytes_per_token
    # the estimate is what load_model keeps in bf16, on one card and on each of two
    assert describe(tmp_path, tp=1)["weight_bytes_per_card"] == kept_bytes(load_model(tmp_path))
    for module in (model_module, loader_module):
        monkeypatch.setattr(module, "world", lambda: (1, 2))
    assert info["weight_bytes_per_card"] == kept_bytes(load_model(tmp_path))


def test_describe_counts_the_release_parameters():
    """The real V4 Flash config: 290,942,289,362 parameters, 14,118,225,362 active (the release index)."""
    cfg = tiny_config(hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, head_dim=512,
                      qk_rope_head_dim=64, q_lora_rank=1024, o_lora_rank=1024, o_groups=8, vocab_size=129280,
                      n_routed_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048, num_hash_layers=3,
                      sliding_window=128, compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0],
                      index_n_heads=64, index_head_dim=128, index_topk=512)
    assert count_parameters(ModelConfig.from_dict(cfg)) == (290_942_289_362, 14_118_225_362)


def test_check_lists_every_problem(tmp_path):
    write_checkpoint(tmp_path, CFG)
    assert check(tmp_path) == []
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["norm.weight"]
    tensors["head.weight"] = tensors["head.weight"].bfloat16()[:, :32].contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    assert check(tmp_path) == ["missing tensor 'norm.weight'",
                               "tensor 'head.weight': shape [256, 32], expected [256, 64]"]


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(map(str, argv)))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli(official, tmp_path, capsys):
    src, _ = official
    code, out, err = run(capsys, "inspect", src)
    assert code == 0 and "FP8 + FP4 experts" in out
    code, out, _ = run(capsys, "inspect", src, "--json", "--check", "--tp", "2")
    info = json.loads(out)
    assert code == 0 and info["format"] == "fp8" and info["problems"] == [] and info["tp"] == 2
    code, out, err = run(capsys, "convert", src, tmp_path / "out", "--to", "bf16")
    assert code == 0 and (tmp_path / "out" / "model.safetensors").exists()
    code, out, err = run(capsys, "inspect", tmp_path / "out", "--check")
    assert code == 0 and "check: all" in out

    (tmp_path / "out" / "model.safetensors").write_bytes(b"\x00" * 7)
    code, out, err = run(capsys, "inspect", tmp_path / "out", "--check")
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    code, _, err = run(capsys, "inspect", src, "--tp", "3")
    assert code == 2 and "--tp 3: does not divide" in err
    code, _, err = run(capsys, "convert", tmp_path / "missing", tmp_path / "x")
    assert code == 2 and err.count("\n") == 1 and "model directory not found" in err
    code, _, err = run(capsys, "convert", src, tmp_path / "x", "--to", "fp16")
    assert code == 2 and "fp16" in err


def test_cli_describes_the_bundled_model_by_default(tmp_path, capsys, monkeypatch):
    import dsv4cli.config
    monkeypatch.setattr(dsv4cli.config, "BUNDLED_MODEL_DIR", tmp_path / "dsv4-tiny")
    code, _, err = run(capsys, "inspect")
    assert code == 2 and "bundled model is not installed" in err
    save_w8a8(random_model(CFG), CFG, tmp_path / "dsv4-tiny")
    code, out, _ = run(capsys, "inspect", "--json")
    assert code == 0 and json.loads(out)["format"] == "w8a8"


def test_inspect_says_what_a_run_at_the_defaults_holds_beside_the_weights(capsys):
    """The decode state `inspect` reports is what a chat's slots at the default settings allocate (built on the
    meta device, drafts `auto` included), and the prefix cache is the default's."""
    from dsv4cli.config import BUNDLED_MODEL_DIR
    from dsv4cli.engine.runner import drafter_depth
    from dsv4cli.engine.slots import SlotState
    from dsv4cli.model.loader import open_checkpoint

    code, out, _ = run(capsys, "inspect", "--json")
    state, s, cfg = json.loads(out)["run_state"], Settings(), open_checkpoint(BUNDLED_MODEL_DIR).config
    with torch.device("meta"):
        model = Transformer(cfg).to(torch.bfloat16)
    slots = SlotState(model, s.max_batch, s.max_seq_len, drafter_depth(cfg, s.drafts), reuse_prefix=True)
    assert state == {"max_batch": s.max_batch, "max_seq_len": s.max_seq_len, "decode_state_bytes": slots.nbytes(),
                     "prefix_cache_bytes": s.prefix_cache_bytes}
    assert slots.draft_q is not None            # the bundled model drafts: its distributions are counted
    code, out, _ = run(capsys, "inspect")
    assert code == 0 and f"decode state at --max-batch {s.max_batch} x --max-seq-len {s.max_seq_len}" in out


def test_convert_to_the_releases_layout_and_run_it_every_way(tmp_path, capsys):
    """`convert --to fp4`: the bundled W8A8 model in the release's FP8/FP4 layout (the release's scale rule), which
    loads as an official release; greedy text at fp32 is the same held as stored (`--weights native`) and decoded
    (`float`), and `inspect` lists each mode's bytes."""
    from dsv4cli.config import BUNDLED_MODEL_DIR
    from dsv4cli.model.loader import open_checkpoint
    from dsv4cli.model.quant import fp4_to_float, fp8_to_float, quantize_fp4, quantize_fp8

    convert(BUNDLED_MODEL_DIR, tmp_path / "fp4", to="fp4", progress=False)
    ckpt = open_checkpoint(tmp_path / "fp4")
    assert ckpt.format == "fp8" and ckpt.dtype("layers.0.ffn.experts.0.w1.weight") == "I8"
    assert ckpt.dtype("layers.0.attn.wq_a.weight") == "F8_E4M3" and ckpt.dtype("embed.weight") == "BF16"
    # the release's rule, as the writer applied it: the stored values survive being encoded again
    for name, encode, decode in (("layers.0.attn.wq_a", quantize_fp8, fp8_to_float),
                                 ("layers.0.ffn.experts.0.w1", quantize_fp4, fp4_to_float)):
        values = decode(ckpt.view(f"{name}.weight"), ckpt.view(f"{name}.scale"))
        assert torch.equal(decode(*encode(values)), values) and values.abs().max() > 0
    texts = []
    for weights in ("native", "float"):
        assert main(["generate", "--model", str(tmp_path / "fp4"), "--weights", weights, "--dtype", "float32",
                     "-p", "Tell me a story.", "-n", "24", "--temperature", "0", "--ignore-eos"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()
    assert main(["inspect", str(tmp_path / "fp4")]) == 0
    out = capsys.readouterr().out
    assert all(f"--weights {mode}" in out for mode in ("native", "w8a8", "float")) and "FP4" in out


def test_dtype_auto_takes_bf16_for_the_releases_bytes_where_the_fast_kernels_run(tmp_path):
    """`--dtype auto` on the CPU: bf16 for a run holding the release's FP8/FP4 as stored where the fast kernels
    run (their speed at W8A8's accuracy), else fp32, as for W8A8 and float checkpoints and the release
    re-quantised or decoded; a dtype asked for is kept."""
    from dsv4cli.config import BUNDLED_MODEL_DIR
    from dsv4cli.kernels import native
    from dsv4cli.loading import pick_dtype

    convert(BUNDLED_MODEL_DIR, tmp_path / "fp4", to="fp4", progress=False)
    release, cpu = str(tmp_path / "fp4"), torch.device("cpu")
    fast = torch.bfloat16 if native.lowbit_fast_available() else torch.float32
    assert [pick_dtype(Settings(model=release, weights=w), cpu) for w in ("auto", "native")] == [fast, fast]
    others = [Settings(model=release, weights="w8a8"), Settings(model=release, weights="float"),
              Settings(model=release, dtype="float32"), Settings(), Settings(model=str(tmp_path))]   # no checkpoint
    assert [pick_dtype(s, cpu) for s in others] == [torch.float32] * len(others)
