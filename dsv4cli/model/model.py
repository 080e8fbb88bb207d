"""DeepSeek V4 Flash: the whole model in one file.

Follows the official `inference/model.py` forward pass (docs/decisions.md says what differs): 4 hyper-connection
streams mixed by mHC, low-rank q with a weight-less per-head norm, one shared 512-d latent used as K
and V, interleaved partial RoPE, attention sinks, a sliding window plus compressed KV (ratio 4 with
the lightning indexer, ratio 128 dense), grouped low-rank output, hash / biased sqrt-softplus MoE and
the MTP block. Tensor names are the official ones.

Every call runs through the cached path: a chunk of S tokens per sequence starting at `start[b]`
reads and writes a preallocated, position-addressed `DecodeState`. Because every write goes to a slot
named by its absolute position (ring slot `p % R`, compressed block `(p+1)//r - 1`) and every read is
masked by position, tokens rejected by speculative decoding leave nothing behind: the next chunk
rewrites their slots before anything reads them. Heads, output groups, experts and the vocabulary
are split across torch.distributed ranks.
"""
import copy
import importlib
import itertools
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dsv4cli import kernels, platforms
from dsv4cli.kernels import reference
from dsv4cli.kernels.reference import ExpertStack

from .config import LARGEST_RATIO, ModelConfig
from .drafters import DSPARK, MTP, drafter_kind


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if world()[1] > 1:
        dist.all_reduce(x)
    return x


# The config's counts `--tp` may divide among the ranks, as an error names them, in the order it checks them.
TP_COUNTS = {"n_heads": "attention heads", "o_groups": "output groups", "index_n_heads": "indexer heads",
             "n_routed_experts": "routed experts", "vocab_size": "vocabulary rows"}
# What `--tp` splits: each count the ranks divide and the tensors split along it, by a part of their names. Filled
# from the modules' `tp_split` as they are defined, so the footprint and `tp_problem` know it without building a
# model.
TP_SPLIT: dict[str, set[str]] = {}


