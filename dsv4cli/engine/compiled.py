"""The compiled device steps: `compile = auto | on | off`, compiled steps saved to disk, compiles that
don't stall the streams, and counts that make any fallback visible.

The fused decode step and the prefill chunk's pass are compiled whole (`fullgraph`: a graph break is an
error, never a silent switch to eager) with static shapes per key: (batch bucket, context bucket, sort,
logprobs, greedy) for a step, (rows bucket, context bucket, last, and the first token's flags) for a chunk,
padded to its bucket. Buckets are powers of two, so a run compiles a handful of keys and none in steady
state. Each key is compiled ahead of time (`aot_compile`: traced and compiled, not run) and saved whole,
Dynamo's trace included, so a later launch loads it in seconds instead of tracing the ~5,000-op step
again. In the background (interactive verbs) steps of a new key run eagerly while a worker thread loads
it, after a process of its own has compiled and saved it (where the engine can be loaded again:
`remake`), so streams keep flowing; otherwise the first step of a key waits for it.
"""
import contextlib
import hashlib
import inspect
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from pathlib import Path

import torch

from dsv4cli import platforms
from dsv4cli.kernels.native import user_cache_dir

MIN_CONTEXT = 512           # the smallest context bucket
MIN_CHUNK = 16              # the smallest prefill chunk bucket (rows)
LONG_RUNNING = ("chat", "serve", "batch")    # verbs whose engine outlives a cold compile (auto on the CPU)
KEY_LIMIT = 64              # keys one compiled step may hold; more is an error (shapes are not bucketed)
# Python's thread switch interval while a compile or load runs on a worker thread. Tracing holds the GIL
# in pure Python, and an eager step gives it up at each of its ~7,000 ops (torch releases it around every
# op), then waits a whole interval to get it back: at the default 5 ms a reply stalled 10-44 s a step. At
# 10 us a step takes ~1 s and the compile ~2x longer (bundled model, 2 cores); a compile in a process of
# its own avoids both, which leaves only the load to the thread.
BUILD_SWITCH_INTERVAL = 1e-5
STEP_TTL_DAYS = 30         # a saved step unused this long is deleted when another one is saved
PR_SET_PDEATHSIG = 1       # Linux prctl: a signal for this process when the thread that started it ends

# a kernel call in generated wrapper code: inductor's C++ / Triton kernels, library (extern) kernels,
# aten fallbacks and custom ops
_CALL = re.compile(r"^\s*(?:\w+ = )?(?:cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|aten\.\w+(?:\.\w+)?"
                   r"|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(", re.MULTILINE)


def cache_dir() -> Path:
    """Where compiled kernels persist between runs (XDG cache)."""
    return user_cache_dir() / "inductor"


def steps_dir() -> Path:
    """Where whole compiled steps (graph, guards and generated code) persist between runs."""
    return user_cache_dir() / "steps"


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


# A CPU batch job of fewer tokens than this (requests x max_tokens) ends before a compile beside it pays
# off: a cold compile takes 2-3 min while the eager steps run a third slower, then 5-10x faster; 400
# requests of 48 tokens (19,200) ran 54-55 s eager and 70-74 s with a compile that never finished.
BATCH_COMPILE_TOKENS = 60_000


def choose(mode: str, device: torch.device, verb: str, small_model: bool, beside: bool,
           job_tokens: int | None = None) -> tuple[bool, str | None]:
    """Whether to compile the decode step for `verb`, and a line for the user or None: what `auto`
    picked when it turned compiling on, or why a compile can't run.

    auto: on for accelerators, where the compiled step is then captured as a graph. On the CPU, on for
    the verbs whose engine outlives a cold compile (`LONG_RUNNING`) with a small model, whose step is
    mostly per-op overhead (the compiled one is 5-10x faster), when the compile can run `beside` the
    run (not under --tp, whose ranks compile in the foreground) while it goes on eagerly; for a batch
    job, when its `job_tokens` (requests x max_tokens) reach BATCH_COMPILE_TOKENS. Off for a one-shot
    `generate`, which ends before a cold compile would (minutes), and for large models, whose CPU step
    is the weights' bandwidth, which compiling doesn't change."""
    long_enough = job_tokens is None or job_tokens >= BATCH_COMPILE_TOKENS
    pays_off = verb in LONG_RUNNING and small_model and beside and long_enough
    if mode == "off" or (mode == "auto" and device.type == "cpu" and not pays_off):
        return False, None
    reason = unavailable_reason(device)
    if reason:
        return False, reason
    if mode == "on":
        return True, None
    if device.type != "cpu":
        return True, f"compile = auto: on ({device.type}: the compiled step is captured as a graph)"
    return True, (f"compile = auto: on ({verb}, small model on the CPU: compiled in the background while replies "
                  "stream; compile = off skips it)")


