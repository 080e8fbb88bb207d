"""What a step gives the host: one packed tensor, made on the device and read back in one host read.

A row per decode slot [0, batch), then one per prompt that ended in the step; its columns, each part only
where the step has it (`StepLayout`):
    tokens      D+1        the candidates: L+1 for a decode row (its committed ones first), a prompt's first token
    accepted    1          the drafts accepted (0 for a first token)
    confidence  D          the next drafts' confidences (DSpark: the scheduler chooses how many to verify)
    drafts      D          the next drafts (masked steps: the host computes their rows' masks)
    logprobs    (D+1)·W    each candidate's logprob row, W wide (`token_logprobs`)
int64, or float64 where a float part is there (token ids stay exact). A step with scored prompt chunks also
returns their rows' logprob rows, read in the same host read.
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .request import TokenLogprob
from .sampling import MASKED_LOGPROB, TOP_LOGPROBS


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, given: torch.Tensor | None = None) -> torch.Tensor:
    """Processed logits [B,R,V] and the token taken at each row [B,R] -> logprob rows [B,R,1+2W(+G)] float64: the
    token's logprob, the W = TOP_LOGPROBS highest logprobs and their ids (exact in float64), then the logprobs of
    the `given` ids [B,R,G] of each row."""
    lp = logits.log_softmax(-1).clamp(min=MASKED_LOGPROB)     # a token a grammar forbids: -inf, which JSON lacks
    top = lp.topk(min(TOP_LOGPROBS, lp.shape[-1]), -1)
    parts = [lp.gather(-1, tokens[..., None]), top.values, top.indices.to(lp.dtype)]
    return torch.cat(parts + ([lp.gather(-1, given)] if given is not None else []), -1).double()


def read_logprob(token: int, row: list[float], n_top: int, given: int = 0) -> TokenLogprob:
    """A logprob row (`token_logprobs`) read back on the host, with the request's `n_top` alternatives (and the
    logprobs of its `given` ids, last)."""
    w = (len(row) - 1 - given) // 2
    top = [(int(t), v) for v, t in zip(row[1: 1 + n_top], row[1 + w: 1 + w + n_top])]
    return TokenLogprob(token, row[0], top, row[1 + 2 * w:])


class Rows(NamedTuple):
    """Rows of a step's result on the device, before packing."""
    tokens: torch.Tensor                    # [N, C] candidates, C <= D+1
    accepted: torch.Tensor                  # [N]
    confidence: torch.Tensor | None         # [N, D]
    drafts: torch.Tensor | None             # [N, >= D]
    logprobs: torch.Tensor | None           # [N, C, W]


class RowResult(NamedTuple):
    """A row of a step's result on the host."""
    tokens: list[int]                       # the candidates; the committed ones: tokens[:accepted + 1]
    accepted: int
    confidence: list[float] | None
    drafts: list[int] | None
    logprobs: list[list[float]] | None      # a logprob row per candidate


class StepLayout(NamedTuple):
    """The packed tensor's columns for a drafter drafting `depth` (D) tokens a step."""
    depth: int
    confidence: bool
    drafts: bool
    logprobs: bool

    @classmethod
    def of(cls, key, depth: int, confidences: bool) -> "StepLayout":
        """The layout of the step `key` (a StepKey) of a runner drafting `depth`, reporting `confidences`."""
        return cls(depth, confidences, key.sampling.masked and depth > 0, key.sampling.logprobs)

    def pack(self, parts: list[Rows], device: torch.device) -> torch.Tensor:
        """The parts' rows in one tensor, on the `device`."""
        d = self.depth
        if not parts:
            return torch.empty(0, d + 2, dtype=torch.long, device=device)
        columns = [torch.cat([F.pad(p.tokens, (0, d + 1 - p.tokens.shape[1])) for p in parts]),
                   torch.cat([p.accepted for p in parts])[:, None]]
        if self.confidence:
            columns.append(torch.cat([p.confidence for p in parts]))
        if self.drafts:
            columns.append(torch.cat([p.drafts[:, :d] for p in parts]))
        if self.logprobs:
            width = (d + 1) * parts[0].logprobs.shape[-1]     # every row as wide as D+1 candidates' rows
            columns.append(torch.cat([F.pad(p.logprobs.flatten(1), (0, width - p.logprobs[0].numel()))
                                      for p in parts]))
        if self.confidence or self.logprobs:
            columns = [c.double() for c in columns]
        return torch.cat(columns, 1)

    def unpack(self, packed: list[list]) -> list[RowResult]:
        """The packed rows, read back on the host, as named fields."""
        d = self.depth
        results = []
        for row in packed:
            at = d + 2
            confidence = drafts = logprobs = None
            if self.confidence:
                confidence, at = row[at: at + d], at + d
            if self.drafts:
                drafts, at = [int(t) for t in row[at: at + d]], at + d
            if self.logprobs:
                w = (len(row) - at) // (d + 1)
                logprobs = [row[at + j * w: at + (j + 1) * w] for j in range(d + 1)]
            results.append(RowResult([int(t) for t in row[:d + 1]], int(row[d + 1]), confidence, drafts, logprobs))
        return results


def read_step(out: torch.Tensor | tuple[torch.Tensor, torch.Tensor], layout: StepLayout) \
        -> tuple[list[RowResult], list[list[float]]]:
    """A step's results on the host in one read: its rows, and the scored chunks' logprob rows (none unless a
    chunk is scored)."""
    if not isinstance(out, tuple):
        return layout.unpack(out.tolist()), []
    packed, scores = out
    (n, w), width = packed.shape, scores.shape[1]
    flat = torch.cat([packed.double().flatten(), scores.flatten()]).tolist()
    rows = [flat[i:i + w] for i in range(0, n * w, w)]
    return layout.unpack(rows), [flat[i:i + width] for i in range(n * w, len(flat), width)]
