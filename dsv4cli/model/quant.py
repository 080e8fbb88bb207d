"""Weight formats: Ascend W8A8_DYNAMIC (msModelSlim layout) and the official FP8 / FP4 release.

W8A8_DYNAMIC follows msModelSlim's DeepSeek V4 Flash recipe: the q/kv projections and every expert
linear hold int8 weights with one fp32 scale per output channel (symmetric, offset 0); activations
are quantised per token at run time. Everything else stays float. The official release stores
linears as FP8 E4M3 with one E8M0 scale per 128x128 tile, and routed experts as packed FP4 E2M1 with
one E8M0 scale per 32 inputs; `fp8_to_float` / `fp4_to_float` decode them.
"""
import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from dsv4cli.kernels.reference import FP4_BLOCK, FP4_VALUES, FP8_BLOCK, fp4_to_float, fp8_to_float  # noqa: F401

from .drafters import DrafterKind, drafter_kind
from .model import Linear

# msModelSlim deepseek_v4_flash_w8a8.yaml: W8A8_DYNAMIC on attention linears except wo_a/wo_b,
# compressors and weights_proj, and on every FFN linear except the gate (a drafter's layers too, unless its
# kind has a recipe of its own: DrafterKind.w8a8).
_W8A8_LINEAR = re.compile(
    r"(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|indexer\.wq_b)|ffn\.(experts\.\d+|shared_experts)\.w[123])")
W8A8_PREFIX = "quant_model_weights"
W8A8_DESCRIPTION = "quant_model_description.json"

FP32_TENSORS = ("hc_", ".ape", "attn_sink", "gate.bias")   # stored fp32 in every layout; the rest bf16


def is_w8a8_linear(prefix: str, drafter: DrafterKind | None = None) -> bool:
    """Whether the linear `prefix` (e.g. 'layers.3.attn.wq_a') is int8 in the W8A8 recipe (of a checkpoint
    whose drafter is of the kind `drafter`)."""
    own = drafter is not None and drafter.w8a8 is not None and prefix.startswith("mtp.")
    return (drafter.w8a8 if own else _W8A8_LINEAR).fullmatch(prefix) is not None


def vocab_copies(cfg) -> dict[str, str]:
    """The copies of the trunk's embed / head a W8A8 checkpoint holds for its drafter (unrotated, where the
    trunk's are QuaRot-rotated), by msModelSlim's names for its kind."""
    kind = drafter_kind(cfg)
    return kind.vocab_copies(cfg) if kind else {}


def as_stored(name: str, t: torch.Tensor) -> torch.Tensor:
    """A float tensor (or the hash routing table) as the official layout stores it: mHC, ape, sinks
    and gate bias fp32, tid2eid int64, the rest bf16."""
    if name.endswith("tid2eid"):
        return t.to(torch.int64)
    return t.to(torch.float32 if any(k in name for k in FP32_TENSORS) else torch.bfloat16)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: scale [out,1] = amax/127, q [out,in] = round(w/scale)."""
    wf = w.float()
    scale = wf.abs().amax(dim=1, keepdim=True).clamp(min=1e-30) / 127   # an all-zero row gets zero codes
    return torch.round(wf / scale).clamp(-127, 127).to(torch.int8), scale


def dequantized(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with its int8 weights times their `weight_scale` (fp32) and the scales dropped; every
    other tensor as it is. Take one `state_dict()` and pass it here: each call of that unpacks every
    packed weight."""
    out = {}
    for name, t in state.items():
        if name.endswith("weight_scale"):
            continue
        out[name] = t.float() * state[name + "_scale"].float() if t.dtype == torch.int8 else t
    return out


@torch.no_grad()
def quantize_model(model: nn.Module) -> nn.Module:
    """Swap the recipe's linears to int8 weights + `weight_scale`, in place, as `load_model` holds a W8A8
    checkpoint: a `float_only` linear keeps its dequantised weights."""
    drafter = drafter_kind(model.cfg)
    for name, module in model.named_modules():
        if isinstance(module, Linear) and is_w8a8_linear(name, drafter) and module.format == "float":
            q, scale = quantize_weight(module.weight)
            if module.float_only:
                module.weight.copy_(q.float() * scale)
                continue
            module.weight = nn.Parameter(q, requires_grad=False)
            module.weight_scale = nn.Parameter(scale, requires_grad=False)
    return model


