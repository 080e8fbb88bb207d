"""OpenAI's Files and Batches API behind `--batch-dir DIR`: what is stored there, and a batch running.

DIR/files/ID holds an uploaded file (ID.json: its file object); DIR/batches/ID.json a batch object, rewritten
whole (a temporary file synced and renamed over it) at every change of status. A batch runs through `dsv4 batch`'s
own runner (`BatchRun`), fed into the server's engine steps by the engine thread (`loop.py`): its results and
error records are appended to two files whose ids are fixed when the batch is created (and shown once it
ends) exactly as `dsv4 batch` appends them, so a server killed mid-batch resumes it at its next start the
way `--resume` does (a torn last line cut off, answered ids skipped): every request once. DIR is locked by
one server at a time. At start what a killed server was writing is removed, an object that cannot be read is
skipped (each named on stderr), and an unfinished batch that cannot resume is stored as failed: one damaged
entry never stops the server.
"""
import contextlib
import dataclasses
import fcntl
import json
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import BinaryIO

from dsv4cli.batch.output import ResultFile, Results, answered
from dsv4cli.batch.requests import RequestParser
from dsv4cli.batch.runner import BatchRun, count_lines
from dsv4cli.engine import EngineAPI
from dsv4cli.errors import RunError, UsageError
from dsv4cli.openai.requests import BodyParser, BodyRules

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
# the fields of a stored object the server reads, with their types: one without them is skipped at start
FILE_FIELDS = {"id": str, "bytes": int, "created_at": int, "filename": str, "purpose": str}
BATCH_FIELDS = {"id": str, "created_at": int, "status": str, "input_file_id": str, "request_counts": dict}
RUN_FIELDS = {"output": str, "errors": str, "seed": int}     # an unfinished batch's "dsv4": how it runs
WINDOW = 24 * 3600      # OpenAI's one completion window; a batch here never expires