class OpModule(nn.Module):
    """A module that runs the kernel seam's ops as `self.ops.<op>`: the reference until `Transformer.prepare`
    binds the device's kernel module to every module, once. Copied or pickled, the binding travels by
    the module's name (a module object can't be)."""
    ops = reference
    # what of the module `--tp` splits: {config count: its attributes split along it}; an attribute holding a
    # module stands for all of that module's tensors
    tp_split: dict[str, tuple[str, ...]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for count, names in cls.tp_split.items():
            assert count in TP_COUNTS, f"{cls.__name__}.tp_split: {count} is not one of TP_COUNTS"
            TP_SPLIT.setdefault(count, set()).update(names)

    def __getstate__(self):
        state = self.__dict__.copy()
        if "ops" in state:
            state["ops"] = state["ops"].__name__
        return state

    def __setstate__(self, state):
        if isinstance(state.get("ops"), str):
            state["ops"] = importlib.import_module(state["ops"])
        super().__setstate__(state)


class PackedWeight:
    """A module whose `weight` the CPU kernels may hold in a layout of their own (`pack`): the packed copy
    is then the only one held (the parameter moves to the meta device, keeping shape and dtype), and
    state_dict() unpacks it."""
    packed = None

    def pack(self) -> None:
        if self.packed is None and (packed := self._pack(self.weight)) is not None:
            self.packed = packed
            self.weight = nn.Parameter(self.weight.to("meta"), requires_grad=False)

    def unpack(self) -> None:
        """The plain weight back, the packed copy dropped."""
        if self.packed is not None:
            self.weight = nn.Parameter(self._unpack(self.packed), requires_grad=False)
            self.packed = None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.packed is not None:
            destination[prefix + "weight"] = self._unpack(self.packed)


# The official release's own weight formats, held as its files store them (`Linear.format`).
RELEASE_FORMATS = {torch.float8_e4m3fn: "fp8", torch.float4_e2m1fn_x2: "fp4"}


class Linear(PackedWeight, OpModule):
    """y = x W^T with W [out, in]: float, int8 + per-channel `weight_scale` (W8A8 dynamic), or the official
    release's bytes with their `scale`: FP8 E4M3 [out, in] with a grid of 128 x 128 tile scales (`scale_offset`:
    where this rank's part starts inside its first tile), or packed FP4 E2M1 [out, in/2] with a scale per 32
    inputs, read in place by the kernels (never packed, never widened).

    int8 weights may be packed for the backend's int8 GEMM, fp32 ones for its few-row fp32 GEMM.
    `groups`: the rows are that many projections of their own (attention's wo_a: `by_groups`), packed apart.
    `float_only`: the module reads the weight in float math of its own (fp32), so an int8 or FP4 weight is held
    dequantised (an FP8 one too, unless it is read `by_groups`: `holds_fp8`)."""

    def __init__(self, in_features: int, out_features: int, dtype=None, groups: int | None = None,
                 float_only: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.register_parameter("weight_scale", None)
        self.register_parameter("scale", None)
        self.scale_offset = (0, 0)
        self.groups, self.float_only = groups, float_only

    @property
    def quantized(self) -> bool:
        return self.weight.dtype == torch.int8

    @property
    def format(self) -> str:
        """How the weight is held: 'fp8' or 'fp4' (the release's bytes), 'int8' (W8A8) or 'float'."""
        return RELEASE_FORMATS.get(self.weight.dtype, "int8" if self.quantized else "float")

    @property
    def holds_fp8(self) -> bool:
        """Whether an FP8 weight stays FP8 here: every linear read through `forward` or `by_groups`."""
        return not self.float_only or self.groups is not None

    def _pack(self, weight):
        if self.scale is not None:          # the release's bytes are read where they are
            return None
        return self.ops.pack_w8a8(weight) if self.quantized else self.ops.pack_linear_fp32(weight, self.groups or 1)

    def _unpack(self, packed):
        return self.ops.unpack_w8a8(packed) if self.quantized else self.ops.unpack_linear_fp32(packed)

    @property
    def kernel_weight(self) -> torch.Tensor:
        """The weight as the kernels read it: the packed copy where there is one."""
        return self.packed if self.packed is not None else self.weight

    @property
    def kernel_scale(self) -> torch.Tensor | None:
        """The scale the kernels read with it: W8A8's per channel or the release's."""
        return self.scale if self.scale is not None else self.weight_scale

    def by_groups(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., G, d] through the G projections the rows hold (attention's wo_a) -> [..., G, out/G]."""
        G = self.groups
        if self.format == "fp8":
            return self.ops.fp8_grouped_projection(x, self.weight, self.scale, self.scale_offset, G)
        return self.ops.grouped_projection(x, self.weight.view(G, -1, self.weight.shape[-1]), self.packed)

    def forward(self, x: torch.Tensor, xq=None) -> torch.Tensor:
        """`xq`: x already quantised per token (several W8A8 linears reading the same x)."""
        if self.scale is not None:
            if self.weight.dtype == torch.float4_e2m1fn_x2:
                return self.ops.fp4_linear(x, self.weight, self.scale)
            return self.ops.fp8_linear(x, self.weight, self.scale, self.scale_offset)
        if self.quantized:
            return self.ops.w8a8_linear(x, self.weight, self.weight_scale, xq, self.packed)
        if self.packed is not None:
            return self.ops.linear_fp32(x, self.weight, self.packed).to(x.dtype)
        return self.ops.linear(x, self.weight)


class RMSNorm(OpModule):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x):
        return self.ops.rms_norm(x, self.weight, self.eps)


def rope_table(cfg: ModelConfig, length: int, compressed: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [length, rope_dim/2]: plain RoPE (window-only layers, MTP) or YaRN (compressed layers)."""
    dim = cfg.rope_dim
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    if compressed and cfg.original_seq_len > 0:
        def correction_dim(rotations):
            return dim * math.log(cfg.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(cfg.beta_fast)), 0)
        high = min(math.ceil(correction_dim(cfg.beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / max(high - low, 1e-3))
        smooth = 1 - ramp.clamp(0, 1)
        freqs = freqs / cfg.rope_factor * (1 - smooth) + freqs * smooth
    angles = torch.outer(torch.arange(length, dtype=torch.float32, device=device), freqs)
    return angles.cos(), angles.sin()


# --------------------------------------------------------------------------------------------------
# Decode state and the per-call plan
# --------------------------------------------------------------------------------------------------

def block_span(ratio: int) -> int:
    """Blocks a compressor row feeds: ratio-4 blocks overlap (block j pools tokens 4j-4..4j+3), so their
    projections are two halves wide and a block has 2r candidate rows."""
    return 2 if ratio == 4 else 1


class LayerCache:
    """One attention layer's state for `batch` sequences; all sizes fixed at allocation.

    win:      ring [B, R, head_dim] of window KV, slot p % R
    compress_kv/compress_gate: ring [B, R, span*head_dim] f32 of compressor projections (gate includes ape)
    compressed: [B, T+1, head_dim] compressed blocks, block j in slot j, slot T is a sink for unused writes
    idx_*:    the same for the indexer's own compressor (ratio 4 only)
    """

    def __init__(self, cfg: ModelConfig, ratio: int, batch: int, ring: int, max_len: int, zeros):
        """`zeros(*shape, dtype=None)`: a zero tensor where the state lives (None: in its dtype)."""
        self.ratio = ratio
        self.win = zeros(batch, ring, cfg.head_dim)
        if ratio:
            span = block_span(ratio)
            blocks = max_len // ratio + 1
            self.compress_kv = zeros(batch, ring, span * cfg.head_dim, dtype=torch.float32)
            self.compress_gate = zeros(batch, ring, span * cfg.head_dim, dtype=torch.float32)
            self.compressed = zeros(batch, blocks, cfg.head_dim)
        if ratio == 4:
            self.idx_kv = zeros(batch, ring, 2 * cfg.index_head_dim, dtype=torch.float32)
            self.idx_gate = zeros(batch, ring, 2 * cfg.index_head_dim, dtype=torch.float32)
            self.idx_compressed = zeros(batch, blocks, cfg.index_head_dim)

    def tensors(self):
        return [v for v in vars(self).values() if isinstance(v, torch.Tensor)]

    def view(self, index: slice) -> "LayerCache":
        view = copy.copy(self)
        for name, t in vars(self).items():
            if isinstance(t, torch.Tensor):
                setattr(view, name, t[index])
        return view

    def carried(self, pos: int, window: int) -> dict[str, tuple[str, int, int]]:
        """What a call starting at position `pos` reads of the positions before it, per tensor: ("ring", lo,
        pos), the rows of positions [lo, pos) (the window's last window-1; a compressor's rows since its
        last closed block, plus ratio 4's overlapping half of the block before), or ("blocks", 0, n), the
        n blocks closed before `pos`. Whatever else a later call reads, it writes first."""
        def ring(n: int) -> tuple[str, int, int]:
            return "ring", max(pos - n, 0), pos
        parts = {"win": ring(window - 1)}
        if self.ratio:
            rows = ring(pos % self.ratio + (block_span(self.ratio) - 1) * self.ratio)
            parts |= {"compress_kv": rows, "compress_gate": rows, "compressed": ("blocks", 0, pos // self.ratio)}
        if self.ratio == 4:
            rows = ring(pos % 4 + 4)
            parts |= {"idx_kv": rows, "idx_gate": rows, "idx_compressed": ("blocks", 0, pos // 4)}
        return parts


class DecodeState:
    """Preallocated KV / compressor state for up to `batch` sequences of `max_len` tokens.

    `max_draft` is the most rows one call may write past the last committed token; the rings are
    that much longer than the window so rejected rows never overwrite a slot still in use. `spare`
    more ring rows let a new prompt resume a slot up to that many rows before the previous writes
    ended (prefix reuse).
    """

    def __init__(self, model: "Transformer", batch: int, max_len: int, max_draft: int = 8, spare: int = 0):
        cfg = model.cfg
        device, dtype = model.embed.weight.device, model.dtype       # a meta model's: its size, nothing allocated

        def zeros(*shape, dtype=dtype):
            return torch.zeros(*shape, device=device, dtype=dtype)

        self.batch, self.max_len, self.max_draft, self.window = batch, max_len, max_draft, cfg.window_size
        self.ratios = set(cfg.compress_ratios[: cfg.n_layers]) - {0}        # the trunk's compressed layers
        # rows any call reads before its first position: the window, or a largest-ratio block's candidates
        self.lookback = max(cfg.window_size, LARGEST_RATIO) - 1
        self.ring = self.lookback + 1 + max_draft + 1 + spare
        ratios = cfg.compress_ratios
        self.layers = [LayerCache(cfg, ratios[i], batch, self.ring, max_len, zeros) for i in range(cfg.n_layers)]
        self.drafter = [LayerCache(cfg, 0, batch, self.ring, max_len, zeros)     # the drafter's layers, mtp.N
                        for _ in range(cfg.n_mtp_layers)]
        table_len = max_len + max_draft + 2
        self.rope = {"main": rope_table(cfg, table_len, False, device),
                     "compress": rope_table(cfg, table_len, True, device)}
        self._views = {}

    def view(self, index: int | slice) -> "DecodeState":
        """A view of some sequence slots; writes through it land in this state. Views are cached,
        so stepping a batch bucket creates nothing."""
        if isinstance(index, int):
            index = slice(index, index + 1)
        key = (index.start, index.stop)
        if key not in self._views:
            view = copy.copy(self)
            view._views = {}
            view.layers = [c.view(index) for c in self.layers]
            view.drafter = [c.view(index) for c in self.drafter]
            self._views[key] = view
        return self._views[key]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for c in self.layers + self.drafter for t in c.tensors())


class CompressPlan:
    """Which rows of a chunk close a ratio-r block, where the block goes, and its candidate rows.

    Rows closing a block are at most ceil(S/r) per sequence; their count is fixed by S and r, so
    shapes stay static (rows that don't exist write to the sink slot).
    """

    def __init__(self, r: int, start, pos, state: DecodeState, context: int):
        """`start` [B] and `pos` [B,S]: the call's first and every position; `context`: a bound on them all."""
        span, S, ring, table = block_span(r), pos.shape[1], state.ring, state.rope["compress"]
        blocks = state.max_len // r + 1
        n = -(-S // r)
        first = (r - 1 - start % r) % r                                        # [B]
        rows = first[:, None] + r * torch.arange(n, device=pos.device)          # [B,n]
        valid = rows < S
        self.closes = valid                                                     # [B,n]: the block closes here
        row_pos = start[:, None] + rows
        block = (row_pos + 1) // r - 1
        self.slot = torch.where(valid & (block < blocks - 1), block, blocks - 1)
        block_pos = (block.clamp(min=0) * r).clamp(max=table[0].shape[0] - 1)
        self.cos, self.sin = table[0][block_pos], table[1][block_pos]
        cand = row_pos[..., None] - (span * r - 1) + torch.arange(span * r, device=pos.device)  # [B,n,span*r]
        self.from_ring = (cand < start[:, None, None])[..., None]
        self.ring_row = (cand % ring).flatten(1)[..., None]
        self.chunk_row = (cand - start[:, None, None]).clamp(0, S - 1).flatten(1)[..., None]
        self.cand_valid = cand >= 0
        self.n_visible = min(context // r, blocks - 1)        # blocks a call may read: a static bound
        self.closed = (pos + 1) // r                          # [B,S] blocks closed before each query


    def candidates(self, ring: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
        """[B,n,span*r,C]: each closing block's candidate rows, from the ring (earlier calls) or from
        this chunk's rows, read in place."""
        B, n, c = *self.cand_valid.shape[:2], self.cand_valid.shape[2]
        from_ring = ring.gather(1, self.ring_row.expand(-1, -1, ring.shape[-1]))
        from_chunk = chunk.gather(1, self.chunk_row.expand(-1, -1, chunk.shape[-1]))
        return torch.where(self.from_ring, from_ring.view(B, n, c, -1), from_chunk.view(B, n, c, -1))


class CallPlan:
    """Everything the layers share for one call of the model: positions, RoPE rows, masks, write slots."""

    def __init__(self, tokens: torch.Tensor, start: torch.Tensor, state: DecodeState, compressed: bool = True,
                 context: int | None = None, length: torch.Tensor | None = None):
        B, S = tokens.shape
        dev = tokens.device
        self.B, self.S = B, S
        table_len = state.rope["main"][0].shape[0]
        self.pos = start[:, None] + torch.arange(S, device=dev)                 # [B,S]
        p = self.pos.clamp(max=table_len - 1)
        self.rope = {k: (c[p].unsqueeze(2), s[p].unsqueeze(2)) for k, (c, s) in state.rope.items()}
        R, W = state.ring, state.window
        q = self.pos[..., None]
        slot_pos = q - (q - torch.arange(R, device=dev)) % R                    # position held by each slot
        self.ring_mask = (slot_pos >= 0) & (slot_pos > q - W) & (slot_pos < start[:, None, None])   # [B,S,R]
        chunk_pos = self.pos[:, None, :]
        self.chunk_mask = (chunk_pos <= q) & (chunk_pos > q - W)                                   # [B,S,S]
        # ring writes: the last min(S, R) rows (earlier ones would share their slots). A padded chunk
        # (`length` [B] real rows) writes its last real rows; where it has fewer, the slots of the
        # positions before it get back what they hold. Its padding rows must not write the rings: there
        # are more of them than the rows past the window. What else they write lies at positions past
        # the chunk (blocks they close), position-addressed garbage as rejected rows leave.
        keep = min(S, R)
        if length is None:
            self.write_rows, self.write_real = slice(S - keep, S), None
            self.write_slot = self.pos[:, S - keep:] % R
        else:
            rows = length[:, None] - keep + torch.arange(keep, device=dev)                           # [B,keep]
            self.write_rows, self.write_real = rows.clamp(min=0)[..., None], (rows >= 0)[..., None]
            self.write_slot = (start[:, None] + rows) % R
        # `context` (a host-side bound on every position in the call) limits how many compressed
        # blocks are read; without it the whole preallocated cache is read, masked.
        context = min(context or state.max_len, state.max_len)
        self.plans = {r: CompressPlan(r, start, self.pos, state, context) for r in state.ratios} if compressed else {}

    @property
    def shape(self) -> tuple[int, int]:
        return self.B, self.S

    def write_ring(self, ring: torch.Tensor, rows: torch.Tensor):
        """Store this chunk's per-token rows in a position-addressed ring (after it has been read)."""
        ring = ring[: self.B]
        idx = self.write_slot[..., None].expand(-1, -1, ring.shape[-1])
        if self.write_real is None:
            ring.scatter_(1, idx, rows[:, self.write_rows].to(ring.dtype))
            return
        real = rows.gather(1, self.write_rows.expand(-1, -1, rows.shape[-1])).to(ring.dtype)
        ring.scatter_(1, idx, torch.where(self.write_real, real, ring.gather(1, idx)))


class TrunkRows(NamedTuple):
    """What the trunk gives for a segment: its streams [B,S,hc,D], and the drafter's target features [B,S,F]
    (`Transformer.forward_segments`; None where its kind has no target layers)."""
    hidden: torch.Tensor
    features: torch.Tensor | None


class Segment(NamedTuple):
    """One part of a call: tokens [B,S] at positions start[b].. of `state` (a DecodeState or a view of
    some of its slots). `context` bounds every position + 1 (see CallPlan). `length` [B]: a padded
    chunk's real rows (a compiled prefill chunk's length is a bucket): the rows after them write
    nothing later calls read."""
    tokens: torch.Tensor
    start: torch.Tensor
    state: "DecodeState"
    context: int | None = None
    length: torch.Tensor | None = None


def rows_at(x: torch.Tensor, row: torch.Tensor | None) -> torch.Tensor:
    """Row row[b] of each sequence of x [B,S,...] as [B,1,...]; None: the last row."""
    if row is None:
        return x[:, -1:]
    index = row.view(-1, *[1] * (x.dim() - 1)).expand(-1, 1, *x.shape[2:])
    return x.gather(1, index)


def join(parts: list[torch.Tensor]) -> torch.Tensor:
    """Several segments' rows [B_i,S_i,...] as one [1,N,...], so token-wise work runs once over all of
    them; a single segment stays as it is."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat([p.reshape(1, -1, *p.shape[2:]) for p in parts], 1)


def split(x: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """`join` undone: [1,N,...] back into [B_i,S_i,...] per segment."""
    if len(shapes) == 1:
        return [x]
    parts = x.split([b * s for b, s in shapes], 1)
    return [p.reshape(b, s, *x.shape[2:]) for p, (b, s) in zip(parts, shapes)]


# --------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------

class Compressor(OpModule):
    """Pools every `ratio` tokens into one KV entry with a per-channel softmax gate.

    Ratio 4 overlaps: block j pools the first channel half of tokens 4j-4..4j-1 with the second half
    of tokens 4j..4j+3. Blocks close when their last token arrives, and exist from then on.
    """

    def __init__(self, cfg: ModelConfig, ratio: int, head_dim: int):
        super().__init__()
        self.ratio, self.head_dim = ratio, head_dim
        self.span = block_span(ratio)
        self.eps = cfg.norm_eps
        self.ape = nn.Parameter(torch.zeros(ratio, self.span * head_dim, dtype=torch.float32))
        self.wkv = Linear(cfg.dim, self.span * head_dim, float_only=True)
        self.wgate = Linear(cfg.dim, self.span * head_dim, float_only=True)
        self.norm = RMSNorm(head_dim, cfg.norm_eps)

    def project(self, x) -> list[torch.Tensor]:
        """The token-wise part: kv and gate rows (fp32), before the position's ape."""
        return [self.ops.linear_fp32(x, lin.weight, lin.packed) for lin in (self.wkv, self.wgate)]

    def forward(self, kv, gate, call: CallPlan, ring_kv, ring_gate, blocks):
        plan: CompressPlan = call.plans[self.ratio]
        B, r, d = call.B, self.ratio, self.head_dim
        gate = gate + self.ape[call.pos % r]
        pooled = self.ops.compress_blocks(ring_kv[:B], ring_gate[:B], kv, gate, plan, r).to(blocks.dtype)  # [B,n,d]
        pooled = self.ops.rope(self.norm(pooled), plan.cos, plan.sin)
        blocks[:B].scatter_(1, plan.slot[..., None].expand(-1, -1, d), pooled)
        call.write_ring(ring_kv, kv)
        call.write_ring(ring_gate, gate)


class Indexer(OpModule):
    """Lightning indexer: picks the top-k ratio-4 blocks per query by sum_h w_h * relu(q_h . k)."""
    tp_split = {"index_n_heads": ("wq_b", "weights_proj")}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.index_n_heads // world()[1]
        self.head_dim, self.topk = cfg.index_head_dim, cfg.index_topk
        self.scale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = Linear(cfg.dim, self.n_heads)
        self.compressor = Compressor(cfg, 4, cfg.index_head_dim)

    def project(self, x, qr) -> list[torch.Tensor]:
        """The token-wise part: query heads, head weights, the compressor's rows."""
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        return [q, self.weights_proj(x).float() * self.scale, *self.compressor.project(x)]

    def forward(self, q, w, kv, gate, call: CallPlan, cache: LayerCache) -> torch.Tensor:
        """The blocks each query attends to: [B,S,k] block indices, k = min(index_topk, the blocks a
        call may read), best first; ties go to the lower block index. Where fewer blocks are closed
        than k, the surplus indices point at blocks the query must not see (the attention masks them)."""
        self.compressor(kv, gate, call, cache.idx_kv, cache.idx_gate, cache.idx_compressed)
        cos, sin = call.rope["compress"]
        q = self.ops.rope(q, cos, sin)
        plan = call.plans[4]
        scores = all_reduce(self.ops.indexer_scores(q, cache.idx_compressed[:call.B, : plan.n_visible], w))   # [B,S,T]
        return self.ops.topk_blocks(scores, plan.closed, min(self.topk, plan.n_visible))


class Attention(OpModule):
    tp_split = {"n_heads": ("wq_b", "attn_sink"), "o_groups": ("wo_a", "wo_b")}   # wo_b: its columns

    def __init__(self, layer_id: int, cfg: ModelConfig):
        super().__init__()
        ws = world()[1]
        self.cfg = cfg
        self.ratio = cfg.compress_ratios[layer_id]
        self.rope_kind = "compress" if self.ratio else "main"
        self.n_heads, self.n_groups = cfg.n_heads // ws, cfg.o_groups // ws
        self.head_dim, self.eps = cfg.head_dim, cfg.norm_eps
        self.scale = cfg.head_dim ** -0.5
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * cfg.head_dim)
        self.wkv = Linear(cfg.dim, cfg.head_dim)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.wo_a = Linear(cfg.n_heads * cfg.head_dim // cfg.o_groups, self.n_groups * cfg.o_lora_rank,
                           groups=self.n_groups, float_only=True)
        self.wo_b = Linear(self.n_groups * cfg.o_lora_rank, cfg.dim)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        if self.ratio:
            self.compressor = Compressor(cfg, self.ratio, cfg.head_dim)
        if self.ratio == 4:
            self.indexer = Indexer(cfg)

    def forward(self, x, calls: list[CallPlan], caches: list[LayerCache]):
        """x: the rows of every segment of the call (`join`); calls/caches: each segment's plan and cache.
        The projections run once over all rows; attention, and its state writes, per segment in order."""
        qr = self.q_norm(self.wq_a(x))
        rows = [self.query(qr), self.kv_norm(self.wkv(x))]
        if self.ratio:
            rows += self.compressor.project(x)
        if self.ratio == 4:
            rows += self.indexer.project(x, qr)
        shapes = [call.shape for call in calls]
        return self.output(join([self.attend(call, cache, *seg) for call, cache, *seg
                                 in zip(calls, caches, *(split(t, shapes) for t in rows))]))

    def query(self, qr):
        """The query heads [.., H, D] from the low-rank q, each RMS-normalised without a weight."""
        return self.ops.rms_norm(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), None, self.eps)

    def output(self, o):
        """The heads' outputs [B,S,H,D] through the grouped low-rank projection and wo_b."""
        z = self.wo_a.by_groups(o.reshape(*o.shape[:2], self.n_groups, -1))
        return all_reduce(self.wo_b(z.flatten(2)))

    def attend(self, call: CallPlan, cache: LayerCache, q, kv, *compress_rows):
        """One segment: RoPE, the compressors' and the window's state writes, attention. Returns the
        heads' outputs [B,S,H,D] with RoPE undone at the query position."""
        B = call.B
        cos, sin = call.rope[self.rope_kind]
        q = self.ops.rope(q, cos, sin)
        kv = self.ops.rope(kv, cos[:, :, 0], sin[:, :, 0])   # [B,S,D]
        # KV read in place: the window ring, this chunk's rows, and the compressed blocks (CSA: the
        # indexer's top-k, gathered by index; HCA: every closed block)
        ring = cache.win[:B]
        if torch.is_grad_enabled():      # training: autograd keeps what attention read, and the ring is
            ring = ring.clone()          # overwritten below; inference reads it in place
        sources = [(ring, call.ring_mask, None), (kv, call.chunk_mask, None)]
        if self.ratio:
            self.compressor(*compress_rows[:2], call, cache.compress_kv, cache.compress_gate, cache.compressed)
            plan = call.plans[self.ratio]
            if self.ratio == 4:
                top = self.indexer(*compress_rows[2:], call, cache)
                sources.append((cache.compressed[:B], top < plan.closed[..., None], top))
            else:
                visible = torch.arange(plan.n_visible, device=q.device) < plan.closed[..., None]
                sources.append((cache.compressed[:B, : plan.n_visible], visible, None))
        o = self.ops.sparse_attention(q, sources, self.attn_sink, self.scale)
        call.write_ring(cache.win, kv)
        return self.ops.rope(o, cos, -sin)       # undo RoPE at the query position


# --------------------------------------------------------------------------------------------------
# MoE
# --------------------------------------------------------------------------------------------------

class Expert(OpModule):
    """SwiGLU with the gate clamped from above and the up projection clamped both ways."""

    def __init__(self, dim: int, inter_dim: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = Linear(dim, inter_dim)
        self.w2 = Linear(inter_dim, dim)
        self.w3 = Linear(dim, inter_dim)

    def kernel_tensors(self) -> tuple[list, list]:
        """(weights, scales) of w1, w3, w2, as a compiled graph passes them to the host-experts op."""
        linears = (self.w1, self.w3, self.w2)
        return [lin.kernel_weight for lin in linears], [lin.kernel_scale for lin in linears]

    def forward(self, x, weight=None, xq=None):
        """w2(swiglu(w1 x, w3 x) * weight): the routing weight scales the intermediate, before w2."""
        h = self.ops.swiglu(self.w1(x, xq), self.w3(x, xq), self.limit)
        return self.w2((h if weight is None else h * weight).to(x.dtype))


class Gate(PackedWeight, OpModule):
    """The router. Its scores are fp32 math on a weight the release stores in bf16: where the CPU kernels pack it
    (V4 Flash's [256, 4096]), they read the bf16 bytes; a plain weight is widened at each call, which took 1.5
    ms a layer at batch 1 on Zen 4 (benchmarks/README.md, The MoE gate read as stored)."""

    def __init__(self, layer_id: int, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.dim))
        self.hash = layer_id < cfg.n_hash_layers
        if self.hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.n_activated_experts,
                                                        dtype=torch.int32))
            self.bias = None
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def _pack(self, weight):
        return self.ops.pack_linear_fp32(weight)

    def _unpack(self, packed):
        return self.ops.unpack_linear_fp32(packed)

    def forward(self, x, input_ids):
        c = self.cfg
        return self.ops.moe_gate(self.ops.linear_fp32(x, self.weight, self.packed), self.bias,
                                 self.tid2eid if self.hash else None, input_ids, c.n_activated_experts, c.score_func,
                                 c.route_scale)


class MoE(OpModule):
    """Routed experts (only the ones a token is routed to run) plus the shared expert.

    Two ways to run the routed experts, both reading only the chosen experts' weights: routing read on
    the host, each expert on its own tokens (`routes_on_host`, set by `Transformer.prepare` from the
    platform); or, after `stack_experts`, grouped GEMMs over the stacked weights with the routing kept
    on the device (static shapes, no sync). A compiled step can't read the routing on the host: with
    stacked experts it keeps it on the device there too, else the host path is one opaque op."""
    tp_split = {"n_routed_experts": ("experts",)}     # a rank holds its experts whole, the others' not at all

    def __init__(self, layer_id: int, cfg: ModelConfig):
        super().__init__()
        rank, ws = world()
        self.n_local = cfg.n_routed_experts // ws
        self.first = rank * self.n_local
        self.limit = cfg.swiglu_limit
        self.gate = Gate(layer_id, cfg)
        self.experts = nn.ModuleList(
            [Expert(cfg.dim, cfg.moe_inter_dim, cfg.swiglu_limit) if self.first <= i < self.first + self.n_local
             else None for i in range(cfg.n_routed_experts)])
        self.shared_experts = Expert(cfg.dim, cfg.moe_inter_dim, cfg.swiglu_limit) if cfg.n_shared_experts else None
        self.stack: ExpertStack | None = None    # set: the experts run as grouped GEMMs (`prepare_experts`)
        self.shared_inside = False               # the routed-experts op runs the shared expert too
        self.table = None        # the experts as the CPU's fused kernel holds them (kept alive here, never read)

    def local_experts(self) -> list[Expert]:
        # not `self.experts[a:b]`: slicing a ModuleList builds a new one, ~0.5 ms a layer for 256 experts
        return list(itertools.islice(self.experts, self.first, self.first + self.n_local))

    @torch.no_grad()
    def stack_experts(self) -> None:
        """Stack this rank's experts ([E, 2*inter, dim] for w1|w3, [E, dim, inter] for w2, scales alike; FP4:
        the packed bytes [E, ., in/2] and their group scales) and make every expert's tensors views of the
        stacks, so the official per-expert names still read and write them. One layer's experts are copied at a
        time, never a second full copy."""
        experts = self.local_experts()
        w1 = experts[0].w1
        scale = "scale" if w1.scale is not None else "weight_scale" if w1.quantized else None

        def stacked(get):
            parts = [get(e) for e in experts]
            out = torch.empty((len(parts), *parts[0].shape), dtype=parts[0].dtype, device=parts[0].device)
            for i, t in enumerate(parts):
                out[i].view(torch.uint8 if t.element_size() == 1 else t.dtype).copy_(
                    t.view(torch.uint8) if t.element_size() == 1 else t)    # FP4/E8M0 bytes copy as bytes
            return out

        def rows(a, b):             # w1's rows then w3's, in any 1-byte format
            return torch.cat([a.view(torch.uint8), b.view(torch.uint8)]).view(a.dtype) if a.element_size() == 1 \
                else torch.cat([a, b])

        inter = w1.weight.shape[0]
        w13 = stacked(lambda e: rows(e.w1.weight, e.w3.weight))
        w2 = stacked(lambda e: e.w2.weight)
        s13 = stacked(lambda e: rows(getattr(e.w1, scale), getattr(e.w3, scale))) if scale else None
        s2 = stacked(lambda e: getattr(e.w2, scale)) if scale else None
        for i, e in enumerate(experts):
            views = {(e.w1, "weight"): w13[i, :inter], (e.w3, "weight"): w13[i, inter:], (e.w2, "weight"): w2[i]}
            if s13 is not None:
                views.update({(e.w1, scale): s13[i, :inter], (e.w3, scale): s13[i, inter:], (e.w2, scale): s2[i]})
            for (linear, attr), view in views.items():
                setattr(linear, attr, nn.Parameter(view, requires_grad=False))
        self.stack = ExpertStack(w13, w2, s13, s2, self.limit)

    def prepare_experts(self, on_host: bool) -> None:
        """Choose, once, how the routed experts run: stacked for grouped GEMMs with the routing on the device
        (accelerators, and host experts that stayed plain: small ones), or one call of the kernel module's
        `routed_experts` with the routing read on the host (packed experts: their kernels read each
        expert's weight in place; and the release's FP4 experts, read where the file's mapping holds them),
        all of a layer's in one native call where the kernel module has a table for them (`expert_table`:
        W8A8's, the release's FP4). With one world rank the host call runs the shared expert too where the
        table holds it (with more, its output joins after the all-reduce)."""
        experts = self.local_experts()
        linears = [lin for e in experts for lin in (e.w1, e.w2, e.w3)]
        # packed in a layout of the kernels' own (read in place), not merely widened (`widen_w8a8`)
        packed = on_host and any(lin.packed is not None and self.ops.is_packed(lin.packed) for lin in linears)
        in_place = on_host and experts[0].w1.scale is not None
        if not (packed or in_place):
            if self.stack is None:
                for lin in linears:
                    lin.unpack()              # the stack holds the experts' weights (widened there)
                self.stack_experts()
            self.stack = self.ops.widen_experts(self.stack)
            return
        self.stack = None          # packed now: each expert's weights are read where they are
        self.shared_inside = self.shared_experts is not None and world()[1] == 1
        if experts[0].w1.format in ("int8", "fp4"):      # the formats a fused call may read
            shared = self.shared_experts if self.shared_inside else None
            self.table = self.ops.expert_table(experts, shared)
            if self.table is None and shared is not None and (table := self.ops.expert_table(experts)) is not None:
                self.table, self.shared_inside = table, False     # the shared expert isn't laid out for it

    def forward(self, x, input_ids):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, idx = self.gate(x, input_ids)
        local = idx - self.first
        # every routed expert's w1/w3 reads x: quantise it once (the quantisation is per token)
        xq = self.ops.quantize_per_token(x) if self.experts[self.first].w1.quantized else None
        if self.stack is not None:
            y = self.ops.grouped_experts(x, weights, local, self.stack, xq)
        else:
            shared = self.shared_experts if self.shared_inside else None
            y = self.ops.routed_experts(x, weights, local, self.local_experts(), shared, xq)
        y = all_reduce(y)
        if self.shared_experts is not None and not self.shared_inside:
            y += self.shared_experts(x, xq=xq if self.shared_experts.w1.quantized else None).float()
        return y.to(x.dtype).view(shape)


# --------------------------------------------------------------------------------------------------
# Hyper-connections, blocks, model
# --------------------------------------------------------------------------------------------------

class Block(OpModule):
    def __init__(self, layer_id: int, cfg: ModelConfig, attention=None):
        super().__init__()
        self.cfg = cfg
        mix, width = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * cfg.dim
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = (attention or Attention)(layer_id, cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = MoE(layer_id, cfg)
        for part in ("attn", "ffn"):
            self.register_parameter(f"hc_{part}_fn", nn.Parameter(torch.empty(mix, width, dtype=torch.float32)))
            self.register_parameter(f"hc_{part}_base", nn.Parameter(torch.zeros(mix, dtype=torch.float32)))
            self.register_parameter(f"hc_{part}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))

    def forward(self, h, calls: list[CallPlan], caches: list[LayerCache], input_ids):
        """h, input_ids: every segment's rows (`join`); calls, caches: each segment's plan and cache."""
        h = self.hyper_connection(h, "attn", lambda x: self.attn(self.attn_norm(x), calls, caches))
        return self.hyper_connection(h, "ffn", lambda x: self.ffn(self.ffn_norm(x), input_ids))

    def hyper_connection(self, h, part: str, sublayer):
        """mHC around a sub-layer: collapse the streams h [B,S,hc,D] into its input, mix the streams
        by the Sinkhorn-normalised comb and add its output with the post weights."""
        c = self.cfg
        fn, scale, base = (getattr(self, f"hc_{part}_{name}") for name in ("fn", "scale", "base"))
        x, post, comb = self.ops.mhc_pre(h, fn, scale, base, c.norm_eps, c.hc_eps)
        comb = self.ops.mhc_sinkhorn(comb, c.hc_eps, c.hc_sinkhorn_iters)
        return self.ops.mhc_post(sublayer(x), h, post, comb)


class ParallelEmbedding(nn.Module):
    """Vocabulary split across ranks; each rank looks up its rows and the results are summed."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        rank, ws = world()
        self.part = vocab // ws
        self.first = rank * self.part
        self.weight = nn.Parameter(torch.empty(self.part, dim))

    def forward(self, ids):
        if world()[1] == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.first
        outside = (local < 0) | (local >= self.part)
        y = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0)
        return all_reduce(y)


class ParallelHead(PackedWeight, OpModule):
    """Untied LM head, vocabulary split across ranks, run in fp32."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab // world()[1], dim))

    def _pack(self, weight):
        return self.ops.pack_linear_fp32(weight)

    def _unpack(self, packed):
        return self.ops.unpack_linear_fp32(packed)

    def forward(self, y):
        logits = self.ops.linear_fp32(y, self.weight, self.packed)
        ws = world()[1]
        if ws > 1:
            parts = [torch.empty_like(logits) for _ in range(ws)]
            dist.all_gather(parts, logits.contiguous())
            logits = torch.cat(parts, dim=-1)
        return logits


class MTPBlock(Block):
    """Next-next-token block: mixes embed(t_{p+1}) with the trunk's streams at p, then one
    window-only block, its own hc_head and norm, and the shared LM head."""

    def __init__(self, stage: int, cfg: ModelConfig):
        super().__init__(cfg.n_layers + stage, cfg)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.e_proj = Linear(cfg.dim, cfg.dim)
        self.h_proj = Linear(cfg.dim, cfg.dim)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hc_head_fn = nn.Parameter(torch.empty(cfg.hc_mult, cfg.hc_mult * cfg.dim, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, h_prev, next_ids, calls: list[CallPlan], caches: list[LayerCache], embed):
        """The block's streams (before its hc_head)."""
        e = self.enorm(embed(next_ids))
        x = self.e_proj(e).unsqueeze(2) + self.h_proj(self.hnorm(h_prev))
        return super().forward(x, calls, caches, next_ids)

    def logits(self, x, head):
        """fp32 logits from the block's streams x, through the shared LM head."""
        y = self.ops.mhc_head(x, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self.cfg.norm_eps,
                             self.cfg.hc_eps)
        return head(self.norm(y))


class BlockPlan:
    """What a DSpark block's stages share: its slots' positions n..n+S-1 after the anchor's position n
    (RoPE rows, theta without YaRN as every ratio-0 layer), and the ring rows every query of the block
    sees: the target features of the last `window` committed positions n-window..n-1."""

    def __init__(self, anchor_pos: torch.Tensor, size: int, state: DecodeState, cfg: ModelConfig):
        B, dev = anchor_pos.shape[0], anchor_pos.device
        cos, sin = state.rope["main"]
        p = (anchor_pos[:, None] + torch.arange(size, device=dev)).clamp(max=cos.shape[0] - 1)
        self.cos, self.sin = cos[p].unsqueeze(2), sin[p].unsqueeze(2)
        q, R = anchor_pos[:, None] - 1, state.ring                               # the newest committed position
        slot_pos = q - (q - torch.arange(R, device=dev)) % R                      # [B,R] position each slot holds
        seen = (slot_pos >= 0) & (slot_pos > q - cfg.window_size)
        self.ring_mask = seen[:, None].expand(B, size, R)
        self.block_mask = torch.ones(B, size, size, dtype=torch.bool, device=dev)   # non-causal within the block


class DSparkAttention(Attention):
    """A DSpark stage's attention (ratio 0): a block's queries attend, non-causally, to the block's own keys
    and to the stage's window ring, which holds RoPE(kv_norm(wkv(main_x))) of committed positions only."""

    def write(self, main_x, call: CallPlan, cache: LayerCache) -> None:
        """The ring rows of a segment's committed positions (`call`'s real rows) from its main_x [B,S,D]."""
        cos, sin = call.rope["main"]
        call.write_ring(cache.win, self.ops.rope(self.kv_norm(self.wkv(main_x)), cos[:, :, 0], sin[:, :, 0]))

    def block(self, x, plan: BlockPlan, cache: LayerCache):
        B = x.shape[0]
        q = self.ops.rope(self.query(self.q_norm(self.wq_a(x))), plan.cos, plan.sin)
        kv = self.ops.rope(self.kv_norm(self.wkv(x)), plan.cos[:, :, 0], plan.sin[:, :, 0])
        sources = [(cache.win[:B], plan.ring_mask, None), (kv, plan.block_mask, None)]
        o = self.ops.sparse_attention(q, sources, self.attn_sink, self.scale)
        return self.output(self.ops.rope(o, plan.cos, -plan.sin))


class MarkovHead(OpModule):
    """A token's Markov embedding (markov_w1, looked up by the previous token) and the bias it adds to the
    next slot's logits (markov_w2, stored [vocab, rank]); both split along the vocabulary."""
    tp_split = {"vocab_size": ("markov_w1", "markov_w2")}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.markov_w1 = ParallelEmbedding(cfg.vocab_size, cfg.dspark_markov_rank)
        self.markov_w2 = ParallelHead(cfg.vocab_size, cfg.dspark_markov_rank)

    def forward(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the embedding [B, rank] of the tokens prev [B], the bias fp32 [B, V] they give the next slot)."""
        e = self.markov_w1(prev)
        return e, self.markov_w2(e)


class ConfidenceHead(OpModule):
    """A logit per block slot: sigmoid of it estimates the chance the slot's draft is accepted, given that
    the drafts before it were."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.proj = Linear(cfg.dim + cfg.dspark_markov_rank, 1, float_only=True)

    def forward(self, x, e):
        """x [B,S,D]: the drafter's hidden after hc_head (before its norm); e [B,S,rank]: each slot's
        Markov embedding (of the token before its draft)."""
        return self.ops.linear_fp32(torch.cat([x, e], -1), self.proj.weight)[..., 0]


class DSparkStage(Block):
    """One of the 0731 drafter's stages (`mtp.N`): a trunk block whose attention is DSparkAttention. The
    first stage also projects the target features (main_proj, main_norm); the last holds the drafter's
    hc_head and norm, the Markov and confidence heads; W8A8 checkpoints give the first its own embedding
    and the last its own head (unrotated copies of the trunk's)."""
    tp_split = {"vocab_size": ("embed", "head")}

    def __init__(self, stage: int, cfg: ModelConfig):
        super().__init__(cfg.n_layers + stage, cfg, DSparkAttention)
        first, last = stage == 0, stage == cfg.n_mtp_layers - 1
        if first:
            self.main_proj = Linear(len(cfg.dspark_target_layer_ids) * cfg.dim, cfg.dim)
            self.main_norm = RMSNorm(cfg.dim, cfg.norm_eps)
            if cfg.dspark_vocab_copies:
                self.embed = ParallelEmbedding(cfg.vocab_size, cfg.dim)
        if last:
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.hc_head_fn = nn.Parameter(torch.empty(cfg.hc_mult, cfg.hc_mult * cfg.dim, dtype=torch.float32))
            self.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult, dtype=torch.float32))
            self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
            self.markov_head = MarkovHead(cfg)
            self.confidence_head = ConfidenceHead(cfg)
            if cfg.dspark_vocab_copies:
                self.head = ParallelHead(cfg.vocab_size, cfg.dim)

    def forward(self, h, plan: BlockPlan, cache: LayerCache):
        """A block's streams h [B,S,hc,D] through the stage (its MoE routes every slot on its own state)."""
        h = self.hyper_connection(h, "attn", lambda x: self.attn.block(self.attn_norm(x), plan, cache))
        return self.hyper_connection(h, "ffn", lambda x: self.ffn(self.ffn_norm(x), None))


# Each drafter kind's stage module, built as `stage(i, cfg)` for its layers mtp.0..
STAGES = {DSPARK: DSparkStage, MTP: MTPBlock}


class Transformer(OpModule):
    tp_split = {"vocab_size": ("embed", "head")}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = ParallelEmbedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([Block(i, cfg) for i in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = ParallelHead(cfg.vocab_size, cfg.dim)
        self.hc_head_fn = nn.Parameter(torch.empty(cfg.hc_mult, cfg.hc_mult * cfg.dim, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        kind = drafter_kind(cfg)         # None only with no drafter layers
        self.mtp = nn.ModuleList([STAGES[kind](i, cfg) for i in range(cfg.n_mtp_layers)])
        self.target_layers = kind.target_layers(cfg) if kind else ()     # whose outputs the drafter reads

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def prepare(self) -> "Transformer":
        """Bind the device's kernel module to every module and lay the loaded weights out for it: routing
        on the host, big weights packed in the kernels' own layout (where they have one), the routed
        experts' path chosen (`MoE.prepare_experts`)."""
        device = self.embed.weight.device
        ops, platform = kernels.module_for(device), platforms.for_device(device)
        for module in self.modules():
            packed = isinstance(module, PackedWeight)
            if packed and not platform.packs_weights:
                module.unpack()        # by the kernels that packed it: this platform reads plain weights
            if isinstance(module, OpModule):
                module.ops = ops
            if packed and platform.packs_weights:
                module.pack()
        for moe in (m for m in self.modules() if isinstance(m, MoE)):
            moe.prepare_experts(platform.routes_on_host)
        return self

    def forward_segments(self, segments: list[Segment]) -> list["TrunkRows"]:
        """The trunk over several chunks in one pass (a step's prefill chunks and decode rows; the model's
        one cached entry point): the token-wise work (embedding, mHC, norms, projections, MoE) runs once
        over all their rows, attention per segment, in the order given, so a later segment's state writes
        land after an earlier one's. Returns each segment's streams [B,S,hc,D] (before hc_head: `logits`)
        and, for a drafter with target layers (DrafterKind.target_layers), its target features
        [B,S,len(target layers)*D]: the mean over the hc streams of each target layer's output."""
        calls = [CallPlan(s.tokens, s.start, s.state, context=s.context, length=s.length) for s in segments]
        tokens = join([s.tokens for s in segments])
        h = self.embed(tokens).unsqueeze(2).repeat(1, 1, self.cfg.hc_mult, 1)
        features = []
        for i, layer in enumerate(self.layers):
            h = layer(h, calls, [s.state.layers[i] for s in segments], tokens)
            if i in self.target_layers:
                features.append(h.mean(2))
        shapes = [call.shape for call in calls]
        feats = split(torch.cat(features, -1), shapes) if features else [None] * len(segments)
        return [TrunkRows(x, f) for x, f in zip(split(h, shapes), feats)]

    def logits(self, h):
        """fp32 logits from the trunk's streams h [..., hc, D]."""
        y = self.ops.mhc_head(h, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self.cfg.norm_eps,
                              self.cfg.hc_eps)
        return self.head(self.norm(y))

    def mtp_forward_segments(self, hidden: list[torch.Tensor], segments: list[Segment]) -> list[torch.Tensor]:
        """The MTP layer over several segments in one pass (as `forward_segments`): row p from the streams
        `hidden` at p and the segment's token at p, t_{p+1}. Returns each segment's MTP streams (usable as
        `hidden` for a deeper draft; `mtp_logits` gives their logits)."""
        calls = [CallPlan(s.tokens, s.start, s.state, compressed=False, length=s.length) for s in segments]
        x = self.mtp[0](join(hidden), join([s.tokens for s in segments]), calls, [s.state.drafter[0] for s in segments],
                        self.embed)
        return split(x, [call.shape for call in calls])

    def mtp_logits(self, x):
        """fp32 logits from the MTP layer's streams, through the shared LM head."""
        return self.mtp[0].logits(x, self.head)

    def dspark_context(self, features):
        """The drafter's view of target features [B,S,3D]: main_x [B,S,D] = main_norm(main_proj(features)),
        the rows every stage projects into its ring."""
        first = self.mtp[0]
        return first.main_norm(first.main_proj(features))

    def dspark_write(self, main_x, segment: Segment) -> None:
        """Each stage's ring gets the segment's real rows of main_x (`segment.length`: the committed ones)."""
        call = CallPlan(segment.tokens, segment.start, segment.state, compressed=False,
                        length=segment.length)
        for stage, cache in zip(self.mtp, segment.state.drafter):
            stage.attn.write(main_x, call, cache)

    def dspark_block(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, state: DecodeState,
                     slots: int | None = None):
        """One draft pass: the block [anchor, noise x (size-1)] at positions anchor_pos.. through the stages,
        each attending to its ring of state (the slots' views). Returns (base logits fp32 [B,n,V], the
        drafter's hidden after hc_head and before its norm [B,n,D]) of the block's first n = `slots` slots (all
        by default: the whole block runs through the stages either way, the head only for these); slot k's
        logits are for the position after its own."""
        c, size = self.cfg, self.cfg.dspark_block_size
        noise = torch.full_like(anchor[:, None], c.dspark_noise_token_id).expand(-1, size - 1)
        ids = torch.cat([anchor[:, None], noise], 1)
        first, last = self.mtp[0], self.mtp[-1]
        h = getattr(first, "embed", self.embed)(ids).unsqueeze(2).repeat(1, 1, c.hc_mult, 1)
        plan = BlockPlan(anchor_pos, size, state, c)
        for stage, cache in zip(self.mtp, state.drafter):
            h = stage(h, plan, cache)
        y = self.ops.mhc_head(h, last.hc_head_fn, last.hc_head_scale, last.hc_head_base, c.norm_eps, c.hc_eps)
        y = y[:, :slots]
        return getattr(last, "head", self.head)(last.norm(y)), y

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, return_hidden: bool = False):
        """Logits [B,S,V] (fp32) for fresh sequences starting at position 0 (and the streams)."""
        B, S = input_ids.shape
        start = torch.zeros(B, dtype=torch.long, device=input_ids.device)
        (rows,) = self.forward_segments([Segment(input_ids, start, DecodeState(self, B, S, max_draft=0))])
        logits = self.logits(rows.hidden)
        return (logits, rows.hidden) if return_hidden else logits

    @torch.no_grad()
    def mtp_forward(self, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """MTP logits [B,S,V] of fresh sequences: row p from trunk streams at p and token next_ids[:, p] = t_{p+1}."""
        B, S = next_ids.shape
        start = torch.zeros(B, dtype=torch.long, device=next_ids.device)
        (x,) = self.mtp_forward_segments([hidden], [Segment(next_ids, start, DecodeState(self, B, S, max_draft=0))])
        return self.mtp_logits(x)
