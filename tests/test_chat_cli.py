"""`dsv4 chat` end to end: in a pseudo-terminal (pexpect) and piped."""
import io
import json
import os
import re
import signal
import subprocess
import sys

import pexpect
import torch
from terminal import RewrappingTerminal

from dsv4cli.chat.tui import printable
from dsv4cli.config import BUNDLED_MODEL_DIR as BUNDLED

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def chat_env(home) -> dict:
    # one torch thread: the tiny model is far faster that way on a loaded machine
    return dict(os.environ, TERM="xterm-256color", COLUMNS="120", LINES="40", HOME=str(home), OMP_NUM_THREADS="1")


def spawn_chat(model_dir, home, *args) -> pexpect.spawn:
    """The chat in a terminal, Ctrl-C's signal at its default as a user's shell leaves it (a harness started
    in the background hands its children SIGINT ignored)."""
    child = pexpect.spawn(sys.executable, ["-m", "dsv4cli", "chat", "--model", str(model_dir), "--temperature", "0",
                                           *args], env=chat_env(home), dimensions=(40, 120), encoding="utf-8",
                          timeout=60, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    child.expect("Ctrl-D quits")
    child.expect(">>> ")
    return child


def command(child, line: str, reply: str) -> None:
    child.sendline(line)
    child.expect(reply)
    child.expect(">>> ")


def test_chat_in_a_terminal(tiny_model_dir, tmp_path):
    child = spawn_chat(tiny_model_dir, tmp_path, "--max-tokens", "2000", "--ignore-eos", "--mtp", "2")
    child.sendline("Tell me a long story")
    child.expect("TPOT")          # the live status bar, while tokens stream
    child.expect("accept")
    child.sendcontrol("c")
    child.expect("interrupted")   # the summary line of the stopped reply
    child.expect(">>> ")

    command(child, "/set max_tokens 3", "max_tokens = 3")
    command(child, "Hello again", r"3 tokens · prompt \d+")   # the chat goes on
    command(child, "/set temperature 0.5", "temperature = 0.5")
    command(child, "/show settings", r"temperature[^\r\n]*0\.5")
    child.sendline("/set temperature -1")
    child.expect_exact("error: /set temperature: must be in [0, 100], got -1.0")
    child.expect(">>> ")
    assert ANSI.sub("", child.before).strip() == ""            # one line, then the prompt again

    path = tmp_path / "chat.json"
    command(child, f"/save {path}", "saved 4 messages")
    data = json.loads(path.read_text())
    messages = data["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[0]["content"] == "Tell me a long story" and messages[1]["interrupted"] is True
    assert data["settings"]["temperature"] == 0.5 and data["settings"]["max_tokens"] == 3
    command(child, "/clear", "conversation cleared")
    command(child, f"/load {path}", "loaded 4 messages")
    command(child, "/show prompt", "Hello again")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_a_reply_streaming_while_the_terminal_narrows_is_shown_once(tmp_path):
    """The terminal rewraps the live view's lines onto more rows when it narrows; the next frame erases them
    all, so the reply is not left above itself. No COLUMNS or LINES: rich reads the terminal's size."""
    env = {k: v for k, v in chat_env(tmp_path).items() if k not in ("COLUMNS", "LINES")}
    child = pexpect.spawn(sys.executable, ["-m", "dsv4cli", "chat", "--model", str(BUNDLED), "--temperature", "0",
                                           "--max-tokens", "2000", "--ignore-eos", "--mtp", "0"], env=env,
                          dimensions=(40, 120), encoding="utf-8", timeout=60)
    child.logfile_read = written = io.StringIO()
    child.expect(">>> ")
    child.sendline("Tell me a long story")
    child.expect("TPOT")
    child.expect(pexpect.TIMEOUT, timeout=1)          # some lines of the reply at 120 columns
    at_resize = len(written.getvalue())
    child.setwinsize(40, 60)
    child.expect(pexpect.TIMEOUT, timeout=1)
    child.sendcontrol("c")
    child.expect("interrupted")
    child.expect(">>> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    term = RewrappingTerminal(120, 40)
    term.feed(written.getvalue()[:at_resize])
    term.resize(60)
    term.feed(written.getvalue()[at_resize:])
    lines = term.lines()
    prompt = next(i for i, line in enumerate(lines) if line.endswith("Tell me a long story"))
    start = next(line for line in lines[prompt + 1:] if line.strip())[:20]
    assert len(start) == 20 and sum(start in line for line in lines) == 1, "\n".join(lines)


def test_chat_multiline_ctrl_c_hint_and_ctrl_d(tiny_model_dir, tmp_path):
    child = spawn_chat(tiny_model_dir, tmp_path, "--max-tokens", "2", "--mtp", "0")
    child.sendline('"""')
    child.sendline("line one")
    child.sendline('line two"""')
    child.expect(r"tokens · prompt \d+")
    child.expect(">>> ")
    command(child, "and then?", r"tokens · prompt \d+ \(\d+ reused\)")   # the first turn's state is resumed
    command(child, "/show prompt", r"line one\r\nline two")
    child.sendcontrol("c")
    child.expect("Use Ctrl-D or /exit to quit")
    child.expect(">>> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_chat_piped(tiny_model_dir, tmp_path):
    path = tmp_path / "chat.json"
    lines = ["Hello", "/set max_tokens 2", "/set temperature -1", "Hi there", f"/save {path}"]
    r = subprocess.run([sys.executable, "-m", "dsv4cli", "chat", "--model", str(tiny_model_dir), "--temperature", "0",
                        "--max-tokens", "4"], input="\n".join(lines) + "\n", capture_output=True,
                       text=True, timeout=120, env=chat_env(tmp_path))
    assert r.returncode == 0, r.stderr
    replies = [m["content"] for m in json.loads(path.read_text())["messages"] if m["role"] == "assistant"]
    assert len(replies) == 2
    assert r.stdout == "".join(printable(text) + "\n" for text in replies)   # stdout: the replies only
    assert "\x1b" not in r.stdout + r.stderr
    assert "error: /set temperature: must be in [0, 100], got -1.0" in r.stderr


def test_chat_drops_the_oldest_turns_when_the_conversation_no_longer_fits(tiny_model_dir, tmp_path):
    """The model stops seeing the oldest exchanges; the transcript /save writes keeps them."""
    path = tmp_path / "chat.json"
    questions = [f"Tell me something about the number {i}, please." for i in range(6)]
    lines = [*questions, "/show prompt", f"/save {path}"]
    r = subprocess.run([sys.executable, "-m", "dsv4cli", "chat", "--model", str(tiny_model_dir), "--temperature", "0",
                        "--max-tokens", "8", "--ignore-eos", "--max-seq-len", "64", "--system", "Be brief."],
                       input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120,
                       env=chat_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "error" not in r.stderr                    # every message answered, none refused
    assert "context full: the model no longer sees the 2 oldest messages (the system prompt stays" in r.stderr
    shown = r.stderr[r.stderr.index("prompt ("):]       # /show prompt: what the model saw last
    assert "Be brief." in shown and questions[5] in shown and questions[0] not in shown
    messages = json.loads(path.read_text())["messages"]
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert [m["content"] for m in messages if m["role"] == "user"] == questions


def test_a_long_max_tokens_keeps_the_history(tiny_model_dir, tmp_path):
    """max_tokens near max_seq_len once hid every earlier exchange from the model and from /save: the reply's
    room is capped at a quarter of max_seq_len."""
    path = tmp_path / "chat.json"
    lines = ["Hello", "What is 2 plus 3?", "/set max_tokens 250", "What is 7 plus 1?", "/show prompt", f"/save {path}"]
    r = subprocess.run([sys.executable, "-m", "dsv4cli", "chat", "--model", str(tiny_model_dir), "--temperature", "0",
                        "--max-tokens", "4", "--max-seq-len", "256"], input="\n".join(lines) + "\n",
                       capture_output=True, text=True, timeout=120, env=chat_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "no longer sees" not in r.stderr
    shown = r.stderr[r.stderr.index("prompt ("):]
    assert "Hello" in shown and "2 plus 3" in shown and "7 plus 1" in shown
    users = [m["content"] for m in json.loads(path.read_text())["messages"] if m["role"] == "user"]
    assert users == ["Hello", "What is 2 plus 3?", "What is 7 plus 1?"]


def test_load_of_a_file_that_is_no_conversation_is_one_error(tiny_model_dir, tmp_path):
    """A JSON list or string once ended the chat (exit 1) and lost the conversation."""
    files = {name: tmp_path / f"{name}.json" for name in ("list", "string", "items", "number")}
    files["list"].write_text("[1, 2]")
    files["string"].write_text('"hello"')
    files["items"].write_text('{"messages": [1, 2]}')
    files["number"].write_text('{"messages": [{"role": "user", "content": "x"}], "settings": 3}')
    path = tmp_path / "chat.json"
    lines = ["Hello", *(f"/load {f}" for f in files.values()), "What is 2 plus 3?", f"/save {path}"]
    r = subprocess.run([sys.executable, "-m", "dsv4cli", "chat", "--model", str(tiny_model_dir), "--temperature", "0",
                        "--max-tokens", "4"], input="\n".join(lines) + "\n", capture_output=True, text=True,
                       timeout=120, env=chat_env(tmp_path))
    assert r.returncode == 0, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 4 and all(f"/load {f}: " in e for e, f in zip(errors, files.values())), errors
    assert "Traceback" not in r.stderr
    users = [m["content"] for m in json.loads(path.read_text())["messages"] if m["role"] == "user"]
    assert users == ["Hello", "What is 2 plus 3?"]


def test_show_model_and_prompt_tell_the_truth(tmp_path):
    """The bundled W8A8 model: the parameter count is inspect's (per-row weight scales are not parameters),
    and prefix reuse is on."""
    from dsv4cli.config import BUNDLED_MODEL_DIR
    from dsv4cli.tools.inspect import describe, human_count

    r = subprocess.run([sys.executable, "-m", "dsv4cli", "chat", "--temperature", "0", "--max-tokens", "2"],
                       input="Hi\n/show model\n/show prompt\n", capture_output=True, text=True, timeout=120,
                       env=chat_env(tmp_path))
    assert r.returncode == 0, r.stderr
    params = re.search(r"parameters\s+(.*)", r.stderr)[1].strip()
    assert params == human_count(describe(BUNDLED_MODEL_DIR)["parameters"])
    assert "KV prefix reuse" in r.stderr and "not available" not in r.stderr
    assert "prefills only what follows the cached state" in r.stderr and "all prefilled again" not in r.stderr


def test_chat_logprobs_and_tools(tiny_model_dir, tmp_path):
    """/set logprobs N then /show logprobs lists the last reply's tokens with N alternatives; /tools FILE
    renders the tools into the prompt; a bad file is one error line and the chat goes on."""
    tools, bad = tmp_path / "tools.json", tmp_path / "bad.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "get_time", "parameters": {}}}]))
    bad.write_text("[1]")
    lines = ["/show logprobs", "/set logprobs 2", f"/tools {tools}", "Hi", "/show logprobs", "/show prompt",
             f"/tools {bad}"]
    r = subprocess.run([sys.executable, "-m", "dsv4cli", "chat", "--model", str(tiny_model_dir), "--temperature", "0",
                        "--max-tokens", "3", "--ignore-eos"], input="\n".join(lines) + "\n", capture_output=True,
                       text=True, timeout=120, env=chat_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "logprobs: none; /set logprobs N, then a reply" in r.stderr
    out = [line.rstrip() for line in r.stderr.splitlines()]
    table = out[out.index("logprobs") + 1:][:3]
    assert len(table) == 3 and all(len(re.findall(r" -?\d+\.\d+", row)) == 3 for row in table), table
    assert "tools: get_time" in r.stderr and '"name": "get_time"' in r.stderr
    assert f"error: /tools {bad}: must hold a list" in r.stderr


def test_the_terminal_shows_no_special_tokens(tmp_path):
    """The bundled model writes `<｜end▁of▁sentence｜>` and chat markers once it runs past its end: no frame of
    the live view, nor the reply printed after it, shows them."""
    from dsv4cli.config import BUNDLED_MODEL_DIR

    child = spawn_chat(BUNDLED_MODEL_DIR, tmp_path, "--max-tokens", "40", "--ignore-eos")
    child.sendline("What is 2 plus 3?")
    child.expect(r"40 tokens · prompt \d+")
    shown = ANSI.sub("", child.before)
    assert "2 + 3 = 5." in shown and not any(t in shown for t in ("<｜", "｜>", "</think>")), shown
    child.expect(">>> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)


def test_a_saved_chat_resumes_from_its_state_without_a_prefill(tiny_model_dir, tmp_path):
    """/save writes the decode state beside the transcript; `dsv4 chat --resume` loads both and answers the
    next message as the chat would have gone on, prefilling only what follows the saved state (its summary:
    `prompt N (M reused)`); a state another model made is refused in one line and the transcript loads."""
    path, question = tmp_path / "chat.json", "What is 2 plus 3?"
    base = [sys.executable, "-m", "dsv4cli", "chat", "--model", str(tiny_model_dir), "--temperature", "0",
            "--max-tokens", "6", "--ignore-eos"]

    def piped(*args, lines):
        r = subprocess.run([*base, *args], input="\n".join(lines) + "\n", capture_output=True, text=True,
                           timeout=120, env=chat_env(tmp_path))
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        return r

    went_on = piped(lines=["Tell me a story about a fox.", "And one about a cat.", f"/save {path}", question])
    state = tmp_path / "chat.json.safetensors"
    saved = int(re.search(r"saved the decode state of (\d+) tokens to ", went_on.stderr)[1])
    assert state.is_file() and saved > 20
    resumed = piped("--resume", str(path), lines=[question])
    assert f"resumed the decode state of {saved} tokens" in resumed.stderr
    assert resumed.stdout.splitlines() == went_on.stdout.splitlines()[2:]

    child = pexpect.spawn(sys.executable, [*base[1:], "--resume", str(path)], env=chat_env(tmp_path),
                          dimensions=(40, 120), encoding="utf-8", timeout=60)
    child.expect("loaded 4 messages")        # on a terminal, the conversation it resumed, then the banner
    child.expect(">>> Tell me a story about a fox.")
    child.expect(">>> And one about a cat.")
    child.expect("Ctrl-D quits")
    child.expect(">>> ")
    child.sendline(question)
    child.expect(r"6 tokens · prompt (\d+) \((\d+) reused\)")
    prompt, reused = int(child.match[1]), int(child.match[2])
    # everything before the last reply (whose re-rendered tokens may differ from those generated, as in a chat
    # that went on): the new message is prefilled, not the conversation
    assert reused >= saved - 6 - 1 and prompt - reused < 40
    child.expect(">>> ")
    child.sendeof()
    child.expect(pexpect.EOF)

    other = piped("--resume", str(path), "--model", str(BUNDLED), "--max-seq-len", "512", lines=[question])
    refused = [line for line in other.stderr.splitlines() if line.startswith("error: ")]
    assert refused == [f"error: {state}: state refused: made by another model ({tiny_model_dir.name}; this chat runs "
                       "dsv4-tiny); the conversation loads without it"], other.stderr
    assert "loaded 4 messages" in other.stderr and len(other.stdout.splitlines()) == 1

    r = subprocess.run([*base, "--resume", str(tmp_path / "missing.json")], capture_output=True, text=True,
                       timeout=120, env=chat_env(tmp_path))
    assert r.returncode == 2 and r.stderr.strip().endswith("--resume " + str(tmp_path / "missing.json") +
                                                           ": no such file")


def test_hostile_transcripts_and_save_paths_are_one_error_each(tiny_model_dir, tmp_path):
    """A transcript nested 100k deep, one with a lone surrogate, /load /dev/zero and /tools /dev/zero once ended the
    chat (internal error, or a read without bound) and lost the conversation; a transcript whose format named a file
    made /load read it into the next reply; /save replaced a pipe or a device it was given. Each is one error line,
    the chat goes on, and at start-up (--resume, -c) one line and exit 2."""
    deep, lone, grammar = tmp_path / "deep.json", tmp_path / "lone.json", tmp_path / "grammar.json"
    deep.write_text('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}")
    lone.write_text('{"messages": [{"role": "user", "content": "a\\ud800b"}]}')       # the escape, as JSON has it
    secret = tmp_path / "secret.txt"
    secret.write_text("the secret")
    grammar.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                                   "settings": {"format": f"grammar {secret}"}}))
    pipe, device, path = tmp_path / "pipe", tmp_path / "null", tmp_path / "chat.json"
    os.mkfifo(pipe)
    device.symlink_to("/dev/null")                    # a device's path (replacing /dev/null itself needs root)
    os.mkfifo(tmp_path / "kept.json.safetensors")     # where /save would put the decode state of kept.json
    lines = ["Hello", f"/load {deep}", f"/load {lone}", f"/load {grammar}", "/load /dev/zero", "/tools /dev/zero",
             f"/save {pipe}", f"/save {device}", f"/save {tmp_path / 'kept.json'}", "What is 2 plus 3?",
             f"/save {path}"]
    base = [sys.executable, "-m", "dsv4cli", "chat", "--model", str(tiny_model_dir), "--temperature", "0",
            "--max-tokens", "4"]
    r = subprocess.run(base, input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120,
                       env=chat_env(tmp_path))
    assert r.returncode == 0, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: /load {deep}: nested too deep to read",
        f"error: /load {lone}: a string holds a lone surrogate '\\ud800', which is not text",
        f"error: /load {grammar}: settings.format 'grammar {secret}': a transcript may not name a file to read "
        "(/set format after /load)",
        "error: /load /dev/zero: larger than 64 MiB (the most dsv4 reads of one file)",
        "error: /tools /dev/zero: cannot read: larger than 64 MiB (the most dsv4 reads of one file)",
        f"error: /save {pipe}: not a regular file",
        f"error: /save {device}: not a regular file",
        f"error: the decode state was not saved: {tmp_path / 'kept.json.safetensors'} is not a regular file",
    ], r.stderr
    assert "Traceback" not in r.stderr and "the secret" not in r.stdout
    assert pipe.is_fifo() and device.is_symlink() and (tmp_path / "kept.json.safetensors").is_fifo()
    data = json.loads(path.read_text())
    assert [m["content"] for m in data["messages"] if m["role"] == "user"] == ["Hello", "What is 2 plus 3?"]
    assert data["settings"]["format"] == "text"

    for args, message in ((["--resume", str(lone)], f"--resume: /load {lone}: a string holds a lone surrogate"),
                          (["--resume", str(deep)], f"--resume: /load {deep}: nested too deep to read"),
                          (["-c", "/dev/zero"], "/dev/zero: cannot read config file: larger than 64 MiB")):
        r = subprocess.run([*base, *args], input="Hi\n", capture_output=True, text=True, timeout=120,
                           env=chat_env(tmp_path))
        assert r.returncode == 2 and r.stdout == "", r.stderr
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: " + message), r.stderr


def test_damaged_decode_states_are_refused_in_one_line(tiny_model_dir, tmp_path):
    """A state whose tensor has another width or dtype than the model's once ended the chat (internal error); one
    holding NaN loaded without a word. Each is refused in one line, nothing of it is put into the engine, and the
    transcript beside it loads."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = tmp_path / "chat.json"
    base = [sys.executable, "-m", "dsv4cli", "chat", "--model", str(tiny_model_dir), "--temperature", "0",
            "--max-tokens", "4", "--ignore-eos"]
    r = subprocess.run(base, input=f"Tell me a story.\n/save {path}\n", capture_output=True, text=True, timeout=120,
                       env=chat_env(tmp_path))
    assert r.returncode == 0 and "saved the decode state" in r.stderr, r.stderr
    with safe_open(str(path) + ".safetensors", "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path) + ".safetensors")
    win = tensors["layers.0.win"]
    damaged = {"wide": {"layers.0.win": torch.cat([win, win[:, :1]], 1)},
               "dtype": {"layers.0.win": win.to(torch.bfloat16)},
               "nan": {"layers.0.win": win.clone().fill_(float("nan"))}}
    for name, change in damaged.items():       # written by the real writer, as /save writes it, then altered
        (tmp_path / f"{name}.json").write_text(path.read_text())
        save_file(tensors | change, str(tmp_path / f"{name}.json.safetensors"), metadata=meta)
    lines = ["Hello", *(f"/load {tmp_path / name}.json" for name in damaged), "What next?", f"/save {path}"]
    r = subprocess.run(base, input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120,
                       env=chat_env(tmp_path))
    assert r.returncode == 0, r.stderr
    refused = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    shape = list(win.shape)
    assert refused == [f"error: {tmp_path / name}.json.safetensors: state refused: layers.0.win: {why} (a damaged "
                       "file); the conversation loads without it" for name, why in (
                           ("wide", f"shape {[shape[0], shape[1] + 1]}, this state needs {shape}"),
                           ("dtype", "bfloat16, this state holds float32"),
                           ("nan", "holds NaN or infinity"))], r.stderr
    assert "resumed the decode state" not in r.stderr and r.stderr.count("loaded 2 messages") == 3
    users = [m["content"] for m in json.loads(path.read_text())["messages"] if m["role"] == "user"]
    assert users == ["Tell me a story.", "What next?"]
