"""`dsv4 batch IN.jsonl -o OUT.jsonl`: the verb, and `mode = "batch"` for `dsv4 run`."""
from pathlib import Path

import typer

from dsv4cli.cli import CliOptions, app, model_options, register_mode
from dsv4cli.errors import UsageError

from .runner import run_batch


@app.command()
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


register_mode("batch", run_batch)
