"""The `dsv4` command: the typer app, the verb table, `config show`, `run`, and main().

Every verb but `config` and `run` lives in its own module (the model verbs take their flags from
`dsv4cli.options`); this module knows them by name (VERBS) and imports a verb's module only when that verb
runs or shows its help, so `dsv4 --help` and `dsv4 config show` start without torch. `dsv4 run FILE.toml`
finds the function for the file's mode in MODES the same way.
"""

import atexit
import contextlib
import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path
from typing import Any, NamedTuple

import typer
from rich.markup import escape
from rich.table import Table

from dsv4cli.config import REDACTED, SPEC, format_value, shown_value
from dsv4cli.errors import RunError, UsageError
from dsv4cli.options import CliOptions, placed, resolve_invocation, with_options
from dsv4cli.terminal import table_console

# Idle OpenMP threads sleep instead of spinning, so a spinning thread never takes the core a sibling (or
# another process) needs. The OpenMP runtime reads this once, when torch loads it (a verb imports torch
# when it runs), so it is set here, unless the user chose a policy.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# torch's profiler (kineto; bench counts kernel launches with it) writes "USDT: ... profiler_start" and
# "profiler_stop" lines to stderr at every profile; a level above its highest (USDT, 5) keeps it quiet.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

# typer's help shows a type for every option, switches too (`--json <bool>`, `--help <bool>`), as if they took
# a value; a switch shows none.
_display_type = typer.core.TyperOption.display_type_rich
typer.core.TyperOption.display_type_rich = lambda self, ctx: None if self.is_flag else _display_type(self, ctx)


class Verb(NamedTuple):
    command: str    # "module:function", the typer command function
    help: str       # what `dsv4 --help` lists and `dsv4 VERB --help` starts with (the function has no docstring)
    # `dsv4 VERB SUB ...` runs SUB's "module:function"; any other first argument is the verb's own (an input file)
    subverbs: dict[str, str] = {}


VERBS = {
    "chat": Verb("dsv4cli.chat.command:chat", "Chat with the model: streamed replies with live speed and draft "
                 "acceptance, /help for commands. When stdin is not a terminal: one message per line in, one "
                 "reply per line out."),
    "generate": Verb("dsv4cli.generate:generate", "Generate a reply to one prompt with the model (the bundled one "
                     "by default); the prompt can come from -p, --prompt-file or stdin."),
    "batch": Verb("dsv4cli.batch.command:batch", "Answer every request of a JSONL file (OpenAI batch format) "
                  "into -o OUT.jsonl; --resume continues a run, --shard I/N answers one shard, `dsv4 batch merge` "
                  "joins the shards.", {"merge": "dsv4cli.batch.command:merge"}),
    "serve": Verb("dsv4cli.serve.command:serve", "Serve the model over an OpenAI-compatible HTTP API "
                  "(/v1/chat/completions, /v1/completions, /v1/responses, streaming) and Anthropic's "
                  "/v1/messages, with continuous batching."),
    "perplexity": Verb("dsv4cli.perplexity:perplexity", "Perplexity of the model on a text (windows of --ctx "
                       "tokens), and KL divergence against logits saved by another run (--save-logits)."),
    "bench": Verb("dsv4cli.bench:bench_command", "Decode speed: plain vs the drafter (DSpark at each length and "
                  "auto, the MTP chain) at several batch sizes and prompt lengths, with peers."),
    "inspect": Verb("dsv4cli.tools.commands:inspect", "Describe a checkpoint from its config and headers: format, "
                    "parameters, layers, memory."),
    "convert": Verb("dsv4cli.tools.commands:convert", "Convert a checkpoint, streaming shard by shard with bounded "
                    "memory."),
}
# `dsv4 run FILE.toml`: mode -> "module:function" taking the resolved Settings and returning an exit code
MODES = {"chat": "dsv4cli.chat.command:run_chat", "generate": "dsv4cli.generate:run_generate",
         "batch": "dsv4cli.batch.runner:run_batch", "serve": "dsv4cli.serve.command:run_serve"}


def load(target: str) -> Callable[..., Any]:
    """The function a "module:function" names, its module imported now."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def load_verb(name: str, target: str | None = None) -> typer.core.TyperCommand:
    """The click command of verb `name` (or of the "module:function" `target`, one of its subverbs, whose
    docstring is its help), its module imported now."""
    single = typer.Typer(add_completion=False)
    single.command(name, help=None if target else VERBS[name].help)(load(target or VERBS[name].command))
    return typer.main.get_command(single)


class _Verbs(typer.core.TyperGroup):
    """The root command: lists every verb from VERBS and imports one only when it is invoked."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        # stand-ins that name and describe the verbs for `dsv4 --help` (and "did you mean ...?")
        verbs = {name: typer.core.TyperCommand(name, help=verb.help) for name, verb in VERBS.items()}
        self.commands = {**verbs, **self.commands}

    def resolve_command(self, ctx: Any, args: list[str]) -> tuple[str | None, Any, list[str]]:
        name, command, rest = super().resolve_command(ctx, args)
        if name not in VERBS:
            return name, command, rest
        if rest and rest[0] in VERBS[name].subverbs:
            sub = f"{name} {rest[0]}"
            return sub, load_verb(sub, VERBS[name].subverbs[rest[0]]), rest[1:]
        return name, load_verb(name), rest


