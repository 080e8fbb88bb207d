"""The engine API shared by every front end: requests, streamed events, metrics."""
from .api import EngineAPI, ModelInfo
from .engine import Engine, EngineFailed
from .request import Event, Metrics, Sequence, TokenLogprob
from .sampling import TOP_LOGPROBS, SamplingParams

__all__ = ["TOP_LOGPROBS", "Engine", "EngineAPI", "EngineFailed", "Event", "Metrics", "ModelInfo", "SamplingParams",
           "Sequence", "TokenLogprob"]
