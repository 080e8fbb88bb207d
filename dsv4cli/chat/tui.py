"""What the chat shows: the header, the streaming reply with its live status bar, summaries and tables."""
import math
import re
import sys
import time

from rich.console import Console, Group
from rich.control import Control
from rich.live import Live
from rich.live_render import LiveRender
from rich.markdown import Markdown
from rich.segment import ControlType, Segment
from rich.table import Table
from rich.text import Text

from dsv4cli.config import Settings
from dsv4cli.encoding import THINK_END
from dsv4cli.engine import EngineAPI, Metrics, drafter_label
from dsv4cli.model.drafters import drafter_named
from dsv4cli.tokenizer import Tokenizer
from dsv4cli.units import human_count

SPARKS = "▁▂▃▄▅▆▇█"
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # all C0 controls but tab and newline


def printable(text: str) -> str:
    """Model text with control characters removed: they would move the cursor or recolour the terminal."""
    return _CONTROL.sub("", text)


def split_reply(text: str, thinking: bool, tok: Tokenizer, final: bool) -> tuple[str, str]:
    """(reasoning, answer) as shown, without special tokens (a partial one held back until `final`): in
    thinking mode the reply starts with reasoning and ends it with </think>."""
    if not thinking:
        return "", tok.visible(text, final)
    reasoning, found, answer = text.partition(THINK_END)
    return tok.visible(reasoning, final or bool(found)), tok.visible(answer, final)


def ms(seconds: float) -> str:
    return f"{1000 * seconds:.0f} ms" if seconds >= 0.1 else f"{1000 * seconds:.1f} ms"


def sparkline(values: list[float], width: int = 20) -> str:
    """The last `width` values as bars scaled between their min and max."""
    values = values[-width:]
    lo, hi = min(values, default=0), max(values, default=0)
    return "".join(SPARKS[round((v - lo) / (hi - lo) * 7) if hi > lo else 0] for v in values)


def status_bar(m: Metrics, drafting: str, step_s: list[float], steps_run: str | None = None) -> Text:
    """Two lines under a streaming reply: speed and step latency (led by `steps_run`, how the decode steps
    run, e.g. "eager, compiling", when compile is on), then the drafter (`drafting`: `drafter_label`) and
    its acceptance; under auto, the drafts verified per drafting step on average."""
    if not m.t_first:
        return Text(f"prefilling {m.prompt_tokens - m.cached_tokens} prompt tokens…", style="dim")

    def stat(label: str, value: str) -> Text:
        return Text.assemble(f"{label} " if label else "", (value, "bold"))

    decoding = m.output_tokens > 1
    # the reply's mean decode speed so far (the summary shows it over the whole reply); the step sparkline
    # shows the latest steps
    speed = [stat("", f"{m.output_tokens} tok"), stat("", f"{m.tokens_per_s:.1f} tok/s" if decoding else "- tok/s"),
             stat("TTFT", ms(m.ttft)), stat("TPOT", ms(m.tpot) if decoding else "-")]
    if step_s:
        speed.append(stat("step", f"{sparkline(step_s)} {ms(step_s[-1])}"))
    if steps_run and decoding:      # first: a narrow terminal cuts the line's end
        speed.insert(0, stat("", steps_run))
    drafter = [stat("drafter", drafting)]
    if drafting != "off":
        if "auto" in drafting:
            drafter.append(stat("verified", f"{m.draft_tokens / m.drafts:.1f}" if m.drafts else "-"))
        drafter += [stat("accept", f"{100 * m.acceptance_rate:.1f}%" if m.drafts else "-"),
                stat("per position", " ".join(f"{p:.2f}" for p in m.per_position) or "-"),
                stat("mean acceptance length", f"{m.mean_acceptance_length:.2f}")]
    bar = Text("\n", style="dim").join([Text(" · ").join(speed), Text(" · ").join(drafter)])
    bar.no_wrap, bar.overflow = True, "ellipsis"
    return bar


