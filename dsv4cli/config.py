"""Settings: one table of every key, and the resolver that layers where values come from.

Precedence, highest first: CLI flags > DSV4_* environment > config file (TOML) > the model's
generation_config.json > defaults. The `Settings` fields below are the single spec: the CLI options,
`dsv4 config show`, the README reference table and the tests all read it through `SPEC`.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import json
import math
import os
import re
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dsv4cli import platforms
from dsv4cli.errors import UsageError
from dsv4cli.hub import is_model_id, model_name, resolve_model

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

BUNDLED_MODEL_DIR = Path(__file__).parent / "assets" / "dsv4-tiny"

_TYPE_NAMES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    list[str]: "a list of strings",
    list[int]: "a list of integers",
}
_BOOLS = {
    **dict.fromkeys(("1", "true", "yes", "on"), True),
    **dict.fromkeys(("0", "false", "no", "off"), False),
}


@dataclass(frozen=True)
class Key:
    """How one setting is spelled, typed, checked and documented."""

    section: str  # TOML table; "" = top level
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    lo: float | None = None  # numeric bounds, inclusive unless lo_open / hi_open
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    flags: tuple[str, ...] = ()  # CLI spellings; () = "--" + name with "_" -> "-"
    path: bool = False  # a relative path in a config file is relative to that file's directory
    file_only: bool = False  # no flag, no environment variable
    secret: bool = False  # `config show` prints it redacted
    auto: bool = False  # the string "auto" is a value too (an integer key that can be left to the engine)
    nonempty: bool = False  # strings (each item, for a list) must not be empty
    unlimited: int | None = None  # a value outside the rule that means "no limit": settings take it, bodies not
    name: str = ""  # filled in from the Settings field
    type: Any = None  # filled in from the Settings annotation, None stripped

    @property
    def env(self) -> str:
        return "" if self.file_only else "DSV4_" + self.name.upper()

    @property
    def flag(self) -> str:
        """The spelling error messages use."""
        return self.flags[0].split("/")[0]

    @property
    def place(self) -> str:
        return f"[{self.section}].{self.name}" if self.section else self.name

    @property
    def bounds(self) -> str:
        """The values a request body may give."""
        if self.nonempty:
            return "non-empty"
        if self.auto:
            return "auto, or " + dataclasses.replace(self, auto=False).bounds
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo}"
        return ""

    @property
    def rule(self) -> str:
        """The values a setting may take."""
        return self.bounds + (f" or {self.unlimited}" if self.unlimited is not None else "")

    def allows(self, v: Any) -> bool:
        if self.nonempty:
            return v != ""
        if self.choices:
            return v in self.choices
        above = self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)
        below = self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)
        return above and below

    def problem(self, value: Any, setting: bool = False) -> str | None:
        """Why a value of the right type breaks this key's rule (a setting's or a body's; each item, for a
        list), or None."""
        if self.auto and value == "auto":
            return None
        is_list, rule = isinstance(value, list), self.rule if setting else self.bounds
        for v in value if is_list else [value]:
            if not self.allows(v):
                return f"{'items ' if is_list else ''}must be {rule}, got {format_value(v)}"
        return None


def _key(section: str, default: Any, help: str, **rule: Any) -> Any:
    """A Settings field that carries its Key."""
    key = Key(section, default, help, **rule)
    if isinstance(default, list):
        return field(default_factory=list, metadata={"key": key})
    return field(default=default, metadata={"key": key})


@dataclass(frozen=True)
class Settings:
    """Every setting, flat; sections only group keys in TOML files, help and docs."""

    mode: str | None = _key(
        "", None, "What `dsv4 run` does with this file", choices=("chat", "generate", "batch", "serve"),
        file_only=True
    )
    # [model]
    model: str | None = _key("model", None, "Model directory (unset: the bundled dsv4-tiny)", path=True)
    device: str = _key("model", "auto", "Device to run on", choices=("auto", *platforms.names()))
    dtype: str = _key("model", "auto", "Compute dtype", choices=("auto", "float32", "bfloat16", "float16"))
    weights: str = _key(
        "model", "auto", "How quantised weights are held: native (as the files store them: the official release's "
        "FP8 linears and FP4 experts, W8A8's int8), w8a8 (the release re-quantised to int8 per channel at load), "
        "float (decoded to the compute dtype); auto: native, w8a8 on NPUs", choices=("auto", "native", "w8a8", "float")
    )
    mmap: bool = _key(
        "model", True, "Map weights held as stored from the checkpoint's files instead of copying them: processes "
        "share the page cache, and a machine with less memory than the weights still runs (pages read as used)"
    )
    mlock: bool = _key("model", False, "Lock the mapped weights in memory (read once, never paged out)")
    tp: int = _key("model", 1, "Tensor-parallel degree (devices per model)", lo=1)
    max_seq_len: int = _key("model", 4096, "Most tokens (prompt + reply) one sequence may hold", lo=64,
                            flags=("--max-seq-len", "--ctx-size", "--max-model-len"))   # llama.cpp's and vLLM's names
    max_batch: int = _key("model", 8, "Most sequences decoded together", lo=1)
    prefill_budget: int = _key(
        "model", 160, "Prompt tokens prefilled per engine step (in the running streams' decode pass when eager)",
        lo=1
    )
    prefix_cache_bytes: int = _key(
        "model", 1 << 30, "Memory for snapshots of prompts' decode state every 128 tokens, so a later prompt that "
        "starts the same way prefills only the rest (chat, serve, batch; device memory on accelerators); 0 = off",
        lo=0
    )
    prefix_spill_bytes: int | str = _key(
        "model", "auto", "Host memory for prefix snapshots spilled from a full prefix_cache_bytes (auto: as much on "
        "accelerators, 0 on the CPU, where both are host memory)", lo=0, auto=True
    )
    threads: int | None = _key(
        "model", None, "CPU threads for torch (unset: 1 for a model under 100M parameters, else every core)", lo=1,
        hi=1024,  # torch's OpenMP runtime crashes at 2048
    )
    compile: str = _key(
        "model",
        "auto",
        "Compile the decode step and prefill chunks with torch.compile (auto: on for accelerators; on the CPU, for "
        "chat, serve and batch with a model under 100M parameters)",
        choices=("auto", "on", "off"),
    )
    # [sampling]
    temperature: float = _key(
        "sampling", 1.0, "Sampling temperature; 0 = greedy", lo=0, hi=100, flags=("--temperature", "--temp")
    )
    top_p: float = _key(
        "sampling",
        1.0,
        "Sample from the smallest set of tokens with this much probability",
        lo=0,
        lo_open=True,
        hi=1,
    )
    top_k: int = _key("sampling", 0, "Sample from the k most likely tokens; 0 = off", lo=0)
    min_p: float = _key(
        "sampling",
        0.0,
        "Drop tokens below min_p times the top probability; 0 = off",
        lo=0,
        hi=1,
        hi_open=True,
    )
    repetition_penalty: float = _key(
        "sampling",
        1.0,
        "Penalize tokens already in the prompt or reply (> 1 discourages); 1 = off",
        lo=0.01,
        hi=100,
    )
    presence_penalty: float = _key(
        "sampling", 0.0, "Subtract from the logit of every token already generated", lo=-2, hi=2
    )
    frequency_penalty: float = _key(
        "sampling", 0.0, "Subtract this times each token's count so far", lo=-2, hi=2
    )
    seed: int | None = _key("sampling", None, "Random seed for reproducible sampling (unset: random)", lo=0)
    max_tokens: int = _key(
        "sampling", 256, "Most tokens to generate per reply; -1: until the context (max_seq_len) is full", lo=1,
        unlimited=-1, flags=("--max-tokens", "-n")
    )
    # an empty stop string is in every reply: it would end each one after its first token
    stop: list[str] = _key("sampling", [], "Stop when the reply contains this string (repeatable)", nonempty=True)
    stop_token_ids: list[int] = _key(
        "sampling", [], "Stop on this token id (repeatable)", lo=0, flags=("--stop-token-id",)
    )
    ignore_eos: bool = _key("sampling", False, "Keep generating past the end-of-sequence token")
    min_tokens: int = _key(
        "sampling", 0, "Tokens a reply has at least before EOS, a stop token id or a stop string may end it "
        "(vLLM's min_tokens)", lo=0
    )
    logprobs: int | None = _key(
        "sampling", None, "Report each output token's logprob and this many alternatives (unset: off)", lo=0, hi=20
    )
    # [speculative]
    drafts: int | str = _key(
        "speculative",
        "auto",
        "Drafts verified per step: the MTP layer's chain (preview checkpoints) or DSpark's block (0731, at most "
        "its block size); 0 = plain decoding; auto: DSpark verifies per step as many as pay off, MTP 1 "
        "(formerly mtp: --mtp, DSV4_MTP and [speculative].mtp still work)",
        lo=0,
        hi=8,
        auto=True,
        flags=("--drafts", "--mtp"),
    )
    verify: str = _key(
        "speculative", "block", "How sampled drafts are verified: token (each draft alone, accepted with probability "
        "min(1, p/q)) or block (the drafts jointly, Sun et al. 2024: the same output distribution, never fewer "
        "drafts accepted in expectation); greedy rows match prefixes either way", choices=("token", "block")
    )
    # [chat]
    system: str = _key("chat", "", "System prompt")
    system_file: str | None = _key("chat", None, "Read the system prompt from this file", path=True)
    thinking: bool = _key("chat", False, "Let the model think before it answers")
    reasoning_effort: str | None = _key(
        "chat",
        None,
        "How hard to think (unset: the model's default: 0731 low, the preview high); OpenAI's minimal, medium and "
        "xhigh map to low, high and max",
        choices=("low", "high", "max", "minimal", "medium", "xhigh"),
    )
    format: str = _key(
        "chat", "text", "The form of each answer, enforced while it is generated (after the reasoning): text; json "
        "(a JSON object); json-schema FILE (JSON matching the schema in FILE); grammar FILE (a Lark grammar with a "
        "start rule, or else a regular expression, in FILE)", nonempty=True
    )
    # [generate]
    prompt: str | None = _key(
        "generate",
        None,
        "The prompt; - reads it from stdin (unset: stdin when it is not a terminal)",
        flags=("--prompt", "-p"),
    )
    prompt_file: str | None = _key("generate", None, "Read the prompt from this file", path=True)
    prompt_ids: str | None = _key(
        "generate", None, "The prompt as token ids, comma-separated, used as they are (no BOS, no chat template)"
    )
    raw: bool = _key("generate", False, "Send the prompt as is, without the chat template")
    json: bool = _key("generate", False, "Print the result as one JSON object")
    tools: str | None = _key(
        "generate", None, "A JSON file with a list of tools (OpenAI form) the model may call", path=True
    )
    json_schema: str | None = _key(
        "generate", None, "Constrain the answer (after the reasoning) to JSON matching the JSON schema in this file",
        path=True
    )
    grammar: str | None = _key(
        "generate", None, "Constrain the answer (after the reasoning) to the Lark grammar (a file with a start rule) "
        "or else the regular expression in this file", path=True
    )
    # [batch]
    input: str | None = _key(
        "batch", None, "Requests, one JSON object per line", path=True, flags=("--input", "-i")
    )
    output: str | None = _key(
        "batch", None, "Results, one JSON line per request", path=True, flags=("--output", "-o")
    )
    errors: str | None = _key("batch", None, "Failed requests go here instead of into the output", path=True)
    resume: bool = _key("batch", False, "Skip requests whose custom_id is already in the output")
    shard: str | None = _key(
        "batch", None, "Answer one shard of the input: I/N (the requests whose custom_id hashes to I of N; files "
        "OUT.shard-I-of-N), auto (I and N of a Slurm array job) or auto/N (I: Kubernetes' JOB_COMPLETION_INDEX or "
        "Slurm's)", nonempty=True
    )
    # [serve]
    host: str = _key("serve", "127.0.0.1", "Address to listen on (0.0.0.0: every interface)")
    port: int = _key("serve", 8000, "Port to listen on; 0 picks a free one", lo=0, hi=65535)
    api_key: str | None = _key(
        "serve", None, "Require `Authorization: Bearer KEY` on /v1 requests (unset: no key); better in DSV4_API_KEY",
        secret=True,
    )
    max_waiting: int = _key(
        "serve", 64, "Most requests waiting for a batch slot; beyond it a request gets HTTP 429", lo=0
    )
    log_prompts: bool = _key("serve", False, "Log each request's body (prompts included)")
    served_model_name: str | None = _key(
        "serve", None, "The model's name in /v1/models and replies (unset: the model id given to --model, else the "
        "model directory's name)"
    )
    allowed_hosts: list[str] = _key(
        "serve", [], "Host header names accepted (repeatable; * = any); unset: localhost, 127.0.0.1 and [::1] when "
        "--host is a loopback address (no DNS rebinding), else any", flags=("--allowed-host",), nonempty=True
    )
    cors_origins: list[str] = _key(
        "serve", [], "Browser origin allowed to call the server, e.g. http://localhost:3000 (CORS; repeatable; "
        "* = any); unset: none", flags=("--cors-origin",), nonempty=True
    )
    max_body_bytes: int = _key("serve", 8 << 20, "Largest request body; a larger one gets HTTP 413", lo=1)
    max_messages: int = _key("serve", 2048, "Most messages in a chat request", lo=1)
    max_prompt_tokens: int | None = _key(
        "serve", None, "Most prompt tokens in a request (unset: max_seq_len - 1); a prompt too long for it by its "
        "length alone is refused before it is tokenised", lo=1
    )
    read_timeout: float = _key(
        "serve", 30.0, "Seconds a client has to send a whole request (head and body), from connecting or from its "
        "previous reply; a slower or idle connection is closed", lo=0, lo_open=True
    )
    max_connections: int = _key(
        "serve", 1024, "Most open connections (and no more than the open-file limit allows); one more closes the "
        "oldest connection that has not sent a whole request yet", lo=1
    )
    batch_dir: str | None = _key(
        "serve", None, "Serve OpenAI's Files and Batches API (/v1/files, /v1/batches), keeping files and batches in "
        "this directory; a batch a stopped server left unfinished resumes at the next start (unset: off)", path=True
    )
    batch_slots: int | None = _key(
        "serve", None, "Most slots API batches hold at once; they take only slots no online request waits for "
        "(unset: a quarter of max_batch, at least 1)", lo=1
    )
    stored_responses_bytes: int = _key(
        "serve", 64 << 20, "Memory for stored Responses (previous_response_id, GET /v1/responses/{id}), as their "
        "JSON's bytes; the least recently used go first (0: none kept)", lo=0
    )
    max_file_bytes: int = _key("serve", 200 << 20, "Largest file upload (POST /v1/files); a larger one gets HTTP 413",
                               lo=1)
    shutdown_timeout: float = _key(
        "serve", 20.0, "Seconds a stopping server (SIGTERM, Ctrl-C) gives running requests to finish; then they end "
        "with an error", lo=0
    )

    @property
    def model_dir(self) -> Path:
        return Path(self.model) if self.model else BUNDLED_MODEL_DIR

    @property
    def model_name(self) -> str:
        """What the model is called in replies, results and banners: --served-model-name (which `resolve` sets
        to the model id when it found the model in a hub cache), else its id when the directory is a hub cache's
        copy (not the snapshot's hash), else the directory's name."""
        return self.served_model_name or model_name(self.model_dir)


def _base_type(annotation: Any) -> Any:
    """`int | None` -> int; other annotations unchanged."""
    args = typing.get_args(annotation)
    return next(a for a in args if a is not type(None)) if type(None) in args else annotation


def _spec() -> dict[str, Key]:
    hints = typing.get_type_hints(Settings)
    spec = {}
    for f in fields(Settings):
        base = _base_type(hints[f.name])
        if f.metadata["key"].auto:          # `int | str`: an integer, or the string auto
            base = next(a for a in typing.get_args(base) if a is not str)
        key = dataclasses.replace(f.metadata["key"], name=f.name, type=base)
        if not key.flags and not key.file_only:
            dash = f.name.replace("_", "-")
            key = dataclasses.replace(
                key, flags=(f"--{dash}/--no-{dash}" if key.type is bool else f"--{dash}",)
            )
        spec[f.name] = key
    return spec


SPEC: dict[str, Key] = _spec()
SECTIONS: tuple[str, ...] = tuple(dict.fromkeys(k.section for k in SPEC.values() if k.section))
# Keys by an earlier name, still read in config files, DSV4_* variables and chat's /set and /load (the flags are
# the keys' own `flags`)
RENAMED = {"mtp": "drafts"}
# What a request may set: the engine's SamplingParams has these fields (and the defaults here), plus logit_bias.
SAMPLING_KEYS: tuple[str, ...] = tuple(name for name, key in SPEC.items() if key.section == "sampling")


REDACTED = "<redacted>"


def shown_value(name: str, value: Any) -> Any:
    """A value as `config show` may print it: a secret that is set is redacted."""
    return REDACTED if SPEC[name].secret and value is not None else value


def format_value(value: Any) -> str:
    """A value as TOML spells it; None is "unset"."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(map(format_value, value)) + "]"
    return str(value)


