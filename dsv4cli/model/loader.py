"""Load a DeepSeek V4 checkpoint: the official float or FP8/FP4 layout, or msModelSlim W8A8_DYNAMIC.

Every tensor is first checked against config.json from the safetensors headers alone (names, shapes,
dtypes), so a bad checkpoint fails before anything is read. Then the shards are memory-mapped and
read tensor by tensor: each rank takes only its slice (heads, groups, experts, vocabulary rows),
decodes FP8/FP4 if needed and copies it straight to the target device and dtype. A tensor's mapped
pages are dropped once it is copied, so host memory stays close to what the rank keeps.
"""
import dataclasses
import json
import math
import mmap
import os
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from dsv4cli import kernels, platforms

from .config import ConfigError, ModelConfig
from .drafters import MTP, drafter_kind
from .model import Linear, PackedWeight, Transformer, world
from .quant import (
    FP4_BLOCK,
    FP8_BLOCK,
    FP32_TENSORS,
    W8A8_DESCRIPTION,
    W8A8_PREFIX,
    fp4_to_float,
    fp8_to_float,
    is_w8a8_linear,
    quantize_weight,
    vocab_copies,
)

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
FLOATS = ("F32", "BF16", "F16")
SCALES = ("F8_E8M0", "F32")      # E8M0 in the release; V4 Base ships fp32 scales


class LoadError(ValueError):
    """A checkpoint problem a user can fix; one line naming the file or tensor."""


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(data, dict):
        raise LoadError(f"{path}: expected a JSON object")
    return data


# Legacy (HF-style) name parts and what the official convert.py renames them to.
LEGACY_NAMES = {"self_attn": "attn", "mlp": "ffn", "weight_scale_inv": "scale", "e_score_correction_bias": "bias"}


def native_name(name: str) -> str:
    return ".".join(LEGACY_NAMES.get(part, part) for part in name.removeprefix("model.").split("."))


class Entry(NamedTuple):
    """A tensor's safetensors header entry; begin/end are byte offsets into the data section."""
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class Shard:
    """One safetensors file: its header (tensors under their native names), and its tensors as views
    of a private read-only mapping."""

    def __init__(self, path: Path):
        self.path, self.map = path, None
        self.entries: dict[str, Entry] = {}
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                n = int.from_bytes(f.read(8), "little")
                if size < 8 or n > size - 8:
                    raise ValueError(f"header length {n} exceeds the file size {size}")
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            for name, h in header.items():
                begin, end = h["data_offsets"]
                self.entries[native_name(name)] = Entry(h["dtype"], tuple(h["shape"]), begin, end)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise LoadError(f"{path}: not a valid safetensors file ({type(e).__name__}: {e})") from None
        self.start = 8 + n
        for name, (dtype, shape, begin, end) in self.entries.items():
            if dtype not in DTYPES or end - begin != math.prod(shape) * DTYPES[dtype].itemsize:
                raise LoadError(f"{path}: corrupt header entry '{name}' ({dtype} {list(shape)}, {end - begin} bytes)")
        needed = self.start + max((e.end for e in self.entries.values()), default=0)
        if needed > size:
            raise LoadError(f"{path}: truncated: {size} bytes, its header describes {needed}")

    def view(self, name: str) -> torch.Tensor:
        """The whole tensor as a view of the mapped file; pages are read when it is used."""
        if self.map is None:
            with open(self.path, "rb") as f:
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        dtype, shape, begin, end = self.entries[name]
        if begin == end:
            return torch.empty(shape, dtype=DTYPES[dtype])
        return torch.frombuffer(self.map, dtype=DTYPES[dtype], count=math.prod(shape),
                                offset=self.start + begin).view(shape)

    def release(self, name: str) -> None:
        """Unmap a tensor's pages from this process (the OS page cache may keep them)."""
        e = self.entries[name]
        first = (self.start + e.begin) // mmap.PAGESIZE * mmap.PAGESIZE
        if self.map is not None and e.end > e.begin and hasattr(mmap, "MADV_DONTNEED"):
            self.map.madvise(mmap.MADV_DONTNEED, first, self.start + e.end - first)


