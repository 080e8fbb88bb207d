"""`dsv4 batch` end to end: real subprocesses, real files, the tiny random model, greedy unless said."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from jsonl import chat, read_jsonl, write_jsonl

from dsv4cli.batch.output import ResultFile, Results
from dsv4cli.batch.requests import RequestParser
from dsv4cli.batch.runner import BatchRun
from dsv4cli.cli import main
from dsv4cli.config import resolve
from dsv4cli.loading import load_engine, sampling_params

# one torch thread: the machine's cores are shared, and two threads fighting another job are slower than one
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def dsv4(*args):
    return subprocess.run([sys.executable, "-m", "dsv4cli", *args], capture_output=True, text=True, timeout=300,
                          env=ENV)


def start(*args):
    """The CLI as a user's shell starts it: Ctrl-C's signal at its default (a harness started in the
    background hands its children SIGINT ignored, and Python then installs no handler)."""
    return subprocess.Popen([sys.executable, "-m", "dsv4cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, preexec_fn=default_sigint)


def default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def answers(records):
    """custom_id -> what a rerun must reproduce (the choices and usage; not timings or `created`)."""
    return {r["custom_id"]: (r["id"], r["response"]["body"]["choices"], r["response"]["body"]["usage"])
            for r in records if r["response"] is not None}


def wait_for_lines(path, n, proc):
    while proc.poll() is None and (not path.exists() or path.read_bytes().count(b"\n") < n):
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"


# 24 chat requests of 32 tokens (a run of a few seconds, which the tests interrupt after 2-3 answers), every other
# one sampled without a seed (a seed derived from its custom_id)
LONG = [chat(f"q{i}", f"Question {i}: say something.", max_completion_tokens=32, ignore_eos=True,
             **({"temperature": 0.8} if i % 2 else {})) for i in range(24)]


@pytest.fixture(scope="module")
def long_run(tiny_model_dir, tmp_path_factory):
    """The uninterrupted run the interrupted ones must reproduce: (input path, its records, its run seed).
    No --seed: the run draws one and keeps it beside the output."""
    tmp = tmp_path_factory.mktemp("batch")
    src = write_jsonl(tmp / "in.jsonl", LONG)
    r = dsv4("batch", str(src), "-o", str(tmp / "out.jsonl"), "--model", str(tiny_model_dir), "--max-batch", "4",
             "--temperature", "0")
    assert r.returncode == 0, r.stderr
    return src, read_jsonl(tmp / "out.jsonl"), int((tmp / "out.jsonl.seed").read_text())


def test_bad_lines_become_error_records_and_the_run_goes_on(tiny_model_dir, tmp_path):
    rows = [
        chat("ok-1", "Hello"),
        "{not json",
        "",                                                                         # blank: skipped
        "[1, 2]",
        {"method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}},
        {"custom_id": 7, "method": "POST", "url": "/v1/chat/completions", "body": {}},
        {"custom_id": "url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "get", "method": "GET", "url": "/v1/chat/completions", "body": {}},
        chat("temp", "Hi", temperature="hot"),
        chat("empty", "Hi") | {"body": {"messages": []}},
        chat("role", "Hi") | {"body": {"messages": [{"role": "robot", "content": "Hi"}]}},
        chat("long", "word " * 200),
        chat("ok-1", "Hello again"),                                                # duplicate custom_id
        chat("stream", "Hi", stream=True),
        {"id": "simple", "prompt": "Once upon a time"},
        {"id": "both", "prompt": "x", "messages": [{"role": "user", "content": "x"}]},
        chat("seed", "Hi", seed=2**70),
        chat("think", "Hi", thinking=True),
        chat("hot", "Hi", temperature=1e300),            # once passed the parser and failed the run
        chat("rep", "Hi", repetition_penalty=1e308),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    r = dsv4("batch", str(src), "-o", str(out), "--model", str(tiny_model_dir), "--max-seq-len", "128", "-n", "4",
             "--temperature", "0")
    assert r.returncode == 0, r.stderr
    records = read_jsonl(out)
    errors = {rec["error"]["line"]: rec["error"]["code"] for rec in records if rec["error"]}
    assert errors == {2: "invalid_json", 4: "invalid_request", 5: "missing_custom_id", 6: "invalid_request",
                      7: "unsupported_url", 8: "unsupported_method", 9: "invalid_parameter", 10: "invalid_messages",
                      11: "invalid_messages", 12: "prompt_too_long", 13: "duplicate_custom_id",
                      14: "unsupported_parameter", 16: "invalid_request", 17: "invalid_parameter",
                      19: "invalid_parameter", 20: "invalid_parameter"}
    assert all(rec["response"] is None and rec["error"]["message"] for rec in records if rec["error"])
    ok = {rec["custom_id"]: rec for rec in records if rec["response"]}
    assert set(ok) == {"ok-1", "simple", "think"}
    assert ok["ok-1"]["response"]["body"]["object"] == "chat.completion"
    assert ok["simple"]["response"]["body"]["object"] == "text_completion"
    assert "reasoning_content" in ok["think"]["response"]["body"]["choices"][0]["message"]
    assert "reasoning_content" not in ok["ok-1"]["response"]["body"]["choices"][0]["message"]
    assert "3 ok, 16 errors" in r.stderr.strip().splitlines()[-1]


def test_empty_and_duplicate_custom_ids_leave_each_id_once(tiny_model_dir, tmp_path):
    """An empty custom_id once stopped the run (the engine named the request itself); a duplicate's error record
    named the id a second time. A resumed run writes nothing more."""
    rows = [chat("", "Hi"), chat("a", "Hello"), {"id": "", "prompt": "x"}, chat("a", "Hello again"),
            {"id": "b", "prompt": "y"}]
    src, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    args = ("batch", str(src), "-o", str(out), "--model", str(tiny_model_dir), "-n", "3", "--temperature", "0")
    r = dsv4(*args)
    assert r.returncode == 0, r.stderr
    records = read_jsonl(out)
    assert sorted(rec["custom_id"] for rec in records if rec["custom_id"] is not None) == ["a", "b"]
    errors = {rec["error"]["line"]: (rec["error"]["code"], rec["error"]["message"]) for rec in records if rec["error"]}
    assert errors == {1: ("invalid_request", "custom_id: must not be empty"),
                      3: ("invalid_request", "custom_id: must not be empty"),
                      4: ("duplicate_custom_id", "custom_id 'a' was already used by an earlier line")}
    before = out.read_bytes()
    r = dsv4(*args, "--resume")
    assert r.returncode == 0 and "0 ok, 0 errors, 5 already done" in r.stderr, r.stderr
    assert out.read_bytes() == before


def test_same_answers_one_at_a_time_and_as_generate(tiny_model_dir, tmp_path, long_run):
    """Greedy answers do not depend on the batch: one slot gives the 4-slot run's. (The sampled ones are compared
    across runs of the same batch size, in the resume tests: with --ignore-eos all 32 tokens show, and the random
    model's float GEMMs of 1 and 4 rows differ in their last bits, which can move a draw that sits on a boundary
    of the inverse CDF.)"""
    _, reference, seed = long_run
    src = write_jsonl(tmp_path / "in.jsonl", LONG[:6])
    out = tmp_path / "out.jsonl"
    r = dsv4("batch", str(src), "-o", str(out), "--model", str(tiny_model_dir), "--max-batch", "1",
             "--temperature", "0", "--seed", str(seed))
    assert r.returncode == 0, r.stderr
    greedy = {f"q{i}" for i in range(0, 6, 2)}
    assert {k: v for k, v in answers(read_jsonl(out)).items() if k in greedy} == \
        {k: v for k, v in answers(reference).items() if k in greedy}
    r = dsv4("generate", "--model", str(tiny_model_dir), "--prompt", "Question 2: say something.", "-n", "32",
             "--ignore-eos", "--temperature", "0", "--json")
    assert r.returncode == 0, r.stderr
    [q2] = [rec["response"]["body"] for rec in reference if rec["custom_id"] == "q2"]
    assert q2["choices"][0]["message"]["content"] == json.loads(r.stdout)["text"]
    stats = q2["dsv4_stats"]
    assert q2["usage"]["completion_tokens"] == 32 and stats["draft_tokens"] == stats["drafts"] > 0


def test_unseeded_sampling_is_random(tiny_model_dir, tmp_path, long_run):
    """Without --seed a run draws its own seed: not the same samples as --seed 0, and not one run's twice."""
    _, reference, seed = long_run
    sampled = [q for q in LONG[:6] if "temperature" in q["body"]]
    src = write_jsonl(tmp_path / "in.jsonl", sampled)
    runs = []
    for n, extra in enumerate((["--seed", "0"], [])):
        out = tmp_path / f"out{n}.jsonl"
        r = dsv4("batch", str(src), "-o", str(out), "--model", str(tiny_model_dir), *extra)
        assert r.returncode == 0, r.stderr
        runs.append(answers(read_jsonl(out)))
    unseeded = {k: v for k, v in answers(reference).items() if k in runs[0]}
    assert runs[0] != unseeded and runs[1] != unseeded and runs[0] != runs[1]
    assert int((tmp_path / "out1.jsonl.seed").read_text()) not in (0, seed)


