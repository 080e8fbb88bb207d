"""Shards of one batch input, run by separate processes that never talk: which requests a shard answers,
where its files go, and its manifest.

A request belongs to shard blake2b(custom_id) mod N, so every shard agrees on the split whatever the line
order; a line without a usable custom_id (not JSON, no id) belongs to shard 0, which writes its error
record. Shard I of N writes `OUT` as `OUT-stem.shard-I-of-N.suffix` (the errors file likewise) and a manifest
beside it, `SHARD.manifest.json`: the input's SHA-256, the model, the settings that decide answers, the
shard, the run seed and the counts. `dsv4 batch merge` checks the manifests agree before it merges.
"""
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dsv4cli.config import RENAMED, SAMPLING_KEYS, Settings, read_json
from dsv4cli.errors import UsageError

# the settings that decide a request's answer (the run seed is kept apart): shards and a merge's retries share them
ANSWER_KEYS = (*(k for k in SAMPLING_KEYS if k != "seed"), "drafts", "verify", "max_seq_len", "thinking",
               "reasoning_effort")
# each manifest field: its JSON type as `new_manifest` writes it, and how an error names that type
MANIFEST_FIELDS = {"input": (str, "a string"), "input_sha256": (str, "a string"), "model": (str, "a string"),
                   "settings": (dict, "an object"), "shard": (dict, "an object"), "seed": (int, "an integer"),
                   "errors": (str | None, "a string or null"), "complete": (bool, "true or false"),
                   "counts": (dict, "an object")}
