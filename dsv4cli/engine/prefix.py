"""Prefix reuse: a new prompt starts where state it shares with an earlier one ends, instead of prefilling
that prefix again: a free slot's own state (a chat turn resumes the previous one), or a snapshot in the
prefix store (`prefix_store.py`), copied into the slot.

The host keeps, per slot, the tokens its state holds and which ring rows can still be trusted; a prompt
resumes a slot only if every row its prefill reads before the resume point is still in the rings.
"""
import json
from dataclasses import dataclass, field
from pathlib import Path

from dsv4cli.model import DecodeState, Transformer
from dsv4cli.model.drafters import drafter_kind

from . import session_file
from .prefix_store import BOUNDARY, PrefixStore
from .request import Sequence
from .snapshot import state_identity

SPARE_RING_ROWS = 64   # ring rows beyond need, so a prompt can resume a slot a little before its end


@dataclass
class SlotHistory:
    """What a slot's device state holds, tracked on the host for prefix reuse.

    tokens:     every token committed in the slot; the state has the rows of positions < len - 1
    valid_from: ring rows of positions below this may hold other positions' data
    written_to: a bound on the highest position any write reached (rejected rows, a drafter's writes ahead)
    """
    tokens: list[int] = field(default_factory=list)
    valid_from: int = 0
    written_to: int = -1

    def trusted_from(self, ring: int) -> int:
        """The lowest position whose ring rows still hold that position."""
        return max(self.valid_from, self.written_to - ring + 1)

    def resume_point(self, prompt: list[int], lookback: int, ring: int) -> int:
        """The first prompt position to prefill in this slot; the state of every row before it is the
        one this prompt would produce. `lookback`: rows a call reads before its first position."""
        n = min(len(prompt), len(self.tokens))
        same = next((i for i in range(n) if prompt[i] != self.tokens[i]), n)
        # row p of the MTP layer read token p+1: redo the row before the first differing token
        start = same - 1
        if start <= 0:
            return 0
        # the rows the prefill reads before `start` must still be in the rings, not overwritten
        # by later positions of the same slot
        lowest = max(0, start - lookback)
        return start if lowest >= self.trusted_from(ring) else 0

    def resumed(self, start: int, ring: int) -> "SlotHistory":
        """The history of this slot once a prompt resumes it at `start` (0: a fresh slot)."""
        return SlotHistory(valid_from=self.trusted_from(ring), written_to=self.written_to) if start else SlotHistory()

    def record(self, tokens: list[int], ahead: int) -> None:
        """Tokens committed in the slot, by a step whose writes reach below len(tokens) + `ahead`."""
        self.tokens += tokens
        self.written_to = max(self.written_to, len(self.tokens) + ahead)


def scored(seq: Sequence) -> bool:
    """Whether a request scores its prompt: it then prefills it whole, reusing no state, since a reused
    prefix's logprobs were never computed (its prefill still stores snapshots for the requests after it)."""
    return seq.params.prompt_logprobs is not None