def test_kill_9_then_resume_answers_each_request_once(tiny_model_dir, tmp_path, long_run):
    src, reference, seed = long_run
    out = tmp_path / "out.jsonl"
    args = ("batch", str(src), "-o", str(out), "--model", str(tiny_model_dir), "--max-batch", "4", "--temperature", "0")
    proc = start(*args, "--seed", str(seed))   # the resumed run takes the seed kept in out.jsonl.seed
    wait_for_lines(out, 3, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = read_jsonl(out)
    assert 3 <= len(done) < len(LONG)
    with open(out, "ab") as f:                                  # what a crash in the middle of a write leaves
        f.write(json.dumps(reference[-1]).encode()[:40])

    r = dsv4(*args, "--resume")
    assert r.returncode == 0, r.stderr
    assert f"{len(done)} already done" in r.stderr
    records = read_jsonl(out)                                   # the torn line is gone: every line parses
    assert sorted(rec["custom_id"] for rec in records) == sorted(f"q{i}" for i in range(len(LONG)))
    assert answers(records) == answers(reference)

    before = out.read_bytes()
    r = dsv4(*args, "--resume")
    assert r.returncode == 0 and f"0 ok, 0 errors, {len(LONG)} already done" in r.stderr
    assert out.read_bytes() == before


def test_ctrl_c_stops_cleanly_and_resume_finishes(tiny_model_dir, tmp_path, long_run):
    src, reference, seed = long_run
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    args = ("batch", "-i", str(src), "-o", str(out), "--errors", str(errors), "--model", str(tiny_model_dir),
            "--max-batch", "4", "--temperature", "0", "--seed", str(seed))
    proc = start(*args)
    wait_for_lines(out, 2, proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "batch interrupted" in stderr and "Traceback" not in stderr
    assert out.read_bytes().endswith(b"\n") and len(read_jsonl(out)) < len(LONG)
    r = dsv4(*args, "--resume")
    assert r.returncode == 0, r.stderr
    assert answers(read_jsonl(out)) == answers(reference) and errors.read_text() == ""


def test_a_full_disk_stops_the_run_with_how_to_go_on(tiny_model_dir, tmp_path):
    """The output is /dev/full (through a link, so the seed file lands in tmp_path): every write fails with ENOSPC."""
    rows = [{"id": f"q{i}", "prompt": f"Item {i}:"} for i in range(3)]
    src, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    out.symlink_to("/dev/full")
    args = ("batch", str(src), "-o", str(out), "--model", str(tiny_model_dir), "-n", "2", "--temperature", "0")
    r = dsv4(*args)
    assert r.returncode == 1, r.stderr
    summary, error = r.stderr.strip().splitlines()
    assert summary.startswith("batch stopped: 0 ok")
    assert error == (f"error: -o/--output {out}: cannot write: no space left on device; free space and rerun with "
                     "--resume (the results so far are kept)")
    out.unlink()                                                # space again
    r = dsv4(*args, "--resume")
    assert r.returncode == 0, r.stderr
    assert sorted(rec["custom_id"] for rec in read_jsonl(out)) == ["q0", "q1", "q2"]


def test_a_filesystem_that_fills_up_loses_nothing(tiny_model_dir, tmp_path):
    """A 12 KiB tmpfs fills after a few results (a write may stop mid-line); with more room, --resume answers
    the rest, each request once. Needs the right to mount (root in a container); skipped without it."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        rows = [{"id": f"q{i}", "prompt": f"Item {i}:", "max_tokens": 8, "ignore_eos": True} for i in range(40)]
        src, out = write_jsonl(tmp_path / "in.jsonl", rows), disk / "out.jsonl"
        args = ("batch", str(src), "-o", str(out), "--model", str(tiny_model_dir), "--max-batch", "4")
        r = dsv4(*args)
        assert r.returncode == 1 and "no space left on device; free space and rerun with --resume" in r.stderr
        assert 0 < out.read_bytes().count(b"\n") < len(rows)
        subprocess.run(["mount", "-o", "remount,size=1m", str(disk)], check=True)
        r = dsv4(*args, "--resume")
        assert r.returncode == 0, r.stderr
        assert sorted(rec["custom_id"] for rec in read_jsonl(out)) == sorted(f"q{i}" for i in range(40))
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_second_run_on_the_same_files_is_refused(tiny_model_dir, tmp_path):
    """Both runs --resume: without the lock each would answer every request the other had not written yet."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"Item {i}:", "max_tokens": 16, "ignore_eos": True}
                                              for i in range(100)])
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    args = ("batch", str(src), "--model", str(tiny_model_dir), "--max-batch", "2", "--resume", "--mtp", "0")
    first = start(*args, "-o", str(out), "--errors", str(errors))
    wait_for_lines(out, 1, first)
    for files in (["-o", str(out)], ["-o", str(tmp_path / "other.jsonl"), "--errors", str(errors)]):
        r = dsv4(*args, *files)
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith("error: ") and len(r.stderr.splitlines()) == 1
        assert "another dsv4 batch run is writing this file" in r.stderr
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr
    assert sorted(int(rec["custom_id"]) for rec in read_jsonl(out)) == list(range(100))


