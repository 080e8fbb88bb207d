"""Speculative verification (rejection sampling) of K drafts against the target distributions: the one
verifier every drafter's drafts go through, and the one way a committed token is chosen (a prompt's first
token is a row with no drafts).

Drafts drawn from a distribution q (the drafter's at the request's settings; one-hot where a grammar
forced them) are accepted with probability min(1, p(d)/q(d)); on rejection the token is drawn from the
residual max(p - q, 0), renormalised (p where it has no mass); when every draft is accepted a bonus token is
drawn from the last row. The output is distributed exactly as the target model's, and greedy rows (one-hot
p) get exact-match acceptance. A row may verify fewer drafts than the step has (`limit`): it then commits what a
step of that many drafts commits, token for token (its uniforms are keyed by position, not by step).

That is the token rule (`verify`). The block rule (`verify_block`; Sun et al., "Block Verification
Accelerates Speculative Decoding", ICLR 2025, Algorithm 2) judges the drafts jointly: it keeps the longest
prefix whose stop test passes, where each prefix's test weighs what the drafts before it carried, and draws
the correction from that prefix's own residual. Its output is distributed as the target's too, and its
expected accepted length is never below the token rule's; on greedy rows it is prefix matching.
"""
import torch

from .sampling import (
    RNG_ACCEPT,
    RNG_DRAW,
    SamplingMode,
    SlotParams,
    hold_stops,
    processed_logits,
    sample_from,
    target_probs,
    uniform,
)
from .step_result import token_logprobs


def commit_rows(logits: torch.Tensor, drafts: torch.Tensor, sp: SlotParams, b: slice, pos: torch.Tensor,
                mode: SamplingMode, *, q: torch.Tensor | None = None, limit: torch.Tensor | None = None,
                block: bool = False):
    """The tokens K drafts commit: logits [B,K+1,V] of the rows [last, drafts] at positions pos.. of the
    slots `b` of `sp`, drafts [B,K] (K = 0: a prompt's first token), chosen as `mode` says: greedy rows take
    the logits' argmax (the tokens their distributions give); with logprobs, each candidate is scored by its
    own row's processed distribution (a correction token reports its probability under the model, not under
    the residual it was drawn from).
    `q` [B,K,V]: the distributions the drafts were drawn from (None only with K = 0); `limit` [B]: the
    drafts each row verifies, at most K (None: K); `block`: sampled rows verify by the block rule.
    Returns (tokens [B,K+1], n_accepted [B], what `token_logprobs` gives for the tokens or None)."""
    if mode.greedy:
        return (*verify_greedy(logits.argmax(-1), drafts, limit), None)
    k = drafts.shape[1]
    # row i is conditioned on drafts 1..i as output tokens: count them for the penalties
    counts = sp.output_counts[b, None].expand(-1, k + 1, -1)
    if k:
        onehot = torch.zeros_like(counts).scatter_(-1, drafts[..., None], 1.0).cumsum(1)
        counts = counts + torch.cat([torch.zeros_like(onehot[:, :1]), onehot], 1)[:, : k + 1]
    processed = hold_stops(processed_logits(logits, sp, b, counts), sp, b, pos)
    rule = verify_block if block and k else verify
    tokens, n_acc = rule(target_probs(processed, sp, b, mode.sort), drafts, sp.seed[b], pos, q, limit)
    return tokens, n_acc, token_logprobs(processed, tokens) if mode.logprobs else None


def verify(probs: torch.Tensor, drafts: torch.Tensor, seed: torch.Tensor, pos: torch.Tensor,
           q: torch.Tensor | None = None, limit: torch.Tensor | None = None):
    """Speculative verification of K drafts with K+1 target rows.

    probs [B,K+1,V]: row i is the target distribution after the i-th draft; drafts [B,K] drawn from q
    [B,K,V] (None only with K = 0); pos [B] the position of row 0; limit [B] the drafts each row
    verifies (None: K; 0: the row samples its first distribution, as plain decoding). Returns (tokens [B,K+1],
    n_accepted [B]): the committed tokens are tokens[:, :n_accepted+1] (accepted drafts, then a correction
    or bonus token).
    """
    B, R, _ = probs.shape
    K = R - 1
    rows = pos[:, None] + torch.arange(R, device=probs.device)
    if K:
        # min(1, p/q): a draft q never draws (q = 0) is accepted only where p has it
        ratio = probs[:, :K].gather(-1, drafts.unsqueeze(-1)) / q.gather(-1, drafts.unsqueeze(-1))
        accept = uniform(seed[:, None], rows[:, :K], RNG_ACCEPT) < ratio.squeeze(-1)
        if limit is not None:
            accept &= torch.arange(K, device=probs.device) < limit[:, None]
        n_acc = accept.long().cumprod(-1).sum(-1)                                   # leading accepts
    else:
        n_acc = torch.zeros(B, dtype=torch.long, device=probs.device)
    return _draw_last(probs, drafts, seed, pos, n_acc, limit, q), n_acc


def verify_block(probs: torch.Tensor, drafts: torch.Tensor, seed: torch.Tensor, pos: torch.Tensor, q: torch.Tensor,
                 limit: torch.Tensor | None = None):
    """`verify` by the block rule, for K >= 1 drafts: the row keeps the longest prefix i whose uniform passes
    its test h_i (`_block_tests`; 0 if none), then draws from r_i, or from p_{L+1} after the whole block. Same
    arguments and result as `verify`."""
    K = probs.shape[1] - 1
    dev = probs.device
    L, _, w, test = _block_tests(probs, drafts, q, limit)
    prefix = torch.arange(K + 1, device=dev)
    eta = uniform(seed[:, None], pos[:, None] + torch.arange(K, device=dev), RNG_ACCEPT)  # [B,K]: prefixes 1..K
    passed = (eta <= test[:, 1:]) & (prefix[1:] <= L[:, None])
    n_acc = (passed.long() * prefix[1:]).amax(-1)                                          # the longest, or 0
    return _draw_last(probs, drafts, seed, pos, n_acc, L, q, w.gather(1, n_acc[:, None])), n_acc


