"""`dsv4 convert`: the official FP8/FP4 (or float) release to the msModelSlim W8A8 layout or to bf16, and any
checkpoint (W8A8 included) to the release's own FP8/FP4 layout, so every path can run the same weights.

It streams: source tensors are decoded one at a time in file order and written out as they come, so
memory holds one output shard (at most `max_shard_bytes`) and one tensor, never the whole model.
"""
import shutil
from pathlib import Path

import torch

from dsv4cli.model.drafters import drafter_kind
from dsv4cli.model.loader import LoadError, open_checkpoint, plan, progress_bar, read_item
from dsv4cli.model.model import Transformer
from dsv4cli.model.quant import (
    RELEASE_CONFIG,
    ShardWriter,
    W8A8Writer,
    as_stored,
    is_w8a8_linear,
    quantize_weight,
    release_tensors,
    vocab_copies,
    write_config,
)

TARGETS = ("w8a8", "bf16", "fp4")
# Files next to the weights that a converted checkpoint keeps.
COPIED = ("tokenizer*", "generation_config.json", "special_tokens_map.json", "*.jinja")


def convert(src, dst, to: str = "w8a8", progress: bool = True, max_shard_bytes: int = 4 << 30) -> None:
    """Write the checkpoint at `src` to the new directory `dst` in the `to` layout."""
    if to not in TARGETS:
        raise ValueError(f"to must be one of {', '.join(TARGETS)}, got {to!r}")
    src, dst = Path(src), Path(dst)
    ckpt = open_checkpoint(src)
    if ckpt.format == "w8a8" and to != "fp4":
        raise LoadError(f"{src}: already W8A8 (and QuaRot-rotated); convert the original release instead")
    with torch.device("meta"):
        model = Transformer(ckpt.config)
    items, problems = plan(ckpt, model)
    if problems:
        raise LoadError(f"{src}: {problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise LoadError(f"{dst}: already exists; choose a new directory")
    tmp = dst.with_name(dst.name + ".partial")        # renamed to dst only once complete
    shutil.rmtree(tmp, ignore_errors=True)
    if to == "w8a8":
        out = W8A8Writer(tmp, max_shard_bytes, vocab_copies(ckpt.config))
    else:
        out = ShardWriter(tmp, "model", max_shard_bytes)
    modules, drafter = dict(model.named_modules()), drafter_kind(ckpt.config)
    items.sort(key=lambda it: ckpt.position(it.sources[0]))
    total = sum(ckpt.nbytes(n) for it in items for n in it.sources)
    with progress_bar(progress, total, f"converting {src.name} to {to}") as advance:
        for item in items:
            prefix, _, attr = item.name.rpartition(".")
            # FP8 and FP4 values fit bf16 exactly; W8A8's int8 x scale, re-encoded to fp4, is read in fp32
            t = read_item(ckpt, item, "cpu", torch.float32 if to == "fp4" else torch.bfloat16,
                          module=modules.get(prefix)).tensor
            if to == "fp4":
                for name, stored in release_tensors(item.name, t, modules.get(prefix)):
                    out.add(name, stored)
            elif to == "bf16":
                out.add(item.name, as_stored(item.name, t))
            elif attr == "weight" and is_w8a8_linear(prefix, drafter):
                out.linear(prefix, *quantize_weight(t))
            else:
                out.tensor(item.name, t)
            advance(sum(ckpt.nbytes(n) for n in item.sources))
    if to == "w8a8":
        out.close(ckpt.config.raw)
    elif to == "fp4":
        out.close()
        write_config(tmp, {**ckpt.config.raw, **RELEASE_CONFIG})
    else:
        out.close()
        write_config(tmp, {**ckpt.config.raw, "torch_dtype": "bfloat16"}, drop=("quantization_config", "expert_dtype"))
    for pattern in COPIED:
        for f in src.glob(pattern):
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
    if dst.exists():
        dst.rmdir()
    tmp.rename(dst)
