"""Scoring on the bundled model, in one run: what prompt logprobs cost against a plain prefill, and what W8A8
costs in quality against its float twin.

    python benchmarks/scoring.py [--repeats 5] [--tokens 2000] [--out results/scoring-cpu-1thread.json]

- speed: one engine (W8A8 as shipped, fp32 compute, compile off, one thread, the default prefill budget), a
  ~2,000-token prompt run alone, taking turns: prefilled for its first token (no scoring), scored whole
  (`prompt_logprobs` 0, `max_tokens` 0: what `dsv4 perplexity` and lm-evaluation-harness ask), and scored with
  the 20 most likely ids per token (what `--save-logits` keeps). min / median seconds and the ratio of medians.
  Target: scored <= 1.3x the prefill.
- quality: `dsv4 perplexity` on a held-out text (stories and prose the model was not trained on) with the
  bundled W8A8 model against its float twin, a float checkpoint of the same weights dequantised (the bundled
  model's float weights before quantisation were not kept, so this measures what int8 activations cost, not
  the weights' rounding): the twin's logits saved, then W8A8's KL divergence, top-1 agreement and Δppl; and
  the twin against itself (0 by construction: the instrument's floor).
"""
import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from meta import stamp
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsv4cli.config import BUNDLED_MODEL_DIR  # noqa: E402
from dsv4cli.engine import Engine, EngineOptions, SamplingParams  # noqa: E402
from dsv4cli.model import load_model  # noqa: E402
from dsv4cli.tokenizer import Tokenizer  # noqa: E402
from scripts.corpus import BOS, EOS, build_corpus  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DSV4_COMPILE": "off"}


def heldout_text(chars: int) -> str:
    """Stories and prose from a corpus seed the bundled model was not trained on."""
    docs = build_corpus(seed=4242, n_chat=0, n_text=400)
    text = ""
    for doc in docs:
        text += doc.removeprefix(BOS).removesuffix(EOS) + "\n\n"
        if len(text) >= chars:
            return text
    return text


def speed(tokens: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    engine = Engine(load_model(BUNDLED_MODEL_DIR, "cpu", torch.float32), tok,
                    EngineOptions(max_batch=1, max_seq_len=4096, drafts=0))
    text = heldout_text(tokens * 8)
    prompt = [tok.bos_id, *tok.encode(text)][:tokens]
    cases = {"prefill": SamplingParams(temperature=0, max_tokens=1),
             "scored": SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=0),
             "scored_top20": SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=20)}
    engine.generate([prompt[:300]], cases["scored"])           # warm-up
    times = {name: [] for name in cases}
    for _ in range(repeats):
        for name, params in cases.items():
            t0 = time.perf_counter()
            engine.generate([prompt], dataclasses.replace(params))
            times[name].append(time.perf_counter() - t0)
    out = {name: {"min_s": round(min(t), 4), "median_s": round(statistics.median(t), 4)} for name, t in times.items()}
    base = statistics.median(times["prefill"])
    for name in ("scored", "scored_top20"):
        out[name]["ratio_to_prefill"] = round(statistics.median(times[name]) / base, 3)
    out["prompt_tokens"] = len(prompt)
    return out


def float_twin(path: Path) -> None:
    """The bundled checkpoint with its W8A8 linears dequantised (int8 x per-channel scale) into fp32, in the
    official float layout."""
    src = BUNDLED_MODEL_DIR
    labels = json.loads((src / "quant_model_description.json").read_text())
    weights = load_file(src / "quant_model_weights.safetensors")
    out = {}
    for name, t in weights.items():
        if name.endswith((".weight_scale", ".weight_offset")):
            continue
        if labels.get(name) == "W8A8_DYNAMIC":
            t = t.float() * weights[name.removesuffix(".weight") + ".weight_scale"].float()
        out[name] = t.contiguous()
    path.mkdir(parents=True)
    save_file(out, path / "model.safetensors")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, path / name)


def perplexity(model: Path | None, text: Path, *args: str) -> dict:
    cmd = [sys.executable, "-m", "dsv4cli", "perplexity", str(text), "--dtype", "float32", "--ctx", "512", "--json",
           *(["--model", str(model)] if model else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, check=False)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)}: {r.stderr}")
    return json.loads(r.stdout)


def quality(chars: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        text = tmp / "heldout.txt"
        text.write_text(heldout_text(chars))
        twin, saved = tmp / "twin", tmp / "twin.logits"
        float_twin(twin)
        ref = perplexity(twin, text, "--save-logits", str(saved))
        same = perplexity(twin, text, "--kl-divergence", str(saved))
        w8a8 = perplexity(None, text, "--kl-divergence", str(saved))
    keys = ("ppl", "ppl_stderr", "tokens", "windows", "kl_mean", "kl_median", "kl_p90", "kl_p99", "kl_max",
            "top1_agreement", "delta_ppl", "base_rest_mass", "seconds")
    return {"float_twin": {k: ref[k] for k in keys if k in ref}, "float_twin_vs_itself": {k: same[k] for k in keys},
            "w8a8_vs_float_twin": {k: w8a8[k] for k in keys}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--chars", type=int, default=40000, help="held-out text for the quality runs")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/scoring-cpu-1thread.json"))
    a = ap.parse_args()
    result = {"meta": stamp(vars(a)), "speed": speed(a.tokens, a.repeats), "quality": quality(a.chars)}
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
