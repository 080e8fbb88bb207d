"""What a model holds: parameters (all, and those one token uses), the bytes a card keeps under tensor
parallelism, and the decode state's bytes, from config.json and the safetensors headers alone (no tensor data
is read), by arithmetic: building the model even on the meta device takes seconds at V4 Flash's size, and a
decode state there imports torch's symbolic shapes (its rope tables are the process's first meta ops)."""
import math
from typing import NamedTuple

from .config import LARGEST_RATIO, ModelConfig
from .drafters import drafter_kind
from .loader import Checkpoint, keep_fp32, open_checkpoint, weights_mode
from .model import TP_COUNTS, TP_SPLIT, block_span
from .quant import is_w8a8_linear

# The name parts of the tensors model.py splits across tensor-parallel ranks (its modules' `tp_split`);
# everything else is replicated on every card.
SPLIT_NAMES = frozenset().union(*TP_SPLIT.values())


class ModelTensor(NamedTuple):
    """A parameter or buffer of the whole model (one rank's build, no split), as the footprint reads it."""
    name: str
    shape: tuple[int, ...]
    parameter: bool = True          # a buffer (the hash routing table) is held but not counted
    floating: bool = True
    linear: tuple[bool, bool] | None = None   # a Linear's weight: its (float_only, holds_fp8)


def tp_problem(cfg: ModelConfig, tp: int) -> str | None:
    """Why `tp` ranks can't split this model (a count it does not divide), or None."""
    for count, what in TP_COUNTS.items():
        if count in TP_SPLIT and (n := getattr(cfg, count)) % tp:
            return f"does not divide the {n} {what}"
    return None


def split_by_tp(name: str) -> bool:
    """Whether tensor parallelism splits the model tensor `name` (held in part by each rank)."""
    return not SPLIT_NAMES.isdisjoint(name.split("."))


def count_parameters(cfg: ModelConfig) -> tuple[int, int]:
    """(all parameters, those one token uses), as the checkpoint's config counts them (no scales, FP4 weights by
    their values): every routed expert but the top-k is idle per token."""
    total = sum(math.prod(t.shape) for t in model_tensors(cfg) if t.parameter)
    idle = (cfg.n_layers + cfg.n_mtp_layers) * (cfg.n_routed_experts - cfg.n_activated_experts)
    return total, total - idle * 3 * cfg.dim * cfg.moe_inter_dim


