"""From resolved settings to a ready engine: device, dtype, threads, checks against the model and the free
memory, whether to compile (and how), model, tokenizer, sampling defaults."""
import atexit
import dataclasses
import functools
import gc
import os
import sys
from pathlib import Path

import torch

from dsv4cli import kernels, platforms
from dsv4cli.config import SAMPLING_KEYS, Settings, read_json
from dsv4cli.encoding import is_tool
from dsv4cli.engine import COMPILE_BUDGET, Engine, EngineAPI, EngineOptions, SamplingParams, decode_state_bytes
from dsv4cli.errors import UsageError
from dsv4cli.hub import missing_model
from dsv4cli.model import ConfigError, LoadError, ModelConfig, Transformer, load_model
from dsv4cli.model.drafters import drafter_kind
from dsv4cli.model.footprint import footprint, tp_problem
from dsv4cli.model.loader import open_checkpoint, weights_mode
from dsv4cli.tokenizer import Tokenizer
from dsv4cli.units import human_bytes

# Below this many parameters a decode step is hundreds of tiny ops: a second intra-op thread adds a barrier
# per op and gains nothing, and when another process holds a core every barrier waits for a descheduled
# thread (benchmarks/threads.py has the numbers).
SMALL_MODEL_PARAMETERS = 100_000_000
LONG_RUNNING = ("chat", "serve", "batch")    # verbs whose engine outlives a cold compile (auto on the CPU)
PREFIX_VERBS = ("chat", "serve", "batch")    # verbs whose prompts share prefixes: they keep a prefix store
# A CPU batch job of fewer tokens than this (requests x max_tokens) ends before a compile beside it pays
# off: a cold compile takes minutes while the eager steps beside it run slower (docs/decisions.md, Compiled
# steps, has the job that ran longer with a compile than without).
BATCH_COMPILE_TOKENS = 60_000


def pick_device(name: str) -> torch.device:
    try:
        return platforms.pick(name).device()
    except LookupError as e:
        raise UsageError(str(e)) from None


def pick_dtype(s: Settings, device: torch.device) -> torch.dtype:
    """--dtype; `auto`: the platform's default, or the kernels' own choice for a run holding the official release's
    FP8/FP4 as stored (`release_dtype`: bf16 on a CPU with the fast kernels)."""
    if s.dtype != "auto":
        return getattr(torch, s.dtype)
    chosen = kernels.module_for(device).release_dtype() if holds_release(s.model_dir, s.weights, device) else None
    return getattr(torch, chosen or platforms.for_device(device).default_dtype)


@functools.cache        # asked by the memory check and by the load: the shards' headers read once
def holds_release(model_dir: Path, weights: str, device: torch.device) -> bool:
    """Whether a run holds the official release's FP8/FP4 as stored (`--weights` resolving to native)."""
    try:
        ckpt = open_checkpoint(model_dir)
        return ckpt.format == "fp8" and weights_mode(ckpt, weights, device) == "native"
    except LoadError:          # the load says what is wrong
        return False


def sampling_params(s: Settings) -> SamplingParams:
    """A request's defaults from the sampling settings (lists copied: a request owns its own)."""
    values = {name: getattr(s, name) for name in SAMPLING_KEYS}
    return SamplingParams(**{name: list(v) if isinstance(v, list) else v for name, v in values.items()})


def load_tools(path: str, place: str) -> list[dict]:
    """A JSON file holding a list of tools in OpenAI form, {"type": "function", "function": {"name": ...}}."""
    try:
        tools = read_json(path)
    except OSError as e:
        raise UsageError(f"{place} {path}: cannot read: {e.strerror}") from None
    except ValueError as e:
        raise UsageError(f"{place} {path}: {e}") from None
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


def model_config(s: Settings) -> ModelConfig:
    """The model's config.json; a missing directory or config is one line (with how to download an id)."""
    if not s.model_dir.is_dir():
        raise missing_model(s.model or str(s.model_dir))
    try:
        return ModelConfig.from_file(s.model_dir / "config.json")
    except ConfigError as e:
        raise UsageError(str(e)) from None