def _is(value: Any, tp: Any) -> bool:
    if typing.get_origin(tp) is list:
        return isinstance(value, list) and all(_is(v, typing.get_args(tp)[0]) for v in value)
    if tp in (int, float) and isinstance(value, bool):  # bool is an int subclass, but not a number here
        return False
    return isinstance(value, (int, float) if tp is float else tp)


def check(name: str, value: Any, place: str, setting: bool = False) -> Any:
    """Type- and rule-check one value for key `name`; `place` starts the error. Returns it normalized.
    `setting`: a value of the settings (flags, environment, files, chat /set), which may be the key's
    `unlimited` (a request body may not)."""
    key = SPEC[name]
    if setting and key.unlimited is not None and value == key.unlimited:
        return value
    if isinstance(value, tuple):
        value = list(value)
    if key.auto and isinstance(value, str):       # a flag's text, or auto
        if value.strip() == "auto":
            return "auto"
        try:
            value = int(value)
        except ValueError:
            raise UsageError(f"{place}: must be auto or an integer, got {format_value(value)}") from None
    if not _is(value, key.type):
        raise UsageError(f"{place}: must be {_TYPE_NAMES[key.type]}, got {format_value(value)}")
    if key.type is float and not math.isfinite(value):
        raise UsageError(f"{place}: must be a finite number, got {value}")
    # the engine keeps integers in int64 tensors
    if any(isinstance(v, int) and abs(v) >= 1 << 63 for v in (value if isinstance(value, list) else [value])):
        raise UsageError(f"{place}: must fit in 64 bits, got {format_value(value)}")
    if problem := key.problem(value, setting):
        raise UsageError(f"{place}: {problem}")
    return float(value) if key.type is float else value