def e8m0(exponents: torch.Tensor) -> torch.Tensor:
    """Integer exponents e as E8M0 scales 2^e."""
    return (exponents + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def quantize_fp8(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The release's FP8 rule: per block x block tile a power-of-two scale, the smallest that maps the tile's
    amax to at most 448 (E4M3's largest), and each value rounded to E4M3. Returns (weight, E8M0 grid)."""
    rows, cols = w.shape
    padded = w.new_zeros(-(-rows // block) * block, -(-cols // block) * block, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    amax = padded.unflatten(0, (-1, block)).unflatten(-1, (-1, block)).abs().amax(dim=(1, 3))
    exp = torch.ceil(torch.log2(amax.clamp(min=2.0 ** -100) / 448))
    scale = (2 ** exp).repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return (w.float() / scale).to(torch.float8_e4m3fn), e8m0(exp)


def quantize_fp4(w: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The release's FP4 rule: per `block` inputs a power-of-two scale mapping the group's amax to at most 6
    (E2M1's largest), each value the nearest E2M1 code; two codes a byte, the even input in the low nibble.
    Returns (packed int8 [out, in/2], E8M0 [out, in/block])."""
    groups = w.float().unflatten(-1, (-1, block))
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -100) / 6))
    x = (groups / 2 ** exp[..., None]).flatten(-2)
    codes = (x[..., None] - torch.tensor(FP4_VALUES)).abs().argmin(-1)
    return (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8).view(torch.int8), e8m0(exp)


# What the release's config.json says of its weights.
RELEASE_CONFIG = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                          "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "activation_scheme": "dynamic"},
                  "expert_dtype": "fp4", "torch_dtype": "bfloat16"}


def is_release_fp8(prefix: str) -> bool:
    """Whether the release stores the linear `prefix` in FP8 (routed experts: FP4): all but the compressors,
    the indexer's weights_proj and DSpark's confidence head, which are bf16."""
    return not any(k in prefix for k in ("compressor", "weights_proj", "confidence_head"))


def release_tensors(name: str, t: torch.Tensor, module: nn.Module | None) -> list[tuple[str, torch.Tensor]]:
    """A model tensor as the release stores it: a routed expert's weight as packed FP4 + its `scale`, another
    linear's as FP8 + its tile `scale` (`is_release_fp8`), the rest as `as_stored`."""
    prefix, _, attr = name.rpartition(".")
    if attr == "weight" and isinstance(module, Linear) and is_release_fp8(prefix):
        q, scale = (quantize_fp4 if ".experts." in prefix else quantize_fp8)(t)
        return [(name, q), (f"{prefix}.scale", scale)]
    return [(name, as_stored(name, t))]


@torch.no_grad()
def release_model(model: nn.Module) -> nn.Module:
    """Swap the linears to the release's formats in place (`release_tensors`: FP8 with tile scales, routed experts
    FP4), as `load_model --weights native` holds an official checkpoint; float-only linears keep their weights
    as the FP8/FP4 values decode (as the loader holds them)."""
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.format == "float" and is_release_fp8(name):
            (_, q), (_, scale) = release_tensors(f"{name}.weight", module.weight, module)
            fp4 = q.dtype == torch.int8
            if module.float_only and (fp4 or not module.holds_fp8):
                module.weight.copy_(fp4_to_float(q, scale) if fp4 else fp8_to_float(q, scale))
                continue
            module.weight = nn.Parameter(q.view(torch.float4_e2m1fn_x2) if fp4 else q, requires_grad=False)
            module.scale = nn.Parameter(scale if fp4 else scale.float(), requires_grad=False)
    return model


class ShardWriter:
    """Writes tensors as they arrive into shards of at most `max_shard_bytes`: `{prefix}.safetensors`
    when one is enough, else `{prefix}-0000i-of-0000N.safetensors` plus `{prefix}.safetensors.index.json`.
    Only the shard being filled is held in memory."""

    def __init__(self, out_dir, prefix: str, max_shard_bytes: int):
        self.out, self.prefix, self.max_bytes = Path(out_dir), prefix, max_shard_bytes
        self.out.mkdir(parents=True, exist_ok=True)
        self.pending, self.pending_bytes, self.total_bytes = {}, 0, 0
        self.written: list[tuple[Path, list[str]]] = []

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = t.detach().contiguous().cpu()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        path = self.out / f"{self.prefix}.part{len(self.written)}"   # renamed once the count is known
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.written:
            self._flush()
        n = len(self.written)
        if n == 1:
            self.written[0][0].rename(self.out / f"{self.prefix}.safetensors")
            return
        weight_map = {}
        for i, (path, names) in enumerate(self.written, 1):
            final = f"{self.prefix}-{i:05d}-of-{n:05d}.safetensors"
            path.rename(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out / f"{self.prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_config(out_dir, config: dict, extra_files: dict[str, str] | None = None,
                 drop: tuple[str, ...] = ("quantization_config",)) -> None:
    """config.json without the keys in `drop`, and the extra files (tokenizer, generation config) as given."""
    out = Path(out_dir)
    (out / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in drop}, indent=2))
    for name, text in (extra_files or {}).items():
        (out / name).write_text(text)


class W8A8Writer:
    """Streams a checkpoint out in the msModelSlim W8A8_DYNAMIC layout and its description file."""

    def __init__(self, out_dir, max_shard_bytes: int = 4 << 30, copies: dict[str, str] | None = None):
        """`copies`: float tensors written twice, under a second name too (`vocab_copies`)."""
        self.shards = ShardWriter(out_dir, W8A8_PREFIX, max_shard_bytes)
        self.copies, self.labels = copies or {}, {}

    def _add(self, name: str, t: torch.Tensor, label: str) -> None:
        self.shards.add(name, t)
        self.labels[name] = label

    def linear(self, prefix: str, q: torch.Tensor, scale: torch.Tensor) -> None:
        scale = scale.float().reshape(-1, 1)
        self._add(f"{prefix}.weight", q, "W8A8_DYNAMIC")
        self._add(f"{prefix}.weight_scale", scale, "W8A8_DYNAMIC")
        self._add(f"{prefix}.weight_offset", torch.zeros_like(scale), "W8A8_DYNAMIC")

    def tensor(self, name: str, t: torch.Tensor) -> None:
        """A float tensor (or the hash routing table), labelled FLOAT; a copy the writer makes is written once."""
        if name in self.labels:
            return
        t = as_stored(name, t)
        self._add(name, t, "FLOAT")
        if name in self.copies:
            self._add(self.copies[name], t.clone(), "FLOAT")

    def close(self, config: dict, extra_files: dict[str, str] | None = None) -> None:
        self.shards.close()
        description = {**self.labels, "model_quant_type": "W8A8_DYNAMIC", "version": "1.0.0",
                       "metadata": {}, "group_size": 0, "optional": {}}
        (self.shards.out / W8A8_DESCRIPTION).write_text(json.dumps(description, indent=2))
        write_config(self.shards.out, config, extra_files)


@torch.no_grad()
def save_w8a8(model: nn.Module, config: dict, out_dir, max_shard_bytes: int = 4 << 30,
              extra_files: dict[str, str] | None = None) -> None:
    """Write `model` in the msModelSlim W8A8_DYNAMIC layout: the recipe's linears as W8A8_DYNAMIC
    (int8 ones as they are, float ones quantised on the way out), everything else as FLOAT;
    config.json loses its quantization_config."""
    writer = W8A8Writer(out_dir, max_shard_bytes, vocab_copies(model.cfg))
    drafter = drafter_kind(model.cfg)
    state = model.state_dict()
    for name, t in state.items():
        prefix, _, attr = name.rpartition(".")
        if attr == "weight_scale":
            continue                                        # written with its weight
        if t.dtype == torch.int8:
            writer.linear(prefix, t, state[f"{prefix}.weight_scale"])
        elif attr == "weight" and is_w8a8_linear(prefix, drafter):
            writer.linear(prefix, *quantize_weight(t))
        else:
            writer.tensor(name, t)
    writer.close(config, extra_files)
