"""The drafter kinds a checkpoint can have, one description each: what the engine, the loader, the weight formats
and the front ends need to know of a kind is read here, never from its name. A kind's own code is its stage
modules (`model.STAGES`) and its proposer (`engine.runner.PROPOSERS`); docs/architecture.md, "A drafter kind",
has the recipe for a new one.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import ModelConfig


@dataclass(frozen=True, eq=False)
class DrafterKind:
    """A drafter kind. Its layers are the checkpoint's `mtp.N` (ModelConfig.n_mtp_layers of them), each a trunk
    block and parts of its own; their state is DecodeState.drafter."""
    name: str           # ModelConfig.drafter: what session files, metrics and --json output call it
    label: str          # how the front ends name it
    layers: str         # what its layers are called
    layers_key: str     # the config.json key that counts them, as the loader's errors name it
    present: Callable[[ModelConfig], bool]      # the config says the checkpoint has it (asked in DRAFTERS' order)
    auto_depth: Callable[[ModelConfig], int]    # the drafts a step drafts under mtp = auto
    max_depth: Callable[[ModelConfig], int | None]   # the most a step can draft: one pass's block (None: no bound)
    confidence: bool    # it estimates each draft's chance of acceptance (auto chooses how many to verify by it)
    target_layers: Callable[[ModelConfig], tuple[int, ...]]    # trunk layers whose outputs it reads
    # a bound on where its writes reach at D drafts a step: below the slot's committed tokens + write_ahead(D)
    write_ahead: Callable[[int], int]
    in_transformers: bool   # transformers' DeepSeek V4 runs its layers (bench's float peer keeps them)
    # W8A8: the trunk's embed / head -> the unrotated copies msModelSlim writes for it
    vocab_copies: Callable[[ModelConfig], dict[str, str]]
    # its modules read those copies where the checkpoint has them (ModelConfig.dspark_vocab_copies), else it
    # shares the trunk's
    holds_copies: bool
    w8a8: re.Pattern | None     # its layers' int8 linears in the W8A8 recipe (None: the trunk's recipe)
    # what its stage `stage` holds besides the trunk's block, by arithmetic (footprint.Tensors `t`, prefix `p`)
    stage_tensors: Callable[..., None]
    settings: Callable[[ModelConfig], dict]     # its own settings, as `dsv4 inspect` lists them
    summary: Callable[[dict], str]              # inspect's line for it: its settings and `layers` (the count)


def _dspark_stage_tensors(t, p: str, stage: int, cfg: ModelConfig) -> None:
    """The first stage projects the target features; the last holds the head's norm and hc_head, the Markov and
    confidence heads; with the checkpoint's copies, the first its own embedding and the last its own head."""
    if stage == 0:
        t.linear(f"{p}.main_proj", len(cfg.dspark_target_layer_ids) * cfg.dim, cfg.dim)
        t.tensor(f"{p}.main_norm.weight", cfg.dim)
        if cfg.dspark_vocab_copies:
            t.tensor(f"{p}.embed.weight", cfg.vocab_size, cfg.dim)
    if stage == cfg.n_mtp_layers - 1:
        t.tensor(f"{p}.norm.weight", cfg.dim)
        t.hc_head(f"{p}.")
        t.tensor(f"{p}.markov_head.markov_w1.weight", cfg.vocab_size, cfg.dspark_markov_rank)
        t.tensor(f"{p}.markov_head.markov_w2.weight", cfg.vocab_size, cfg.dspark_markov_rank)
        t.linear(f"{p}.confidence_head.proj", cfg.dim + cfg.dspark_markov_rank, 1, float_only=True)
        if cfg.dspark_vocab_copies:
            t.tensor(f"{p}.head.weight", cfg.vocab_size, cfg.dim)


