"""On-device sampling, batched over requests with their own settings: penalties, filters, the target
distributions (greedy rows one-hot, so greedy and sampled requests share one verification rule,
`verify.py`), logprobs and counter-based randomness.

Logprobs are those of the processed distribution: the logits after logit_bias, penalties and temperature
(temperature 0 counts as 1, so greedy rows report the model's own distribution, not the one-hot they
select with), before top-k / top-p / min-p truncation; vLLM calls these processed logprobs.

Randomness is counter-based: a request's uniforms are a hash of (seed, position, purpose), so a seeded
request gives the same tokens whatever else is in the batch, with no generator state to carry.
"""
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import NamedTuple

import torch

from .grammar import Grammar

FLOAT32_MAX = 3.4e38
INT64_MAX = (1 << 63) - 1


def _logits(default=MISSING, **kwargs):
    """A field that changes a row's logits unless at its default: a greedy request with one set is no longer
    `plain_greedy` (its token is not the raw logits' argmax)."""
    return field(default=default, **kwargs, metadata={"changes_logits": True})


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = _logits(1.0)
    presence_penalty: float = _logits(0.0)
    frequency_penalty: float = _logits(0.0)
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = _logits(0)    # EOS, stop_token_ids and stop strings end no reply shorter than this
    logprobs: int | None = None     # None: off; N: the committed token's logprob and the N most likely (<= 20)
    # None: off; N: each prompt token's logprob under the model (its raw logits, after the tokens before it) and
    # the N most likely there (<= 20); the prompt is then prefilled whole (no reused prefix: `prefix.py`)
    prompt_logprobs: int | None = None
    # with prompt_logprobs: per prompt position (0 unused), ids whose logprobs are reported there too, as many at
    # each (another run's top ids, for a KL divergence: `dsv4 perplexity`)
    score_ids: list[list[int]] | None = None
    logit_bias: dict[int, float] = _logits(default_factory=dict)    # token id -> added to its logit
    # a background request (an API batch's) gives way: a step that prefills a foreground prompt while only
    # background requests decode runs the prefill alone (`scheduler.streams_to_decode`); its tokens are the same
    background: bool = False
    grammar: Grammar | None = None      # what the reply must match (structured output: `grammar.py`)

    def problem(self, vocab: int, prompt: int | None = None) -> str | None:
        """Why these settings can't run on the device of a model with `vocab` tokens (for a prompt of `prompt`
        tokens), or None: a number no float32 or int64 holds, a negative temperature or a penalty that rounds
        to 0 (it divides), more logprobs than the step returns, a biased or scored id that is no token. The
        front ends refuse values outside the meaningful ranges (`config.SPEC`); this guards the engine's own
        callers."""
        floats = {name: getattr(self, name) for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                                                          "presence_penalty", "frequency_penalty")}
        for name, v in (floats | {f"logit_bias[{t}]": b for t, b in self.logit_bias.items()}).items():
            number = isinstance(v, int | float) and not isinstance(v, bool)
            if not (number and math.isfinite(v) and abs(v) <= FLOAT32_MAX):
                return f"{name}: must be a finite float32 number, got {v!r}"
        if self.temperature < 0:
            return f"temperature: must be >= 0, got {self.temperature!r}"
        if not self.repetition_penalty >= 1e-30:
            return f"repetition_penalty: must be > 0, got {self.repetition_penalty!r}"
        for name in ("top_k", "seed", "max_tokens", "min_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not -INT64_MAX <= v <= INT64_MAX):
                return f"{name}: must be an integer that fits in 64 bits, got {v!r}"
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= TOP_LOGPROBS:
                return f"{name}: must be 0..{TOP_LOGPROBS}, got {v}"
        if self.score_ids is not None:
            if self.prompt_logprobs is None:
                return "score_ids: only with prompt_logprobs"
            width = len(self.score_ids[0]) if self.score_ids else 0
            if not width or any(len(ids) != width or not all(0 <= t < vocab for t in ids) for ids in self.score_ids):
                return f"score_ids: as many ids at each position (at least one), each in 0..{vocab - 1}"
            if prompt is not None and len(self.score_ids) != prompt:
                return f"score_ids: one list per prompt position ({prompt}), got {len(self.score_ids)}"
        if self.max_tokens < 0:
            return f"max_tokens: must be >= 0 (0: score the prompt only), got {self.max_tokens}"
        if not 0 <= self.min_tokens <= max(self.max_tokens, 0):
            return f"min_tokens: must be in 0..max_tokens ({self.max_tokens}), got {self.min_tokens}"
        bad = next((t for t in self.logit_bias if not 0 <= t < vocab), None)
        if bad is not None:
            return f"logit_bias: token id {bad} is not in the vocabulary (0..{vocab - 1})"
        if self.grammar is not None and self.ignore_eos:
            return "ignore_eos: not with a constrained reply (its grammar says where it ends)"
        return None


# the logprob reported for a token a grammar forbids (OpenAI's figure for "never")
MASKED_LOGPROB = -9999.0
# alternatives the device returns whenever logprobs are on: a fixed width keeps the step capturable
TOP_LOGPROBS = 20


class SlotParams:
    """Per-slot sampling settings as device tensors [max_batch] (written on admission), with the prompt
    mask and output-token counts [max_batch, vocab] the penalties read (counts updated every step)."""

    def __init__(self, n: int, vocab: int, device):
        def t(value, dtype=torch.float32):
            return torch.full((n,), value, dtype=dtype, device=device)

        self.temperature, self.top_p, self.top_k, self.min_p = t(0.0), t(1.0), t(0, torch.long), t(0.0)
        self.rep, self.presence, self.frequency = t(1.0), t(0.0), t(0.0)
        self.seed = t(0, torch.long)
        self.output_counts = torch.zeros(n, vocab, dtype=torch.float32, device=device)
        self.prompt_mask = torch.zeros(n, vocab, dtype=torch.bool, device=device)
        self.bias = torch.zeros(n, vocab, dtype=torch.float32, device=device)
        # min_tokens: the ids that end a reply (EOS, stop_token_ids), held back while the slot's output is shorter
        self.min_tokens, self.first_pos = t(0, torch.long), t(0, torch.long)     # first_pos: its first token's row
        self.stops = torch.zeros(n, vocab, dtype=torch.bool, device=device)
        self._views: dict[int, SlotParams] = {}

    def nbytes(self) -> int:
        """The bytes of its tensors (on the meta device: what it would allocate)."""
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor))

    def view(self, slot: int) -> "SlotParams":
        """One slot's settings as a SlotParams of one row (views: writes land here), cached like
        DecodeState's views."""
        if slot not in self._views:
            view = object.__new__(SlotParams)
            view.__dict__.update({k: t[slot:slot + 1] for k, t in vars(self).items() if isinstance(t, torch.Tensor)})
            view._views = {}
            self._views[slot] = view
        return self._views[slot]

    def set(self, slot: int, p: SamplingParams, seed: int, prompt_ids: torch.Tensor, eos: int | None = None):
        """A request's settings into `slot`; `eos`: the tokenizer's, which min_tokens holds back."""
        self.temperature[slot], self.top_p[slot], self.top_k[slot] = p.temperature, p.top_p, p.top_k
        self.min_p[slot], self.rep[slot] = p.min_p, p.repetition_penalty
        self.presence[slot], self.frequency[slot] = p.presence_penalty, p.frequency_penalty
        self.seed[slot] = seed
        self.output_counts[slot].zero_()
        self.prompt_mask[slot].zero_()
        self.prompt_mask[slot, prompt_ids] = True
        self.bias[slot].zero_()
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=self.bias.device)
            self.bias[slot, ids] = torch.tensor(list(p.logit_bias.values()), device=self.bias.device)
        self.min_tokens[slot], self.first_pos[slot] = p.min_tokens, len(prompt_ids) - 1
        self.stops[slot].zero_()
        if p.min_tokens:
            ids = [t for t in [*([] if eos is None else [eos]), *p.stop_token_ids] if 0 <= t < self.stops.shape[1]]
            self.stops[slot, torch.tensor(ids, dtype=torch.long, device=self.stops.device)] = True