class PrefixReuse:
    """Where an admitted prompt's prefill starts, and what its prefill leaves for later prompts, for the
    `max_batch` slots of `state` (their drafter drafting `depth` tokens a step).

    A prompt resumes a free slot's own state (`same_slot`: a chat turn resuming the last one) or, when
    further, the longest prefix in the store (`cache`: its bytes of device and host memory; 0 device bytes:
    no store), copied into a free slot; its chunks then store a snapshot at every boundary they end at. A
    waiting prompt that shares more with a prompt still prefilling than the store holds waits until that
    prompt has stored the prefix they share, so prompts that arrive together prefill it once. A chat's
    state also goes to and comes from a file (`session_file.py`)."""

    def __init__(self, model: Transformer, state: DecodeState, max_batch: int, same_slot: bool,
                 cache: tuple[int, int], depth: int):
        self.state, self.same_slot = state, same_slot
        # how far past the committed tokens a step writes: the trunk's rows reach pos + K, below len + K; the
        # drafter's as its kind says
        kind = drafter_kind(model.cfg) if depth else None
        self.ahead = max(depth, kind.write_ahead(depth) if kind else 0)
        self.identity = state_identity(model, depth > 0)              # what the state is valid for
        self.store = PrefixStore(state, *cache, json.dumps(self.identity).encode()) if cache[0] else None
        self.history = [SlotHistory() for _ in range(max_batch)]    # what each slot's state holds
        self.boundary = BOUNDARY if self.store is not None else 0    # where prefill chunks end (scheduler)

    def keys(self, seq: Sequence) -> list[bytes]:
        if seq.prefix_keys is None:
            seq.prefix_keys = self.store.keys(seq.prompt_ids)
        return seq.prefix_keys

    def ready(self, waiting: list[Sequence], prefilling: list[Sequence]) -> int | None:
        """The first waiting request that need not wait for a prefilling one, or None."""
        return next((i for i, seq in enumerate(waiting)
                     if self.store is None or scored(seq) or not self._held(seq, prefilling)), None)

    def _held(self, seq: Sequence, prefilling: list[Sequence]) -> bool:
        """Whether a prefilling request will store more of this prompt than the store holds now."""
        keys = self.keys(seq)
        node = self.store.longest(keys)
        for other in prefilling:
            theirs = self.keys(other)
            shared = next((i for i, (a, b) in enumerate(zip(keys, theirs)) if a != b), min(len(keys), len(theirs)))
            if shared * BOUNDARY > max(other.prefilled, node.end if node else 0):
                return True
        return False

    def place(self, seq: Sequence, free: list[int]) -> tuple[int, int]:
        """A free slot for `seq` and the prompt position its prefill starts at; the state of every position
        before it is in the slot (none for a scored prompt)."""
        s = self.state
        reuse = not scored(seq)
        starts = {i: self.history[i].resume_point(seq.prompt_ids, s.lookback, s.ring) if self.same_slot and reuse
                  else 0 for i in free}
        slot = max(free, key=lambda i: (starts[i], -i))
        node = self.store.longest(self.keys(seq)) if self.store is not None and reuse else None
        if node is None or node.end <= starts[slot]:
            self.history[slot] = self.history[slot].resumed(starts[slot], s.ring)
            return slot, starts[slot]
        slot = min(free, key=lambda i: (starts[i], i))          # the slot whose own state is of least use
        # a snapshot at P holds every row a resume at P or later reads: what `resume_point` allows when the
        # rows from P - lookback are trusted
        self.history[slot] = SlotHistory(valid_from=node.end - s.lookback, written_to=node.end)
        return slot, self.store.restore(node, slot)

    def chunks_ran(self, chunks: list[tuple[Sequence, int, int]]) -> None:
        """Prefill chunks (request, a, b) ran: a snapshot into the store for each that ended at a boundary."""
        for seq, _, end in chunks:
            if self.store is not None and end % BOUNDARY == 0 and end < len(seq.prompt_ids):
                self.store.store(self.keys(seq), seq.slot, end)

    def record(self, slot: int, tokens: list[int]) -> None:
        """Tokens committed in `slot`."""
        if self.same_slot:
            self.history[slot].record(tokens, self.ahead)

    def save(self, path: str | Path, header: dict[str, str]) -> int:
        """Slot 0's state and tokens into `path` with `header` and the state's identity in its metadata; returns
        the positions saved (0: none yet, and nothing is written)."""
        history = self.history[0]
        return session_file.save(path, self.state, 0, history.tokens, history.trusted_from(self.state.ring),
                                 header | self.identity)

    def load(self, path: str | Path, header: dict[str, str], free: bool) -> int:
        """A state `save` wrote into slot 0, which the next prompt resumes (a chat: one slot, `free`, with
        same-slot reuse); returns its positions. ValueError (one line) if the state is another model's, dtype's,
        drafter's or `header` value's."""
        if len(self.history) != 1 or not free or not self.same_slot:
            raise ValueError("a state resumes a chat: one free slot with prefix reuse")
        tokens, trusted_from = session_file.load(path, self.state, 0, header | self.identity)
        self.history[0] = SlotHistory(tokens, valid_from=trusted_from, written_to=len(tokens) - 1)
        return len(tokens) - 1
