"""Checkpoint load throughput and peak host memory, against a plain read of the same files.

    python benchmarks/load.py [PATH] [--layout preview|0731] [--device cpu] [--dtype bfloat16] [--repeats 3]
        [--out load.json]

Without PATH it first writes a synthetic W8A8 checkpoint (about 1 GB, random weights) to a temporary
directory: the preview's layout (one MTP layer) or 0731's (three DSpark stages, their Markov tables and the
drafter's own embed/head copies). The raw read and the load each run `--repeats` times in fresh processes,
after one warm-up read, so both see a warm page cache and each peak RSS is its own; the median run is
reported, and every run. `rss_over_weights` is the load's peak RSS above
the process's RSS before loading, divided by the bytes of weights the model keeps.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meta import stamp

SYNTHETIC = {   # a small V4-shaped model dominated by its experts, like the real one
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 32768,
    "hidden_size": 2048, "num_hidden_layers": 4, "num_nextn_predict_layers": 1, "num_attention_heads": 16,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_lora_rank": 1024,
    "o_groups": 4, "n_routed_experts": 32, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "moe_intermediate_size": 1024, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
    "num_hash_layers": 1, "swiglu_limit": 10.0, "sliding_window": 128, "compress_ratios": [0, 4, 128, 4, 0],
    "index_n_heads": 16, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "rms_norm_eps": 1e-6,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
}


# 0731: the same trunk, three DSpark stages past it (V4 Flash's block, noise token and Markov rank)
SYNTHETIC_0731 = {**SYNTHETIC, "compress_ratios": SYNTHETIC["compress_ratios"][:4] + [0, 0, 0],
                  "dspark_block_size": 5, "dspark_noise_token_id": 5, "dspark_target_layer_ids": [1, 2, 3],
                  "dspark_markov_rank": 256}


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # Linux reports KiB


def files_of(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def write_synthetic(path: Path, layout: str) -> dict:
    """Tensor by tensor from the model's shapes, so writing never holds the whole model."""
    import torch

    from dsv4cli.model import ModelConfig, Transformer
    from dsv4cli.model.quant import W8A8Writer, is_w8a8_linear, quantize_weight, vocab_copies

    config = SYNTHETIC_0731 if layout == "0731" else SYNTHETIC
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_dict(config))
    writer = W8A8Writer(path, max_shard_bytes=256 << 20, copies=vocab_copies(model.cfg))
    dspark = model.cfg.drafter == "dspark"
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        prefix, _, attr = name.rpartition(".")
        if name.endswith("tid2eid"):
            writer.tensor(name, torch.randint(0, config["n_routed_experts"], t.shape))
        elif attr == "weight" and is_w8a8_linear(prefix, dspark):
            writer.linear(prefix, *quantize_weight(torch.randn(t.shape) * 0.02))
        else:
            writer.tensor(name, torch.randn(t.shape) * 0.02)
    writer.close(config)
    return {"bytes": sum(f.stat().st_size for f in files_of(path))}


def raw_read(path: Path) -> dict:
    """Every file read into freshly allocated memory that is kept, as a load must."""
    import torch

    start, kept = time.perf_counter(), []
    for f in files_of(path):
        kept.append(torch.empty(f.stat().st_size, dtype=torch.uint8))
        with open(f, "rb", buffering=0) as fh:
            fh.readinto(memoryview(kept[-1].numpy()))
    seconds = time.perf_counter() - start
    total = sum(t.numel() for t in kept)
    return {"bytes": total, "seconds": seconds, "gb_per_s": total / seconds / 1e9, "peak_rss": peak_rss()}


def load(path: Path, device: str, dtype: str, threads: str) -> dict:
    import torch

    from dsv4cli.kernels import module_for
    from dsv4cli.model import load_model

    if int(threads):
        torch.set_num_threads(int(threads))
    module_for(torch.device(device))    # the kernels' code (a native extension on the CPU) is no part of the load
    before = peak_rss()
    start = time.perf_counter()
    model = load_model(path, device, getattr(torch, dtype), progress=False)
    seconds = time.perf_counter() - start
    kept = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    on_disk = sum(f.stat().st_size for f in files_of(path))
    return {"bytes": on_disk, "seconds": seconds, "gb_per_s": on_disk / seconds / 1e9, "weights_kept": kept,
            "rss_before": before, "peak_rss": peak_rss(), "rss_over_weights": (peak_rss() - before) / kept}


def median_run(runs: list[dict], key: str) -> dict:
    """The run whose `key` is the median (the lower one of an even count)."""
    return sorted(runs, key=lambda r: r[key])[(len(runs) - 1) // 2]


def child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", type=Path, help="checkpoint directory (default: a synthetic one)")
    parser.add_argument("--layout", default="preview", choices=["preview", "0731"],
                        help="the synthetic checkpoint's layout (without PATH)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=0, help="torch threads for the load (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=3, help="raw reads and loads, each in a fresh process")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, path, *rest = args.child
        run = {"write": write_synthetic, "raw": raw_read, "load": load}[mode]
        print(json.dumps(run(Path(path), *rest)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = args.path
        if path is None:
            path = Path(tmp)
            child("write", tmp, args.layout)
        child("raw", str(path))                                     # warm the page cache
        raws, loads = [], []
        for _ in range(args.repeats):      # alternating, each in a fresh process: the machine's drift hits both
            raws.append(child("raw", str(path)))
            loads.append(child("load", str(path), args.device, args.dtype, str(args.threads)))
        report = {"meta": stamp(vars(args)),
                  "path": str(args.path or f"synthetic W8A8, {args.layout} layout"), "device": args.device,
                  "dtype": args.dtype,
                  "threads": args.threads, "load_average": os.getloadavg()[0],
                  "raw_read": median_run(raws, "gb_per_s"), "load": median_run(loads, "gb_per_s"),
                  # the allocator's layout moves the peak from run to run (1.1-1.3x on this machine)
                  "rss_over_weights": {"min": min(r["rss_over_weights"] for r in loads),
                                       "median": statistics.median(r["rss_over_weights"] for r in loads)},
                  "runs": {"raw_read": raws, "load": loads}}
    report["load_over_raw"] = report["load"]["gb_per_s"] / report["raw_read"]["gb_per_s"]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
