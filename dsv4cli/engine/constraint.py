"""Structured output in the step: a request's grammar masks the vocabulary of every row it commits, the
rows of its drafts included.

The host keeps a matcher (llguidance) per constrained slot, advanced over the tokens the slot commits.
For a call of the step it computes, for each row the call commits from (a prompt's last row; a decode
slot's [last, d1..dL]), the bitmask of the tokens the grammar allows after the committed tokens and the
drafts before that row. It does so on a worker thread (llguidance leaves the interpreter lock) while the
device runs the trunk; the step waits for the masks (`await_masks`) only once its LM head has run, and sets
the logits of the tokens they forbid to -inf before sampling and verification. A draft the grammar forbids
then has target probability 0 and is rejected like any other, so a step commits drafts only while they
are target-accepted and grammar-legal, and every token it draws comes from the masked distribution:
constrained greedy output is the same with drafts as without, and sampling stays exact.

Where the grammar forces the next tokens (JSON's keys and punctuation), they replace the slot's first
drafts before the step, as drafts from a one-hot q, which the drafter would rarely have guessed.

A grammar may start after a free part that a given token ends (the reasoning's `</think>`): rows before
it are not masked. A grammar that reaches a state with no way on (llguidance then allows only the end of
the reply, which is not complete) ends the request when that end is committed, without it: finish reason
"constraint", with drafts as without.
"""
import functools
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from dsv4cli.tokenizer import Tokenizer

from .grammar import Grammar, llguidance, new_matcher
from .request import Sequence
from .slots import SlotState


def mask_words(vocab: int) -> int:
    return (vocab + 31) // 32


