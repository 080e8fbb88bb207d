"""From resolved settings to a ready engine: device, dtype, threads, checks against the model and the free
memory, model, tokenizer, sampling defaults."""
import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

import torch

from dsv4cli import platforms
from dsv4cli.config import SAMPLING_KEYS, Settings
from dsv4cli.encoding import is_tool
from dsv4cli.engine import Engine, EngineAPI, SamplingParams, compiled
from dsv4cli.engine.slots import SlotState
from dsv4cli.errors import UsageError
from dsv4cli.hub import missing_model
from dsv4cli.model import ConfigError, LoadError, ModelConfig, Transformer, load_model
from dsv4cli.tokenizer import Tokenizer
from dsv4cli.tools.inspect import describe, human_bytes

# Below this many parameters a decode step is hundreds of tiny ops: a second intra-op thread adds a barrier
# per op and gains nothing, and when another process holds a core every barrier waits for a descheduled
# thread (benchmarks/threads.py: 35 -> ~1 tok/s on 2 cores with one busy).
SMALL_MODEL_PARAMETERS = 100_000_000


def pick_device(name: str) -> torch.device:
    try:
        return platforms.pick(name).device()
    except LookupError as e:
        raise UsageError(str(e)) from None


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    return getattr(torch, platforms.for_device(device).default_dtype if name == "auto" else name)


def sampling_params(s: Settings) -> SamplingParams:
    """A request's defaults from the sampling settings (lists copied: a request owns its own)."""
    values = {name: getattr(s, name) for name in SAMPLING_KEYS}
    return SamplingParams(**{name: list(v) if isinstance(v, list) else v for name, v in values.items()})


def load_tools(path: str, place: str) -> list[dict]:
    """A JSON file holding a list of tools in OpenAI form, {"type": "function", "function": {"name": ...}}."""
    try:
        tools = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageError(f"{place} {path}: cannot read: {e.strerror}") from None
    except ValueError as e:
        raise UsageError(f"{place} {path}: not JSON: {e}") from None
    if not isinstance(tools, list) or not all(is_tool(t) for t in tools):
        raise UsageError(f'{place} {path}: must hold a list of {{"type": "function", "function": {{"name": ...}}}}')
    return tools


def cpu_cores() -> int:
    """The cores this process may run on (a container or taskset may allow fewer than the machine has)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pick_threads(s: Settings, parameters: int) -> int:
    """--threads, else 1 for a small model, else the cores shared among the --tp ranks of this machine."""
    if s.threads:
        return s.threads
    return 1 if parameters < SMALL_MODEL_PARAMETERS else max(1, cpu_cores() // s.tp)


def decode_state_bytes(cfg: ModelConfig, s: Settings, dtype: torch.dtype) -> int:
    """What the engine's DecodeState will take, measured on the meta device (nothing is allocated)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    state = SlotState.decode_state(model, s.max_batch, s.max_seq_len, s.mtp, reuse_prefix=s.mode == "chat",
                                   device="meta", dtype=dtype)
    return state.nbytes()


def model_config(s: Settings) -> ModelConfig:
    """The model's config.json; a missing directory or config is one line (with how to download an id)."""
    if not s.model_dir.is_dir():
        raise missing_model(s.model or str(s.model_dir))
    try:
        return ModelConfig.from_file(s.model_dir / "config.json")
    except ConfigError as e:
        raise UsageError(str(e)) from None


def check_limits(s: Settings, cfg: ModelConfig, device: torch.device) -> int:
    """Refuse settings the model cannot run before loading it (sequence length, stop ids, memory);
    returns the model's parameter count and weight bytes (a card's, under --tp)."""
    if s.max_seq_len > cfg.max_position_embeddings:
        raise UsageError(f"--max-seq-len {s.max_seq_len}: above the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings})")
    for token in s.stop_token_ids:
        if token >= cfg.vocab_size:
            raise UsageError(f"--stop-token-id {token}: not a token id; the vocabulary has {cfg.vocab_size}")
    dtype = pick_dtype(s.dtype, device)
    try:
        info = describe(s.model_dir, s.tp, float_bytes=dtype.itemsize)
    except LoadError as e:
        raise UsageError(str(e)) from None
    weights, state = info["weight_bytes_per_card"], decode_state_bytes(cfg, s, dtype)
    free = platforms.for_device(device).free_memory(device)
    if weights + state > free:
        card = " per card" if s.tp > 1 else ""
        raise UsageError(f"not enough memory on {device.type}: the model needs about {human_bytes(weights + state)}"
                         f"{card} (weights {human_bytes(weights)}, decode state {human_bytes(state)} for --max-batch "
                         f"{s.max_batch} x --max-seq-len {s.max_seq_len}); {human_bytes(free)} is free")
    return info["parameters"], weights


