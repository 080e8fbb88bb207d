"""`dsv4 batch merge OUT [SHARDS...]`: the shards `--shard` wrote for one input, as one output.

Their manifests must agree (input, model, settings, run seed, shard count). Every non-blank input line
gets its one record, in input order: its result, or its error record. A line with no record in any shard
is missing, and nothing is written until none is (the shard that owns it is named, to be resumed); a line
answered twice (a shard file given twice under another name) is written once and reported. Records are
found by their line (`batch_req_LINE`) and copied byte for byte; only their offsets are held in memory. Nothing
in a shard is trusted: a manifest or record not as `dsv4 batch` writes it, or a record whose custom_id is not its
input line's, is refused in one line naming its file and line.
`--retry-failed` runs the requests the engine failed (`engine_error`) again, with the shards' seed, into
`OUT.retry` (resumable like any run), and their new records take the old ones' place.
"""
import contextlib
import dataclasses
import json
import os
import re
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from dsv4cli.config import Settings
from dsv4cli.errors import RunError, UsageError

from .shards import Shard, disagreement, input_digest, new_manifest, read_manifest, shard_files

SHOWN = 5       # ids named per kind in the report


@dataclass
class Record:
    file: int           # index into the files read
    row: int            # its line in that file
    offset: int
    length: int
    ok: bool
    code: str | None    # the error's code
    custom_id: str | None


def load_shards(out: Path, paths: list[Path]) -> list[tuple[Path, dict]]:
    """Each shard file with its manifest, checked to be shards of one run."""
    paths = paths or shard_files(out)
    if not paths:
        raise UsageError(f"merge: no shard files for {out} ({Shard(0, 1).path(out).name.replace('0-of-1', 'I-of-N')}); "
                         "name them: dsv4 batch merge OUT SHARDS...")
    shards, seen = [], {}
    for path in paths:
        if not path.is_file():
            raise UsageError(f"merge: {path}: no such file")
        if path.resolve() == out.resolve():
            raise UsageError(f"merge: {out}: is one of the shards; give another output file")
        manifest = read_manifest(path)
        if manifest is None:
            raise UsageError(f"merge: {path}: has no manifest ({path.name}.manifest.json); merge takes the files "
                             "dsv4 batch --shard wrote")
        if shards and (why := disagreement(shards[0][1], manifest)):
            raise UsageError(f"merge: {path} is a shard of a run with {why} than {shards[0][0]}; shards of different "
                             "runs do not merge")
        index = manifest["shard"]["index"]
        if index in seen:
            raise UsageError(f"merge: shard {index}/{manifest['shard']['count']} is given twice ({seen[index]} and "
                             f"{path})")
        seen[index] = path
        errors = manifest["errors"] and path.parent / manifest["errors"]
        if errors and not errors.is_file():
            raise UsageError(f"merge: {errors}: {'not a regular file' if errors.exists() else 'no such file'} (the "
                             f"errors file of {path}, its manifest says)")
        shards.append((path, manifest))
    return sorted(shards, key=lambda item: item[1]["shard"]["index"])


def index_records(paths: list[Path]) -> dict[int, list[Record]]:
    """Input line -> its records in these result files (a torn last line, a crash's, is left out)."""
    found: dict[int, list[Record]] = {}
    for i, path in enumerate(paths):
        offset = 0
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                if not raw.endswith(b"\n"):
                    break
                try:
                    line, ok, code, custom_id = parse_record(raw)
                except ValueError as e:
                    raise UsageError(f"merge: {path}: line {n}: not a batch result line ({e})") from None
                found.setdefault(line, []).append(Record(i, n, offset, len(raw), ok, code, custom_id))
                offset += len(raw)
    return found


