"""Load a DeepSeek V4 checkpoint: official float layout or msModelSlim W8A8_DYNAMIC.

Shards are memory-mapped and read tensor by tensor; each rank reads only its own slice (heads,
groups, experts, vocabulary rows) and places it straight on the target device and dtype.
"""
import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .config import ConfigError, ModelConfig
from .model import Transformer, world

W8A8_DESCRIPTION = "quant_model_description.json"
# Copies of embed/head that msModelSlim writes for the MTP layer; the model shares the originals.
MTP_COPIES = ("mtp.0.emb.tok_emb.weight", "mtp.0.head.weight")


class LoadError(ValueError):
    """A checkpoint problem a user can fix; one line naming the file or tensor."""


def checkpoint_files(path: Path) -> tuple[str, list[Path], dict]:
    """(format, shard files, quant description) for a checkpoint directory."""
    desc_file = path / W8A8_DESCRIPTION
    description = {}
    if desc_file.exists():
        fmt = "w8a8"
        try:
            description = json.loads(desc_file.read_text())
        except json.JSONDecodeError as e:
            raise LoadError(f"{desc_file}: invalid JSON: {e.msg}") from None
        index = path / "quant_model_weights.safetensors.index.json"
    else:
        fmt = "float"
        index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{path}: no .safetensors files")
    for f in files:
        if not f.exists():
            raise LoadError(f"{f}: shard listed in the index is missing")
    return fmt, files, description


def open_shards(files: list[Path]) -> dict:
    """name -> (file, handle); a truncated or corrupt shard is reported by file name."""
    tensors = {}
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt")
            for name in handle.keys():
                tensors[name] = handle
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise LoadError(f"{f}: unreadable safetensors file ({e})") from None
    return tensors


def keep_fp32(name: str) -> bool:
    return any(k in name for k in ("hc_", ".ape", "attn_sink", "gate.bias", "norm.weight"))


def read_slice(handle, name: str, local_shape: torch.Size) -> torch.Tensor:
    """Read this rank's part of a tensor: the whole tensor, or a contiguous block along the one
    dimension where the local shape is smaller (the official tensor-parallel split)."""
    sl = handle.get_slice(name)
    full = sl.get_shape()
    if list(full) == list(local_shape) or len(full) != len(local_shape):
        return handle.get_tensor(name)
    rank = world()[0]
    dims = [d for d in range(len(full)) if full[d] != local_shape[d]]
    if len(dims) != 1 or full[dims[0]] != local_shape[dims[0]] * world()[1]:
        raise LoadError(f"tensor '{name}': shape {list(full)}, expected {list(local_shape)}")
    d, n = dims[0], local_shape[dims[0]]
    index = tuple(slice(rank * n, (rank + 1) * n) if i == d else slice(None) for i in range(len(full)))
    return sl[index]


def load_model(path, device="cpu", dtype=torch.bfloat16) -> Transformer:
    path = Path(path)
    if not path.is_dir():
        raise LoadError(f"{path}: model directory not found")
    try:
        cfg = ModelConfig.from_file(path / "config.json")
    except ConfigError as e:
        raise LoadError(str(e)) from None
    if cfg.raw.get("quantization_config", {}).get("quant_method") == "fp8":
        raise LoadError(f"{path}: official FP8/FP4 release; convert it first with `dsv4 convert`")
    fmt, files, description = checkpoint_files(path)
    with torch.device("meta"):
        model = Transformer(cfg)
    tensors = open_shards(files)
    expected = dict(model.named_parameters())
    expected.update(model.named_buffers())
    seen = set()
    for name, meta in expected.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if name not in tensors:
            raise LoadError(f"{path}: missing tensor '{name}'")
        handle = tensors[name]
        t = read_slice(handle, name, meta.shape)
        if t.shape != meta.shape:
            raise LoadError(f"tensor '{name}': shape {list(t.shape)}, expected {list(meta.shape)}")
        seen.add(name)
        if t.dtype == torch.int8:
            if attr != "weight" or not hasattr(module, "weight_scale"):
                raise LoadError(f"tensor '{name}': int8 but this tensor is not a quantisable linear")
            if fmt == "w8a8" and description.get(name) not in ("W8A8_DYNAMIC", None):
                raise LoadError(f"tensor '{name}': int8 but labelled {description.get(name)!r}")
            scale_name = f"{module_name}.weight_scale"
            if scale_name not in tensors:
                raise LoadError(f"{path}: missing tensor '{scale_name}'")
            scale = read_slice(tensors[scale_name], scale_name, torch.Size([meta.shape[0], 1]))
            if list(scale.shape) != [meta.shape[0], 1]:
                raise LoadError(f"tensor '{scale_name}': shape {list(scale.shape)}, expected [{meta.shape[0]}, 1]")
            module.weight_scale = nn.Parameter(scale.to(device, torch.float32), requires_grad=False)
            seen.update({scale_name, f"{module_name}.weight_offset"})
            t = t.to(device)
        elif name.endswith("tid2eid"):
            t = t.to(device, torch.int32)
        elif not t.is_floating_point():
            raise LoadError(f"tensor '{name}': dtype {t.dtype}, expected a float type")
        else:
            t = t.to(device, torch.float32 if keep_fp32(name) else dtype)
        if isinstance(meta, nn.Parameter):
            module._parameters[attr] = nn.Parameter(t, requires_grad=False)
        else:
            module._buffers[attr] = t
    rank, ws = world()
    extra = [n for n in tensors if n not in seen and n not in MTP_COPIES and not is_other_rank_expert(n, cfg)]
    if extra:
        raise LoadError(f"{path}: unexpected tensor '{extra[0]}'" + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else ""))
    return model.eval()


def is_other_rank_expert(name: str, cfg: ModelConfig) -> bool:
    """Routed experts owned by another rank are skipped, not reported as extra."""
    parts = name.split(".")
    if "experts" not in parts or world()[1] == 1:
        return False
    expert = int(parts[parts.index("experts") + 1])
    n_local = cfg.n_routed_experts // world()[1]
    return expert // n_local != world()[0]
