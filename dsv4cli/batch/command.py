"""`dsv4 batch IN.jsonl -o OUT.jsonl` and `dsv4 batch merge OUT.jsonl [SHARDS...]`: the verb and its merge
(`mode = "batch"` of `dsv4 run` is `runner.run_batch`). The runner (and torch) is imported when a verb runs, so
the command line's mistakes are said without waiting for it, and a merge without retries never imports it."""
import os
from pathlib import Path

import typer

from dsv4cli.errors import UsageError
from dsv4cli.options import CliOptions, check_model_dir, model_options

from .shards import check_paths, parse_shard


@model_options("input", "output", "errors", "resume", "shard", "thinking", "reasoning_effort")
def batch(
    opts: CliOptions,
    in_file: Path | None = typer.Argument(None, metavar="IN.jsonl", help="Requests, one JSON object per line"),
) -> int:
    if in_file is not None:
        if opts.flags["input"] is not None:
            raise UsageError("the input is given twice: as IN.jsonl and as -i/--input")
        opts.flags["input"] = str(in_file)
    settings, _ = opts.resolve()
    check_model_dir(settings)
    check_paths(settings, parse_shard(settings.shard, os.environ) if settings.shard else None)   # before torch
    from .runner import run_batch

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
    from .merge import run_merge

    settings, _ = opts.resolve()
    return run_merge(settings, out, shards or [], retry_failed)
