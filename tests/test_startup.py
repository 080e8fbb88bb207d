"""Start-up: the memory check's numbers by arithmetic, equal to counting a model built on the meta device (which
takes seconds at V4 Flash's size and imports torch's symbolic shapes), and the CLI's mistakes said before torch
is imported; real files and processes, nothing replaced."""
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny import tiny_config, tiny_dspark_config

from dsv4cli.cli import main
from dsv4cli.config import BUNDLED_MODEL_DIR, Settings
from dsv4cli.engine import decode_state_bytes
from dsv4cli.engine.runner import drafter_depth
from dsv4cli.engine.slots import SlotState
from dsv4cli.loading import shape_options
from dsv4cli.model import LoadError, ModelConfig, Transformer
from dsv4cli.model.footprint import ModelTensor, footprint, model_tensors, state_bytes, tensor_bytes
from dsv4cli.model.loader import open_checkpoint, plan, weights_mode
from dsv4cli.model.model import Linear
from dsv4cli.model.quant import FP4_BLOCK, FP8_BLOCK, FP32_TENSORS, RELEASE_CONFIG, is_release_fp8

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from real_width import DSPARK, V4_FLASH  # noqa: E402

FLASH = {**V4_FLASH, "num_hidden_layers": 43, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0]}
FLASH_0731 = {**FLASH, **DSPARK, "dspark_target_layer_ids": [40, 41, 42],
              "compress_ratios": FLASH["compress_ratios"][:43] + [0, 0, 0]}
BUNDLED = (BUNDLED_MODEL_DIR, BUNDLED_MODEL_DIR.parent / "dsv4-tiny-mtp")
_models: dict[ModelConfig, Transformer] = {}


def module_tensors(model: Transformer) -> list[ModelTensor]:
    """What a built model holds, as `model_tensors` lists it: the oracle of the arithmetic."""
    modules = dict(model.named_modules())
    buffers = dict(model.named_buffers())
    out = []
    for name, t in [*model.named_parameters(), *buffers.items()]:
        prefix, _, attr = name.rpartition(".")
        linear = modules.get(prefix) if attr == "weight" else None
        flags = (linear.float_only, linear.holds_fp8) if isinstance(linear, Linear) else None
        out.append(ModelTensor(name, tuple(t.shape), name not in buffers, t.is_floating_point(), flags))
    return out


def meta_model(cfg: ModelConfig) -> Transformer:
    """The model built on the meta device, as the memory check built it before (once per config)."""
    if cfg not in _models:
        with torch.device("meta"):
            _models[cfg] = Transformer(cfg)
    return _models[cfg]


def configs() -> list[ModelConfig]:
    """The tiny configs, the bundled models', V4 Flash's (preview and 0731), the DSpark ones with and without
    the drafter's own vocabulary copies."""
    cfgs = [ModelConfig.from_dict(d) for d in (tiny_config(), tiny_dspark_config(), FLASH, FLASH_0731)]
    cfgs += [ModelConfig.from_file(path / "config.json") for path in BUNDLED]
    return cfgs + [replace(cfg, dspark_vocab_copies=True) for cfg in cfgs if cfg.drafter == "dspark"]


@pytest.mark.parametrize("cfg", configs(), ids=lambda cfg: f"{cfg.n_layers}x{cfg.dim}-{cfg.drafter}"
                         + ("-copies" if cfg.dspark_vocab_copies else ""))
def test_the_model_tensors_by_arithmetic_are_the_built_models(cfg):
    """Every parameter and buffer: name, shape, counted or not, float or not, and a Linear's float_only and
    holds_fp8, which is all the footprint reads."""
    model = meta_model(cfg)
    assert {t.name: t for t in model_tensors(cfg)} == {t.name: t for t in module_tensors(model)}
    assert len(model_tensors(cfg)) == len(module_tensors(model))


