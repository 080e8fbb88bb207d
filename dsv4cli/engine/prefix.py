"""Prefix reuse: a new prompt starts where a free slot's device state stops matching it, so a chat turn
resumes the previous one instead of prefilling it again.

The host keeps, per slot, the tokens its state holds and which ring rows can still be trusted; a prompt
resumes a slot only if every row its prefill reads before the resume point is still in the rings.
"""
from dataclasses import dataclass, field

SPARE_RING_ROWS = 64   # ring rows beyond need, so a prompt can resume a slot a little before its end


@dataclass
class SlotHistory:
    """What a slot's device state holds, tracked on the host for prefix reuse.

    tokens:     every token committed in the slot; the state has the rows of positions < len - 1
    valid_from: ring rows of positions below this may hold other positions' data
    written_to: a bound on the highest position any write reached (rejected rows, MTP chains)
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

    def record(self, tokens: list[int], mtp_depth: int) -> None:
        """Tokens committed in the slot."""
        self.tokens += tokens
        # trunk rows reach pos + K, MTP chains pos + n_acc + K - 1: both below len + K
        self.written_to = max(self.written_to, len(self.tokens) + mtp_depth)
