"""The `dsv4 inspect` and `dsv4 convert` verbs.

Checkpoint and config problems become UsageError: one `error:` line and exit code 2.
"""
import json
import sys
from enum import Enum
from pathlib import Path

import typer

from dsv4cli.errors import UsageError


class Target(str, Enum):
    w8a8 = "w8a8"
    bf16 = "bf16"
    fp4 = "fp4"


def model_dir(value: str) -> Path:
    """A model directory, or a model id found in the local Hugging Face or ModelScope cache."""
    from dsv4cli.hub import is_model_id, missing_model, resolve_model

    path = Path(resolve_model(value))
    if not path.exists() and is_model_id(value):
        raise missing_model(value)
    return path


def inspect(
    model: str | None = typer.Argument(None, metavar="[MODEL]", help="Model directory or id (default: the bundled "
                                       "dsv4-tiny)"),
    tp: int = typer.Option(1, "--tp", min=1, help="Tensor-parallel cards, for the memory per card"),
    check: bool = typer.Option(False, "--check", help="Also check every tensor's presence, shape and dtype"),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON object instead"),
) -> int:
    from dsv4cli.config import BUNDLED_MODEL_DIR

    if model is None and not BUNDLED_MODEL_DIR.is_dir():
        raise UsageError(f"no MODEL given and the bundled model is not installed ({BUNDLED_MODEL_DIR})")
    path = model_dir(model) if model else BUNDLED_MODEL_DIR
    # torch from here: the model is named
    from dsv4cli.model.loader import LoadError
    from dsv4cli.terminal import table_console
    from dsv4cli.tools import inspect as tool

    try:
        info = tool.describe(path, tp)
    except LoadError as e:
        raise UsageError(str(e)) from None
    problems = tool.check(path) if check else []
    if as_json:
        print(json.dumps({**info, **({"problems": problems} if check else {})}, indent=2))
    else:
        table_console().print(tool.render(info))
        for problem in problems:
            print(f"problem: {problem}")
        if check and not problems:
            print(f"check: all {info['tensors']} tensors have the names, shapes and dtypes the config needs")
    if problems:
        raise UsageError(f"{path}: {len(problems)} problem(s) found")
    return 0


def convert(
    source: str = typer.Argument(..., metavar="SRC", help="Official release (FP8/FP4), float or (to fp4) W8A8 "
                                 "checkpoint: a directory or a model id"),
    dst: Path = typer.Argument(..., help="New directory for the converted checkpoint"),
    to: Target = typer.Option(Target.w8a8, "--to", help="w8a8: msModelSlim W8A8_DYNAMIC layout; bf16: official "
                              "layout; fp4: the official release's FP8 linears and FP4 experts"),
) -> int:
    src = model_dir(source)
    # torch from here: the model is named
    from dsv4cli.model.loader import LoadError
    from dsv4cli.tools.convert import convert as run

    try:
        run(src, dst, to=to.value, progress=sys.stderr.isatty())
    except LoadError as e:
        raise UsageError(str(e)) from None
    except OSError as e:    # e.g. a destination that cannot be created or written
        raise UsageError(f"{e.filename or dst}: {e.strerror}") from None
    print(f"wrote {dst}")
    return 0
