"""The compiled step: `StepRunner.step` compiled with torch.compile once per StepKey, saved to disk whole,
loaded by later launches, built beside a run without stalling it.

Each key is compiled whole (`fullgraph`: a graph break is an error, never a silent switch to eager) with
static shapes, ahead of time (`aot_compile`: traced and compiled, not run), and saved with Dynamo's trace,
so a later launch loads it in seconds instead of tracing the ~5,000-op step again. The scheduler buckets
the shapes (`scheduler.py`), so a run compiles a handful of keys and none in steady state.

In the background a key's steps run eagerly while a process of its own compiles and saves it (at a
lower priority, one compile thread, so the run keeps its core); the step that finds it saved loads it
(a few seconds, once per key). Without a way to make the runner again in another process, a key's
first step compiles it in the foreground. The compiling process ends with the run: it reads its stdin
until the run's end closes it.
"""
import contextlib
import hashlib
import inspect
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

from dsv4cli import platforms
from dsv4cli.cache import user_cache_dir

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


class CompiledSteps:
    """`owner.step(key, *inputs)` compiled once per key (a hashable tuple of its static arguments): a call
    is `self(key, *inputs)`; `owner.example_inputs(key)` gives inputs to trace it with, `owner.compile_tag`
    what else shapes its graphs (the state's sizes).

    `background`: a key's steps run eagerly until it is ready (`eager_steps` counts them). With `remake` (a
    picklable call that makes the owner again, compiling in the foreground) a missing key is compiled and
    saved by a process of its own, one at a time, started when `may_start(key, self)` says so; else the
    key's first step compiles it here. Counts: each key's generated wrapper code (`sources`, for counting
    kernel calls), where each key came from (`built`: "compiled", "compiled apart" or "loaded", with
    seconds), and `recompiles` (a ready key whose guards fail: must stay 0)."""

    def __init__(self, owner, device: torch.device, background: bool = False, remake=None,
                 may_start=lambda key, steps: True):
        use_cache_dir()
        platform = platforms.for_device(device)
        self.owner, self.background, self.remake, self.may_start = owner, background, remake, may_start
        self.compiler = torch.compile(owner.step, backend=platform.compile_backend, fullgraph=True, dynamic=False)
        self.where = (torch.__version__, platform.name, platform.compile_backend, owner.compile_tag)
        self.ready: dict[tuple, object] = {}      # key -> the compiled step
        self.apart: tuple | None = None     # (key, process, its stderr, start time) of a compile beside the run
        self.sources: dict[tuple, list[str]] = {}
        self.built: dict[tuple, tuple[str, float]] = {}
        self.recompiles = 0
        self.eager_steps = 0
        self.last_compiled = False                 # whether the latest decode step ran compiled

    def __call__(self, key: tuple, *inputs):
        fn = self.ready.get(key)
        if fn is None and self.background and self.remake is not None:
            self._poll()
            fn = self.ready.get(key)
            if fn is None and self.apart is None and self.may_start(key, self):
                if self._path(key).exists():
                    fn = self._build(key)          # saved by an earlier launch: load it now
                else:
                    self._start(key)
        elif fn is None:
            fn = self._build(key)
        if key.batch:
            self.last_compiled = fn is not None
        if fn is None:
            self.eager_steps += 1
            return self.owner.step(key, *inputs)
        if fn.guard_check(self.owner, key, *inputs):
            return fn(self.owner, key, *inputs)
        self.recompiles += 1          # what the step reads no longer matches its graph
        del self.ready[key]
        return self._build(key, reuse=False)(self.owner, key, *inputs)

    @property
    def status(self) -> str:
        """What steps run as, for a status line: "compiled" or "eager", and ", compiling" while a step
        shape compiles beside them."""
        return ("compiled" if self.last_compiled else "eager") + (", compiling" if self.busy else "")

    def is_ready(self, key: tuple) -> bool:
        return key in self.ready

    @property
    def busy(self) -> bool:
        """A compiling process is running for this engine."""
        return self.apart is not None

    def wait(self) -> None:
        """Until the running compile is saved and loaded (re-raises its error)."""
        while self.apart is not None:
            self.apart[1].wait()
            self._poll()

    def close(self) -> None:
        """Stop a running compile (its step is not saved: the next launch compiles it again)."""
        if self.apart is not None:
            _, proc, log, _ = self.apart
            proc.kill()
            proc.wait()
            proc.stdin.close()
            log.close()
            self.apart = None

    def _start(self, key: tuple) -> None:
        """Compile and save `key`'s step in a process of its own (in a session of its own: a Ctrl-C at the
        terminal, which chat takes to stop a reply, must not reach it)."""
        cmd = [sys.executable, "-c", "from dsv4cli.engine.compiled import compile_apart; compile_apart()"]
        env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1", "OMP_NUM_THREADS": "1"}
        log = tempfile.TemporaryFile()  # noqa: SIM115 - not a pipe: a chatty compile must never block on a full one
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                start_new_session=True, env=env)
        proc.stdin.write(pickle.dumps((self.remake, key)))
        proc.stdin.flush()         # left open: the process ends when this one closes it, or ends
        # reaped as it ends, not at the engine's next step (an idle server would keep a zombie a supervisor sees)
        threading.Thread(target=proc.wait, name="dsv4-compile-reaper", daemon=True).start()
        self.apart = (key, proc, log, time.perf_counter())

    def _poll(self) -> None:
        """Load the step a compiling process saved, once it has ended; raise its error if it failed."""
        if self.apart is None or self.apart[1].poll() is None:
            return
        key, proc, log, t0 = self.apart
        self.apart = None
        out = proc.stdout.read()
        proc.stdin.close()
        log.seek(0)
        err = log.read()
        log.close()
        if proc.returncode:
            last = (err.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
            raise RuntimeError(f"compile: the compiling process failed (exit code {proc.returncode}): {last}")
        saved = (out.decode(errors="replace").strip().splitlines() or [""])[-1]
        if saved != str(self._path(key)):     # it made a runner unlike this one
            raise RuntimeError(f"compile: the compiling process saved {saved!r}, not this engine's step "
                               f"{self._path(key)}")
        self._build(key)
        self.built[key] = ("compiled apart", time.perf_counter() - t0)

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
                fn = self.compiler.aot_compile(((key, *self.owner.example_inputs(key)), {}))
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
        self.sources[key] = [inspect.getsource(m.call) for m in PyCodeCache.modules[modules:] if hasattr(m, "call")]
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
    """A compiling process (`CompiledSteps._start`): from stdin (remake, key), make the owner again, compile
    and save the key's step; print where it is. It yields the cores to the run (nice) and ends when the
    run closes its stdin."""
    remake, key = pickle.load(sys.stdin.buffer)
    threading.Thread(target=lambda: (sys.stdin.buffer.read(), os._exit(1)), daemon=True).start()
    if hasattr(os, "nice"):
        os.nice(10)
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