SHAPE = "give I/N (0 <= I < N), auto (Slurm's array task, or with --shard auto/N Kubernetes' completion index)"


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def owns(self, custom_id: str | None) -> bool:
        """Whether this shard answers the line with this custom_id (None: a line that has none)."""
        if custom_id is None:
            return self.index == 0
        digest = hashlib.blake2b(custom_id.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % self.count == self.index

    def path(self, path: Path) -> Path:
        """The file this shard writes for `path`: results.jsonl -> results.shard-2-of-4.jsonl."""
        width = len(str(self.count - 1))
        return path.with_name(f"{path.stem}.shard-{self.index:0{width}d}-of-{self.count}{path.suffix}")


def shard_files(out: Path) -> list[Path]:
    """The shard files `--shard` wrote for `out`, whatever their count."""
    pattern = re.compile(re.escape(out.stem) + r"\.shard-\d+-of-\d+" + re.escape(out.suffix))
    return sorted(p for p in out.parent.glob(f"{out.stem}.shard-*") if pattern.fullmatch(p.name))


def parse_shard(text: str, env: Mapping[str, str]) -> Shard:
    """--shard I/N, or auto: I and N from a Slurm array job (SLURM_ARRAY_TASK_ID less SLURM_ARRAY_TASK_MIN, and
    SLURM_ARRAY_TASK_COUNT), or auto/N: I from Kubernetes' JOB_COMPLETION_INDEX (an Indexed Job does not tell
    its pods the completions count) or Slurm's."""
    m = re.fullmatch(r"\s*(\d+|auto)\s*(?:/\s*(\d+))?\s*", text)
    if m is None or (m[1] != "auto" and m[2] is None):
        raise UsageError(f"--shard: {SHAPE}; got {text!r}")
    count = int(m[2]) if m[2] else None
    if m[1] != "auto":
        index, source = int(m[1]), ""
    elif env.get("SLURM_ARRAY_TASK_ID"):
        index, source = _env_int(env, "SLURM_ARRAY_TASK_ID") - _env_int(env, "SLURM_ARRAY_TASK_MIN", 0), \
            " (SLURM_ARRAY_TASK_ID less SLURM_ARRAY_TASK_MIN)"
        if count is None:
            count = _env_int(env, "SLURM_ARRAY_TASK_COUNT")
    elif env.get("JOB_COMPLETION_INDEX"):
        index, source = _env_int(env, "JOB_COMPLETION_INDEX"), " (JOB_COMPLETION_INDEX)"
        if count is None:
            raise UsageError("--shard auto: JOB_COMPLETION_INDEX gives the index only; give the Job's completions "
                             "as the count, --shard auto/N")
    else:
        raise UsageError("--shard auto: neither SLURM_ARRAY_TASK_ID (a Slurm array job) nor JOB_COMPLETION_INDEX "
                         "(a Kubernetes Indexed Job) is set; give --shard I/N")
    if count is None or count < 1 or not 0 <= index < count:
        raise UsageError(f"--shard: shard {index}{source} of {count}: the index must be in [0, {count}); run the "
                         "array as 0..N-1 (or 1..N) with one task per shard")
    return Shard(index, count)


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    if name not in env and default is not None:
        return default
    try:
        return int(env[name])
    except (KeyError, ValueError):
        raise UsageError(f"--shard auto: {name}: must be an integer, got {env.get(name)!r}") from None


def input_digest(path: Path) -> str:
    """The input's SHA-256 (hex): shards of one input agree on it, and a merge checks the input did not change."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def input_seed(digest: str) -> int:
    """The run seed of shards given no --seed: from the input, so that every shard samples as one run would
    without them agreeing on it (a random one each would not)."""
    return int(digest[:16], 16) >> 2


def manifest_path(out: Path) -> Path:
    return out.with_name(out.name + ".manifest.json")


def new_manifest(s: Settings, src: Path, digest: str, shard: Shard, seed: int, out: Path, err: Path | None) -> dict:
    """A shard's manifest: what it answers (input, model, settings, shard, seed), where, and its counts so far."""
    return {"input": str(src.resolve()), "input_sha256": digest, "model": s.model_name,
            "settings": {name: getattr(s, name) for name in ANSWER_KEYS},
            "shard": {"index": shard.index, "count": shard.count}, "seed": seed,
            "errors": os.path.relpath(err, out.parent) if err else None,   # beside the output, wherever it moves
            "complete": False, "counts": {"ok": 0, "errors": 0}}


def write_manifest(out: Path, manifest: dict) -> None:
    """Written whole or not at all (a temporary file renamed over the old one)."""
    path = manifest_path(out)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(manifest, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as e:
        raise UsageError(f"{path}: cannot write: {e.strerror}") from None


def read_manifest(out: Path) -> dict | None:
    """The manifest of shard file `out`, None when it has none; a UsageError naming what is wrong with one that
    is not as `new_manifest` writes it."""
    path = manifest_path(out)
    if not path.exists():
        return None
    try:
        manifest = read_json(path)
    except OSError as e:
        raise UsageError(f"{path}: cannot read: {e.strerror}") from None
    except ValueError as e:
        raise UsageError(f"{path}: {e}; not a manifest of dsv4 batch --shard") from None
    if why := manifest_problem(manifest):
        raise UsageError(f"{path}: {why}; not a manifest of dsv4 batch --shard")
    manifest["settings"] = {RENAMED.get(k, k): v for k, v in manifest["settings"].items()}   # written before a rename
    return manifest


def manifest_problem(manifest) -> str | None:
    """What makes this JSON value no manifest: a field missing or of another type, a shard outside its count."""
    if not isinstance(manifest, dict):
        return "not a JSON object"
    for key, (kind, name) in MANIFEST_FIELDS.items():
        if key not in manifest:
            return f"{key}: missing"
        if not _is(manifest[key], kind):
            return f"{key}: must be {name}"
    index, count = manifest["shard"].get("index"), manifest["shard"].get("count")
    if not (_is(index, int) and _is(count, int) and 0 <= index < count):
        return 'shard: must be {"index": I, "count": N} with 0 <= I < N'
    return None


def _is(value, kind) -> bool:
    """isinstance, but a JSON true or false is no integer."""
    return isinstance(value, kind) and not (isinstance(value, bool) and kind is int)


def disagreement(a: dict, b: dict) -> str | None:
    """How manifest b's run differs from a's in what decides the answers, or None when they agree."""
    if a["input_sha256"] != b["input_sha256"]:
        return f"another input ({b['input']}, sha256 {b['input_sha256'][:12]}... against {a['input']}, " \
               f"{a['input_sha256'][:12]}...)"
    if a["model"] != b["model"]:
        return f"another model ({b['model']} against {a['model']})"
    for name in sorted(a["settings"].keys() | b["settings"].keys()):
        if a["settings"].get(name) != b["settings"].get(name):
            return f"other settings ({name} {json.dumps(b['settings'].get(name))} against " \
                   f"{json.dumps(a['settings'].get(name))})"
    if a["seed"] != b["seed"]:
        return f"another run seed ({b['seed']} against {a['seed']})"
    if a["shard"]["count"] != b["shard"]["count"]:
        return f"another shard count ({b['shard']['count']} against {a['shard']['count']})"
    return None


def check_paths(s: Settings, shard: Shard | None = None) -> tuple[Path, Path, Path | None]:
    """The input, output and errors paths (with `shard`, that shard's files), or a UsageError for any that
    cannot work."""
    if not s.input:
        raise UsageError("missing input: give IN.jsonl (or -i/--input)")
    if not s.output:
        raise UsageError("-o/--output: missing; give the file to write results to")
    src, out = Path(s.input), Path(s.output)
    err = Path(s.errors) if s.errors else None
    if shard is not None:
        out, err = shard.path(out), err and shard.path(err)
    if not src.is_file():
        raise UsageError(f"{src}: {'is a directory' if src.is_dir() else 'no such file'}")
    for flag, path in (("-o/--output", out), ("--errors", err)):
        if path is None:
            continue
        if path.is_dir():
            raise UsageError(f"{flag} {path}: is a directory; give a file path")
        if path.exists() and path.resolve() == src.resolve():
            raise UsageError(f"{flag} {path}: is the input file")
        if not s.resume and path.exists() and path.stat().st_size:
            raise UsageError(f"{flag} {path}: already has results; add --resume to continue that run (or remove it)")
    if err is not None and err.absolute() == out.absolute():
        raise UsageError("--errors: must be another file than -o/--output")
    return src, out, err
