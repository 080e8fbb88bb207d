"""The engine: requests in, streamed tokens out, with continuous batching and fused MTP speculation.

Admission (`_assign`, `_prefill`): a waiting request takes a free slot (with prefix reuse, the one whose
state it resumes furthest: `prefix.py`), its prompt is prefilled in chunks through the trunk and the MTP
layer, at most `prefill_budget` tokens per step, and the first token and first drafts come out of its
last chunk. Each step then runs one fused decode step for the running slots, all on the device
(`_fused_decode`):
  trunk over [last token, K drafts] -> target distributions (`sampling.py`) -> verify (`verify.py`) ->
  MTP over the same rows with the committed tokens -> next K drafts (`mtp.py`).
The host reads one packed tensor per step (committed tokens + counts, and their logprobs when a running
request asked for them) and does the bookkeeping: metrics, detokenising and stop rules (`output.py`).
Requests (`request.py`) join and leave between steps; every per-slot tensor lives in `slots.py`.
"""
import functools
import itertools
import random
import time

import torch

from dsv4cli.model import Transformer
from dsv4cli.tokenizer import StreamDecoder, Tokenizer

from .api import ModelInfo
from .compiled import CompiledDecode, batch_bucket, context_bucket
from .graphs import DecodeGraphs
from .mtp import MTPDrafter
from .output import append_output
from .request import Event, Metrics, Sequence, TokenLogprob
from .sampling import (
    RNG_DRAW,
    TOP_LOGPROBS,
    SamplingParams,
    needs_sort,
    processed_logits,
    sample_from,
    target_probs,
    token_logprobs,
    uniform,
)
from .slots import SlotState
from .verify import verify