def _block_tests(probs: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor, limit: torch.Tensor | None):
    """The block rule's quantities for K >= 1 drafts (arguments as `verify`): with w_0 = 1 and
    w_i = min(1, w_{i-1} p_i(d_i) / q_i(d_i)) (the mass drafts 1..i carry), the residual after i accepted drafts
    is r_i = max(w_i p_{i+1} - q_{i+1}, 0) and the test of prefix i is h_i = |r_i| / (|r_i| + 1 - w_i), that of
    the whole block (i = L, the row's limit) h_L = w_L. Returns (L [B], p/q [B,K], w [B,K+1], h [B,K+1])."""
    B, R, V = probs.shape
    K = R - 1
    dev = probs.device
    L = torch.full((B,), K, device=dev) if limit is None else limit.clamp(max=K)
    p_draft = probs[:, :K].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)                  # [B,K]
    # p/q; a draft q never draws (q = 0) carries mass only where p has it
    ratio = (p_draft / q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)).nan_to_num(0.0)
    w = [torch.ones(B, device=dev)]
    for i in range(K):
        w.append(torch.where(w[-1] > 0, torch.minimum(w[-1] * ratio[:, i], torch.ones_like(w[-1])), 0.0))
    w = torch.stack(w, 1)                                                                   # [B,K+1]: w_0..w_K
    mass = (w[:, :K, None] * probs[:, :K] - q).clamp_(min=0.0).sum(-1)                    # |r_i|, i < K
    # 1 - w first: where w_i rounds to 1 a tiny |r_i| gives h_i = 1, not |r_i| / 0
    test = torch.where(mass > 0, mass / (mass + (1.0 - w[:, :K])).clamp(min=1e-30), 0.0)  # h_0..h_{K-1}
    test = torch.cat([test, w[:, K:]], 1)                                                  # h_K: never used as a prefix
    prefix = torch.arange(K + 1, device=dev)
    test = torch.where(prefix == L[:, None], w.gather(1, L[:, None]).expand(-1, K + 1), test)   # h_L = w_L
    return L, ratio, w, test


def expected_accepted(probs: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor, limit: torch.Tensor | None = None,
                      block: bool = False) -> torch.Tensor:
    """The drafts each row accepts on average over the verifier's uniforms, given these drafts (arguments as
    `verify`, K >= 1): the token rule's sum over i of prod_{j<=i} min(1, p_j(d_j) / q_j(d_j)); the block rule's
    sum over i of P(some prefix >= i passes) = 1 - prod_{j=i..L} (1 - h_j). Averaged over drafted blocks it is
    each rule's expected acceptance, compared on the same blocks (`benchmarks/verify_rules.py`). [B] float."""
    K = probs.shape[1] - 1
    L, ratio, _, test = _block_tests(probs, drafts, q, limit)
    inside = torch.arange(1, K + 1, device=probs.device) <= L[:, None]                   # prefixes 1..L
    if not block:
        return (ratio.clamp(max=1.0).cumprod(-1) * inside).sum(-1)
    fail = torch.where(inside, 1.0 - test[:, 1:].clamp(max=1.0), 1.0)
    return (inside * (1.0 - fail.flip(1).cumprod(1).flip(1))).sum(-1)


def _draw_last(probs: torch.Tensor, drafts: torch.Tensor, seed: torch.Tensor, pos: torch.Tensor, n_acc: torch.Tensor,
               limit: torch.Tensor | None, q: torch.Tensor | None = None, weight: torch.Tensor | None = None):
    """The tokens after `n_acc` [B] kept drafts: those drafts, then one drawn from row n_acc, the residual
    max(w p - q, 0) where the row rejected (w: `weight` [B,1], 1 for the token rule), else the row itself (the
    bonus after all `limit` drafts). Returns tokens [B,K+1]."""
    B, R, V = probs.shape
    K = R - 1
    row = probs.gather(1, n_acc.view(B, 1, 1).expand(-1, 1, V)).squeeze(1)
    if K:
        q_row = q.gather(1, n_acc.clamp(max=K - 1).view(B, 1, 1).expand(-1, 1, V)).squeeze(1)
        residual = ((row if weight is None else weight * row) - q_row).clamp_(min=0.0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, row)
        row = torch.where((n_acc < (K if limit is None else limit.clamp(max=K)))[:, None], residual, row)
    last = sample_from(row, uniform(seed, pos + n_acc, RNG_DRAW))
    return torch.cat([drafts, last[:, None]], 1).scatter(1, n_acc[:, None], last[:, None])


def verify_greedy(targets: torch.Tensor, drafts: torch.Tensor, limit: torch.Tensor | None = None):
    """`verify` for rows whose target distributions are one-hot at `targets` [B,K+1] (the argmax of
    each row's logits): a draft is accepted when it equals its row's argmax, and the correction or bonus
    is the argmax of the first row not accepted. Returns what `verify` returns for them."""
    B, R = targets.shape
    K = R - 1
    if K:
        accept = drafts == targets[:, :K]
        if limit is not None:
            accept &= torch.arange(K, device=targets.device) < limit[:, None]
        n_acc = accept.long().cumprod(-1).sum(-1)
    else:
        n_acc = torch.zeros(B, dtype=torch.long, device=targets.device)
    last = targets.gather(1, n_acc[:, None])
    tokens = torch.cat([drafts, last], 1) if K else last
    return tokens.scatter(1, n_acc[:, None], last), n_acc
