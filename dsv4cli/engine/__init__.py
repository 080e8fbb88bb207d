"""The engine API shared by every front end: requests, streamed events, metrics."""
from .api import EngineAPI, EngineOptions, EngineStatus, ModelInfo, acceptance_text, drafter_label
from .compiled import COMPILE_BUDGET
from .request import Event, Metrics, Sequence, TokenLogprob
from .sampling import TOP_LOGPROBS, SamplingParams
from .scheduler import Engine, EngineFailed, decode_state_bytes

__all__ = ["COMPILE_BUDGET", "TOP_LOGPROBS", "Engine", "EngineAPI", "EngineFailed", "EngineOptions", "EngineStatus",
           "Event", "Metrics", "ModelInfo", "SamplingParams", "Sequence", "TokenLogprob", "acceptance_text",
           "decode_state_bytes", "drafter_label"]
