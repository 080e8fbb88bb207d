"""The engine API shared by every front end: requests, streamed events, metrics."""
from .engine import Engine, Event, Metrics, Sequence, TokenLogprob
from .sampling import SamplingParams

__all__ = ["Engine", "Event", "Metrics", "SamplingParams", "Sequence", "TokenLogprob"]