@dataclass
class Checkpoint:
    path: Path
    config: ModelConfig
    format: str                    # "float", "fp8" (official release) or "w8a8"
    shards: list[Shard]
    tensors: dict[str, Shard]      # tensor name -> the shard holding it
    description: dict              # quant_model_description.json (W8A8 only)

    def entry(self, name: str) -> Entry:
        return self.tensors[name].entries[name]

    def dtype(self, name: str) -> str:
        return self.entry(name).dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def nbytes(self, name: str) -> int:
        return self.entry(name).end - self.entry(name).begin

    def view(self, name: str) -> torch.Tensor:
        return self.tensors[name].view(name)

    def position(self, name: str) -> tuple[Path, int]:
        return self.tensors[name].path, self.entry(name).begin

    def label(self, name: str) -> str:
        """The W8A8 label of a tensor: from the description, else from its dtype."""
        if self.description:
            return self.description.get(name, "FLOAT")
        return "W8A8_DYNAMIC" if self.format == "w8a8" and self.dtype(name) == "I8" else "FLOAT"


def open_checkpoint(path) -> Checkpoint:
    """Read config.json, the index, the description and every shard header; check that they agree."""
    path = Path(path)
    if not path.is_dir():
        raise LoadError(f"{path}: model directory not found")
    try:
        cfg = ModelConfig.from_file(path / "config.json")
    except ConfigError as e:
        raise LoadError(str(e)) from None
    description = read_json(path / W8A8_DESCRIPTION) if (path / W8A8_DESCRIPTION).exists() else {}
    index = path / (f"{W8A8_PREFIX}.safetensors.index.json" if description else "model.safetensors.index.json")
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise LoadError(f"{index}: no 'weight_map' object")
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{path}: no .safetensors files")
    for f in files:
        if not f.exists():
            raise LoadError(f"{f}: listed in {index.name} but missing")
    shards = [Shard(f) for f in files]
    tensors = {}
    for shard in shards:
        for name in shard.entries:
            if name in tensors:
                raise LoadError(f"{path}: tensor '{name}' is in both {tensors[name].path.name} and {shard.path.name}")
            tensors[name] = shard

    w8a8 = next((n for n in tensors if n.endswith(".weight_scale")), None)
    fp8 = next((n for n in tensors if n.endswith(".scale") or tensors[n].entries[n].dtype == "F8_E4M3"), None)
    if (w8a8 or description) and fp8:
        raise LoadError(f"{path}: mixes W8A8 tensors ('{w8a8 or W8A8_DESCRIPTION}') with FP8 tensors ('{fp8}'); "
                        "a W8A8 checkpoint is QuaRot-rotated and cannot take original weights")
    fmt = "w8a8" if w8a8 or description else "fp8" if fp8 else "float"
    kind = drafter_kind(cfg)
    if kind and kind.holds_copies and kind.vocab_copies(cfg)["embed.weight"] in tensors:   # its own vocabulary
        cfg = dataclasses.replace(cfg, dspark_vocab_copies=True)
    ckpt = Checkpoint(path, cfg, fmt, shards, tensors, description)
    check_config(ckpt)
    return ckpt


def check_config(ckpt: Checkpoint) -> None:
    """config.json against what the tensor names and the embedding say."""
    cfg, names, where = ckpt.config, ckpt.tensors, ckpt.path / "config.json"

    def indices(pattern):
        return {int(m.group(1)) for n in names if (m := re.search(pattern, n))}

    drafter = drafter_kind(cfg) or MTP      # no drafter: mtp.N tensors would be the preview's MTP layers
    for field, want, have, what in (
            ("num_hidden_layers", cfg.n_layers, indices(r"^layers\.(\d+)\."), "layers"),
            (drafter.layers_key, cfg.n_mtp_layers, indices(r"^mtp\.(\d+)\."), drafter.layers),
            ("n_routed_experts", cfg.n_routed_experts, indices(r"\.experts\.(\d+)\."), "routed experts")):
        if have and have != set(range(want)):
            raise LoadError(f"{where}: {field} is {want} but the checkpoint has {what} "
                            f"{min(have)}..{max(have)} ({len(have)})")
    if "embed.weight" in names and ckpt.shape("embed.weight") != (cfg.vocab_size, cfg.dim):
        raise LoadError(f"{where}: vocab_size x hidden_size is {[cfg.vocab_size, cfg.dim]} but embed.weight "
                        f"is {list(ckpt.shape('embed.weight'))}")
    quant = (cfg.raw.get("quantization_config") or {}).get("quant_method")
    if quant and ckpt.format != "fp8":
        raise LoadError(f"{where}: quantization_config says {quant} but the checkpoint is {ckpt.format}; "
                        "remove quantization_config")


