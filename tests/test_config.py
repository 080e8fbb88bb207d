import dataclasses
import json
import re
from pathlib import Path

import pytest

from dsv4cli.config import (
    OTHER_ENV,
    SAMPLING_KEYS,
    SPEC,
    Settings,
    check,
    load_file,
    reference_markdown,
    resolve,
)
from dsv4cli.engine import SamplingParams
from dsv4cli.errors import UsageError
from dsv4cli.loading import sampling_params
from dsv4cli.openai.requests import SAMPLING_FIELDS

ROOT = Path(__file__).resolve().parents[1]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_precedence_and_sources(tmp_path):
    model = tmp_path / "model"
    write(
        model / "generation_config.json",
        json.dumps({"temperature": 0.3, "top_p": 0.9, "top_k": 20, "max_new_tokens": 99, "eos_token_id": 1}),
    )
    config = write(
        tmp_path / "run.toml",
        f"""
[model]
model = "{model}"
[sampling]
top_p = 0.8
top_k = 10
max_tokens = 50
""",
    )
    env = {"DSV4_TOP_K": "5", "DSV4_MAX_TOKENS": "60", "DSV4_SEED": ""}  # empty counts as unset
    settings, sources = resolve(config, flags={"max_tokens": 70, "min_p": None}, env=env)

    assert (settings.temperature, settings.top_p, settings.top_k, settings.max_tokens) == (0.3, 0.8, 5, 70)
    assert sources["max_tokens"] == "flag"
    assert sources["top_k"] == "env DSV4_TOP_K"
    assert sources["top_p"] == f"config {config} [sampling].top_p"
    assert sources["temperature"] == "generation_config.json"
    assert sources["min_p"] == sources["seed"] == "default"
    assert settings.stop_token_ids == []  # eos_token_id is not copied: the engine stops on EOS anyway
    assert sources.keys() == SPEC.keys()


def test_defaults_and_bundled_model(tmp_path):
    settings, sources = resolve(flags={"model": str(tmp_path)}, env={})
    assert settings.model_dir == tmp_path
    assert (settings.device, settings.tp, settings.drafts, settings.max_tokens) == ("auto", 1, "auto", 256)
    assert {k for k, s in sources.items() if s != "default"} == {"model"}
    bundled, _ = resolve(env={})
    assert bundled.model is None and bundled.model_dir.name == "dsv4-tiny"


def test_generation_config_do_sample_false_is_greedy(tmp_path):
    write(tmp_path / "generation_config.json", json.dumps({"do_sample": False, "temperature": 0.7}))
    settings, sources = resolve(flags={"model": str(tmp_path)}, env={})
    assert settings.temperature == 0.0 and sources["temperature"] == "generation_config.json"


def test_values_are_normalized(tmp_path):
    config = write(
        tmp_path / "sub" / "x.toml",
        """
[sampling]
temperature = 1
stop = ["\\n\\n", "END"]
[batch]
input = "data/in.jsonl"
output = "/abs/out.jsonl"
""",
    )
    settings, _ = resolve(config, flags={"stop_token_ids": (3, 4)}, env={"DSV4_THINKING": "yes"})
    assert settings.temperature == 1.0 and isinstance(settings.temperature, float)
    assert settings.stop == ["\n\n", "END"] and settings.stop_token_ids == [3, 4]
    assert settings.thinking is True
    assert settings.input == str(tmp_path / "sub" / "data" / "in.jsonl")  # relative to the config file
    assert settings.output == "/abs/out.jsonl"


