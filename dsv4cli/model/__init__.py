"""The DeepSeek V4 model: config, modules with decode state, checkpoint loading."""
from .config import ConfigError, ModelConfig
from .loader import LoadError, load_model
from .model import DecodeState, Segment, Transformer

__all__ = ["ConfigError", "DecodeState", "LoadError", "ModelConfig", "Segment", "Transformer", "load_model"]