def check_limits(s: Settings, cfg: ModelConfig, device: torch.device, verb: str) -> int:
    """Refuse settings the model cannot run for `verb` before loading it (sequence length, stop ids, memory:
    weights, decode state and the prefix store's device memory); returns the model's parameter count and weight
    bytes (a card's, under --tp)."""
    if s.max_seq_len > cfg.max_position_embeddings:
        raise UsageError(f"--max-seq-len {s.max_seq_len}: above the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings})")
    for token in s.stop_token_ids:
        if token >= cfg.vocab_size:
            raise UsageError(f"--stop-token-id {token}: not a token id; the vocabulary has {cfg.vocab_size}")
    dtype = pick_dtype(s, device)
    try:
        parameters, held = footprint(s.model_dir, s.tp, float_bytes=dtype.itemsize, weights=s.weights, device=device)
    except LoadError as e:
        raise UsageError(str(e)) from None
    weights = sum(held.values())
    platform = platforms.for_device(device)
    # the release's bytes, mapped on the host: the page cache holds them, and pages the OS drops are read again
    mapped = held["fp4"] + held["fp8"] if s.mmap and platform.on_host_cores else 0
    state = decode_state_bytes(cfg, shape_options(s, verb), dtype.itemsize)
    free, store = platform.free_memory(device), s.prefix_cache_bytes
    need = weights - mapped + state + store
    if need > free:
        card = " per card" if s.tp > 1 else ""
        cache = f", prefix cache {human_bytes(store)} (--prefix-cache-bytes)" if store else ""
        held_part = f"weights {human_bytes(weights - mapped)}" + (" besides the mapped ones" if mapped else "")
        raise UsageError(f"not enough memory on {device}: the model needs about {human_bytes(need)}"
                         f"{card} ({held_part}, decode state {human_bytes(state)} for --max-batch "
                         f"{s.max_batch} x --max-seq-len {s.max_seq_len}{cache}); {human_bytes(free)} is free")
    if mapped and need + mapped > free:
        print(f"dsv4: {human_bytes(mapped)} of weights are mapped from {s.model_dir} with {human_bytes(free - need)} "
              "of memory left for them: the OS reads pages from disk as the experts are used (slower than "
              "holding them; --mlock pins them where they fit)", file=sys.stderr)
    return parameters, weights


def check_tp(s: Settings, cfg: ModelConfig) -> None:
    """Refuse a --tp that does not divide what the ranks split."""
    if problem := tp_problem(cfg, s.tp):
        raise UsageError(f"--tp {s.tp}: {problem} of {s.model_dir}")


def load_weights(s: Settings, device: torch.device) -> tuple[Transformer, Tokenizer]:
    """The model (its tensor-parallel slice when in a group) and tokenizer, with this process's threads."""
    if s.threads:
        torch.set_num_threads(s.threads)
    try:
        tokenizer = Tokenizer.from_dir(s.model_dir)
        model = load_model(s.model_dir, device=device, dtype=pick_dtype(s, device), weights=s.weights,
                           mmap_weights=s.mmap, mlock=s.mlock)
    except (LoadError, ValueError) as e:
        raise UsageError(str(e)) from None
    return model, tokenizer


def compiles_apart(weights: int, device: torch.device) -> bool:
    """Whether a compile can run beside the run in a process of its own, which loads the model again (before
    this one loads it: `weights` bytes): where the model lives in host memory with room for both copies
    (an accelerator would need the second in device memory)."""
    platform = platforms.for_device(device)
    return platform.on_host_cores and 2 * weights <= platform.free_memory(device)


def choose_compile(mode: str, device: torch.device, verb: str, small_model: bool, beside: bool,
                   job_tokens: int | None = None) -> tuple[bool, str | None]:
    """Whether to compile the steps for `verb`, and a line for the user or None: what `auto` picked when it
    turned compiling on, or why a compile can't run.

    auto: on where the platform captures the compiled step as a graph (accelerators). On the CPU, on for
    the verbs whose engine outlives a cold compile (`LONG_RUNNING`) with a small model, whose step is
    mostly per-op overhead (the compiled one is several times faster: docs/decisions.md), when the compile
    can run `beside` the run in a process of its own while it goes on eagerly; for a batch job, when its
    `job_tokens` (requests x max_tokens) reach BATCH_COMPILE_TOKENS. Off for a one-shot `generate`, which
    ends before a cold compile would (minutes), and for large models, whose CPU step is the weights'
    bandwidth, which compiling doesn't change."""
    platform = platforms.for_device(device)
    graphs = platform.graph_api() is not None
    long_enough = job_tokens is None or job_tokens >= BATCH_COMPILE_TOKENS
    pays_off = verb in LONG_RUNNING and small_model and beside and long_enough
    if mode == "off" or (mode == "auto" and not graphs and not pays_off):
        return False, None
    if reason := platform.compile_unavailable_reason():
        return False, reason
    if mode == "on":
        return True, None
    if graphs:
        return True, f"compile = auto: on ({platform.name}: the compiled step is captured as a graph)"
    return True, (f"compile = auto: on ({verb}, small model on the CPU): each step shape compiles in a process of "
                  f"its own on idle cores only ({idle_cores_now()}), at most {COMPILE_BUDGET} a run, and swaps in "
                  f"{'as it is ready' if verb == 'batch' else 'while the engine idles'}; steps run eager meanwhile; "
                  "compile = off skips it")


