"""The preview checkpoints' drafter: the MTP layer, chained for depth K.

The MTP layer runs over the rows the trunk just ran, row p taking the trunk's streams at p and token
p+1, so its window has no holes. The row of the newest committed token's predecessor gives draft 1; for
depth K > 1 the layer runs again on its own streams and its latest draft, one position further per draft
(the vLLM convention). Each draft is drawn from the layer's distribution at the request's settings (the
argmax for greedy rows), which the verifier takes as q: a sampled draft from a distribution close to the
target's is accepted more often than its argmax, and only drafts drawn from a q leave the block rule room
(with argmax drafts no verifier accepts more than the token rule).
"""
import torch

from dsv4cli.model import Segment, Transformer
from dsv4cli.model.model import join, rows_at, split

from .drafter import DraftRows, Proposal
from .sampling import RNG_DRAFT, SamplingMode, draft_probs, sample_from, uniform


class MTPDrafter:
    """`depth` (K) drafts per step from `model`'s MTP layer, writing its caches of the DecodeState given."""

    def __init__(self, model: Transformer, depth: int):
        self.model, self.depth = model, depth

    def propose(self, rows: list[DraftRows], mode: SamplingMode) -> list[Proposal]:
        """Every row of every segment through the MTP layer in one pass (rejected rows leave
        position-addressed garbage the next step rewrites), then the chained drafts of those that want them,
        drawn as the step's `mode` says."""
        segments = [Segment(r.next_ids, r.start, r.cache, length=r.length) for r in rows]
        streams = self.model.mtp_forward_segments([r.hidden for r in rows], segments)
        wanted = [(r, rows_at(x, r.committed - 1)) for r, x in zip(rows, streams) if r.wanted]
        return self._chain(wanted, mode) if wanted else []

    def _chain(self, wanted: list[tuple[DraftRows, torch.Tensor]], mode: SamplingMode) -> list[Proposal]:
        """The drafts [B, K] after each segment's newest committed token (at position n) from the MTP row
        before it (streams [B,1,hc,D]): the first from those streams, each next one from the MTP layer run
        again on its own streams and the latest draft, one pass and one head call for all segments."""
        starts = [r.start + r.committed for r, _ in wanted]
        streams = [x for _, x in wanted]
        drafts, qs = [[] for _ in wanted], [[] for _ in wanted]
        for i in range(self.depth):
            if i:
                segments = [Segment(d[-1][:, None], n + i - 1, r.cache) for d, n, (r, _) in zip(drafts, starts, wanted)]
                streams = self.model.mtp_forward_segments(streams, segments)
            logits = split(self.model.mtp_logits(join(streams)), [x.shape[:2] for x in streams])
            for d, q, lg, n, (r, _) in zip(drafts, qs, logits, starts, wanted):
                if mode.greedy:
                    d.append(lg[:, -1].argmax(-1))
                else:
                    q.append(draft_probs(lg[:, -1], r.sampling, r.rows, mode.sort))
                    d.append(sample_from(q[-1], uniform(r.sampling.seed[r.rows], n + i + 1, RNG_DRAFT)))
        return [Proposal(torch.stack(d, 1), torch.stack(q, 1) if q else None, None) for d, q in zip(drafts, qs)]
