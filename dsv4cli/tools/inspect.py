"""`dsv4 inspect`: what a checkpoint holds and what it needs, from config.json and the safetensors
headers alone (no tensor data is read)."""
import torch
from rich.table import Table

from dsv4cli.config import Settings
from dsv4cli.engine import decode_state_bytes
from dsv4cli.errors import UsageError
from dsv4cli.loading import shape_options
from dsv4cli.model.drafters import drafter_kind, drafter_named
from dsv4cli.model.footprint import count_parameters, model_tensors, tensor_bytes, tp_problem
from dsv4cli.model.loader import Checkpoint, LoadError, open_checkpoint, plan
from dsv4cli.model.model import Transformer
from dsv4cli.units import human_bytes, human_count


def is_quantized(ckpt: Checkpoint, name: str) -> bool:
    if ckpt.format == "w8a8":
        return ckpt.label(name) == "W8A8_DYNAMIC" or name.endswith((".weight_scale", ".weight_offset"))
    return ckpt.dtype(name) in ("F8_E4M3", "F8_E8M0", "I8") or name.endswith(".scale")


def describe(path, tp: int = 1, float_bytes: int = 2) -> dict:
    """Format, sizes, parameter counts, layer schedule and the memory a card needs with `tp` cards
    (float weights loaded as `float_bytes`-byte values: 2 for bf16, 4 for float32)."""
    ckpt = open_checkpoint(path)
    cfg = ckpt.config
    if problem := tp_problem(cfg, tp):
        raise UsageError(f"--tp {tp}: {problem}")
    total, active = count_parameters(cfg)
    modes = {"fp8": ("native", "w8a8", "float"), "w8a8": ("native", "float"), "float": ("float",)}[ckpt.format]
    tensors = model_tensors(cfg)
    by_mode = {mode: tensor_bytes(ckpt, tensors, tp, float_bytes, mode) for mode in modes}
    ratios = cfg.compress_ratios[: cfg.n_layers]
    quantized = sum(is_quantized(ckpt, n) for n in ckpt.tensors)
    kind = drafter_kind(cfg)
    drafter = {"kind": cfg.drafter, "layers": cfg.n_mtp_layers,
               "bytes_on_disk": sum(ckpt.nbytes(n) for n in ckpt.tensors if n.startswith("mtp.")),
               **(kind.settings(cfg) if kind else {})}
    return {
        "path": str(ckpt.path), "format": ckpt.format,
        "shards": len(ckpt.shards), "bytes_on_disk": sum(s.path.stat().st_size for s in ckpt.shards),
        "tensors": len(ckpt.tensors), "quantized_tensors": quantized, "float_tensors": len(ckpt.tensors) - quantized,
        "parameters": total, "active_parameters": active,
        "hidden_size": cfg.dim, "vocab_size": cfg.vocab_size,
        "layers": cfg.n_layers, "schedule": {"SWA": ratios.count(0), "CSA": ratios.count(4), "HCA": ratios.count(128)},
        "mtp_layers": cfg.n_mtp_layers, "drafter": drafter,
        "routed_experts": cfg.n_routed_experts, "experts_per_token": cfg.n_activated_experts,
        "tp": tp, "weight_bytes_per_card": sum(by_mode[modes[0]].values()), "weights": by_mode,
        "kv_bytes_per_token": cfg.kv_bytes_per_token,
        "run_state": run_state(cfg, float_bytes),
    }


def run_state(cfg, float_bytes: int) -> dict:
    """What a chat run at the default settings holds besides the weights, per card (every rank holds the
    whole decode state: V4's attention has one KV head): its decode state and the prefix cache."""
    run = Settings()
    return {"max_batch": run.max_batch, "max_seq_len": run.max_seq_len,
            "decode_state_bytes": decode_state_bytes(cfg, shape_options(run, "chat"), float_bytes),
            "prefix_cache_bytes": run.prefix_cache_bytes}


def check(path) -> list[str]:
    """Every problem with the checkpoint's tensors (presence, shape, dtype) against its config."""
    try:
        ckpt = open_checkpoint(path)
    except LoadError as e:
        return [str(e)]
    with torch.device("meta"):
        model = Transformer(ckpt.config)
    return plan(ckpt, model)[1]


FORMATS = {"w8a8": "W8A8_DYNAMIC (msModelSlim)", "fp8": "FP8 + FP4 experts (official release)",
           "float": "float (official layout)"}


def render(info: dict) -> Table:
    s = info["schedule"]
    params = f"{human_count(info['parameters'])} total, {human_count(info['active_parameters'])} active per token"
    layers = f"{info['layers']}: {s['SWA']} sliding-window, {s['CSA']} CSA (ratio 4), {s['HCA']} HCA (ratio 128)"
    d = info["drafter"]
    kind = drafter_named(d["kind"])
    drafter = kind.summary(d) if kind else "none"
    table = Table(title=info["path"], show_header=False, title_justify="left")
    for key, value in (
            ("format", FORMATS[info["format"]]),
            ("on disk", f"{human_bytes(info['bytes_on_disk'])} in {info['shards']} shard(s)"),
            ("tensors", f"{info['tensors']} ({info['quantized_tensors']} quantised, {info['float_tensors']} float)"),
            ("parameters", params),
            ("layers", layers),
            ("drafter", drafter + (f"; {human_bytes(d['bytes_on_disk'])}" if d["kind"] else "")),
            ("experts", f"{info['routed_experts']} routed, {info['experts_per_token']} per token"),
            *((f"--weights {mode}, per card (tp={info['tp']})", held_line(held))
              for mode, held in info["weights"].items()),
            ("KV cache per token", human_bytes(info["kv_bytes_per_token"])),
            ("a run's state, per card", state_line(info["run_state"]))):
        table.add_row(key, value)
    return table


def state_line(state: dict) -> str:
    """'738 MiB decode state at --max-batch 8 x --max-seq-len 4096 (+ 1 GiB prefix cache in chat, serve and batch)'"""
    return (f"{human_bytes(state['decode_state_bytes'])} decode state at --max-batch {state['max_batch']} x "
            f"--max-seq-len {state['max_seq_len']} (+ {human_bytes(state['prefix_cache_bytes'])} prefix cache in chat, "
            "serve and batch)")


HELD = {"fp4": "FP4", "fp8": "FP8", "int8": "int8", "float": "float"}


def held_line(held: dict[str, int]) -> str:
    """A mode's weight bytes, then each format's part: '158.2 GB (FP4 140.1 GB, FP8 9.4 GB, float 8.7 GB)'."""
    parts = ", ".join(f"{HELD[k]} {human_bytes(n)}" for k, n in held.items() if n)
    return f"{human_bytes(sum(held.values()))} ({parts})"
