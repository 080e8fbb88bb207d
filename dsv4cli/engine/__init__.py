"""The engine API shared by every front end: requests, streamed events, metrics."""
from .api import EngineAPI, EngineOptions, ModelInfo, acceptance_text, drafter_label
from .request import Event, Metrics, Sequence, TokenLogprob
from .sampling import TOP_LOGPROBS, SamplingParams
from .scheduler import Engine, EngineFailed

__all__ = ["TOP_LOGPROBS", "Engine", "EngineAPI", "EngineFailed", "EngineOptions", "Event", "Metrics", "ModelInfo",
           "SamplingParams", "Sequence", "TokenLogprob", "acceptance_text", "drafter_label"]