def parse_value(name: str, text: str, place: str) -> Any:
    """Parse and check a setting given as text (an environment variable, a chat /set). Lists are JSON."""
    tp = SPEC[name].type
    if SPEC[name].auto:
        return check(name, text, place)
    try:
        if typing.get_origin(tp) is list:
            value = json.loads(text)
        elif tp is bool:
            value = _BOOLS[text.strip().lower()]
        else:
            value = tp(text)
    except (ValueError, KeyError):
        kind = _TYPE_NAMES[tp].replace("a list", "a JSON list")
        raise UsageError(f"{place}: must be {kind}, got {text!r}") from None
    return check(name, value, place, setting=True)


def without_unlimited(s: Settings) -> Settings:
    """Settings whose `unlimited` values are the limits they stand for: max_tokens -1 is max_seq_len (the
    engine ends a reply when the context is full)."""
    return dataclasses.replace(s, max_tokens=s.max_seq_len) if s.max_tokens == SPEC["max_tokens"].unlimited else s


MAX_READ_BYTES = 64 << 20     # the most a file read whole may hold: config, system prompt, tools, chat transcript


def read_bounded(path: str | Path) -> bytes:
    """A file's bytes, read whole; OSError (EFBIG) when it holds more than MAX_READ_BYTES, so a device that never
    ends (/dev/zero) or a huge file is refused instead of filling memory."""
    with open(path, "rb") as f:
        data = f.read(MAX_READ_BYTES + 1)
    if len(data) > MAX_READ_BYTES:
        raise OSError(errno.EFBIG, f"larger than {MAX_READ_BYTES >> 20} MiB (the most dsv4 reads of one file)")
    return data


