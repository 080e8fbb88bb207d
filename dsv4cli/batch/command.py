"""`dsv4 batch IN.jsonl -o OUT.jsonl`: the verb (`mode = "batch"` of `dsv4 run` is `runner.run_batch`)."""
from pathlib import Path

import typer

from dsv4cli.errors import UsageError
from dsv4cli.options import CliOptions, model_options

from .runner import run_batch


@model_options("input", "output", "errors", "resume", "thinking", "reasoning_effort")
def batch(
    opts: CliOptions,
    in_file: Path | None = typer.Argument(None, metavar="IN.jsonl", help="Requests, one JSON object per line"),
) -> int:
    """Answer every request of a JSONL file (OpenAI batch format) into -o OUT.jsonl; --resume continues a run."""
    if in_file is not None:
        if opts.flags["input"] is not None:
            raise UsageError("the input is given twice: as IN.jsonl and as -i/--input")
        opts.flags["input"] = str(in_file)
    settings, _ = opts.resolve()
    return run_batch(settings)
