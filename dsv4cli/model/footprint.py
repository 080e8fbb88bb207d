"""What a model holds: parameters (all, and those one token uses) and the bytes a card keeps under
tensor parallelism, from config.json and the safetensors headers alone (no tensor data is read)."""
import re

import torch

from .config import ModelConfig
from .loader import Checkpoint, keep_fp32, open_checkpoint
from .model import Transformer

# What model.py splits across tensor-parallel ranks (heads, output groups, experts, vocabulary rows: the
# trunk's embed and head, the drafter's copies of them and DSpark's Markov tables); everything else is
# replicated on every card.
TP_SPLIT = re.compile(r"(^|\.)(embed|head|markov_w1|markov_w2)\.|\.(wq_b|wo_a|wo_b|weights_proj)\.|attn_sink"
                      r"|\.experts\.")


def tp_problem(cfg: ModelConfig, tp: int) -> str | None:
    """Why `tp` ranks can't split this model (a count it does not divide), or None."""
    for what, n in (("attention heads", cfg.n_heads), ("output groups", cfg.o_groups),
                    ("indexer heads", cfg.index_n_heads), ("routed experts", cfg.n_routed_experts),
                    ("vocabulary rows", cfg.vocab_size)):
        if n % tp:
            return f"does not divide the {n} {what}"
    return None


def count_parameters(model: Transformer) -> tuple[int, int]:
    """(all parameters, those one token uses): every routed expert but the top-k is idle per token. A loaded
    W8A8 model's per-row weight scales are not counted, so it counts as its checkpoint's config does."""
    cfg = model.cfg
    total = sum(p.numel() for name, p in model.named_parameters() if not name.endswith("weight_scale"))
    idle = (cfg.n_layers + cfg.n_mtp_layers) * (cfg.n_routed_experts - cfg.n_activated_experts)
    return total, total - idle * 3 * cfg.dim * cfg.moe_inter_dim


def weight_bytes_per_card(ckpt: Checkpoint, model: Transformer, tp: int, float_bytes: int) -> int:
    """The bytes of weights a card holds as `load_model` keeps them (int8 + fp32 scale, fp32, or
    `float_bytes`-byte floats: 2 for bf16, 4 for float32), the split tensors' share of them."""
    def loaded_bytes(name, t):
        if ckpt.format == "w8a8" and ckpt.label(name) == "W8A8_DYNAMIC":
            return t.numel() + 4 * t.shape[0]
        return t.numel() * (4 if keep_fp32(name) or not t.is_floating_point() else float_bytes)

    return sum(loaded_bytes(n, t) // (tp if TP_SPLIT.search(n) else 1)
               for n, t in [*model.named_parameters(), *model.named_buffers()])


def footprint(path, tp: int = 1, float_bytes: int = 2) -> tuple[int, int]:
    """(parameters, weight bytes per card) of the checkpoint at `path`."""
    ckpt = open_checkpoint(path)
    with torch.device("meta"):
        model = Transformer(ckpt.config)
    return count_parameters(model)[0], weight_bytes_per_card(ckpt, model, tp, float_bytes)