class Tensors:
    """A list of model tensors being made for `cfg`, with the parts model.py's modules are made of."""

    def __init__(self, cfg: ModelConfig):
        self.cfg, self.out = cfg, []

    def tensor(self, name, *shape, **kind):
        self.out.append(ModelTensor(name, shape, **kind))

    def linear(self, name, n_in, n_out, float_only=False, grouped=False):
        self.tensor(f"{name}.weight", n_out, n_in, linear=(float_only, not float_only or grouped))

    def compressor(self, p, ratio, head_dim):
        width = block_span(ratio) * head_dim
        self.tensor(f"{p}.ape", ratio, width)
        self.linear(f"{p}.wkv", self.cfg.dim, width, float_only=True)
        self.linear(f"{p}.wgate", self.cfg.dim, width, float_only=True)
        self.tensor(f"{p}.norm.weight", head_dim)

    def expert(self, p):
        cfg = self.cfg
        self.linear(f"{p}.w1", cfg.dim, cfg.moe_inter_dim)
        self.linear(f"{p}.w2", cfg.moe_inter_dim, cfg.dim)
        self.linear(f"{p}.w3", cfg.dim, cfg.moe_inter_dim)

    def hc_head(self, p):
        hc, dim = self.cfg.hc_mult, self.cfg.dim
        self.tensor(f"{p}hc_head_fn", hc, hc * dim)
        self.tensor(f"{p}hc_head_base", hc)
        self.tensor(f"{p}hc_head_scale", 1)

    def block(self, p, layer_id):
        cfg, tensor, linear = self.cfg, self.tensor, self.linear
        hc, dim = cfg.hc_mult, cfg.dim
        a, ratio = f"{p}.attn", cfg.compress_ratios[layer_id]
        tensor(f"{p}.attn_norm.weight", dim)
        linear(f"{a}.wq_a", dim, cfg.q_lora_rank)
        tensor(f"{a}.q_norm.weight", cfg.q_lora_rank)
        linear(f"{a}.wq_b", cfg.q_lora_rank, cfg.n_heads * cfg.head_dim)
        linear(f"{a}.wkv", dim, cfg.head_dim)
        tensor(f"{a}.kv_norm.weight", cfg.head_dim)
        linear(f"{a}.wo_a", cfg.n_heads * cfg.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank,
               float_only=True, grouped=True)
        linear(f"{a}.wo_b", cfg.o_groups * cfg.o_lora_rank, dim)
        tensor(f"{a}.attn_sink", cfg.n_heads)
        if ratio:
            self.compressor(f"{a}.compressor", ratio, cfg.head_dim)
        if ratio == 4:
            linear(f"{a}.indexer.wq_b", cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
            linear(f"{a}.indexer.weights_proj", dim, cfg.index_n_heads)
            self.compressor(f"{a}.indexer.compressor", 4, cfg.index_head_dim)
        tensor(f"{p}.ffn_norm.weight", dim)
        tensor(f"{p}.ffn.gate.weight", cfg.n_routed_experts, dim)
        if layer_id < cfg.n_hash_layers:
            tensor(f"{p}.ffn.gate.tid2eid", cfg.vocab_size, cfg.n_activated_experts, parameter=False,
                   floating=False)
        else:
            tensor(f"{p}.ffn.gate.bias", cfg.n_routed_experts)
        for i in range(cfg.n_routed_experts):
            self.expert(f"{p}.ffn.experts.{i}")
        if cfg.n_shared_experts:
            self.expert(f"{p}.ffn.shared_experts")
        mix = (2 + hc) * hc
        for part in ("attn", "ffn"):
            tensor(f"{p}.hc_{part}_fn", mix, hc * dim)
            tensor(f"{p}.hc_{part}_base", mix)
            tensor(f"{p}.hc_{part}_scale", 3)


def model_tensors(cfg: ModelConfig) -> list[ModelTensor]:
    """What `Transformer(cfg)` holds (model.py's modules, one by one), by arithmetic."""
    t = Tensors(cfg)
    t.tensor("embed.weight", cfg.vocab_size, cfg.dim)
    for i in range(cfg.n_layers):
        t.block(f"layers.{i}", i)
    t.tensor("norm.weight", cfg.dim)
    t.tensor("head.weight", cfg.vocab_size, cfg.dim)
    t.hc_head("")
    kind = drafter_kind(cfg)
    for stage in range(cfg.n_mtp_layers):
        t.block(f"mtp.{stage}", cfg.n_layers + stage)
        kind.stage_tensors(t, f"mtp.{stage}", stage, cfg)
    return t.out


def tensor_bytes(ckpt: Checkpoint, tensors: list[ModelTensor], tp: int, float_bytes: int,
                 mode: str) -> dict[str, int]:
    """The bytes of weights a card holds as `load_model` keeps them in `mode` (`loader.weights_mode`), by how each
    is held: 'fp4' (packed + E8M0 per 32), 'fp8' (+ fp32 tile scales), 'int8' (+ fp32 per channel) and 'float'
    (fp32 where kept so, else `float_bytes`-byte: 2 for bf16, 4 for float32); the split tensors' share of them."""
    drafter = drafter_kind(ckpt.config)
    out = dict.fromkeys(("fp4", "fp8", "int8", "float"), 0)
    for name, shape, _, floating, linear in tensors:
        prefix = name.rpartition(".")[0]
        float_only, holds_fp8 = linear or (False, False)
        stored = ckpt.dtype(name) if name in ckpt.tensors else None
        split = tp if split_by_tp(name) else 1
        numel = math.prod(shape)
        rows, cols = shape if len(shape) == 2 else (0, 0)
        if linear is None:
            how, n = "float", numel * (4 if keep_fp32(name) or not floating else float_bytes)
        elif mode == "native" and stored == "I8" and ckpt.format == "fp8" and not float_only:
            how, n = "fp4", numel // 2 + numel // 32
        elif mode == "native" and stored == "F8_E4M3" and holds_fp8:
            how, n = "fp8", numel + 4 * -(-rows // 128) * -(-cols // 128)
        elif (mode == "native" and ckpt.format == "w8a8" and ckpt.label(name) == "W8A8_DYNAMIC"
              and not float_only) or (mode == "w8a8" and ckpt.format == "fp8" and not float_only
                                      and stored in ("I8", "F8_E4M3") and is_w8a8_linear(prefix, drafter)):
            how, n = "int8", numel + 4 * rows
        else:
            how, n = "float", numel * (4 if keep_fp32(name) else float_bytes)
        out[how] += n // split
    return out


def footprint(path, tp: int = 1, float_bytes: int = 2, weights: str = "auto",
              device="cpu") -> tuple[int, dict[str, int]]:
    """(parameters, weight bytes per card by how they are held: `tensor_bytes`) of the checkpoint at `path`, as
    `--weights` `weights` holds them on `device`."""
    ckpt = open_checkpoint(path)
    tensors = model_tensors(ckpt.config)
    mode = weights_mode(ckpt, weights, device)
    return count_parameters(ckpt.config)[0], tensor_bytes(ckpt, tensors, tp, float_bytes, mode)


def state_bytes(cfg: ModelConfig, batch: int, max_len: int, max_draft: int, spare: int, float_bytes: int) -> int:
    """What `model.DecodeState(..., batch, max_len, max_draft, spare)` allocates for its layers and the
    drafter's (`DecodeState.nbytes`), by arithmetic: its float tensors are `float_bytes` wide, the compressors'
    rings fp32."""
    lookback = max(cfg.window_size, LARGEST_RATIO) - 1
    ring = lookback + 1 + max_draft + 1 + spare
    per_sequence = (cfg.n_layers + cfg.n_mtp_layers) * ring * cfg.head_dim * float_bytes    # the window rings
    for ratio in filter(None, cfg.compress_ratios[: cfg.n_layers]):
        blocks = max_len // ratio + 1
        per_sequence += 2 * ring * block_span(ratio) * cfg.head_dim * 4 + blocks * cfg.head_dim * float_bytes
        if ratio == 4:      # the indexer's own compressor
            per_sequence += 2 * ring * 2 * cfg.index_head_dim * 4 + blocks * cfg.index_head_dim * float_bytes
    return batch * per_sequence
