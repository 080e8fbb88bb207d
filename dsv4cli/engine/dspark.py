"""The 0731 checkpoints' drafter: DSpark, a block of drafts from one pass of its stages.

Each step the trunk's target features of the rows it committed (and only those) enter every stage's ring,
position-addressed like the rest of the decode state; then, for each sequence that decodes on, the block
[newest committed token, noise x (size-1)] runs through the stages in one pass, non-causally over the
block and over the ring (`Transformer.dspark_block`). Its logits are the base of each slot's draft; the
Markov head adds, slot by slot, a bias from the token drafted before it, and the draft is drawn from the
biased distribution at the request's settings (the argmax for greedy rows), which the verifier then
takes as q. The confidence head gives each draft's chance of acceptance, for choosing how many to verify.
"""
import torch

from dsv4cli.model import Segment, Transformer
from dsv4cli.model.model import join, rows_at, split

from .drafter import DraftRows, Proposal
from .sampling import RNG_DRAFT, SamplingMode, draft_probs, sample_from, uniform


class DSparkDrafter:
    """`depth` drafts per step (at most the block size; auto's is the whole block) from `model`'s DSpark
    stages, writing their rings in the DecodeState given. The block always runs whole through the stages
    (its rows attend to each other); the head and the Markov head run for the `depth` slots drafted only: at
    batch 1 on a CPU core the head over a block's 5 rows is compute-bound, over one row it is one read."""

    def __init__(self, model: Transformer, depth: int):
        self.model, self.depth = model, depth

    def propose(self, rows: list[DraftRows], mode: SamplingMode) -> list[Proposal]:
        model = self.model
        main_x = split(model.dspark_context(join([r.features for r in rows])), [r.next_ids.shape for r in rows])
        for r, x in zip(rows, main_x):      # committed rows only: a rejected draft leaves no trace
            model.dspark_write(x, Segment(r.next_ids, r.start, r.cache, length=r.committed))
        return [self._block(r, mode) for r in rows if r.wanted]

    def _block(self, r: DraftRows, mode: SamplingMode) -> Proposal:
        """The drafts of one segment's block after its newest committed token (the anchor, at position n)."""
        anchor, n = rows_at(r.next_ids, r.committed - 1)[:, 0], r.start + r.committed
        logits, hidden = self.model.dspark_block(anchor, n, r.cache, self.depth)
        markov = self.model.mtp[-1].markov_head
        prev, drafts, qs, embeddings = anchor, [], [], []
        for i in range(self.depth):        # slot i drafts position n+i+1, biased by the token before it
            e, bias = markov(prev)
            biased = logits[:, i] + bias
            if mode.greedy:
                prev = biased.argmax(-1)
            else:
                q = draft_probs(biased, r.sampling, r.rows, mode.sort)
                prev = sample_from(q, uniform(r.sampling.seed[r.rows], n + i + 1, RNG_DRAFT))
                qs.append(q)
            drafts.append(prev)
            embeddings.append(e)
        confidence = self.model.mtp[-1].confidence_head(hidden, torch.stack(embeddings, 1)).sigmoid()
        return Proposal(torch.stack(drafts, 1), torch.stack(qs, 1) if qs else None, confidence)
