"""A chat conversation, its settings and the slash commands that change them. No terminal I/O here:
the front end (command.py) reads lines, asks `ChatSession.command` what a slash command means, and
renders what comes back."""
import dataclasses
import difflib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dsv4cli.config import RENAMED, SPEC, Settings, check, format_value, parse_value, read_json, without_unlimited
from dsv4cli.encoding import encode_messages
from dsv4cli.engine import Metrics, TokenLogprob
from dsv4cli.errors import UsageError
from dsv4cli.loading import load_tools
from dsv4cli.structured import FORMATS

COMMANDS = {  # name: (arguments, what it does)
    "/help": ("", "list the commands"),
    "/clear": ("", "forget the conversation (the system prompt stays)"),
    "/regen": ("", "generate the last reply again"),
    "/undo": ("", "remove the last exchange (your message and its reply)"),
    "/system": ("[TEXT]", "set the system prompt; without TEXT remove it"),
    "/set": ("KEY VALUE", "change a setting, e.g. /set temperature 0.7, /set drafts 2 (alone: list them)"),
    "/show": ("[settings|model|prompt|logprobs]",
              "show the settings, the model, the rendered prompt; logprobs: the last reply's (/set logprobs N)"),
    "/tools": ("[FILE]", "offer the tools in a JSON file (OpenAI form) to the model; without FILE remove them"),
    "/stats": ("", "totals for this session"),
    "/save": ("FILE", "write the conversation and settings as JSON, and its decode state beside it (FILE.safetensors)"),
    "/load": ("FILE", "read a conversation written by /save; with its state, the next reply prefills only what is new"),
    "/exit": ("", "quit (or Ctrl-D)"),
}
SHOW_PARTS = ("settings", "model", "prompt", "logprobs")
# What /set may change: sampling, the drafts setting and the chat keys (system_file is read into system at the
# start; /system sets it); the model sections need a reload.
SETTABLE = tuple(name for name, key in SPEC.items()
                 if key.section in ("sampling", "speculative", "chat") and name != "system_file")
# /set also takes the flag spellings: temp, n, max-tokens, stop-token-id, ...
_ALIASES = {f.split("/")[0].lstrip("-").replace("-", "_"): name for name in SETTABLE for f in SPEC[name].flags}
_ALIASES |= {name: name for name in SETTABLE}
# The formats that name a file to read: a transcript may come from anyone, so /load takes none of them (else it
# could read any local file into the next reply) and /save writes none.
FILE_FORMATS = tuple(f.removesuffix(" FILE") for f in FORMATS if f.endswith(" FILE"))


def names_a_file(value: str) -> bool:
    """Whether a `format` setting names a file (json-schema FILE, grammar FILE)."""
    return value.strip().partition(" ")[0] in FILE_FORMATS


@dataclass
class Outcome:
    """What a slash command tells the front end."""
    message: str = ""           # a line to print
    error: bool = False
    action: str | None = None   # "reply": answer the last user message; "show"; "stats"; "exit"; "saved"; "loaded"
    part: str = ""              # for "show": one of SHOW_PARTS, or "" for all
    path: Path | None = None    # for "saved" and "loaded": the transcript's file (its state goes beside it)


@dataclass
class Totals:
    """Session totals over every reply, interrupted ones included."""
    replies: int = 0
    interrupted: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: int = 0
    counts: Metrics = field(default_factory=Metrics)

    def add(self, m: Metrics, interrupted: bool) -> None:
        self.replies += 1
        self.interrupted += interrupted
        if m.t_first:
            self.ttft_s += m.ttft
            self.decode_s += m.t_last - m.t_first
            self.decode_tokens += max(m.output_tokens - 1, 0)
        self.counts.merge(m)

    def rows(self) -> list[tuple[str, str]]:
        c = self.counts
        rows = [("replies", f"{self.replies} ({self.interrupted} interrupted)"),
                ("prompt tokens (reused from earlier turns)", f"{c.prompt_tokens} ({c.cached_tokens})"),
                ("tokens generated", str(c.output_tokens)),
                ("mean TTFT", f"{1000 * self.ttft_s / self.replies:.0f} ms" if self.replies else "-"),
                ("decode speed", f"{self.decode_tokens / self.decode_s:.1f} tok/s" if self.decode_s else "-")]
        if c.drafts:
            rows += [("drafts / drafted / accepted", f"{c.drafts} / {c.draft_tokens} / {c.accepted_tokens}"),
                     ("acceptance rate", f"{100 * c.acceptance_rate:.1f}%"),
                     ("mean acceptance length", f"{c.mean_acceptance_length:.2f}"),
                     ("per-position acceptance", " ".join(f"{p:.2f}" for p in c.per_position))]
        return rows