app = typer.Typer(
    name="dsv4",
    cls=_Verbs,
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,  # main() reports errors
    context_settings={"help_option_names": ["-h", "--help"]},
)
config_app = typer.Typer(help="Show how settings resolve.", no_args_is_help=True)
app.add_typer(config_app, name="config")


def _print_version(value: bool) -> None:
    if value:
        print(f"dsv4 {version('dsv4cli')}")
        raise typer.Exit()


@app.callback()
def _root(
    _version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit"
    ),
    _debug: bool = typer.Option(False, "--debug", help="Show tracebacks (here or after the verb; or DSV4_DEBUG=1)"),
) -> None:
    """Terminal inference for DeepSeek V4 Flash: chat, one-shot generation, JSONL batch, an OpenAI-compatible
    server, config-driven runs."""


# config show and run take every settings key as a flag (config show's own --json prints JSON)
SETTINGS_KEYS = tuple(name for name, key in SPEC.items() if not key.file_only)


@config_app.command("show")
@with_options(tuple(name for name in SETTINGS_KEYS if name != "json"), config=True)
def config_show(
    opts: CliOptions, as_json: bool = typer.Option(False, "--json", help="Print a JSON object instead")
) -> int:
    """Print every setting with its resolved value and where it came from."""
    settings, sources = opts.resolve()
    values = {name: shown_value(name, value) for name, value in asdict(settings).items()}
    if as_json:
        print(json.dumps({name: {"value": values[name], "source": sources[name]} for name in SPEC}, indent=2))
        return 0
    table = Table("key", "value", "source")
    for name, key in SPEC.items():
        value = values[name] if values[name] is REDACTED else format_value(values[name])
        table.add_row(*map(escape, (key.place, value, sources[name])))
    table_console().print(table)
    return 0


# run: the file's mode decides which of them matter
@app.command()
@with_options(SETTINGS_KEYS, config=False)
def run(
    opts: CliOptions, file: Path = typer.Argument(..., help="TOML config file with a mode", dir_okay=False)
) -> int:
    """Run what a config file describes (its `mode`); flags override the file."""
    if not file.exists():
        raise UsageError(f"{file}: no such config file; `dsv4 run` takes a TOML file whose mode says what to run "
                         f"(configs/*.toml); to use a model, e.g. `dsv4 chat --model {file}`")
    settings, _ = resolve_invocation(file, opts.flags)
    if settings.mode is None:
        raise UsageError(f'{file}: mode: missing; set it to "chat", "generate", "batch" or "serve" at the top')
    return load(MODES[settings.mode])(settings)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code: 0 ok, 1 internal error, 2 usage or input error, 130 interrupted."""
    return run_verb(sys.argv[1:] if argv is None else argv)


def dsv4() -> None:
    """The `dsv4` command: main(), then the exit handlers and an exit without Python's teardown, which frees
    torch's objects one by one (about 1 s after a chat on a small CPU: /exit would wait for it; the OS frees
    them at once). Every file the run writes is closed (or an unbuffered descriptor) by then."""
    code = [1]

    def exit_now() -> None:        # registered first, so it runs after every other exit handler
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code[0])

    atexit.register(exit_now)
    try:
        code[0] = main()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code[0] = e.code or 0
        else:
            print(e.code, file=sys.stderr)      # as Python's own exit would
    sys.exit(code[0])


def run_verb(argv: list[str]) -> int:
    debug = "--debug" in argv or os.environ.get("DSV4_DEBUG") == "1"    # before or after the verb
    try:
        return app(args=argv, prog_name="dsv4", standalone_mode=False) or 0
    except typer.TyperException as e:  # click's usage errors: unknown flag, bad value, missing argument
        if message := e.format_message():  # empty when typer already printed the help (no_args_is_help)
            print(f"error: {message}", file=sys.stderr)
        return e.exit_code
    except UsageError as e:
        if debug:
            traceback.print_exc()
        print(f"error: {placed(str(e))}", file=sys.stderr)
        return 2
    except RunError as e:
        if debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 1
    except SystemExit as e:
        # typer ends a run whose reader went away (`dsv4 generate ... | head`, EPIPE) with sys.exit(1), stdout
        # wrapped so that the exit's flush cannot fail again: that is no failure of the run, so exit quietly
        if isinstance(e.__context__, BrokenPipeError):
            return 0
        raise
    except (typer.Abort, KeyboardInterrupt):  # click turns Ctrl-C into Abort
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the one place an internal failure becomes a one-line report
        if debug:
            traceback.print_exc()
        first = (str(e).splitlines() or [""])[0]
        hint = "" if debug else " (run with --debug for the traceback)"
        print(f"error: internal error: {type(e).__name__}: {first}{hint}", file=sys.stderr)
        return 1



if __name__ == "__main__":
    sys.exit(main())
