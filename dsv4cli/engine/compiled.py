"""The compiled decode step: `compile = auto | on | off`, a persistent compile cache, and counts that
make any fallback visible.

The fused step is compiled whole (`fullgraph`: a graph break is an error, never a silent switch to
eager) with static shapes per key (batch bucket, context bucket, sort, logprobs). Buckets are powers
of two, so a run compiles a handful of keys and none in steady state; Dynamo's recompile limit is an
error too. Prefill chunks and admission's first drafts run eagerly.
"""
import inspect
import os
import re
import shutil
from pathlib import Path

import torch

from dsv4cli import platforms

MIN_CONTEXT = 512           # the smallest context bucket
RECOMPILE_LIMIT = 64        # keys one compiled step may hold; more is an error (torch's default is 8)

# a kernel call in generated wrapper code: inductor's C++ / Triton kernels, library (extern) kernels,
# aten fallbacks and custom ops
_CALL = re.compile(r"^\s*(?:\w+ = )?(?:cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|aten\.\w+(?:\.\w+)?"
                   r"|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(", re.MULTILINE)


def cache_dir() -> Path:
    """Where compiled kernels persist between runs (XDG cache)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsv4cli" / "inductor"


def use_cache_dir() -> None:
    """Point inductor at `cache_dir()` unless the user chose a directory or it can't be written
    (then inductor keeps its own, under the temp directory)."""
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
    except OSError:
        return
    if os.access(cache_dir(), os.W_OK):
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir()))


def unavailable_reason(device: torch.device) -> str | None:
    """One line saying why this machine can't compile for `device`, or None."""
    if device.type == "cpu":
        compilers = (os.environ.get("CXX"), "g++", "c++", "clang++")
        if not any(c and shutil.which(c) for c in compilers):
            return "compile: no C++ compiler found (install g++ or set CXX); running eager"
    return None


def choose(mode: str, device: torch.device) -> tuple[bool, str]:
    """Whether to compile the decode step, and why in a few words.

    auto: on for accelerators (where the compiled step is then captured as a graph), off on the CPU,
    where a cold compile takes minutes (`compile = on` pays off for long CPU jobs; a warm cache
    starts in seconds)."""
    if mode == "off":
        return False, "compile = off"
    reason = unavailable_reason(device)
    if reason:
        return False, reason
    if mode == "on":
        return True, "compile = on"
    if device.type != "cpu":
        return True, f"compile = auto: on ({device.type})"
    return False, "compile = auto: off on the CPU (a cold compile takes minutes; compile = on for long jobs)"


def batch_bucket(nb: int, max_batch: int) -> int:
    return min(1 << (nb - 1).bit_length(), max_batch)


def context_bucket(bound: int) -> int:
    return max(MIN_CONTEXT, 1 << (bound - 1).bit_length())


def kernel_calls(source: str) -> int:
    """Kernel calls in generated wrapper code (each runs once per call of the compiled graph)."""
    return len(_CALL.findall(source))


class CompiledDecode:
    """`fn(*key)` compiled once per key, static shapes, no graph breaks. Counts compiles and the
    kernel calls each key's generated code makes. `tag` names what else fixes the graph (the
    engine's shape), so a graph this process already loaded keeps its count."""

    _known_calls: dict[tuple, int] = {}

    def __init__(self, fn, device: torch.device, tag: tuple = ()):
        self.tag = tag
        use_cache_dir()
        torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        self.fn = torch.compile(fn, backend=platforms.for_device(device).compile_backend, fullgraph=True,
                                dynamic=False)
        self.calls: dict[tuple, int] = {}       # key -> kernel calls of its generated code
        self.recompiles = 0                     # compiles for a key already compiled: must stay 0

    def __call__(self, *key) -> torch.Tensor:
        from torch._dynamo.utils import counters
        from torch._inductor.codecache import PyCodeCache

        graphs, modules = counters["stats"]["unique_graphs"], len(PyCodeCache.modules)
        out = self.fn(*key)
        if key not in self.calls:
            new = [m for m in PyCodeCache.modules[modules:] if hasattr(m, "call")]
            known = self._known_calls.get((self.tag, key), 0)
            self.calls[key] = sum(kernel_calls(inspect.getsource(m.call)) for m in new) if new else known
            self._known_calls[(self.tag, key)] = self.calls[key]
        elif counters["stats"]["unique_graphs"] > graphs:
            self.recompiles += 1
        return out
