"""`dsv4 chat`: talk with the model in the terminal; plain lines in and out when stdin is not a terminal.

Each turn re-encodes the whole conversation with the DSV4 chat format; the engine resumes the previous
turn's state and prefills only what follows the shared prefix. /save writes the engine's state beside the
transcript, and /load (or --resume) puts it back, so a saved chat continues without a prefill. Ctrl-C stops a
reply between two engine steps and keeps its text.
"""
import atexit
import contextlib
import dataclasses
import json
import signal
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.text import Text

from dsv4cli.config import Settings
from dsv4cli.engine import EngineAPI, drafter_label
from dsv4cli.errors import UsageError
from dsv4cli.loading import load_engine, sampling_params
from dsv4cli.openai.responses import visible_message
from dsv4cli.options import CliOptions, model_options
from dsv4cli.structured import format_grammar

from .session import COMMANDS, SETTABLE, ChatSession, Outcome, read_message, state_file
from .tui import LiveReply, PlainReply, header, model_rows, printable, reply_view, rows_table

HISTORY_FILE = Path.home() / ".dsv4_history"


@contextlib.contextmanager
def sigint_flag():
    """Ctrl-C appends to the yielded list instead of raising, so a reply stops between engine steps,
    never in the middle of one (which could leave the engine's state half updated)."""
    pressed = []
    previous = signal.signal(signal.SIGINT, lambda *_: pressed.append(True))
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


