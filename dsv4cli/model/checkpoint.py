"""Write checkpoints in the official layout (bf16/fp32 safetensors + config.json), and random init."""
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from .model import Transformer


def save_checkpoint(tensors: dict[str, torch.Tensor], config: dict, out_dir, max_shard_bytes: int = 0,
                    prefix: str = "model", extra_files: dict[str, str] | None = None) -> None:
    """Save tensors as `{prefix}.safetensors`, or as numbered shards plus an index when they exceed
    `max_shard_bytes` (0 = one file)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and max_shard_bytes and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], str(out / f"{prefix}.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"{prefix}-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name, text in (extra_files or {}).items():
        (out / name).write_text(text)


@torch.no_grad()
def init_weights(model: Transformer, seed: int = 0, std: float = 0.02, spread: float = 0.0) -> None:
    """Random init. `spread` > 0 also randomises the parameters that are constant at init in training
    (norm weights, mHC bases/scales, ape, sinks, gate bias) so that tests exercise every term."""
    g = torch.Generator().manual_seed(seed)

    def normal(t, s):
        t.copy_(torch.randn(t.shape, generator=g) * s)

    cfg = model.cfg
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + torch.randn(p.shape, generator=g) * spread)
        elif "hc_" in name and name.endswith("_fn"):
            normal(p, std)
        elif "hc_" in name and name.endswith("_base"):
            normal(p, spread)
        elif "hc_" in name and name.endswith("_scale"):
            p.copy_(1 + torch.randn(p.shape, generator=g) * spread)
        elif name.endswith((".ape", "attn_sink", "gate.bias")):
            normal(p, spread)
        elif name.startswith(("embed", "head")):
            normal(p, 4 / math.sqrt(cfg.dim))
        else:
            normal(p, min(std, 1 / math.sqrt(p.shape[-1])))
    for layer in list(model.layers) + list(model.mtp):
        if layer.ffn.gate.hash:
            t = layer.ffn.gate.tid2eid
            t.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[: t.shape[1]]
                                 for _ in range(t.shape[0])]).int())

