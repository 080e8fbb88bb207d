"""Give the bundled model DSpark: train a 0731-layout block drafter for dsv4-tiny's frozen trunk by
self-distillation, and write the model in the 0731 W8A8 layout.

Usage: python scripts/train_dspark.py [--trunk dsv4cli/assets/dsv4-tiny-mtp] [--out dsv4cli/assets/dsv4-tiny]
           [--steps 2000] [--minutes 120] [--threads 2]

The trunk is the preview-layout dsv4-tiny (scripts/train_tiny.py), loaded as `load_model` runs it (W8A8), and
stays frozen: it gives every training row its target features (the mean hc streams of its last three
layers' outputs, as 0731 taps layers 40-42 of 43) and its next-token distributions, the teacher. For anchors
drawn along each row, the drafter sees the ring of the last `window` positions' features and the block
[anchor, noise x 4]; slot k learns the teacher's distribution at position anchor + k (KL), its Markov bias
taking the row's token before it, and the confidence head learns whether its draft is the teacher's argmax
given that the drafts before it were (BCE). The block runs through the model's own code (`dspark_write`,
`dspark_block`), so it trains exactly what the engine runs. Evaluation: greedy replies to the held-out
questions through the engine with the whole block verified, and their mean acceptance length.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: make `scripts.*` importable

from dsv4cli.engine import Engine, EngineOptions, SamplingParams  # noqa: E402
from dsv4cli.model import DecodeState, ModelConfig, Segment, Transformer, load_model  # noqa: E402
from dsv4cli.model.checkpoint import init_weights  # noqa: E402
from dsv4cli.model.quant import dequantized, save_w8a8  # noqa: E402
from dsv4cli.tokenizer import Tokenizer  # noqa: E402
from scripts.corpus import build_corpus, heldout_set  # noqa: E402
from scripts.train_tiny import SEQ_LEN, batches, prompt_ids  # noqa: E402

SEED = 0
BATCH, ANCHORS = 8, 16          # rows per step, anchors per row
LR, WARMUP = 2e-3, 30
CONFIDENCE_WEIGHT = 0.2
BLOCK, MARKOV_RANK = 5, 32


def dspark_config(trunk: dict, noise_id: int) -> dict:
    """The trunk's config.json as 0731 writes it: three stages past the trunk in compress_ratios (window-only),
    num_nextn_predict_layers left at its legacy 1, the DSpark fields; the stages tap the last three layers."""
    n = trunk["num_hidden_layers"]
    return {**trunk, "compress_ratios": trunk["compress_ratios"][:n] + [0, 0, 0], "num_nextn_predict_layers": 1,
            "dspark_block_size": BLOCK, "dspark_noise_token_id": noise_id,
            "dspark_target_layer_ids": [n - 3, n - 2, n - 1], "dspark_markov_rank": MARKOV_RANK}


def student_from(trunk: Transformer, cfg: dict) -> Transformer:
    """A float 0731-layout model: the trunk's weights (dequantised: re-quantising gives its int8 codes back),
    the drafter at random."""
    torch.manual_seed(SEED)
    model = Transformer(ModelConfig.from_dict(cfg))
    init_weights(model, seed=SEED, std=0.02)
    state = dequantized(trunk.state_dict())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("mtp."):
                p.copy_(state[name])
        for name, b in model.named_buffers():
            b.copy_(state[name])
    return model


def losses(trunk: Transformer, student: Transformer, rows: torch.Tensor, pad_id: int, g: torch.Generator):
    """(KL of the slots' Markov-biased distributions to the teacher's, the confidence heads' BCE) for a batch."""
    B, S = rows.shape
    with torch.no_grad():       # the preview-layout trunk taps nothing itself: its target layers' outputs by hooks
        taps = {}
        hooks = [trunk.layers[i].register_forward_hook(lambda m, a, out, i=i: taps.__setitem__(i, out.mean(2)))
                 for i in student.cfg.dspark_target_layer_ids]
        state = DecodeState(trunk, B, S, max_draft=0)
        (out,) = trunk.forward_segments([Segment(rows, torch.zeros(B, dtype=torch.long), state)])
        for h in hooks:
            h.remove()
        features = torch.cat([taps[i] for i in student.cfg.dspark_target_layer_ids], -1)
        teacher = trunk.logits(out.hidden).log_softmax(-1)                      # [B,S,V]: position p -> p+1
    real = (rows != pad_id).sum(1)                                               # rows are packed from the left
    n = (torch.rand(B, ANCHORS, generator=g) * (real[:, None] - BLOCK - 2).clamp(min=1)).long() + 1   # anchors
    b = torch.arange(B)[:, None].expand(-1, ANCHORS).flatten()
    n = n.flatten()
    N = len(n)
    main_x = student.dspark_context(features)[b]                                 # [N,S,D]
    drafter = DecodeState(student, N, S, max_draft=BLOCK + 1)
    student.dspark_write(main_x, Segment(rows[b], torch.zeros(N, dtype=torch.long), drafter, length=n))
    logits, hidden = student.dspark_block(rows[b, n], n, drafter)
    markov = student.mtp[-1].markov_head
    positions = n[:, None] + torch.arange(BLOCK)                                 # slot k: the token after n+k
    target = teacher[b[:, None], positions]                                      # [N,BLOCK,V]
    embeddings, biased = [], []
    for k in range(BLOCK):          # teacher forcing: the token before slot k's draft is the row's
        e, bias = markov(rows[b, n + k])
        embeddings.append(e)
        biased.append(logits[:, k] + bias)
    biased = torch.stack(biased, 1)
    valid = (positions + 1 < real[b, None]).float()                              # targets inside the document
    kl = (F.kl_div(biased.log_softmax(-1), target, log_target=True, reduction="none").sum(-1) * valid).sum() \
        / valid.sum()
    confidence = student.mtp[-1].confidence_head(hidden, torch.stack(embeddings, 1))
    match = (biased.argmax(-1) == target.argmax(-1)).float()
    reached = torch.cat([torch.ones(N, 1), match[:, :-1].cumprod(1)], 1) * valid  # drafts before it accepted
    bce = (F.binary_cross_entropy_with_logits(confidence, match, reduction="none") * reached).sum() / reached.sum()
    return kl, bce


@torch.no_grad()
def acceptance(model: Transformer, tok: Tokenizer, items: list[dict]) -> dict:
    """Greedy replies to the questions through the engine, every draft of the block verified."""
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = Engine(model, tok, EngineOptions(max_batch=8, max_seq_len=512, drafts=0)).generate(
        [prompt_ids(tok, it["question"]) for it in items], params)
    engine = Engine(model, tok, EngineOptions(max_batch=8, max_seq_len=512, drafts=BLOCK))
    got = engine.generate([prompt_ids(tok, it["question"]) for it in items], params)
    assert [s.output_ids for s in got] == [s.output_ids for s in plain]      # the drafter never changes a token
    m = engine.totals
    return {"mean_acceptance_length": round(m.mean_acceptance_length, 3),
            "per_position": [round(p, 3) for p in m.per_position], "steps_with_drafts": m.drafts}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trunk", default=str(ROOT / "dsv4cli" / "assets" / "dsv4-tiny-mtp"))
    ap.add_argument("--out", default=str(ROOT / "dsv4cli" / "assets" / "dsv4-tiny"))
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--minutes", type=float, default=120.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-items", type=int, default=70)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    t_start = time.time()

    def log(msg):
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    trunk_dir = Path(args.trunk)
    tok = Tokenizer.from_dir(trunk_dir)
    trunk = load_model(trunk_dir, "cpu", torch.float32)
    cfg = dspark_config(json.loads((trunk_dir / "config.json").read_text()), tok.special_ids["<｜System｜>"])
    student = student_from(trunk, cfg)
    params = [p for n, p in student.named_parameters() if n.startswith("mtp.")]
    for n, p in student.named_parameters():
        p.requires_grad_(n.startswith("mtp."))
    log(f"drafter: {sum(p.numel() for p in params) / 1e6:.2f} M parameters; trunk {trunk_dir} frozen")
    corpus = build_corpus(SEED, n_chat=40000, n_text=4000)
    pad_id = tok.special_ids["<｜▁pad▁｜>"]
    data = batches([tok.encode(d) for d in corpus], pad_id)
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(SEED)
    items = heldout_set(SEED + 1, args.eval_items)
    student.train()
    hist, t0 = [], time.time()
    for step in range(args.steps):
        if time.time() - t0 > args.minutes * 60:
            log(f"time budget of {args.minutes} min reached at step {step}/{args.steps}")
            break
        for group in opt.param_groups:
            group["lr"] = LR * min(1.0, (step + 1) / WARMUP) * (0.1 + 0.9 * (1 - step / args.steps))
        kl, bce = losses(trunk, student, next(data)[:BATCH, :SEQ_LEN], pad_id, g)
        (kl + CONFIDENCE_WEIGHT * bce).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        hist.append((kl.item(), bce.item()))
        if step % 20 == 0:
            recent = hist[-20:]
            log(f"step {step:4d}  kl {sum(h[0] for h in recent) / len(recent):.4f}  "
                f"bce {sum(h[1] for h in recent) / len(recent):.4f}  {(time.time() - t0) / (step + 1):.2f} s/step")
    student.eval().prepare()
    float_eval = acceptance(student, tok, items)
    log(f"float: {float_eval}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
        stale.unlink()
    extra = {name: (trunk_dir / name).read_text(encoding="utf-8")
             for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json")}
    save_w8a8(student, cfg, out, extra_files=extra)
    loaded = load_model(out, "cpu", torch.float32)
    w8a8_eval = acceptance(loaded, Tokenizer.from_dir(out), items)
    log(f"w8a8: {w8a8_eval}")
    tail = hist[-50:]
    report = {"seed": SEED, "trunk": "dsv4-tiny-mtp (frozen)", "steps": len(hist), "batch": BATCH,
              "anchors_per_row": ANCHORS, "lr": LR, "block": BLOCK, "markov_rank": MARKOV_RANK,
              "train_seconds": round(time.time() - t0, 1), "threads": args.threads,
              "final_kl": round(sum(h[0] for h in tail) / len(tail), 4),
              "final_bce": round(sum(h[1] for h in tail) / len(tail), 4),
              "heldout_seed": SEED + 1, "heldout_items": len(items), "float": float_eval, "w8a8": w8a8_eval}
    # the trunk's report (its training and held-out numbers are this model's too), the drafter's under "dspark"
    trunk_report = json.loads((trunk_dir / "training.json").read_text())
    (out / "training.json").write_text(json.dumps({**trunk_report, "dspark": report}, indent=2) + "\n")
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