class Constraints:
    """The matchers of the constrained slots of an engine's slot state (whose steps verify at most `depth`
    drafts) and the masks of the rows of the call being run. Counts the seconds masks took to compute
    (`mask_s`), the seconds steps waited for them (`wait_s`), over `calls` masked calls, and the drafts the
    grammar forced (`forced`)."""

    def __init__(self, tok: Tokenizer, state: SlotState, depth: int):
        self.tok, self.state, self.depth = tok, state, depth
        max_batch, self.vocab = state.sampling.bias.shape       # the slots, and the logits' width
        # the rows a call commits at most: a decode row per slot with its drafts, a first token per slot
        self.host = torch.full((max_batch * (depth + 2), mask_words(self.vocab)), -1, dtype=torch.int32)
        self.matchers: list = [None] * max_batch
        self.after: list[int | None] = [None] * max_batch     # the token that ends a slot's free part, while in it
        self.drafts: list[list[int]] = [[] for _ in range(max_batch)]     # each slot's drafts, as the device holds
        self.job = None
        self.mask_s = self.wait_s = 0.0
        self.calls = self.forced = 0

    def admit(self, slot: int, grammar: Grammar | None) -> None:
        """A request takes `slot` (every request: a slot's matcher is its latest request's)."""
        self.matchers[slot] = None if grammar is None else new_matcher(self.tok, self.vocab, grammar)
        self.after[slot] = None if grammar is None else grammar.after
        self.drafts[slot] = []

    def plan(self, params: list, firsts: list[Sequence], decoding: list[bool], drafts: int) -> bool:
        """Whether a call masks its rows (some of the requests committing in it, `params`, has a grammar); if
        so, start computing the masks on the worker thread, rows in the order of the call's LM head: the first
        token of each prompt that ends (`firsts`), then the decode rows [last, d1..dL] (L = `drafts`) of
        slots [0, len(decoding)), masked where `decoding`. The step's `await_masks` waits for them."""
        if not any(p.grammar is not None for p in params):
            return False
        self.join()
        for slot in (slot for slot, d in enumerate(decoding) if d and drafts):
            self._force(slot, drafts)
        rows = [(seq.slot, [], 1) for seq in firsts]
        rows += [(slot if d else None, self.drafts[slot][:drafts], drafts + 1) for slot, d in enumerate(decoding)]
        self.job = _worker().submit(self._fill, rows)
        _WAITING[0] = self
        return True

    def _force(self, slot: int, n: int) -> None:
        """Where the grammar forces the slot's next tokens (JSON's keys and punctuation, which a drafter
        rarely guesses), they replace its first drafts, as drafts drawn from a one-hot q: the verifier stays
        exact, and a token that is the only legal one is always accepted."""
        matcher = self.matchers[slot]
        if matcher is None or self.after[slot] is not None:
            return
        forced = matcher.compute_ff_tokens()[:n]
        if not forced or forced == self.drafts[slot][:len(forced)]:
            return
        self.drafts[slot][:len(forced)] = forced
        ids = torch.tensor(forced, device=self.state.drafts.device)
        self.state.drafts[slot, :len(forced)] = ids
        if self.state.draft_q is not None:
            self.state.draft_q[slot, :len(forced)] = F.one_hot(ids, self.state.draft_q.shape[-1]).float()
        self.forced += len(forced)

    def _fill(self, rows: list[tuple[int | None, list[int], int]]) -> None:
        """The masks of each (slot, its drafts, its rows) into the host buffer, rows in order: all ones where
        the slot has no constraint (None: not one that commits), before the end of a free part, and past a
        draft the grammar forbids (those rows commit nothing)."""
        t0, jobs, at = time.perf_counter(), [], 0
        for slot, drafts, n in rows:
            matcher = None if slot is None else self.matchers[slot]
            skip = 0
            if matcher is not None and self.after[slot] is not None:      # masked from the row after `after` on
                skip = drafts.index(self.after[slot]) + 1 if self.after[slot] in drafts else None
            if matcher is not None and skip is not None:
                jobs.append((matcher, at + skip, drafts[skip:]))
            at += n
        host = self.host[:at]
        host.fill_(-1)
        where = (host.data_ptr(), host.shape[1] * 4, at)
        alone, drafted = [(m, row) for m, row, drafts in jobs if not drafts], [job for job in jobs if job[2]]
        if alone:
            executor().unsafe_compute_mask_ptr(alone, *where)
        if drafted:
            executor().unsafe_compute_mask_ptr_with_draft_token(drafted, *where)
        self.calls += 1
        self.mask_s += time.perf_counter() - t0

    def wait(self) -> torch.Tensor:
        """The masks of the call started, [rows, words] int32, once computed."""
        t0 = time.perf_counter()
        rows = self.join()
        self.wait_s += time.perf_counter() - t0
        return rows

    def join(self) -> torch.Tensor:
        """Wait for the masks being computed (re-raising the worker's error); the last computed."""
        if self.job is not None:
            job, self.job = self.job, None
            job.result()
        return self.host

    def commit(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """The request's matcher past the tokens its slot committed; those its grammar allows (fewer than all:
        an end the grammar does not allow, at a dead end; the request ends with finish reason "constraint")."""
        matcher, after = self.matchers[seq.slot], self.after[seq.slot]
        if matcher is None:
            return tokens
        self.join()
        skip = 0
        if after is not None:            # the free part: the grammar starts after `after`
            if after not in tokens:
                return tokens
            skip, self.after[seq.slot] = tokens.index(after) + 1, None
        legal = skip + matcher.try_consume_tokens(tokens[skip:])
        if legal < len(tokens) and tokens[legal] == self.tok.eos_id and matcher.is_accepting():
            legal += 1          # the end of a complete reply, which ends it (llguidance does not consume it)
        if legal < len(tokens):
            seq.finish_reason = "constraint"
        return tokens[:legal]

    def read(self, rows: list, key, firsts: list[Sequence]) -> None:
        """After a masked call (`key`), the drafts each slot's next step verifies, from the call's rows
        (`step_result.RowResult`: decode slots [0, key.batch), then the prompts that ended, `firsts`)."""
        if not (key.sampling.masked and self.depth):
            return
        for slot, row in zip([*range(key.batch), *(seq.slot for seq in firsts)], rows):
            if self.matchers[slot] is not None:
                self.drafts[slot] = row.drafts


# the Constraints whose masks the running step waits for: one step runs at a time
_WAITING: list[Constraints | None] = [None]


@functools.cache
def _worker() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="dsv4-masks")


@functools.cache
def executor():
    """llguidance's thread pool, for computing many rows' masks at once."""
    return llguidance().LLExecutor()


@torch.library.custom_op("dsv4cli::await_masks", mutates_args=())
def await_masks(logits: torch.Tensor) -> torch.Tensor:
    """The masks [rows, words] int32 of the rows of `logits` [..., V] (the step's LM head output, rows in
    order), once the host has computed them (`Constraints.plan`), on the logits' device. Taking the logits
    orders the wait after the trunk, in eager and compiled steps alike."""
    rows = _WAITING[0].wait()[: logits.shape[:-1].numel()]
    return rows.to(logits.device, copy=True)


@await_masks.register_fake
def _(logits: torch.Tensor) -> torch.Tensor:
    return logits.new_empty((logits.shape[:-1].numel(), mask_words(logits.shape[-1])), dtype=torch.int32)


def apply_masks(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """logits [..., V] with the tokens each row's bitmask (`masks` [rows, words]) forbids at -inf."""
    bits = masks[..., None] >> torch.arange(32, dtype=torch.int32, device=masks.device) & 1
    allowed = bits.flatten(-2)[:, : logits.shape[-1]].view(logits.shape).bool()
    return logits.masked_fill(~allowed, float("-inf"))