def summary_line(m: Metrics, drafting: str, finish_reason: str | None) -> Text:
    """One line after each reply."""
    reused = f" ({m.cached_tokens} reused)" if m.cached_tokens else ""
    parts = [f"{m.output_tokens} tokens", f"prompt {m.prompt_tokens}{reused}"]
    if m.t_first:
        parts.append(f"TTFT {ms(m.ttft)}")
    if m.output_tokens > 1:
        parts.append(f"{m.tokens_per_s:.1f} tok/s (mean over the reply)")
    if drafting != "off" and m.drafts:
        parts.append(f"accept {100 * m.acceptance_rate:.1f}% (mean length {m.mean_acceptance_length:.2f})")
    line = Text(" · ".join(parts), style="dim")
    if finish_reason == "cancelled":
        line.append(" · interrupted", style="yellow")
    elif finish_reason == "length":
        line.append(" · stopped at max_tokens", style="yellow")
    return line


def reply_view(reasoning: str, answer: str, markdown: bool = True) -> Group:
    """The reasoning dimmed, apart from the answer; the answer as Markdown, or as plain text while it
    streams (rendering Markdown every frame would cost as much as decoding on a fast device)."""
    reasoning, answer = printable(reasoning).strip(), printable(answer).strip()
    parts = []
    if reasoning:
        parts += [Text.assemble(("thinking ", "dim bold"), (reasoning, "dim italic")), Text()]
    if answer:
        parts.append(Markdown(answer) if markdown else Text(answer))
    return Group(*parts)


class Tail:
    """The last `height` lines of a renderable: a long reply streams at the bottom of the screen."""

    def __init__(self, renderable, height: int):
        self.renderable, self.height = renderable, height

    def __rich_console__(self, console, options):
        lines = console.render_lines(self.renderable, options.update(height=None), pad=False)
        for line in lines[-self.height:]:
            yield from line
            yield Segment.line()


class LiveReply:
    """A reply streaming on a terminal: its latest lines with the status bar under them, redrawn at most
    ten times a second. Closing it replaces the live view with the whole reply and a summary line.
    Typing is not echoed meanwhile (it waits for the next prompt), so it can't scramble the view."""

    def __init__(self, console: Console, seq, tok: Tokenizer, drafting: str, thinking: bool, status=None):
        """`drafting`: the engine's `drafter_label`; `status`: its `status` call (how its steps run shows in
        the bar), or None."""
        self.console, self.seq, self.tok, self.drafting, self.thinking = console, seq, tok, drafting, thinking
        self.status = status
        self.step_s: list[float] = []
        self.drawn = 0.0
        self.live = _RewrapAwareLive(self, console=console, auto_refresh=False, transient=True,
                                     vertical_overflow="crop")
        self.tty = _NoEcho()

    def __rich_console__(self, console, options):
        height = max(options.size.height - 3, 1)
        keep = height * options.max_width   # characters: at most what fits on the screen
        reasoning, answer = split_reply(self.seq.text[: self.seq.emitted], self.thinking, self.tok, final=False)
        answer = answer[-keep:]
        reasoning = reasoning[len(reasoning) - max(keep - len(answer), 0):]
        yield Tail(reply_view(reasoning, answer, markdown=False), height)
        yield status_bar(self.seq.metrics, self.drafting, self.step_s,
                         self.status().compile if self.status is not None else None)

    def __enter__(self):
        self.tty.__enter__()
        self.live.start(refresh=True)
        return self

    def __exit__(self, *exc):
        self.live.stop()
        self.tty.__exit__()
        self.console.print(reply_view(*split_reply(self.seq.text[: self.seq.emitted], self.thinking, self.tok,
                                                   final=True)))
        self.console.print(summary_line(self.seq.metrics, self.drafting, self.seq.finish_reason))

    def update(self) -> None:
        if time.perf_counter() - self.drawn >= 0.1:
            self.live.refresh()
            self.drawn = time.perf_counter()


