"""The installed `dsv4` console script, run as a user would run it."""

import json
import os
import subprocess
import sys
from pathlib import Path

from dsv4cli.config import SPEC

ROOT = Path(__file__).resolve().parents[1]
DSV4 = Path(sys.executable).parent / "dsv4"


def dsv4(*args: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    """Run dsv4 with a clean DSV4_* environment and a wide terminal, so rich tables do not wrap."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_")}
    return subprocess.run(
        [str(DSV4), *args],
        cwd=cwd,
        env={**base, "COLUMNS": "1000", **env},
        capture_output=True,
        text=True,
        check=False,
    )


def test_help_and_version():
    out = dsv4("--help")
    assert out.returncode == 0 and "config" in out.stdout and "run" in out.stdout
    version = dsv4("--version")
    assert version.returncode == 0 and version.stdout.startswith("dsv4 ")


def test_module_entry_points():
    for module in ("dsv4cli", "dsv4cli.cli"):
        out = subprocess.run(
            [sys.executable, "-m", module, "--version"], capture_output=True, text=True, check=False
        )
        assert out.returncode == 0 and out.stdout.startswith("dsv4 "), out.stderr


def test_config_show_lists_values_and_sources(tmp_path):
    config = tmp_path / "x.toml"
    config.write_text("[sampling]\ntop_p = 0.5\n")
    out = dsv4("config", "show", "-c", str(config), "--temp", "0.2", "--model", str(tmp_path), DSV4_TOP_K="7")
    assert out.returncode == 0, out.stderr
    rows = {line.split("│")[1].strip(): line for line in out.stdout.splitlines() if line.count("│") == 4}
    assert "0.2" in rows["[sampling].temperature"] and "flag" in rows["[sampling].temperature"]
    assert "env DSV4_TOP_K" in rows["[sampling].top_k"]
    assert f"config {config} [sampling].top_p" in rows["[sampling].top_p"]
    assert "default" in rows["[speculative].drafts"]


def test_config_show_json(tmp_path):
    out = dsv4("config", "show", "--json", "--stop", "a", "--stop", "b", "--model", str(tmp_path))
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["stop"] == {"value": ["a", "b"], "source": "flag"}
    assert shown["tp"] == {"value": 1, "source": "default"}


def test_malformed_config_is_one_line_exit_2(tmp_path):
    (tmp_path / "bad.toml").write_text("[sampling]\ntemperature = = 1\n")
    out = dsv4("config", "show", "-c", "bad.toml", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.startswith("error: bad.toml: line 2") and len(out.stderr.splitlines()) == 1
    assert "Traceback" not in out.stderr


def test_debug_shows_the_traceback(tmp_path):
    (tmp_path / "bad.toml").write_text("[sampling]\ntop_p = 2\n")
    out = dsv4("config", "show", "-c", "bad.toml", "--debug", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" in out.stderr


def test_bad_values_name_the_flag_or_variable():
    out = dsv4("config", "show", "--top-p", "2")
    assert (out.returncode, out.stderr) == (2, "error: --top-p: must be in (0, 1], got 2.0\n")
    out = dsv4("config", "show", DSV4_MTP="9")      # the old name of DSV4_DRAFTS, still read
    assert (out.returncode, out.stderr) == (2, "error: DSV4_MTP: must be auto, or in [0, 8], got 9\n")
    out = dsv4("config", "show", "--json", "--mtp", "3")     # the old spelling of --drafts
    assert out.returncode == 0 and json.loads(out.stdout)["drafts"] == {"value": 3, "source": "flag"}


def test_run_dispatches_to_the_mode(tmp_path, tiny_model_dir):
    (tmp_path / "g.toml").write_text(
        f'mode = "generate"\n[model]\nmodel = "{tiny_model_dir}"\n[sampling]\ntemperature = 0\nmax_tokens = 3\n'
        '[generate]\nprompt = "Hi"\njson = true\n')
    out = dsv4("run", str(tmp_path / "g.toml"), "--max-tokens", "2")   # a flag overrides the file
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["token_ids"]) == 2


def test_run_needs_a_mode(tmp_path):
    (tmp_path / "x.toml").write_text("[sampling]\ntop_k = 1\n")
    out = dsv4("run", "x.toml", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("error: x.toml: mode: missing")
    out = dsv4("run", "dsv4-tiny", cwd=tmp_path)        # a model where a config file goes: what run takes
    assert out.returncode == 2 and "takes a TOML file" in out.stderr and "dsv4 chat --model dsv4-tiny" in out.stderr


def test_the_names_users_type_from_other_tools(tmp_path):
    """The bundled model by its name (`--model dsv4-tiny`, as every banner calls it), llama.cpp's --ctx-size and
    vLLM's --max-model-len for --max-seq-len."""
    for flags in (["--model", "dsv4-tiny", "--ctx-size", "300"],
                  ["--model", "dsv4-tiny-mtp", "--max-model-len", "300"]):
        out = dsv4("config", "show", "--json", *flags, cwd=tmp_path)
        shown = json.loads(out.stdout)
        assert out.returncode == 0 and shown["max_seq_len"] == {"value": 300, "source": "flag"}
        assert shown["model"]["value"].endswith(f"assets/{flags[1]}")
    out = dsv4("generate", "--model", "dsv4-tiny", "-p", "Hello!", "-n", "4", "--temperature", "0", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip()


def test_usage_errors_exit_2():
    for args in (["--no-such-flag"], ["config", "show", "--bogus"], ["config", "show", "--tp", "x"], ["run"]):
        out = dsv4(*args)
        assert out.returncode == 2, args
        assert out.stderr.startswith("error: ") and len(out.stderr.splitlines()) == 1, out.stderr


def one_error_line(out: subprocess.CompletedProcess, says: str) -> None:
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error: ") and len(out.stderr.splitlines()) == 1, out.stderr
    assert says in out.stderr, out.stderr


def test_model_ids_resolve_in_the_local_hub_caches(tmp_path, tiny_model_dir):
    """A Hugging Face cache and a ModelScope cache laid out as their tools leave them; nothing is downloaded."""
    import shutil

    snapshot = tmp_path / "hf" / "models--acme--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_model_dir, snapshot)
    (tmp_path / "hf" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hf" / "models--acme--tiny" / "refs" / "main").write_text("0123abcd")
    shutil.copytree(tiny_model_dir, tmp_path / "ms" / "models" / "other" / "tiny")
    caches = {"HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "MODELSCOPE_CACHE": str(tmp_path / "ms")}
    gen = ("generate", "-p", "Hi", "-n", "2", "--temperature", "0", "--raw")
    for model in ("acme/tiny", "other/tiny"):
        out = dsv4(*gen, "--model", model, **caches)
        assert out.returncode == 0, out.stderr
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "g.toml").write_text('mode = "generate"\n[model]\nmodel = "acme/tiny"\n')
    out = dsv4("run", str(tmp_path / "runs" / "g.toml"), *gen[1:], **caches)     # not runs/acme/tiny
    assert out.returncode == 0, out.stderr
    shown = json.loads(dsv4("config", "show", "--json", "--model", "acme/tiny", **caches).stdout)
    assert shown["model"]["value"] == str(snapshot)

    one_error_line(dsv4(*gen, "--model", "acme/absent", **caches), "hf download acme/absent")
    one_error_line(dsv4(*gen, "--model", str(tmp_path / "nonexistent")), "nonexistent: no such model directory")

    # results name the model by its id, not by the snapshot's hash or the bare directory name
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "Hi"}\n')
    for model in ("acme/tiny", "other/tiny"):
        out = tmp_path / f"{model.replace('/', '-')}.jsonl"
        r = dsv4("batch", str(tmp_path / "in.jsonl"), "-o", str(out), "-n", "2", "--model", model, **caches)
        assert r.returncode == 0, r.stderr
        assert json.loads(out.read_text())["response"]["body"]["model"] == model
    # inspect and convert take ids too
    out = dsv4("inspect", "acme/tiny", "--json", **caches)
    assert out.returncode == 0 and json.loads(out.stdout)["format"] == "float", out.stderr
    one_error_line(dsv4("inspect", "acme/absent", **caches), "hf download acme/absent")
    out = dsv4("convert", "other/tiny", str(tmp_path / "bf16"), "--to", "bf16", **caches)
    assert out.returncode == 0 and (tmp_path / "bf16" / "config.json").is_file(), out.stderr


def test_a_load_time_error_names_where_the_value_came_from(tmp_path, tiny_model_dir):
    """A value checked against the model, once loaded, is reported at its place: a flag as a flag, a config
    file's key as the file's key, an environment variable by its name."""
    gen = ("generate", "-p", "Hi", "--model", str(tiny_model_dir))
    (tmp_path / "run.toml").write_text("[model]\nmax_seq_len = 8192\n")
    one_error_line(dsv4(*gen, "-c", str(tmp_path / "run.toml")),
                   f"error: {tmp_path / 'run.toml'} [model].max_seq_len 8192: above the model's")
    one_error_line(dsv4(*gen, DSV4_MAX_SEQ_LEN="8192"), "error: DSV4_MAX_SEQ_LEN 8192: above the model's")
    one_error_line(dsv4(*gen, "-c", str(tmp_path / "run.toml"), "--max-seq-len", "9000"),
                   "error: --max-seq-len 9000: above the model's")
    (tmp_path / "gen.toml").write_text(f'mode = "generate"\n[generate]\nprompt = "Hi"\n[model]\n'
                                       f'model = "{tiny_model_dir}"\ntp = 3\n')
    one_error_line(dsv4("run", str(tmp_path / "gen.toml")), f"error: {tmp_path / 'gen.toml'} [model].tp 3: ")


def test_limits_are_checked_before_loading(tmp_path, tiny_model_dir):
    model = ("--model", str(tiny_model_dir))
    gen = ("generate", "-p", "Hi", *model)
    one_error_line(dsv4(*gen, "--max-seq-len", "8192"), "above the model's max_position_embeddings (4096)")
    one_error_line(dsv4(*gen, "--max-batch", "1000000000"), "not enough memory on cpu")
    one_error_line(dsv4(*gen, "--temperature", "inf"), "--temperature: must be a finite number")
    one_error_line(dsv4(*gen, "--stop-token-id", "100000"), "--stop-token-id 100000: not a token id")
    one_error_line(dsv4("bench", *model, "--batches", "0"), "--batches: expected integers >= 1")
    one_error_line(dsv4("bench", *model, "--depths", "9"), "--depths: expected integers in [0, 8]")
    (tmp_path / "file").write_text("")
    one_error_line(dsv4("convert", str(tiny_model_dir), str(tmp_path / "file" / "out")), "Not a directory")
    out = dsv4("--debug", *gen, "--temperature", "inf")                 # --debug before the verb too
    assert out.returncode == 2 and "Traceback" in out.stderr


def test_switches_show_no_value_in_help():
    out = dsv4("generate", "--help")
    assert out.returncode == 0 and "--no-ignore-eos" in out.stdout
    assert "<bool>" not in out.stdout and "<float>" in out.stdout


def test_threads_default_to_one_for_a_small_model():
    """Intra-op threads only add barriers to the bundled model's tiny ops, and with another process on a core
    each barrier waits for a descheduled thread (benchmarks/threads.py)."""
    bench = ("bench", "--depths", "0", "--batches", "1", "--prompts", "short", "-n", "2", "--no-transformers", "--json")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}   # torch's own default: every core
    for extra, threads in (((), 1), (("--threads", "3"), 3)):
        out = subprocess.run([str(DSV4), *bench, *extra], env=env, capture_output=True, text=True, check=False)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["meta"]["threads"] == threads


def test_out_of_range_numbers_are_one_error_line(tiny_model_dir):
    """Numbers no device holds, and ones that pass the type check but not the model or the memory."""
    gen = ("generate", "-p", "Hi", "--model", str(tiny_model_dir))
    for flag, value, says in (("--top-k", "99999999999999999999", "--top-k: must fit in 64 bits"),
                              ("--seed", "99999999999999999999", "--seed: must fit in 64 bits"),
                              ("--max-batch", "99999999999999999999", "--max-batch: must fit in 64 bits"),
                              ("--threads", "99999999999999999999", "--threads: must fit in 64 bits"),
                              ("--threads", "2048", "--threads: must be in [1, 1024], got 2048"),
                              ("--temperature", "1e300", "--temperature: must be in [0, 100], got 1e+300"),
                              ("--repetition-penalty", "1e300", "--repetition-penalty: must be in [0.01, 100]"),
                              ("--max-batch", "1000000000000", "not enough memory on cpu"),
                              ("--max-seq-len", "1000000000000", "above the model's max_position_embeddings"),
                              ("--prefill-budget", "99999999999999999999", "--prefill-budget: must fit in 64 bits"),
                              ("--drafts", "99999999999999999999", "--drafts: must fit in 64 bits")):
        one_error_line(dsv4(*gen, flag, value), says)
    one_error_line(dsv4("serve", "--port", "99999"), "--port: must be in [0, 65535], got 99999")


def test_config_show_takes_every_settings_flag(tmp_path):
    """It used to take only the model verbs' options (`--port`: "No such option", did you mean --tp?)."""
    (tmp_path / "x").write_text("Be brief.")       # every path is "x"; --system-file reads it
    args = []
    for name, key in SPEC.items():
        # config show's own --json prints JSON; --system-file gives the system prompt
        if key.file_only or name in ("json", "system"):
            continue
        if key.type is bool:
            args += [key.flags[0].split("/")[0]]
            continue
        value = key.default if key.default not in (None, []) else key.choices[0] if key.choices else \
            key.lo if key.type in (int, list[int]) and key.lo is not None else "x" if "str" in str(key.type) else 1
        args += [key.flag, str(value[0] if isinstance(value, list) else value)]
    out = dsv4("config", "show", "--json", *args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert {name for name, v in shown.items() if v["source"] == "flag"} == set(SPEC) - {"mode", "json"}
    assert shown["port"]["value"] == 8000 and shown["api_key"]["value"] == "<redacted>"
    assert shown["system"]["value"] == "Be brief."


def test_unknown_variables_are_one_error_line():
    one_error_line(dsv4("config", "show", DSV4_TEMPERATUR="0"), "DSV4_TEMPERATUR: unknown setting; did you mean "
                                                               "DSV4_TEMPERATURE?")
    assert dsv4("config", "show", DSV4_DEBUG="1", DSV4_NATIVE_KERNELS="0").returncode == 0


def test_logprobs_without_json_says_so():
    out = dsv4("generate", "-p", "Hi", "-n", "2", "--logprobs", "2")
    assert out.returncode == 0 and out.stderr == "warning: --logprobs: shown only with --json; ignored\n", out.stderr


def test_a_closed_pipe_ends_generate_quietly():
    """`dsv4 generate ... | head -c 20`: the reader leaves while the reply streams."""
    proc = subprocess.Popen([str(DSV4), "generate", "-p", "Tell me a story.", "-n", "300", "--ignore-eos"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert len(proc.stdout.read(20)) == 20
    proc.stdout.close()
    assert proc.wait(timeout=120) == 0
    assert proc.stderr.read() == b""


def test_piped_tables_are_whole_and_torch_keeps_quiet():
    """Piped, rich assumed 80 columns and cut every bench cell to `…`; the profiler bench counts launches with
    printed `USDT: ... profiler_start` lines."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES") and not k.startswith("DSV4_")}
    bench = subprocess.run([str(DSV4), "bench", "--depths", "0", "--batches", "1", "--prompts", "short", "-n", "2",
                            "--no-transformers", "--compile", "off"], env=env, capture_output=True, text=True)
    assert bench.returncode == 0, bench.stderr
    assert "…" not in bench.stdout and "short" in bench.stdout and "tok/s" in bench.stdout
    assert "USDT" not in bench.stderr and "profiler_start" not in bench.stderr, bench.stderr
    shown = subprocess.run([str(DSV4), "config", "show"], env=env, capture_output=True, text=True)
    assert shown.returncode == 0 and "…" not in shown.stdout and "Penalize tokens" not in shown.stdout
    assert "[model].model │ unset" in " ".join(shown.stdout.split())


def test_install_hints_fit_the_install(tmp_path):
    """An editable checkout (this one) installs an extra from itself; an install from an index by name. Both
    read pip's direct_url.json (PEP 610)."""
    blocked = ("import sys; sys.modules['uvicorn'] = None; from dsv4cli.cli import main; sys.exit(main(['serve']))")
    out = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, cwd=tmp_path)
    assert (out.returncode, out.stderr) == (2, "error: dsv4 serve needs the serve extra (uvicorn is missing): "
                                               f"pip install -e '.[serve]' in {ROOT}\n")
    site, info = tmp_path / "site", tmp_path / "site" / "dsv4cli-0.1.0.dist-info"    # as pip installs a wheel
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dsv4cli\nVersion: 0.1.0\n")
    (info / "direct_url.json").write_text('{"url": "file:///src/dsv4cli", "dir_info": {}}')
    (site / "dsv4cli").symlink_to(ROOT / "dsv4cli")
    code = (f"import sys; sys.path.insert(0, {str(site)!r}); from dsv4cli.errors import install_hint; "
            "print(install_hint('serve'))")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.stdout == "pip install 'dsv4cli[serve]'\n", out.stderr


def test_shell_completion():
    """`dsv4 --show-completion` prints the shell's script; the script asks dsv4 itself for the candidates."""
    # the shell named, not detected from the process tree (typer's switch): a test's parents may hold no shell
    out = dsv4("--show-completion", "bash", _TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION="1")
    assert out.returncode == 0 and "_DSV4_COMPLETE=complete_bash" in out.stdout, out.stderr
    for words, cword, expect in (("dsv4 gen", 1, "generate"), ("dsv4 generate --tem", 2, "--temperature"),
                                 ("dsv4 config show --syst", 3, "--system-file")):
        out = dsv4(COMP_WORDS=words, COMP_CWORD=str(cword), _DSV4_COMPLETE="complete_bash")
        assert out.returncode == 0 and expect in out.stdout.split(), (words, out.stdout, out.stderr)


def test_the_quick_start_needs_no_numpy():
    """`pip install -e .` brings no numpy (torch does not require it): the README's first command must answer
    without it (the prefix store's digest of the weights reads their bytes with ctypes, not `.numpy()`)."""
    blocked = ("import sys; sys.modules['numpy'] = None; from dsv4cli.cli import main; "
               "sys.argv = ['dsv4', 'generate', '--prompt', 'What is the capital of France?', '--max-tokens', '8', "
               "'--temperature', '0']; raise SystemExit(main())")
    out = subprocess.run([sys.executable, "-c", blocked], cwd=ROOT, capture_output=True, text=True, check=False,
                         env={k: v for k, v in os.environ.items() if not k.startswith("DSV4_")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
