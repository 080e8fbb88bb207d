"""`dsv4 batch --shard` and `dsv4 batch merge` end to end: shard processes on the bundled model, run at once,
killed with SIGKILL and resumed, then merged; real files and processes throughout."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
from jsonl import chat, read_jsonl, write_jsonl

from dsv4cli.batch.output import error_record
from dsv4cli.batch.requests import BadLine
from dsv4cli.batch.shards import Shard, input_digest, input_seed, manifest_path
from dsv4cli.cli import main

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def dsv4(*args, env=None):
    return subprocess.run([sys.executable, "-m", "dsv4cli", *args], capture_output=True, text=True, timeout=600,
                          env={**ENV, **(env or {})})


def start(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "dsv4cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**ENV, **(env or {})})


def answers(records):
    """custom_id -> what another run must reproduce: the record's id (its line), choices and usage, or the error."""
    return {r["custom_id"]: (r["id"], r["response"]["body"]["choices"], r["response"]["body"]["usage"])
            if r["response"] else (r["id"], r["error"]) for r in records}


def lines_written(path):
    return path.read_bytes().count(b"\n") if path.exists() else 0


# 32 requests of 10 tokens, a quarter sampled (seeded from the run seed and the custom_id), a line that is not
# JSON (shard 0 reports it) and a repeated custom_id (the shard that owns the id reports it)
ROWS = [chat(f"r{i}", f"What is {i} plus {i % 7}?", max_completion_tokens=10, ignore_eos=True,
             **({"temperature": 0.8} if i % 4 == 3 else {})) for i in range(32)]
ROWS[9:9] = ["{not json"]
ROWS.append(chat("r5", "the same id again"))
IDS = [r["custom_id"] for r in ROWS if isinstance(r, dict)][:-1]
COMMON = ("--temperature", "0", "--max-batch", "2")


