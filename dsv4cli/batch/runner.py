"""`dsv4 batch`: stream a JSONL file of requests through the engine and append one result line each.

The input is read line by line and at most 2 x max_batch requests are in the engine at once (the running
batch plus as many waiting to take a slot the moment one frees), so memory does not grow with the file.
Results go out in the order requests finish, matched to their input by custom_id.
"""
import os
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from dsv4cli.config import Settings
from dsv4cli.engine import EngineAPI, EngineFailed, Sequence, acceptance_text, drafter_label
from dsv4cli.errors import RunError, UsageError
from dsv4cli.loading import load_engine, sampling_params
from dsv4cli.openai.requests import BodyRules

from .output import ResultFile, Results, answered, error_record, result_record, run_seed
from .requests import BadLine, Request, RequestParser
from .shards import (
    Shard,
    check_paths,
    disagreement,
    input_digest,
    input_seed,
    new_manifest,
    parse_shard,
    read_manifest,
    write_manifest,
)


class BatchRun:
    """One pass over the input: parse, skip what is already answered, keep the engine fed, write results.
    `dsv4 batch` drives it with `run`; `dsv4 serve`'s engine thread feeds an API batch into its own steps with
    `feed` and hands it each of its requests that ends (`finish`)."""

    def __init__(self, engine: EngineAPI, parser: RequestParser, results: Results, model: str,
                 bar: Progress | None = None, name: str = "line"):
        """`name`: engine request ids are NAME-LINE (a server runs several batches and online requests at once)."""
        self.engine, self.parser, self.results, self.model = engine, parser, results, model
        self.bar, self.name = bar, name
        self.window = 2 * engine.max_batch
        self.in_flight: dict[str, tuple[Request, Sequence]] = {}     # by engine request id
        self.pending: Iterator[Request] = iter(())
        self.exhausted = False          # every input line is read
        self.peak_in_flight = 0
        self.ok = self.failed = self.skipped = self.tokens = 0
        self.t0 = time.perf_counter()

    def run(self, lines: Iterable[bytes]) -> None:
        self.start(lines)
        while True:
            self.feed(self.window - len(self.in_flight))
            if not self.engine.has_work():
                return
            for event in self.engine.step():
                if event.finished:
                    self.finish(event.seq)

    def start(self, lines: Iterable[bytes]) -> None:
        self.pending, self.exhausted = self._requests(lines), False

    @property
    def finished(self) -> bool:
        return self.exhausted and not self.in_flight

    def feed(self, room: int) -> int:
        """Submit up to `room` more requests to the engine (reading on through the input); how many it did."""
        fed = 0
        while fed < room and not self.exhausted:
            req = next(self.pending, None)
            if req is None:
                self.exhausted = True
                break
            request_id = f"{self.name}-{req.line}"
            try:
                seq = self.engine.submit(req.prompt_ids, req.params, request_id)
            except ValueError as e:     # the parser checks what the engine refuses; this is a last guard
                self._failed(req, str(e))
                continue
            self.in_flight[request_id] = (req, seq)
            fed += 1
        self.peak_in_flight = max(self.peak_in_flight, len(self.in_flight))
        return fed

    def _requests(self, lines: Iterable[bytes]) -> Iterator[Request]:
        """The requests still to run; bad lines become error records on the way, answered ones are skipped."""
        for n, raw in enumerate(lines, 1):
            if not raw.strip():
                continue   # blank lines are not requests (and not counted by count_lines)
            try:
                req = self.parser.parse(n, raw)   # even a line to skip: it claims its custom_id
                if req is None:                   # another shard's
                    self._tick()
                    continue
            except BadLine as bad:
                if n not in self.results.errored:
                    self.results.errors.append(error_record(bad))
                    self.failed += 1
                else:
                    self.skipped += 1
                self._tick()
                continue
            if req.custom_id in self.results.done:
                self.skipped += 1
                self._tick()
                continue
            yield req

    def finish(self, seq: Sequence) -> None:
        """A request of this run ended: its result, or an error record when the engine failed it."""
        req, _ = self.in_flight.pop(seq.id)
        if seq.error is not None:
            self._failed(req, seq.error)
            return
        self.results.out.append(result_record(req, seq, self.model, self.engine.tok))
        self.ok += 1
        self.tokens += len(seq.output_ids)
        self._tick()

    def _failed(self, req: Request, error: str) -> None:
        """The engine failed this request: an error record (--resume runs it again), and the run goes on."""
        failed = BadLine("engine_error", error, req.custom_id)
        failed.line = req.line
        self.results.errors.append(error_record(failed))
        self.failed += 1
        self._tick()

    def _tick(self) -> None:
        if self.bar is not None:
            self.bar.update(self.bar.task_ids[0], advance=1, stats=self.rates())

    def rates(self, accept: bool = True) -> str:
        """Requests and tokens per second so far, and (`accept`) the drafts' acceptance rate."""
        dt = max(time.perf_counter() - self.t0, 1e-9)
        totals = self.engine.totals
        accept = f" · accept {totals.acceptance_rate:.0%}" if accept and totals.draft_tokens else ""
        return f"{self.ok / dt:.1f} req/s · {self.tokens / dt:.1f} tok/s{accept}"

    def summary(self, state: str, label: str = "batch") -> str:
        """One line: how the run ended (done, interrupted, stopped) and its counts and rates."""
        dt = time.perf_counter() - self.t0
        skipped = f", {self.skipped} already done" if self.skipped else ""
        totals, drafting = self.engine.totals, drafter_label(self.engine)
        accept = f" · {acceptance_text(totals)}" if totals.drafts else ""
        cached = (f" · prefix cache {totals.prefix_hit_rate:.0%} of prompt tokens ({totals.cached_tokens} of "
                  f"{totals.prompt_tokens})")
        return (f"{label} {state}: {self.ok} ok, {self.failed} errors{skipped} · {self.tokens} tokens in {dt:.1f} s"
                f" · {self.rates(accept=False)}{cached} · drafter {drafting}{accept}")