def test_config_file_run_with_errors_file(tiny_model_dir, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [chat("a", "Hi"), "oops", {"id": "b", "prompt": "Hello"}])
    (tmp_path / "batch.toml").write_text(f"""mode = "batch"
[model]
model = "{tiny_model_dir}"
max_batch = 2
[sampling]
temperature = 0.0
max_tokens = 4
[batch]
input = "in.jsonl"
output = "runs/out.jsonl"
errors = "runs/errors.jsonl"
resume = true
""")
    r = dsv4("run", str(tmp_path / "batch.toml"))
    assert r.returncode == 0, r.stderr
    assert sorted(rec["custom_id"] for rec in read_jsonl(tmp_path / "runs/out.jsonl")) == ["a", "b"]
    [bad] = read_jsonl(tmp_path / "runs/errors.jsonl")
    assert bad["error"]["line"] == 2 and bad["error"]["code"] == "invalid_json" and bad["response"] is None


def test_unusable_arguments_exit_2(tmp_path, capsys):
    """Checked before the model loads, so main() in this process is enough."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    done = write_jsonl(tmp_path / "done.jsonl", [{"id": "batch_req_1"}])
    for args, says in (([str(tmp_path / "missing.jsonl"), "-o", "o.jsonl"], "no such file"),
                       ([str(src), "-o", str(tmp_path)], "is a directory"),
                       ([str(src)], "-o/--output: missing"),
                       ([str(src), "-i", str(src), "-o", "o.jsonl"], "given twice"),
                       ([str(src), "-o", str(done)], "add --resume")):     # nothing gets overwritten by accident
        assert main(["batch", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and len(err.splitlines()) == 1


def test_large_input_keeps_a_bounded_window(tiny_model_dir, tmp_path):
    """300 requests through the runner in this process, to read its in-flight counter."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"Item {i}:", "max_tokens": 2} for i in range(300)])
    s, _ = resolve(None, {"model": str(tiny_model_dir), "temperature": 0.0, "max_batch": 4})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = load_engine(s, "batch")
        out = ResultFile(tmp_path / "out.jsonl")
        run = BatchRun(engine, RequestParser(engine.tok, sampling_params(s), 0, s.max_seq_len),
                       Results(out, out, set(), set()), "tiny")
        with open(src, "rb") as lines:
            run.run(lines)
        out.close()
    finally:
        torch.set_num_threads(threads)
    assert run.ok == 300 and run.peak_in_flight == 2 * 4 and not run.in_flight
    assert sorted(int(rec["custom_id"]) for rec in read_jsonl(tmp_path / "out.jsonl")) == list(range(300))


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def in_process_run(tiny_model_dir, tmp_path, rows, **settings):
    """The runner in this process (to reach the engine's model), on `rows`; returns (records, engine, parser)."""
    tmp_path.mkdir(exist_ok=True)
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    s, _ = resolve(None, {"model": str(tiny_model_dir), "temperature": 0.0, "max_batch": 3, **settings})
    engine = load_engine(s, "batch")
    out = ResultFile(tmp_path / "out.jsonl")
    run = BatchRun(engine, RequestParser(engine.tok, sampling_params(s), 0, s.max_seq_len),
                   Results(out, out, set(), set()), "tiny")
    with open(src, "rb") as lines:
        run.run(lines)
    out.close()
    return read_jsonl(tmp_path / "out.jsonl"), engine, RequestParser(engine.tok, sampling_params(s), 0, s.max_seq_len)


