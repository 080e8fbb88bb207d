"""How many prompt tokens a step that also decodes may prefill: a budget in time, not tokens.

A running stream's next token waits for its step, and a step that prefills waits for its chunks. A fixed
token budget is several decode steps' time on a small CPU (docs/decisions.md, The engine: the worst gap it
gave while prompts arrived). Here a chunk may take about SHARE of a decode step's time, as measured on this
device (prefill seconds per token and decode step seconds, both moving averages), so the worst gap stays near
1 + SHARE steps; a step with no stream decoding prefills the whole token budget (nobody waits on it).
"""

SHARE = 1.5          # a mixed step's prefill, in decode steps: gaps at most ~2.5x the median
MIN_TOKENS = 16      # a chunk never shrinks below this: too small a chunk costs the prompt more steps than it saves
EMA = 0.2            # weight of a new measurement


class PrefillPace:
    """The measured costs and the budget they give, at most `budget` tokens a step."""

    def __init__(self, budget: int):
        self.budget, self.share = budget, SHARE
        self.decode_s: float | None = None       # a decode-only step
        self.token_s: float | None = None        # a prompt token's share of a step

    def tokens(self, decoding: bool) -> int:
        """The prefill budget of the next step; `decoding`: streams decode in it."""
        if not decoding or self.decode_s is None or not self.token_s:
            return self.budget
        return max(MIN_TOKENS, int(min(self.budget, self.share * self.decode_s / self.token_s)))

    def ran(self, prompt_tokens: int, decoded: bool, seconds: float) -> None:
        """A call took `seconds` for `prompt_tokens` prefilled and, if `decoded`, the decode rows."""
        if not prompt_tokens:
            if decoded:
                self.decode_s = _mean(self.decode_s, seconds)
            return
        if decoded and self.decode_s is None:
            return                          # its decode rows' share is not known yet
        prefill = seconds - (self.decode_s if decoded else 0.0)
        self.token_s = _mean(self.token_s, max(prefill, 0.0) / prompt_tokens)


def _mean(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new