def count_lines(path: Path) -> int:
    """Non-blank lines, without parsing them: the progress bar's total."""
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


def progress_bar(total: int) -> Progress:
    bar = Progress(TextColumn("batch"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
                   TimeRemainingColumn(), console=Console(stderr=True))
    bar.add_task("batch", total=total, stats="")
    return bar


def shard_manifest(s: Settings, shard: Shard, src: Path, out: Path, err: Path | None) -> dict:
    """The manifest a shard starts with, written now. Its run seed: --seed, else the one an earlier run of the
    shard kept (--resume), else one from the input's hash, so that every shard draws the same without talking.
    A resumed shard must answer as the earlier run did: same input, model and settings."""
    digest = input_digest(src)
    earlier = read_manifest(out) if s.resume else None
    seed = s.seed if s.seed is not None else earlier["seed"] if earlier else input_seed(digest)
    manifest = new_manifest(s, src, digest, shard, seed, out, err)
    if earlier is not None and (why := disagreement(manifest, earlier)):
        raise UsageError(f"--resume: {out} holds the answers of a run with {why}; resume with the same input and "
                         "settings, or remove it")
    write_manifest(out, manifest)
    return manifest


def run_batch(s: Settings) -> int:
    shard = parse_shard(s.shard, os.environ) if s.shard else None
    src, out_path, err_path = check_paths(s, shard)
    # locked before anything is read or loaded: a second run on these files stops here
    out = ResultFile(out_path)
    errors = ResultFile(err_path, flag="--errors") if err_path else out
    results = Results(out, errors, *answered([out_path, err_path] if s.resume else []))
    manifest = shard_manifest(s, shard, src, out_path, err_path) if shard else None
    seed = manifest["seed"] if manifest else run_seed(out_path, s.seed, s.resume)
    total = count_lines(src)
    # the job's size at most (a line's own max_tokens may ask for fewer): `compile = auto` compiles only
    # a job long enough to gain from it
    share = total // shard.count if shard else total
    engine = load_engine(s, "batch", job_tokens=max(share - len(results.done), 0) * s.max_tokens)
    parser = RequestParser(engine.tok, sampling_params(s), seed, engine.max_seq_len,
                           BodyRules(s.thinking, s.reasoning_effort, vocab=engine.model_info.vocab_size), shard)
    bar = progress_bar(total) if sys.stderr.isatty() else None
    batch = BatchRun(engine, parser, results, s.model_name, bar)
    interrupted, failed = False, None
    try:
        with open(src, "rb") as lines, bar or nullcontext():
            batch.run(lines)
    except KeyboardInterrupt:
        interrupted = True
    except EngineFailed as e:           # every result so far is written; the requests in flight are not
        failed = RunError(f"{e}; the results so far are kept: --resume answers the rest")
    except RunError as e:               # a result could not be written (a full disk)
        failed = e
    finally:
        for file in dict.fromkeys((out, errors)):
            try:
                file.close()
            except RunError as e:
                failed = failed or e
        if manifest is not None:
            manifest["counts"] = {"ok": len(results.done) + batch.ok, "errors": len(results.errored) + batch.failed}
            manifest["complete"] = not (failed or interrupted)
            write_manifest(out_path, manifest)
    label = f"batch shard {shard}" if shard else "batch"
    print(batch.summary("stopped" if failed else "interrupted" if interrupted else "done", label), file=sys.stderr)
    if failed is not None:
        raise failed
    return 130 if interrupted else 0
