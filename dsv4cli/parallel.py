"""Tensor parallelism on one node: `--tp N` runs N ranks, one per device, started by the CLI itself.

Every rank holds its slice of the weights (heads, output groups, experts, vocabulary) and runs the
same engine. Rank 0 owns the front end: before each engine step it broadcasts the host-side commands
(submit, cancel, stop) so all ranks take identical steps; logits are all-gathered, so sampling and
verification agree everywhere without further traffic. A watchdog on rank 0 ends the run with one
line if a rank dies; followers ignore Ctrl-C and stop when rank 0 says so or disappears.
"""
import atexit
import dataclasses
import os
import random
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv4cli import platforms
from dsv4cli.engine import Engine, EngineStatus, Event, ModelInfo, SamplingParams, Sequence
from dsv4cli.errors import RunError

TIMEOUT = timedelta(minutes=10)   # a generous bound for a collective; rank deaths are caught earlier


def rendezvous() -> dist.TCPStore:
    """The ranks' meeting point, held by whoever starts them: bound to a port the kernel picks, so no other
    process can take it between choosing it and binding it. Ranks join with `init_rank(..., store.port, ...)`."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT, wait_for_workers=False)


def init_rank(rank: int, world: int, port: int, device: torch.device):
    """Join the process group met at `port` (a `rendezvous()`); returns (this rank's device, the gloo group
    used for commands)."""
    platform = platforms.for_device(device)
    device = platform.set_device(rank, world)
    backend = platform.dist_backend
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    control = dist.new_group(backend="gloo") if backend != "gloo" else None
    return device, control


class Leader:
    """Rank 0's engine: the engine API (`EngineAPI`) of its local Engine, with every command mirrored to
    the other ranks."""

    def __init__(self, engine: Engine, control, procs, watchdog: threading.Event):
        self.engine, self.control, self.procs, self.watchdog = engine, control, procs, watchdog
        self.pending: list[tuple] = []
        self.closed = False
        # the local engine's (totals is its object, which it updates in place)
        self.tok, self.device, self.totals = engine.tok, engine.device, engine.totals
        self.max_batch, self.max_seq_len, self.draft_depth = engine.max_batch, engine.max_seq_len, engine.draft_depth
        self.drafts, self.verify = engine.drafts, engine.verify

    @property
    def model_info(self) -> ModelInfo:
        return self.engine.model_info

    def status(self) -> EngineStatus:
        return self.engine.status()

    def on_compile(self, note) -> None:
        self.engine.on_compile(note)

    def has_work(self) -> bool:
        return self.engine.has_work()

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        if params.seed is None:           # every rank must draw the same numbers
            params = dataclasses.replace(params, seed=random.getrandbits(62))
        seq = self.engine.submit(prompt_ids, params, request_id)
        self.pending.append(("submit", list(prompt_ids), params, seq.id))
        return seq

    def resized(self, max_batch: int, drafts: int, compile: bool | None = None, verify: str | None = None) -> "Leader":
        """Every rank swaps in an engine of another batch size / drafts setting (on the next step)."""
        leader = Leader(self.engine.resized(max_batch, drafts, compile, verify), self.control, self.procs,
                        self.watchdog)
        leader.pending = [*self.pending, ("rebuild", leader.engine.options)]
        self.pending = []
        return leader

    def cancel(self, seq: Sequence) -> None:
        self.engine.cancel(seq)
        self.pending.append(("cancel", seq.id))

    def save_state(self, path: str, header: dict[str, str]) -> int:
        raise ValueError("not under --tp: each rank holds a slice of the state")

    def load_state(self, path: str, header: dict[str, str]) -> int:
        raise ValueError("not under --tp: each rank holds a slice of the state")

    def step(self) -> list[Event]:
        try:
            self._send(self.pending)
            self.pending = []
            return self.engine.step()
        except RuntimeError as e:           # a collective failed: name the rank that died, if one did
            dead = self._dead_rank()
            if dead is None:
                raise
            raise RunError(dead) from e

    def _dead_rank(self) -> str | None:
        for _ in range(20):
            if dead := dead_rank(self.procs):
                self.watchdog.set()       # this thread reports it; the watchdog stays quiet
                return dead
            time.sleep(0.1)
        return None

    def close(self):
        if self.closed:
            return
        self.closed = True
        self.watchdog.set()               # the ranks now end on purpose: not a dead rank to report
        if all(p.exitcode is None for p in self.procs):
            try:
                self._send([("stop",)])
            except RuntimeError:            # a peer went away meanwhile; finish() kills the rest
                return
            for p in self.procs:
                p.join(timeout=10)

    def _send(self, commands):
        dist.broadcast_object_list([commands], src=0, group=self.control)


def follow(engine, control) -> None:
    """A follower rank: apply rank 0's commands, then take the same step."""
    seqs = {}
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        for cmd in box[0]:
            if cmd[0] == "stop":
                return
            if cmd[0] == "submit":
                _, ids, params, rid = cmd
                seqs[rid] = engine.submit(ids, params, rid)
            elif cmd[0] == "cancel":
                engine.cancel(seqs.pop(cmd[1]))
            elif cmd[0] == "rebuild":
                engine = engine.rebuilt(cmd[1])
        engine.step()
        seqs = {k: s for k, s in seqs.items() if not s.finished}


