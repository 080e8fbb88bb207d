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
import statistics
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
COMPILE_BUDGET = 8          # keys one run compiles in the background (the most used first)
MIN_USES = 4                # eager calls of a key before the background compiles it (a rare shape never is)
IDLE_S = 0.5                # seconds without a step that make the engine idle (a reply's steps are back to back)
PROBE_STEPS = 16            # decode steps a probe runs with the compile running, and as many stopped, alternating
PROBE_EVERY = 120.0         # seconds between probes: the machine's load changes
RECHECK = 20.0              # seconds before a probe that let the compile run beside the steps is checked again
BESIDE_SLOWDOWN = 1.1       # how much slower steps may be with the compile running beside them


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

    # ---- the background ----------------------------------------------------------------------

    def _schedule(self) -> None:
        """Start loading every saved step of a used key, and compiling the most used unsaved one (decode
        keys first: a chunk key waits until a decode key is ready)."""
        waiting = {key for key, _, _ in self._to_load} | {item[0] for item in self._loaded}
        if self.apart is not None:
            waiting.add(self.apart[0])
        decode_ready = any(key.batch for key in self.ready)
        wanted = sorted((key for key, n in self.uses.items() if n >= MIN_USES and key not in self.ready
                         and key not in waiting and key not in self.failed and (key.batch or decode_ready)),
                        key=self.uses.get, reverse=True)
        for key in wanted:
            if key not in self._unsaved and self._path(key).exists():
                self._load_later(key, "loaded", time.perf_counter())
            else:
                self._unsaved.add(key)
        compile_next = next((key for key in wanted if key in self._unsaved), None)
        if (compile_next is not None and self.apart is None and self.remake is not None
                and self.started < COMPILE_BUDGET):
            self._start(compile_next)

    def _start(self, key: tuple) -> None:
        """Compile and save `key`'s step in a process of its own, in a process group of its own: a Ctrl-C
        at the terminal, which chat takes to stop a reply, must not reach it, and the group must stay in the
        run's session, so that when the run ends, killed or not, while it is stopped (`stepping`), the
        kernel continues it with a SIGHUP (an orphaned group with stopped members), which ends it and the
        compilers it started. Both sides make the group, as shells do (whichever runs first)."""
        cmd = [sys.executable, "-c", "import os; os.setpgid(0, 0); "
               "from dsv4cli.engine.compiled import compile_apart; compile_apart()"]
        env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1", "OMP_NUM_THREADS": "1"}
        log = tempfile.TemporaryFile()  # noqa: SIM115 - not a pipe: a chatty compile must never block on a full one
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)
        with contextlib.suppress(OSError):      # it may have run its own first
            os.setpgid(proc.pid, proc.pid)
        proc.stdin.write(pickle.dumps((self.remake, key)))
        proc.stdin.flush()         # left open: the process ends when this one closes it, or ends
        # reaped as it ends, not at the engine's next step (an idle server would keep a zombie a supervisor sees)
        threading.Thread(target=proc.wait, name="dsv4-compile-reaper", daemon=True).start()
        with self._lock:
            self.apart, self._running = (key, proc, log, time.perf_counter()), True
            self.started += 1
            self._set_running(self.beside or not self._in_step)
        self._background()

    def _set_running(self, running: bool) -> None:
        """Stop or continue the compiling process and the compilers it runs (under `_lock`)."""
        if self.apart is None or running == self._running:
            return
        pid = self.apart[1].pid
        try:
            if os.getpgid(pid) != pid:      # its group isn't made yet: never signal this run's own
                return
            os.killpg(pid, signal.SIGCONT if running else signal.SIGSTOP)
        except ProcessLookupError:          # it has just ended
            pass
        self._running = running

    def _measure(self, what: tuple, running: bool, seconds: float, now: float) -> None:
        """A decode step took `seconds` with the compile `running` or stopped. Every PROBE_EVERY seconds
        (if the kernel counted a core idle meanwhile) a probe runs 2 x PROBE_STEPS of them, the compile
        running and stopped in turn; then it runs beside the steps only if they were at most
        BESIDE_SLOWDOWN slower with it running (checked again after RECHECK): measured, since an idle core
        can still share the step's core's caches, memory or (in a VM) its hardware thread. On a 2-vCPU VM
        a compile on the idle vCPU made eager steps about 2x slower."""
        core_idle = self._core_idle(now)
        if self._probe is None:
            # running it beside the steps is tried only where the kernel counts a core idle meanwhile
            if now >= self._probe_at and (self.beside or core_idle):
                self._probe, self._times = 2 * PROBE_STEPS, {True: {}, False: {}}
            return
        # alternating step by step, so a change in the machine's speed falls on both sides alike
        self._times[running].setdefault(what, []).append(seconds)
        self._probe -= 1
        if self._probe > 0:
            return
        self._probe = None
        ratios = [statistics.median(on) / statistics.median(off) for key, on in self._times[True].items()
                  if len(on) >= 3 and len(off := self._times[False].get(key, ())) >= 3]
        if not ratios:           # the steps changed shape meanwhile: try again soon
            self._probe_at = now + 10
            return
        self.beside = statistics.median(ratios) <= BESIDE_SLOWDOWN
        self._probe_at = now + (RECHECK if self.beside else PROBE_EVERY)

    def _core_idle(self, now: float) -> bool:
        """Whether the steps of the last second or so left a core idle (/proc/stat, read once a second, in
        windows of back-to-back steps; where it can't be read, True: the probe then decides alone)."""
        if now - self._stat_at >= 1.0:
            stat = cpu_times()
            if stat is not None and self._stat is not None and now - self._stat_at < 2.0:
                (idle0, total0), (idle, total) = self._stat, stat
                self.idle_cores = (idle - idle0) / max(1, total - total0) * (os.cpu_count() or 1)
            self._stat, self._stat_at = stat, now
        if self._stat is None:
            return True
        return self.idle_cores is not None and self.idle_cores >= 0.5

    def _poll(self) -> None:
        """Queue the step a compiling process saved for loading, once it has ended; raise its error if it
        failed."""
        if self.apart is None or self.apart[1].poll() is None:
            return
        key, proc, log, t0 = self.apart
        with self._lock:
            self.apart = None
        out = proc.stdout.read()
        proc.stdin.close()
        log.seek(0)
        err = log.read()
        log.close()
        saved = (out.decode(errors="replace").strip().splitlines() or [""])[-1]
        if proc.returncode:
            last = (err.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
            self._failed(key, f"compile: the compiling process failed (exit code {proc.returncode}): {last}")
        elif saved != str(self._path(key)):     # it made a runner unlike this one (the code changed meanwhile)
            self._failed(key, f"compile: the compiling process saved {saved!r}, not this engine's step "
                              f"{self._path(key)}")
        else:
            self._load_later(key, "compiled apart", t0)

    def _failed(self, key: tuple, problem: str) -> None:
        """A background compile failed: one line, and that key's steps stay eager (no request fails for it)."""
        self.failed[key] = problem
        print(f"{problem}; that step shape runs eager", file=sys.stderr, flush=True)

    def _load_later(self, key: tuple, how: str, t0: float) -> None:
        with self._lock:
            self._to_load.append((key, how, t0))
            self._lock.notify_all()
        self._background()

    def _background(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._between_steps, name="dsv4-compile-background",
                                            daemon=True)
            self._thread.start()

    def _between_steps(self) -> None:
        """The background thread: once the engine idles (IDLE_S without a step), the compiling process
        continues and each queued saved step loads (at once where `swap` is "ready", or when forced)."""
        while True:
            with self._lock:
                if self._closing:
                    return
                idle = not self._in_step and time.perf_counter() - self._last_step >= IDLE_S
                if idle:
                    self._set_running(True)
                item = self._to_load[0] if self._to_load and (idle or self._forced or self.swap == "ready") else None
                if item is None:
                    self._lock.wait(0.05)
                    continue
            key, how, t0 = item
            self.loading = True
            try:
                result = self._read(key)
            except Exception as e:     # noqa: BLE001 - raised on the engine's thread, at its next step
                result = (e, None)
            self.loading = False
            with self._lock:
                self._to_load.pop(0)
                self._loaded.append((key, how, t0, *result))
                self._lock.notify_all()

    def _swap(self) -> None:
        """On the engine's thread, between steps: the loaded steps become ready."""
        if not self._loaded:
            return
        with self._lock:
            loaded, self._loaded = self._loaded, []
        for key, how, t0, fn, sources in loaded:
            if isinstance(fn, Exception):
                raise RuntimeError(f"compile: loading the saved step failed: {type(fn).__name__}: {fn}") from fn
            if fn is None:            # written by another torch or platform: compile it again
                self._unsaved.add(key)
                continue
            self.sources[key], self.built[key], self.ready[key] = sources, (how, time.perf_counter() - t0), fn

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


def cpu_times() -> tuple[int, int] | None:
    """Every CPU's idle (with iowait) and total time so far, in clock ticks, or None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return ticks[3] + ticks[4], sum(ticks[:8])


_SOURCE = source_digest()
