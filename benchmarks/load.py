"""Checkpoint load throughput and peak host memory, against a plain read of the same files.

    python benchmarks/load.py [PATH] [--layout preview|0731|release] [--real-width LAYERS] [--device cpu]
        [--dtype bfloat16] [--weights auto] [--repeats 3] [--paged-steps N] [--out load.json]

Without PATH it first writes a synthetic checkpoint (random weights) to a temporary directory: W8A8 in the
preview's layout (one MTP layer, about 1 GB) or 0731's (three DSpark stages, their Markov tables and the
drafter's own embed/head copies), or (`release`) the official release's own layout, FP8 linears and FP4
experts, of the preview's model; `--real-width LAYERS` gives that model V4 Flash's widths (256 experts of
2048, vocabulary 129,280) and LAYERS layers. The raw read and the load each run `--repeats` times in fresh
processes, after one warm-up read, so both see a warm page cache and each peak RSS is its own; the median run
is reported, and every run. `rss_over_weights` is the load's peak RSS above the process's RSS before loading,
divided by the bytes of weights the model keeps; `rss_over_file` the peak RSS over the checkpoint's bytes.
Weights held as stored (`--weights native` on the CPU) are mapped, so the load reads none of them: their
pages come in as the model uses them. `--paged-steps N` then runs N decode steps of the loaded model with the
checkpoint's pages dropped from the page cache before each (posix_fadvise DONTNEED: what a machine with less
memory than the weights sees), and reports the bytes read from disk per token (/proc/self/io).
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


def write_release(path: Path, layers: str) -> dict:
    """The official release's layout (FP8 linears, FP4 experts, bf16/fp32 rest), tensor by tensor, random codes
    of ~1/sqrt(in) magnitude; with `layers` > 0, at V4 Flash's widths with that many layers."""
    import math

    import torch
    from real_width import V4_FLASH

    from dsv4cli.model import ModelConfig, Transformer
    from dsv4cli.model.model import Linear
    from dsv4cli.model.quant import RELEASE_CONFIG, ShardWriter, as_stored, e8m0, is_release_fp8, write_config

    config = SYNTHETIC
    if int(layers):
        n = int(layers)
        config = {**V4_FLASH, "num_hidden_layers": n, "compress_ratios": ([4, 128] * n)[:n] + [0]}
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_dict(config))
    modules = dict(model.named_modules())
    writer = ShardWriter(path, "model", max_shard_bytes=1 << 30)
    g = torch.Generator().manual_seed(0)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        prefix, _, attr = name.rpartition(".")
        module = modules[prefix]
        if name.endswith("tid2eid"):
            writer.add(name, torch.randint(0, config["n_routed_experts"], t.shape, generator=g))
        elif attr == "weight" and isinstance(module, Linear) and is_release_fp8(prefix) and ".experts." in prefix:
            rows, cols = t.shape           # E2M1 codes uniform: std ~2.2
            writer.add(name, torch.randint(-128, 128, (rows, cols // 2), generator=g, dtype=torch.int8))
            writer.add(f"{prefix}.scale", e8m0(torch.full((rows, cols // 32), round(-math.log2(2.2 * cols ** .5)))))
        elif attr == "weight" and isinstance(module, Linear) and is_release_fp8(prefix):
            rows, cols = t.shape
            writer.add(name, (torch.randn(t.shape, generator=g) * 64).to(torch.float8_e4m3fn))
            grid = (-(-rows // 128), -(-cols // 128))
            writer.add(f"{prefix}.scale", e8m0(torch.full(grid, round(-math.log2(64 * cols ** .5)))))
        else:
            writer.add(name, as_stored(name, torch.randn(t.shape, generator=g) * 0.02))
    writer.close()
    write_config(path, {**config, **RELEASE_CONFIG})
    return {"bytes": sum(f.stat().st_size for f in files_of(path))}


def drop_pages(path: Path, model=None) -> None:
    """Drop the checkpoint's pages from the page cache, after unmapping those `model`'s mapped weights hold
    (madvise DONTNEED: the mapping stays, its next read faults the page in from the file again)."""
    import ctypes
    import mmap

    import torch

    libc = ctypes.CDLL(None, use_errno=True)
    for t in model.parameters() if model is not None else ():
        if t.dtype in (torch.float8_e4m3fn, torch.float4_e2m1fn_x2):
            first = t.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
            libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(t.data_ptr() + t.nbytes - first),
                         mmap.MADV_DONTNEED)
    for f in files_of(path):
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def disk_reads() -> int:
    """Bytes this process has read from storage (not the page cache)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def paged_steps(model, path: Path, steps: int) -> dict:
    """`steps` decode steps (the engine's fused step, batch 1), the checkpoint's pages dropped before each: disk
    reads and seconds per token."""
    import torch
    from real_width import decode_step

    from dsv4cli.engine import Engine, EngineOptions

    engine = Engine(model, None, EngineOptions(max_batch=1, max_seq_len=256, drafts=0, graphs=False))
    state, step, _, _ = decode_step(engine, 1, 0, 256)
    reads, times = [], []
    with torch.no_grad():
        for i in range(steps):
            state.pos.fill_(32 + i)
            drop_pages(path, model)
            before, start = disk_reads(), time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
            reads.append(disk_reads() - before)
    return {"tokens": steps, "disk_read_bytes_per_token": statistics.median(reads),
            "seconds_per_token": statistics.median(times)}


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


def load(path: Path, device: str, dtype: str, threads: str, weights: str = "auto", steps: str = "0") -> dict:
    import torch

    from dsv4cli.kernels import module_for
    from dsv4cli.model import load_model

    if int(threads):
        torch.set_num_threads(int(threads))
    module_for(torch.device(device))    # the kernels' code (a native extension on the CPU) is no part of the load
    before = peak_rss()
    start = time.perf_counter()
    model = load_model(path, device, getattr(torch, dtype), progress=False, weights=weights)
    seconds = time.perf_counter() - start
    kept = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    on_disk = sum(f.stat().st_size for f in files_of(path))
    out = {"bytes": on_disk, "seconds": seconds, "gb_per_s": on_disk / seconds / 1e9, "weights_kept": kept,
           "weights_mapped": getattr(model, "mapped_bytes", 0), "rss_before": before, "peak_rss": peak_rss(),
           "rss_over_weights": (peak_rss() - before) / kept, "rss_over_file": peak_rss() / on_disk}
    if int(steps):
        out["paged"] = paged_steps(model, path, int(steps))
    return out


def median_run(runs: list[dict], key: str) -> dict:
    """The run whose `key` is the median (the lower one of an even count)."""
    return sorted(runs, key=lambda r: r[key])[(len(runs) - 1) // 2]


def child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", type=Path, help="checkpoint directory (default: a synthetic one)")
    parser.add_argument("--layout", default="preview", choices=["preview", "0731", "release"],
                        help="the synthetic checkpoint's layout (without PATH)")
    parser.add_argument("--real-width", type=int, default=0, metavar="LAYERS",
                        help="with --layout release: V4 Flash's widths, this many layers")
    parser.add_argument("--weights", default="auto", help="how the load holds quantised weights (--weights)")
    parser.add_argument("--paged-steps", type=int, default=0,
                        help="decode steps after the load with the checkpoint's pages dropped before each")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=0, help="torch threads for the load (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=3, help="raw reads and loads, each in a fresh process")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, path, *rest = args.child
        run = {"write": write_synthetic, "release": write_release, "raw": raw_read, "load": load}[mode]
        print(json.dumps(run(Path(path), *rest)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = args.path
        if path is None:
            path = Path(tmp)
            child(*(("release", tmp, str(args.real_width)) if args.layout == "release"
                    else ("write", tmp, args.layout)))
        child("raw", str(path))                                     # warm the page cache
        raws, loads = [], []
        for _ in range(args.repeats):      # alternating, each in a fresh process: the machine's drift hits both
            raws.append(child("raw", str(path)))
            loads.append(child("load", str(path), args.device, args.dtype, str(args.threads), args.weights,
                               str(args.paged_steps)))
        report = {"meta": stamp(vars(args)),
                  "path": str(args.path or f"synthetic {'release' if args.layout == 'release' else 'W8A8'}, "
                                            f"{args.layout} layout" + (f", real width, {args.real_width} layers"
                                                                       if args.real_width else "")),
                  "device": args.device, "weights": args.weights,
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