def write_headers(path: Path, config: dict, release: bool) -> Path:
    """A checkpoint of `config` whose data section is a hole (a sparse file): real safetensors headers, in the
    official release's layout (FP8 linears and their tile scales, FP4 routed experts and theirs) or float."""
    model = meta_model(ModelConfig.from_dict(config))
    modules, header, offset = dict(model.named_modules()), {}, 0

    def add(name, dtype, shape):
        nonlocal offset
        size = math.prod(shape) * {"I8": 1, "F8_E4M3": 1, "F8_E8M0": 1, "BF16": 2, "F32": 4, "I64": 8}[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size

    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        prefix = name.rpartition(".")[0]
        rows, cols = t.shape if t.dim() == 2 else (0, 0)
        if release and isinstance(modules.get(prefix), Linear) and name.endswith(".weight") and is_release_fp8(prefix):
            if ".experts." in prefix:
                add(name, "I8", (rows, cols // 2))
                add(f"{prefix}.scale", "F8_E8M0", (rows, cols // FP4_BLOCK))
            else:
                add(name, "F8_E4M3", (rows, cols))
                add(f"{prefix}.scale", "F8_E8M0", (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)))
        elif name.endswith("tid2eid"):
            add(name, "I64", t.shape)
        else:
            add(name, "F32" if any(k in name for k in FP32_TENSORS) else "BF16", t.shape)
    path.mkdir()
    text = json.dumps(header).encode()
    with open(path / "model.safetensors", "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + offset)
    (path / "config.json").write_text(json.dumps({**config, **(RELEASE_CONFIG if release else {})}))
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[Path]:
    """The bundled models (W8A8), tiny ones (float and the release's layout, preview and 0731) and V4 Flash in
    the release's layout."""
    d = tmp_path_factory.mktemp("headers")
    written = [write_headers(d / "tiny-float", tiny_config(), release=False),
               write_headers(d / "tiny-release", tiny_config(), release=True),
               write_headers(d / "dspark-release", tiny_dspark_config(), release=True),
               write_headers(d / "flash-release", FLASH, release=True)]
    for path in written:    # the headers are what the loader reads: every tensor there, as it wants it
        ckpt = open_checkpoint(path)
        assert plan(ckpt, meta_model(ckpt.config))[1] == []
    return [*BUNDLED, *written]


def test_the_footprint_by_arithmetic_is_the_built_models(checkpoints):
    """Parameters and the bytes held per card by format, for every --weights mode and tp 1 and 2, bf16 and fp32
(V4 Flash: bf16): as counted on the model built on the meta device (`module_tensors`)."""
    formats = set()
    for path in checkpoints:
        ckpt = open_checkpoint(path)
        model = meta_model(ckpt.config)
        formats.add(ckpt.format)
        built = module_tensors(model)
        for weights in ("auto", "native", "w8a8", "float"):
            try:
                mode = weights_mode(ckpt, weights, "cpu")
            except LoadError:       # w8a8 of a float checkpoint
                assert ckpt.format == "float" and weights == "w8a8"
                continue
            for tp in (1, 2):
                for float_bytes in (2,) if ckpt.config.dim == FLASH["hidden_size"] else (2, 4):
                    parameters = sum(p.numel() for p in model.parameters())
                    want = parameters, tensor_bytes(ckpt, built, tp, float_bytes, mode)
                    assert footprint(path, tp, float_bytes, weights) == want, (path.name, weights, tp, float_bytes)
    assert formats == {"float", "fp8", "w8a8"}


@pytest.mark.parametrize("cfg", configs()[:6], ids=lambda cfg: f"{cfg.n_layers}x{cfg.dim}-{cfg.drafter}")
def test_the_decode_state_bytes_by_arithmetic_are_the_allocated_ones(cfg):
    """What SlotState allocates (built on the meta device: the decode state, the drafts' distributions and the
    sampling rows), for each drafter depth, with and without chat's spare ring rows, bf16 and fp32, a sequence
    length on and off a block boundary."""
    model = meta_model(cfg)
    for mtp in (0, 1, 3, "auto"):
        for mode in ("chat", "generate"):
            for dtype in (torch.bfloat16, torch.float32):
                for batch, max_len in ((1, 4096), (3, 1000)):
                    options = shape_options(Settings(drafts=mtp, max_batch=batch, max_seq_len=max_len), mode)
                    slots = SlotState(model.to(dtype), batch, max_len, drafter_depth(cfg, mtp),
                                      reuse_prefix=mode == "chat")
                    assert decode_state_bytes(cfg, options, dtype.itemsize) == slots.nbytes(), (mtp, mode, dtype, batch)
    assert state_bytes(cfg, 2, 4096, 2, 0, 2) == 2 * state_bytes(cfg, 1, 4096, 2, 0, 2)


def run_cli(*args: str) -> tuple[int, str, set[str]]:
    """The CLI in a fresh interpreter: (exit code, stderr, which of torch and sympy were imported by the end)."""
    code = ("import sys\nfrom dsv4cli.cli import main\ncode = main(sys.argv[1:])\n"
            "print(f'\\nexit {code} imported', *(m for m in ('torch', 'sympy') if m in sys.modules), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, check=False)
    *said, last = out.stderr.rstrip("\n").splitlines()
    assert last.startswith("exit "), out.stderr
    return int(last.split()[1]), "\n".join(said).strip(), set(last.split()[3:])


def test_usage_errors_are_said_before_torch_is_imported(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "Hi"}\n')
    for args, says in (
            (["generate", "--model", "/nonexistent", "-p", "hi"], "error: /nonexistent: no such model directory"),
            (["generate", "--bogus"], "error: No such option: --bogus"),
            (["generate", "-p", "hi", "--prompt-file", str(src)], "error: --prompt-file: the prompt is also given"),
            (["generate", "--json-schema", str(tmp_path / "none.json"), "-p", "hi"], "error: --json-schema"),
            (["batch", str(src), "-o", str(tmp_path / "o.jsonl"), "--model", "/nonexistent"],
             "error: /nonexistent: no such model directory"),
            (["batch", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "o.jsonl")], "none.jsonl: no such file"),
            (["batch", str(src), "-o", str(src)], "-o/--output " + str(src) + ": is the input file"),
            (["batch", str(src), "-o", str(tmp_path / "o.jsonl"), "--shard", "3/2"], "--shard"),
            (["batch", "merge", str(tmp_path / "o.jsonl")], "error: merge: no shard files"),
            (["inspect", "acme/absent"], "hf download acme/absent")):
        code, err, imported = run_cli(*args)
        assert code == 2 and err.count("\n") == 0 and says in err and not imported, (args, err, imported)


def test_a_merge_imports_no_torch(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": "Hi"}) + "\n" for i in range(6)))
    for shard in ("0/2", "1/2"):
        assert main(["batch", str(src), "-o", str(tmp_path / "out.jsonl"), "-n", "1", "--shard", shard]) == 0
    code, err, imported = run_cli("batch", "merge", str(tmp_path / "out.jsonl"))
    assert code == 0 and "2 shards" in err and "6 requests, 6 ok" in err and not imported, err
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 6


def test_the_memory_check_builds_no_model():
    """A refused --max-batch: the check counted, and built nothing on the meta device (whose first op imports
    torch's symbolic shapes, sympy)."""
    code, err, imported = run_cli("generate", "-p", "hi", "--max-batch", "1000000000")
    assert code == 2 and "not enough memory on cpu" in err and imported == {"torch"}, (err, imported)
