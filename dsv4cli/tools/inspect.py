"""`dsv4 inspect`: what a checkpoint holds and what it needs, from config.json and the safetensors
headers alone (no tensor data is read)."""
import re

import torch
from rich.table import Table

from dsv4cli.errors import UsageError
from dsv4cli.model.loader import Checkpoint, LoadError, keep_fp32, open_checkpoint, plan
from dsv4cli.model.model import Transformer

# What model.py splits across tensor-parallel ranks (heads, output groups, experts, vocabulary rows);
# everything else is replicated on every card.
TP_SPLIT = re.compile(r"^(embed|head)\.|\.(wq_b|wo_a|wo_b|weights_proj)\.|attn_sink|\.experts\.")


def is_quantized(ckpt: Checkpoint, name: str) -> bool:
    if ckpt.format == "w8a8":
        return ckpt.label(name) == "W8A8_DYNAMIC" or name.endswith((".weight_scale", ".weight_offset"))
    return ckpt.dtype(name) in ("F8_E4M3", "F8_E8M0", "I8") or name.endswith(".scale")


def count_parameters(model: Transformer) -> tuple[int, int]:
    """(all parameters, those one token uses): every routed expert but the top-k is idle per token. A loaded
    W8A8 model's per-row weight scales are not counted, so it counts as its checkpoint's config does."""
    cfg = model.cfg
    total = sum(p.numel() for name, p in model.named_parameters() if not name.endswith("weight_scale"))
    idle = (cfg.n_layers + cfg.n_mtp_layers) * (cfg.n_routed_experts - cfg.n_activated_experts)
    return total, total - idle * 3 * cfg.dim * cfg.moe_inter_dim


def describe(path, tp: int = 1, float_bytes: int = 2) -> dict:
    """Format, sizes, parameter counts, layer schedule and the memory a card needs with `tp` cards
    (float weights loaded as `float_bytes`-byte values: 2 for bf16, 4 for float32)."""
    ckpt = open_checkpoint(path)
    cfg = ckpt.config
    for what, n in (("attention heads", cfg.n_heads), ("output groups", cfg.o_groups),
                    ("routed experts", cfg.n_routed_experts), ("vocabulary rows", cfg.vocab_size)):
        if n % tp:
            raise UsageError(f"--tp {tp} must divide the {n} {what}")
    with torch.device("meta"):
        model = Transformer(cfg)
    total, active = count_parameters(model)

    def loaded_bytes(name, t):       # as load_model keeps it: int8 + fp32 scale, fp32 or the dtype's floats
        if ckpt.format == "w8a8" and ckpt.label(name) == "W8A8_DYNAMIC":
            return t.numel() + 4 * t.shape[0]
        return t.numel() * (4 if keep_fp32(name) or not t.is_floating_point() else float_bytes)

    per_card = sum(loaded_bytes(n, t) // (tp if TP_SPLIT.search(n) else 1)
                   for n, t in [*model.named_parameters(), *model.named_buffers()])
    ratios = cfg.compress_ratios[: cfg.n_layers]
    quantized = sum(is_quantized(ckpt, n) for n in ckpt.tensors)
    return {
        "path": str(ckpt.path), "format": ckpt.format,
        "shards": len(ckpt.shards), "bytes_on_disk": sum(s.path.stat().st_size for s in ckpt.shards),
        "tensors": len(ckpt.tensors), "quantized_tensors": quantized, "float_tensors": len(ckpt.tensors) - quantized,
        "parameters": total, "active_parameters": active,
        "hidden_size": cfg.dim, "vocab_size": cfg.vocab_size,
        "layers": cfg.n_layers, "schedule": {"SWA": ratios.count(0), "CSA": ratios.count(4), "HCA": ratios.count(128)},
        "mtp_layers": cfg.n_mtp_layers,
        "routed_experts": cfg.n_routed_experts, "experts_per_token": cfg.n_activated_experts,
        "tp": tp, "weight_bytes_per_card": per_card, "kv_bytes_per_token": cfg.kv_bytes_per_token,
    }


def check(path) -> list[str]:
    """Every problem with the checkpoint's tensors (presence, shape, dtype) against its config."""
    try:
        ckpt = open_checkpoint(path)
    except LoadError as e:
        return [str(e)]
    with torch.device("meta"):
        model = Transformer(ckpt.config)
    return plan(ckpt, model)[1]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.4g} {unit}"
        n /= 1024
    return f"{n:.4g} TiB"


def human_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


FORMATS = {"w8a8": "W8A8_DYNAMIC (msModelSlim)", "fp8": "FP8 + FP4 experts (official release)",
           "float": "float (official layout)"}


def render(info: dict) -> Table:
    s = info["schedule"]
    params = f"{human_count(info['parameters'])} total, {human_count(info['active_parameters'])} active per token"
    layers = (f"{info['layers']}: {s['SWA']} sliding-window, {s['CSA']} CSA (ratio 4), {s['HCA']} HCA "
              f"(ratio 128); {info['mtp_layers']} MTP")
    table = Table(title=info["path"], show_header=False, title_justify="left")
    for key, value in (
            ("format", FORMATS[info["format"]]),
            ("on disk", f"{human_bytes(info['bytes_on_disk'])} in {info['shards']} shard(s)"),
            ("tensors", f"{info['tensors']} ({info['quantized_tensors']} quantised, {info['float_tensors']} float)"),
            ("parameters", params),
            ("layers", layers),
            ("experts", f"{info['routed_experts']} routed, {info['experts_per_token']} per token"),
            (f"weights per card (tp={info['tp']})", human_bytes(info["weight_bytes_per_card"])),
            ("KV cache per token", human_bytes(info["kv_bytes_per_token"]))):
        table.add_row(key, value)
    return table
