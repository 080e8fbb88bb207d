"""The engine: requests in, streamed tokens out, with continuous batching and fused MTP speculation.

One decode step for the running batch, all on the device:
  trunk over [last token, K drafts] -> target distributions -> verify -> MTP over the same rows with
  the committed tokens -> next K drafts (the MTP layer chained on its own streams for K > 1).
The host reads one packed tensor per step (committed tokens + counts, and their logprobs when a running
request asked for them) and does the bookkeeping:
detokenising, stop checks, metrics. Sequences join (after a chunked prefill) and leave between steps.
"""
import functools
import itertools
import random
import time
from dataclasses import dataclass, field

import torch

from dsv4cli.model import DecodeState, Transformer
from dsv4cli.tokenizer import StreamDecoder, Tokenizer

from .api import ModelInfo
from .compiled import CompiledStep, batch_bucket, context_bucket
from .graphs import StepGraphs
from .sampling import (
    TOP_LOGPROBS,
    SamplingParams,
    SlotParams,
    needs_sort,
    processed_logits,
    sample_from,
    target_probs,
    token_logprobs,
    uniform,
    verify,
)


@dataclass
class Metrics:
    """Per-request timings and speculative-decoding counters (vLLM definitions)."""
    t_submit: float = 0.0
    t_first: float = 0.0
    t_last: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0          # prompt tokens whose state was reused, not prefilled
    output_tokens: int = 0
    drafts: int = 0                 # steps that proposed drafts
    draft_tokens: int = 0           # drafts proposed
    accepted_tokens: int = 0        # drafts accepted
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.t_first - self.t_submit

    @property
    def tpot(self) -> float:
        return (self.t_last - self.t_first) / max(self.output_tokens - 1, 1)

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first over the time after the first."""
        dt = self.t_last - self.t_first
        return (self.output_tokens - 1) / dt if dt > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def per_position(self) -> list[float]:
        return [a / self.drafts for a in self.accepted_per_position] if self.drafts else []

    def merge(self, other: "Metrics") -> None:
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.output_tokens += other.output_tokens
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        if len(self.accepted_per_position) < len(other.accepted_per_position):
            self.accepted_per_position += [0] * (len(other.accepted_per_position) - len(self.accepted_per_position))
        for i, a in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += a

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "output_tokens": self.output_tokens,
                "ttft_s": round(self.ttft, 6), "tpot_s": round(self.tpot, 6),
                "tokens_per_s": round(self.tokens_per_s, 3), "drafts": self.drafts,
                "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "acceptance_rate": round(self.acceptance_rate, 4),
                "mean_acceptance_length": round(self.mean_acceptance_length, 4),
                "per_position": [round(p, 4) for p in self.per_position]}


@dataclass
class TokenLogprob:
    """A committed token's logprob under the processed distribution, and the most likely alternatives."""
    token: int
    logprob: float
    top: list[tuple[int, float]]       # (token id, logprob), most likely first


@dataclass
class Sequence:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0                # characters of `text` already streamed
    finish_reason: str | None = None
    slot: int = -1
    metrics: Metrics = field(default_factory=Metrics)
    decoder: StreamDecoder | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)     # one per output id, when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Event:
    """What one step produced for one sequence: new text/tokens, and whether it finished."""
    seq: Sequence
    text: str
    token_ids: list[int]
    finished: bool


