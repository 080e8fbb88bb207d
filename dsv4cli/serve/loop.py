"""The engine thread: the one thread that touches the engine (and so every tensor).

HTTP handlers run on the asyncio event loop. They hand work to this thread through `submit` and
`cancel`, which only append to a lock-guarded inbox and wake the thread; the thread applies the inbox
between engine steps, steps while there is work, and sleeps on a condition when there is none (no
spinning). What a step produced goes back to each request's asyncio queue with
`call_soon_threadsafe`, as plain values: a handler never reads a Sequence the engine is still writing.
Batching is the engine's own: every step admits waiting requests into free slots (continuous batching).
A request of n choices (or best_of candidates) is that many sequences, all admitted at once.

API batches (`batches.py`) share the engine with online requests at a lower priority: between steps the
thread feeds a batch's requests into the engine only into slots that are free and that no online request
waits for, into at most `batch_slots` of them, and not while an online request waits for its first token,
so an online request never queues behind a batch, always finds `max_batch - batch_slots` slots the batches
cannot take, and prefills alone (batch requests are background requests: `engine.scheduler.streams_to_decode`).
Their results are written here, on this thread, as each one ends.
"""
import asyncio
import contextlib
import sys
import threading
import traceback
from dataclasses import dataclass, field

from dsv4cli.engine import EngineAPI, EngineFailed, SamplingParams, Sequence, TokenLogprob
from dsv4cli.errors import RunError

from .batches import ApiBatch
from .metrics import ServerMetrics


class QueueFull(Exception):
    """More requests wait for a slot than `max_waiting` allows."""


class Stopping(Exception):
    """The server is stopping: it takes no more requests."""


@dataclass
class Delta:
    """What one step produced for one of a request's sequences: text that can no longer change, the
    logprobs of its new tokens, and, when it ended, the finished Sequence (the engine no longer writes it)."""
    text: str
    logprobs: list[TokenLogprob]
    done: Sequence | None = None
    error: str | None = None        # the request is over: the engine failed it, or the server is stopping
    status: int = 500               # the HTTP status of that error
    first: bool = False             # the sequence's first delta: its prompt is prefilled
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)     # on the first delta, when asked for


@dataclass(eq=False)
class Job:
    """A request on its way through the engine thread: a prompt and SamplingParams per sequence to run, and
    where their deltas go, as (sequence index, Delta)."""
    prompts: list[list[int]]
    params: list[SamplingParams]
    queue: asyncio.Queue
    aloop: asyncio.AbstractEventLoop
    seqs: list[Sequence] = field(default_factory=list)

    def deliver(self, index: int, delta: Delta) -> None:
        _call_soon(self.aloop, self.queue.put_nowait, (index, delta))