def _mtp_stage_tensors(t, p: str, stage: int, cfg: ModelConfig) -> None:
    """The token's embedding and the trunk's streams mixed in, its own norm and hc_head."""
    t.tensor(f"{p}.enorm.weight", cfg.dim)
    t.tensor(f"{p}.hnorm.weight", cfg.dim)
    t.linear(f"{p}.e_proj", cfg.dim, cfg.dim)
    t.linear(f"{p}.h_proj", cfg.dim, cfg.dim)
    t.tensor(f"{p}.norm.weight", cfg.dim)
    t.hc_head(f"{p}.")


def _dspark_summary(d: dict) -> str:
    return (f"DSpark (0731): {d['layers']} stages, block of {d['block_size']}, Markov rank {d['markov_rank']}, "
            f"target layers {d['target_layers']}" + (", own embed/head copies" if d["own_vocabulary_copies"] else ""))


# 0731's DSpark block drafter (engine/dspark.py): one pass of its stages drafts a block, sampled, with confidences.
DSPARK = DrafterKind(
    name="dspark", label="DSpark", layers="DSpark stages",
    layers_key="n_mtp_layers (the DSpark stages past num_hidden_layers in compress_ratios)",
    present=lambda cfg: cfg.dspark_block_size > 0,
    auto_depth=lambda cfg: cfg.dspark_block_size, max_depth=lambda cfg: cfg.dspark_block_size,
    confidence=True, target_layers=lambda cfg: cfg.dspark_target_layer_ids,
    write_ahead=lambda depth: 0,        # its rings take committed rows only
    in_transformers=False,
    vocab_copies=lambda cfg: {"embed.weight": "mtp.0.embed.weight",
                              "head.weight": f"mtp.{cfg.n_mtp_layers - 1}.head.weight"},
    holds_copies=True,
    # msModelSlim's deepseek_v4_dspark adapter, as vllm-ascend's descriptor labels it: every attention linear,
    # wo_a/wo_b included (UNCONFIRMED: the trunk recipe keeps those float), every FFN linear but the gate, and
    # main_proj
    w8a8=re.compile(r"mtp\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.(experts\.\d+|shared_experts)\.w[123]"
                    r"|main_proj)"),
    stage_tensors=_dspark_stage_tensors,
    settings=lambda cfg: {"block_size": cfg.dspark_block_size, "markov_rank": cfg.dspark_markov_rank,
                          "target_layers": list(cfg.dspark_target_layer_ids),
                          "noise_token_id": cfg.dspark_noise_token_id,
                          "own_vocabulary_copies": cfg.dspark_vocab_copies},
    summary=_dspark_summary)

# The preview checkpoints' MTP layer (engine/mtp.py), chained for depth K, sampled.
MTP = DrafterKind(
    name="mtp", label="MTP", layers="MTP layers", layers_key="num_nextn_predict_layers",
    present=lambda cfg: cfg.n_mtp_layers > 0,
    auto_depth=lambda cfg: 1, max_depth=lambda cfg: None,
    confidence=False, target_layers=lambda cfg: (),
    write_ahead=lambda depth: depth,    # its chain writes pos + n_acc + K - 1: below the committed tokens + K
    in_transformers=True,
    vocab_copies=lambda cfg: {"embed.weight": "mtp.0.emb.tok_emb.weight", "head.weight": "mtp.0.head.weight"},
    holds_copies=False, w8a8=None,
    stage_tensors=_mtp_stage_tensors,
    settings=lambda cfg: {},
    summary=lambda d: f"MTP layer ({d['layers']}), chained for depth K")

# Every kind, in the order the config is asked which one it has: MTP last, since any kind's layers are
# n_mtp_layers.
DRAFTERS = {kind.name: kind for kind in (DSPARK, MTP)}


def drafter_kind(cfg: ModelConfig) -> DrafterKind | None:
    """The kind of drafter the config says the checkpoint has, or None."""
    return next((kind for kind in DRAFTERS.values() if kind.present(cfg)), None)


def drafter_named(name: str | None) -> DrafterKind | None:
    """The kind called `name` (ModelConfig.drafter, ModelInfo.drafter), or None for None; ValueError for a name
    no kind has."""
    if name is None:
        return None
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter kind {name!r} (known: {', '.join(DRAFTERS)})")
    return DRAFTERS[name]