def follower_main(rank: int, world: int, port: int, device: torch.device, build) -> None:
    """A follower rank's process: join the group, `build(device)` its engine (a picklable call), follow."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # rank 0 decides when to stop
    exit_with_parent()
    device, control = init_rank(rank, world, port, device)
    engine = build(device)
    with torch.no_grad():
        follow(engine, control)
    leave()


def leave() -> None:
    """End a rank's process once its part is done, skipping interpreter shutdown: gloo's worker threads drop
    their last tensors under the GIL, and one still waiting for it when shutdown starts is stopped inside C++
    (std::terminate, SIGABRT, a "terminate called" line on the terminal)."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def exit_with_parent() -> None:
    """End this follower as soon as rank 0 (its parent) ends, however it ended: killed while the ranks start
    up, it sends no stop and its peers wait for it, up to a collective's timeout."""
    parent = mp.parent_process()

    def wait() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=wait, name="parent", daemon=True).start()


def dead_rank(procs) -> str | None:
    """What the run says when one of the ranks 1.. (`procs`) has exited, or None while they all run."""
    for rank, p in enumerate(procs, 1):
        if p.exitcode is not None:
            return f"tensor-parallel rank {rank} exited with code {p.exitcode}; stopping all ranks"
    return None


def watch(procs, stop: threading.Event) -> None:
    """End rank 0 at once, with one line, when another rank dies: its peers would wait forever."""
    while not stop.wait(0.2):
        # a rank seen gone, then `stop` checked: a rank that ended on rank 0's word was told after `stop` was set
        if (dead := dead_rank(procs)) and not stop.is_set():
            print(f"error: {dead}", file=sys.stderr, flush=True)     # as the CLI says a RunError
            for p in procs:
                p.kill()
            os._exit(1)


def launch_leader(world: int, device: torch.device, build):
    """Rank 0 side of `--tp N`: start ranks 1..N-1, each building its engine with `build(device)` (a
    picklable call), join the group as rank 0, build the local engine, wrap it."""
    store = rendezvous()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=follower_main, args=(r, world, store.port, device, build), daemon=True)
             for r in range(1, world)]
    for p in procs:
        p.start()
    stop = threading.Event()
    threading.Thread(target=watch, args=(procs, stop), daemon=True).start()
    device, control = init_rank(0, world, store.port, device)
    leader = Leader(build(device), control, procs, stop)
    leader.store = store              # the ranks' meeting point lives as long as they run

    def finish():
        stop.set()
        leader.close()
        for p in procs:
            if p.is_alive():
                p.kill()

    atexit.register(finish)
    return leader