class EngineLoop:
    def __init__(self, engine: EngineAPI, max_waiting: int, metrics: ServerMetrics, on_fatal=lambda: None,
                 batch_slots: int = 1):
        """`on_fatal()` is called (on the engine thread) once the engine cannot go on: the server exits.
        `batch_slots`: the most slots API batches hold at once."""
        self.engine, self.max_waiting, self.metrics, self.on_fatal = engine, max_waiting, metrics, on_fatal
        self.batch_slots = batch_slots
        self.wake = threading.Condition()
        self.inbox: list[Job] = []          # submitted, not yet in the engine
        self.cancels: list[Job] = []
        self.jobs: dict[str, tuple[Job, int]] = {}      # in the engine: Sequence.id -> (job, index in job.seqs)
        self.batch_inbox: list[ApiBatch] = []       # to start / to cancel, not yet seen by the engine thread
        self.batch_cancels: list[ApiBatch] = []
        self.batches: list[ApiBatch] = []           # running, oldest first (fed first)
        # sequences in the engine holding a slot (API batches' too) / online ones waiting for one, counted
        # whenever jobs come or go (under the lock, so a submit never sees a job that is in neither the inbox nor
        # these counts); and API batches' sequences in the engine
        self.running = self.waiting = self.batch_held = 0
        self.stopping = False
        self.closed: str | None = None      # why no more requests are taken (the server is stopping)
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)

    @property
    def capacity(self) -> int:
        """The most sequences one request may run: every slot and waiting place."""
        return self.engine.max_batch + self.max_waiting

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Stop the engine thread; a running API batch stays in progress (the next start resumes it). Idempotent:
        the server's shutdown stops it and so does the exit path around it."""
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join()
        with self.wake:
            left, self.batches, self.batch_inbox = self.batches + self.batch_inbox, [], []
        for file in (file for batch in left for file in (batch.run.results.out, batch.run.results.errors)):
            with contextlib.suppress(RunError):     # a full disk: the next start resumes what was written
                file.close()

    def start_batch(self, batch: ApiBatch) -> None:
        with self.wake:
            self.batch_inbox.append(batch)
            self.wake.notify()

    def cancel_batch(self, batch: ApiBatch) -> None:
        """Cancel an API batch: its requests in the engine end before the next step, and it is stored cancelled
        with what it answered so far."""
        with self.wake:
            self.batch_cancels.append(batch)
            self.wake.notify()

    def submit(self, prompts: list[list[int]], params: list[SamplingParams]) -> Job:
        """Queue a request of len(params) sequences, each of its prompt (from the event loop); raises QueueFull
        when they would wait beyond max_waiting, Stopping once the server stops."""
        job = Job(prompts, params, asyncio.Queue(), asyncio.get_running_loop())
        with self.wake:
            if self.error is not None:
                raise RuntimeError(self.error)
            if self.closed is not None:
                raise Stopping(self.closed)
            free_slots = self.engine.max_batch - self.running
            queued = sum(len(j.params) for j in self.inbox)
            if self.waiting + queued + len(params) > self.max_waiting + free_slots:
                raise QueueFull
            self.inbox.append(job)
            self.wake.notify()
        return job

    def cancel(self, job: Job) -> None:
        """End a request early (its client went away); the engine frees its slots before the next step."""
        with self.wake:
            self.cancels.append(job)
            self.wake.notify()

    def close(self, reason: str) -> None:
        """Take no more requests and end every open one now with `reason` (HTTP 503), on the event loop:
        a stopping server's last word to requests that did not finish in time. Their handlers cancel them."""
        with self.wake:
            self.closed = reason
            open_jobs = {id(job): job for job, _ in self.jobs.values()} | {id(job): job for job in self.inbox}
            self.inbox.clear()
        for job in open_jobs.values():
            job.queue.put_nowait((0, Delta("", [], error=reason, status=503)))

    def _run(self) -> None:
        try:
            while True:
                with self.wake:
                    while not (self.inbox or self.cancels or self.stopping or self.engine.has_work() or self.batches
                               or self.batch_inbox or self.batch_cancels):
                        self.wake.wait()
                    if self.stopping:
                        return
                    while self.inbox:
                        self._admit(self.inbox.pop(0))
                    while self.cancels:
                        self._cancel(self.cancels.pop())
                    self.batches += self.batch_inbox
                    self.batch_inbox.clear()
                    while self.batch_cancels:
                        self._end_batch(self.batch_cancels.pop(), "cancelled")
                    self._count()
                self._feed_batches()
                if self.engine.has_work():
                    self._step()
        except Exception as e:  # noqa: BLE001 - the server cannot go on; every request is told why
            if not isinstance(e, EngineFailed | RunError):     # those say all there is in their message
                traceback.print_exc(file=sys.stderr)
            with self.wake:
                self.error = f"engine failed: {type(e).__name__}: {e}"
                orphans = {id(job): job for job, _ in self.jobs.values()} | {id(job): job for job in self.inbox}
            for job in orphans.values():
                job.deliver(0, Delta("", [], error=self.error))
            self.on_fatal()

    def _admit(self, job: Job) -> None:
        try:
            for prompt, params in zip(job.prompts, job.params):
                job.seqs.append(self.engine.submit(prompt, params))
        except ValueError as e:         # the parser checks what the engine refuses; this is a last guard
            for seq in job.seqs:
                self.engine.cancel(seq)
            job.deliver(0, Delta("", [], error=str(e)))
            return
        for index, seq in enumerate(job.seqs):
            self.jobs[seq.id] = (job, index)

    def _cancel(self, job: Job) -> None:
        for seq in job.seqs:
            if self.jobs.pop(seq.id, None) is not None:
                self.engine.cancel(seq)
                self.metrics.finish(seq)

    def _feed_batches(self) -> None:
        """API batches' requests into the slots no online request waits for, up to batch_slots of them; none
        while an online request waits for its first token (its prefill runs alone, `scheduler.streams_to_decode`)."""
        if any(not job.seqs[index].output_ids for job, index in self.jobs.values()):
            return
        free = self.engine.max_batch - self.running - self.waiting - (self.batch_held - self._batch_running())
        room = min(free, self.batch_slots - self.batch_held)
        for batch in list(self.batches):
            if room <= 0:
                break
            try:
                fed = batch.run.feed(room)
            except RunError as e:       # its results cannot be written (a full disk): it fails, the server goes on
                self._end_batch(batch, "failed", str(e))
                continue
            room -= fed
            self.batch_held += fed
            if batch.run.finished:      # the rest of its lines were answered already, or bad
                self._end_batch(batch, "completed")

    def _batch_running(self) -> int:
        return sum(seq.slot >= 0 for batch in self.batches for _, seq in batch.run.in_flight.values())

    def _end_batch(self, batch: ApiBatch, status: str, error: str | None = None) -> None:
        for _, seq in batch.run.in_flight.values():     # a cancelled or failed one's
            self.engine.cancel(seq)
        batch.run.in_flight.clear()
        if batch in self.batches:
            self.batches.remove(batch)
        batch.end(status, error)

    def _batch_event(self, seq: Sequence) -> None:
        """An API batch's request ended: its record written (by the batch's runner), the batch ended when it was
        its last."""
        batch = next((b for b in self.batches if seq.id in b.run.in_flight), None)
        if batch is None:
            return
        try:
            batch.run.finish(seq)
        except RunError as e:
            self._end_batch(batch, "failed", str(e))
            return
        if batch.run.finished:
            self._end_batch(batch, "completed")

    def _step(self) -> None:
        deliveries = []
        for event in self.engine.step():
            entry = self.jobs.get(event.seq.id)
            if entry is None:
                if event.finished:
                    self._batch_event(event.seq)
                continue
            seq = event.seq
            logprobs = seq.logprobs[len(seq.logprobs) - len(event.token_ids):] if seq.params.logprobs is not None \
                else []
            done = seq if event.finished else None
            if done is not None:
                with self.wake:
                    del self.jobs[seq.id]
                self.metrics.finish(seq)
                if seq.error is not None:
                    print(f"request {seq.id}: {seq.error}", file=sys.stderr, flush=True)
            deliveries.append((*entry, Delta(event.text, logprobs, done, seq.error, first=event.first,
                                             prompt_logprobs=seq.prompt_logprobs if event.first else [])))
        with self.wake:
            self._count()           # before the deltas: a client that got its tokens sees itself running
        if deliveries:      # one wake-up of the (one) event loop per step, not one per request
            _call_soon(deliveries[0][0].aloop, _put_all, deliveries)

    def _count(self) -> None:
        online = sum(job.seqs[index].slot >= 0 for job, index in self.jobs.values())
        self.waiting = len(self.jobs) - online
        self.batch_held = sum(len(batch.run.in_flight) for batch in self.batches)
        self.running = online + self._batch_running()
        self.metrics.set_load(self.running, self.waiting)


def _call_soon(aloop: asyncio.AbstractEventLoop, fn, *args) -> None:
    with contextlib.suppress(RuntimeError):     # the event loop is closed: the server is gone, nobody waits
        aloop.call_soon_threadsafe(fn, *args)


def _put_all(deliveries: list[tuple[Job, int, Delta]]) -> None:
    for job, index, delta in deliveries:
        job.queue.put_nowait((index, delta))