CONTEXT_BUCKET = 512   # compressed-KV reads are bounded to a multiple of this many tokens


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, max_batch: int = 8, max_seq_len: int = 4096,
                 mtp: int = 1, prefill_chunk: int = 256, prefill_budget: int = 512, graphs: bool = True,
                 reuse_prefix: bool = False, compile: bool = False, compile_in_background: bool = False):
        if mtp and not model.cfg.n_mtp_layers:
            raise ValueError("this checkpoint has no MTP layer; use mtp 0")
        self.model, self.tok = model, tokenizer
        self.max_batch, self.max_seq_len, self.mtp_depth = max_batch, max_seq_len, mtp
        # prefill tokens per step: running streams wait at most this much prefill between tokens
        self.prefill_chunk, self.prefill_budget = prefill_chunk, prefill_budget
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
        self._ids = itertools.count()
        self.graphs = DecodeGraphs.for_device(self.device) if graphs else None
        # the fused decode step compiled (torch.compile); captured graphs replay the compiled kernels
        self.compiled = (CompiledDecode(self._fused_decode, self.device, (mtp, max_batch, max_seq_len),
                                        background=compile_in_background) if compile else None)

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
        return Engine(self.model, self.tok, max_batch=max_batch, max_seq_len=self.max_seq_len, mtp=mtp,
                      prefill_chunk=self.prefill_chunk, prefill_budget=self.prefill_budget,
                      graphs=self.graphs is not None,
                      reuse_prefix=self.reuse_prefix,
                      compile=self.compiled is not None if compile is None else compile,
                      compile_in_background=self.compiled is not None and self.compiled.background)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    @functools.cached_property
    def model_info(self) -> ModelInfo:
        return ModelInfo.of(self.model)

    def step(self) -> list[Event]:
        """Prefill chunks of admitted requests within the token budget (a request whose last chunk runs
        gives its first token and joins decoding), then one decode step for the running slots. With no
        stream running before the step, it returns after the prefill, so a first token streams without
        waiting for a decode step (nor for its compile)."""
        while self.waiting and None in self.slots:
            self._assign(self.waiting.pop(0))
        running = any(s is not None and s not in self.prefilling for s in self.slots)
        events = self._prefill(self.prefill_budget)
        if running:
            events += self._decode()
        return events

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

    def _prefill(self, budget: int) -> list[Event]:
        """Prefill chunks, oldest request first, up to `budget` tokens (a chunk is cut to fit)."""
        events = []
        while budget > 0 and self.prefilling:
            seq = self.prefilling[0]
            a = seq.prefilled
            b = min(a + self.prefill_chunk, a + budget, len(seq.prompt_ids))
            budget -= b - a
            event = self._prefill_chunk(seq, a, b)
            if event is not None:
                self.prefilling.pop(0)
                events.append(event)
        return events

    @torch.no_grad()
    def _prefill_chunk(self, seq: Sequence, a: int, b: int) -> Event | None:
        """Prompt positions [a, b) through the trunk and the MTP layer; after the last chunk, the first
        token and first drafts."""
        state, sp, slot = self.state, self.state.sampling, seq.slot
        view = state.cache.view(slot)
        n = len(seq.prompt_ids)
        ids = torch.tensor(seq.prompt_ids[a:b + 1], device=self.device)[None]
        start = torch.tensor([a], device=self.device)
        logits, h = self.model.forward_chunk(ids[:, : b - a], start, view, last_only=True, context=b)
        if b < n:
            nxt = ids[:, 1:]
        else:
            processed = processed_logits(logits, sp, slice(slot, slot + 1), sp.output_counts[slot:slot + 1, None])
            probs = target_probs(processed, sp, slice(slot, slot + 1), needs_sort([seq.params]))
            first = sample_from(probs[:, 0], uniform(sp.seed[slot:slot + 1], start + b - 1 - a, RNG_DRAW))
            scored = token_logprobs(processed, first[:, None])[0, 0] if seq.params.logprobs is not None else None
            nxt = torch.cat([ids[:, 1:], first[:, None]], 1)
        if self.drafter is not None:   # the MTP layer sees every prompt row so its window has no holes
            drafts = self.drafter.after_prompt_chunk(h, nxt, start, view, last=b == n)
        seq.prefilled = b
        state.pos[slot] = b
        if b < n:
            return None
        if self.drafter is not None:
            state.drafts[slot, : self.mtp_depth] = drafts[0]
        state.last[slot] = first[0]
        state.active[slot] = True
        sp.output_counts[slot, first[0]] += 1
        self._record(slot, seq.prompt_ids + [int(first[0])])
        logprobs = (None if scored is None
                    else [TokenLogprob.from_scored(int(first[0]), scored.tolist(), seq.params.logprobs)])
        seq.metrics.t_first = seq.metrics.t_last = time.perf_counter()
        return self._emit(seq, [int(first[0])], logprobs)

    # ---- the fused decode step ---------------------------------------------------------------

    def _fused_decode(self, nb: int, context: int, sort: bool = True, logprobs: bool = False) -> torch.Tensor:
        """One decode step on the device for slots [0, nb): verify the drafts, commit, draft again.
        Reads and writes only preallocated tensors, so it can be captured as a graph. `sort`: some
        row filters by top-k / top-p / min-p and needs the vocabulary sorted. `logprobs`: some row
        asked for logprobs.
        Returns [nb, K+2]: the K+1 candidate tokens and the number of accepted drafts; with `logprobs`
        float64 [nb, K+2 + (K+1)(1+2W)]: those, then per candidate row what token_logprobs gives."""
        state, sp, b = self.state, self.state.sampling, slice(0, nb)
        k = self.mtp_depth
        cache = state.cache      # the layers read and write rows [0, nb) of every cache
        pos, last, active = state.pos[b], state.last[b], state.active[b]
        drafts = state.drafts[b, :k]
        rows = torch.cat([last[:, None], drafts], 1)                          # [nb, K+1]
        logits, h = self.model.forward_chunk(rows, pos, cache, context=context)
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
        # slot's pos is its next prefill position, which its next chunk and first decode step rewrite
        # before anything reads them; a free slot's is its last token's, under its `written_to`.
        n_acc = torch.where(active, n_acc, 0)
        if self.drafter is not None:
            new = self.drafter.after_verify(h, drafts, tokens, n_acc, pos, cache)
            state.drafts[b, :k] = torch.where(active[:, None], new, drafts)
        state.last[b] = torch.where(active, tokens.gather(1, n_acc[:, None]).squeeze(1), last)
        state.pos[b] = pos + torch.where(active, n_acc + 1, 0)
        sp.output_counts[b].scatter_add_(
            1, tokens, ((torch.arange(k + 1, device=self.device) <= n_acc[:, None]) & active[:, None]).float())
        packed = torch.cat([tokens, n_acc[:, None]], 1)
        if not logprobs:
            return packed
        # each candidate scored by its own row's processed distribution: a correction token reports
        # its probability under the model, not under the residual it was drawn from
        return torch.cat([packed.double(), token_logprobs(processed, tokens).flatten(1)], 1)

    @torch.no_grad()
    def _decode(self) -> list[Event]:
        decoding = [s is not None and s not in self.prefilling for s in self.slots]
        nb = max(i for i, d in enumerate(decoding) if d) + 1
        running = [s.params for s, d in zip(self.slots[:nb], decoding) if d]
        logprobs = any(p.logprobs is not None for p in running)
        context = self._context_bound(nb)
        if self.compiled is not None:    # fewer, coarser shapes: each one is a compile
            nb, context = batch_bucket(nb, self.max_batch), context_bucket(context)
        key = (nb, context, needs_sort(running), logprobs)
        run = self._fused_decode if self.compiled is None else self.compiled
        fused = lambda: run(*key)  # noqa: E731
        # capture only the step that stays: compiled, with no compile running beside the capture
        capture = self.graphs is not None and (self.compiled is None
                                               or (self.compiled.is_ready(key) and not self.compiled.busy))
        packed = (self.graphs.run(key, fused) if capture else fused()).tolist()   # the one host sync
        k = self.mtp_depth
        width = (len(packed[0]) - k - 2) // (k + 1)       # per candidate row, when logprobs are on
        now = time.perf_counter()
        events = []
        for i, row in enumerate(packed):
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
