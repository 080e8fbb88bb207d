"""The proposer of speculative decoding behind one interface: the step hands the checkpoint's drafter what
the trunk computed over the step's rows and which of them were committed, and gets drafts back for every
sequence that decodes on. The verifier (`verify.py`) is shared: it checks drafts whatever made them.

Two kinds: the preview checkpoints' MTP layer, chained for depth K (`mtp.py`), and the 0731 checkpoints'
DSpark block drafter. A drafter keeps its own position-addressed state in the step's DecodeState, so
rows a step rejects leave nothing it reads later.
"""
from typing import NamedTuple, Protocol

import torch

from dsv4cli.model import DecodeState


class DraftRows(NamedTuple):
    """One segment of a step as the drafter sees it: rows at positions start[b].. of `cache`.

    hidden:    the trunk's streams over the rows [B,S,hc,D]
    next_ids:  [B,S] the token after each row, p+1: the committed one where there is one
    start:     [B]
    cache:     the segment's DecodeState (or a slot's view)
    committed: [B] rows whose tokens are committed; the newest committed token is next_ids at row
               committed-1, at position start+committed: the drafts follow it
    length:    [B] a padded chunk's real rows (model.Segment), or None
    wanted:    whether the segment needs drafts (decode rows; a prefill chunk that ends its prompt)
    """
    hidden: torch.Tensor
    next_ids: torch.Tensor
    start: torch.Tensor
    cache: DecodeState
    committed: torch.Tensor
    length: torch.Tensor | None
    wanted: bool


class Drafter(Protocol):
    depth: int      # drafts the step verifies (K)

    def propose(self, rows: list[DraftRows]) -> list[torch.Tensor]:
        """Write this step's rows into the drafter's state and return drafts [B, K] for each segment that
        wants them, in order."""
        ...
