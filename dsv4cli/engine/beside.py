"""A step's compile beside the run (`CompiledSteps` in the background): which key compiles next, the process
that compiles it (stopped while the engine steps unless a probe measured it harmless), and the thread that
loads a saved step while the engine idles. The policy and its measurements: `compiled.py`'s docstring and
docs/decisions.md ("Compiled steps")."""
import atexit
import contextlib
import os
import pickle
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

COMPILE_BUDGET = 8          # keys one run compiles in the background (the most used first)
MIN_USES = 4                # eager calls of a key before the background compiles it (a rare shape never is)
IDLE_S = 0.5                # seconds without a step that make the engine idle (a reply's steps are back to back)
PROBE_STEPS = 16            # decode steps a probe runs with the compile running, and as many stopped, alternating
PROBE_EVERY = 120.0         # seconds between probes: the machine's load changes
RECHECK = 20.0              # seconds before a probe that let the compile run beside the steps is checked again
BESIDE_SLOWDOWN = 1.1       # how much slower steps may be with the compile running beside them


def cpu_times() -> tuple[int, int] | None:
    """Every CPU's idle (with iowait) and total time so far, in clock ticks, or None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return ticks[3] + ticks[4], sum(ticks[:8])


class Beside:
    """The background half of `CompiledSteps` (its state is made in `CompiledSteps.__init__`)."""

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
        if not self.started:
            atexit.register(self.close)      # at the run's end at once, whether it is stopped or not
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
        can still share the step's core's caches, memory or (in a VM) its hardware thread (docs/decisions.md,
        Compiled steps, has what a compile on an idle vCPU did)."""
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
