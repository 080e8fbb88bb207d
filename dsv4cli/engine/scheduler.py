"""The engine's host side, its scheduler: requests in, streamed tokens out, continuous batching.

Each step: waiting requests take free slots with as much of their prompt's state as is held (a chat slot's own
state, or the prefix store's longest snapshot: `prefix.py`), admitted prompts are cut into chunks within the
prefill budget (ending at the store's snapshot boundaries), and the step's
segments [prefill chunks; decode rows] go to the device side in one call (`runner.py`) — a compiled
engine runs each chunk, padded to a bucket, in a call of its own first, since its graphs have static
shapes. The host reads each call's packed tensor once and does the bookkeeping: metrics, detokenising
and stop rules (`output.py`). Requests join and leave between steps.
"""
import contextlib
import dataclasses
import functools
import itertools
import random
import time
from typing import NamedTuple

from dsv4cli.model import ModelConfig, Transformer
from dsv4cli.model.footprint import state_bytes
from dsv4cli.tokenizer import StreamDecoder, Tokenizer

from .api import EngineOptions, EngineStatus, ModelInfo
from .constraint import Constraints
from .draft_length import DraftLength
from .output import append_output
from .pace import PrefillPace
from .prefix import SPARE_RING_ROWS, PrefixReuse, scored
from .request import Event, Metrics, Sequence, TokenLogprob
from .runner import ChunkKey, DraftPlan, RunnerShape, StepKey, StepRunner, drafter_depth, remade
from .sampling import SamplingMode, SamplingParams
from .slots import SlotState
from .step_result import RowResult, StepLayout, read_logprob, read_step

# Steps failing in a row before the engine counts as broken (a device error that outlives the requests it
# failed): `step` then raises EngineFailed, and a server exits so its supervisor restarts it.
MAX_FAILED_STEPS = 3
CONTEXT_BUCKET = 512    # eager: compressed-KV reads are bounded to a multiple of this many tokens
# Compiled steps have static shapes, each one a compile: their shapes are powers of two, so a run compiles
# a handful of keys and none in steady state.
MIN_CONTEXT = 512       # the smallest context bucket
MIN_CHUNK = 16          # the smallest prefill chunk bucket (rows)


def batch_bucket(nb: int, max_batch: int) -> int:
    return min(1 << (nb - 1).bit_length(), max_batch)


def context_bucket(bound: int) -> int:
    return max(MIN_CONTEXT, 1 << (bound - 1).bit_length())


def chunk_bucket(rows: int, longest: int) -> int:
    """A compiled prefill chunk's rows: the next power of two from MIN_CHUNK, at most `longest`, the
    longest chunk the scheduler cuts (the commonest: every chunk of a long prompt but its last)."""
    return min(max(MIN_CHUNK, 1 << (rows - 1).bit_length()), longest)


def prefill_chunks(prefilling: list[Sequence], budget: int, longest: int, boundary: int = 0) \
        -> list[tuple[Sequence, int, int]]:
    """A step's prefill chunks (request, a, b) of at most `longest` rows, oldest request first, up to `budget`
    tokens (a chunk is cut to fit). With a `boundary`, a chunk that would run past a multiple of it before its
    prompt's last token ends there instead, and is the request's last this step: the prefix store snapshots
    its state there after the step."""
    chunks = []
    for seq in prefilling:
        a, n = seq.prefilled, len(seq.prompt_ids)
        while budget > 0 and a < n:
            b = min(a + longest, a + budget, n)
            edge = min(b, n - 1) // boundary * boundary if boundary else 0
            b = edge if edge > a else b
            chunks.append((seq, a, b))
            budget, a = budget - (b - a), b
            if b == edge:
                break
    return chunks