class Store:
    """The files and batch objects in DIR, held in memory too (the HTTP handlers read them, the engine thread
    updates a batch's): one lock around every change."""

    def __init__(self, root: Path):
        self.root, self.lock = root, threading.Lock()
        try:
            for sub in ("files", "batches"):
                (root / sub).mkdir(parents=True, exist_ok=True)
            self.held = os.open(root / "lock", os.O_WRONLY | os.O_CREAT, 0o644)
        except OSError as e:
            raise UsageError(f"--batch-dir {root}: cannot use it: {e.strerror}") from None
        try:
            fcntl.flock(self.held, fcntl.LOCK_EX | fcntl.LOCK_NB)     # held while the process lives
        except BlockingIOError:
            raise UsageError(f"--batch-dir {root}: another dsv4 serve uses it") from None
        self._sweep()
        self.files = self._load("files", FILE_FIELDS)
        batches = self._load("batches", BATCH_FIELDS).values()
        self.batches = {b["id"]: b for b in sorted(batches, key=lambda b: (b["created_at"], b["id"]))}

    def _sweep(self) -> None:
        """Remove what a server killed mid-write left (DIR is this process's alone now): an upload cut short
        (`upload`'s `.upload.*`), an object's temporary (`_write_json`'s `.*.tmp`); each named on stderr."""
        left = [*(self.root / "files").glob(".upload.*"), *(self.root / "files").glob(".*.tmp"),
                *(self.root / "batches").glob(".*.tmp")]
        for path in sorted(left):
            with contextlib.suppress(OSError):
                path.unlink()
                warn(f"--batch-dir {self.root}: removed {path.parent.name}/{path.name}, a write cut short")

    def _load(self, sub: str, fields: dict[str, type]) -> dict[str, dict]:
        """The objects in DIR/sub by id; one that cannot be used is skipped and named."""
        objects = {}
        for path in sorted((self.root / sub).glob("*.json")):
            try:
                objects[path.stem] = self._read(path, fields)
            except ValueError as e:
                warn(f"--batch-dir {self.root}: skipped {sub}/{path.name}: {e}")
        return objects

    def _read(self, path: Path, fields: dict[str, type]) -> dict:
        """A stored object, or a ValueError saying why it cannot be used (cut, emptied, not ours, its file gone)."""
        try:
            obj = json.loads(path.read_bytes())
        except OSError as e:
            raise ValueError(e.strerror.lower()) from None
        except (ValueError, RecursionError):
            raise ValueError("not JSON (cut or emptied)") from None
        if not _has(obj, fields) or obj["id"] != path.stem:
            raise ValueError(f"not a {path.parent.name[:-1]} object of dsv4 serve")
        if fields is FILE_FIELDS and not self.path(obj["id"]).is_file():
            raise ValueError(f"its file {obj['id']} is gone")
        return obj

    def path(self, file_id: str) -> Path:
        return self.root / "files" / file_id

    def add_file(self, file_id: str, filename: str, purpose: str) -> dict:
        """The file object of a file now complete at path(file_id)."""
        obj = {"id": file_id, "object": "file", "bytes": self.path(file_id).stat().st_size,
               "created_at": int(time.time()), "filename": filename, "purpose": purpose, "status": "processed",
               "expires_at": None, "status_details": None}
        with self.lock:
            _write_json(self.root / "files" / f"{file_id}.json", obj)
            self.files[file_id] = obj
        return obj

    def upload(self, source: BinaryIO, filename: str, purpose: str) -> dict:
        """Copy an uploaded file in (beside its place first: no half file ever has an id)."""
        file_id = new_id("file-")
        fd, tmp = tempfile.mkstemp(dir=self.root / "files", prefix=".upload.")
        try:
            with os.fdopen(fd, "wb") as f:
                shutil.copyfileobj(source, f, 1 << 20)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(file_id))
            return self.add_file(file_id, filename, purpose)
        except BaseException:       # a full disk, most likely: nothing of it is left to keep it full
            for path in (tmp, self.path(file_id)):
                Path(path).unlink(missing_ok=True)
            raise

    def save(self, batch: dict) -> None:
        with self.lock:
            _write_json(self.root / "batches" / f"{batch['id']}.json", batch)
            self.batches[batch["id"]] = batch

    def fail(self, batch: dict, error: str) -> None:
        """Store a batch that cannot run as failed, saying why, and name it on stderr."""
        warn(f"--batch-dir {self.root}: batch {batch['id']} failed: {error}")
        failed = ended(batch, "failed", error)
        try:
            self.save(failed)
        except OSError as e:
            self.keep(failed, e)

    def keep(self, batch: dict, e: OSError) -> None:
        """Hold a batch that ended in memory only, the disk taking no write (`e`; full, most likely): stored
        unfinished, it is resumed at the next start, which ends it again (a resumed batch answers every request
        once)."""
        with self.lock:
            self.batches[batch["id"]] = batch
        warn(f"--batch-dir {self.root}: batch {batch['id']} {batch['status']}, but cannot store that: "
             f"{e.strerror.lower()}; the next start resumes it")