# what a request's uniforms are for: each purpose its own stream, so no two draws share a number
RNG_ACCEPT = 1      # accepting a draft
RNG_DRAW = 2        # drawing a token: the first, a correction or a bonus
RNG_DRAFT = 3       # drawing a draft from the drafter's distribution


def uniform(seed: torch.Tensor, pos: torch.Tensor, purpose: int) -> torch.Tensor:
    """Deterministic uniforms in [0,1) from (seed, position, purpose) with a splitmix64-style hash."""
    x = seed * 0x9E3779B1 + pos * 0x85EBCA77 + purpose * 0xC2B2AE3D
    for mul in (0xBF58476D1CE4E5B9 - (1 << 64), 0x94D049BB133111EB - (1 << 64)):
        x = (x ^ (x >> 31) & 0x1FFFFFFFF) * mul
    x = x ^ ((x >> 29) & 0x7FFFFFFFF)
    return ((x >> 11) & ((1 << 53) - 1)).double().mul(2.0 ** -53).float()


def needs_sort(params: list[SamplingParams]) -> bool:
    """Whether any sampled request filters by rank or mass (top-k, top-p, min-p): only those need the
    vocabulary sorted. Decided on the host for a step's requests, so each step's shapes are static."""
    return any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0) for p in params)


# the fields that change logits (`_logits`), at the values that leave them as they are
NEUTRAL = {f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(SamplingParams)
           if f.metadata.get("changes_logits")}


