"""The command-line options of the model verbs, made from the settings table.

A verb module declares its typer command with them; `dsv4cli.cli` lists the verb and imports its
module only when it runs:

    from dsv4cli.options import CliOptions, model_options

    @model_options("prompt", "raw", "json")  # plus the options for these keys of the [generate] section
    def generate(opts: CliOptions) -> int:
        settings, _ = opts.resolve()
        ...
"""
import functools
import inspect
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from dsv4cli.config import SPEC, Settings, format_value, resolve
from dsv4cli.hub import missing_model

# The options of every model verb: model, sampling and speculative keys.
SHARED_KEYS = tuple(k.name for k in SPEC.values() if k.section in ("model", "sampling", "speculative"))


# Where each setting of this invocation came from (its `resolve`): an error raised later, at load, names the
# place of the value the user must change (`placed`).
SOURCES: dict[str, str] = {}
_FLAG_KEYS = {flag: name for name, key in SPEC.items() for flag in key.flags}


@dataclass
class CliOptions:
    """What the shared options of one invocation said; `flags` holds only keys given on the command line."""

    config: Path | None
    flags: dict[str, Any]
    debug: bool

    def resolve(self) -> tuple[Settings, dict[str, str]]:
        return resolve_invocation(self.config, self.flags)


def resolve_invocation(config: Path | None, flags: dict[str, Any]) -> tuple[Settings, dict[str, str]]:
    """`config.resolve` for this invocation, its sources kept in SOURCES."""
    settings, sources = resolve(config, flags)
    SOURCES.clear()
    SOURCES.update(sources)
    return settings, sources


def placed(message: str) -> str:
    """An error that starts with a setting's flag (`--max-seq-len 9000: ...`, as code that checks a value
    writes it) said with the place the value came from when that was a config file or the environment:
    `run.toml [model].max_seq_len 9000: ...`, `DSV4_MAX_SEQ_LEN 9000: ...`."""
    flag = re.match(r"--[a-z0-9-]+(?=[ :])", message)
    name = _FLAG_KEYS.get(flag.group()) if flag else None
    source = SOURCES.get(name, "flag") if name else "flag"
    if source.startswith("config "):
        path, place = source.removeprefix("config ").rsplit(" ", 1)
        return f"{path} {place}" + message[flag.end():]
    if source.startswith("env "):
        return source.removeprefix("env ") + message[flag.end():]
    return message          # a flag, or a default a flag would change


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
    kind = str if key.auto else key.type        # "auto" or a number, read by config.check
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind | None)


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


def with_options(keys: tuple[str, ...], config: bool) -> Callable[[Callable], Callable]:
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
    return with_options(SHARED_KEYS + keys, config=True)


def check_model_dir(s: Settings) -> None:
    """A model verb's missing model directory, said before the verb imports torch to load the model (the line
    `loading.model_config` says)."""
    if not s.model_dir.is_dir():
        raise missing_model(s.model or str(s.model_dir))
