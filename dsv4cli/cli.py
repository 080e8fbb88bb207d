"""The `dsv4` command: the typer app, the options every model verb shares, `config show`, `run`, and main().

A verb in another module adds itself to `app` with the shared options:

    from dsv4cli.cli import CliOptions, app, model_options

    @app.command()
    @model_options("prompt", "raw", "json")  # plus the options for these keys of the [generate] section
    def generate(opts: CliOptions) -> int:
        settings, _ = opts.resolve()
        ...

and a mode `dsv4 run FILE.toml` can dispatch to registers itself with `register_mode("generate", fn)`.
"""

import functools
import inspect
import json
import os
import sys
import traceback
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dsv4cli.config import SPEC, Settings, format_value, resolve
from dsv4cli.errors import RunError, UsageError
from dsv4cli.tools.commands import register as register_tool_commands

# Idle OpenMP threads sleep instead of spinning, so a spinning thread never takes the core a sibling (or
# another process) needs. The OpenMP runtime reads this once, when torch loads it: the verbs imported at
# the bottom of this module import torch, so it is set here, unless the user chose a policy.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# typer's help shows a type for every option, switches too (`--json <bool>`, `--help <bool>`), as if they took
# a value; a switch shows none.
_display_type = typer.core.TyperOption.display_type_rich
typer.core.TyperOption.display_type_rich = lambda self, ctx: None if self.is_flag else _display_type(self, ctx)

app = typer.Typer(
    name="dsv4",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,  # main() reports errors
    context_settings={"help_option_names": ["-h", "--help"]},
)
config_app = typer.Typer(help="Show how settings resolve.", no_args_is_help=True)
app.add_typer(config_app, name="config")
register_tool_commands(app)  # inspect, convert

# The options of every model verb: model, sampling and speculative keys.
SHARED_KEYS = tuple(k.name for k in SPEC.values() if k.section in ("model", "sampling", "speculative"))

MODES: dict[str, Callable[[Settings], int]] = {}


def register_mode(name: str, run: Callable[[Settings], int]) -> None:
    """Let `dsv4 run` dispatch config files with `mode = name` to `run`, which returns an exit code."""
    MODES[name] = run


@dataclass
class CliOptions:
    """What the shared options of one invocation said; `flags` holds only keys given on the command line."""

    config: Path | None
    flags: dict[str, Any]
    debug: bool

    def resolve(self) -> tuple[Settings, dict[str, str]]:
        return resolve(self.config, self.flags)


def _option(name: str) -> inspect.Parameter:
    """The typer option for a settings key: None by default, so only a flag that is given counts."""
    key = SPEC[name]
    notes = [key.rule, f"default {format_value(key.default)}" if key.default not in (None, []) else ""]
    help = f"{key.help} ({'; '.join(filter(None, notes))})" if any(notes) else key.help
    item = typing.get_args(key.type)[0] if typing.get_origin(key.type) is list else None
    option = typer.Option(
        None,
        *key.flags,
        help=help,
        show_default=False,
        rich_help_panel=key.section.title(),
        metavar=f"<{item.__name__}>" if item else None,  # a repeatable option takes one value each time
    )
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=key.type | None)


_CONFIG = inspect.Parameter(
    "config",
    inspect.Parameter.KEYWORD_ONLY,
    default=typer.Option(None, "-c", "--config", help="TOML config file", dir_okay=False),
    annotation=Path | None,
)
_DEBUG = inspect.Parameter(
    "debug",
    inspect.Parameter.KEYWORD_ONLY,
    default=typer.Option(False, "--debug", help="Show tracebacks (or set DSV4_DEBUG=1)"),
    annotation=bool,
)


def _with_options(keys: tuple[str, ...], config: bool) -> Callable[[Callable], Callable]:
    """Decorator: give typer fn's own parameters plus the options for `keys` (and -c/--config, --debug),
    and pass those to fn as one `opts: CliOptions`."""

    def decorate(fn: Callable) -> Callable:
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "opts"]
        params = [*own, *map(_option, keys), *([_CONFIG] if config else []), _DEBUG]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            flags = {name: kwargs.pop(name) for name in keys}
            opts = CliOptions(kwargs.pop("config", None), flags, kwargs.pop("debug"))
            return fn(opts=opts, **kwargs)

        command.__signature__ = inspect.Signature(params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


def model_options(*keys: str) -> Callable[[Callable], Callable]:
    """Decorator for a model verb: adds the shared options, the options for the settings `keys` it also
    takes (e.g. "prompt"), -c/--config and --debug; the verb gets them as its `opts: CliOptions` parameter."""
    return _with_options(SHARED_KEYS + keys, config=True)


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
    """Terminal inference for DeepSeek V4 Flash: chat, one-shot generation, JSONL batch, config-driven runs."""


@config_app.command("show")
@model_options()
def config_show(
    opts: CliOptions, as_json: bool = typer.Option(False, "--json", help="Print a JSON object instead")
) -> int:
    """Print every setting with its resolved value and where it came from."""
    settings, sources = opts.resolve()
    values = asdict(settings)
    if as_json:
        print(json.dumps({name: {"value": values[name], "source": sources[name]} for name in SPEC}, indent=2))
        return 0
    table = Table("key", "value", "source")
    for name, key in SPEC.items():
        table.add_row(*map(escape, (key.place, format_value(values[name]), sources[name])))
    Console().print(table)
    return 0


# run takes every settings key as a flag: the file's mode decides which ones matter.
@app.command()
@_with_options(tuple(name for name, key in SPEC.items() if not key.file_only), config=False)
def run(
    opts: CliOptions, file: Path = typer.Argument(..., help="TOML config file with a mode", dir_okay=False)
) -> int:
    """Run what a config file describes (its `mode`); flags override the file."""
    settings, _ = resolve(file, opts.flags)
    if settings.mode is None:
        raise UsageError(f'{file}: mode: missing; set it to "chat", "generate" or "batch" at the top')
    return MODES[settings.mode](settings)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code: 0 ok, 1 internal error, 2 usage or input error, 130 interrupted."""
    argv = sys.argv[1:] if argv is None else argv
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
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        if debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 1
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


# Verbs in their own modules add themselves to `app` on import.
from dsv4cli import bench, generate  # noqa: E402, F401
from dsv4cli.batch import command as batch_command  # noqa: E402, F401
from dsv4cli.chat import command as chat_command  # noqa: E402, F401

if __name__ == "__main__":
    # Run the importable dsv4cli.cli, not this __main__ copy: verbs register on dsv4cli.cli.app.
    from dsv4cli.cli import main as cli_main

    sys.exit(cli_main())
