"""The proposer of speculative decoding behind one interface: the step hands the checkpoint's drafter what
the trunk computed over the step's rows and which of them were committed, and gets drafts back for every
sequence that decodes on. The verifier (`verify.py`) is shared: it checks drafts whatever made them.

One proposer per drafter kind (`runner.PROPOSERS`; what the rest of the engine knows of a kind is its
description, `model.drafters.DrafterKind`): the preview checkpoints' MTP layer, chained for depth K (`mtp.py`),
and the 0731 checkpoints' DSpark block drafter (`dspark.py`). A drafter keeps its own position-addressed state
in the step's DecodeState, so rows a step rejects leave nothing it reads later.
"""
from typing import NamedTuple, Protocol

import torch

from dsv4cli.model import DecodeState

from .sampling import SamplingMode, SlotParams


class DraftRows(NamedTuple):
    """One segment of a step as the drafter sees it: rows at positions start[b].. of `cache`.

    hidden:    the trunk's streams over the rows [B,S,hc,D]
    features:  the trunk's target features over the rows [B,S,F] (model.TrunkRows; None where the kind reads
               no target layers)
    next_ids:  [B,S] the token after each row, p+1: the committed one where there is one
    start:     [B]
    cache:     the segment's DecodeState (or a slot's view)
    committed: [B] rows whose tokens are committed; the newest committed token is next_ids at row
               committed-1, at position start+committed: the drafts follow it
    length:    [B] a padded chunk's real rows (model.Segment), or None
    wanted:    whether the segment needs drafts (decode rows; a prefill chunk that ends its prompt)
    sampling:  the segment's sampling settings, rows `rows` of it (drafts drawn at the request's settings)
    """
    hidden: torch.Tensor
    features: torch.Tensor | None
    next_ids: torch.Tensor
    start: torch.Tensor
    cache: DecodeState
    committed: torch.Tensor
    length: torch.Tensor | None
    wanted: bool
    sampling: SlotParams
    rows: slice


class Proposal(NamedTuple):
    """A segment's next drafts [B, D] (D: the drafter's drafts a step), the distributions they were drawn
    from [B, D, V] at the requests' settings (None: a step of greedy rows only, whose drafts are argmaxes), and
    each draft's confidence [B, D]: the chance it is accepted given the ones before it (None: the drafter
    doesn't say; DrafterKind.confidence)."""
    drafts: torch.Tensor
    q: torch.Tensor | None
    confidence: torch.Tensor | None


class Drafter(Protocol):
    depth: int      # drafts a step proposes (at most that many are verified)

    def propose(self, rows: list[DraftRows], mode: SamplingMode) -> list[Proposal]:
        """Write this step's rows into the drafter's state and return a Proposal for each segment that
        wants one, in order, drafting as the step's `mode` says (greedy: argmaxes)."""
        ...