def read_json(path: str | Path) -> Any:
    """A JSON file's value (`read_bounded`). ValueError saying why when it is not UTF-8 JSON, is nested too deep
    to parse, or holds a string that is not text (a lone surrogate: no tokenizer takes it)."""
    data = read_bounded(path)
    try:
        value = json.loads(data.decode("utf-8"))
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise ValueError("nested too deep to read") from None
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except UnicodeEncodeError as e:
        raise ValueError(f"a string holds a lone surrogate {e.object[e.start:e.end]!a}, which is not text") from None
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    return value


def read_text_file(name: str, path: str) -> str:
    """The text of a file a setting names (one trailing newline dropped), or a UsageError naming the flag."""
    try:
        return read_bounded(path).decode("utf-8").removesuffix("\n")
    except OSError as e:
        raise UsageError(f"{SPEC[name].flag} {path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{SPEC[name].flag} {path}: not UTF-8 text") from None


def _unknown_key(name: str, section: str) -> str:
    if name in SPEC:
        return f"unknown key here; it belongs at {SPEC[name].place}"
    here = [k for k in SPEC if SPEC[k].section == section]
    if close := difflib.get_close_matches(name, here, 1):
        return f"unknown key; did you mean {close[0]}?"
    if close := difflib.get_close_matches(name, SPEC, 1):
        return f"unknown key; did you mean {SPEC[close[0]].place}?"
    return f"unknown key; known here: {', '.join(here)}"


