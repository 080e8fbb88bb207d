"""Train the bundled preview-layout model, dsv4-tiny-mtp: a small DeepSeek V4 with an MTP layer, from scratch on CPU
(scripts/train_dspark.py then gives its trunk the DSpark drafter of the default dsv4-tiny).

Usage: python scripts/train_tiny.py [--out dsv4cli/assets/dsv4-tiny-mtp] [--steps 1200] [--minutes 120] [--threads 2]

Builds the synthetic corpus (scripts/corpus.py), trains a byte-level BPE tokenizer with the DSV4
special tokens, trains the model (trunk next-token loss + MTP next-next-token loss) on packed
documents, evaluates greedy accuracy on the held-out questions and MTP K=1 acceptance, exports the
msModelSlim W8A8 layout and re-evaluates the exported model as `load_model` reads it. Every random
choice is seeded and kernels are deterministic, so with the same thread count a rerun reproduces the
weights bit for bit; the step count fixes the run (`--minutes` only caps it on a slow machine).
About 40 minutes on 2 CPU cores.
"""
import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: make `scripts.*` importable

from dsv4cli.encoding import encode_messages, parse_completion  # noqa: E402
from dsv4cli.model import DecodeState, ModelConfig, Segment, Transformer, load_model  # noqa: E402
from dsv4cli.model.checkpoint import init_weights  # noqa: E402
from dsv4cli.model.model import Gate  # noqa: E402
from dsv4cli.model.quant import save_w8a8  # noqa: E402
from dsv4cli.tokenizer import Tokenizer  # noqa: E402
from scripts.corpus import build_corpus, heldout_set, is_story, story_requests  # noqa: E402
from scripts.train_tokenizer import train_tokenizer  # noqa: E402

SEED = 0
VOCAB_TARGET = 1536        # BPE stops earlier when the corpus has no more merges to learn
SEQ_LEN = 256              # tokens per training row (plus 2 for the next and next-next targets)
BATCH = 8
LR, MIN_LR_FRAC, WARMUP, WEIGHT_DECAY = 3e-3, 0.1, 30, 0.1
MTP_WEIGHT = 0.5
BIAS_UPDATE = 2e-3         # aux-loss-free balancing: step of the routing bias toward equal expert load
PAD = -100                 # ignore_index for padded target positions
LOG_EVERY = 10
PROBE_EVERY = 150
STORY_TOKENS = 128         # greedy budget for a story reply (corpus stories are at most about 70 tokens)


def model_config(vocab_size: int) -> dict:
    """config.json: every V4 attention kind (window-only, CSA ratio 4 with indexer, HCA ratio 128),
    hash MoE in layer 0, biased MoE elsewhere, mHC, a shared expert and one MTP layer."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": vocab_size, "hidden_size": 128, "num_hidden_layers": 6, "num_nextn_predict_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 16,
        "q_lora_rank": 96, "o_lora_rank": 64, "o_groups": 2,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 160,
        "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "num_hash_layers": 1, "swiglu_limit": 10.0, "hidden_act": "silu",
        # window 64 < a multi-turn chat, so the compressed paths carry the older context
        "sliding_window": 64, "compress_ratios": [0, 4, 128, 4, 128, 0, 0],
        "index_n_heads": 4, "index_head_dim": 32, "index_topk": 8,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 1024,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
    }


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------

def pack_rows(docs: list[list[int]], length: int, pad_id: int, seed: int) -> torch.Tensor:
    """Whole documents packed greedily, in a seeded order, into rows of `length` tokens; the tail of
    each row is `pad_id`. Documents are never split, so every answer is seen with its question."""
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    rows, row = [], []
    for i in order:
        if len(row) + len(docs[i]) > length:
            rows.append(row + [pad_id] * (length - len(row)))
            row = []
        row += docs[i][:length]
    rows.append(row + [pad_id] * (length - len(row)))
    return torch.tensor(rows)


def batches(docs, pad_id: int):
    """Endless deterministic batches [BATCH, SEQ_LEN + 2]; each epoch repacks in a new order."""
    epoch = 0
    while True:
        rows = pack_rows(docs, SEQ_LEN + 2, pad_id, SEED + epoch)
        for i in range(0, len(rows) - BATCH + 1, BATCH):
            yield rows[i:i + BATCH]
        epoch += 1


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------

def losses(model: Transformer, rows: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(trunk CE on t_{p+1}, MTP CE on t_{p+2}) for rows [B, S+2], padding masked out.

    The cached path with a fresh state at position 0 is the plain causal forward; its in-place
    state writes happen on fresh buffers, so autograd sees an ordinary graph."""
    B, S = rows.shape[0], rows.shape[1] - 2
    targets = rows.masked_fill(rows == pad_id, PAD)
    state = DecodeState(model, B, S, max_draft=0)
    start = torch.zeros(B, dtype=torch.long)
    ((hidden, _),) = model.forward_segments([Segment(rows[:, :S], start, state)])
    (mtp_hidden,) = model.mtp_forward_segments([hidden], [Segment(rows[:, 1:S + 1], start, state)])
    logits, mtp_logits = model.logits(hidden), model.mtp_logits(mtp_hidden)
    main = F.cross_entropy(logits.flatten(0, 1), targets[:, 1:S + 1].flatten(), ignore_index=PAD)
    mtp = F.cross_entropy(mtp_logits.flatten(0, 1), targets[:, 2:].flatten(), ignore_index=PAD)
    return main, mtp


