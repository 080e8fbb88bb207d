"""The official release's weights held as stored, against the same weights decoded or re-quantised: quality
and speed on the bundled model.

    python benchmarks/release_weights.py [--threads 1] [--tokens 64] [--out results.json]

The bundled model is written in the release's own layout (`dsv4 convert --to fp4`: FP8 linears, FP4 experts),
then each `--weights` mode runs it: `native` (the release's bytes read as stored), `float` (decoded: the
oracle) and `w8a8` (re-quantised to int8 per channel at load), in fp32 and bf16. Quality: `dsv4 perplexity` on
held-out text (`scoring.heldout_text`) with the KL divergence against the float model in fp32
(`--save-logits` / `--kl-divergence`). Speed: the bytes of weights each mode holds, and greedy decode
tokens/s at batch 1 of the engine (eager, no drafter), each mode in turn in this process, twice, median.
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from meta import ROOT, stamp
from scoring import heldout_text

from dsv4cli.engine import Engine, EngineOptions, SamplingParams
from dsv4cli.model import load_model
from dsv4cli.tokenizer import Tokenizer

MODES = [("float", "float32"), ("native", "float32"), ("w8a8", "float32"),
         ("float", "bfloat16"), ("native", "bfloat16"), ("w8a8", "bfloat16")]


def dsv4(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "dsv4cli", *args], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    return json.loads(out.stdout)


def decode_rate(path: Path, weights: str, dtype: str, tokens: int) -> tuple[float, int]:
    """(greedy tokens/s at batch 1, bytes of weights held) of one mode."""
    model = load_model(path, dtype=getattr(torch, dtype), weights=weights)
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    engine = Engine(model, Tokenizer.from_dir(path), EngineOptions(max_batch=1, max_seq_len=512, drafts=0))
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine.generate([list(range(30, 62))], params)               # warm-up
    start = time.perf_counter()
    engine.generate([list(range(30, 62))], params)
    return tokens / (time.perf_counter() - start), held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--chars", type=int, default=40000)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        release = tmp / "release"
        subprocess.run([sys.executable, "-m", "dsv4cli", "convert", str(ROOT / "dsv4cli/assets/dsv4-tiny"),
                        str(release), "--to", "fp4"], check=True, capture_output=True, cwd=ROOT)
        text = tmp / "heldout.txt"
        text.write_text(heldout_text(a.chars))
        common = ["perplexity", str(text), "--model", str(release), "--json", "--threads", str(a.threads)]
        base = dsv4(*common, "--weights", "float", "--dtype", "float32", "--save-logits", str(tmp / "ref.logits"))
        quality = {}
        for weights, dtype in MODES:
            r = dsv4(*common, "--weights", weights, "--dtype", dtype, "--kl-divergence", str(tmp / "ref.logits"))
            quality[f"{weights} {dtype}"] = {k: r[k] for k in ("ppl", "kl_mean", "kl_median", "kl_p99", "kl_max",
                                                               "top1_agreement", "delta_ppl")}
            print(f"{weights} {dtype}: ppl {r['ppl']:.4f}, KL mean {r['kl_mean']:.2e}, top-1 "
                  f"{r['top1_agreement']:.4f}", flush=True)
        rates = {f"{w} {d}": [] for w, d in MODES}
        held = {}
        for _ in range(2):                       # modes alternate: the machine's drift hits each alike
            for weights, dtype in MODES:
                rate, held[f"{weights} {dtype}"] = decode_rate(release, weights, dtype, a.tokens)
                rates[f"{weights} {dtype}"].append(rate)
        speed = {k: {"tokens_per_s": round(statistics.median(v), 2), "weight_bytes": held[k],
                     "vs_float": round(statistics.median(v) / statistics.median(rates[f"float {k.split()[1]}"]), 3)}
                 for k, v in rates.items()}
        for k, v in speed.items():
            print(f"{k}: {v['tokens_per_s']} tok/s ({v['vs_float']}x float), {v['weight_bytes'] / 2**20:.2f} MiB")
    report = {"meta": stamp(vars(a)), "benchmark": "release_weights", "base": {k: base[k] for k in ("ppl", "tokens")},
              "quality": quality, "speed": speed}
    if a.out:
        a.out.write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