@torch.no_grad()
def test_logprobs_validate_as_openai_types_and_match_the_model(tiny_model_dir, tmp_path):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    harmless = {"model": "x", "user": "u", "metadata": {"a": "b"}, "store": False, "stream_options": None,
                "parallel_tool_calls": True, "response_format": {"type": "text"}}
    rows = [chat("chat", "Hello there", max_completion_tokens=8, logprobs=True, top_logprobs=3, **harmless),
            chat("sampled", "Hello there", max_completion_tokens=8, logprobs=True, temperature=0.8, seed=1,
                 logit_bias={"40": 3}),
            chat("plain", "Hello there", max_completion_tokens=8),
            {"custom_id": "text", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": "Once upon", "max_tokens": 8, "logprobs": 2}}]
    for mtp in (0, 2):
        records, engine, parser = in_process_run(tiny_model_dir, tmp_path / f"k{mtp}", rows, drafts=mtp)
        assert not [r["error"] for r in records if r["error"]]
        bodies = {r["custom_id"]: r["response"]["body"] for r in records}
        for cid in ("chat", "sampled", "plain"):
            ChatCompletion.model_validate(bodies[cid])
        Completion.model_validate(bodies["text"])
        assert bodies["plain"]["choices"][0]["logprobs"] is None
        for n, row in enumerate(rows, 1):
            choice = bodies[row["custom_id"]]["choices"][0]
            req = parser.parse(n, json.dumps(row).encode())
            if row["custom_id"] == "plain":
                continue
            if row["custom_id"] == "text":
                logprobs, tops = choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]
                assert all(len(t) <= 2 for t in tops) and "".join(choice["logprobs"]["tokens"]) == choice["text"]
            else:
                content = choice["logprobs"]["content"]
                logprobs, tops = [c["logprob"] for c in content], [c["top_logprobs"] for c in content]
                assert all(len(t) == req.params.logprobs for t in tops)
            # the reply's tokens again (greedy and seeded: the same), scored by the full forward pass
            out = engine.generate([req.prompt_ids], req.params)[0].output_ids
            logits = engine.model(torch.tensor([req.prompt_ids + out]))[0, len(req.prompt_ids) - 1: -1]
            for t, b in req.params.logit_bias.items():
                logits[:, t] += b
            ref = (logits / (req.params.temperature or 1.0)).log_softmax(-1)
            want = ref.gather(-1, torch.tensor(out)[:, None])[:, 0]
            assert len(logprobs) == len(out)
            assert (torch.tensor(logprobs) - want).abs().max() <= 1e-4, (mtp, row["custom_id"])


def test_field_policy_refuses_by_name_and_the_run_goes_on(tiny_model_dir, tmp_path):
    rows = [chat("ok", "Hi", max_completion_tokens=2),
            chat("schema", "Hi", response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            chat("n2", "Hi", n=2),
            chat("audio", "Hi", audio={"voice": "alloy", "format": "wav"}),
            chat("unknown", "Hi", frobnicate=1),
            chat("required", "Hi", tool_choice="required"),
            chat("named", "Hi", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}),
            chat("top21", "Hi", logprobs=True, top_logprobs=21),
            chat("toponly", "Hi", top_logprobs=2),
            chat("stops", "Hi", stop=["a", "b", "c", "d", "e"]),
            chat("bias", "Hi", logit_bias={"999999": 1}),
            chat("badtool", "Hi", tools=[{"name": "get_weather"}]),
            {"custom_id": "outer", "method": "POST", "url": "/v1/chat/completions", "extra": 1,
             "body": {"messages": [{"role": "user", "content": "Hi"}]}},
            {"id": "simple-unknown", "prompt": "x", "temprature": 0.5},
            chat("ok2", "Hi", max_completion_tokens=2, stop=["a", "b", "c", "d"]),
            chat("choice", "Hi", max_completion_tokens=8, guided_choice=["yes", "no"]),
            chat("twice", "Hi", guided_json={"type": "object"}, structured_outputs={"regex": "a+"}),
            chat("min", "Hi", min_tokens=9, max_tokens=4)]
    records, _, _ = in_process_run(tiny_model_dir, tmp_path, rows)
    errors = {r["custom_id"]: r["error"]["message"] for r in records if r["error"]}
    assert sorted(r["custom_id"] for r in records if r["response"]) == ["choice", "ok", "ok2"]
    choice = next(r for r in records if r["custom_id"] == "choice")["response"]["body"]["choices"][0]
    assert choice["message"]["content"] in ("yes", "no")
    names = {"schema": "body.response_format.json_schema.schema", "n2": "body.n", "audio": "body.audio",
             "unknown": "body.frobnicate",
             "required": "body.tool_choice", "named": "body.tool_choice", "top21": "body.top_logprobs",
             "toponly": "body.top_logprobs", "stops": "body.stop", "bias": "body.logit_bias", "badtool": "body.tools",
             "outer": "extra", "simple-unknown": "temprature", "twice": "body.structured_outputs.regex",
             "min": "body.min_tokens"}
    assert set(errors) == set(names)
    for cid, name in names.items():
        assert errors[cid].startswith(name + ":") and "\n" not in errors[cid], errors[cid]
    assert "needs tools" in errors["required"] and "not one of the offered tools" in errors["named"]
    assert errors["simple-unknown"].endswith("did you mean temperature?") and "at most max_tokens" in errors["min"]


def test_tools_are_rendered_and_tool_calls_returned_in_openai_form(tiny_model_dir):
    from openai.types.chat import ChatCompletion

    from dsv4cli.batch.output import result_record
    from dsv4cli.encoding import DSML, TOOL_CALLS_END, TOOL_CALLS_OPENING
    from dsv4cli.engine import SamplingParams, Sequence
    from dsv4cli.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    parser = RequestParser(tok, SamplingParams(), 0, 4096)
    ask = chat("t", "Weather in Paris?", tools=[WEATHER])
    req = parser.parse(1, json.dumps(ask).encode())
    assert '"name": "get_weather"' in tok.decode(req.prompt_ids)
    none = parser.parse(2, json.dumps(chat("n", "Weather in Paris?", tools=[WEATHER], tool_choice="none")).encode())
    assert "get_weather" not in tok.decode(none.prompt_ids)
    # what the model writes when it calls the tool (the tiny random model would not)
    text = (f'I will look.{TOOL_CALLS_OPENING}\n<{DSML}invoke name="get_weather">\n'
            f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n</{DSML}invoke>\n{TOOL_CALLS_END}')
    seq = Sequence("t", req.prompt_ids, req.params, 0, output_ids=tok.encode(text), text=text, finish_reason="stop")
    body = result_record(req, seq, "tiny", tok)["response"]["body"]
    completion = ChatCompletion.model_validate(body)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will look."
    [call] = choice.message.tool_calls
    assert call.id == "call_1_0" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # two calls in one turn: both returned, or the first alone with parallel_tool_calls false
    invoke = text[text.index(f"<{DSML}invoke"): text.index(f"\n{TOOL_CALLS_END}")]
    two = text.replace(invoke, invoke + "\n" + invoke.replace("Paris", "Rome"))
    for parallel, cities in ((True, ["Paris", "Rome"]), (False, ["Paris"])):
        ask = chat(f"p{parallel}", "Weather?", tools=[WEATHER], parallel_tool_calls=parallel)
        req2 = parser.parse(4, json.dumps(ask).encode())
        seq = Sequence("p", req2.prompt_ids, req2.params, 0, output_ids=tok.encode(two), text=two, finish_reason="stop")
        calls = ChatCompletion.model_validate(result_record(req2, seq, "tiny", tok)["response"]["body"]).choices[0]
        assert [json.loads(c.function.arguments)["city"] for c in calls.message.tool_calls] == cities
    # the call and its result come back as later turns
    follow = {"custom_id": "f", "method": "POST", "url": "/v1/chat/completions",
              "body": {"tools": [WEATHER], "messages": [
                  {"role": "user", "content": "Weather in Paris?"},
                  body["choices"][0]["message"],
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]}}
    prompt = tok.decode(parser.parse(3, json.dumps(follow).encode()).prompt_ids)
    assert "<tool_result>sunny, 21 C</tool_result>" in prompt and 'invoke name="get_weather"' in prompt


def test_a_completion_prompt_of_token_ids(tmp_path):
    """A completions line whose prompt is token ids continues them as they are (the bundled model, greedy):
    BOS + the tokens of a text answers as the text does; an id past the vocabulary is that line's error."""
    from dsv4cli.config import BUNDLED_MODEL_DIR
    from dsv4cli.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    ids = [tok.bos_id, *tok.encode("Once upon a time")]
    rows = [{"custom_id": cid, "method": "POST", "url": "/v1/completions",
             "body": {"prompt": prompt, "max_tokens": 16, "temperature": 0}}
            for cid, prompt in (("text", "Once upon a time"), ("ids", ids), ("bad", [tok.vocab_size]))]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = dsv4("batch", str(src), "-o", str(tmp_path / "out.jsonl"))
    assert r.returncode == 0, r.stderr
    records = {rec["custom_id"]: rec for rec in read_jsonl(tmp_path / "out.jsonl")}
    text = [records[c]["response"]["body"]["choices"][0]["text"] for c in ("text", "ids")]
    assert text[0] == text[1] and text[0]
    assert records["bad"]["error"]["code"] == "invalid_prompt" and f"{tok.vocab_size} is not a token id" in \
        records["bad"]["error"]["message"]
    assert "drafter DSpark auto (block 5)" in r.stderr and "mean length" in r.stderr
    assert r.stderr.count("accept ") == 1           # the summary says the acceptance once


def test_echo_with_logprobs_scores_the_prompt_in_a_batch(tmp_path):
    """A completions line with echo and logprobs (max_tokens 0: scored only) answers with the prompt's text
    and tokens, their logprobs (the first null, as OpenAI's API and vLLM send it, though the openai package's
    types say float) and alternatives; a list of several prompts is that line's error (one line, one request)."""
    from dsv4cli.config import BUNDLED_MODEL_DIR
    from dsv4cli.model import load_model
    from dsv4cli.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    rows = [{"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body} for cid, body in (
        ("scored", {"prompt": "Once upon a time", "max_tokens": 0, "echo": True, "logprobs": 2}),
        ("two", {"prompt": ["a", "b"], "max_tokens": 1, "echo": True}))]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = dsv4("batch", str(src), "-o", str(tmp_path / "out.jsonl"), "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    records = {rec["custom_id"]: rec for rec in read_jsonl(tmp_path / "out.jsonl")}
    body = records["scored"]["response"]["body"]
    choice, ids = body["choices"][0], [tok.bos_id, *tok.encode("Once upon a time")]
    assert choice["text"] == "Once upon a time" and body["usage"]["completion_tokens"] == 0
    assert choice["logprobs"]["tokens"] == [tok.decode([t]) for t in ids]
    lp = load_model(BUNDLED_MODEL_DIR, "cpu", torch.float32).forward(torch.tensor([ids])).log_softmax(-1)[0]
    want = lp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = choice["logprobs"]["token_logprobs"]
    assert got[0] is None and choice["logprobs"]["top_logprobs"][0] is None
    assert (torch.tensor(got[1:]) - want).abs().max() <= 1e-4
    assert all(len(top) == 2 for top in choice["logprobs"]["top_logprobs"][1:])
    assert records["two"]["error"]["code"] == "unsupported_parameter" and "prompt" in records["two"]["error"]["message"]