def build_model(cfg: dict) -> Transformer:
    torch.manual_seed(SEED)
    model = Transformer(ModelConfig.from_dict(cfg))
    init_weights(model, seed=SEED, std=0.02)
    with torch.no_grad():  # init_weights sizes embed/head for random-model tests; train from small logits
        model.embed.weight.normal_(0, 1.0)
        model.head.weight.normal_(0, cfg["hidden_size"] ** -0.5 * 0.5)
    return model


def lr_at(step: int, steps: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    t = (step - WARMUP) / max(1, steps - WARMUP)
    return LR * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * t)))


def train(model: Transformer, docs, pad_id: int, steps: int, minutes: float, log, probe=None) -> dict:
    """AdamW with warmup + cosine for `steps` steps; `probe(model)` (a one-line held-out check) is
    logged every PROBE_EVERY steps."""
    gates = [m for m in model.modules() if isinstance(m, Gate) and not m.hash]
    biases = {id(g.bias) for g in gates}
    params = [p for p in model.parameters() if id(p) not in biases]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95))
    # Routed-expert loads per step, read from the gates' chosen experts.
    loads = {g: torch.zeros(g.cfg.n_routed_experts) for g in gates}

    def count(gate, args, out):
        if torch.is_grad_enabled():  # training forwards only, not the probes
            loads[gate] += torch.bincount(out[1].flatten(), minlength=gate.cfg.n_routed_experts)

    hooks = [g.register_forward_hook(count) for g in gates]

    model.train()
    t0, hist = time.time(), []
    data = batches(docs, pad_id)
    for step in range(steps):
        if time.time() - t0 > minutes * 60:
            log(f"time budget of {minutes} min reached at step {step}/{steps}")
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps)
        main, mtp = losses(model, next(data), pad_id)
        (main + MTP_WEIGHT * mtp).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():  # DeepSeek's aux-loss-free balancing: raise underloaded experts' bias
            for g in gates:
                g.bias.add_(BIAS_UPDATE * torch.sign(loads[g].mean() - loads[g]))
                loads[g].zero_()
        hist.append((main.item(), mtp.item()))
        if step % LOG_EVERY == 0 or step == steps - 1:
            recent = hist[-LOG_EVERY:]
            el = time.time() - t0
            log(f"step {step:5d}  loss {sum(h[0] for h in recent) / len(recent):.4f}  "
                f"mtp {sum(h[1] for h in recent) / len(recent):.4f}  lr {lr_at(step, steps):.2e}  "
                f"{el / (step + 1):.2f} s/step  {el / 60:.1f} min")
        if probe and (step + 1) % PROBE_EVERY == 0:
            log(f"step {step + 1:5d}  held-out: {probe(model)}")
    for h in hooks:
        h.remove()
    model.eval()
    tail = hist[-50:]
    return {"steps": len(hist), "train_seconds": round(time.time() - t0, 1),
            "final_loss": round(sum(h[0] for h in tail) / len(tail), 4),
            "final_mtp_loss": round(sum(h[1] for h in tail) / len(tail), 4)}


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------

def prompt_ids(tok: Tokenizer, question: str) -> list[int]:
    return tok.encode(encode_messages([{"role": "user", "content": question}]))


@torch.no_grad()
def greedy(model: Transformer, ids: list[int], eos_id: int, max_new: int = 40) -> list[int]:
    """Greedy continuation with the plain full forward, up to and including EOS."""
    out = []
    for _ in range(max_new):
        nxt = int(model(torch.tensor([ids + out]))[0, -1].argmax())
        out.append(nxt)
        if nxt == eos_id:
            break
    return out


@torch.no_grad()
def mtp_matches(model: Transformer, ids: list[int], n_prompt: int) -> tuple[int, int]:
    """MTP K=1 drafts equal to the main model's greedy token, teacher-forced on the greedy sequence.

    Row p sees the trunk at p and t_{p+1} and drafts t_{p+2}; drafts exist once the first token has
    been generated, i.e. for targets at n_prompt+1 onward."""
    x = torch.tensor([ids])
    _, hidden = model(x, return_hidden=True)
    draft = model.mtp_forward(hidden[:, :-1], x[:, 1:])[0].argmax(-1)    # row p -> t_{p+2}
    rows = range(n_prompt - 1, len(ids) - 2)
    return sum(int(draft[p]) == ids[p + 2] for p in rows), len(rows)