def _unknown_section(name: str) -> str:
    if close := difflib.get_close_matches(name, SECTIONS, 1):
        return f"unknown section; did you mean [{close[0]}]?"
    return f"unknown section; sections are {', '.join(f'[{s}]' for s in SECTIONS)}"


def _toml_error(e: Exception) -> str:
    """tomllib says "msg (at line 3, column 7)"; put the place first like every other error."""
    m = re.fullmatch(r"(.*) \(at line (\d+), column (\d+)\)", str(e))
    return f"line {m[2]}, column {m[3]}: invalid TOML: {m[1]}" if m else f"invalid TOML: {e}"


def load_file(path: str | Path) -> dict[str, tuple[Any, str]]:
    """Read and check a TOML config file: {key: (value, source)}."""
    try:
        data = tomllib.loads(read_bounded(path).decode("utf-8"))
    except OSError as e:
        raise UsageError(f"{path}: cannot read config file: {e.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{path}: {_toml_error(e)}") from None
    except RecursionError:
        raise UsageError(f"{path}: invalid TOML: nested too deep") from None
    tables = {"": {k: v for k, v in data.items() if not isinstance(v, dict)}}
    tables |= {k: v for k, v in data.items() if isinstance(v, dict)}
    found = {}
    for section, table in tables.items():
        if section and section not in SECTIONS:
            raise UsageError(f"{path}: [{section}]: {_unknown_section(section)}")
        for name, value in table.items():
            place = f"[{section}].{name}" if section else name
            if name in RENAMED and RENAMED[name] in table:
                raise UsageError(f"{path}: {place}: the old name of {RENAMED[name]}, also set here; give one of them")
            name = RENAMED.get(name, name)
            if name not in SPEC or SPEC[name].section != section:
                raise UsageError(f"{path}: {place}: {_unknown_key(name, section)}")
            value = check(name, value, f"{path}: {place}", setting=True)
            if SPEC[name].path:
                here = Path(path).parent / os.path.expanduser(value)
                if not (name == "model" and is_model_id(value) and not here.exists()):  # an id stays an id
                    value = os.path.normpath(here)
            found[name] = (value, f"config {path} {place}")
    return found