CONTEXT_BUCKET = 512   # compressed-KV reads are bounded to a multiple of this many tokens
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


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, max_batch: int = 8, max_seq_len: int = 4096,
                 mtp: int = 1, prefill_chunk: int = 256, graphs: bool = True, reuse_prefix: bool = False,
                 compile: bool = False):
        if mtp and not model.cfg.n_mtp_layers:
            raise ValueError("this checkpoint has no MTP layer; use mtp 0")
        self.model, self.tok = model, tokenizer
        self.max_batch, self.max_seq_len, self.k = max_batch, max_seq_len, mtp
        self.prefill_chunk = prefill_chunk
        self.device = model.embed.weight.device
        # Prefix reuse: a new prompt starts where a free slot's state stops matching it (a chat turn
        # resumes the previous one). Off by default: batch output must not depend on slot history.
        self.reuse_prefix = reuse_prefix
        self.state = DecodeState(model, max_batch, max_seq_len, max_draft=max(mtp, 1) + 1,
                                 spare=SPARE_RING_ROWS if reuse_prefix else 0)
        self.history = [SlotHistory() for _ in range(max_batch)]
        vocab = model.cfg.vocab_size
        self.params = SlotParams(max_batch, vocab, self.device)
        # device-resident speculative state per slot: the last committed token (not yet run through
        # the trunk), its position, and the drafts for the next step
        self.last = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self.drafts = torch.zeros(max_batch, max(mtp, 1), dtype=torch.long, device=self.device)
        self.slots: list[Sequence | None] = [None] * max_batch
        self.waiting: list[Sequence] = []
        self.totals = Metrics()
        self._ids = itertools.count()
        self.graphs = StepGraphs.for_device(self.device) if graphs else None
        # the fused step compiled (torch.compile); captured graphs replay the compiled kernels
        self.compiled = (CompiledStep(self._device_step, self.device, (mtp, max_batch, max_seq_len))
                         if compile else None)

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
        if not seq.finished:
            seq.finish_reason = "cancelled"
        if 0 <= seq.slot < self.max_batch and self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None

    def resized(self, max_batch: int, mtp: int, compile: bool | None = None) -> "Engine":
        """A new engine on the same loaded model with another batch size or MTP depth."""
        return Engine(self.model, self.tok, max_batch=max_batch, max_seq_len=self.max_seq_len, mtp=mtp,
                      prefill_chunk=self.prefill_chunk, graphs=self.graphs is not None,
                      reuse_prefix=self.reuse_prefix,
                      compile=self.compiled is not None if compile is None else compile)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    @functools.cached_property
    def model_info(self) -> ModelInfo:
        return ModelInfo.of(self.model)

    def step(self) -> list[Event]:
        """Admit waiting requests into free slots (prefill), then one decode step for all running."""
        events = []
        while self.waiting and None in self.slots:
            events.append(self._admit(self.waiting.pop(0)))
        if any(s is not None for s in self.slots):
            events += self._decode()
        return events

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
        seqs = [self.submit(p, params) for p in prompts]
        while self.has_work():
            self.step()
        return seqs

    # ---- internals ---------------------------------------------------------------------------

    def _resume_point(self, h: SlotHistory, prompt: list[int]) -> int:
        """The first prompt position to prefill in a slot holding `h`; the state of every row before it
        is the one this prompt would produce."""
        n = min(len(prompt), len(h.tokens))
        same = next((i for i in range(n) if prompt[i] != h.tokens[i]), n)
        # row p of the MTP layer read token p+1: redo the row before the first differing token
        start = same - 1
        if start <= 0:
            return 0
        # the rows the prefill reads before `start` must still be in the rings, not overwritten
        # by later positions of the same slot
        lowest = max(0, start - self.state.lookback)
        return start if lowest >= h.trusted_from(self.state.ring) else 0

    def _record(self, slot: int, tokens: list[int]) -> None:
        if not self.reuse_prefix:
            return
        h = self.history[slot]
        h.tokens += tokens
        # trunk rows reach pos + K, MTP chains pos + n_acc + K - 1: both below len + K
        h.written_to = max(h.written_to, len(h.tokens) + self.k)

    @torch.no_grad()
    def _admit(self, seq: Sequence) -> Event:
        """Chunked prefill of the trunk and the MTP layer (from the reusable prefix on), first token,
        first drafts."""
        free = [i for i, s in enumerate(self.slots) if s is None]
        starts = {i: self._resume_point(self.history[i], seq.prompt_ids) if self.reuse_prefix else 0 for i in free}
        slot = max(free, key=lambda i: (starts[i], -i))
        reused, old = starts[slot], self.history[slot]
        self.history[slot] = (SlotHistory(valid_from=old.trusted_from(self.state.ring), written_to=old.written_to)
                              if reused else SlotHistory())
        self.slots[slot], seq.slot = seq, slot
        seq.metrics.cached_tokens = reused
        ids = torch.tensor(seq.prompt_ids, device=self.device)
        self.params.set(slot, seq.params, seq.seed, ids)
        view = self.state.slot(slot)
        n = len(seq.prompt_ids)
        for a in range(reused, n, self.prefill_chunk):
            b = min(a + self.prefill_chunk, n)
            start = torch.tensor([a], device=self.device)
            logits, h = self.model.step(ids[None, a:b], start, view, last_only=True, context=b)
            if b < n:
                nxt = ids[None, a + 1:b + 1]
            else:
                processed = processed_logits(logits, self.params, slice(slot, slot + 1),
                                             self.params.output_counts[slot:slot + 1, None])
                probs = target_probs(processed, self.params, slice(slot, slot + 1), needs_sort([seq.params]))
                first = sample_from(probs[:, 0], uniform(self.params.seed[slot:slot + 1], start + b - 1 - a, 2))
                scored = token_logprobs(processed, first[:, None])[0, 0] if seq.params.logprobs is not None else None
                nxt = torch.cat([ids[None, a + 1:b], first[:, None]], 1)
            if self.k:   # the MTP layer sees every prompt row so its window has no holes
                mtp_logits, streams = self.model.mtp_step(h, nxt, start, view)
        if self.k:
            self.drafts[slot, : self.k] = self._chain(mtp_logits[:, -1], streams[:, -1:], n, view)[0]
        self.last[slot], self.pos[slot] = first[0], n
        self.params.output_counts[slot, first[0]] += 1
        self._record(slot, seq.prompt_ids + [int(first[0])])
        logprobs = None if scored is None else [self._logprob(int(first[0]), scored.tolist(), seq.params.logprobs)]
        return self._emit(seq, [int(first[0])], logprobs, first_token=True)

    def _chain(self, logits, streams, pos, state):
        """Greedy drafts: the first from `logits`; for K > 1 the MTP layer runs again on its own
        streams and its latest draft, one position further each time."""
        draft = logits.argmax(-1)
        drafts = [draft]
        start = pos if torch.is_tensor(pos) else torch.tensor([pos], device=self.device)
        for i in range(1, self.k):
            lg, streams = self.model.mtp_step(streams, draft[:, None], start + i - 1, state)
            draft = lg[:, -1].argmax(-1)
            drafts.append(draft)
        return torch.stack(drafts, 1)

    def _device_step(self, nb: int, context: int, sort: bool = True, logprobs: bool = False) -> torch.Tensor:
        """The fused step on the device for slots [0, nb): verify the drafts, commit, draft again.
        Reads and writes only preallocated tensors, so it can be captured as a graph. `sort`: some
        row filters by top-k / top-p / min-p and needs the vocabulary sorted. `logprobs`: some row
        asked for logprobs.
        Returns [nb, K+2]: the K+1 candidate tokens and the number of accepted drafts; with `logprobs`
        float64 [nb, K+2 + (K+1)(1+2W)]: those, then per candidate row what token_logprobs gives."""
        b = slice(0, nb)
        k = self.k
        view = self.state      # the layers read and write rows [0, nb) of every cache
        pos, last = self.pos[b], self.last[b]
        drafts = self.drafts[b, :k]
        rows = torch.cat([last[:, None], drafts], 1)                          # [nb, K+1]
        logits, h = self.model.step(rows, pos, view, context=context)
        # row i is conditioned on drafts 1..i as output tokens: count them for the penalties
        counts = self.params.output_counts[b, None].expand(-1, k + 1, -1)
        if k:
            onehot = torch.zeros_like(counts).scatter_(-1, drafts[..., None], 1.0).cumsum(1)
            counts = counts + torch.cat([torch.zeros_like(onehot[:, :1]), onehot], 1)[:, : k + 1]
        processed = processed_logits(logits, self.params, b, counts)
        probs = target_probs(processed, self.params, b, sort)
        tokens, n_acc = verify(probs, drafts, self.params.seed[b], pos)
        if k:
            # MTP over every verified row: row p takes t_{p+1}, the committed token where there is one
            nxt = torch.cat([drafts, drafts[:, :1]], 1).scatter(1, n_acc[:, None], tokens.gather(1, n_acc[:, None]))
            mtp_logits, streams = self.model.mtp_step(h, nxt, pos, view)
            sel = n_acc.view(-1, 1, 1)
            last_logits = mtp_logits.gather(1, sel.expand(-1, 1, mtp_logits.shape[-1]))[:, 0]
            last_streams = streams.gather(1, sel[..., None].expand(-1, 1, *streams.shape[2:]))
            self.drafts[b, :k] = self._chain(last_logits, last_streams, pos + n_acc + 1, view)
        self.last[b] = tokens.gather(1, n_acc[:, None]).squeeze(1)
        self.pos[b] = pos + n_acc + 1
        self.params.output_counts[b].scatter_add_(
            1, tokens, (torch.arange(k + 1, device=self.device) <= n_acc[:, None]).float())
        packed = torch.cat([tokens, n_acc[:, None]], 1)
        if not logprobs:
            return packed
        # each candidate scored by its own row's processed distribution: a correction token reports
        # its probability under the model, not under the residual it was drawn from
        return torch.cat([packed.double(), token_logprobs(processed, tokens).flatten(1)], 1)

    @torch.no_grad()
    def _decode(self) -> list[Event]:
        nb = max(i for i, s in enumerate(self.slots) if s is not None) + 1
        running = [s.params for s in self.slots[:nb] if s is not None]
        logprobs = any(p.logprobs is not None for p in running)
        context = self._context_bound(nb)
        if self.compiled is not None:    # fewer, coarser shapes: each one is a compile
            nb, context = batch_bucket(nb, self.max_batch), context_bucket(context)
        key = (nb, context, needs_sort(running), logprobs)
        run = self._device_step if self.compiled is None else self.compiled
        step = lambda: run(*key)  # noqa: E731
        packed = (step() if self.graphs is None else self.graphs.run(key, step)).tolist()   # the one host sync
        k = self.k
        width = (len(packed[0]) - k - 2) // (k + 1)       # per candidate row, when logprobs are on
        now = time.perf_counter()
        events = []
        for i, row in enumerate(packed):
            seq = self.slots[i]
            if seq is None:
                continue
            tokens, n = [int(t) for t in row[: k + 1]], int(row[k + 1])
            scored = None
            if seq.params.logprobs is not None:
                scored = [self._logprob(tokens[j], row[k + 2 + j * width: k + 2 + (j + 1) * width], seq.params.logprobs)
                          for j in range(n + 1)]
            m = seq.metrics
            if k:
                m.drafts += 1
                m.draft_tokens += k
                m.accepted_tokens += n
                if not m.accepted_per_position:
                    m.accepted_per_position = [0] * k
                for j in range(n):
                    m.accepted_per_position[j] += 1
            m.t_last = now
            self._record(i, tokens[: n + 1])
            events.append(self._emit(seq, tokens[: n + 1], scored))
        return events

    @staticmethod
    def _logprob(token: int, scored: list[float], n_top: int) -> TokenLogprob:
        """One candidate row of token_logprobs, read back on the host, with the request's n_top alternatives."""
        w = (len(scored) - 1) // 2
        top = [(int(t), v) for v, t in zip(scored[1: 1 + n_top], scored[1 + w: 1 + w + n_top])]
        return TokenLogprob(token, scored[0], top)

    def _context_bound(self, nb: int) -> int:
        """A bound on every position this step touches, from host-side lengths, rounded up to a
        bucket so shapes (and captured graphs) repeat."""
        longest = max(len(s.prompt_ids) + len(s.output_ids) for s in self.slots[:nb] if s is not None)
        return -(-(longest + self.k + 1) // CONTEXT_BUCKET) * CONTEXT_BUCKET

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None,
              first_token: bool = False) -> Event:
        """Append committed tokens to a sequence, applying stop rules; free its slot when done.

        Text that could still turn into a stop string is held back until it can't."""
        m = seq.metrics
        if first_token:
            m.t_first = m.t_last = time.perf_counter()
        p = seq.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else {self.tok.eos_id})
        new_ids, text = [], ""
        for j, t in enumerate(tokens):
            if t in stops:
                seq.finish_reason = "stop"
                break
            new_ids.append(t)
            seq.output_ids.append(t)
            if logprobs is not None:
                seq.logprobs.append(logprobs[j])
            text += seq.decoder.push(t)
            if len(seq.output_ids) >= p.max_tokens or len(seq.prompt_ids) + len(seq.output_ids) >= self.max_seq_len:
                seq.finish_reason = "length"
                break
        m.output_tokens = len(seq.output_ids)
        if seq.finished:
            text += seq.decoder.flush()
        full = seq.text + text
        longest = max((len(s) for s in p.stop), default=0)
        for s in p.stop:
            cut = full.find(s, max(0, len(seq.text) - len(s) + 1))
            if cut >= 0:
                full = full[:cut]
                seq.finish_reason = "stop"
        seq.text = full
        ready = len(full) if seq.finished else max(seq.emitted, len(full) - longest + 1 if longest else len(full))
        text, seq.emitted = full[seq.emitted:ready], ready
        if seq.finished:
            self.slots[seq.slot] = None
            self.totals.merge(m)
        return Event(seq, text, new_ids, seq.finished)
