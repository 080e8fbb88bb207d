"""`dsv4 batch IN.jsonl -o OUT.jsonl` and `dsv4 batch merge OUT.jsonl [SHARDS...]`: the verb and its merge
(`mode = "batch"` of `dsv4 run` is `runner.run_batch`)."""
from pathlib import Path

import typer

from dsv4cli.errors import UsageError
from dsv4cli.options import CliOptions, model_options

from .merge import run_merge
from .runner import run_batch


@model_options("input", "output", "errors", "resume", "shard", "thinking", "reasoning_effort")
def batch(
    opts: CliOptions,
    in_file: Path | None = typer.Argument(None, metavar="IN.jsonl", help="Requests, one JSON object per line"),
) -> int:
    """Answer every request of a JSONL file (OpenAI batch format) into -o OUT.jsonl; --resume continues a run,
    --shard I/N answers one shard, `dsv4 batch merge` joins the shards."""
    if in_file is not None:
        if opts.flags["input"] is not None:
            raise UsageError("the input is given twice: as IN.jsonl and as -i/--input")
        opts.flags["input"] = str(in_file)
    settings, _ = opts.resolve()
    return run_batch(settings)


@model_options("input", "errors", "thinking", "reasoning_effort")
def merge(
    opts: CliOptions,
    out: Path = typer.Argument(..., metavar="OUT.jsonl", help="The merged output (--shard's -o)"),
    shards: list[Path] | None = typer.Argument(None, metavar="SHARDS...",
                                               help="Shard outputs (default: OUT's shard files beside it)"),
    retry_failed: bool = typer.Option(False, "--retry-failed", help="Run the requests the engine failed again "
                                      "(with the shards' model and settings: give their flags or -c file)"),
) -> int:
    """Merge the shards of one input (`dsv4 batch --shard I/N`) into OUT.jsonl: every request once, in input
    order; refuses shards of different inputs or settings, and names requests no shard answered."""
    settings, _ = opts.resolve()
    return run_merge(settings, out, shards or [], retry_failed)