def evaluate(model: Transformer, tok: Tokenizer, items: list[dict]) -> dict:
    per_kind, hit, total, samples = {}, 0, 0, []
    for it in items:
        ids = prompt_ids(tok, it["question"])
        gen = greedy(model, ids, tok.eos_id)
        reply = parse_completion(tok.decode(gen), thinking=False)["content"].strip()
        ok = reply == it["answer"]
        k = per_kind.setdefault(it["kind"], [0, 0])
        k[0] += ok
        k[1] += 1
        m, n = mtp_matches(model, ids + gen, len(ids))
        hit, total = hit + m, total + n
        if len(samples) < 8:
            samples.append({"question": it["question"], "reply": reply, "correct": ok})
    correct = sum(k[0] for k in per_kind.values())
    return {"accuracy": round(correct / len(items), 4),
            "accuracy_by_kind": {k: round(v[0] / v[1], 4) for k, v in per_kind.items()},
            "mtp_acceptance": round(hit / max(total, 1), 4), "mtp_drafts": total, "samples": samples}


def evaluate_stories(model: Transformer, tok: Tokenizer, requests: list[str]) -> dict:
    """Share of the held-out story requests answered greedily with a story (`is_story`)."""
    samples = []
    for request in requests:
        gen = greedy(model, prompt_ids(tok, request), tok.eos_id, max_new=STORY_TOKENS)
        reply = parse_completion(tok.decode(gen), thinking=False)["content"].strip()
        samples.append({"request": request, "reply": reply, "story": is_story(reply)})
    stories = sum(s["story"] for s in samples)
    return {"story_rate": round(stories / len(samples), 4), "story_requests": len(samples), "samples": samples}


@torch.no_grad()
def sample_text(model: Transformer, tok: Tokenizer, text: str, n: int = 48) -> str:
    ids = tok.encode(text)
    return text + tok.decode(greedy(model, ids, tok.eos_id, n))


# --------------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "dsv4cli" / "assets" / "dsv4-tiny-mtp"))
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--minutes", type=float, default=120.0,
                    help="stop training early after this long (the shipped model ran all its steps: 38 minutes here)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-items", type=int, default=70)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)   # two threads otherwise vary the last bits between runs
    torch.manual_seed(SEED)
    t_start = time.time()

    def log(msg):
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    corpus = build_corpus(SEED, n_chat=40000, n_text=4000)
    with tempfile.TemporaryDirectory() as tmp:
        train_tokenizer(corpus, tmp, vocab_size=VOCAB_TARGET)
        tok = Tokenizer.from_dir(tmp)
        tok_files = {name: (Path(tmp) / name).read_text(encoding="utf-8")
                     for name in ("tokenizer.json", "tokenizer_config.json")}
    docs = [tok.encode(d) for d in corpus]
    pad_id = tok.special_ids["<｜▁pad▁｜>"]
    vocab = -(-tok.vocab_size // 64) * 64
    log(f"corpus: {len(docs)} documents, {sum(map(len, docs))} tokens, tokenizer vocab {tok.vocab_size}")

    cfg = model_config(vocab)
    model = build_model(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f} M parameters")
    items = heldout_set(SEED + 1, args.eval_items)

    def probe(m):
        r = evaluate(m, tok, items[:21])
        return f"accuracy {r['accuracy']} {r['accuracy_by_kind']}  mtp acceptance {r['mtp_acceptance']}"

    stats = train(model, docs, pad_id, args.steps, args.minutes, log, probe)
    log(f"trained {stats['steps']} steps in {stats['train_seconds']} s: loss {stats['final_loss']}, "
        f"mtp {stats['final_mtp_loss']}")

    fp = evaluate(model, tok, items)
    fp_stories = evaluate_stories(model, tok, story_requests("heldout"))
    log(f"float: accuracy {fp['accuracy']} {fp['accuracy_by_kind']}, mtp acceptance {fp['mtp_acceptance']}, "
        f"story rate {fp_stories['story_rate']}")
    log("sample: " + sample_text(model, tok, tok.decode([tok.bos_id]) + "Once upon a time"))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
        stale.unlink()
    generation = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "do_sample": False}
    save_w8a8(model, cfg, out, extra_files={**tok_files, "generation_config.json": json.dumps(generation, indent=2)})

    loaded = load_model(out, "cpu", torch.float32)
    loaded_tok = Tokenizer.from_dir(out)
    q = evaluate(loaded, loaded_tok, items)
    q_stories = evaluate_stories(loaded, loaded_tok, story_requests("heldout"))
    log(f"w8a8: accuracy {q['accuracy']} {q['accuracy_by_kind']}, mtp acceptance {q['mtp_acceptance']}, "
        f"story rate {q_stories['story_rate']}")

    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    report = {"seed": SEED, "parameters": n_params, "tokens_seen": stats["steps"] * BATCH * SEQ_LEN,
              "batch": BATCH, "seq_len": SEQ_LEN, "lr": LR, "mtp_weight": MTP_WEIGHT, **stats,
              "wall_seconds": round(time.time() - t_start, 1), "threads": args.threads,
              "heldout_seed": SEED + 1, "heldout_items": len(items), "float": fp, "w8a8": q,
              "stories": {"float": fp_stories, "w8a8": q_stories}, "bytes_on_disk": size}
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {out} ({size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
