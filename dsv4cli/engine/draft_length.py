"""How many of DSpark's drafts a step verifies under `drafts = auto`: the length L that gives the most
tokens per second, from what each draft is expected to add and what a step of L drafts costs here.

A step that verifies L drafts commits, per slot, 1 + sum_{k<=L} prod_{i<=k} a_i tokens on average, where
a_i is the chance draft i is accepted given the ones before it: the confidence head's sigmoid. It costs
the seconds a step of L+1 rows takes on this device, measured: on accelerators the rows are nearly free
up to a few, on a CPU each row reads the routed experts it picks, so the union grows with L and a long
block can cost more than it brings (ktransformers measured that). L = 0 is plain decoding, a candidate like
the others: its steps skip the block pass (the stages' rings still take the committed rows), so they cost
what plain decoding costs and auto never picks what it expects to be slower than plain. Back from plain,
a slot's drafts were made for positions it has passed: its row verifies none that step (the scheduler's
per-row limits). Each length is first measured once (in order, at the start), then re-measured now and then,
as costs drift (the context grows, the machine gets busy): each length no more often than its step's expected
loss against the best length's allows within EXPLORE of the decode time, so a length that can't pay (on a CPU,
a long block at batch 1: docs/decisions.md, Speculative decoding) is tried once in hundreds of steps, not every
64th.
"""
import math

import torch
import torch.distributed as dist

from dsv4cli.model.model import world

REFRESH_STEPS = 64     # the fewest steps between two measurements of a length that isn't the best
EXPLORE = 0.005        # the share of decode time that re-measuring the other lengths may lose, all together
EMA = 0.3              # weight of a new measurement in a length's cost


class DraftLength:
    """The lengths' costs and the choices, and what it needs to know of each of `max_batch` slots."""

    def __init__(self, most: int, device: torch.device, max_batch: int):
        self.most, self.device = most, device
        self.confidence: list[list[float]] = [[] for _ in range(max_batch)]   # each slot's next drafts'
        self.drafted = [False] * max_batch      # each slot's drafts are for its next positions
        self.cost: dict[tuple[int, int], float] = {}       # (batch, L) -> seconds per step
        self.seen: dict[tuple[int, int], int] = {}          # (batch, L) -> the step it was last measured at
        self.steps = 0
        self.chosen: dict[int, int] = {}                    # L -> steps that verified it (for reports)

    def choose(self, batch: int, confidences: list[list[float]]) -> int:
        """The drafts to verify at `batch` rows (0: a plain step), for the running slots' next drafts'
        confidences."""
        self.steps += 1
        lengths = range(self.most + 1)
        unmeasured = [n for n in lengths if (batch, n) not in self.cost]
        if unmeasured:
            n = unmeasured[0]
        else:
            rate = {n: self.expected_tokens(n, confidences) / self.cost[batch, n] for n in lengths}
            n = best = max(lengths, key=rate.get)
            # a step of n loses what it costs beyond the best length's time for the same tokens; spaced so
            # each of the other lengths loses at most EXPLORE / len(others) of the best length's steps' time
            share = EXPLORE / self.most * self.cost[batch, best]
            spacing = {m: max(REFRESH_STEPS, self.cost[batch, m] * (1 - rate[m] / rate[best]) / share)
                       for m in lengths if m != best}
            due = {m: self.steps - self.seen[batch, m] - s for m, s in spacing.items()}
            overdue = max(due, key=due.get, default=None)
            if overdue is not None and due[overdue] >= 0:
                n = overdue
        self.chosen[n] = self.chosen.get(n, 0) + 1
        return n

    def plan(self, nb: int, decoding: list[bool], params: list) -> tuple[int, bool, list[int] | None]:
        """A step's (drafts verified, whether it drafts the next ones, each decode row's own count when they
        differ) for the decode rows [0, nb), `decoding` saying which slots decode, `params` their requests'
        SamplingParams. A slot whose drafts are stale (it stepped plain) verifies none; a sampled request
        with a seed verifies the whole block every step, so its tokens don't follow the measured costs: they
        are those of --drafts at the block size, in every run and batch."""
        live = [i for i, d in enumerate(decoding) if d]
        n = self.choose(nb, [self.confidence[i] for i in live])
        seeded = {i for i in live if params[i].temperature > 0 and params[i].seed is not None}
        want = [(self.most if i in seeded else n) if decoding[i] and self.drafted[i] else 0 for i in range(nb)]
        drafts, propose = max(want), n > 0 or bool(seeded)
        same = all(w == drafts for i, w in enumerate(want) if decoding[i])
        return drafts, propose, None if same else want

    def stepped(self, decoding: list[bool], propose: bool, joined: list[int]) -> None:
        """A step ran: the decoding slots have fresh drafts if it proposed; slots `joined` (their prompts'
        last chunks ran) have their first."""
        for i, d in enumerate(decoding):
            if d:
                self.drafted[i] = propose
        for i in joined:
            self.drafted[i] = True

    @staticmethod
    def expected_tokens(n: int, confidences: list[list[float]]) -> float:
        """Tokens a step of n drafts commits over the slots, by the confidences (prefix survival)."""
        return sum(1 + sum(math.prod(c[:k]) for k in range(1, n + 1)) for c in confidences)

    def observe(self, batch: int, n: int, seconds: float) -> None:
        """A step of n drafts at `batch` rows took `seconds` (under --tp, the slowest rank's: every rank then
        holds the same costs and takes the same lengths, as their steps must match)."""
        if world()[1] > 1:
            t = torch.tensor([seconds], dtype=torch.float32, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            seconds = t.item()
        old = self.cost.get((batch, n))
        self.cost[batch, n] = seconds if old is None else (1 - EMA) * old + EMA * seconds
        self.seen[batch, n] = self.steps

    def report(self) -> dict:
        """The cost model and the choices so far (bench, status lines)."""
        return {"chosen": dict(sorted(self.chosen.items())),
                "step_ms": {f"{b}x{n}": round(s * 1e3, 3) for (b, n), s in sorted(self.cost.items())}}
