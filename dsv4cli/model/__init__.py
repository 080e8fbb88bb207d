"""The DeepSeek V4 model: config, modules with decode state, checkpoint loading."""
from .config import ConfigError, ModelConfig
from .loader import LoadError, load_model
from .model import DecodeState, Transformer

__all__ = ["ConfigError", "DecodeState", "LoadError", "ModelConfig", "Transformer", "load_model"]