class ChatSession:
    """The messages so far (user and assistant; the system prompt lives in `settings.system`): all of them
    are the transcript /save writes; the model sees those from `start` on, as many as fit its context."""

    def __init__(self, settings: Settings, encoding: str = "preview"):
        """`encoding`: the checkpoint's chat encoding (`Tokenizer.encoding`)."""
        self.settings, self.encoding = settings, encoding
        self.messages: list[dict] = []
        self.start = 0                                  # the first message the model sees
        self.totals = Totals()
        self.tools: list[dict] = []                     # rendered on the system message
        self.last_logprobs: list[TokenLogprob] = []      # the last reply's, when /set logprobs asked for them

    # ---- the conversation ----------------------------------------------------------------------

    def _with_system(self, messages: list[dict]) -> list[dict]:
        system = {"role": "system", "content": self.settings.system} | ({"tools": self.tools} if self.tools else {})
        return ([system] if self.settings.system or self.tools else []) + messages

    @property
    def conversation(self) -> list[dict]:
        """What the model sees: the system prompt and the messages from `start` on."""
        return self._with_system(self.messages[self.start:])

    @property
    def transcript(self) -> list[dict]:
        """The whole conversation, what /save writes."""
        return self._with_system(self.messages)

    def prompt(self, start: int | None = None) -> str:
        """The conversation (from message `start`, default what the model sees) in the DSV4 chat format;
        after a user turn it opens the assistant's reply."""
        s, start = self.settings, self.start if start is None else start
        return encode_messages(self._with_system(self.messages[start:]), thinking=s.thinking,
                               reasoning_effort=s.reasoning_effort, encoding=self.encoding)

    def add_user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def fit(self, prompt_ids: Callable[[str], list[int]], budget: int) -> tuple[list[int], int]:
        """Let the model see as many of the latest exchanges as fit in `budget` prompt tokens (the system
        prompt and the last user message always); returns the prompt's ids and how many messages it no
        longer shows that the previous prompt did."""
        users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
        starts = [0, *(i for i in users if i)] if users else [0]
        ids = prompt_ids(self.prompt(0))
        lo, hi = 0, len(starts) - 1
        if len(ids) <= budget:
            hi = 0
        # the earliest start that fits, by bisection: fewer exchanges never take more tokens
        while lo < hi:
            mid = (lo + hi) // 2
            if len(prompt_ids(self.prompt(starts[mid]))) <= budget:
                hi = mid
            else:
                lo = mid + 1
        hidden = max(starts[lo] - self.start, 0)
        self.start = starts[lo]
        return (ids if lo == 0 else prompt_ids(self.prompt())), hidden

    def add_reply(self, parsed: dict, metrics: Metrics, interrupted: bool) -> dict:
        """Keep a reply, an assistant message as `responses.visible_message` gives it (content, reasoning,
        tool calls); an interrupted one is kept and marked."""
        message = {k: v for k, v in parsed.items() if v or k == "content"}
        if interrupted:
            message["interrupted"] = True
        self.messages.append(message)
        self.totals.add(metrics, interrupted)
        return message

    def settings_rows(self) -> list[tuple[str, str]]:
        return [(name, format_value(getattr(self.settings, name))) for name in SETTABLE]

    # ---- slash commands ------------------------------------------------------------------------

    def command(self, line: str) -> Outcome:
        name, _, arg = line.strip().partition(" ")
        if name not in COMMANDS:
            close = difflib.get_close_matches(name, COMMANDS, 1)
            hint = f"did you mean {close[0]}? " if close else ""
            return Outcome(f"unknown command {name}; {hint}/help lists the commands", error=True)
        try:
            return getattr(self, "_" + name[1:])(arg.strip())
        except UsageError as e:
            return Outcome(str(e), error=True)

    def _help(self, arg: str) -> Outcome:
        width = max(len(f"{n} {a}") for n, (a, _) in COMMANDS.items())
        lines = [f"{f'{n} {a}':<{width}}  {h}" for n, (a, h) in COMMANDS.items()]
        lines += ['"""  start and end a multi-line message', "Ctrl-C  stop a reply", "Ctrl-D  quit"]
        return Outcome("\n".join(lines))

    def _clear(self, arg: str) -> Outcome:
        self.messages.clear()
        self.start = 0
        return Outcome("conversation cleared")

    def _regen(self, arg: str) -> Outcome:
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if not self.messages:
            raise UsageError("/regen: nothing to answer yet")
        return Outcome(action="reply")

    def _undo(self, arg: str) -> Outcome:
        if not self.messages:
            raise UsageError("/undo: the conversation is empty")
        if self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()
        self.start = min(self.start, len(self.messages))
        return Outcome(f"removed the last exchange; {len(self.messages)} messages left")

    def _system(self, arg: str) -> Outcome:
        self.settings = dataclasses.replace(self.settings, system=arg)
        return Outcome(f"system prompt set: {arg}" if arg else "system prompt removed")

    def _tools(self, arg: str) -> Outcome:
        self.tools = load_tools(arg, "/tools") if arg else []
        names = ", ".join(t["function"]["name"] for t in self.tools)
        return Outcome(f"tools: {names}" if arg else "tools removed")

    def _set(self, arg: str) -> Outcome:
        if not arg:
            return Outcome(action="show", part="settings")
        key, _, text = arg.partition(" ")
        name, text = _ALIASES.get(key.replace("-", "_")), text.strip()
        if name is None:
            close = difflib.get_close_matches(key, SETTABLE, 1)
            hint = f"did you mean {close[0]}?" if close else "/set alone lists them"
            raise UsageError(f"/set: unknown setting {key!r}; {hint}")
        if not text:
            raise UsageError(f"/set {name}: give a value ({SPEC[name].rule or SPEC[name].help})")
        unset = SPEC[name].default is None and text.lower() in ("unset", "none")
        value = None if unset else parse_value(name, text, f"/set {name}")
        self.settings = without_unlimited(dataclasses.replace(self.settings, **{name: value}))
        return Outcome(f"{name} = {format_value(getattr(self.settings, name))}")

    def _show(self, arg: str) -> Outcome:
        if arg and arg not in SHOW_PARTS:
            raise UsageError(f"/show: unknown part {arg!r}; parts: {', '.join(SHOW_PARTS)}")
        return Outcome(action="show", part=arg)

    def _stats(self, arg: str) -> Outcome:
        return Outcome(action="stats")

    def _save(self, arg: str) -> Outcome:
        if not arg:
            raise UsageError("/save: give a file name")
        path = Path(arg).expanduser()
        if path.exists() and not path.is_file():    # a device, a directory, a pipe: never replaced
            raise UsageError(f"/save {arg}: not a regular file")
        settings = {name: getattr(self.settings, name) for name in SETTABLE if name != "system"}
        unsaved = settings.pop("format") if names_a_file(self.settings.format) else None
        data = json.dumps({"messages": self.transcript, "settings": settings}, ensure_ascii=False, indent=2)
        try:  # write a temporary file next to the target, then rename: a crash never leaves half a file
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(data + "\n")
            os.replace(tmp, path)
        except OSError as e:
            raise UsageError(f"/save {arg}: {e.strerror}") from None
        note = f" (not the format {unsaved}: /load reads no file a transcript names)" if unsaved else ""
        return Outcome(f"saved {len(self.transcript)} messages to {path}{note}", action="saved", path=path)

    def _load(self, arg: str) -> Outcome:
        if not arg:
            raise UsageError("/load: give a file name")
        try:
            data = read_json(Path(arg).expanduser())
        except OSError as e:
            raise UsageError(f"/load {arg}: {e.strerror}") from None
        except ValueError as e:
            raise UsageError(f"/load {arg}: {e}") from None
        data = data if isinstance(data, dict) else {"messages": None}    # a list or a string is no conversation
        messages, settings = data.get("messages"), data.get("settings", {})
        if not isinstance(messages, list) or not isinstance(settings, dict):
            raise UsageError(f'/load {arg}: expected {{"messages": [...], "settings": {{...}}}} as /save writes')
        try:
            if messages:
                encode_messages(messages)  # checks every message
        except ValueError as e:
            raise UsageError(f"/load {arg}: {e}") from None
        values = {}
        for name, value in settings.items():
            name = RENAMED.get(name, name)       # a transcript saved before a key's rename
            if name not in SETTABLE:
                raise UsageError(f"/load {arg}: settings.{name}: not a chat setting")
            unset = value is None and SPEC[name].default is None
            values[name] = None if unset else check(name, value, f"/load {arg}: settings.{name}", setting=True)
            if name == "format" and names_a_file(value):
                raise UsageError(f"/load {arg}: settings.format {value!r}: a transcript may not name a file to read "
                                 "(/set format after /load)")
        has_system = bool(messages) and messages[0]["role"] == "system"
        values["system"] = messages[0]["content"] if has_system else ""
        self.settings = without_unlimited(dataclasses.replace(self.settings, **values))
        self.messages, self.start = messages[has_system:], 0
        return Outcome(f"loaded {len(messages)} messages from {arg}", action="loaded", path=Path(arg).expanduser())

    def _exit(self, arg: str) -> Outcome:
        return Outcome(action="exit")


def state_file(transcript: Path) -> Path:
    """Where /save puts a conversation's decode state: beside its transcript."""
    return transcript.with_name(transcript.name + ".safetensors")


def read_message(read: Callable[[str], str], prompt: str = ">>> ", more: str = "... ") -> str:
    """One message from `read` (input()): a line, or a block between lines that start and end with \"\"\".
    At end of input inside a block the block so far is the message; EOFError otherwise."""
    line = read(prompt)
    if not line.lstrip().startswith('"""'):
        return line
    body = line.lstrip()[3:]
    if body.rstrip().endswith('"""'):  # """one line"""
        return body.rstrip()[:-3]
    lines = [body] if body else []
    while True:
        try:
            line = read(more)
        except EOFError:
            break
        if line.rstrip().endswith('"""'):
            lines.append(line.rstrip()[:-3])
            break
        lines.append(line)
    return "\n".join(lines).strip("\n")