@pytest.mark.parametrize(
    "text, error",
    [
        ("[sampling]\ntemperature = \n", "x.toml: line 2, column 15: invalid TOML: "),
        (
            "[sampling]\ntemprature = 0.5\n",
            "x.toml: [sampling].temprature: unknown key; did you mean temperature?",
        ),
        (
            "[model]\ntemperature = 0.5\n",
            "x.toml: [model].temperature: unknown key here; it belongs at [sampling].temperature",
        ),
        ("[smapling]\ntop_k = 1\n", "x.toml: [smapling]: unknown section; did you mean [sampling]?"),
        ('mdoe = "chat"\n', "x.toml: mdoe: unknown key; did you mean mode?"),
        ('[model]\ntp = "8"\n', 'x.toml: [model].tp: must be an integer, got "8"'),
        ("[model]\ntp = true\n", "x.toml: [model].tp: must be an integer, got true"),
        ("[model]\ntp = 1.5\n", "x.toml: [model].tp: must be an integer, got 1.5"),
        ('[sampling]\nstop = "END"\n', 'x.toml: [sampling].stop: must be a list of strings, got "END"'),
        ("[chat]\nthinking = 1\n", "x.toml: [chat].thinking: must be a boolean, got 1"),
        ("[sampling]\ntemperature = -1\n", "x.toml: [sampling].temperature: must be in [0, 100], got -1"),
        ("[sampling]\ntop_p = 0\n", "x.toml: [sampling].top_p: must be in (0, 1], got 0"),
        ("[sampling]\nmin_p = 1.0\n", "x.toml: [sampling].min_p: must be in [0, 1), got 1.0"),
        (
            "[sampling]\npresence_penalty = 2.5\n",
            "x.toml: [sampling].presence_penalty: must be in [-2, 2], got 2.5",
        ),
        (
            "[sampling]\nstop_token_ids = [1, -2]\n",
            "x.toml: [sampling].stop_token_ids: items must be >= 0, got -2",
        ),
        ("[model]\nmax_seq_len = 32\n", "x.toml: [model].max_seq_len: must be >= 64, got 32"),
        (
            '[model]\ndevice = "gpu"\n',
            'x.toml: [model].device: must be one of auto, cpu, cuda, npu, got "gpu"',
        ),
        ("[speculative]\ndrafts = 9\n", "x.toml: [speculative].drafts: must be auto, or in [0, 8], got 9"),
        ("[speculative]\nmtp = 9\n", "x.toml: [speculative].mtp: must be auto, or in [0, 8], got 9"),    # the old name
        ("[speculative]\nmtp = 1\ndrafts = 2\n", "x.toml: [speculative].mtp: the old name of drafts, also set here"),
    ],
)
def test_config_file_errors(tmp_path, monkeypatch, text, error):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "x.toml", text)
    with pytest.raises(UsageError) as e:
        resolve("x.toml", env={})
    assert str(e.value).startswith(error)
    assert "\n" not in str(e.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(UsageError, match="nope.toml: cannot read config file: No such file"):
        resolve(tmp_path / "nope.toml", env={})


@pytest.mark.parametrize(
    "env, error",
    [
        ({"DSV4_TP": "eight"}, "DSV4_TP: must be an integer, got 'eight'"),
        ({"DSV4_TEMPERATURE": "-0.5"}, "DSV4_TEMPERATURE: must be in [0, 100], got -0.5"),
        ({"DSV4_IGNORE_EOS": "maybe"}, "DSV4_IGNORE_EOS: must be a boolean, got 'maybe'"),
        ({"DSV4_STOP": "END"}, "DSV4_STOP: must be a JSON list of strings, got 'END'"),
        ({"DSV4_DEVICE": "tpu"}, 'DSV4_DEVICE: must be one of auto, cpu, cuda, npu, got "tpu"'),
    ],
)
def test_env_errors(env, error):
    with pytest.raises(UsageError) as e:
        resolve(env=env)
    assert str(e.value) == error


def test_a_misspelt_variable_is_an_error():
    """It used to be ignored without a word; the variables that are no settings stay accepted."""
    with pytest.raises(UsageError, match=r"^DSV4_TEMPERATUR: unknown setting; did you mean DSV4_TEMPERATURE\?$"):
        resolve(env={"DSV4_TEMPERATUR": "0"})
    with pytest.raises(UsageError, match=r"^DSV4_FOO: unknown setting; `dsv4 config show` lists the settings"):
        resolve(env={"DSV4_FOO": "1"})
    settings, _ = resolve(env={"DSV4_DEBUG": "1", "DSV4_NATIVE_KERNELS": "0", "DSV4_FOO": "", "DSV4_TOP_K": "3"})
    assert settings.top_k == 3


def test_every_variable_the_code_reads_is_known():
    """A DSV4_* name read anywhere in the package is a setting's or one of OTHER_ENV, so none is refused."""
    names = {m for path in (ROOT / "dsv4cli").rglob("*.py")
             for m in re.findall(r"[\"'](DSV4_[A-Z0-9_]+)[\"']", path.read_text())}   # the names code reads
    settings = {key.env for key in SPEC.values() if key.env}
    assert names - settings == set(OTHER_ENV) and names >= {"DSV4_DEBUG", "DSV4_NATIVE_KERNELS"}


def test_max_tokens_minus_one_runs_until_the_context_is_full(tmp_path):
    """-1 is max_seq_len, from every settings layer; a request body must give a real count."""
    settings, sources = resolve(flags={"max_tokens": -1, "max_seq_len": 1024}, env={})
    assert (settings.max_tokens, sources["max_tokens"]) == (1024, "flag")
    assert resolve(env={"DSV4_MAX_TOKENS": "-1"})[0].max_tokens == 4096
    assert resolve(write(tmp_path / "x.toml", "[sampling]\nmax_tokens = -1\n"), env={})[0].max_tokens == 4096
    with pytest.raises(UsageError, match=r"^--max-tokens: must be >= 1 or -1, got -2$"):
        resolve(flags={"max_tokens": -2}, env={})
    with pytest.raises(UsageError, match=r"^body.max_tokens: must be >= 1, got -1$"):
        check("max_tokens", -1, "body.max_tokens")


def test_system_file(tmp_path):
    write(tmp_path / "prompts" / "pirate.txt", "You are a pirate.\n")
    config = write(tmp_path / "chat.toml", '[chat]\nsystem_file = "prompts/pirate.txt"\n')    # relative to the file
    settings, sources = resolve(config, env={})
    assert (settings.system, sources["system"]) == ("You are a pirate.", f"config {config} [chat].system_file")
    with pytest.raises(UsageError, match="^--system-file: the system prompt is also given with --system"):
        resolve(config, flags={"system": "Be brief."}, env={})
    with pytest.raises(UsageError, match=r"^--system-file \S+missing.txt: cannot read: No such file or directory$"):
        resolve(flags={"system_file": str(tmp_path / "missing.txt")}, env={})


@pytest.mark.parametrize(
    "flags, error",
    [
        ({"top_p": 2.0}, "--top-p: must be in (0, 1], got 2.0"),
        ({"temperature": -1.0}, "--temperature: must be in [0, 100], got -1.0"),
        ({"stop_token_ids": [-1]}, "--stop-token-id: items must be >= 0, got -1"),
        # values the device cannot hold (they used to fail the engine step, not the input)
        ({"temperature": 1e300}, "--temperature: must be in [0, 100], got 1e+300"),
        ({"repetition_penalty": 1e308}, "--repetition-penalty: must be in [0.01, 100], got 1e+308"),
        ({"repetition_penalty": 1e-300}, "--repetition-penalty: must be in [0.01, 100], got 1e-300"),
        ({"top_k": 99999999999999999999}, "--top-k: must fit in 64 bits, got 99999999999999999999"),
        ({"seed": 1 << 63}, f"--seed: must fit in 64 bits, got {1 << 63}"),
        ({"max_batch": 99999999999999999999}, "--max-batch: must fit in 64 bits, got 99999999999999999999"),
        ({"stop_token_ids": [1 << 64]}, f"--stop-token-id: must fit in 64 bits, got [{1 << 64}]"),
        ({"threads": 2048}, "--threads: must be in [1, 1024], got 2048"),
    ],
)
def test_flag_errors(flags, error):
    with pytest.raises(UsageError) as e:
        resolve(flags=flags, env={})
    assert str(e.value) == error


def test_bad_generation_config_names_the_file(tmp_path):
    write(tmp_path / "generation_config.json", json.dumps({"top_p": 1.5}))
    with pytest.raises(UsageError, match=r"generation_config.json: top_p: must be in \(0, 1\], got 1.5"):
        resolve(flags={"model": str(tmp_path)}, env={})


@pytest.mark.parametrize("name", ["chat", "generate", "batch", "serve", "npu-8card"])
def test_example_configs_validate(name):
    found = load_file(ROOT / "configs" / f"{name}.toml")
    assert found["mode"][0] in ("chat", "generate", "batch", "serve")


def test_npu_config_is_a_real_deployment():
    settings, _ = resolve(ROOT / "configs" / "npu-8card.toml", env={})
    assert (settings.device, settings.dtype, settings.tp, settings.drafts) == ("npu", "bfloat16", 8, 1)
    assert settings.max_seq_len == 65536 and settings.model.endswith("w8a8-mtp")


def test_readme_config_reference_matches_spec():
    readme = (ROOT / "README.md").read_text()
    assert reference_markdown() in readme, "README is stale: run python scripts/gen_config_reference.py"


def test_the_sampling_settings_are_the_engines_request_params():
    """One list: every [sampling] key is a SamplingParams field with the same default (logit_bias, background, the
    grammar and prompt scoring are only per request), the CLI's request defaults carry every one, and batch
    bodies may set them."""
    per_request = {"logit_bias", "background", "grammar", "prompt_logprobs", "score_ids"}
    assert {f.name for f in dataclasses.fields(SamplingParams)} == {*SAMPLING_KEYS, *per_request}
    assert all(getattr(SamplingParams(), name) == SPEC[name].default for name in SAMPLING_KEYS)
    given = {"temperature": 0.5, "top_p": 0.9, "top_k": 3, "min_p": 0.1, "repetition_penalty": 1.2,
             "presence_penalty": 0.3, "frequency_penalty": -0.4, "seed": 7, "max_tokens": 9, "stop": ["x"],
             "stop_token_ids": [5], "ignore_eos": True, "min_tokens": 4, "logprobs": 2}
    assert given.keys() == set(SAMPLING_KEYS)
    settings = Settings(**given)
    params = sampling_params(settings)
    assert dataclasses.asdict(params) == {**given, "logit_bias": {}, "background": False, "grammar": None,
                                          "prompt_logprobs": None, "score_ids": None}
    assert params.stop is not settings.stop
    assert set(SAMPLING_FIELDS.values()) == set(SAMPLING_KEYS) - {"logprobs"}


def test_drafts_is_read_under_its_old_name_mtp(tmp_path):
    """`drafts` was `mtp`: a config file's [speculative].mtp and DSV4_MTP still set it (the flag --mtp and chat's
    /set mtp are tested with the CLI and the chat session); where both names are set, the new one wins."""
    write(tmp_path / "old.toml", "[speculative]\nmtp = 2\n")
    s, sources = resolve(tmp_path / "old.toml", env={})
    assert (s.drafts, sources["drafts"]) == (2, f"config {tmp_path / 'old.toml'} [speculative].mtp")
    s, sources = resolve(None, env={"DSV4_MTP": "3"})
    assert (s.drafts, sources["drafts"]) == (3, "env DSV4_MTP")
    s, sources = resolve(None, env={"DSV4_MTP": "3", "DSV4_DRAFTS": "1"})
    assert (s.drafts, sources["drafts"]) == (1, "env DSV4_DRAFTS")
