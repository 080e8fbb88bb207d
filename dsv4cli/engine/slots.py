"""Every per-slot device tensor of the engine in one object. A slot holds one running request; a step
reads and writes slots [0, nb) in place, and a prefill chunk its slot's views, so all of this is
preallocated."""
from typing import NamedTuple

import torch

from dsv4cli.model import DecodeState, ModelConfig, Transformer
from dsv4cli.model.drafters import drafter_kind

from .prefix import SPARE_RING_ROWS
from .sampling import SlotParams


class SlotView(NamedTuple):
    """One slot's state as views of one row (writes land in the SlotState): what a prefill chunk reads and
    writes. Views are graph inputs of a compiled chunk, whose guards check their sizes and strides, not
    where they start, so every slot runs one graph."""
    cache: DecodeState
    sampling: SlotParams
    last: torch.Tensor
    pos: torch.Tensor
    drafts: torch.Tensor
    active: torch.Tensor
    draft_q: torch.Tensor | None
    confidence: torch.Tensor | None


class SlotState:
    """The state of `max_batch` slots (B), K = drafts per step, V = vocabulary, R = ring rows.

    cache:     the model's DecodeState, per trunk and drafter layer (model.LayerCache): window KV ring
               [B, R, head_dim], compressor rings [B, R, span*head_dim] and compressed blocks
               [B, max_len/ratio + 1, head_dim] (and the indexer's); positions >= the slot's `pos`
               hold rows the next step rewrites
    last:      [B] long, the last committed token, not yet run through the trunk
    pos:       [B] long, its position
    drafts:    [B, max(K, 1)] long, the drafts the next step verifies (K: the drafter's drafts a step)
    draft_q:   [B, K, V] the distributions they were drawn from (one-hot where a grammar forced them; read in
               sampled steps only)
    confidence: [B, K] each draft's chance of acceptance given the earlier ones (DrafterKind.confidence)
    limit:     [B] long, the drafts a slot's row verifies in a step whose key says `limits` (the host's
               choice, written before the step)
    active:    [B] bool, the slot decodes (free and still-prefilling slots are stepped but keep their
               state: their `pos` names where their rows may be written, see StepRunner.step)
    sampling:  SlotParams, the request's settings: [B] temperature, top_p, top_k, min_p, rep,
               presence, frequency, seed; [B, V] bias (logit_bias), prompt_mask (tokens in the
               prompt), output_counts (how often each token was output)
    """

    def __init__(self, model: Transformer, max_batch: int, max_seq_len: int, depth: int, reuse_prefix: bool):
        device = model.embed.weight.device
        self.cache = self.decode_state(model, max_batch, max_seq_len, depth, reuse_prefix)
        self.last = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.pos = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.drafts = torch.zeros(max_batch, max(depth, 1), dtype=torch.long, device=device)
        self.active = torch.zeros(max_batch, dtype=torch.bool, device=device)
        self.limit = torch.zeros(max_batch, dtype=torch.long, device=device)
        kind = drafter_kind(model.cfg) if depth else None
        self.draft_q = torch.zeros(max_batch, depth, model.cfg.vocab_size, device=device) if kind else None
        self.confidence = torch.zeros(max_batch, depth, device=device) if kind and kind.confidence else None
        self.sampling = SlotParams(max_batch, model.cfg.vocab_size, device)
        self._views: dict[int, SlotView] = {}

    def nbytes(self) -> int:
        """The bytes of every tensor the slots hold, the cache's included."""
        own = [self.last, self.pos, self.drafts, self.active, self.limit, self.draft_q, self.confidence]
        return (self.cache.nbytes() + self.sampling.nbytes()
                + sum(t.numel() * t.element_size() for t in own if t is not None))

    @staticmethod
    def bytes_beside_cache(cfg: ModelConfig, max_batch: int, depth: int) -> int:
        """What `nbytes` counts besides the cache, from the config alone (no model): the sampling settings with
        their [V] rows (a SlotParams on the meta device), and per slot the positions and drafts and the drafts'
        distributions [K, V] (fp32: at V4's vocabulary 2.6 MB a slot for 5 drafts)."""
        kind = drafter_kind(cfg) if depth else None
        per_slot = 8 * (3 + max(depth, 1)) + 1          # last, pos, limit and drafts (long), active (bool)
        if kind:
            per_slot += 4 * depth * cfg.vocab_size + (4 * depth if kind.confidence else 0)
        return SlotParams(max_batch, cfg.vocab_size, "meta").nbytes() + max_batch * per_slot

    @staticmethod
    def decode_state(model: Transformer, max_batch: int, max_seq_len: int, depth: int, reuse_prefix: bool
                     ) -> DecodeState:
        """The cache a SlotState allocates (for a model on the meta device: its size, with nothing allocated). A
        step writes K+1 rows past the last committed token; spare ring rows let a prompt resume a slot."""
        return DecodeState(model, max_batch, max_seq_len, max_draft=max(depth, 1) + 1,
                           spare=SPARE_RING_ROWS if reuse_prefix else 0)

    def view(self, slot: int) -> SlotView:
        """Slot `slot`'s views (cached: a step makes none)."""
        if slot not in self._views:
            one = slice(slot, slot + 1)
            self._views[slot] = SlotView(self.cache.view(slot), self.sampling.view(slot), self.last[one],
                                         self.pos[one], self.drafts[one], self.active[one],
                                         *(None if t is None else t[one] for t in (self.draft_q, self.confidence)))
        return self._views[slot]
