"""The engine's device side: the model, every slot's state, the drafter, and the one step function.

A step is a list of segments, [prefill chunks; decode rows], run in one trunk pass
(`Transformer.forward_segments`): the chunks write their slots' state, and a chunk that ends its prompt
gives the prompt's first token; the decode rows [last, K drafts] of slots [0, batch) give the target
distributions, the verifier commits tokens (`verify.py`), and the drafter drafts again from the committed
rows (`drafter.py`: its kind's proposer, `PROPOSERS`). "Prefill alone" is the same call with no
decode rows. Everything stays on the device; the step returns one packed tensor, the host's one read
(StepKey says what it holds).

A step's static arguments are its StepKey, so a compiled engine compiles one graph per key
(`compiled.py`: the chunks padded to buckets by the scheduler, each in a call of its own) and captures the
decode-only ones (`graphs.py`); the tensors a chunk reads and writes come in as its slot's views.
"""
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dsv4cli.model import Segment, Transformer
from dsv4cli.model.drafters import DSPARK, MTP, drafter_kind
from dsv4cli.model.model import join, rows_at, split

from .compiled import CompiledSteps
from .constraint import apply_masks, await_masks
from .drafter import Drafter, DraftRows
from .dspark import DSparkDrafter
from .graphs import DecodeGraphs
from .mtp import MTPDrafter
from .sampling import SamplingMode, SamplingParams
from .slots import SlotState, SlotView
from .step_result import Rows, StepLayout, token_logprobs
from .verify import commit_rows


class ChunkKey(NamedTuple):
    rows: int         # the chunk's rows (padded to a bucket when compiled)
    context: int      # a bound on its positions + 1 (the compressed blocks it reads)
    last: bool        # it ends its prompt: the first token and first drafts come out of it
    scored: bool = False    # its prompt tokens are scored (`prompt_logprobs`): the LM head runs on every row
    given: int = 0          # ids each scored row scores besides its token and the top ones (`score_ids`)


class DraftPlan(NamedTuple):
    """What a step's decode rows verify and draft."""
    drafts: int = 0         # L: the drafts each row verifies (at most the drafter's D)
    propose: bool = True    # the rows get next drafts (False: the drafter only takes their rows in)
    limits: bool = False    # each row verifies as many drafts as its slot's `limit` says (at most L)


class StepKey(NamedTuple):
    """A step's static arguments (what `StepRunner.step` says each changes). What the step returns:
    `step_result.py` (its layout: `StepLayout.of`)."""
    chunks: tuple[ChunkKey, ...] = ()
    batch: int = 0                          # decode rows for slots [0, batch); 0: none
    context: int = 0                        # a bound on the decode rows' positions + 1
    sampling: SamplingMode = SamplingMode()     # how the committing rows choose their tokens
    plan: DraftPlan = DraftPlan()           # what the decode rows verify and draft


class ChunkInputs(NamedTuple):
    ids: torch.Tensor             # [1, rows+1]: the chunk's tokens, then the one after it (or padding)
    start: torch.Tensor           # [1] the chunk's first position
    length: torch.Tensor | None   # [1] its real rows when padded to a bucket, else None
    slot: SlotView
    given: torch.Tensor | None = None     # [1, rows, G]: the ids each row also scores (ChunkKey.given)


@dataclass(frozen=True)
class RunnerShape:
    """What a runner's device state and steps are built for."""
    max_batch: int              # slots
    max_seq_len: int            # tokens a slot holds
    depth: int                  # D: the tokens the checkpoint's drafter drafts a step (0: plain decoding)
    reuse_prefix: bool = False  # slots keep their state for the next prompt (`SlotState`)
    confidences: bool = False   # the result carries the next drafts' confidences, where the kind has them (auto)
    graphs: bool = True         # decode-only steps captured where the platform can
    block_verify: bool = False  # sampled drafts verified jointly (`verify.verify_block`), else one by one