def parse_record(raw: bytes) -> tuple[int, bool, str | None, str | None]:
    """A result line's input line, whether it is a result (else an error record), its error code and custom_id;
    ValueError naming what is not as `dsv4 batch` writes it."""
    try:
        r = json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deep") from None
    if not isinstance(r, dict):
        raise ValueError("not a JSON object")
    if not isinstance(r.get("custom_id", 0), str | None):
        raise ValueError("custom_id: must be a string or null")
    if r.get("response") is not None:
        line = re.fullmatch(r"batch_req_([1-9][0-9]*)", r["id"]) if isinstance(r.get("id"), str) else None
        if line is None:
            raise ValueError("id: must be batch_req_ and its input line")
        return int(line[1]), True, None, r["custom_id"]
    error = r.get("error")
    if not isinstance(error, dict) or not isinstance(error.get("code"), str):
        raise ValueError("error.code: must be a string")
    line = error.get("line")
    if not isinstance(line, int) or isinstance(line, bool) or line < 1:
        raise ValueError("error.line: must be an input line's number")
    return line, False, error["code"], r["custom_id"]


def check_ids(src: Path, records: dict[int, list[Record]], files: list[Path]) -> None:
    """A UsageError naming the first record whose input line `src` does not have, or whose custom_id is not that
    line's: a result must carry its line's, an error record its line's or null (a line with no usable id, a
    repeated one)."""
    lines = set()
    for n, raw in input_lines(src):
        lines.add(n)
        custom_id = line_id(raw)
        for r in records.get(n, ()):
            if not ((r.custom_id == custom_id and custom_id is not None) if r.ok else r.custom_id in (None, custom_id)):
                raise UsageError(f"merge: {files[r.file]}: line {r.row}: custom_id {json.dumps(r.custom_id)} is not "
                                 f"that of input line {n} of {src} ({json.dumps(custom_id)}); nothing was written")
    if extra := sorted(records.keys() - lines):
        r = records[extra[0]][0]
        raise UsageError(f"merge: {files[r.file]}: line {r.row}: a record of input line {extra[0]}, which {src} does "
                         "not have (blank or past its end); nothing was written")


def input_lines(src: Path):
    """(line number, raw line) of every non-blank input line."""
    with open(src, "rb") as f:
        for n, raw in enumerate(f, 1):
            if raw.strip():
                yield n, raw


def line_id(raw: bytes) -> str | None:
    """A line's custom_id, as the parser reads it; None when it has none."""
    try:
        obj = json.loads(raw)
        cid = obj.get("custom_id") if "body" in obj else obj.get("custom_id", obj.get("id"))
    except (ValueError, AttributeError, TypeError, RecursionError):     # not JSON, or not an object
        return None
    return str(cid) if isinstance(cid, str | int) and not isinstance(cid, bool) else None


def named(ids: list[str]) -> str:
    more = f" and {len(ids) - SHOWN} more" if len(ids) > SHOWN else ""
    return ", ".join(ids[:SHOWN]) + more


def retry(s: Settings, src: Path, manifest: dict, failed: set[int], out: Path) -> Path:
    """Run the failed lines again into OUT.retry (what an interrupted retry wrote is kept) with the shards' seed
    and settings; returns that file."""
    # the engine (and torch) only here: a merge without retries copies lines
    from dsv4cli.engine import EngineFailed
    from dsv4cli.loading import load_engine, sampling_params
    from dsv4cli.openai.requests import BodyRules

    from .output import ResultFile, Results, answered
    from .requests import RequestParser
    from .runner import BatchRun

    mine = new_manifest(s, src, manifest["input_sha256"], Shard(0, manifest["shard"]["count"]), manifest["seed"], out,
                        None)
    if why := disagreement(manifest, json.loads(json.dumps(mine))):
        raise UsageError(f"merge --retry-failed: this run would have {why}; give the shards' model and settings "
                         "(their flags or -c file)")
    path = out.with_name(out.name + ".retry")
    file = ResultFile(path, flag="merge --retry-failed")
    results = Results(file, file, *answered([path]))
    engine = load_engine(s, "batch")
    parser = RequestParser(engine.tok, sampling_params(s), manifest["seed"], engine.max_seq_len,
                           BodyRules(s.thinking, s.reasoning_effort, vocab=engine.model_info.vocab_size))
    run = BatchRun(engine, parser, results, s.model_name)
    try:
        # the other lines read as blank: line numbers stay those of the input
        with open(src, "rb") as lines:
            run.run(raw if n in failed else b"\n" for n, raw in enumerate(lines, 1))
    except EngineFailed as e:
        raise RunError(f"{e}; the retries so far are kept in {path}: rerun the merge to go on") from None
    finally:
        file.close()
        engine.close()
    print(run.summary("done", "merge --retry-failed"), file=sys.stderr)
    return path