# DSV4_* variables that are not settings, read where they act
OTHER_ENV = {"DSV4_DEBUG": "1 shows tracebacks (cli.py)",
             "DSV4_NATIVE_KERNELS": "0 runs torch's CPU kernels instead of the project's (kernels/native.py)",
             "DSV4_LOWBIT_ISA": "avx2 or avx512: the build of the release-format CPU kernels (cpu_lowbit.c) to use"}


def _from_env(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """The settings the environment sets; a DSV4_* variable that names none is a mistake (a misspelling
    would otherwise be ignored without a word)."""
    renamed = {f"DSV4_{old.upper()}": SPEC[new] for old, new in RENAMED.items()}
    known = {key.env for key in SPEC.values() if key.env} | set(OTHER_ENV) | set(renamed)
    for name in sorted(env):
        if name.startswith("DSV4_") and env[name] and name not in known:
            close = difflib.get_close_matches(name.removeprefix("DSV4_"), [k.removeprefix("DSV4_") for k in known], 1)
            hint = f"did you mean DSV4_{close[0]}?" if close else "`dsv4 config show` lists the settings (DSV4_ + key)"
            raise UsageError(f"{name}: unknown setting; {hint}")
    found = {key.name: (parse_value(key.name, env[old], old), f"env {old}") for old, key in renamed.items()
             if env.get(old)}
    for key in SPEC.values():
        if key.env and env.get(key.env):  # set but empty counts as unset; the key's own name over an old one
            found[key.name] = (parse_value(key.name, env[key.env], key.env), f"env {key.env}")
    return found


def _from_flags(flags: Mapping[str, Any]) -> dict[str, tuple[Any, str]]:
    """None (and an empty repeatable) means the flag was not given."""
    return {
        name: (check(name, value, SPEC[name].flag, setting=True), "flag")
        for name, value in flags.items()
        if value is not None and value != [] and value != ()
    }


# generation_config.json keys -> ours. eos_token_id is left out on purpose: the engine always stops on the
# tokenizer's EOS unless ignore_eos, and copying it into stop_token_ids would make ignore_eos stop working.
_GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "max_new_tokens": "max_tokens",
}


