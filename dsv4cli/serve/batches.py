"""OpenAI's Files and Batches API behind `--batch-dir DIR`: what is stored there, and a batch running.

DIR/files/ID holds an uploaded file (ID.json: its file object); DIR/batches/ID.json a batch object, rewritten
whole (a temporary file renamed over it) at every change of status. A batch runs through `dsv4 batch`'s own
runner (`BatchRun`), fed into the server's engine steps by the engine thread (`loop.py`): its results and
error records are appended to two files whose ids are fixed when the batch is created (and shown once it
ends) exactly as `dsv4 batch` appends them, so a server killed mid-batch resumes it at its next start the
way `--resume` does (a torn last line cut off, answered ids skipped): every request once. DIR is locked by
one server at a time.
"""
import dataclasses
import fcntl
import json
import os
import secrets
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import BinaryIO

from dsv4cli.batch.output import ResultFile, answered
from dsv4cli.batch.requests import RequestParser
from dsv4cli.batch.runner import BatchRun, count_lines
from dsv4cli.engine import EngineAPI
from dsv4cli.errors import RunError, UsageError
from dsv4cli.openai.requests import BodyParser

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
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
        self.files = {p.stem: json.loads(p.read_text()) for p in (root / "files").glob("*.json")}
        batches = [json.loads(p.read_text()) for p in (root / "batches").glob("*.json")]
        self.batches = {b["id"]: b for b in sorted(batches, key=lambda b: (b["created_at"], b["id"]))}

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
        with os.fdopen(fd, "wb") as f:
            shutil.copyfileobj(source, f, 1 << 20)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path(file_id))
        return self.add_file(file_id, filename, purpose)

    def save(self, batch: dict) -> None:
        with self.lock:
            _write_json(self.root / "batches" / f"{batch['id']}.json", batch)
            self.batches[batch["id"]] = batch


class ApiBatch:
    """A batch object and, while it runs, its BatchRun. `feed` and `finish` (the runner's) and `end` run on the
    engine thread; the HTTP handlers read `object()`."""

    def __init__(self, store: Store, batch: dict, engine: EngineAPI, bodies: BodyParser, model: str):
        self.store, self.batch, self.lock = store, batch, threading.Lock()     # the lock: around changes of status
        run = batch["dsv4"]             # where its results go and its seed: not shown
        self.paths = store.path(run["output"]), store.path(run["errors"])
        out, errors = ResultFile(self.paths[0]), ResultFile(self.paths[1])
        done, errored = answered(list(self.paths))           # what a server stopped mid-batch wrote
        # background requests: a step that prefills an online prompt does not decode them (`engine.scheduler`)
        defaults = dataclasses.replace(bodies.defaults, background=True)
        parser = RequestParser(bodies.tok, defaults, run["seed"], bodies.max_seq_len, bodies.thinking,
                               bodies.reasoning_effort, vocab=bodies.vocab)
        self.run = BatchRun(engine, parser, out, errors, model, done, errored, name=batch["id"])
        self.input = open(store.path(batch["input_file_id"]), "rb")  # noqa: SIM115 - read until the batch ends
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
        return self.batch["request_counts"] | {"completed": len(run.done) + run.ok,
                                               "failed": len(run.errored) + run.failed}

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
            self.batch = self.batch | {"status": "cancelling", "cancelling_at": int(time.time())}
            self.store.save(self.batch)
            return True

    def end(self, status: str, error: str | None = None) -> None:
        """Close its files and store it as `status` (completed, cancelled or failed), with its output and error
        files (those not empty) as file objects; once."""
        with self.lock:
            if not self.ended:
                self._end(status, error)

    def _end(self, status: str, error: str | None) -> None:
        self.input.close()
        for file in dict.fromkeys((self.run.out, self.run.errors)):
            try:
                file.close()
            except RunError as e:
                status, error = "failed", error or str(e)
        now = int(time.time())
        batch = self.batch | {"status": status, "request_counts": self.counts(), f"{status}_at": now}
        if status == "completed":
            batch["finalizing_at"] = now
        if error is not None:
            batch["errors"] = {"object": "list", "data": [{"code": "batch_failed", "message": error, "param": None,
                                                           "line": None}]}
        for key, path, kind in (("output_file_id", self.paths[0], "output"), ("error_file_id", self.paths[1], "error")):
            if path.stat().st_size:
                batch[key] = self.store.add_file(path.name, f"{batch['id']}_{kind}.jsonl", "batch_output")["id"]
        self.batch = batch
        self.store.save(batch)


def shown(batch: dict) -> dict:
    """A stored batch object without what only the server reads."""
    return {k: v for k, v in batch.items() if k != "dsv4"}


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def _write_json(path: Path, obj: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)