@dataclass
class Item:
    """One model tensor and the checkpoint tensors it is read from (the weight first)."""
    name: str
    shape: torch.Size              # this rank's shape
    kind: str                      # float | index | w8a8 | w8a8_float | fp8 | fp4
    sources: tuple[str, ...]


def keep_fp32(name: str) -> bool:
    """Kept fp32 in memory whatever the compute dtype: what the files store fp32, and the norms."""
    return any(k in name for k in (*FP32_TENSORS, "norm.weight"))


def split_dim(full: tuple[int, ...], local: tuple[int, ...]) -> int | None:
    """The dimension a tensor is split along across ranks (None: whole); raises if the shapes don't fit."""
    ws = world()[1]
    dims = [d for d in range(len(full)) if full[d] != local[d]] if len(full) == len(local) else [-1]
    if not dims:
        return None
    if len(dims) > 1 or full[dims[0]] != local[dims[0]] * ws:
        raise ValueError
    return dims[0]


def local_index(full: tuple[int, ...], local: tuple[int, ...]) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    """This rank's block of a (possibly split) tensor: the index and where it starts."""
    d, rank = split_dim(full, local), world()[0]
    start = tuple(rank * local[i] if i == d else 0 for i in range(len(full)))
    return tuple(slice(s, s + n) for s, n in zip(start, local)), start


def is_other_rank_expert(name: str, cfg: ModelConfig) -> bool:
    """Routed experts owned by another rank are skipped, not reported as extra."""
    rank, ws = world()
    m = re.search(r"\.experts\.(\d+)\.", name)
    return ws > 1 and m is not None and int(m.group(1)) // (cfg.n_routed_experts // ws) != rank