def write_atomically(path: Path, chunks) -> None:
    """The file whole or not at all: written beside it, then renamed over it."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise RunError(f"merge: {path}: cannot write: {e.strerror}") from None


def run_merge(s: Settings, out: Path, paths: list[Path], retry_failed: bool) -> int:
    shards = load_shards(out, paths)
    first = shards[0][1]
    src = Path(s.input or first["input"])
    if not src.is_file():
        raise UsageError(f"merge: the input {src} is not there; give it with -i/--input")
    if input_digest(src) != first["input_sha256"]:
        raise UsageError(f"merge: {src} is not the input the shards answered (its SHA-256 differs); give that one "
                         "with -i/--input")
    files = [p for path, m in shards for p in (path, m["errors"] and path.parent / m["errors"]) if p]
    records = index_records(files)
    check_ids(src, records, files)
    check_complete(src, records, shards)
    failed = {n for n, found in records.items() if choose(found).code == "engine_error"}
    if retry_failed and failed:
        files.append(retry(s, src, first, failed, out))
        retried = index_records(files[-1:])
        for n in failed:                    # the retry's record (file index: the last) replaces the failure
            records[n] = [dataclasses.replace(r, file=len(files) - 1) for r in retried.get(n, [])] or records[n]
    write_merged(out, Path(s.errors) if s.errors else None, src, files, records, len(shards))
    if retry_failed and failed:
        files[-1].unlink()
    return 0


def choose(found: list[Record]) -> Record:
    """A line's record: its result (a line the engine failed and --resume answered has both), else its error."""
    return next((r for r in found if r.ok), found[0])


def check_complete(src: Path, records: dict[int, list[Record]], shards: list[tuple[Path, dict]]) -> None:
    """A UsageError naming the requests no shard answered, and why: a shard not given, or one that did not finish."""
    missing = [(n, line_id(raw)) for n, raw in input_lines(src) if n not in records]
    if not missing:
        return
    count = shards[0][1]["shard"]["count"]
    owners = {i for _, cid in missing for i in range(count) if Shard(i, count).owns(cid)}
    given = {m["shard"]["index"] for _, m in shards}
    why = [f"shard {i}/{count} was not given" for i in sorted(owners - given)]
    why += [f"{path} did not finish (rerun it with --resume)" for path, m in shards
            if m["shard"]["index"] in owners and not m["complete"]]
    ids = [cid if cid is not None else f"line {n}" for n, cid in missing]
    raise UsageError(f"merge: {len(missing)} requests have no result ({named(ids)}): "
                     f"{'; '.join(why) or 'no shard holds their records'}; nothing was written")


def write_merged(out: Path, err: Path | None, src: Path, files: list[Path], records: dict[int, list[Record]],
                 n_shards: int) -> None:
    """Every line's record in input order into `out` (errors into `err` when given), and a report of one line."""
    plan = [(n, raw, choose(records[n])) for n, raw in input_lines(src)]
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(open(p, "rb")) for p in files]

        def copies(rows):
            for _, _, r in rows:
                handles[r.file].seek(r.offset)
                yield handles[r.file].read(r.length)

        if err is None:
            write_atomically(out, copies(plan))
        else:
            write_atomically(out, copies(row for row in plan if row[2].ok))
            write_atomically(err, copies(row for row in plan if not row[2].ok))
    errors = [r for _, _, r in plan if not r.ok]
    duplicated = [line_id(raw) or f"line {n}" for n, raw, _ in plan if sum(r.ok for r in records[n]) > 1]
    failed = [r.custom_id for r in errors if r.code == "engine_error"]
    codes = ", ".join(f"{code} {k}" for code, k in Counter(r.code for r in errors).most_common())
    print(f"merge: {n_shards} shards of {src} -> {out}{f' and {err}' if err else ''}: {len(plan)} requests, "
          f"{len(plan) - len(errors)} ok, {len(errors)} errors{f' ({codes})' if errors else ''}"
          f"{f'; failed by the engine: {named(failed)} (--retry-failed runs them again)' if failed else ''}"
          f"; {len(duplicated)} duplicated{f' ({named(duplicated)}, written once)' if duplicated else ''}",
          file=sys.stderr)