class Chat:
    """The chat loop on a terminal (tty: readline prompt, live view) or on pipes (plain lines)."""

    def __init__(self, engine: EngineAPI, session: ChatSession, tty: bool):
        self.engine, self.session, self.tty = engine, session, tty
        # on a pipe stdout carries the replies only; everything else goes to stderr, uncoloured
        self.console = Console(highlight=False) if tty else Console(file=sys.stderr, highlight=False,
                                                                    color_system=None)
        self.format = session.settings.format       # the answers' form, as last checked
        self.grammars: dict = {}                    # (format, thinking) -> the engine's grammar for it

    def run(self) -> int:
        """The read-reply loop: 0 at the end of input or /exit; 130 when a piped run is interrupted."""
        if self.tty:
            self.console.print(header(self.engine, self.session.settings))
        while True:
            try:
                code = self.turn()
            except EOFError:
                if self.tty:
                    self.console.print()
                return 0
            except KeyboardInterrupt:  # at the prompt (a reply catches its own)
                if not self.tty:
                    return 130
                self.console.print("\n[dim]Use Ctrl-D or /exit to quit[/]")
                continue
            if code is not None:
                return code

    def turn(self) -> int | None:
        """Read a message or a command and act on it; an exit code when the chat ends."""
        line = read_message(input, *((">>> ", "... ") if self.tty else ("", "")))
        if not line.strip():
            return None
        if line.startswith("/"):
            outcome = self.session.command(line)
            if outcome.action == "exit":
                return 0
            self.handle(outcome)
            if outcome.action != "reply":
                return None
        else:
            self.session.add_user(line)
        return None if self.reply() or self.tty else 130

    def handle(self, outcome: Outcome) -> None:
        if self.session.settings.format != self.format:    # /set format or /load: checked before it is said
            try:
                self.grammar()
                self.format = self.session.settings.format
            except ValueError as e:
                self.session.settings = dataclasses.replace(self.session.settings, format=self.format)
                return self.error(f"format: {e}")
        if outcome.error:
            self.error(outcome.message)
        elif outcome.message:
            self.console.print(Text(outcome.message))
        if outcome.action == "show":
            self.show(outcome.part)
        elif outcome.action == "stats":
            self.console.print(rows_table("session", self.session.totals.rows()))
        s = self.session.settings
        if (s.drafts, s.verify) != (self.engine.drafts, self.engine.verify):   # /set drafts or verify, or /load
            self.rebuild_engine()
        if outcome.action == "saved":
            self.save_state(outcome.path)
        elif outcome.action == "loaded":
            self.show_conversation()
            self.load_state(outcome.path)

    def show_conversation(self) -> None:
        """On a terminal, a loaded conversation as it looked when typed and answered (a pipe gets answers only)."""
        if not self.tty:
            return
        for m in self.session.messages:
            if m["role"] == "user":
                self.console.print(Text(f">>> {printable(m['content'])}"), soft_wrap=True)
            elif m["role"] == "assistant":
                self.console.print(reply_view(m.get("reasoning_content") or "", m.get("content") or ""))
                for call in m.get("tool_calls") or []:
                    f = call.get("function", call)
                    self.console.print(Text(f"tool call: {f.get('name')}({f.get('arguments', '')})", style="dim"))
                if m.get("interrupted"):
                    self.console.print(Text("(interrupted)", style="yellow"))

    def grammar(self):
        """The answers' grammar for the format setting (None: text), made once per format and thinking mode."""
        s = self.session.settings
        if (s.format, s.thinking) not in self.grammars:
            self.grammars[s.format, s.thinking] = format_grammar(s.format, self.engine.tok,
                                                                 self.engine.model_info.vocab_size, s.thinking)
        return self.grammars[s.format, s.thinking]

    def error(self, message: str) -> None:
        self.console.print(Text(f"error: {message}", style="red"), soft_wrap=True)     # one line, however long

    def rebuild_engine(self) -> None:
        """A new engine for the new drafts setting or verify rule; the model stays loaded."""
        s, old = self.session.settings, self.engine
        try:
            self.engine = old.resized(1, s.drafts, verify=s.verify)
        except ValueError as e:
            self.session.settings = dataclasses.replace(s, drafts=old.drafts, verify=old.verify)
            self.error(f"drafts {s.drafts}: {e}")

    def state_header(self) -> dict[str, str]:
        """What a state file names besides the engine's identity; the encoding must match to load it."""
        s = self.session.settings
        return {"model": s.model_name, "encoding": self.session.encoding,
                "settings": json.dumps({name: getattr(s, name) for name in SETTABLE if name != "system"})}

    def save_state(self, transcript: Path) -> None:
        """The engine's state of the conversation beside its transcript (an older one there is removed)."""
        path = state_file(transcript)
        if path.exists() and not path.is_file():    # a device, a directory, a pipe: neither replaced nor removed
            self.error(f"the decode state was not saved: {path} is not a regular file")
            return
        try:
            n = self.engine.save_state(str(path), self.state_header())
        except (ValueError, OSError) as e:
            self.error(f"the decode state was not saved: {e}")
            return
        if n:
            self.console.print(Text(f"saved the decode state of {n} tokens to {path}"))
        else:
            path.unlink(missing_ok=True)

    def load_state(self, transcript: Path) -> None:
        """The state saved beside a transcript into the engine, which the next reply resumes; a state of another
        model or encoding is refused in one line (the transcript stays loaded)."""
        path = state_file(transcript)
        if not path.is_file():
            return
        try:
            n = self.engine.load_state(str(path), self.state_header())
        except ValueError as e:
            self.error(f"{path}: state refused: {e}; the conversation loads without it")
            return
        self.console.print(Text(f"resumed the decode state of {n} tokens: the next reply prefills only what follows"))

    def show(self, part: str) -> None:
        s = self.session
        if part in ("", "settings"):
            self.console.print(rows_table("settings", s.settings_rows()))
        if part in ("", "model"):
            self.console.print(rows_table("model", model_rows(self.engine, s.settings)))
        if part in ("", "prompt"):
            if not s.conversation:
                self.console.print(Text("prompt: the conversation is empty", style="dim"))
                return
            prompt = s.prompt()
            n = len(self.engine.tok.encode(prompt))
            self.console.print(Text(f"prompt ({n} tokens; the next turn prefills only what follows the cached "
                                    "state of the conversation)", style="bold"))
            self.console.print(Text(printable(prompt)), soft_wrap=True)  # as is: no wrapping newlines added
        if part == "logprobs":
            self.show_logprobs()

    def show_logprobs(self) -> None:
        """The last reply's tokens: each one's logprob and the alternatives /set logprobs N asked for."""
        if not self.session.last_logprobs:
            hint = "/set logprobs N, then a reply" if self.session.settings.logprobs is None else "no reply yet"
            self.console.print(Text(f"logprobs: none; {hint}", style="dim"))
            return
        tok = self.engine.tok
        rows = [(repr(tok.decode([e.token])), f"{e.logprob:.4f}  " + "  ".join(
                 f"{tok.decode([t])!r} {v:.3f}" for t, v in e.top)) for e in self.session.last_logprobs]
        self.console.print(rows_table("logprobs", rows))

    def reply(self) -> bool:
        """Stream the answer to the last user message into the history; False if Ctrl-C stopped it."""
        s = self.session.settings
        try:
            params = sampling_params(s)
            params.grammar = self.grammar()
            seq = self.engine.submit(self.fitting_prompt(), params)
        except ValueError as e:  # the last message alone does not fit in max_seq_len, or its format is unreadable
            self.session.messages.pop()
            self.error(f"{e}; your message was dropped")
            return True
        tok = self.engine.tok
        drafting = drafter_label(self.engine)
        view = (LiveReply(self.console, seq, tok, drafting, s.thinking, self.engine.status) if self.tty
                else PlainReply(seq, tok, s.thinking))
        with sigint_flag() as stop, view:
            try:
                while not seq.finished and not stop:
                    decoding = seq.metrics.t_first > 0   # the first step is the prefill: not a decode step
                    t = time.perf_counter()
                    self.engine.step()
                    if decoding:
                        view.step_s.append(time.perf_counter() - t)
                    view.update()
            finally:
                if not seq.finished:
                    self.engine.cancel(seq)
        if seq.error is not None:      # the engine failed this reply: nothing of it joins the history
            self.session.messages.pop()
            self.error(f"{seq.error}; your message was dropped")
            return True
        interrupted = seq.finish_reason == "cancelled"
        self.session.last_logprobs = seq.logprobs
        self.session.add_reply(visible_message(tok, seq.text[: seq.emitted], s.thinking), seq.metrics, interrupted)
        return not interrupted


    def fitting_prompt(self) -> list[int]:
        """The conversation's prompt: the latest exchanges that leave room for the reply in max_seq_len.
        The room is max_tokens, but at most a quarter of max_seq_len, so a long max_tokens still leaves
        history for the model (the reply then ends when the context is full). Says so in one line when the
        model stops seeing messages; the transcript (/save) keeps them all."""
        max_seq_len, s = self.engine.max_seq_len, self.session.settings
        room = min(s.max_tokens, max_seq_len // 4)
        ids, hidden = self.session.fit(self.engine.tok.encode, max_seq_len - room)
        if hidden:
            self.console.print(Text(f"context full: the model no longer sees the {hidden} oldest messages (the system "
                                    "prompt stays; /save keeps them all)", style="yellow"))
        return ids


def setup_readline() -> None:
    """Line editing, history (kept across sessions), bracketed paste and Tab completion of commands."""
    try:
        import readline
    except ImportError:  # e.g. Windows: plain input() still works
        return

    def complete(text: str, state: int) -> str | None:
        line = readline.get_line_buffer()
        words = COMMANDS if " " not in line else SETTABLE if line.startswith("/set ") and line.count(" ") == 1 else ()
        options = [w + " " for w in words if w.startswith(text)]
        return options[state] if state < len(options) else None

    readline.parse_and_bind("set enable-bracketed-paste on")
    readline.parse_and_bind("tab: complete")
    readline.set_completer_delims(" \t\n")
    readline.set_completer(complete)
    readline.set_history_length(1000)
    with contextlib.suppress(OSError):
        readline.read_history_file(HISTORY_FILE)

    def save_history() -> None:
        with contextlib.suppress(OSError):
            readline.write_history_file(HISTORY_FILE)

    atexit.register(save_history)


def run_chat(s: Settings, resume: Path | None = None) -> int:
    """The chat; `resume`: a transcript /save wrote, loaded first (with its decode state, when one is beside it)."""
    if resume is not None and not resume.is_file():
        raise UsageError(f"--resume {resume}: no such file")
    tty = sys.stdin.isatty() and sys.stdout.isatty()
    try:
        # one conversation: one sequence's cache, which each turn resumes
        engine = load_engine(dataclasses.replace(s, max_batch=1), "chat")
    except KeyboardInterrupt:
        return 130
    chat = Chat(engine, ChatSession(s, engine.tok.encoding), tty)
    try:
        chat.grammar()
    except ValueError as e:
        raise UsageError(f"--format: {e}") from None
    if tty:
        setup_readline()
    if resume is not None:
        outcome = chat.session.command(f"/load {resume}")
        if outcome.error:
            raise UsageError(f"--resume: {outcome.message}")
        chat.handle(outcome)
    return chat.run()


@model_options("system", "system_file", "thinking", "reasoning_effort", "format")
def chat(opts: CliOptions, resume: Path | None = typer.Option(
        None, "--resume", help="Continue a chat /save wrote: its transcript, and its decode state when beside it "
        "(FILE.safetensors), so the next reply prefills only what follows", dir_okay=False)) -> int:
    settings, _ = opts.resolve()
    return run_chat(settings, resume)