def plain_greedy(params: list[SamplingParams]) -> bool:
    """Whether every request is greedy with nothing that changes its logits (`NEUTRAL`) and no logprobs: its
    token is then the raw logits' argmax, and a step needs no distribution at all (at V4 Flash's vocabulary
    the penalties, softmax and draw were ~10 passes over 129k logits per row). Decided on the host for a
    step's requests, as `needs_sort` is."""
    return all(p.temperature == 0 and p.logprobs is None and all(getattr(p, k) == v for k, v in NEUTRAL.items())
               for p in params)


class SamplingMode(NamedTuple):
    """How a step's committing rows choose their tokens, decided on the host from their requests: static in the
    step (each mode a compiled graph of its own)."""
    rule: str = "greedy"      # "greedy": every request is `plain_greedy` (its token the logits' argmax, no
    #                           distribution computed); "sample": drawn from the processed distribution;
    #                           "ranked": drawn, and some request filters by rank or mass (the vocabulary sorted)
    logprobs: bool = False    # some request asked for logprobs
    masked: bool = False      # some request has a grammar: the rows' logits are masked (`constraint.py`)

    @classmethod
    def of(cls, params: list[SamplingParams]) -> "SamplingMode":
        rule = "greedy" if plain_greedy(params) else "ranked" if needs_sort(params) else "sample"
        return cls(rule, any(p.logprobs is not None for p in params), any(p.grammar is not None for p in params))

    @property
    def greedy(self) -> bool:
        return self.rule == "greedy"

    @property
    def sort(self) -> bool:
        return self.rule == "ranked"


def processed_logits(logits: torch.Tensor, sp: SlotParams, b: slice, counts: torch.Tensor) -> torch.Tensor:
    """logits [B,R,V] fp32 with logit_bias, penalties and temperature applied (temperature 0 as 1);
    counts [B,R,V] output-token counts."""
    logits = logits + sp.bias[b, None]
    rep, pres, freq = sp.rep[b, None, None], sp.presence[b, None, None], sp.frequency[b, None, None]
    seen = sp.prompt_mask[b, None] | (counts > 0)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - pres * (counts > 0) - freq * counts
    temp = sp.temperature[b, None, None]
    return logits / torch.where(temp == 0, 1.0, temp)


def hold_stops(logits: torch.Tensor, sp: SlotParams, b: slice, pos: torch.Tensor) -> torch.Tensor:
    """min_tokens: processed logits [B,R,V] of rows at positions pos.. with the ids that end a reply at -inf
    on each row whose token would be output token i < min_tokens (row pos + j outputs token pos + j -
    first_pos). Per row, so a step that verifies drafts commits what plain decoding would."""
    made = pos[:, None] + torch.arange(logits.shape[1], device=logits.device) - sp.first_pos[b, None]
    early = made < sp.min_tokens[b, None]
    return logits.masked_fill(early[..., None] & sp.stops[b, None], float("-inf"))


def draft_probs(logits: torch.Tensor, sp: SlotParams, b: slice, sort: bool) -> torch.Tensor:
    """The distribution a drafter draws a slot's draft from, logits [B,V] (a DSpark slot's Markov-biased
    ones): at the request's temperature and filters, the penalties left out (any distribution keeps
    verification exact; this one is close to the target's)."""
    temp = sp.temperature[b, None]
    return target_probs((logits / torch.where(temp == 0, 1.0, temp))[:, None], sp, b, sort)[:, 0]


def target_probs(logits: torch.Tensor, sp: SlotParams, b: slice, sort: bool = True):
    """The distribution each row samples from, from processed logits [B,R,V]: greedy one-hot, or the
    softmax with top-k, top-p and min-p filtering. With `sort` False (no row filters) greedy rows take
    the argmax and the rest a plain softmax."""
    greedy = sp.temperature[b, None, None] == 0
    if not sort:
        top = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return torch.where(greedy, top, logits.softmax(-1))
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    k = sp.top_k[b, None, None]
    drop = ((k > 0) & (rank >= k)) | (greedy & (rank > 0))
    drop = drop | ((probs.cumsum(-1) - probs) >= sp.top_p[b, None, None])    # keep the smallest nucleus
    drop = (drop | (probs < sp.min_p[b, None, None] * probs[..., :1])) & (rank > 0)
    probs = probs.masked_fill(drop, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, probs)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [..., V], u [...] -> token ids [...]."""
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[..., -1]).unsqueeze(-1).contiguous()).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)
