"""The preview checkpoints' drafter: the MTP layer, chained for depth K.

The MTP layer runs over the rows the trunk just ran, row p taking the trunk's streams at p and token
p+1, so its window has no holes. The row of the newest committed token's predecessor gives draft 1; for
depth K > 1 the layer runs again on its own streams and its latest draft, one position further per draft
(the vLLM convention). Drafts are greedy (argmax), which keeps verification exact (`verify.py`).
"""
import torch

from dsv4cli.model import Segment, Transformer
from dsv4cli.model.model import join, rows_at, split

from .drafter import DraftRows, Proposal
from .sampling import SamplingMode


class MTPDrafter:
    """`depth` (K) drafts per step from `model`'s MTP layer, writing its caches of the DecodeState given."""

    def __init__(self, model: Transformer, depth: int):
        self.model, self.depth = model, depth

    def propose(self, rows: list[DraftRows], mode: SamplingMode) -> list[Proposal]:
        """Every row of every segment through the MTP layer in one pass (rejected rows leave
        position-addressed garbage the next step rewrites), then the chained drafts of those that want them
        (argmaxes whatever the requests' settings)."""
        segments = [Segment(r.next_ids, r.start, r.cache, length=r.length) for r in rows]
        streams = self.model.mtp_forward_segments([r.hidden for r in rows], segments)
        wanted = [(r, rows_at(x, r.committed - 1)) for r, x in zip(rows, streams) if r.wanted]
        drafts = self._chain([(x, r.start + r.committed, r.cache) for r, x in wanted]) if wanted else []
        return [Proposal(d, None, None) for d in drafts]

    def _chain(self, starts: list[tuple[torch.Tensor, torch.Tensor, object]]) -> list[torch.Tensor]:
        """Greedy drafts [B, K] at positions pos.. for each (streams [B,1,hc,D] of the MTP row before pos,
        pos, cache): the first from those streams, each next one from the MTP layer run again on its own
        streams and the latest draft, one pass and one head call for all of them."""
        streams = [x for x, _, _ in starts]
        drafts = [[] for _ in starts]
        for i in range(self.depth):
            if i:
                segments = [Segment(d[-1][:, None], pos + i - 1, cache) for d, (_, pos, cache) in zip(drafts, starts)]
                streams = self.model.mtp_forward_segments(streams, segments)
            logits = split(self.model.mtp_logits(join(streams)), [x.shape[:2] for x in streams])
            for d, lg in zip(drafts, logits):
                d.append(lg[:, -1].argmax(-1))
        return [torch.stack(d, 1) for d in drafts]
