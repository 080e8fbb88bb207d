"""`dsv4cli.load`: the engine the CLI would run, for Python code (as mlx-lm's `load`)."""
from typing import Any

from dsv4cli.config import SPEC, resolve
from dsv4cli.engine import EngineAPI
from dsv4cli.loading import load_engine

# What shapes an engine; sampling is per request (SamplingParams).
ENGINE_KEYS = tuple(name for name, key in SPEC.items() if key.section in ("model", "speculative") and name != "model")


def load(model: str | None = None, **settings: Any) -> EngineAPI:
    """A ready engine for a model directory or id (None: the bundled dsv4-tiny), set up as the CLI sets it
    up: device and dtype, the thread count for the model's size (1 for a model under 100M parameters,
    torch's default of every core is 10x slower there), the checks against the model and the free memory.
    `settings` are the engine's settings keys (`max_batch=4`, `drafts=2`, `max_seq_len=8192`, `device="cuda"`,
    ...), checked as the CLI checks flags; DSV4_* variables and config files are not read. A bad value
    raises `dsv4cli.errors.UsageError` with the CLI's message."""
    unknown = sorted(set(settings) - set(ENGINE_KEYS))
    if unknown:
        raise TypeError(f"load() got unknown settings {', '.join(unknown)}; engine settings are "
                        f"{', '.join(ENGINE_KEYS)} (sampling goes in each request's SamplingParams)")
    s, _ = resolve(None, {"model": model, **settings}, env={})
    return load_engine(s, "generate")   # compile = auto: on for accelerators, off on the CPU (a cold compile
                                        # takes minutes)
