"""OpenAI's Files and Batches API on `dsv4 serve --batch-dir`: the real `openai` SDK against real server processes on
the bundled model, a server killed with SIGKILL mid-batch and started again, answers checked against `dsv4 batch`."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx2 as httpx
import openai
import pytest
from jsonl import chat, write_jsonl
from test_serve import Server

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def parse_jsonl(text):
    return [json.loads(line) for line in text.splitlines()]


def answers(records):
    """custom_id -> what another run must reproduce (not timings, `created` or completion ids)."""
    return {r["custom_id"]: (r["id"], r["response"]["body"]["choices"], r["response"]["body"]["usage"])
            for r in records if r["response"] is not None}


def batch_reference(tmp_path, src, seed, *args):
    """`dsv4 batch` on the same input with the batch's seed: the answers the API's batch must give."""
    out = tmp_path / "reference.jsonl"
    r = subprocess.run([sys.executable, "-m", "dsv4cli", "batch", str(src), "-o", str(out), "--temperature", "0",
                        "--seed", str(seed), *args], capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, r.stderr
    return answers(parse_jsonl(out.read_text()))


def wait_for(client, batch_id, statuses=("completed", "failed", "cancelled"), timeout=300):
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in statuses:
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    return batch


def stored(batch_dir, batch_id):
    """The batch as the server keeps it (its seed and the ids of its result files, fixed when it was created)."""
    return json.loads((batch_dir / "batches" / f"{batch_id}.json").read_text())


# 20 chat requests (every fourth sampled, seeded by the batch's seed and the custom_id), a line that is not JSON and
# a completion
ROWS = [chat(f"c{i}", f"What is {i} plus {i % 5}?", max_completion_tokens=8,
             **({"temperature": 0.7} if i % 4 == 1 else {})) for i in range(20)]
ROWS += ["{not json", {"custom_id": "p", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": "Once upon a time", "max_tokens": 8}}]


def batch_under_way(server, src, store):
    """A batch of `src` on `server` and its result file, once 3 results are written there (the server still
    running)."""
    client = server.client(key=None)
    batch = client.batches.create(input_file_id=client.files.create(file=src, purpose="batch").id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    output = store / "files" / stored(store, batch.id)["dsv4"]["output"]
    while not output.exists() or output.read_bytes().count(b"\n") < 3:
        assert server.proc.poll() is None
        time.sleep(0.05)
    return batch, output


def resumed(server, batch_id, rows):
    """The records of a batch a restarted `server` finished: completed, each of `rows` answered once."""
    try:
        client = server.client(key=None)
        batch = wait_for(client, batch_id)
        assert batch.status == "completed" and batch.request_counts.completed == len(rows), batch
        records = parse_jsonl(client.files.content(batch.output_file_id).text)
    finally:
        server.stop()
    assert sorted(r["custom_id"] for r in records) == sorted(r["custom_id"] for r in rows)      # each once
    return records


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batches")
    s = Server(tmp, "--temperature", "0", "--batch-dir", str(tmp / "store"), "--max-batch", "4")
    s.dir = tmp / "store"
    yield s
    s.stop()


def test_the_openai_sdk_round_trip(served, tmp_path):
    """files.create -> batches.create -> poll -> files.content: every request once, in the output or the error
    file, answered as `dsv4 batch` answers it; the batch is listed; an online request is served meanwhile."""
    client = served.client(key=None)
    src = write_jsonl(tmp_path / "in.jsonl", ROWS)
    uploaded = client.files.create(file=src, purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == src.stat().st_size and uploaded.filename == "in.jsonl"
    assert client.files.content(uploaded.id).content == src.read_bytes()
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "test"})
    assert batch.status == "in_progress" and batch.request_counts.total == len(ROWS)
    online = client.chat.completions.create(model="dsv4-tiny", messages=[{"role": "user", "content": "Hello!"}],
                                            max_tokens=4)
    assert online.choices[0].message.content
    batch = wait_for(client, batch.id)
    assert batch.status == "completed" and batch.metadata == {"job": "test"}, batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(ROWS) - 1, 1)
    output = parse_jsonl(client.files.content(batch.output_file_id).text)
    [error] = parse_jsonl(client.files.content(batch.error_file_id).text)
    assert error["error"]["code"] == "invalid_json" and error["error"]["line"] == len(ROWS) - 1
    assert sorted(r["custom_id"] for r in output) == sorted(r["custom_id"] for r in ROWS if isinstance(r, dict))
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert answers(output) == batch_reference(tmp_path, src, stored(served.dir, batch.id)["dsv4"]["seed"])
    assert batch.id in [b.id for b in client.batches.list(limit=5)]


def test_a_server_killed_mid_batch_finishes_it_after_a_restart(tmp_path):
    """SIGKILL once some results are written; a new server on the same directory resumes the batch: every id once,
    each answer the one an uninterrupted run gives."""
    rows = [chat(f"k{i}", f"Question {i}: say something.", max_completion_tokens=12, ignore_eos=True,
                 **({"temperature": 0.8} if i % 3 == 0 else {})) for i in range(24)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    store, args = tmp_path / "store", ("--temperature", "0", "--batch-dir", str(tmp_path / "store"), "--max-batch", "2")
    server = Server(tmp_path, *args)
    try:
        batch, output = batch_under_way(server, src, store)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
    finally:
        server.stop()
    written = output.read_bytes().count(b"\n")
    assert 3 <= written < len(rows) and stored(store, batch.id)["status"] == "in_progress"

    records = resumed(Server(tmp_path, *args), batch.id, rows)
    assert answers(records) == batch_reference(tmp_path, src, stored(store, batch.id)["dsv4"]["seed"],
                                               "--max-batch", "2")


def test_cancel_keeps_what_was_answered_each_once(served, tmp_path):
    client = served.client(key=None)
    rows = [chat(f"x{i}", "Tell me a story.", max_completion_tokens=64, ignore_eos=True) for i in range(40)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    batch = client.batches.create(input_file_id=client.files.create(file=src, purpose="batch").id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    while client.batches.retrieve(batch.id).request_counts.completed < 2:
        time.sleep(0.05)
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    batch = wait_for(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at and 2 <= batch.request_counts.completed < len(rows)
    ids = [r["custom_id"] for r in parse_jsonl(client.files.content(batch.output_file_id).text)]
    assert len(ids) == len(set(ids)) == batch.request_counts.completed
    assert served.health()["running"] == 0          # its requests left the engine
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.cancel(batch.id)
    assert "cannot cancel a batch whose status is cancelled" in e.value.body["message"]


def test_bad_uploads_and_batches_are_refused_naming_the_problem(served, tmp_path):
    client = served.client(key=None)
    src = write_jsonl(tmp_path / "in.jsonl", ROWS[:2])
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=src, purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    uploaded = client.files.create(file=src, purpose="batch")
    bad = "file-nope"
    for kwargs, param in (({"endpoint": "/v1/embeddings"}, "endpoint"), ({"input_file_id": bad}, "input_file_id"),
                          ({"extra_body": {"priority": 1}}, "priority"),
                          ({"metadata": {"k": "v" * 513}}, "metadata"), ({"metadata": {"k" * 65: "v"}}, "metadata"),
                          ({"input_file_id": [uploaded.id]}, "input_file_id"), ({"endpoint": [[[]]]}, "endpoint")):
        with pytest.raises(openai.BadRequestError) as e:
            client.batches.create(**{"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions",
                                     "completion_window": "24h", **kwargs})
        assert e.value.body["param"] == param
    for call in (lambda: client.files.content("file-nope"), lambda: client.batches.retrieve("batch_nope")):
        with pytest.raises(openai.NotFoundError):
            call()
    # a web page may post a form to any address unasked: an upload carrying a browser's Origin is refused
    r = httpx.post(served.url + "/v1/files", data={"purpose": "batch"}, files={"file": ("a.jsonl", b"{}\n")},
                   headers={"origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"


def test_without_the_flag_there_is_no_batch_api_and_one_server_per_directory(served, tmp_path):
    r = subprocess.run([sys.executable, "-m", "dsv4cli", "serve", "--port", "0", "--batch-dir", str(served.dir)],
                       capture_output=True, text=True, timeout=60, env=ENV)
    assert r.returncode == 2 and r.stderr.strip() == f"error: --batch-dir {served.dir}: another dsv4 serve uses it"
    plain = Server(tmp_path, "--max-file-bytes", "10")
    try:
        assert httpx.get(plain.url + "/v1/batches").status_code == 404
    finally:
        plain.stop()
    small = Server(tmp_path, "--batch-dir", str(tmp_path / "small"), "--max-file-bytes", "100")
    try:
        r = httpx.post(small.url + "/v1/files", data={"purpose": "batch"}, files={"file": ("a.jsonl", b"x" * 200)})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    finally:
        small.stop()


def test_sigterm_mid_batch_stops_cleanly_and_the_batch_resumes_once(tmp_path):
    """SIGTERM once some results are written: the server stops with exit 0 (it closes each result file once), and a
    new server on the same directory finishes the batch, every id once."""
    rows = [chat(f"t{i}", f"Question {i}: say something.", max_completion_tokens=12, ignore_eos=True)
            for i in range(24)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    store, args = tmp_path / "store", ("--temperature", "0", "--batch-dir", str(tmp_path / "store"), "--max-batch", "2")
    (tmp_path / "first").mkdir()
    server = Server(tmp_path / "first", *args)
    try:
        batch, output = batch_under_way(server, src, store)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.log.read_text()
    finally:
        server.stop()
    log = server.log.read_text()
    assert "internal error" not in log and "Traceback" not in log and "dsv4 serve: stopped" in log, log
    assert output.read_bytes().count(b"\n") < len(rows) and stored(store, batch.id)["status"] == "in_progress"

    resumed(Server(tmp_path, *args), batch.id, rows)


@pytest.fixture(scope="module")
def kept_store(tmp_path_factory):
    """A directory a stopped server left: two completed batches (`batches`) of one uploaded file (`file`)."""
    tmp = tmp_path_factory.mktemp("kept")
    server = Server(tmp, "--temperature", "0", "--batch-dir", str(tmp / "store"))
    try:
        client = server.client(key=None)
        file = client.files.create(file=write_jsonl(tmp / "in.jsonl", ROWS[:2]), purpose="batch")
        batches = [wait_for(client, client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                                          completion_window="24h").id) for _ in range(2)]
    finally:
        server.stop()
    return tmp / "store", file.id, [b.id for b in batches]


def damage(store, batch_id, kind):
    """Damage `store` one way (the batch `batch_id` is one of its two); the damaged entry and what it reads (the
    temporaries left, for "cut short")."""
    path = store / "batches" / f"{batch_id}.json"
    if kind == "cut":
        path.write_bytes(path.read_bytes()[:40])
    elif kind == "emptied":
        path.write_bytes(b"")
    elif kind == "odd":
        path.write_text(json.dumps(stored(store, batch_id) | {"created_at": "yesterday"}))
    elif kind == "stray":
        path = store / "files" / "notes.json"
        path.write_text("my notes\n")
    elif kind == "cut short":       # a server killed while it took an upload in, and while it stored a batch
        for path in (store / "files" / ".upload.k9x2", store / "batches" / f".{batch_id}.json.q7.tmp"):
            path.write_bytes(b"{}\n" * 1000)
        return [f"batches/.{batch_id}.json.q7.tmp", "files/.upload.k9x2"]        # in the order they are named
    else:   # an unfinished batch whose input was removed by hand (its file and file object)
        other = stored(store, batch_id) | {"id": "batch_gone", "input_file_id": "file-gone", "status": "in_progress",
                                           "dsv4": {"output": "file-out", "errors": "file-err", "seed": 1}}
        (store / "batches" / "batch_gone.json").write_text(json.dumps(other))
        return None
    return f"{path.parent.name}/{path.name}"


@pytest.mark.parametrize("kind", ["cut", "emptied", "odd", "stray", "input removed", "cut short"])
def test_a_damaged_batch_dir_starts_naming_what_it_skips(kept_store, tmp_path, kind):
    """One damaged entry is skipped and named in one line, or fails its batch alone; what a killed server was
    writing is removed, each named; the server starts, the healthy batch and file are served and a new batch
    runs."""
    store = tmp_path / "store"
    shutil.copytree(kept_store[0], store)
    file_id, (healthy, damaged) = kept_store[1], kept_store[2]
    skipped = damage(store, damaged, kind)
    server = Server(tmp_path, "--temperature", "0", "--batch-dir", str(store))
    try:
        client = server.client(key=None)
        assert client.batches.retrieve(healthy).status == "completed"
        assert client.files.retrieve(file_id).purpose == "batch"
        batch = wait_for(client, client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                                       completion_window="24h").id)
        assert batch.status == "completed", batch
        warnings = [line for line in server.log.read_text().splitlines() if line.startswith("warning: ")]
        if isinstance(skipped, list):
            assert warnings == [f"warning: --batch-dir {store}: removed {name}, a write cut short" for name in skipped]
            assert not any((store / name).exists() for name in skipped)
        elif skipped is None:
            gone = client.batches.retrieve("batch_gone")
            assert gone.status == "failed" and "file-gone: no such file or directory" in gone.errors.data[0].message
            assert stored(store, "batch_gone")["status"] == "failed"
            assert warnings == [f"warning: --batch-dir {store}: batch batch_gone failed: {gone.errors.data[0].message}"]
        else:
            assert len(warnings) == 1 and f"--batch-dir {store}: skipped {skipped}: " in warnings[0], warnings
    finally:
        server.stop()


def test_a_full_disk_is_507_fails_only_the_batch_and_loses_nothing(tmp_path):
    """The batch directory on a 64 KiB tmpfs. An upload that does not fit is refused with 507 naming the directory; a
    batch whose results fill the disk fails alone (the server goes on) and a new batch is refused with 507; no
    temporary is left to keep the disk full. With more room, the next start finishes the batch, every id once. Needs
    the right to mount (root in a container); skipped without it."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    rows = [chat(f"f{i}", f"Item {i}:", max_completion_tokens=8, ignore_eos=True) for i in range(120)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    args = ("--temperature", "0", "--batch-dir", str(disk), "--max-batch", "4")

    def refused(r):
        assert r.status_code == 507, r.text
        assert r.json()["error"]["type"] == "server_error" and r.json()["error"]["code"] == "insufficient_storage"
        assert str(disk) in r.json()["error"]["message"]
        assert list(disk.rglob(".*")) == []         # no temporary left

    try:
        server = Server(tmp_path, *args)
        try:
            client = server.client(key=None)
            refused(httpx.post(server.url + "/v1/files", data={"purpose": "batch"},
                               files={"file": ("big.jsonl", b"{}\n" * 50_000)}, timeout=60))
            file_id = client.files.create(file=src, purpose="batch").id
            batch = wait_for(client, client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                                           completion_window="24h").id)
            message = batch.errors.data[0].message          # in the API's words, not `dsv4 batch`'s flags
            assert batch.status == "failed" and "no space left on device" in message, batch
            assert message.startswith("result file ") and "restart dsv4 serve, which resumes the batch" in message
            refused(server.post("/v1/batches", {"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                "completion_window": "24h"}, key=None))
            assert server.proc.poll() is None
        finally:
            server.stop()
        subprocess.run(["mount", "-o", "remount,size=1m", str(disk)], check=True)
        server = Server(tmp_path, *args)
        try:
            client = server.client(key=None)
            batch = wait_for(client, batch.id)
            assert batch.status == "completed" and batch.request_counts.completed == len(rows), batch
            records = parse_jsonl(client.files.content(batch.output_file_id).text)
        finally:
            server.stop()
        assert sorted(r["custom_id"] for r in records) == sorted(r["custom_id"] for r in rows)      # each once
    finally:
        subprocess.run(["umount", str(disk)], check=False)