class _RewrapAwareRender(LiveRender):
    """rich's live region, erasing every row its last frame takes after the terminal narrowed: VTE, iTerm2,
    kitty, Windows Terminal and tmux rewrap a line wider than the terminal onto more rows, so erasing the
    rows drawn would leave the rest of the frame above the next one (the reply shown twice)."""

    def __init__(self, renderable, console: Console, **kwargs):
        super().__init__(renderable, **kwargs)
        self.console, self.widths, self.width = console, [], 0

    def __rich_console__(self, console, options):
        segments = list(super().__rich_console__(console, options))
        self.widths = [Segment.get_line_length(line) for line in Segment.split_lines(segments)]
        self.width = options.max_width
        yield from segments

    def rows(self) -> int:
        """Rows the last frame takes now (an xterm, which cuts instead of rewrapping, loses a few rows above
        it on a narrowing: less harm than a duplicate)."""
        width = self.console.width
        if width >= self.width:
            return self.last_render_height
        return sum(max(1, math.ceil(w / width)) for w in self.widths)

    def position_cursor(self) -> Control:
        if self._shape is None:
            return Control()
        up = ((ControlType.CURSOR_UP, 1), (ControlType.ERASE_IN_LINE, 2)) * (self.rows() - 1)
        return Control(ControlType.CARRIAGE_RETURN, (ControlType.ERASE_IN_LINE, 2), *up)

    def restore_cursor(self) -> Control:
        if self._shape is None:
            return Control()
        return Control(ControlType.CARRIAGE_RETURN, *((ControlType.CURSOR_UP, 1), (ControlType.ERASE_IN_LINE, 2))
                       * self.rows())


class _RewrapAwareLive(Live):
    def __init__(self, renderable, **kwargs):
        super().__init__(renderable, **kwargs)
        self._live_render = _RewrapAwareRender(renderable, self.console, vertical_overflow=self.vertical_overflow)


class PlainReply:
    """A reply streaming to a pipe: the answer text only, then a newline."""

    def __init__(self, seq, tok: Tokenizer, thinking: bool):
        self.seq, self.tok, self.thinking, self.written = seq, tok, thinking, 0
        self.step_s: list[float] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.update(final=True)
        sys.stdout.write("\n")
        sys.stdout.flush()

    def update(self, final: bool = False) -> None:
        answer = printable(split_reply(self.seq.text[: self.seq.emitted], self.thinking, self.tok, final)[1])
        sys.stdout.write(answer[self.written:])
        sys.stdout.flush()
        self.written = len(answer)


class _NoEcho:
    """Terminal echo off while a reply streams (a no-op when stdin is not a terminal)."""

    def __enter__(self):
        try:
            import termios
            self.saved = termios.tcgetattr(sys.stdin)
            attrs = termios.tcgetattr(sys.stdin)
            attrs[3] &= ~termios.ECHO
            termios.tcsetattr(sys.stdin, termios.TCSANOW, attrs)
        except (ImportError, OSError, ValueError):
            self.saved = None

    def __exit__(self, *exc):
        if self.saved is not None:
            import termios
            termios.tcsetattr(sys.stdin, termios.TCSANOW, self.saved)


def model_rows(engine: EngineAPI, settings: Settings) -> list[tuple[str, str]]:
    info = engine.model_info
    kind = drafter_named(info.drafter)
    return [("model", str(settings.model_dir)),
            ("format", {"w8a8": "w8a8 (int8 linears)", "fp8+fp4": "fp8+fp4 (the release's bytes)"}.get(info.weights,
                                                                                                   info.weights)),
            ("device", str(engine.device)),
            ("dtype", info.dtype),
            ("tensor parallel", str(settings.tp)),
            ("drafter", drafter_label(engine)),
            ("parameters", human_count(info.parameters)),
            ("layers", f"{info.layers}" + (f" (+{info.drafter_layers} {kind.layers})" if kind else "")),
            ("vocab", str(info.vocab_size)),
            ("max_seq_len", str(engine.max_seq_len)),
            ("KV prefix reuse", "on: a turn prefills only what follows the state the previous turn left")]


def header(engine: EngineAPI, settings: Settings) -> Group:
    info = dict(model_rows(engine, settings))
    facts = [info["format"].split()[0], info["device"], info["dtype"], f"TP {info['tensor parallel']}",
             f"drafter {info['drafter']}", f"{info['parameters']} params"]
    return Group(Text.assemble(("dsv4 chat ", "bold"), (info["model"], "cyan")),
                 Text(" · ".join(facts), style="dim"),
                 Text('/help for commands · """ for multi-line · Ctrl-C stops a reply · Ctrl-D quits', style="dim"))


def rows_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table.grid(padding=(0, 2))
    table.title, table.title_justify, table.title_style = title, "left", "bold"
    table.add_column(style="dim")
    table.add_column()
    for key, value in rows:
        table.add_row(key, Text(value))
    return table
