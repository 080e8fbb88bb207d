"""ModelConfig: the checkpoint's config.json (official DeepSeek V4 field names), validated."""
import json
from dataclasses import dataclass, field
from pathlib import Path

from .drafters import drafter_kind

COMPRESS_RATIOS = (0, 4, 128)       # a layer's KV compression: 0 window only, 4 with the indexer, 128 dense
LARGEST_RATIO = max(COMPRESS_RATIOS)


class ConfigError(ValueError):
    """A missing or inconsistent config.json field; the message is one line naming it."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_mtp_layers: int
    n_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    moe_inter_dim: int
    score_func: str
    route_scale: float
    n_hash_layers: int
    swiglu_limit: float
    window_size: int
    compress_ratios: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    rope_factor: float
    original_seq_len: int
    beta_fast: float
    beta_slow: float
    max_position_embeddings: int
    bos_id: int
    eos_id: int
    # 0731 checkpoints: the DSpark block drafter (its stages are the n_mtp_layers `mtp.N`; 0: none)
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    # the drafter reads its own vocabulary tensors (mtp.0.embed, mtp.N-1.head: msModelSlim's unrotated
    # copies in W8A8); set by the loader from the checkpoint's tensor names
    dspark_vocab_copies: bool = False
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def drafter(self) -> str | None:
        """The name of the checkpoint's drafter kind (`drafters.drafter_kind`): "dspark" (0731), "mtp" (the
        preview's MTP layer) or None."""
        kind = drafter_kind(self)
        return kind.name if kind else None

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        def need(key):
            if key not in d:
                raise ConfigError(f"missing field '{key}'")
            return d[key]

        rs = d.get("rope_scaling") or d.get("rope_parameters") or {}
        if rs and rs.get("type", rs.get("rope_type")) not in ("yarn", None):
            raise ConfigError(f"rope_scaling.type must be 'yarn', got {rs.get('type')!r}")
        eos = d.get("eos_token_id", 1)
        block = d.get("dspark_block_size", 0)
        ratios = tuple(need("compress_ratios"))
        # 0731 keeps the legacy num_nextn_predict_layers = 1: its stages are the compress_ratios past the
        # trunk (inference/config.json's n_mtp_layers), checked against the mtp.N tensors at load
        stages = d.get("n_mtp_layers", len(ratios) - need("num_hidden_layers")) if block \
            else d.get("num_nextn_predict_layers", 0)
        cfg = cls(
            vocab_size=need("vocab_size"),
            dim=need("hidden_size"),
            n_layers=need("num_hidden_layers"),
            n_mtp_layers=stages,
            n_heads=need("num_attention_heads"),
            head_dim=need("head_dim"),
            rope_dim=need("qk_rope_head_dim"),
            q_lora_rank=need("q_lora_rank"),
            o_lora_rank=need("o_lora_rank"),
            o_groups=need("o_groups"),
            n_routed_experts=need("n_routed_experts"),
            n_shared_experts=d.get("n_shared_experts", 1),
            n_activated_experts=need("num_experts_per_tok"),
            moe_inter_dim=need("moe_intermediate_size"),
            score_func=d.get("scoring_func", "sqrtsoftplus"),
            route_scale=float(d.get("routed_scaling_factor", 1.0)),
            n_hash_layers=d.get("num_hash_layers", 0),
            swiglu_limit=float(d.get("swiglu_limit", 0.0)),
            window_size=need("sliding_window"),
            compress_ratios=ratios,
            index_n_heads=need("index_n_heads"),
            index_head_dim=need("index_head_dim"),
            index_topk=need("index_topk"),
            hc_mult=d.get("hc_mult", 4),
            hc_sinkhorn_iters=d.get("hc_sinkhorn_iters", 20),
            hc_eps=float(d.get("hc_eps", 1e-6)),
            norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            compress_rope_theta=float(d.get("compress_rope_theta", 160000.0)),
            rope_factor=float(rs.get("factor", 1.0)),
            original_seq_len=int(rs.get("original_max_position_embeddings", 0)) if rs else 0,
            beta_fast=float(rs.get("beta_fast", 32)),
            beta_slow=float(rs.get("beta_slow", 1)),
            max_position_embeddings=d.get("max_position_embeddings", 1 << 20),
            bos_id=d.get("bos_token_id", 0),
            eos_id=eos[0] if isinstance(eos, list) else eos,
            dspark_block_size=block,
            dspark_noise_token_id=d.get("dspark_noise_token_id", 0),
            dspark_target_layer_ids=tuple(d.get("dspark_target_layer_ids", ())),
            dspark_markov_rank=d.get("dspark_markov_rank", 0),
            raw=d,
        )
        cfg.validate(d)
        return cfg

    def validate(self, d: dict) -> None:
        def bad(msg):
            raise ConfigError(msg)

        if d.get("num_key_value_heads", 1) != 1:
            bad(f"num_key_value_heads must be 1 (one shared latent KV), got {d['num_key_value_heads']}")
        drafter = "n_mtp_layers (DSpark stages)" if self.dspark_block_size else "num_nextn_predict_layers"
        if len(self.compress_ratios) != self.n_layers + self.n_mtp_layers:
            bad(f"compress_ratios has {len(self.compress_ratios)} entries, expected num_hidden_layers + "
                f"{drafter} = {self.n_layers + self.n_mtp_layers}")
        if self.dspark_block_size:
            if self.dspark_block_size < 1 or self.n_mtp_layers < 1:
                bad(f"dspark_block_size ({self.dspark_block_size}) needs at least one DSpark stage")
            targets = self.dspark_target_layer_ids
            if not targets or not all(0 <= i < self.n_layers for i in targets):
                bad(f"dspark_target_layer_ids must name trunk layers 0..{self.n_layers - 1}, "
                    f"got {list(self.dspark_target_layer_ids)}")
            if not 0 <= self.dspark_noise_token_id < self.vocab_size:
                bad(f"dspark_noise_token_id ({self.dspark_noise_token_id}) is not a token id")
            if self.dspark_markov_rank < 1:
                bad(f"dspark_markov_rank must be >= 1, got {self.dspark_markov_rank}")
        if any(r not in COMPRESS_RATIOS for r in self.compress_ratios):
            bad(f"compress_ratios entries must be 0, 4 or 128, got {sorted(set(self.compress_ratios))}")
        if any(r != 0 for r in self.compress_ratios[self.n_layers:]):
            bad("compress_ratios entries of the MTP layers must be 0 (sliding window only)")
        if self.n_heads % self.o_groups:
            bad(f"num_attention_heads ({self.n_heads}) must be divisible by o_groups ({self.o_groups})")
        if self.rope_dim % 2 or self.rope_dim > self.head_dim or self.rope_dim > self.index_head_dim:
            bad(f"qk_rope_head_dim ({self.rope_dim}) must be even and <= head_dim and index_head_dim")
        if not 0 < self.n_activated_experts <= self.n_routed_experts:
            bad(f"num_experts_per_tok ({self.n_activated_experts}) must be in 1..n_routed_experts")
        if self.score_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            bad(f"scoring_func must be sqrtsoftplus, sigmoid or softmax, got {self.score_func!r}")
        if self.n_shared_experts > 1:
            bad(f"n_shared_experts must be 0 or 1, got {self.n_shared_experts}")
        if self.n_hash_layers > self.n_layers:
            bad(f"num_hash_layers ({self.n_hash_layers}) exceeds num_hidden_layers ({self.n_layers})")
        if d.get("tie_word_embeddings", False):
            bad("tie_word_embeddings must be false (DeepSeek V4 has a separate head)")

    @property
    def kv_bytes_per_token(self) -> float:
        """Growing KV-cache bytes per token of context at 2 bytes per value (compressed entries)."""
        total = 0.0
        for r in self.compress_ratios[: self.n_layers]:
            if r:
                total += self.head_dim * 2 / r
            if r == 4:
                total += self.index_head_dim * 2 / r
        return total
