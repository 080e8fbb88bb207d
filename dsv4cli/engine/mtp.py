"""The MTP step: drafting with the checkpoint's MTP layer (the proposer of speculative decoding).

The MTP layer runs over the rows the trunk just ran, row p taking the trunk's streams at p and token
p+1, so its window has no holes. The row of the last committed token gives draft 1; for depth K > 1 the
layer runs again on its own streams and its latest draft, one position further per draft (the vLLM
convention). Drafts are greedy (argmax), which keeps verification exact (`verify.py`).
"""
import torch

from dsv4cli.model import DecodeState, Transformer


class MTPDrafter:
    """`depth` (K) drafts per step from `model`'s MTP layer, writing its caches of the DecodeState given."""

    def __init__(self, model: Transformer, depth: int):
        self.model, self.depth = model, depth

    def after_prompt_chunk(self, hidden, next_ids, start, cache: DecodeState, last: bool) -> torch.Tensor | None:
        """MTP over a prefill chunk's rows (hidden: the trunk's streams, next_ids [1,S] token p+1 per row);
        after the prompt's last chunk, the first drafts [1, K]."""
        logits, streams = self.model.mtp_forward_chunk(hidden, next_ids, start, cache)
        if not last:
            return None
        return self._drafts_from(logits[:, -1], streams[:, -1:], start + next_ids.shape[1], cache)

    def after_verify(self, hidden, drafts, tokens, n_acc, pos, cache: DecodeState) -> torch.Tensor:
        """The next drafts [B, K] after a verified step (hidden: the trunk's streams over [last, drafts]
        at pos.., tokens/n_acc: what verify committed). Every verified row runs, with the committed token
        where there is one; rejected rows leave position-addressed garbage the next step rewrites."""
        nxt = torch.cat([drafts, drafts[:, :1]], 1).scatter(1, n_acc[:, None], tokens.gather(1, n_acc[:, None]))
        logits, streams = self.model.mtp_forward_chunk(hidden, nxt, pos, cache)
        sel = n_acc.view(-1, 1, 1)
        last_logits = logits.gather(1, sel.expand(-1, 1, logits.shape[-1]))[:, 0]
        last_streams = streams.gather(1, sel[..., None].expand(-1, 1, *streams.shape[2:]))
        return self._drafts_from(last_logits, last_streams, pos + n_acc + 1, cache)

    def _drafts_from(self, logits, streams, pos, cache: DecodeState) -> torch.Tensor:
        """Greedy drafts [B, K] at positions pos..: the first from `logits` (the MTP row before pos),
        each next one from the MTP layer run again on its own streams and the latest draft."""
        draft = logits.argmax(-1)
        drafts = [draft]
        for i in range(1, self.depth):
            lg, streams = self.model.mtp_forward_chunk(streams, draft[:, None], pos + i - 1, cache)
            draft = lg[:, -1].argmax(-1)
            drafts.append(draft)
        return torch.stack(drafts, 1)
