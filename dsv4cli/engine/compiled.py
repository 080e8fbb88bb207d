"""The compiled step: `StepRunner.step` compiled with torch.compile once per StepKey, saved to disk whole,
loaded by later launches, built beside a run without slowing it.

Each key is compiled whole (`fullgraph`: a graph break is an error, never a silent switch to eager) with
static shapes, ahead of time (`aot_compile`: traced and compiled, not run), and saved with Dynamo's trace,
so a later launch loads it in seconds instead of tracing the ~5,000-op step again. The scheduler buckets
the shapes (`scheduler.py`), so a run compiles a handful of keys and none in steady state.

In the background (`CompiledSteps.want`) nothing of the compile may slow the run, which runs eagerly, with
compile-off's exact shapes, until every key of a step is ready:
- a process of its own compiles and saves one key at a time, the most used one first, at most
  COMPILE_BUDGET a run, under SCHED_IDLE: the kernel runs it only on a core nothing else wants, so it
  measures free cores itself, all the time (a nice level still takes a tenth of a busy core);
- a saved step loads on a thread of its own once the engine has taken no step for IDLE_BEFORE_SWAP (a
  load holds the GIL for stretches of up to 0.3 s: during a reply it would stall tokens), and swaps in at
  the next step. A job that never idles (`swap="ready"`: batch) loads it as soon as it is saved.
Without a way to make the runner again in another process, a key's first step compiles it in the
foreground. The compiling process ends with the run: it reads its stdin until the run's end closes it.
"""
import contextlib
import hashlib
import inspect
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

from dsv4cli import platforms
from dsv4cli.cache import user_cache_dir

from .beside import COMPILE_BUDGET, Beside  # noqa: F401 - COMPILE_BUDGET: loading's line says it

KEY_LIMIT = 64              # keys one engine may compile; more is an error (shapes escaped the buckets)
STEP_TTL_DAYS = 30          # a saved step unused this long is deleted when another one is saved


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


