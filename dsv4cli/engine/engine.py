"""The engine: requests in, streamed tokens out, with continuous batching and fused MTP speculation.

Admission (`_assign`, `_prefill_chunks`): a waiting request takes a free slot (with prefix reuse, the one
whose state it resumes furthest: `prefix.py`), its prompt is prefilled in chunks through the trunk and the
MTP layer, at most `prefill_budget` tokens per step, and the first token and first drafts come out of its
last chunk. Each step runs one fused decode step for the running slots, all on the device
(`_fused_decode`):
  trunk over [last token, K drafts] -> target distributions (`sampling.py`) -> verify (`verify.py`) ->
  MTP over the same rows with the committed tokens -> next K drafts (`mtp.py`).
Eager (`mixed`), the step's prefill chunks join its forward passes (`Transformer.forward_segments`): the
weights are read and the token-wise ops run once for both; compiled, they run in passes of their own first
(`_prefill_chunk`).
The host reads one packed tensor per step (committed tokens + counts, and their logprobs when a running
request asked for them) and does the bookkeeping: metrics, detokenising and stop rules (`output.py`).
Requests (`request.py`) join and leave between steps; every per-slot tensor lives in `slots.py`.
"""
import functools
import itertools
import random
import time

import torch
import torch.nn.functional as F

from dsv4cli.model import DecodeState, Segment, Transformer
from dsv4cli.tokenizer import StreamDecoder, Tokenizer

from .api import ModelInfo
from .compiled import CompiledSteps, batch_bucket, chunk_bucket, context_bucket
from .graphs import DecodeGraphs
from .mtp import MTPDrafter, PromptRows
from .output import append_output
from .request import Event, Metrics, Sequence, TokenLogprob
from .sampling import (
    RNG_DRAW,
    TOP_LOGPROBS,
    SamplingParams,
    SlotParams,
    needs_sort,
    plain_greedy,
    processed_logits,
    sample_from,
    target_probs,
    token_logprobs,
    uniform,
)
from .slots import SlotState
from .verify import verify, verify_greedy

CONTEXT_BUCKET = 512   # compressed-KV reads are bounded to a multiple of this many tokens
# Steps failing in a row before the engine counts as broken (a device error that outlives the requests it
# failed): `step` then raises EngineFailed, and a server exits so its supervisor restarts it.
MAX_FAILED_STEPS = 3