class StepRunner:
    """The device side of an engine of the given `shape`. `compile`: steps compiled per key, in the
    `background` (eager until ready, built by a process of its own made with `remake`, a picklable call that
    builds this runner again compiling in the foreground: `remade`; `swap`: when a saved step loads,
    `CompiledSteps`)."""

    def __init__(self, model: Transformer, shape: RunnerShape, compile: bool = False, background: bool = False,
                 remake=None, swap: str = "idle"):
        self.drafter = make_drafter(model, shape.depth)
        self.model, self.max_batch, self.swap = model, shape.max_batch, swap
        self.depth = self.drafter.depth if self.drafter is not None else 0
        self.confidences = shape.confidences and self.depth > 0 and drafter_kind(model.cfg).confidence
        self.block_verify = shape.block_verify
        self.device = model.embed.weight.device
        self.state = SlotState(model, shape.max_batch, shape.max_seq_len, self.depth, shape.reuse_prefix)
        self.graphs = DecodeGraphs.for_device(self.device) if shape.graphs else None
        self.compile_tag = (self.depth, shape.max_batch, shape.max_seq_len, self.state.cache.ring, self.confidences,
                            self.block_verify)
        self.compiled = CompiledSteps(self, self.device, background, remake, swap) if compile else None

    def __getstate__(self) -> dict:
        """What a saved compiled step keeps of the runner (its guards' view): what the step reads."""
        return {k: self.__dict__[k] for k in ("model", "depth", "confidences", "block_verify", "device", "drafter",
                                              "state")}

    # ---- host-side writes between steps --------------------------------------------------------

    def admit(self, slot: int, params: SamplingParams, seed: int, prompt_ids: list[int], start: int,
              eos: int | None = None) -> None:
        """A request takes `slot`, its prefill starting at position `start` (a resumed prefix before it);
        `eos`: the tokenizer's (min_tokens holds it back)."""
        self.state.sampling.set(slot, params, seed, torch.tensor(prompt_ids, device=self.device), eos)
        self.state.pos[slot] = start      # where decode steps write this inactive slot's rows (see `step`)

    def free(self, slot: int) -> None:
        self.state.active[slot] = False

    def set_limits(self, limits: list[int]) -> None:
        """The drafts each decode row [0, len) verifies in the next step whose key says `limits`."""
        self.state.limit[:len(limits)].copy_(torch.tensor(limits))

    def chunk_inputs(self, slot: int, prompt: list[int], a: int, b: int, rows: int,
                     score_ids: list[list[int]] | None = None, compiled: bool = False) -> ChunkInputs:
        """Prompt positions [a, b) of the request in `slot` as a chunk of `rows` rows (padded when more); row i
        also scores the ids `score_ids[a + i + 1]` when given (the ids for the token it predicts). A
        `compiled` chunk always has its real length: its graph is the same for every length of its bucket."""
        ids = prompt[a:b + 1]
        ids = torch.tensor(ids + [0] * (rows + 1 - len(ids)), device=self.device)[None]
        start = torch.tensor([a], device=self.device)
        length = torch.tensor([b - a], device=self.device) if rows > b - a or compiled else None
        given = None
        if score_ids is not None:
            part = score_ids[a + 1:b + 1]
            given = torch.tensor(part + [[0] * len(score_ids[0])] * (rows - len(part)), device=self.device)[None]
        return ChunkInputs(ids, start, length, self.state.view(slot), given)

    # ---- the step ------------------------------------------------------------------------------

    @torch.no_grad()
    def run(self, key: StepKey, *chunks: ChunkInputs, compiled: bool = False) \
            -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`step`, `compiled` or eager, captured as a graph when it runs eager without a compiled engine or
        compiled with its key ready (decode rows only, not masked: a masked step waits for the host mid-way;
        no compile running beside the capture: a worker's device work would spoil it)."""
        fused = functools.partial(self.compiled, key) if compiled else functools.partial(self.step, key)
        if chunks or self.graphs is None or key.sampling.masked or (self.compiled is not None and not (
                compiled and self.compiled.is_ready(key) and not self.compiled.busy)):
            return fused(*chunks)
        return self.graphs.run(key, fused)

    def step(self, key: StepKey, *chunks: ChunkInputs) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One step on the device: the packed result (`step_result.py`), and the scored chunks' logprob rows
        (each row's next token under the model's raw logits) when a chunk is `scored`. Without chunks it reads
        and writes only preallocated tensors, so it can be captured as a graph.

        What each part of the key changes: `chunks`, the prompt segments and their rows (`ChunkKey`: padded
        rows, context bound, whether a chunk ends its prompt and gives its first token, whether its rows are
        scored); `batch` and `context`, the decode segment's rows and the attention bound; `sampling`, how
        tokens are committed (`SamplingMode`: argmax or a draw, sorted for rank filters, logprob rows packed,
        the host's grammar masks awaited and applied); `plan`, the drafts verified, whether the drafter
        proposes, and per-row limits (`DraftPlan`).

        A chunk runs before the decode rows in every layer, and its slot's `pos` moves to the chunk's end
        first: the decode rows [0, batch) include inactive slots (free, or prefilling), which act as a
        slot whose drafts were all rejected and write only positions pos..pos+L, rewritten before
        anything reads them (position-addressed state); run before the chunk, or at its start, they would
        land on rows the chunk reads or writes."""
        segments, ends = self._segments(key, chunks)
        trunk = self.model.forward_segments(segments)
        hidden = [t.hidden for t in trunk]
        # one head call over the rows that commit: a prompt's last real row, every decode row
        ending = [i for i, ck in enumerate(key.chunks) if ck.last]
        scored = [rows_at(hidden[i], ends[i] - 1) for i in ending] + hidden[len(chunks):]
        logits = self.model.logits(join(scored)) if scored else None
        if key.sampling.masked:   # the host's masks, computed while the trunk ran
            logits = apply_masks(logits, await_masks(logits))
        logits = split(logits, [x.shape[:2] for x in scored]) if scored else []
        # a scored chunk's rows, each scoring the prompt's next token: [rows, V] logits at most, never a prompt's
        scores = [token_logprobs(self.model.logits(hidden[i]), c.ids[:, 1:ck.rows + 1], c.given)[0]
                  for i, (ck, c) in enumerate(zip(key.chunks, chunks)) if ck.scored]
        firsts, rows = [], []         # per prompt that ends: (its inputs, first token [1,1], its logprobs)
        for i, (ck, c) in enumerate(zip(key.chunks, chunks)):
            nxt = c.ids[:, 1:ck.rows + 1]
            if ck.last:
                first, _, lp = commit_rows(logits[ending.index(i)], nxt[:, :0], c.slot.sampling, slice(0, 1),
                                           c.start + ends[i] - 1, key.sampling)
                firsts.append((c, first, lp))
                nxt = nxt.scatter(1, (ends[i] - 1)[:, None], first)
            rows.append(DraftRows(hidden[i], trunk[i].features, nxt, c.start, c.slot.cache, ends[i], c.length, ck.last,
                                  c.slot.sampling, slice(0, 1)))
        decoded = self._verify(key, trunk[-1], logits[-1], rows) if key.batch else None
        # a proposal for each segment that wants one: each prompt that ends, the decode rows unless the key
        # says not (None: none, and plain decoding)
        made = iter(self.drafter.propose(rows, key.sampling) if self.drafter is not None else ())
        proposed = [next(made, None) if r.wanted else None for r in rows]
        if key.batch:       # the decode rows are the last segment the drafter saw
            self._advance(slice(0, key.batch), *decoded[:2], proposed[-1] if self.drafter is not None else None)
        for (c, first, _), i in zip(firsts, ending):     # after the decode rows': the slot joins them
            self._join(c.slot, first, proposed[i])
        packed = self._packed(key, decoded, firsts)
        return (packed, torch.cat(scores)) if scores else packed

    def _segments(self, key: StepKey, chunks: tuple[ChunkInputs, ...]) -> tuple[list[Segment], list[torch.Tensor]]:
        """The step's segments [chunks; decode rows] and each chunk's real end, each chunk's slot `pos` moved to
        its end first (`step`)."""
        st = self.state
        ends = [c.length if c.length is not None else torch.full_like(c.start, ck.rows)
                for ck, c in zip(key.chunks, chunks)]
        for c, n in zip(chunks, ends):
            c.slot.pos.copy_(c.start + n)
        segments = [Segment(c.ids[:, :ck.rows], c.start, c.slot.cache, ck.context, c.length)
                    for ck, c in zip(key.chunks, chunks)]
        if key.batch:
            b = slice(0, key.batch)
            segments.append(Segment(torch.cat([st.last[b, None], st.drafts[b, :key.plan.drafts]], 1), st.pos[b],
                                    st.cache, key.context))
        return segments, ends

    def _join(self, slot: SlotView, first: torch.Tensor, proposal) -> None:
        """A slot whose prompt ended joins the decode rows: its first token [1,1], its first drafts."""
        slot.last.copy_(first[:, 0])
        slot.active.fill_(True)
        if proposal is not None:
            self._keep(proposal, slot.drafts, slot.draft_q, slot.confidence)
        slot.sampling.output_counts.scatter_add_(1, first, torch.ones_like(first, dtype=torch.float32))

    def _verify(self, key: StepKey, trunk, logits, rows: list[DraftRows]):
        """The decode rows' committed tokens [B,L+1], accepted drafts [B] and logprobs, and their rows for the
        drafter (appended to `rows`). Inactive rows commit nothing: they act as all drafts rejected."""
        st, b, L = self.state, slice(0, key.batch), key.plan.drafts
        pos, drafts = st.pos[b], st.drafts[b, :L]
        # the draws' distributions: a greedy step's drafts are argmaxes (and its rows one-hot)
        q = st.draft_q[b, :L] if st.draft_q is not None and not key.sampling.greedy else None
        limit = st.limit[b] if key.plan.limits else None
        tokens, n_acc, scored = commit_rows(logits, drafts, st.sampling, b, pos, key.sampling, q=q, limit=limit,
                                            block=self.block_verify)
        n_acc = torch.where(st.active[b], n_acc, 0)
        if self.drafter is not None:
            # row i's next token: draft i+1, the committed one at row n_acc (past it, garbage the next step rewrites)
            nxt = torch.cat([drafts, tokens[:, -1:]], 1).scatter(1, n_acc[:, None], tokens.gather(1, n_acc[:, None]))
            rows.append(DraftRows(trunk.hidden, trunk.features, nxt, pos, st.cache, n_acc + 1, None, key.plan.propose,
                                  st.sampling, b))
        return tokens, n_acc, scored

    def _advance(self, b: slice, tokens, n_acc, proposal) -> None:
        """The active decode slots past their committed tokens, with their next drafts."""
        st = self.state
        active = st.active[b]
        if proposal is not None:
            self._keep(proposal, st.drafts[b], None if st.draft_q is None else st.draft_q[b],
                       None if st.confidence is None else st.confidence[b], active)
        st.last[b] = torch.where(active, tokens.gather(1, n_acc[:, None]).squeeze(1), st.last[b])
        st.pos[b] = st.pos[b] + torch.where(active, n_acc + 1, 0)
        committed = (torch.arange(tokens.shape[1], device=self.device) <= n_acc[:, None]) & active[:, None]
        st.sampling.output_counts[b].scatter_add_(1, tokens, committed.float())

    @staticmethod
    def _keep(proposal, drafts, draft_q, confidence, active=None) -> None:
        """A proposal into a slot's (or slots') views, for the slots `active` says (None: all)."""
        def put(dst, src):
            if dst is not None and src is not None:
                shape = (-1,) + (1,) * (src.dim() - 1)
                dst.copy_(src if active is None else torch.where(active.view(shape), src, dst))
        put(drafts[:, :proposal.drafts.shape[1]], proposal.drafts)
        put(draft_q, proposal.q)
        put(confidence, proposal.confidence)

    def _packed(self, key: StepKey, decoded, firsts) -> torch.Tensor:
        """The step's one packed result (`step_result.py`): the decode rows, then the prompts that ended."""
        st, parts = self.state, []
        if key.batch:
            b = slice(0, key.batch)
            parts.append(Rows(decoded[0], decoded[1], st.confidence[b] if self.confidences else None, st.drafts[b],
                              decoded[2]))
        for c, first, lp in firsts:
            parts.append(Rows(first, torch.zeros_like(first[:, 0]), c.slot.confidence if self.confidences else None,
                              c.slot.drafts, lp))
        return StepLayout.of(key, self.depth, self.confidences).pack(parts, self.device)

    def example_inputs(self, key: StepKey) -> tuple:
        """Tensor inputs to trace the step `key` with: each chunk's rows, start and real length, and slot
        0's views (every slot's views share its graph)."""
        def given(ck: ChunkKey):
            return torch.zeros(1, ck.rows, ck.given, dtype=torch.long, device=self.device) if ck.given else None

        zeros = [torch.zeros(1, ck.rows + 1, dtype=torch.long, device=self.device) for ck in key.chunks]
        return tuple(ChunkInputs(z, z[0, :1].clone(), z[0, :1] + 1, self.state.view(0), given(ck))
                     for z, ck in zip(zeros, key.chunks))


# Each drafter kind's proposer, made as `proposer(model, depth)`.
PROPOSERS = {DSPARK: DSparkDrafter, MTP: MTPDrafter}


def drafter_depth(cfg, drafts: int | str) -> int:
    """The drafts a step drafts for the setting `drafts`: K, or auto's (DSpark's whole block, the MTP layer's 1),
    none without a drafter."""
    if drafts != "auto":
        return drafts
    kind = drafter_kind(cfg)
    return kind.auto_depth(cfg) if kind else 0


def make_drafter(model: Transformer, depth: int) -> Drafter | None:
    """The drafter of the model's checkpoint for `depth` drafts a step (DSpark drafts the first `depth` of its
    block: auto asks for all of it), or None for plain decoding."""
    if not depth:
        return None
    kind = drafter_kind(model.cfg)
    if kind is None:
        raise ValueError("this checkpoint has no drafter (no MTP layer or DSpark stages); use drafts 0")
    most = kind.max_depth(model.cfg)
    if most is not None and depth > most:
        raise ValueError(f"drafts {depth}: above the {kind.label} block size {most} (one pass drafts {most} tokens)")
    return PROPOSERS[kind](model, depth)


def remade(reload, shape: RunnerShape) -> StepRunner:
    """In a compiling process: this runner again, on a fresh load of its model, compiling in the foreground."""
    model, _ = reload()
    return StepRunner(model, shape, compile=True)