def plan(ckpt: Checkpoint, model: Transformer) -> tuple[list[Item], list[str]]:
    """What to read for each of the model's tensors, and every problem the headers show."""
    # the drafter's vocabulary copies, where the model reads the trunk's own (the preview's MTP layer)
    used = set(vocab_copies(ckpt.config).values()) - set(dict(model.named_parameters()))
    items, problems = [], []
    modules = dict(model.named_modules())
    expected = {**dict(model.named_parameters()), **dict(model.named_buffers())}

    def check(name, shape, dtypes, local=True):
        if name not in ckpt.tensors:
            problems.append(f"missing tensor '{name}'")
            return False
        used.add(name)
        have = ckpt.shape(name)
        try:
            ok = split_dim(have, tuple(shape)) is None or local
        except ValueError:
            ok = False
        if not ok:
            rank_part = f" (this rank's part of {world()[1]})" if world()[1] > 1 and local else ""
            problems.append(f"tensor '{name}': shape {list(have)}, expected {list(shape)}{rank_part}")
        elif ckpt.dtype(name) not in dtypes:
            problems.append(f"tensor '{name}': dtype {ckpt.dtype(name)}, expected {' or '.join(dtypes)}")
        return ok and ckpt.dtype(name) in dtypes

    for name, meta in expected.items():
        prefix, _, attr = name.rpartition(".")
        if name not in ckpt.tensors:
            problems.append(f"missing tensor '{name}'")
            continue
        linear = attr == "weight" and isinstance(modules[prefix], Linear)
        label = ckpt.label(name) if linear else "FLOAT"
        if label not in ("FLOAT", "W8A8_DYNAMIC"):
            problems.append(f"tensor '{name}': labelled {label!r}; only W8A8_DYNAMIC and FLOAT are supported")
            continue
        if label == "W8A8_DYNAMIC":          # decided by the label, never by the name (recipes differ)
            kind = "w8a8_float" if modules[prefix].float_only else "w8a8"
            item = Item(name, meta.shape, kind, (name, f"{prefix}.weight_scale", f"{prefix}.weight_offset"))
            if check(name, meta.shape, ("I8",)):
                rows = ckpt.shape(name)[0]
                for extra in item.sources[1:]:
                    check(extra, (rows, 1), FLOATS, local=False)
        elif linear and ckpt.format == "fp8" and ckpt.dtype(name) == "F8_E4M3":
            item = Item(name, meta.shape, "fp8", (name, f"{prefix}.scale"))
            if check(name, meta.shape, ("F8_E4M3",)):
                rows, cols = ckpt.shape(name)
                check(item.sources[1], (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)), SCALES, local=False)
        elif linear and ckpt.format == "fp8" and ckpt.dtype(name) == "I8":
            rows, cols = meta.shape                     # routed experts: whole on their rank, never split
            item = Item(name, meta.shape, "fp4", (name, f"{prefix}.scale"))
            if check(name, (rows, cols // 2), ("I8",), local=False):
                check(item.sources[1], (rows, cols // FP4_BLOCK), SCALES, local=False)
        elif attr == "tid2eid":
            item = Item(name, meta.shape, "index", (name,))
            check(name, meta.shape, ("I64", "I32"))
        else:
            item = Item(name, meta.shape, "float", (name,))
            check(name, meta.shape, FLOATS)
        used.update(item.sources)            # a scale is not also 'unexpected' where its weight is wrong
        items.append(item)
    extra = [n for n in ckpt.tensors if n not in used and not is_other_rank_expert(n, ckpt.config)]
    problems += [f"unexpected tensor '{n}'" for n in extra]
    return items, problems


WEIGHTS = ("auto", "native", "w8a8", "float")


def weights_mode(ckpt: Checkpoint, weights: str, device) -> str:
    """How the run holds the checkpoint's quantised weights: 'native' (as the files store them: the release's
    FP8/FP4, W8A8's int8), 'w8a8' (the release re-quantised to int8 per channel at load) or 'float' (decoded
    to the run's dtype). 'auto': native where the device's kernels read the release's formats, else w8a8."""
    if weights not in WEIGHTS:
        raise LoadError(f"--weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    reads_release = platforms.for_device(torch.device(device)).reads_release_formats
    if weights == "auto":
        return "native" if reads_release or ckpt.format != "fp8" else "w8a8"
    if weights == "native" and ckpt.format == "fp8" and not reads_release:
        raise LoadError(f"--weights native: the {device} kernels don't read the release's "
                        "FP8/FP4 weights; use --weights w8a8 (re-quantised at load) or float")
    if weights == "w8a8" and ckpt.format == "float":
        raise LoadError("--weights w8a8: the checkpoint is float; `dsv4 convert --to w8a8` writes a W8A8 one")
    return "native" if weights == "w8a8" and ckpt.format == "w8a8" else weights


def e8m0_scales(scale: torch.Tensor) -> torch.Tensor | None:
    """FP4 group scales as E8M0 (the release's), or None where fp32 scales aren't all powers of two."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale
    mantissa, exponent = torch.frexp(scale.float())
    if not bool((mantissa == 0.5).all()) or not bool(((exponent >= -126) & (exponent <= 128)).all()):
        return None
    return (exponent + 126).to(torch.uint8).view(torch.float8_e8m0fnu)


class Held(NamedTuple):
    """One model tensor as the run holds it: the tensor, the scale read with it (W8A8's per channel as
    `weight_scale`, the release's as `scale`) and, for an FP8 rank slice, where it starts in its first tile."""
    tensor: torch.Tensor
    scale_name: str | None = None
    scale: torch.Tensor | None = None
    offset: tuple[int, int] = (0, 0)
    mapped: tuple[torch.Tensor, ...] = ()     # those of tensor and scale that are views of the checkpoint's mapping
    widen: torch.dtype | None = None          # held as stored for the kernels to pack; else widened to this


def read_item(ckpt: Checkpoint, item: Item, device, dtype, mode: str = "float", module: nn.Module | None = None,
              mapped: bool = False) -> Held:
    """This rank's part of one model tensor on `device` (float in `dtype` unless kept fp32), in `mode`
    (`weights_mode`; `module`: the Linear the weight belongs to). `mapped`: a weight held in the file's own bytes
    stays a view of the file's mapping (no copy: pages are read as the kernels use them) where `device` is the
    host."""
    full = ckpt.view(item.sources[0])
    linear = module if isinstance(module, Linear) else None
    platform = platforms.for_device(torch.device(device))
    keep = mapped and platform.on_host_cores    # the mapping is host memory

    def own(t):          # the file's bytes as they are: mapped on the host, else copied to the device
        return t if keep else platform.weight_copy(t, device)

    def requantized(t):                 # the release's weight as W8A8 holds it, or float where W8A8 keeps float
        prefix = item.name.rpartition(".")[0]
        if mode == "w8a8" and is_w8a8_linear(prefix, drafter_kind(ckpt.config)) and not linear.float_only:
            q, scale = quantize_weight(t)
            return Held(q.to(device), "weight_scale", scale.to(device))
        return Held(t.to(device, dtype))

    if item.kind == "fp4":              # routed experts are whole on their rank
        scale = ckpt.view(item.sources[1])
        e8m0 = e8m0_scales(scale) if mode == "native" and not linear.float_only else None
        held = Held(own(full).view(torch.float4_e2m1fn_x2), "scale", own(e8m0)) if e8m0 is not None \
            else requantized(fp4_to_float(full, scale))
    else:
        index, start = local_index(tuple(full.shape), tuple(item.shape))
        part = full[index]
        if item.kind == "float":
            want = torch.float32 if keep_fp32(item.name) else dtype
            # a float tensor stored as the run holds it (a bf16 run's bf16 tensors) stays mapped too; a bf16
            # weight the kernels may pack (they hold bf16 values in bf16: an fp32 run's LM head) is packed from
            # the file's bytes: widened first, V4 Flash's head took 2 s and 2 GB more to load
            packable = (isinstance(module, PackedWeight) and platform.packs_weights and part.dtype == torch.bfloat16
                        and want == torch.float32)
            held = Held(part) if keep and part.is_contiguous() and (part.dtype == want or packable) else \
                Held(part.to(device, want, copy=True))
            held = held._replace(widen=want) if held.tensor.dtype != want else held
        elif item.kind == "index":
            held = Held(part.to(device, torch.int32, copy=True))
        elif item.kind == "fp8":
            scale = ckpt.view(item.sources[1])
            if mode == "native" and linear.holds_fp8:
                (r, c), (rows, cols) = start, part.shape
                tiles = scale[r // FP8_BLOCK: -(-(r + rows) // FP8_BLOCK), c // FP8_BLOCK: -(-(c + cols) // FP8_BLOCK)]
                held = Held(own(part), "scale", tiles.to(device, torch.float32, copy=True),
                            (r % FP8_BLOCK, c % FP8_BLOCK))
            else:
                held = requantized(fp8_to_float(part, scale, start))
        else:
            if ckpt.view(item.sources[2]).any():
                raise LoadError(f"{ckpt.path}: tensor '{item.sources[2]}' is not all zeros; only symmetric "
                                "W8A8_DYNAMIC is supported")
            t = part.to(device, copy=True)
            scale = ckpt.view(item.sources[1])[index[0]].to(device, torch.float32, copy=True)
            # read in float math of the module's own, or a float run asked for: held dequantised
            held = Held((t.float() * scale).to(dtype)) if item.kind == "w8a8_float" or mode == "float" \
                else Held(t, "weight_scale", scale)
    sources = [ckpt.view(name) for name in item.sources]
    mapped = tuple(t for t in (held.tensor, held.scale) if keep and t is not None and t.nbytes and any(
        v.data_ptr() <= t.data_ptr() < v.data_ptr() + v.nbytes for v in sources))
    if mapped:
        return held._replace(mapped=mapped)         # their pages stay where the kernels read them
    for name in item.sources:
        ckpt.tensors[name].release(name)
    return held


def assign(model: nn.Module, name: str, held: Held) -> None:
    prefix, _, attr = name.rpartition(".")
    module = model.get_submodule(prefix)
    if attr in module._buffers:
        module._buffers[attr] = held.tensor
    else:
        module._parameters[attr] = nn.Parameter(held.tensor, requires_grad=False)
    if held.scale is not None:
        setattr(module, held.scale_name, nn.Parameter(held.scale, requires_grad=False))
        module.scale_offset = held.offset


@contextmanager
def progress_bar(show: bool | None, total: int, label: str):
    """Yields advance(nbytes); a rich bar on stderr when `show`, or when None and stderr is a terminal."""
    if not (sys.stderr.isatty() if show is None else show):
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def load_model(path, device="cpu", dtype=torch.bfloat16, progress: bool | None = None, weights: str = "auto",
               mmap_weights: bool = True, mlock: bool = False) -> Transformer:
    """Build the model for this rank and fill it from `path`; raises LoadError naming the first problem.

    `weights`: how quantised weights are held (`weights_mode`). `mmap_weights`: on the host, weights held in the
    file's own bytes stay views of the file's mapping (shared through the page cache by every process that maps
    it; pages the OS drops are read again as they are used); `mlock` pins those pages in memory."""
    ckpt = open_checkpoint(path)
    mode = weights_mode(ckpt, weights, device)
    with torch.device("meta"):
        model = Transformer(ckpt.config)
    items, problems = plan(ckpt, model)
    if problems:
        more = f" (+{len(problems) - 1} more; `dsv4 inspect --check` lists them)" if len(problems) > 1 else ""
        raise LoadError(f"{ckpt.path}: {problems[0]}{more}")
    items.sort(key=lambda it: ckpt.position(it.sources[0]))      # sequential reads, shard by shard
    total = sum(ckpt.nbytes(n) for it in items for n in it.sources)
    # a weight the device's kernels hold in a layout of their own is packed as soon as it is read, so its
    # plain copy is freed before the next one is allocated (packing them all after the load held both)
    ops = kernels.module_for(torch.device(device))
    packs = platforms.for_device(torch.device(device)).packs_weights
    modules = dict(model.named_modules())
    mapped = []
    with progress_bar(progress, total, f"loading {ckpt.path.name}") as advance:
        for item in items:
            prefix, _, attr = item.name.rpartition(".")
            held = read_item(ckpt, item, device, dtype, mode, modules.get(prefix), mmap_weights)
            assign(model, item.name, held)
            mapped += held.mapped
            if packs and attr == "weight" and isinstance(modules[prefix], PackedWeight):
                modules[prefix].ops = ops
                modules[prefix].pack()
            if held.widen is not None and modules[prefix].packed is None:     # no layout of the kernels took it
                modules[prefix].weight = nn.Parameter(held.tensor.to(held.widen), requires_grad=False)
            advance(sum(ckpt.nbytes(n) for n in item.sources))
    model.eval().prepare()
    live = {p.data_ptr() for p in model.parameters()}
    mapped = [t for t in mapped if t.data_ptr() in live]      # not those packed into a layout of the kernels'
    model.weights_mode = mode
    model.mapped_bytes = sum(t.nbytes for t in mapped)     # held as views of the checkpoint's mapping
    if mlock and mapped:
        lock_pages(mapped)
    return model


def lock_pages(tensors: list[torch.Tensor]) -> None:
    """mlock the mapped tensors' pages (`--mlock`): read once now, never dropped; one line on stderr if the
    limit (ulimit -l) refuses."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for t in tensors:
        if libc.mlock(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(t.nbytes)) != 0:
            print(f"dsv4: --mlock: {os.strerror(ctypes.get_errno())} (raise `ulimit -l`); the weights stay "
                  "mapped, and pages the OS drops are read again", file=sys.stderr)
            return