def batch_bucket(nb: int, max_batch: int) -> int:
    return min(1 << (nb - 1).bit_length(), max_batch)


def context_bucket(bound: int) -> int:
    return max(MIN_CONTEXT, 1 << (bound - 1).bit_length())


def chunk_bucket(rows: int, longest: int) -> int:
    """A compiled prefill chunk's rows: the next power of two from MIN_CHUNK, at most `longest`, the
    longest chunk the scheduler cuts (the commonest: every chunk of a long prompt but its last)."""
    return min(max(MIN_CHUNK, 1 << (rows - 1).bit_length()), longest)


def kernel_calls(source: str) -> int:
    """Kernel calls in generated wrapper code (each runs once per call of the compiled graph)."""
    return len(_CALL.findall(source))


def exit_if_building(code: int) -> None:
    """End the process now, with `code`, if a background compile is still running: a compiling process is
    killed (its step is not saved), a compiling thread can't be stopped, and the interpreter's shutdown
    under it aborts (C++ threads torn down while it runs)."""
    for proc in list(_CHILDREN):
        proc.kill()
    if any(t.is_alive() for t in _BUILDS):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def source_digest() -> str:
    """The package's code: a saved step holds traced code, so any change to it makes a new step."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


class CompiledSteps:
    """The device steps of `owner` (method names, in priority order) compiled once per key, a key being
    a step's name and its static arguments: static shapes, no graph breaks, saved to `steps_dir()` and
    loaded from there when a launch finds it. A call is `self(key, *inputs)`, the step's tensor inputs
    (and views of them) after the key; `owner.example_inputs(key)` gives inputs to trace it with.

    `background`: a key's steps run eagerly until it is ready (`eager_steps` counts them) while a worker
    thread compiles (or loads) it; otherwise a key's first step waits for it. In the background a later
    step's key starts only once a key of the first step is ready and no compile runs: the decode step
    gains most, so a chat's first prompt doesn't put its prefill chunk's compile before it. `remake`
    (background only): a picklable call that makes the owner again, compiling in the foreground; given,
    a key missing from `steps_dir()` is compiled and saved by a process of its own, which makes the
    owner again from it, and the thread then loads the saved step: the thread's tracing would hold the
    GIL the eager steps need. Counts: the kernel calls each key's generated code makes, where each key
    came from (`built`: "compiled", "compiled apart" or "loaded", with seconds), and `recompiles` (a
    ready key whose guards fail: must stay 0)."""

    def __init__(self, owner, steps: tuple[str, ...], device: torch.device, tag: tuple = (), background: bool = False,
                 remake=None):
        use_cache_dir()
        self.owner, self.steps, self.background, self.remake = owner, steps, background, remake
        _ = platforms.for_device(device).kernels     # imported now: a trace can't enter cached_property's lock
        backend = platforms.for_device(device).compile_backend
        self.compilers = {name: torch.compile(getattr(owner, name), backend=backend, fullgraph=True, dynamic=False)
                          for name in steps}
        self.where = (torch.__version__, device.type, backend, tag)
        self.ready: dict[tuple, object] = {}      # key -> the compiled step
        self.pending: dict[tuple, Future] = {}
        self.calls: dict[tuple, int] = {}         # key -> kernel calls of its generated code
        self.built: dict[tuple, tuple[str, float]] = {}
        self.recompiles = 0
        self.eager_steps = 0
        self.last_compiled = False                 # whether the latest step ran compiled

    def __call__(self, key: tuple, *inputs):
        name, args = key[0], key[1:]
        fn = self.ready.get(key)
        if fn is None:
            if not self.background:
                fn = self._build(key)
            elif key in self.pending:
                if self.pending[key].done():
                    self.pending[key].result()       # it failed: the error, not eager steps for ever
            elif name == self.steps[0] or (not self.busy and any(k[0] == self.steps[0] for k in self.ready)):
                self.pending[key] = self._start(key)
        if name == self.steps[0]:
            self.last_compiled = fn is not None
        if fn is None:
            self.eager_steps += 1
            return getattr(self.owner, name)(*args, *inputs)
        if fn.guard_check(self.owner, *args, *inputs):
            return fn(self.owner, *args, *inputs)
        self.recompiles += 1          # what the step reads no longer matches its graph
        del self.ready[key]
        return self._build(key, reuse=False)(self.owner, *args, *inputs)

    def keys(self, step: str) -> list[tuple]:
        """The keys of `step` compiled or loaded so far."""
        return [k for k in self.ready if k[0] == step]

    def _start(self, key: tuple) -> Future:
        """`_build(key)` on a daemon thread: a launch that ends meanwhile doesn't wait for it (the step
        is saved only once whole, so the next launch compiles it again; `exit_if_building`)."""
        future = Future()

        def work():
            with _BUILDING:
                try:
                    t0, path = time.perf_counter(), self._path(key)
                    apart = self.remake is not None and not path.exists()
                    if apart:
                        self._compile_apart(key, path)
                    with _short_switch_interval():
                        fn = self._build(key)
                    if apart:
                        self.built[key] = ("compiled apart", time.perf_counter() - t0)
                    future.set_result(fn)
                except BaseException as e:   # noqa: B036 (handed to the engine thread, which raises it)
                    future.set_exception(e)

        thread = threading.Thread(target=work, name="dsv4-compile", daemon=True)
        _BUILDS.add(thread)
        thread.start()
        return future

    def _compile_apart(self, key: tuple, path: Path) -> None:
        """Compile and save `key`'s step (to `path`) in a process of its own, at a lower priority than this one, in a
        session of its own: a Ctrl-C at the terminal (which chat takes to stop a reply) must not reach it."""
        cmd = [sys.executable, "-c", "from dsv4cli.engine.compiled import compile_apart; compile_apart()"]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        _CHILDREN.add(proc)
        try:
            out, err = proc.communicate(pickle.dumps((os.getpid(), self.remake, key)))
        finally:
            _CHILDREN.discard(proc)
        if proc.returncode:
            last = (err.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
            raise RuntimeError(f"compile: the compiling process failed (exit code {proc.returncode}): {last}")
        saved = (out.decode(errors="replace").strip().splitlines() or [""])[-1]
        if saved != str(path):     # it made an engine unlike this one
            raise RuntimeError(f"compile: the compiling process saved {saved!r}, not this engine's step {path}")

    @property
    def status(self) -> str:
        """What steps run as, for a status line: "compiled" or "eager", and ", compiling" while a step
        shape compiles (or loads) beside them."""
        return ("compiled" if self.last_compiled else "eager") + (", compiling" if self.busy else "")

    def is_ready(self, key: tuple) -> bool:
        return key in self.ready

    @property
    def busy(self) -> bool:
        """A compile or load is running (graph capture waits: a worker's device work would spoil it)."""
        return any(not f.done() for f in self.pending.values())

    def wait(self) -> None:
        """Until every compile started so far is ready (re-raises its error)."""
        for f in list(self.pending.values()):
            f.result()

    def _path(self, key: tuple) -> Path:
        model = self.owner.model
        # the tensors as held (not `state_dict()`, which unpacks every packed weight: a full extra copy)
        packed = [(f"{n}.packed", m.packed) for n, m in model.named_modules() if getattr(m, "packed", None) is not None]
        held = [*model.named_parameters(), *model.named_buffers(), *packed]
        shapes = [(n, tuple(t.shape), str(t.dtype)) for n, t in held]
        ident = repr((self.where, key, _SOURCE, model.cfg, shapes)).encode()
        return steps_dir() / f"{hashlib.sha256(ident).hexdigest()[:32]}.bin"

    def _build(self, key: tuple, reuse: bool = True):
        from torch._inductor.codecache import PyCodeCache

        if len(self.ready) >= KEY_LIMIT:       # only if shapes escaped the buckets
            raise RuntimeError(f"compile: more than {KEY_LIMIT} step shapes; shapes are not bucketed")
        t0, modules = time.perf_counter(), len(PyCodeCache.modules)
        path, fn = self._path(key), None
        if reuse and path.exists():
            try:
                with open(path, "rb") as f:
                    fn = torch.compiler.load_compiled_function(f, external_data={"owner": self.owner})
                how = "loaded"
            except Exception:      # written by another torch or platform: compile it afresh
                fn = None
            with contextlib.suppress(OSError):
                os.utime(path)           # used now: `prune_steps` keeps it
        if fn is None:
            with torch.no_grad():
                fn = self.compilers[key[0]].aot_compile(((*key[1:], *self.owner.example_inputs(key)), {}))
            how = "compiled"
            try:         # whole or not at all: a run may end (or a compiling process be killed) meanwhile
                path.parent.mkdir(parents=True, exist_ok=True)
                part = path.with_name(f"{path.name}.{os.getpid()}.part")
                fn.save_compiled_function(str(part), external_data={"owner": self.owner})
                os.replace(part, path)
                prune_steps()
            except OSError:
                pass              # an unwritable cache: the next launch compiles again
            except NotImplementedError:   # oneDNN's packed int8 weights (where the native GEMMs aren't
                part.unlink(missing_ok=True)   # built) can't be pickled: this run keeps its step unsaved
        new = [m for m in PyCodeCache.modules[modules:] if hasattr(m, "call")]
        self.calls[key] = sum(kernel_calls(inspect.getsource(m.call)) for m in new)
        fn.disable_guard_check()         # __call__ checks them once, itself
        self.built[key] = (how, time.perf_counter() - t0)
        self.ready[key] = fn
        return fn


def prune_steps() -> list[Path]:
    """Delete the saved steps (and parts of killed saves) unused for `STEP_TTL_DAYS`: every code version
    saves its own, and nothing else would ever remove the old ones. Returns what it deleted."""
    old = time.time() - STEP_TTL_DAYS * 86400
    gone = []
    for path in [*steps_dir().glob("*.bin"), *steps_dir().glob("*.part")]:
        try:
            if path.stat().st_mtime < old:
                path.unlink()
                gone.append(path)
        except OSError:         # another run's prune got there first
            pass
    return gone


def compile_apart() -> None:
    """A compiling process (`CompiledSteps._compile_apart`): from stdin (parent pid, remake, key), make
    the engine again, compile and save the key's step; print where it is. Dies with the thread that
    started it, and yields the cores to it (nice)."""
    parent, remake, key = pickle.load(sys.stdin.buffer)
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:          # it ended before the line above
        sys.exit(1)
    if hasattr(os, "nice"):
        os.nice(10)
    try:
        compiled = remake().compiled
        compiled._build(key)
    except Exception as e:     # noqa: BLE001 - the traceback, then one line for the parent's error
        traceback.print_exc()
        print(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}", file=sys.stderr, flush=True)
        os._exit(1)
    print(compiled._path(key), flush=True)
    os._exit(0)           # nothing left to tear down that matters


@contextlib.contextmanager
def _short_switch_interval():
    """BUILD_SWITCH_INTERVAL while any background compile of this process runs."""
    with _SWITCH_LOCK:
        if not _SWITCH["builds"]:
            _SWITCH["previous"] = sys.getswitchinterval()
            sys.setswitchinterval(BUILD_SWITCH_INTERVAL)
        _SWITCH["builds"] += 1
    try:
        yield
    finally:
        with _SWITCH_LOCK:
            _SWITCH["builds"] -= 1
            if not _SWITCH["builds"]:
                sys.setswitchinterval(_SWITCH["previous"])


_SOURCE = source_digest()
_BUILDS: set[threading.Thread] = set()      # background compiles started in this process
_BUILDING = threading.Lock()                 # one at a time: Dynamo's state is process-wide
_CHILDREN: set[subprocess.Popen] = set()     # compiling processes running for this one
_SWITCH = {"builds": 0, "previous": sys.getswitchinterval()}
_SWITCH_LOCK = threading.Lock()
