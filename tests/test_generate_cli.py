"""`dsv4 generate` end to end in a subprocess."""
import json
import subprocess
import sys


def dsv4(*args, **kw):
    return subprocess.run([sys.executable, "-m", "dsv4cli", *args], capture_output=True, text=True, timeout=300, **kw)


def test_generate_json_greedy_spec_equals_plain(tiny_model_dir):
    runs = []
    for k in ("0", "2"):
        r = dsv4("generate", "--model", str(tiny_model_dir), "--prompt", "What is 2 plus 3?", "--max-tokens", "12",
                 "--temperature", "0", "--drafts", k, "--ignore-eos", "--json")
        assert r.returncode == 0, r.stderr
        runs.append(json.loads(r.stdout))
    assert runs[0]["token_ids"] == runs[1]["token_ids"] and len(runs[0]["token_ids"]) == 12
    assert runs[0]["finish_reason"] == "length"
    stats = runs[1]["stats"]
    assert stats["draft_tokens"] == 2 * stats["drafts"] and 0 <= stats["acceptance_rate"] <= 1
    assert len(stats["per_position"]) == 2


def test_generate_streams_text(tiny_model_dir):
    r = dsv4("generate", "--model", str(tiny_model_dir), "--prompt", "Hi", "-n", "8", "--temperature", "0", "--raw")
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n")


def test_generate_bad_model_dir_is_one_line(tmp_path):
    r = dsv4("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_thinking_reasoning_is_apart_from_the_answer():
    """The bundled model thinks "The sky looks blue." then answers; no markup in any output."""
    args = ("generate", "--thinking", "-p", "What color is the sky?", "--temperature", "0", "-n", "60")
    r = dsv4(*args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "think>" not in r.stdout + r.stderr
    assert r.stderr.strip() == "The sky looks blue."          # piped: the reasoning goes to stderr
    j = dsv4(*args, "--json")
    assert j.returncode == 0, j.stderr
    result = json.loads(j.stdout)
    assert result["reasoning_content"] == "The sky looks blue." and result["text"] == r.stdout.strip()


def test_prompt_from_stdin_and_from_a_file(tmp_path):
    prompt = "What is 2 plus 3?"
    base = ("generate", "-n", "10", "--temperature", "0")
    expected = dsv4(*base, "-p", prompt)
    assert expected.returncode == 0 and expected.stdout.strip(), expected.stderr
    (tmp_path / "p.txt").write_text(prompt + "\n")
    for args, stdin in (((), prompt + "\n"), (("-p", "-"), prompt), (("--prompt-file", str(tmp_path / "p.txt")), "")):
        r = dsv4(*base, *args, input=stdin)
        assert (r.returncode, r.stdout) == (0, expected.stdout), (args, r.stderr)
    for args, stdin, says in (((), "", "--prompt: missing"), (("-p", "-"), "", "stdin was empty"),
                              (("--prompt-file", str(tmp_path / "none.txt")), "", "cannot read"),
                              (("-p", "x", "--prompt-file", str(tmp_path / "p.txt")), "", "give one of them")):
        r = dsv4(*base, *args, input=stdin)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and says in r.stderr, (args, r.stderr)
        assert len(r.stderr.splitlines()) == 1


def test_generate_json_logprobs_and_tools(tiny_model_dir, tmp_path):
    """--logprobs N: one entry per token with N alternatives, the same tokens as without; --tools FILE renders
    the tools (the prompt grows) and a bad file is one line naming it."""
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "get_time", "parameters": {}}}]))
    base = ("generate", "--model", str(tiny_model_dir), "--prompt", "Hi", "-n", "6", "--temperature", "0",
            "--ignore-eos", "--json")
    plain, scored, tooled = (json.loads(dsv4(*base, *extra).stdout)
                             for extra in ([], ["--logprobs", "3"], ["--tools", str(tools)]))
    assert scored["token_ids"] == plain["token_ids"] and "logprobs" not in plain
    assert len(scored["logprobs"]) == 6 and all(len(e["top_logprobs"]) == 3 for e in scored["logprobs"])
    assert all(e["logprob"] <= e["top_logprobs"][0]["logprob"] + 1e-6 for e in scored["logprobs"])
    assert tooled["stats"]["prompt_tokens"] > plain["stats"]["prompt_tokens"]
    tools.write_text('{"name": "get_time"}')
    r = dsv4(*base, "--tools", str(tools))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "--tools" in r.stderr, r.stderr


def test_until_the_context_is_full_and_a_system_file(tmp_path):
    """-n -1 generates until max_seq_len; --system-file FILE gives the same prompt as --system TEXT."""
    base = ("generate", "-p", "Hi", "--temperature", "0", "--ignore-eos", "--max-seq-len", "64", "--json")
    r = dsv4(*base, "-n", "-1")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["finish_reason"] == "length"
    assert result["stats"]["prompt_tokens"] + len(result["token_ids"]) == 64
    (tmp_path / "system.txt").write_text("You are a pirate.\n")
    runs = [json.loads(dsv4(*base, "-n", "4", *given).stdout)
            for given in (("--system", "You are a pirate."), ("--system-file", str(tmp_path / "system.txt")))]
    assert runs[0]["token_ids"] == runs[1]["token_ids"] and runs[0]["stats"]["prompt_tokens"] > 10


def test_prompt_ids_are_used_as_they_are():
    """--prompt-ids BOS + the tokens of "Once upon a time" continues exactly as --raw of that text (which adds
    the BOS); the stats name the bundled model's drafter; ids that are no token ids are one line, exit 2."""
    from dsv4cli.config import BUNDLED_MODEL_DIR
    from dsv4cli.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    ids = ",".join(str(t) for t in [tok.bos_id, *tok.encode("Once upon a time")])
    common = ("generate", "--temperature", "0", "-n", "24", "--json")
    raw, given = dsv4(*common, "--raw", "-p", "Once upon a time"), dsv4(*common, "--prompt-ids", ids)
    assert raw.returncode == given.returncode == 0, raw.stderr + given.stderr
    raw, given = json.loads(raw.stdout), json.loads(given.stdout)
    assert given["token_ids"] == raw["token_ids"] and given["text"] == raw["text"]
    assert given["stats"]["drafter"] == "dspark" and given["stats"]["drafts_setting"] == "auto"
    assert len(given["stats"]["per_position"]) == 5
    past = tok.vocab_size
    for bad, message in (("0,x", "'x' is not a token id"), (f"0,{past}", f"{past} is not a token id"),
                         ("", "'' is not a token id")):
        r = dsv4("generate", "--prompt-ids", bad)
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = dsv4("generate", "--prompt-ids", "0,5", "-p", "hi")
    assert r.returncode == 2 and "drop --prompt" in r.stderr
