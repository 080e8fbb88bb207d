"""The MTP step: drafting with the checkpoint's MTP layer (the proposer of speculative decoding).

The MTP layer runs over the rows the trunk just ran, row p taking the trunk's streams at p and token
p+1, so its window has no holes. The row of the last committed token gives draft 1; for depth K > 1 the
layer runs again on its own streams and its latest draft, one position further per draft (the vLLM
convention). Drafts are greedy (argmax), which keeps verification exact (`verify.py`).
"""
from typing import NamedTuple

import torch

from dsv4cli.model import DecodeState, Segment, Transformer
from dsv4cli.model.model import last_rows


class PromptRows(NamedTuple):
    """A prefill chunk's rows for the MTP layer: the trunk's streams [1,S,hc,D], next_ids [1,S] (token
    p+1 per row), start [1], the slot's cache view, and whether the chunk ends the prompt."""
    hidden: torch.Tensor
    next_ids: torch.Tensor
    start: torch.Tensor
    cache: DecodeState
    last: bool


class MTPDrafter:
    """`depth` (K) drafts per step from `model`'s MTP layer, writing its caches of the DecodeState given."""

    def __init__(self, model: Transformer, depth: int):
        self.model, self.depth = model, depth

    def after_prompt_chunk(self, hidden, next_ids, start, cache: DecodeState, last: bool,
                           length: torch.Tensor | None = None) -> torch.Tensor | None:
        """MTP over a prefill chunk's rows (hidden: the trunk's streams, next_ids [1,S] token p+1 per row;
        `length` [1]: the real rows of a padded chunk); after the prompt's last chunk, the first drafts [1, K]."""
        # logits of the last row only: the head over every prompt row would be most of the pass
        logits, streams = self.model.mtp_forward_chunk(hidden, next_ids, start, cache, last_only=True, length=length)
        if not last:
            return None
        n = next_ids.shape[1] if length is None else length
        return self._drafts_from([(logits[:, -1], last_rows(streams, length), start + n, cache)])[0]

    def after_verify(self, hidden, drafts, tokens, n_acc, pos, cache: DecodeState,
                     prompts: list[PromptRows] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The next drafts [B, K] after a verified step (hidden: the trunk's streams over [last, drafts]
        at pos.., tokens/n_acc: what verify committed). Every verified row runs, with the committed token
        where there is one; rejected rows leave position-addressed garbage the next step rewrites.
        `prompts`: the step's prefill chunks, run in the same passes before the decode rows (as in the
        trunk); the first drafts [1, K] of each one that ends its prompt come second."""
        nxt = torch.cat([drafts, drafts[:, :1]], 1).scatter(1, n_acc[:, None], tokens.gather(1, n_acc[:, None]))
        segments = [Segment(p.next_ids, p.start, p.cache, last_only=True) for p in prompts]
        outs = self.model.mtp_forward_segments([p.hidden for p in prompts] + [hidden],
                                               segments + [Segment(nxt, pos, cache)])
        logits, streams = outs[-1]
        sel = n_acc.view(-1, 1, 1)
        last_logits = logits.gather(1, sel.expand(-1, 1, logits.shape[-1]))[:, 0]
        last_streams = streams.gather(1, sel[..., None].expand(-1, 1, *streams.shape[2:]))
        starts = [(lg[:, -1], st[:, -1:], p.start + p.next_ids.shape[1], p.cache)
                  for (lg, st), p in zip(outs, prompts) if p.last]
        *firsts, new = self._drafts_from(starts + [(last_logits, last_streams, pos + n_acc + 1, cache)])
        return new, firsts

    def _drafts_from(self, starts) -> list[torch.Tensor]:
        """Greedy drafts [B, K] at positions pos.. for each (logits, streams, pos, cache): the first from
        `logits` (the MTP row before pos), each next one from the MTP layer run again on its own streams
        and the latest draft, one pass for all of them."""
        drafts = [[logits.argmax(-1)] for logits, *_ in starts]
        streams = [s for _, s, _, _ in starts]
        for i in range(1, self.depth):
            outs = self.model.mtp_forward_segments(
                streams, [Segment(d[-1][:, None], pos + i - 1, cache) for d, (_, _, pos, cache) in zip(drafts, starts)])
            for d, (lg, _) in zip(drafts, outs):
                d.append(lg[:, -1].argmax(-1))
            streams = [st for _, st in outs]
        return [torch.stack(d, 1) for d in drafts]