class ApiBatch:
    """A batch object and, while it runs, its BatchRun. `feed` and `finish` (the runner's) and `end` run on the
    engine thread; the HTTP handlers read `object()`."""

    def __init__(self, store: Store, batch: dict, engine: EngineAPI, bodies: BodyParser, model: str):
        self.store, self.batch, self.lock = store, batch, threading.Lock()     # the lock: around changes of status
        run = batch["dsv4"]             # where its results go and its seed: not shown
        self.paths = store.path(run["output"]), store.path(run["errors"])
        # a UsageError when it cannot run (its input removed, a result file damaged), each file it opened closed again
        with contextlib.ExitStack() as opened:
            try:
                self.input = opened.enter_context(open(store.path(batch["input_file_id"]), "rb"))
            except OSError as e:
                raise UsageError(f"its input file {batch['input_file_id']}: {e.strerror.lower()}") from None
            out, errors = (opened.enter_context(contextlib.closing(ResultFile(
                path, flag="result file", again="restart dsv4 serve, which resumes the batch"))) for path in self.paths)
            results = Results(out, errors, *answered(list(self.paths)))     # what a server stopped mid-batch wrote
            opened.pop_all()
        # background requests: a step that prefills an online prompt does not decode them (`engine.scheduler`)
        defaults = dataclasses.replace(bodies.defaults, background=True)
        parser = RequestParser(bodies.tok, defaults, run["seed"], bodies.max_seq_len,
                               BodyRules(bodies.thinking, bodies.reasoning_effort, vocab=bodies.vocab))
        self.run = BatchRun(engine, parser, results, model, name=batch["id"])
        self.run.start(self.input)

    @classmethod
    def create(cls, store: Store, body: dict, engine: EngineAPI, bodies: BodyParser, model: str) -> "ApiBatch":
        """A new batch of a checked body (input_file_id, endpoint, completion_window, metadata), stored, ready to
        run."""
        now = int(time.time())
        batch = {"id": new_id("batch_"), "object": "batch", "endpoint": body["endpoint"], "model": model,
                 "errors": None, "input_file_id": body["input_file_id"], "completion_window": "24h",
                 "status": "in_progress", "output_file_id": None, "error_file_id": None, "created_at": now,
                 "in_progress_at": now, "expires_at": now + WINDOW, "finalizing_at": None, "completed_at": None,
                 "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": count_lines(store.path(body["input_file_id"])), "completed": 0,
                                    "failed": 0},
                 "metadata": body.get("metadata"),
                 "dsv4": {"output": new_id("file-"), "errors": new_id("file-"), "seed": secrets.randbits(62)}}
        store.save(batch)
        return cls(store, batch, engine, bodies, model)

    def counts(self) -> dict:
        run = self.run
        return self.batch["request_counts"] | {"completed": len(run.results.done) + run.ok,
                                               "failed": len(run.results.errored) + run.failed}

    def object(self) -> dict:
        """The batch object as the API shows it, its counts as of now."""
        return shown(self.batch | {"request_counts": self.counts()})

    @property
    def ended(self) -> bool:
        return self.batch["status"] not in ACTIVE

    def cancelling(self) -> bool:
        """Store it as being cancelled; False when it already is, or has ended."""
        with self.lock:
            if self.ended or self.batch["status"] == "cancelling":
                return False
            cancelling = self.batch | {"status": "cancelling", "cancelling_at": int(time.time())}
            self.store.save(cancelling)         # first: on a full disk it is not cancelling (the request is 507)
            self.batch = cancelling
            return True

    def end(self, status: str, error: str | None = None) -> None:
        """Close its files and store it as `status` (completed, cancelled or failed), with its output and error
        files (those not empty) as file objects; once."""
        with self.lock:
            if not self.ended:
                self._end(status, error)

    def _end(self, status: str, error: str | None) -> None:
        self.input.close()
        for file in dict.fromkeys((self.run.results.out, self.run.results.errors)):
            try:
                file.close()
            except RunError as e:
                status, error = "failed", error or str(e)
        batch = ended(self.batch | {"request_counts": self.counts()}, status, error)
        try:
            for key, path, kind in (("output_file_id", self.paths[0], "output"),
                                    ("error_file_id", self.paths[1], "error")):
                if path.stat().st_size:
                    batch[key] = self.store.add_file(path.name, f"{batch['id']}_{kind}.jsonl", "batch_output")["id"]
            self.store.save(batch)
        except OSError as e:
            self.store.keep(batch, e)
        self.batch = batch


def shown(batch: dict) -> dict:
    """A stored batch object without what only the server reads."""
    return {k: v for k, v in batch.items() if k != "dsv4"}


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def ended(batch: dict, status: str, error: str | None = None) -> dict:
    """The batch object ended as `status` (completed, cancelled or failed) now, with `error` saying why."""
    now = int(time.time())
    batch = batch | {"status": status, f"{status}_at": now}
    if status == "completed":
        batch["finalizing_at"] = now
    if error is not None:
        batch["errors"] = {"object": "list", "data": [{"code": "batch_failed", "message": error, "param": None,
                                                       "line": None}]}
    return batch


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _has(obj, fields: dict[str, type]) -> bool:
    """Whether obj is a JSON object with these fields of these types (and, for a batch that may run, its run's)."""
    return isinstance(obj, dict) and all(isinstance(obj.get(k), t) for k, t in fields.items()) and (
        obj.get("status") not in ACTIVE or _has(obj.get("dsv4"), RUN_FIELDS))


def _write_json(path: Path, obj: dict) -> None:
    """Replace path with obj whole: written beside it, synced (a power cut leaves the old one or the new one, never
    an empty one), renamed over it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
