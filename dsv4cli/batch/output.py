"""Result lines (OpenAI batch output format) and the append-only files they go to.

Each record is one whole line written with a single write() on an O_APPEND descriptor, so a crash can
only leave a torn last line; `repair` cuts that off and `scan` reads back what is already answered.
A run holds an exclusive lock on each file it writes from before it reads it until it ends, so two runs
can never answer the same requests into one file.
"""
import errno
import fcntl
import json
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dsv4cli.engine import Sequence
from dsv4cli.errors import RunError, UsageError
from dsv4cli.openai.responses import completion
from dsv4cli.tokenizer import Tokenizer

from .requests import BadLine, Request


def result_record(req: Request, seq: Sequence, model: str, tok: Tokenizer) -> dict:
    body = completion(req, seq, model, tok, str(req.line))
    return {"id": f"batch_req_{req.line}", "custom_id": req.custom_id,
            "response": {"status_code": 200, "request_id": f"req_{req.line}", "body": body}, "error": None}


def error_record(bad: BadLine) -> dict:
    return {"id": f"batch_req_{bad.line}", "custom_id": bad.custom_id, "response": None,
            "error": {"code": bad.code, "message": bad.message, "line": bad.line}}


class ResultFile:
    """An append-only JSONL file this process holds locked: one write per record, fsync at most once a
    second and on close. `flag` names the file in errors, `again` says how its run goes on after a failed
    write."""

    def __init__(self, path: Path, fsync_every: float = 1.0, flag: str = "-o/--output",
                 again: str = "rerun with --resume"):
        self.path, self.fsync_every, self.flag, self.again = path, fsync_every, flag, again
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise UsageError(f"{flag} {path}: cannot write: {e.strerror}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)    # released when the descriptor closes
        except BlockingIOError:
            os.close(self.fd)
            raise UsageError(f"{flag} {path}: another dsv4 batch run is writing this file") from None
        self.synced = time.monotonic()

    def append(self, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        try:
            while data:   # a regular file takes it all in one write; the loop only guards a short write
                data = data[os.write(self.fd, data):]
            if time.monotonic() - self.synced >= self.fsync_every:
                os.fsync(self.fd)
                self.synced = time.monotonic()
        except OSError as e:
            raise self.write_failed(e) from None

    def close(self) -> None:
        """Sync and close it; once (closing the number again could close another file that reused it)."""
        if self.fd < 0:
            return
        fd, self.fd = self.fd, -1
        try:
            os.fsync(fd)
        except OSError as e:
            if e.errno != errno.EINVAL:     # EINVAL: a device or pipe, which has nothing to sync
                raise self.write_failed(e) from None
        finally:
            os.close(fd)

    def write_failed(self, e: OSError) -> RunError:
        """A write that failed (a full disk, most likely): the records before it are whole (a torn last one
        is cut off by --resume), and the requests not written are answered by --resume."""
        fix = "free space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "fix it"
        return RunError(f"{self.flag} {self.path}: cannot write: {e.strerror.lower()}; {fix} and {self.again} "
                        "(the results so far are kept)")


def repair(path: Path) -> int:
    """Cut a torn last line (a write a crash interrupted) off the file; returns the bytes dropped."""
    if not path.exists():
        return 0
    with open(path, "rb+") as f:
        end = size = f.seek(0, os.SEEK_END)
        while end > 0:   # back to just after the last newline, a block at a time
            start = max(0, end - 65536)
            f.seek(start)
            cut = f.read(end - start).rfind(b"\n")
            if cut >= 0:
                end = start + cut + 1
                break
            end = start
        f.truncate(end)
    return size - end


def scan(path: Path) -> tuple[set[str], set[int]]:
    """The custom_ids a result file answers and the input lines it records as errors."""
    done, errored = set(), set()
    if not path.exists():
        return done, errored
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                record = json.loads(raw)
                if record.get("response") is not None:
                    done.add(record["custom_id"])
                else:
                    errored.add(record["error"]["line"])
            except (ValueError, AttributeError, KeyError, TypeError):
                raise UsageError(f"{path}: line {n}: not a batch result line; cannot resume from this file") from None
    return done, errored


def answered(paths: list[Path | None]) -> tuple[set[str], set[int]]:
    """What earlier runs wrote to these result files (those that exist), each repaired first: the custom_ids
    answered and the input lines recorded as errors."""
    done, errored = set(), set()
    for path in filter(None, paths):
        repair(path)
        ids, lines = scan(path)
        done |= ids
        errored |= lines
    return done, errored


@dataclass
class Results:
    """Where a run's records go (`errors` may be `out`) and what earlier runs wrote there (`answered`): the
    custom_ids answered and the input lines recorded as errors, which the run skips."""
    out: "ResultFile"
    errors: "ResultFile"
    done: set[str]
    errored: set[int]


def run_seed(out: Path, seed: int | None, resume: bool) -> int:
    """The seed of this run's unseeded requests: --seed, else the one a resumed run kept in OUT.seed, else a
    new random one. Kept in OUT.seed (OUT holds only result lines) so --resume samples as the first run did."""
    path = out.with_name(out.name + ".seed")
    if seed is None and resume and path.is_file():
        try:
            return int(path.read_text())
        except ValueError:
            raise UsageError(f"{path}: not a seed; remove it or give --seed") from None
    seed = random.randrange(1 << 62) if seed is None else seed
    try:   # a temporary file renamed over the old one: a crash never leaves half a seed
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(f"{seed}\n")
        os.replace(tmp, path)
    except OSError as e:
        raise UsageError(f"{path}: cannot write: {e.strerror}") from None
    return seed