def check_tp(s: Settings, cfg: ModelConfig) -> None:
    """Refuse a --tp that does not divide what the ranks split."""
    path = s.model_dir / "config.json"
    for what, n in (("attention heads", cfg.n_heads), ("output groups", cfg.o_groups),
                    ("indexer heads", cfg.index_n_heads), ("routed experts", cfg.n_routed_experts),
                    ("vocabulary rows", cfg.vocab_size)):
        if n % s.tp:
            raise UsageError(f"--tp {s.tp}: does not divide the {n} {what} of {path.parent}")


def load_weights(s: Settings, device: torch.device) -> tuple[Transformer, Tokenizer]:
    """The model (its tensor-parallel slice when in a group) and tokenizer, with this process's threads."""
    if s.threads:
        torch.set_num_threads(s.threads)
    try:
        tokenizer = Tokenizer.from_dir(s.model_dir)
        model = load_model(s.model_dir, device=device, dtype=pick_dtype(s.dtype, device))
    except (LoadError, ValueError) as e:
        raise UsageError(str(e)) from None
    return model, tokenizer


def compiles_apart(weights: int, device: torch.device) -> bool:
    """Whether a background compile can run in a process of its own, which loads the model again (before
    this one loads it: `weights` bytes): on the CPU, with room for both copies (an accelerator would need
    the second in device memory)."""
    return device.type == "cpu" and 2 * weights <= platforms.for_device(device).free_memory(device)


def build_engine(s: Settings, device: torch.device, compile_in_background: bool = False,
                 compile_apart: bool = False) -> Engine:
    """This process's engine: tokenizer, model (its tensor-parallel slice when in a group), state.
    `compile_apart`: a background compile runs in a process of its own (`compiles_apart`)."""
    model, tokenizer = load_weights(s, device)
    if s.mtp and not model.cfg.n_mtp_layers:
        raise UsageError(f"{s.model_dir}: the checkpoint has no MTP layer; use --mtp 0")
    # A chat turn resumes the previous turn's state; batch and generate prefill every prompt afresh.
    return Engine(model, tokenizer, max_batch=s.max_batch, max_seq_len=s.max_seq_len, mtp=s.mtp,
                  prefill_budget=s.prefill_budget, reuse_prefix=s.mode == "chat", compile=s.compile == "on",
                  compile_in_background=compile_in_background, isolate_failures=s.tp == 1,
                  reload=functools.partial(load_weights, s, device) if compile_apart else None)


def load_engine(s: Settings, verb: str, compile_in_background: bool = True, job_tokens: int | None = None) -> EngineAPI:
    """The engine the settings describe for `verb` (chat, generate, batch, serve, bench: what
    `compile = auto` decides by, with a batch job's `job_tokens`); with --tp N, rank 0's view of N
    cooperating ranks.

    `compile_in_background`: a step shape compiles beside the run (in a process of its own where
    `compiles_apart`, else on a worker thread) while its steps run eagerly, so no stream stalls on a
    compile (not under --tp, whose ranks must run the same step; bench times the compiled step, so it
    waits)."""
    device = pick_device(s.device)
    cfg = model_config(s)
    check_tp(s, cfg)
    parameters, weights = check_limits(s, cfg, device)
    if device.type == "cpu":
        s = dataclasses.replace(s, threads=pick_threads(s, parameters))
    compile_on, say = compiled.choose(s.compile, device, verb, parameters < SMALL_MODEL_PARAMETERS,
                                      beside=compile_in_background and s.tp == 1, job_tokens=job_tokens)
    if say:
        print(say, file=sys.stderr)
    s = dataclasses.replace(s, compile="on" if compile_on else "off")    # every rank decides alike
    if s.tp == 1:
        apart = compile_on and compile_in_background and compiles_apart(weights, device)
        return build_engine(s, device, compile_in_background, apart)
    from dsv4cli import parallel
    return parallel.launch_leader(s, device, lambda dev: build_engine(s, dev))