def test_four_shards_two_killed_and_resumed_merge_to_the_unsharded_answers(tmp_path):
    """Shards 0..3 start at once, each given its index another way (the flag, Slurm's array variables from 1,
    Kubernetes' completion index, DSV4_SHARD); two of them are killed at a random point (after a random number of
    results, 0 = once the manifest is written) and merge refuses until they are resumed. The merged output holds
    every custom_id once, in input order, with the answers of one unsharded run with the shards' seed."""
    src = write_jsonl(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out.jsonl"
    ways = [(["--shard", "0/4"], {}),
            (["--shard", "auto"], {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_MIN": "1",
                                   "SLURM_ARRAY_TASK_COUNT": "4"}),
            (["--shard", "auto/4"], {"JOB_COMPLETION_INDEX": "2"}),
            ([], {"DSV4_SHARD": "3/4"})]
    args = ("batch", str(src), "-o", str(out), *COMMON)
    procs = [start(*args, *flags, env=env) for flags, env in ways]
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    killed = sorted(rng.sample(range(4), 2))
    owned = [sum(Shard(i, 4).owns(cid) for cid in IDS) for i in range(4)]
    points = {i: rng.randrange(owned[i]) for i in killed}
    while points:           # both watched at once: each is killed the moment it reaches its point
        for i, at in list(points.items()):
            files = Shard(i, 4).path(out)
            if manifest_path(files).exists() and lines_written(files) >= at:
                assert procs[i].poll() is None, f"shard {i} ended before it was killed (seed {seed})"
                procs[i].send_signal(signal.SIGKILL)
                del points[i]
        time.sleep(0.01)
    for i, proc in enumerate(procs):
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == (-signal.SIGKILL if i in killed else 0), stderr
    for i in range(4):
        manifest = json.loads(manifest_path(Shard(i, 4).path(out)).read_text())
        assert manifest["shard"] == {"index": i, "count": 4} and manifest["complete"] == (i not in killed)

    r = dsv4("batch", "merge", str(out))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "did not finish (rerun it with --resume)" in r.stderr and not out.exists()

    for i in killed:
        flags, env = ways[i]
        r = dsv4(*args, *flags, "--resume", env=env)
        assert r.returncode == 0, r.stderr
    r = dsv4("batch", "merge", str(out))
    assert r.returncode == 0, r.stderr
    assert "34 requests, 32 ok, 2 errors (invalid_json 1, duplicate_custom_id 1); 0 duplicated" in r.stderr

    merged = read_jsonl(out)
    assert [rec["id"] for rec in merged] == [f"batch_req_{n}" for n in range(1, len(ROWS) + 1)]   # input order
    assert sorted(rec["custom_id"] for rec in merged if rec["custom_id"]) == sorted(IDS)          # each once
    reference = tmp_path / "reference.jsonl"
    r = dsv4("batch", str(src), "-o", str(reference), *COMMON, "--seed", str(input_seed(input_digest(src))))
    assert r.returncode == 0, r.stderr
    assert answers(merged) == answers(read_jsonl(reference))


def test_shards_of_other_inputs_or_settings_do_not_merge(tmp_path):
    rows = [chat(f"a{i}", f"What is {i} plus 1?", max_completion_tokens=2) for i in range(4)]
    a = write_jsonl(tmp_path / "a.jsonl", rows)
    b = write_jsonl(tmp_path / "b.jsonl", rows[:3])
    runs = [(a, "0/2", ()), (b, "1/2", ()), (a, "1/2", ("--top-k", "5"))]
    for n, (src, shard, extra) in enumerate(runs):
        r = dsv4("batch", str(src), "-o", str(tmp_path / f"out{n}.jsonl"), *COMMON, "--shard", shard, *extra)
        assert r.returncode == 0, r.stderr
    shard0 = tmp_path / "out0.shard-0-of-2.jsonl"
    for other, says in ((tmp_path / "out1.shard-1-of-2.jsonl", "another input"),
                        (tmp_path / "out2.shard-1-of-2.jsonl", "other settings (top_k 5 against 0)"),
                        (shard0, "is given twice")):
        r = dsv4("batch", "merge", str(tmp_path / "merged.jsonl"), str(shard0), str(other))
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith("error: merge: ") and says in r.stderr and len(r.stderr.splitlines()) == 1
    assert not (tmp_path / "merged.jsonl").exists()


def test_merge_reports_failed_and_duplicated_ids_and_retries_only_the_failed(tmp_path):
    """The engine failed one request of shard 0 (its record as the runner writes it: `engine_error`), and shard
    1's file holds one of its results twice: the merge writes each id once and names both; --retry-failed runs
    that one request again (its answer the one it would have had) and nothing else."""
    rows = [chat(f"q{i}", f"What is {i} plus 2?", max_completion_tokens=6, ignore_eos=True) for i in range(6)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    for i in range(2):
        r = dsv4("batch", str(src), "-o", str(out), "--errors", str(errors), *COMMON, "--shard", f"{i}/2")
        assert r.returncode == 0, r.stderr
    r = dsv4("batch", "merge", str(out), "--errors", str(errors))
    assert r.returncode == 0 and "6 requests, 6 ok, 0 errors; 0 duplicated" in r.stderr, r.stderr
    reference = answers(read_jsonl(out))

    shard0, shard1 = Shard(0, 2).path(out), Shard(1, 2).path(out)
    first, *rest = read_jsonl(shard0)
    bad = BadLine("engine_error", "engine step failed: RuntimeError: device lost", first["custom_id"])
    bad.line = int(first["id"].removeprefix("batch_req_"))
    write_jsonl(shard0, rest)
    write_jsonl(Shard(0, 2).path(errors), [error_record(bad)])
    with open(shard1, "a") as f:
        f.write(shard1.read_text().splitlines()[0] + "\n")
    dup = read_jsonl(shard1)[0]["custom_id"]

    r = dsv4("batch", "merge", str(out), "--errors", str(errors))
    assert r.returncode == 0, r.stderr
    assert (f"5 ok, 1 errors (engine_error 1); failed by the engine: {first['custom_id']} (--retry-failed runs them "
            f"again); 1 duplicated ({dup}, written once)") in r.stderr
    assert [e["custom_id"] for e in read_jsonl(errors)] == [first["custom_id"]]
    assert sorted(rec["custom_id"] for rec in read_jsonl(out)) == sorted(set(reference) - {first["custom_id"]})

    r = dsv4("batch", "merge", str(out), "--errors", str(errors), "--retry-failed", "--top-k", "3")
    assert r.returncode == 2 and "other settings (top_k 3 against 0)" in r.stderr, r.stderr
    r = dsv4("batch", "merge", str(out), "--errors", str(errors), "--retry-failed", *COMMON)
    assert r.returncode == 0, r.stderr
    assert "merge --retry-failed done: 1 ok, 0 errors" in r.stderr and "6 ok, 0 errors" in r.stderr
    assert answers(read_jsonl(out)) == reference and errors.read_text() == ""
    assert not (tmp_path / "out.jsonl.retry").exists()

    shard1.unlink()
    r = dsv4("batch", "merge", str(out), str(shard0))
    assert r.returncode == 2 and "shard 1/2 was not given; nothing was written" in r.stderr, r.stderr


@pytest.fixture(scope="module")
def two_shards(tmp_path_factory):
    """A real run in two shards, results and errors apart: 8 requests and a line that is not JSON (line 4)."""
    d = tmp_path_factory.mktemp("shards")
    rows = [chat(f"s{i}", f"What is {i} plus 3?", max_completion_tokens=2) for i in range(8)]
    rows[3:3] = ["{not json"]
    src = write_jsonl(d / "in.jsonl", rows)
    for i in range(2):
        r = dsv4("batch", str(src), "-o", str(d / "out.jsonl"), "--errors", str(d / "errors.jsonl"), *COMMON,
                 "--shard", f"{i}/2")
        assert r.returncode == 0, r.stderr
    return d


def edit_record(path, row, change):
    records = read_jsonl(path)
    change(records[row])
    write_jsonl(path, records)


def edit_manifest(path, change):
    manifest = json.loads(manifest_path(path).read_text())
    change(manifest)
    manifest_path(path).write_text(json.dumps(manifest))


RESULTS, ERRORS = "out.shard-0-of-2.jsonl", "errors.shard-0-of-2.jsonl"
# what a hostile hand does to a shard set in folder d, and the line merge answers with (src: the input)
HOSTILE = {
    "a record without custom_id": (
        lambda d: edit_record(d / RESULTS, 0, lambda r: r.pop("custom_id")),
        "{d}/" + RESULTS + ": line 1: not a batch result line (custom_id: must be a string or null)"),
    "an error record whose line is a list": (
        lambda d: edit_record(d / ERRORS, 0, lambda r: r["error"].update(line=[4])),
        "{d}/" + ERRORS + ": line 1: not a batch result line (error.line: must be an input line's number)"),
    "an error record whose code is a list": (
        lambda d: edit_record(d / ERRORS, 0, lambda r: r["error"].update(code=["x"])),
        "{d}/" + ERRORS + ": line 1: not a batch result line (error.code: must be a string)"),
    "an error record of a line the input does not have": (
        lambda d: edit_record(d / ERRORS, 0, lambda r: r["error"].update(line=99)),
        "{d}/" + ERRORS + ": line 1: a record of input line 99, which {src} does not have (blank or past its end)"),
    "a record nested 100k deep": (
        lambda d: (d / RESULTS).write_text("[" * 100_000 + "]" * 100_000 + "\n"),
        "{d}/" + RESULTS + ": line 1: not a batch result line (nested too deep)"),
    "a manifest whose shard index is a list": (
        lambda d: edit_manifest(d / RESULTS, lambda m: m["shard"].update(index=[0])),
        "{d}/" + RESULTS + '.manifest.json: shard: must be {{"index": I, "count": N}} with 0 <= I < N'),
    "a manifest whose shard is a string": (
        lambda d: edit_manifest(d / RESULTS, lambda m: m.update(shard="0/2")),
        "{d}/" + RESULTS + ".manifest.json: shard: must be an object"),
    "a manifest whose settings are a list": (
        lambda d: edit_manifest(d / RESULTS, lambda m: m.update(settings=[])),
        "{d}/" + RESULTS + ".manifest.json: settings: must be an object"),
    "a manifest whose errors file is a list": (
        lambda d: edit_manifest(d / RESULTS, lambda m: m.update(errors=[1])),
        "{d}/" + RESULTS + ".manifest.json: errors: must be a string or null"),
    "a manifest whose errors file is not there": (
        lambda d: edit_manifest(d / RESULTS, lambda m: m.update(errors="gone.jsonl")),
        "{d}/gone.jsonl: no such file (the errors file of {d}/" + RESULTS + ", its manifest says)"),
}


def merge_refused(d, capsys) -> str:
    """The one error line `dsv4 batch merge` of the shard set in d answers with (exit code 2, nothing written)."""
    capsys.readouterr()
    assert main(["batch", "merge", str(d / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: merge: ") or err.startswith("error: " + str(d)), err
    assert len(err.splitlines()) == 1 and not (d / "out.jsonl").exists(), err
    return err.strip()


@pytest.mark.parametrize("case", HOSTILE)
def test_merge_refuses_a_hostile_shard_set_in_one_line(two_shards, tmp_path, capsys, case):
    """Each once ended the merge with an internal error: now one line naming the file and line, exit code 2, and
    nothing written. The same set untouched merges."""
    d = tmp_path / "set"
    shutil.copytree(two_shards, d)
    assert main(["batch", "merge", str(d / "out.jsonl")]) == 0, capsys.readouterr().err
    (d / "out.jsonl").unlink()
    alter, says = HOSTILE[case]
    alter(d)
    assert says.format(d=d, src=two_shards / "in.jsonl") in merge_refused(d, capsys)


def test_merge_refuses_results_whose_custom_id_is_not_their_lines(two_shards, tmp_path, capsys):
    """A shard whose results carry each other's custom_ids once merged without a word into output whose ids were
    not their input lines': each record's custom_id is checked against its input line's."""
    d = tmp_path / "set"
    shutil.copytree(two_shards, d)
    path = max((Shard(i, 2).path(d / "out.jsonl") for i in range(2)), key=lambda p: len(read_jsonl(p)))
    first, second, *rest = read_jsonl(path)
    first["custom_id"], second["custom_id"] = second["custom_id"], first["custom_id"]
    write_jsonl(path, [first, second, *rest])
    line = first["id"].removeprefix("batch_req_")
    assert merge_refused(d, capsys) == (
        f'error: merge: {path}: line 1: custom_id "{first["custom_id"]}" is not that of input line {line} of '
        f'{two_shards / "in.jsonl"} ("{second["custom_id"]}"); nothing was written')


@pytest.mark.parametrize("shard, env, says", [
    ("4/4", {}, "--shard: shard 4 of 4: the index must be in [0, 4)"),
    ("2", {}, "--shard: give I/N"),
    ("auto", {}, "neither SLURM_ARRAY_TASK_ID (a Slurm array job) nor JOB_COMPLETION_INDEX"),
    ("auto", {"JOB_COMPLETION_INDEX": "1"}, "JOB_COMPLETION_INDEX gives the index only; give the Job's completions"),
    ("auto", {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4"},
     "shard 4 (SLURM_ARRAY_TASK_ID less SLURM_ARRAY_TASK_MIN) of 4"),
    ("auto/3", {"JOB_COMPLETION_INDEX": "x"}, "JOB_COMPLETION_INDEX: must be an integer, got 'x'"),
])
def test_a_shard_that_cannot_be_is_one_line(tmp_path, monkeypatch, capsys, shard, env, says):
    """Checked before the model loads, so main() in this process is enough."""
    for name in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_COUNT", "JOB_COMPLETION_INDEX"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    assert main(["batch", str(src), "-o", str(tmp_path / "out.jsonl"), "--shard", shard]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and len(err.splitlines()) == 1
    assert not list(tmp_path.glob("out*"))


def test_every_shard_agrees_on_the_split():
    """Each id in exactly one shard, by a hash that is the same in every process (not Python's salted hash)."""
    ids = [f"request-{i}" for i in range(2000)]
    owners = [[i for i in range(7) if Shard(i, 7).owns(cid)] for cid in ids]
    assert all(len(o) == 1 for o in owners)
    sizes = [sum(o == [i] for o in owners) for i in range(7)]
    assert min(sizes) > 2000 / 7 * 0.8
    code = "from dsv4cli.batch.shards import Shard; print([[i for i in range(7) if Shard(i, 7).owns(f'request-{n}')]" \
           "[0] for n in range(50)])"
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**ENV,
                           "PYTHONHASHSEED": "123"}, check=True).stdout
    assert json.loads(there) == [o[0] for o in owners[:50]]