def idle_cores_now() -> str:
    """The cores idle now, as the kernel's load average counts them (a phrase)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        idle = max(0.0, cores - os.getloadavg()[0])
    except OSError:
        return f"{cores} cores"
    return f"{idle:.1f} of {cores} idle now"


def shape_options(s: Settings, verb: str) -> EngineOptions:
    """The engine options that shape its decode state, for `verb` (a chat keeps its state for the next turn)."""
    return EngineOptions(max_batch=s.max_batch, max_seq_len=s.max_seq_len, drafts=s.drafts, verify=s.verify,
                         reuse_prefix=verb == "chat")


def build_engine(s: Settings, device: torch.device, verb: str, compile_apart: bool = False,
                 swap: str = "idle") -> Engine:
    """This process's engine: tokenizer, model (its tensor-parallel slice when in a group), state.
    `compile_apart`: step shapes compile beside the run in a process of its own (`compiles_apart`),
    swapped in as `swap` says (`Engine`); else a shape's first step compiles it."""
    model, tokenizer = load_weights(s, device)
    cfg = model.cfg
    kind = drafter_kind(cfg)
    if s.drafts != "auto" and s.drafts and kind is None:
        raise UsageError(f"{s.model_dir}: the checkpoint has no drafter (no MTP layer or DSpark stages); "
                         "use --drafts 0")
    most = kind.max_depth(cfg) if kind else None
    if s.drafts != "auto" and most is not None and s.drafts > most:
        raise UsageError(f"--drafts {s.drafts}: above the checkpoint's {kind.label} block size {most} (one pass drafts "
                         f"{most} tokens; verifying more can't use them)")
    # A chat turn resumes the previous turn's state; every prompt resumes the longest prefix in the store.
    options = dataclasses.replace(shape_options(s, verb), prefill_budget=s.prefill_budget,
                                  prefix_cache=(s.prefix_cache_bytes, spill_bytes(s, device)),
                                  compile=s.compile == "on", compile_in_background=compile_apart, swap=swap,
                                  isolate_failures=s.tp == 1)
    engine = Engine(model, tokenizer, options, functools.partial(load_weights, s, device) if compile_apart else None)
    # what loading left (torch's modules, the model's objects) out of the collector's reach: a full collection
    # walked them all, ~125 ms with the bundled model on a small CPU, a stall in whichever step set it off;
    # back in reach at exit, so that an interpreter's teardown frees them as before
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)      # once, however many engines a process builds
    atexit.register(gc.unfreeze)
    return engine


def spill_bytes(s: Settings, device: torch.device) -> int:
    """The prefix store's host memory: prefix_spill_bytes, or auto's: as much as its device memory on an
    accelerator, none where the device is the host (its spills would be copies within the same memory)."""
    if s.prefix_spill_bytes != "auto":
        return s.prefix_spill_bytes
    return 0 if platforms.for_device(device).on_host_cores else s.prefix_cache_bytes


def load_engine(s: Settings, verb: str, compile_in_background: bool = True, job_tokens: int | None = None) -> EngineAPI:
    """The engine the settings describe for `verb` (chat, generate, batch, serve, bench: what
    `compile = auto` decides by, with a batch job's `job_tokens`); with --tp N, rank 0's view of N
    cooperating ranks.

    `compile_in_background`: a step shape compiles beside the run, in a process of its own where
    `compiles_apart`, while its steps run eagerly, so no stream stalls on a compile (not under --tp,
    whose ranks must run the same step; bench times the compiled step, so it waits)."""
    device = pick_device(s.device)
    cfg = model_config(s)
    check_tp(s, cfg)
    if verb not in PREFIX_VERBS:        # one prompt (generate), or decode timed alone (bench): no store
        s = dataclasses.replace(s, prefix_cache_bytes=0)
    parameters, weights = check_limits(s, cfg, device, verb)
    if platforms.for_device(device).on_host_cores:
        s = dataclasses.replace(s, threads=pick_threads(s, parameters))
    apart = compile_in_background and s.tp == 1 and compiles_apart(weights, device)
    compile_on, say = choose_compile(s.compile, device, verb, parameters < SMALL_MODEL_PARAMETERS, beside=apart,
                                     job_tokens=job_tokens)
    if say:
        print(say, file=sys.stderr)
    s = dataclasses.replace(s, compile="on" if compile_on else "off")    # every rank decides alike
    if s.tp == 1:
        # a batch job never idles: its saved steps swap in at once, where a stream would wait for a pause
        return build_engine(s, device, verb, compile_apart=apart, swap="ready" if verb == "batch" else "idle")
    from dsv4cli import parallel
    return parallel.launch_leader(s.tp, device, functools.partial(build_engine, s, verb=verb))