def source_digest() -> str:
    """The package's code: a saved step holds traced code, so any change to it makes a new step."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


class CompiledSteps(Beside):
    """`owner.step(key, *inputs)` compiled once per key (a hashable tuple of its static arguments): a call
    is `self(key, *inputs)`; `owner.example_inputs(key)` gives inputs to trace it with, `owner.compile_tag`
    what else shapes its graphs (the state's sizes).

    `background`: the engine asks `want(keys)` before each step (inside `stepping()`), which runs compiled
    only once all its keys are ready (module docstring); `remake` (a picklable call that makes the owner
    again, compiling in the foreground) lets a process of its own compile them, else a key's first call
    compiles it here. `swap`: "idle" (a saved step loads once the engine idles) or "ready" (at once). Counts:
    each key's generated wrapper code (`sources`, for counting kernel calls), where each key came from
    (`built`: "compiled", "compiled apart" or "loaded", with seconds), the steps that ran eager meanwhile
    (`eager_steps`), and `recompiles` (a ready key whose guards fail: must stay 0)."""

    def __init__(self, owner, device: torch.device, background: bool = False, remake=None, swap: str = "idle"):
        use_cache_dir()
        platform = platforms.for_device(device)
        self.owner, self.background, self.remake, self.swap = owner, background, remake, swap
        self.compiler = torch.compile(owner.step, backend=platform.compile_backend, fullgraph=True, dynamic=False)
        self.where = (torch.__version__, platform.name, platform.compile_backend, owner.compile_tag)
        self.ready: dict[tuple, object] = {}      # key -> the compiled step
        self.apart: tuple | None = None     # (key, process, its stderr, start time) of a compile beside the run
        self.sources: dict[tuple, list[str]] = {}
        self.built: dict[tuple, tuple[str, float]] = {}
        self.recompiles = 0
        self.eager_steps = 0
        self.on_build = None        # called (key, "compiling" or "loading") before a key builds here (bench's progress)
        self.last_compiled = False                 # whether the latest decode step ran compiled
        self.uses: dict[tuple, int] = {}           # key -> its eager calls (background)
        self.started = 0                           # compiles started beside this run
        self.failed: dict[tuple, str] = {}         # keys whose compile failed beside the run: they stay eager
        self.beside = False          # measured: the compiling process may run while steps do (`_measure`)
        self.loading = False         # the background thread is reading a saved step (it holds the GIL in stretches)
        self._paths: dict[tuple, Path] = {}
        self._unsaved: set[tuple] = set()          # keys no saved step was found for
        # shared with the background thread, under `_lock`: the loads, the engine's steps, the process's state
        self._lock = threading.Condition()
        self._to_load: list[tuple[tuple, str, float]] = []     # (key, how, start time), first is loading
        self._loaded: list[tuple[tuple, str, float, object, list[str] | None]] = []
        self._thread: threading.Thread | None = None
        self._in_step, self._last_step, self._forced, self._closing = False, 0.0, False, False
        self._running = True         # the compiling process is not stopped
        # the probe: decode steps' seconds with the compile running / stopped, per what ran
        self._times: dict[bool, dict[tuple, list[float]]] = {True: {}, False: {}}
        self._probe: int | None = None      # decode steps left in a probe (the compile in the other state)
        self._probe_at = 0.0
        self._step_keys: tuple = ()
        self.idle_cores: float | None = None       # idle while steps ran, as /proc/stat counts them
        self._stat: tuple[int, int] | None = None
        self._stat_at = 0.0

    def __call__(self, key: tuple, *inputs):
        """The compiled step of `key` (compiled here first if it is not ready)."""
        fn = self.ready.get(key)
        if fn is None:
            fn = self._build(key)
        if fn.guard_check(self.owner, key, *inputs):
            return fn(self.owner, key, *inputs)
        self.recompiles += 1          # what the step reads no longer matches its graph
        del self.ready[key]
        return self._build(key, reuse=False)(self.owner, key, *inputs)

    def want(self, keys: list[tuple]) -> bool:
        """Whether a step of these calls (their keys) runs compiled now: always in the foreground (a missing
        key compiles at its call); in the background once every key is ready, meanwhile counting their uses
        and starting the next compile or load (module docstring). Swaps in what loaded while idle."""
        ready = True
        if self.background:
            self._poll()
            self._swap()
            for key in keys:
                self.uses[key] = self.uses.get(key, 0) + 1
            ready = all(key in self.ready for key in keys)
            if not ready:
                self.eager_steps += 1
                self._schedule()
        if any(key.batch for key in keys):
            self.last_compiled = ready
        self._step_keys = (*keys, ready)
        return ready

    @contextlib.contextmanager
    def stepping(self):
        """Around each engine step: the compiling process stops for it unless measured harmless, and a saved
        step loads only between steps (`swap` "idle")."""
        with self._lock:
            self._in_step, self._step_keys, compiling = True, (), self.apart is not None
            running = self.beside if self._probe is None else self._probe % 2 == 0
            self._set_running(running)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            now = time.perf_counter()
            with self._lock:
                self._in_step, self._last_step = False, now
            if compiling and self._step_keys and all(k.batch and not k.chunks for k in self._step_keys[:-1]):
                self._measure(self._step_keys, running, now - t0, now)

    @property
    def status(self) -> str:
        """What steps run as, for a status line: "compiled" or "eager", and ", compiling" while a step
        shape compiles beside them."""
        return ("compiled" if self.last_compiled else "eager") + (", compiling" if self.busy else "")

    def is_ready(self, key: tuple) -> bool:
        return key in self.ready

    @property
    def busy(self) -> bool:
        """A compiling process is running for this engine, or a saved step waits to load."""
        return self.apart is not None or bool(self._to_load) or bool(self._loaded)

    def wait(self) -> None:
        """Until the running compile is saved and every waiting step loaded and ready; raises the first
        background compile's failure (for the tests and benchmarks that need the compiled step)."""
        with self._lock:
            self._forced = True
            self._set_running(True)
        try:
            while self.busy:
                if self.apart is not None:
                    self.apart[1].wait()
                self._poll()
                with self._lock:
                    self._lock.wait_for(lambda: not self._to_load)
                self._swap()
        finally:
            self._forced = False
        if self.failed:
            raise RuntimeError(next(iter(self.failed.values())))

    def close(self) -> None:
        """Stop a running compile (its step is not saved: the next launch compiles it again) and the
        background thread."""
        with self._lock:
            if self.apart is not None:
                _, proc, log, _ = self.apart
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)        # the compilers it started too, stopped or not
                proc.kill()                                    # (its group may not be made yet)
                proc.wait()
                proc.stdin.close()
                log.close()
                self.apart = None
            self._closing = True
            self._lock.notify_all()

    # ---- compiling and loading -----------------------------------------------------------------

    def _path(self, key: tuple) -> Path:
        if key not in self._paths:
            model = self.owner.model
            # the tensors as held (not `state_dict()`, which unpacks every packed weight: a full extra copy)
            packed = [(f"{n}.packed", m.packed) for n, m in model.named_modules()
                      if getattr(m, "packed", None) is not None]
            held = [*model.named_parameters(), *model.named_buffers(), *packed]
            shapes = [(n, tuple(t.shape), str(t.dtype)) for n, t in held]
            ident = repr((self.where, key, _SOURCE, model.cfg, shapes)).encode()
            self._paths[key] = steps_dir() / f"{hashlib.sha256(ident).hexdigest()[:32]}.bin"
        return self._paths[key]

    def _read(self, key: tuple) -> tuple[object, list[str]] | tuple[None, None]:
        """The saved step of `key` and its generated code, or (None, None) where it can't be used."""
        from torch._inductor.codecache import PyCodeCache

        path, modules = self._path(key), len(PyCodeCache.modules)
        try:
            with open(path, "rb") as f:
                fn = torch.compiler.load_compiled_function(f, external_data={"owner": self.owner})
        except Exception:      # written by another torch or platform
            return None, None
        with contextlib.suppress(OSError):
            os.utime(path)           # used now: `prune_steps` keeps it
        fn.disable_guard_check()         # __call__ checks them once, itself
        return fn, [inspect.getsource(m.call) for m in PyCodeCache.modules[modules:] if hasattr(m, "call")]

    def _build(self, key: tuple, reuse: bool = True):
        """`key`'s step here, now: its saved one (unless not `reuse`), else compiled and saved."""
        from torch._inductor.codecache import PyCodeCache

        if len(self.ready) >= KEY_LIMIT:       # only if shapes escaped the buckets
            raise RuntimeError(f"compile: more than {KEY_LIMIT} step shapes; shapes are not bucketed")
        t0, saved = time.perf_counter(), reuse and self._path(key).exists()
        if self.on_build is not None:
            self.on_build(key, "loading" if saved else "compiling")
        fn, sources = self._read(key) if saved else (None, None)
        how = "loaded"
        if fn is None:
            modules = len(PyCodeCache.modules)
            with torch.no_grad():
                fn = self.compiler.aot_compile(((key, *self.owner.example_inputs(key)), {}))
            how = "compiled"
            self._save(key, fn)
            fn.disable_guard_check()
            sources = [inspect.getsource(m.call) for m in PyCodeCache.modules[modules:] if hasattr(m, "call")]
        self.sources[key], self.built[key], self.ready[key] = sources, (how, time.perf_counter() - t0), fn
        return fn

    def _save(self, key: tuple, fn) -> None:
        """Whole or not at all: a run may end (or a compiling process be killed) meanwhile."""
        path = self._path(key)
        part = path.with_name(f"{path.name}.{os.getpid()}.part")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fn.save_compiled_function(str(part), external_data={"owner": self.owner})
            os.replace(part, path)
            prune_steps()
        except OSError:
            pass              # an unwritable cache: the next launch compiles again
        except NotImplementedError:   # oneDNN's packed int8 weights (where the native GEMMs aren't
            part.unlink(missing_ok=True)   # built) can't be pickled: this run keeps its step unsaved


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
    """A compiling process (`CompiledSteps._start`): from stdin (remake, key), make the owner again, compile
    and save the key's step; print where it is. It yields the cores to everything else and ends when the
    run closes its stdin. SCHED_IDLE: it runs only where a core would otherwise idle (where there is no
    such policy, the lowest priority)."""
    remake, key = pickle.load(sys.stdin.buffer)
    threading.Thread(target=lambda: (sys.stdin.buffer.read(), os._exit(1)), daemon=True).start()
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        if hasattr(os, "nice"):
            os.nice(19)
    torch.set_num_threads(1)
    try:
        compiled = remake().compiled
        compiled._build(key)
    except Exception as e:     # noqa: BLE001 - the traceback, then one line for the parent's error
        traceback.print_exc()
        print(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}", file=sys.stderr, flush=True)
        os._exit(1)
    print(compiled._path(key), flush=True)
    os._exit(0)           # nothing left to tear down that matters


_SOURCE = source_digest()