def load_generation_config(model_dir: Path) -> dict[str, tuple[Any, str]]:
    """The sampling defaults a model ships in its generation_config.json, if it has one."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: cannot read: {e}") from None
    found = {
        ours: (check(ours, data[theirs], f"{path}: {theirs}"), "generation_config.json")
        for theirs, ours in _GENERATION_CONFIG_KEYS.items()
        if data.get(theirs) is not None
    }
    if data.get("do_sample") is False:  # transformers decodes greedily then, whatever temperature says
        found["temperature"] = (0.0, "generation_config.json")
    return found


def resolve(
    config: str | Path | None = None,
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[Settings, dict[str, str]]:
    """Settings from flags > environment > config file > generation_config.json > defaults, and for
    every key where its value came from: "flag", "env DSV4_X", "config FILE [section].key",
    "generation_config.json" or "default". `flags` maps keys to values, None meaning not given;
    `env` defaults to os.environ. Every value given is checked, even one a higher layer overrides."""
    chosen = load_file(config) if config else {}
    chosen |= _from_env(os.environ if env is None else env)
    chosen |= _from_flags(flags or {})
    model = chosen["model"][0] if "model" in chosen else None
    bundled = BUNDLED_MODEL_DIR.parent / str(model)
    if model and not Path(model).exists() and "/" not in model and bundled.is_dir():
        model = str(bundled)                   # a bundled model by the name it is shown under (dsv4-tiny)
        chosen["model"] = (model, chosen["model"][1])
    if model and (resolved := resolve_model(model)) != model:
        chosen.setdefault("served_model_name", (model, chosen["model"][1]))   # the id, not the snapshot's hash
        model = resolved
        chosen["model"] = (model, chosen["model"][1])
    chosen = load_generation_config(Path(model) if model else BUNDLED_MODEL_DIR) | chosen
    if "system_file" in chosen:
        if "system" in chosen:
            raise UsageError("--system-file: the system prompt is also given with --system; give one of them")
        path, source = chosen["system_file"]
        chosen["system"] = (read_text_file("system_file", path), source)
    settings = Settings(**{name: value for name, (value, _) in chosen.items()})
    return without_unlimited(settings), {name: chosen[name][1] if name in chosen else "default" for name in SPEC}


def reference_markdown() -> str:
    """The config reference table in README.md (scripts/gen_config_reference.py writes it there)."""
    rows = ["| Key | Type | Default | Allowed | Flag | Description |", "|---|---|---|---|---|---|"]
    for key in SPEC.values():
        flags = ", ".join(f"`{f}`" for f in key.flags) or "config file only"
        kind = "path" if key.path else _TYPE_NAMES[key.type].split(" ", 1)[1] + (" or auto" if key.auto else "")
        rows.append(
            f"| `{key.place}` | {kind} | `{format_value(key.default)}` | {key.rule} | {flags} | {key.help} |"
        )
    return "\n".join(rows) + "\n"