class EngineFailed(RuntimeError):
    """The engine cannot go on: its steps keep failing whatever requests they hold."""


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, max_batch: int = 8, max_seq_len: int = 4096,
                 mtp: int = 1, prefill_chunk: int = 256, prefill_budget: int = 160, graphs: bool = True,
                 reuse_prefix: bool = False, compile: bool = False, compile_in_background: bool = False,
                 mixed: bool = True, reload=None, isolate_failures: bool = True):
        """`reload`: a picklable call that loads this model and tokenizer again (`loading.load_weights`);
        given, a background compile runs in a process of its own (`compiled.py`). `isolate_failures`: a
        step that raises fails the requests in it and the engine goes on (`step`); off, it raises (the
        ranks of --tp must all take the same steps)."""
        if mtp and not model.cfg.n_mtp_layers:
            raise ValueError("this checkpoint has no MTP layer; use mtp 0")
        self.model, self.tok, self.reload = model, tokenizer, reload
        self.max_batch, self.max_seq_len, self.mtp_depth = max_batch, max_seq_len, mtp
        # prefill tokens per step: running streams wait at most this much prefill between tokens
        self.prefill_chunk, self.prefill_budget = prefill_chunk, prefill_budget
        # prefill chunks run in the decode step's forward pass (eager steps only); else in passes of their own
        self.mixed = mixed
        self.device = model.embed.weight.device
        # Prefix reuse: a new prompt starts where a free slot's state stops matching it (a chat turn
        # resumes the previous one). Off by default: batch output must not depend on slot history.
        self.reuse_prefix = reuse_prefix
        self.state = SlotState(model, max_batch, max_seq_len, mtp, reuse_prefix)
        self.drafter = MTPDrafter(model, mtp) if mtp else None
        self.slots: list[Sequence | None] = [None] * max_batch
        self.waiting: list[Sequence] = []
        self.prefilling: list[Sequence] = []    # in a slot, prompt not yet prefilled; oldest first
        self.totals = Metrics()
        self.isolate_failures = isolate_failures
        self.failed_steps = 0          # in a row
        self._ids = itertools.count()
        self.graphs = DecodeGraphs.for_device(self.device) if graphs else None
        # the fused decode step compiled (torch.compile); captured graphs replay the compiled kernels
        remake = (functools.partial(compiling_engine, reload, self.options)
                  if compile and compile_in_background and reload is not None else None)
        # the decode step first: a prefill chunk's compile waits for it (steps run eagerly meanwhile)
        self.compiled = (CompiledSteps(self, ("_fused_decode", "_prefill_rows"), self.device,
                                       (mtp, max_batch, max_seq_len),
                                       background=compile_in_background, remake=remake) if compile else None)

    @property
    def options(self) -> dict:
        """What shapes the engine apart from the model: `resized` and a compiling process's copy use it."""
        return dict(max_batch=self.max_batch, max_seq_len=self.max_seq_len, mtp=self.mtp_depth,
                    prefill_chunk=self.prefill_chunk, prefill_budget=self.prefill_budget,
                    graphs=self.graphs is not None, reuse_prefix=self.reuse_prefix, mixed=self.mixed)

    def example_inputs(self, key: tuple) -> tuple:
        """Tensor inputs of the compiled step `key` (its name, then its static arguments) to trace it with:
        a prefill chunk's rows, start, real length and slot 0's views (each slot's views share its graph:
        Dynamo guards their sizes and strides, not where they start)."""
        if key[0] != "_prefill_rows":
            return ()
        zeros = torch.zeros(1, key[1] + 1, dtype=torch.long, device=self.device)
        return (zeros, zeros[0, :1].clone(), zeros[0, :1] + 1, self.state.cache.view(0), self.state.sampling.view(0))

    def __getstate__(self) -> dict:
        """What a saved compiled step keeps of the engine (its guards' view): what the fused step reads,
        not the host bookkeeping the engine thread changes meanwhile, nor the compiler."""
        return {k: self.__dict__[k] for k in ("model", "state", "drafter", "mtp_depth", "device")}

    # ---- API ---------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        if not prompt_ids:
            raise ValueError("empty prompt")
        if len(prompt_ids) >= self.max_seq_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; max_seq_len is {self.max_seq_len}")
        if problem := params.problem():
            raise ValueError(problem)
        if params.logprobs is not None and not 0 <= params.logprobs <= TOP_LOGPROBS:
            raise ValueError(f"logprobs: must be 0..{TOP_LOGPROBS}, got {params.logprobs}")
        vocab = self.model.cfg.vocab_size
        bad = next((t for t in params.logit_bias if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token id {bad} is not in the vocabulary (0..{vocab - 1})")
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        seq = Sequence(request_id or f"req-{next(self._ids)}", list(prompt_ids), params, seed)
        seq.metrics.t_submit = time.perf_counter()
        seq.metrics.prompt_tokens = len(prompt_ids)
        seq.decoder = StreamDecoder(self.tok)
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        if not seq.finished:
            seq.finish_reason = "cancelled"
        if 0 <= seq.slot < self.max_batch and self.slots[seq.slot] is seq:
            self._free(seq.slot)

    def resized(self, max_batch: int, mtp: int, compile: bool | None = None) -> "Engine":
        """A new engine on the same loaded model with another batch size or MTP depth."""
        return Engine(self.model, self.tok, **{**self.options, "max_batch": max_batch, "mtp": mtp},
                      compile=self.compiled is not None if compile is None else compile,
                      compile_in_background=self.compiled is not None and self.compiled.background,
                      reload=self.reload)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    @functools.cached_property
    def model_info(self) -> ModelInfo:
        return ModelInfo.of(self.model)

    def step(self) -> list[Event]:
        """Prefill chunks of admitted requests within the token budget (a request whose last chunk runs
        gives its first token and joins decoding) and one decode step for the running slots: in one
        forward pass (`mixed`), or the chunks first, each in its own. With no stream running before the
        step, it returns after the prefill, so a first token streams without waiting for a decode step
        (nor for its compile).

        A request only fails itself: one whose admission raises, and the requests of a step that raises,
        end with finish reason "error" (in an event) and free their slots, and the engine goes on (every
        other slot's state is position-addressed, so a half-run step leaves nothing it reads). After
        MAX_FAILED_STEPS failed steps in a row it raises EngineFailed."""
        events = []
        while self.waiting and None in self.slots:
            seq = self.waiting.pop(0)
            try:
                self._assign(seq)
            except Exception as e:      # noqa: BLE001 - this request fails, the others go on
                if not self.isolate_failures:
                    raise
                events.append(self._fail(seq, e))
        running = [s for s in self.slots if s is not None and s not in self.prefilling]
        chunks = self._prefill_chunks(self.prefill_budget)
        try:
            if running and chunks and self.mixed and self.compiled is None:
                events += self._decode(chunks)
            else:
                events += [e for seq, a, b in chunks if (e := self._prefill_chunk(seq, a, b)) is not None]
                if running:
                    events += self._decode()
        except Exception as e:          # noqa: BLE001 - the step's requests fail, the engine goes on
            if not self.isolate_failures:
                raise
            self.failed_steps += 1
            if self.failed_steps >= MAX_FAILED_STEPS:
                raise EngineFailed(f"{self.failed_steps} engine steps in a row failed; the last: "
                                   f"{type(e).__name__}: {e}") from e
            failed = {id(seq): seq for seq in [*running, *(seq for seq, _, _ in chunks)]}
            return [ev for ev in events if id(ev.seq) not in failed] + [self._fail(seq, e) for seq in failed.values()]
        self.failed_steps = 0
        return events

    def _fail(self, seq: Sequence, error: Exception) -> Event:
        """End a request the engine failed: its error, an event saying so, its slot freed."""
        seq.finish_reason, seq.error = "error", f"engine step failed: {type(error).__name__}: {error}"
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        if 0 <= seq.slot < self.max_batch and self.slots[seq.slot] is seq:
            self._free(seq.slot)
        return Event(seq, "", [], True)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
        seqs = [self.submit(p, params) for p in prompts]
        while self.has_work():
            self.step()
        return seqs

    # ---- admission ---------------------------------------------------------------------------

    def _assign(self, seq: Sequence) -> None:
        """A free slot for a waiting request (with prefix reuse, the one whose state it resumes
        furthest); its prefill starts at the next step."""
        state, cache = self.state, self.state.cache
        free = [i for i, s in enumerate(self.slots) if s is None]
        starts = {i: state.history[i].resume_point(seq.prompt_ids, cache.lookback, cache.ring)
                  if self.reuse_prefix else 0 for i in free}
        slot = max(free, key=lambda i: (starts[i], -i))
        reused = starts[slot]
        state.history[slot] = state.history[slot].resumed(reused, cache.ring)
        self.slots[slot], seq.slot = seq, slot
        seq.metrics.cached_tokens = seq.prefilled = reused
        state.sampling.set(slot, seq.params, seq.seed, torch.tensor(seq.prompt_ids, device=self.device))
        state.pos[slot] = reused     # where the decode steps write this inactive slot's rows (_fused_decode)
        self.prefilling.append(seq)

    def _prefill_chunks(self, budget: int) -> list[tuple[Sequence, int, int]]:
        """This step's prefill chunks (request, a, b), oldest request first, up to `budget` tokens (a
        chunk is cut to fit)."""
        chunks = []
        for seq in self.prefilling:
            a, n = seq.prefilled, len(seq.prompt_ids)
            while budget > 0 and a < n:
                b = min(a + self.prefill_chunk, a + budget, n)
                chunks.append((seq, a, b))
                budget, a = budget - (b - a), b
        return chunks

    def _chunk_inputs(self, seq: Sequence, a: int, b: int):
        """Prompt tokens [a, b], the one after the chunk included where there is one ([1, <= b-a+1]), the
        chunk's start [1] and its slot's cache view."""
        ids = torch.tensor(seq.prompt_ids[a:b + 1], device=self.device)[None]
        return ids, torch.tensor([a], device=self.device), self.state.cache.view(seq.slot)

    @torch.no_grad()
    def _prefill_chunk(self, seq: Sequence, a: int, b: int) -> Event | None:
        """Prompt positions [a, b) through the trunk and the MTP layer in passes of their own (`_prefill_rows`,
        compiled with the decode step: padded to a bucket of rows); after the last chunk, the first token
        and first drafts."""
        n, p = len(seq.prompt_ids), seq.params
        last, scored = b == n, b == n and p.logprobs is not None
        # what the first token needs, decided on the host as for a step; nothing before the last chunk
        flags = (needs_sort([p]), scored, plain_greedy([p]) and not scored) if last else (False, False, False)
        rows, context, length = b - a, b, None
        if self.compiled is not None:     # few shapes: each one is a compile
            rows, context = chunk_bucket(b - a, min(self.prefill_chunk, self.prefill_budget)), context_bucket(b)
            length = torch.tensor([b - a], device=self.device)
        ids = seq.prompt_ids[a:b + 1]
        ids = torch.tensor(ids + [0] * (rows + 1 - len(ids)), device=self.device)[None]     # [1, rows+1]
        inputs = (ids, torch.tensor([a], device=self.device), length, self.state.cache.view(seq.slot),
                  self.state.sampling.view(seq.slot))
        key = (rows, context, last, *flags)
        if self.compiled is None:
            first, logprobs, drafts = self._prefill_rows(*key, *inputs)
        else:
            first, logprobs, drafts = self.compiled(("_prefill_rows", *key), *inputs)
        seq.prefilled = b
        self.state.pos[seq.slot] = b
        if not last:
            return None
        self._start_decoding(seq, first, drafts)
        return self._first_event(seq, int(first[0]), None if logprobs is None else logprobs.tolist())

    def _prefill_rows(self, rows: int, context: int, last: bool, sort: bool, scored: bool, greedy: bool,
                      ids, start, length, cache: DecodeState, sampling: SlotParams):
        """A prefill chunk on the device: `rows` prompt tokens from ids [1, rows+1] (then the one after
        the chunk, or padding) at positions start [1].. of the slot's `cache`, through the trunk and the
        MTP layer. `length` [1]: the real rows of a chunk padded to `rows` (None: all). After the
        prompt's `last` chunk, its first token [1] from the slot's `sampling` settings (`sort`, `greedy`
        as in a step), with `scored` what token_logprobs gives for it, and the first drafts [1, K]; else
        Nones."""
        logits, h = self.model.forward_chunk(ids[:, :rows], start, cache, last_only=True, context=context,
                                             length=length)
        nxt, first, logprobs, drafts = ids[:, 1:], None, None, None
        if last:
            end = torch.full_like(start, rows) if length is None else length
            first, logprobs = self._first_token(logits, sampling, slice(None), start + end - 1, sort, scored, greedy)
            nxt = nxt.scatter(1, (end - 1)[:, None], first[:, None])
        if self.drafter is not None:   # the MTP layer sees every prompt row so its window has no holes
            drafts = self.drafter.after_prompt_chunk(h, nxt, start, cache, last, length)
        return first, logprobs, drafts

    def _first_token(self, logits, sp: SlotParams, rows, pos, sort: bool, scored: bool,
                     greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first token [1] from the prompt's last logits [1,1,V] (pos [1]: the prompt's last
        position) with the settings of `sp`'s `rows` (one slot), and with `scored` what token_logprobs
        gives for it. `greedy`: the request is `plain_greedy` and not scored: the argmax, as in a step."""
        if greedy:
            return logits[:, 0].argmax(-1), None
        processed = processed_logits(logits, sp, rows, sp.output_counts[rows, None])
        probs = target_probs(processed, sp, rows, sort)
        first = sample_from(probs[:, 0], uniform(sp.seed[rows], pos, RNG_DRAW))
        return first, token_logprobs(processed, first[:, None])[0, 0] if scored else None

    def _start_decoding(self, seq: Sequence, first: torch.Tensor, drafts: torch.Tensor | None) -> None:
        """The slot's device state after its prompt: the first token and drafts; it decodes from now."""
        state, slot = self.state, seq.slot
        if drafts is not None:
            state.drafts[slot, : self.mtp_depth] = drafts[0]
        state.last[slot] = first[0]
        state.active[slot] = True
        state.sampling.output_counts[slot, first[0]] += 1

    def _first_event(self, seq: Sequence, first: int, scored: list[float] | None) -> Event:
        self.prefilling.remove(seq)
        self._record(seq.slot, seq.prompt_ids + [first])
        logprobs = None if scored is None else [TokenLogprob.from_scored(first, scored, seq.params.logprobs)]
        seq.metrics.t_first = seq.metrics.t_last = time.perf_counter()
        return self._emit(seq, [first], logprobs)

    # ---- the fused decode step ---------------------------------------------------------------

    def _fused_decode(self, nb: int, context: int, sort: bool = True, logprobs: bool = False, greedy: bool = False,
                      chunks: list[tuple[Sequence, int, int]] = ()) -> torch.Tensor:
        """One decode step on the device for slots [0, nb): verify the drafts, commit, draft again.
        Without `chunks` it reads and writes only preallocated tensors, so it can be captured as a graph.
        `sort`: some row filters by top-k / top-p / min-p and needs the vocabulary sorted. `logprobs`:
        some row asked for logprobs. `greedy`: every row is `plain_greedy`, so its tokens are the logits'
        argmax (the same tokens the distributions give). `chunks`: prefill chunks (request, a, b) that
        run in the same forward passes, before the decode rows (see `_decode`).
        Returns [nb, K+2]: the K+1 candidate tokens and the number of accepted drafts; with `logprobs`
        float64 [nb, K+2 + (K+1)(1+2W)]: those, then per candidate row what token_logprobs gives. Then
        a row per chunk that ends its prompt: its first token as candidate 0 of a row with no accepted
        drafts."""
        state, sp, b = self.state, self.state.sampling, slice(0, nb)
        k = self.mtp_depth
        cache = state.cache      # the layers read and write rows [0, nb) of every cache
        pos, last, active = state.pos[b], state.last[b], state.active[b]
        drafts = state.drafts[b, :k]
        rows = torch.cat([last[:, None], drafts], 1)                          # [nb, K+1]
        inputs = [self._chunk_inputs(*chunk) for chunk in chunks]
        *chunk_out, (logits, h) = self.model.forward_segments(
            [Segment(ids[:, : c - a], start, view, c, last_only=True) for (_, a, c), (ids, start, view)
             in zip(chunks, inputs)] + [Segment(rows, pos, cache, context)])
        if greedy:
            tokens, n_acc = verify_greedy(logits.argmax(-1), drafts)
        else:
            # row i is conditioned on drafts 1..i as output tokens: count them for the penalties
            counts = sp.output_counts[b, None].expand(-1, k + 1, -1)
            if k:
                onehot = torch.zeros_like(counts).scatter_(-1, drafts[..., None], 1.0).cumsum(1)
                counts = counts + torch.cat([torch.zeros_like(onehot[:, :1]), onehot], 1)[:, : k + 1]
            processed = processed_logits(logits, sp, b, counts)
            probs = target_probs(processed, sp, b, sort)
            tokens, n_acc = verify(probs, drafts, sp.seed[b], pos)
        # Inactive rows (free slots, prompts still prefilling) keep their state and act as a slot whose
        # drafts were all rejected: they write only positions pos..pos+K (MTP chains included), which
        # is safe for the reason rejected rows are (design.md, position-addressed state). A prefilling
        # slot's pos is the end of its chunks so far, which its next chunk and first decode step rewrite
        # before anything reads them; a free slot's is its last token's, under its `written_to`.
        n_acc = torch.where(active, n_acc, 0)
        prompts, firsts = [], []       # the chunks' MTP rows; (request, first token, scored) per prompt ended
        for (seq, a, c), (ids, start, view), (chunk_logits, chunk_h) in zip(chunks, inputs, chunk_out):
            nxt = ids[:, 1:]
            if c == len(seq.prompt_ids):
                first, scored = self._first_token(chunk_logits, sp, slice(seq.slot, seq.slot + 1), start + c - 1 - a,
                                                  needs_sort([seq.params]), logprobs,
                                                  plain_greedy([seq.params]) and not logprobs)
                firsts.append((seq, first, scored))
                nxt = torch.cat([nxt, first[:, None]], 1)
            prompts.append(PromptRows(chunk_h, nxt, start, view, c == len(seq.prompt_ids)))
        first_drafts = [None] * len(firsts)
        if self.drafter is not None:
            new, first_drafts = self.drafter.after_verify(h, drafts, tokens, n_acc, pos, cache, prompts)
            state.drafts[b, :k] = torch.where(active[:, None], new, drafts)
        state.last[b] = torch.where(active, tokens.gather(1, n_acc[:, None]).squeeze(1), last)
        state.pos[b] = pos + torch.where(active, n_acc + 1, 0)
        sp.output_counts[b].scatter_add_(
            1, tokens, ((torch.arange(k + 1, device=self.device) <= n_acc[:, None]) & active[:, None]).float())
        for (seq, first, _), first_draft in zip(firsts, first_drafts):     # after the decode rows' updates
            self._start_decoding(seq, first, first_draft)
        packed = torch.cat([tokens, n_acc[:, None]], 1)
        packed = torch.cat([packed] + [F.pad(first[:, None], (0, k + 1)) for _, first, _ in firsts])
        if not logprobs:
            return packed
        # each candidate scored by its own row's processed distribution: a correction token reports
        # its probability under the model, not under the residual it was drawn from
        scored = token_logprobs(processed, tokens).flatten(1)
        scored = torch.cat([scored] + [F.pad(s[None], (0, scored.shape[1] - s.numel())) for _, _, s in firsts])
        return torch.cat([packed.double(), scored], 1)

    @torch.no_grad()
    def _decode(self, chunks: list[tuple[Sequence, int, int]] = ()) -> list[Event]:
        """The decode step for the running slots, with this step's prefill `chunks` in its forward
        passes when there are any (eager only: their lengths vary). A chunk runs before the decode rows
        in every layer: the decode rows write garbage for its slot at the chunk's end b..b+K, which, run
        first, would land in ring slots the chunk reads (design.md, the mixed step)."""
        for seq, _, b in chunks:
            seq.prefilled = b
            self.state.pos[seq.slot] = b
        decoding = [s is not None and s not in self.prefilling for s in self.slots]
        nb = max(i for i, d in enumerate(decoding) if d) + 1
        ending = [seq for seq, a, b in chunks if b == len(seq.prompt_ids)]
        running = [s.params for s, d in zip(self.slots[:nb], decoding) if d]
        logprobs = any(p.logprobs is not None for p in running + [s.params for s in ending])
        context = self._context_bound(nb)
        if self.compiled is not None:    # fewer, coarser shapes: each one is a compile
            nb, context = batch_bucket(nb, self.max_batch), context_bucket(context)
        key = (nb, context, needs_sort(running), logprobs, plain_greedy(running) and not logprobs)
        if chunks:
            packed = self._fused_decode(*key, chunks).tolist()       # the one host sync
        else:
            if self.compiled is None:
                fused = functools.partial(self._fused_decode, *key)
            else:
                fused = functools.partial(self.compiled, ("_fused_decode", *key))
            # capture only the step that stays: compiled, with no compile running beside the capture
            capture = self.graphs is not None and (self.compiled is None or (
                self.compiled.is_ready(("_fused_decode", *key)) and not self.compiled.busy))
            packed = (self.graphs.run(key, fused) if capture else fused()).tolist()   # the one host sync
        k = self.mtp_depth
        width = (len(packed[0]) - k - 2) // (k + 1)       # per candidate row, when logprobs are on
        events = [self._first_event(seq, int(row[0]), row[k + 2: k + 2 + width] if seq.params.logprobs is not None
                                    else None)
                  for seq, row in zip(ending, packed[nb:])]
        now = time.perf_counter()
        for i, row in enumerate(packed[:nb]):
            seq = self.slots[i]
            if not decoding[i]:                 # free or prefilling
                continue
            tokens, n = [int(t) for t in row[: k + 1]], int(row[k + 1])
            scored = None
            if seq.params.logprobs is not None:
                scored = [TokenLogprob.from_scored(tokens[j], row[k + 2 + j * width: k + 2 + (j + 1) * width],
                                                   seq.params.logprobs)
                          for j in range(n + 1)]
            if k:
                seq.metrics.count_drafts(k, n)
            seq.metrics.t_last = now
            self._record(i, tokens[: n + 1])
            events.append(self._emit(seq, tokens[: n + 1], scored))
        return events

    def _context_bound(self, nb: int) -> int:
        """A bound on every position this step touches, from host-side lengths, rounded up to a
        bucket so shapes (and captured graphs) repeat."""
        longest = max(len(s.prompt_ids) + len(s.output_ids) for s in self.slots[:nb] if s is not None)
        return -(-(longest + self.mtp_depth + 1) // CONTEXT_BUCKET) * CONTEXT_BUCKET

    # ---- host bookkeeping --------------------------------------------------------------------

    def _record(self, slot: int, tokens: list[int]) -> None:
        if self.reuse_prefix:
            self.state.history[slot].record(tokens, self.mtp_depth)

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> Event:
        """Committed tokens into the request's output (stop rules); a finished request frees its slot."""
        event = append_output(seq, tokens, logprobs, self.tok.eos_id, self.max_seq_len)
        if event.finished:
            self._free(seq.slot)
            self.totals.merge(seq.metrics)
        return event

    def _free(self, slot: int) -> None:
        self.slots[slot] = None
        self.state.active[slot] = False


def compiling_engine(reload, options: dict) -> Engine:
    """In a compiling process: this engine again, on a fresh load of its model, compiling in the foreground."""
    model, tokenizer = reload()
    return Engine(model, tokenizer, **options, compile=True)
