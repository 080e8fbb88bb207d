"""A request and what comes back: the sequence (prompt, output so far, finish reason), its metrics, the
events each engine step streams, and the logprobs of its tokens."""
from dataclasses import dataclass, field

from dsv4cli.tokenizer import StreamDecoder

from .sampling import SamplingParams


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
    proposed_per_position: list[int] = field(default_factory=list)   # steps that verified a draft there

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
    def prefix_hit_rate(self) -> float:
        """The share of the prompt whose state was reused (the prefix cache, or a chat's own slot)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def per_position(self) -> list[float]:
        """Per draft position, the share of its verifications that accepted it (its drafts before it
        accepted or not: vLLM's definition)."""
        return [a / p for a, p in zip(self.accepted_per_position, self.proposed_per_position) if p]

    def count_drafts(self, proposed: int, accepted: int) -> None:
        """One step's speculation: `proposed` drafts verified (0: a step that verified none is not one),
        of which the first `accepted` were accepted."""
        if not proposed:
            return
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        grow = proposed - len(self.proposed_per_position)
        if grow > 0:
            self.proposed_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for j in range(proposed):
            self.proposed_per_position[j] += 1
            self.accepted_per_position[j] += j < accepted

    def merge(self, other: "Metrics") -> None:
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.output_tokens += other.output_tokens
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        grow = len(other.proposed_per_position) - len(self.proposed_per_position)
        if grow > 0:
            self.proposed_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i, (a, p) in enumerate(zip(other.accepted_per_position, other.proposed_per_position)):
            self.accepted_per_position[i] += a
            self.proposed_per_position[i] += p

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "prefix_hit_rate": round(self.prefix_hit_rate, 4), "output_tokens": self.output_tokens,
                "ttft_s": round(self.ttft, 6), "tpot_s": round(self.tpot, 6),
                "tokens_per_s": round(self.tokens_per_s, 3), "drafts": self.drafts,
                "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "acceptance_rate": round(self.acceptance_rate, 4),
                "mean_acceptance_length": round(self.mean_acceptance_length, 4),
                "per_position": [round(p, 4) for p in self.per_position]}


@dataclass
class TokenLogprob:
    """A committed token's logprob under the processed distribution (a prompt token's: under the model's raw
    one), and the most likely alternatives."""
    token: int
    logprob: float | None              # None: a prompt's first token, which nothing predicts
    top: list[tuple[int, float]]       # (token id, logprob), most likely first
    given: list[float] = field(default_factory=list)    # a scored prompt's: its `score_ids`' logprobs there


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
    stopped_by: str | None = None   # the stop string that ended it (Anthropic's stop_sequence)
    error: str | None = None        # why the engine failed the request (finish_reason "error")
    slot: int = -1
    prefilled: int = 0              # prompt positions whose state is written (admission, in chunks)
    metrics: Metrics = field(default_factory=Metrics)
    decoder: StreamDecoder | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)     # one per output id, when asked for
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)     # one per prompt token, when asked for
    stop_logprob: TokenLogprob | None = None    # the stop token that ended it, when logprobs are on (not an output id)
    prefix_keys: list[bytes] | None = None     # the prompt's keys in the prefix store, once computed

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
    first: bool = False     # the request's first event: its prompt is prefilled (and scored, if asked)