def context_bound(slots: list[Sequence | None], depth: int) -> int:
    """A bound on every position decode rows of these slots touch (with `depth` drafts), from host-side
    lengths, rounded up to a bucket so shapes (and captured graphs) repeat."""
    longest = max(len(s.prompt_ids) + len(s.output_ids) for s in slots if s is not None)
    return -(-(longest + depth + 1) // CONTEXT_BUCKET) * CONTEXT_BUCKET


def streams_to_decode(running: list[Sequence], chunks: list[tuple[Sequence, int, int]]) -> list[Sequence]:
    """The running streams a step decodes: none when every one is a background request's and a foreground
    prompt prefills (its first token then waits for no background decoding), else all. Never some of them: a
    slot left out inside the decode rows would still advance on the device."""
    if all(s.params.background for s in running) and any(not seq.params.background for seq, _, _ in chunks):
        return []
    return running


def decode_state_bytes(cfg: ModelConfig, options: EngineOptions, float_bytes: int) -> int:
    """What the slots of an engine of `options` for a model of `cfg` hold (`SlotState.nbytes`: the decode state
    and the per-slot rows beside it), from the config alone: the memory check runs before any model is built."""
    depth = drafter_depth(cfg, options.drafts)
    return (state_bytes(cfg, options.max_batch, options.max_seq_len, max_draft=max(depth, 1) + 1,
                        spare=SPARE_RING_ROWS if options.reuse_prefix else 0, float_bytes=float_bytes)
            + SlotState.bytes_beside_cache(cfg, options.max_batch, depth))


def chunk_key(chunk: tuple[Sequence, int, int], longest: int) -> ChunkKey:
    """A prefill chunk (request, a, b) as a step's chunk key; `longest` (compiled steps): its rows padded to a
    bucket of at most that many, its context to a bucket."""
    seq, a, b = chunk
    rows, context = (chunk_bucket(b - a, longest), context_bucket(b)) if longest else (b - a, b)
    given = seq.params.score_ids
    return ChunkKey(rows, context, b == len(seq.prompt_ids), scored(seq), len(given[0]) if given else 0)


class DecodePlan(NamedTuple):
    """A step's decode rows, planned once whichever way it runs (one eager call, or compiled calls)."""
    decoding: list[bool]        # the slots that decode (free and prefilling ones don't)
    batch: int                  # rows for slots [0, batch)
    drafts: int                 # L, the drafts verified (at most the drafter's D)
    propose: bool               # the rows draft again
    limits: list[int] | None    # each row's own L, where they differ


def score_chunks(chunks: list[tuple[Sequence, int, int]], keys: list[ChunkKey], scores: list[list[float]]) -> None:
    """The scored chunks' rows into their requests' prompt logprobs: row i of a chunk [a, b) scores prompt token
    a + i + 1 (the last chunk's last row scores the first output token, reported with it)."""
    at = 0
    for (seq, a, b), ck in zip(chunks, keys):
        if ck.scored:
            seq.prompt_logprobs += [read_logprob(seq.prompt_ids[i + 1], scores[at + i - a], seq.params.prompt_logprobs,
                                                 ck.given)
                                    for i in range(a, min(b, len(seq.prompt_ids) - 1))]
            at += ck.rows


class CallPlanning:
    """What `Engine.step`'s calls are and give: its decode rows' plan, each call's key, and a call's packed
    rows read into its requests' events (on the engine's state)."""

    def _decode_plan(self) -> DecodePlan:
        """The decode rows of the slots decoding now, and how many drafts they verify."""
        decoding = [s is not None and s not in self.prefilling for s in self.slots]
        nb = max((i + 1 for i, d in enumerate(decoding) if d), default=0)
        drafts, propose, limits = self.verified, True, None
        if self.lengths is not None:
            drafts, propose, limits = self.lengths.plan(nb, decoding, [s and s.params for s in self.slots])
        return DecodePlan(decoding, nb, drafts, propose, limits)

    def _key(self, chunks: list[tuple[Sequence, int, int]], decode: DecodePlan | None, bucketed: bool) -> StepKey:
        """The key of a call of these prefill chunks and decode rows; `bucketed` (compiled): its shapes
        padded to buckets."""
        ending = [seq for seq, _, b in chunks if b == len(seq.prompt_ids)]
        committing = ([s.params for s, d in zip(self.slots, decode.decoding) if d] if decode else []) + \
            [s.params for s in ending]
        longest = min(self.options.prefill_chunk, self.options.prefill_budget) if bucketed else 0
        chunk_keys = tuple(chunk_key(chunk, longest) for chunk in chunks)
        if decode is None:
            return StepKey(chunks=chunk_keys, sampling=SamplingMode.of(committing))
        nb, context = decode.batch, context_bound(self.slots[:decode.batch], self.draft_depth)
        if bucketed and nb:
            nb, context = batch_bucket(nb, self.max_batch), context_bucket(context)
        return StepKey(chunks=chunk_keys, batch=nb, context=context, sampling=SamplingMode.of(committing),
                       plan=DraftPlan(drafts=decode.drafts, propose=decode.propose, limits=decode.limits is not None))

    def _events(self, rows: list[RowResult], key: StepKey, decoding: list[bool], ending: list[Sequence],
                limits: list[int] | None, now: float) -> list[Event]:
        """The step's rows (`step_result.py`) into its requests: first tokens of the prompts that ended, each
        decoding slot's committed tokens, their logprobs, the next drafts' confidences, the metrics."""
        nb, drafts = key.batch, key.plan.drafts
        self.constraints.read(rows, key, ending)
        events = []
        for seq, row in zip(ending, rows[nb:]):
            if self.lengths is not None:
                self.lengths.confidence[seq.slot] = row.confidence
            events.append(self._first_event(seq, row.tokens[0], row.logprobs[0]
                                            if seq.params.logprobs is not None else None))
        for i, row in enumerate(rows[:nb]):
            seq = self.slots[i]
            if not decoding[i]:                 # free or prefilling
                continue
            tokens, n = row.tokens[: drafts + 1], row.accepted
            if self.lengths is not None:
                self.lengths.confidence[i] = row.confidence
            scored = None if seq.params.logprobs is None else [
                read_logprob(tokens[j], row.logprobs[j], seq.params.logprobs) for j in range(n + 1)]
            seq.metrics.count_drafts(drafts if limits is None else limits[i], n)
            seq.metrics.t_last = now
            self.prefixes.record(i, tokens[: n + 1])
            events.append(self._emit(seq, tokens[: n + 1], scored))
        return events


class EngineFailed(RuntimeError):
    """The engine cannot go on: its steps keep failing whatever requests they hold."""


class Engine(CallPlanning):
    def __init__(self, model: Transformer, tokenizer: Tokenizer, options: EngineOptions | None = None,
                 reload=None):
        """An engine for `model` as `options` say (None: the defaults); `reload`: a picklable call that loads
        this model and tokenizer again (`loading.load_weights`), for a compile in a process of its own."""
        o = self.options = options or EngineOptions()
        self.tok, self.reload = tokenizer, reload
        self.max_batch, self.max_seq_len, self.drafts, self.verify = o.max_batch, o.max_seq_len, o.drafts, o.verify
        shape = RunnerShape(o.max_batch, o.max_seq_len, drafter_depth(model.cfg, o.drafts), o.reuse_prefix,
                            confidences=o.drafts == "auto", graphs=o.graphs, block_verify=o.verify == "block")
        background = o.compile and o.compile_in_background
        remake = (functools.partial(remade, reload, dataclasses.replace(shape, graphs=False))
                  if background and reload is not None else None)
        self.runner = StepRunner(model, shape, compile=o.compile, background=background, remake=remake, swap=o.swap)
        self.model, self.device, self.compiled = model, self.runner.device, self.runner.compiled
        self.draft_depth = self.runner.depth        # the drafts a step drafts, and verifies at most
        self.verified = drafter_depth(model.cfg, o.drafts)   # the drafts a step verifies, but under auto: --drafts L
        self.lengths = DraftLength(self.draft_depth, self.device, o.max_batch) if self.runner.confidences else None
        self.constraints = Constraints(tokenizer, self.runner.state, self.draft_depth)
        self.slots: list[Sequence | None] = [None] * o.max_batch
        self.prefixes = PrefixReuse(model, self.runner.state.cache, o.max_batch, o.reuse_prefix, o.prefix_cache,
                                    self.draft_depth)
        self.waiting: list[Sequence] = []
        self.prefilling: list[Sequence] = []    # in a slot, prompt not yet prefilled; oldest first
        self.totals, self.failed_steps = Metrics(), 0          # failed steps: in a row
        self.pace = PrefillPace(o.prefill_budget)       # a step's prefill while streams decode: in time
        self._ids = itertools.count()

    # ---- API ---------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        if not prompt_ids:
            raise ValueError("empty prompt")
        if len(prompt_ids) >= self.max_seq_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; max_seq_len is {self.max_seq_len}")
        if problem := params.problem(self.model.cfg.vocab_size, len(prompt_ids)):
            raise ValueError(problem)
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        seq = Sequence(request_id or f"req-{next(self._ids)}", list(prompt_ids), params, seed)
        seq.metrics.t_submit = time.perf_counter()
        seq.metrics.prompt_tokens = len(prompt_ids)
        seq.decoder = StreamDecoder(self.tok)
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        for queue in (self.waiting, self.prefilling):
            if seq in queue:
                queue.remove(seq)
        if not seq.finished:
            seq.finish_reason = "cancelled"
        if 0 <= seq.slot < self.max_batch and self.slots[seq.slot] is seq:
            self._free(seq.slot)

    def resized(self, max_batch: int, drafts: int, compile: bool | None = None, verify: str | None = None) -> "Engine":
        """A new engine on the same loaded model with another batch size or drafts setting (compiled or not, its
        verify rule; None: as this one)."""
        o = self.options
        return self.rebuilt(dataclasses.replace(o, max_batch=max_batch, drafts=drafts, compile=o.compile if compile
                                                is None else compile, verify=verify or o.verify))

    def rebuilt(self, options: EngineOptions) -> "Engine":
        """A new engine on the same loaded model with other options."""
        return Engine(self.model, self.tok, options, self.reload)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def close(self) -> None:
        """Stop what runs beside the engine (a compile)."""
        if self.compiled is not None:
            self.compiled.close()

    @functools.cached_property
    def model_info(self) -> ModelInfo:
        return ModelInfo.of(self.model)

    def status(self) -> EngineStatus:
        lengths = self.lengths.report() if self.lengths is not None else None
        c = self.compiled
        if c is None:
            return EngineStatus(draft_lengths=lengths)
        return EngineStatus(c.status, c.recompiles, tuple(tuple(c.sources[k] or ()) for k in c.ready if k.batch),
                            lengths)

    def on_compile(self, note) -> None:
        if self.compiled is not None:
            self.compiled.on_build = lambda key, how: note(key.batch > 0, how)

    def save_state(self, path: str, header: dict[str, str]) -> int:
        """A chat's state (a one-slot engine's) into a file: `PrefixReuse.save`."""
        return self.prefixes.save(path, header)

    def load_state(self, path: str, header: dict[str, str]) -> int:
        """A chat's state from a file into a one-slot engine's free slot: `PrefixReuse.load`."""
        return self.prefixes.load(path, header, free=self.slots == [None])

    def step(self) -> list[Event]:
        """Admit waiting requests, then prefill chunks within the token budget (a request whose last chunk runs
        gives its first token and joins decoding) and one decode step for the streams running before the step.
        With no stream running, the step ends after the prefill, so a first token streams without waiting for a
        decode step (nor for its compile).

        A request only fails itself: one whose admission raises, and the requests of a step that raises, end
        with finish reason "error" (in an event) and free their slots, and the engine goes on (every other
        slot's state is position-addressed, so a half-run step leaves nothing it reads). After MAX_FAILED_STEPS
        failed steps in a row it raises EngineFailed."""
        events = []
        while None in self.slots and (i := self.prefixes.ready(self.waiting, self.prefilling)) is not None:
            seq = self.waiting.pop(i)
            try:
                self._assign(seq)
            except Exception as e:      # noqa: BLE001 - this request fails, the others go on
                if not self.options.isolate_failures:
                    raise
                events.append(self._fail(seq, e))
        decodable = [s for s in self.slots if s is not None and s not in self.prefilling]
        chunks = prefill_chunks(self.prefilling, self.options.prefill_budget, self.options.prefill_chunk,
                                self.prefixes.boundary)
        running = streams_to_decode(decodable, chunks)
        if running and (paced := self.pace.tokens(decoding=True)) < self.options.prefill_budget:   # streams wait on it
            fewer = prefill_chunks(self.prefilling, paced, self.options.prefill_chunk, self.prefixes.boundary)
            if streams_to_decode(decodable, fewer):
                chunks = fewer
        try:
            decode = self._decode_plan() if running else None
            # compiled (static shapes): each chunk in a call of its own, padded; else one call, as is
            calls = [([chunk], None) for chunk in chunks] + ([([], decode)] if decode else [])
            with self.compiled.stepping() if self.compiled is not None else contextlib.nullcontext():
                if self.compiled is not None and calls and self.compiled.want(
                        [self._key(c, d, bucketed=True) for c, d in calls]):
                    for c, d in calls:
                        events += self._call(c, d, compiled=True)
                elif calls:
                    events += self._call(chunks, decode, compiled=False)
        except Exception as e:          # noqa: BLE001 - the step's requests fail, the engine goes on
            if not self.options.isolate_failures:
                raise
            self.failed_steps += 1
            if self.failed_steps >= MAX_FAILED_STEPS:
                raise EngineFailed(f"{self.failed_steps} engine steps in a row failed; the last: "
                                   f"{type(e).__name__}: {e}") from e
            failed = {id(seq): seq for seq in [*running, *(seq for seq, _, _ in chunks)]}
            return [ev for ev in events if id(ev.seq) not in failed] + [self._fail(seq, e) for seq in failed.values()]
        self.failed_steps = 0
        return events

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
        seqs = [self.submit(p, params) for p in prompts]
        while self.has_work():
            self.step()
        return seqs

    # ---- admission ---------------------------------------------------------------------------

    def _assign(self, seq: Sequence) -> None:
        """A free slot for a waiting request, with the state of as much of its prompt as is held (`prefix.py`);
        its prefill starts at the next step."""
        slot, reused = self.prefixes.place(seq, [i for i, s in enumerate(self.slots) if s is None])
        self.constraints.admit(slot, seq.params.grammar)
        self.runner.admit(slot, seq.params, seq.seed, seq.prompt_ids, reused, self.tok.eos_id)
        self.slots[slot], seq.slot, seq.metrics.cached_tokens, seq.prefilled = seq, slot, reused, reused
        seq.prompt_logprobs = [TokenLogprob(seq.prompt_ids[0], None, [])] if scored(seq) else []
        self.prefilling.append(seq)

    # ---- a call of the step ------------------------------------------------------------------

    def _call(self, chunks: list[tuple[Sequence, int, int]], decode: DecodePlan | None, compiled: bool) \
            -> list[Event]:
        """One call of the device step: these prefill chunks, then the `decode` rows (or none); its key (the
        shapes bucketed when `compiled`) and inputs, its one read, its events."""
        key = self._key(chunks, decode, bucketed=compiled)
        ending = [seq for seq, _, b in chunks if b == len(seq.prompt_ids)]
        decoding = decode.decoding if decode else [False] * self.max_batch
        if key.sampling.masked:        # the masks start computing on the worker thread
            committing = [s.params for s, d in zip(self.slots, decoding) if d] + [s.params for s in ending]
            self.constraints.plan(committing, ending, decoding[:key.batch], key.plan.drafts)
        inputs = []
        for (seq, a, b), ck in zip(chunks, key.chunks):
            seq.prefilled = b
            inputs.append(self.runner.chunk_inputs(seq.slot, seq.prompt_ids, a, b, ck.rows, seq.params.score_ids,
                                                   compiled))
        if decode is not None and decode.limits is not None:
            self.runner.set_limits(decode.limits)
        # a step that compiles in the foreground, or shares the GIL with a saved step loading, is no measure
        # of the length's cost
        steady = self.compiled is None or (self.compiled.is_ready(key) or self.compiled.background) and not (
            self.compiled.loading)
        t0 = time.perf_counter()
        out = self.runner.run(key, *inputs, compiled=compiled)
        self.prefixes.chunks_ran(chunks)
        if not (ending or key.batch or isinstance(out, tuple)):
            return []                       # nothing committed or scored: nothing to read
        rows, scores = read_step(out, StepLayout.of(key, self.draft_depth, self.runner.confidences))  # one host read
        score_chunks(chunks, key.chunks, scores)
        if not (ending or key.batch):
            return []
        now = time.perf_counter()
        if steady:
            self.pace.ran(sum(b - a for _, a, b in chunks), key.batch > 0, now - t0)
        if self.lengths is not None:
            if decode is not None and not chunks and steady and (key.plan.drafts > 0) == key.plan.propose:
                self.lengths.observe(decode.batch, key.plan.drafts, now - t0)
            self.lengths.stepped(decoding, key.plan.propose, [seq.slot for seq in ending])
        return self._events(rows, key, decoding, ending, decode.limits if decode else None, now)

    # ---- host bookkeeping --------------------------------------------------------------------

    def _first_event(self, seq: Sequence, first: int, scored: list[float] | None) -> Event:
        self.prefilling.remove(seq)
        self.prefixes.record(seq.slot, seq.prompt_ids + [first])
        logprobs = None if scored is None else [read_logprob(first, scored, seq.params.logprobs)]
        seq.metrics.t_first = seq.metrics.t_last = time.perf_counter()
        event = self._emit(seq, [first], logprobs)
        event.first = True
        return event

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> Event:
        """Committed tokens into the request's output (stop rules, grammar); a finished one frees its slot."""
        event = append_output(seq, self.constraints.commit(seq, tokens), logprobs, self.tok.eos_id, self.max_seq_len)
        if event.finished:
            self._free(seq.slot)
            self.totals.merge(seq.metrics)
        return event

    def _fail(self, seq: Sequence, error: Exception) -> Event:
        """End a request the engine failed: its error, an event saying so, its slot freed."""
        seq.finish_reason, seq.error = "error", f"engine step failed: {type(error).__name__}: {error}"
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        if 0 <= seq.slot < self.max_batch and self.slots[seq.slot] is seq:
            self._free(seq.slot)
        return Event(seq, "", [], True)

    def _free(self, slot: int) -> None:
        self.slots[slot] = None
        self.runner.free(slot)
