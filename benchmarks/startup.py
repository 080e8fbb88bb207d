"""Start-up time of the `dsv4` CLI, against `python -c "import torch"` on the same machine.

    python benchmarks/startup.py [--tree NAME=PATH ...] [--repeats 5] [--out startup.json]

Every command runs in a fresh interpreter (`python -m dsv4cli` from the tree's root, so that tree's package is
the one imported), once untimed (page cache, native kernels built), then `--repeats` times, the rounds
interleaving the trees and the commands so that a busy spell of the shared machine hits them alike. Reported per
command: median and min wall seconds, and the median over `import torch`'s median (what the CLI adds to torch).
The commands: `generate` of 8 greedy tokens with the bundled model; usage errors (a batch input that is not
there, a batch without -o, a model directory that is not there); `batch merge` of 200 lines (two shards of one
token a request, written once by the first tree); `inspect` of the bundled model; `--help`.
Chat's exit: the seconds from `/exit` (or Ctrl-D) to the end of the process, in a pseudo-terminal after one
reply (what a user waits for once done).
`--tree before=/tmp/base --tree after=.` compares two checkouts in one run (e.g. a `git worktree` of HEAD).
Results: JSON on stdout, or --out.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pexpect
from meta import ROOT, stamp

MERGE_LINES = 200


def commands(work: Path) -> dict[str, tuple[list[str], int]]:
    """name -> (the CLI's arguments, the exit code it must end with)."""
    return {
        "generate": (["generate", "-p", "hi", "-n", "8", "--temperature", "0"], 0),
        "batch, input not there": (["batch", "/nonexistent.jsonl", "-o", str(work / "none.jsonl")], 2),
        "batch, no -o": (["batch", "/nonexistent.jsonl"], 2),
        "generate, model not there": (["generate", "--model", "/nonexistent", "-p", "hi"], 2),
        f"batch merge, {MERGE_LINES} lines": (["batch", "merge", str(work / "out.jsonl")], 0),
        "inspect": (["inspect"], 0),
        "--help": (["--help"], 0),
    }


def environment() -> dict[str, str]:
    """This environment without DSV4_* settings, which would change what the commands do."""
    return {k: v for k, v in os.environ.items() if not k.startswith("DSV4_")}


def timed(argv: list[str], cwd: Path, code: int) -> float:
    t0 = time.perf_counter()
    out = subprocess.run(argv, cwd=cwd, env=environment(), capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - t0
    if out.returncode != code:
        raise SystemExit(f"{' '.join(argv)} in {cwd}: exit {out.returncode}, expected {code}\n{out.stderr}")
    return elapsed


def chat_exit(tree: Path, key: str) -> float:
    """Seconds from the key that ends a chat (after one reply) to the process's end."""
    child = pexpect.spawn(sys.executable, ["-m", "dsv4cli", "chat", "--temperature", "0", "-n", "8"], cwd=str(tree),
                          env=environment() | {"TERM": "xterm-256color"}, dimensions=(40, 120), encoding="utf-8",
                          timeout=120)
    child.expect(">>> ")
    child.sendline("Hello")
    child.expect("tokens · prompt")
    child.expect(">>> ")
    t0 = time.perf_counter()
    child.sendline("/exit") if key == "/exit" else child.sendeof()
    child.expect(pexpect.EOF)
    elapsed = time.perf_counter() - t0
    child.close()
    if child.exitstatus != 0:
        raise SystemExit(f"chat in {tree}: exit {child.exitstatus} after {key}")
    return elapsed


EXITS = {"chat, /exit after a reply": "/exit", "chat, Ctrl-D after a reply": "Ctrl-D"}


def write_shards(work: Path, tree: Path) -> None:
    """The input and its two shards' results, for `batch merge` to join."""
    (work / "in.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "prompt": "Hi"}) + "\n"
                                           for i in range(MERGE_LINES)))
    for shard in ("0/2", "1/2"):
        timed([sys.executable, "-m", "dsv4cli", "batch", str(work / "in.jsonl"), "-o", str(work / "out.jsonl"),
               "--shard", shard, "-n", "1", "--temperature", "0"], tree, 0)


def commit(tree: Path) -> str | None:
    def git(*args):
        out = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=False)
        return out.stdout.strip() if out.returncode == 0 else None
    head = git("rev-parse", "HEAD")
    return head and head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def summary(runs: list[float]) -> dict:
    return {"median_s": round(statistics.median(runs), 3), "min_s": round(min(runs), 3),
            "runs": [round(t, 3) for t in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                        help="a checkout to time (repeatable; default: this one)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree) or {"current": str(ROOT)}
    trees = {name: Path(path).resolve() for name, path in trees.items()}
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_shards(work, next(iter(trees.values())))
        cases = commands(work)
        torch_argv = [sys.executable, "-c", "import torch"]
        timed(torch_argv, ROOT, 0)
        for tree in trees.values():
            for argv, code in cases.values():
                timed([sys.executable, "-m", "dsv4cli", *argv], tree, code)
        torch_runs, runs = [], {name: {case: [] for case in [*cases, *EXITS]} for name in trees}
        for _ in range(args.repeats):
            torch_runs.append(timed(torch_argv, ROOT, 0))
            for case, (argv, code) in cases.items():
                for name, tree in trees.items():
                    runs[name][case].append(timed([sys.executable, "-m", "dsv4cli", *argv], tree, code))
            for case, key in EXITS.items():
                for name, tree in trees.items():
                    runs[name][case].append(chat_exit(tree, key))
    torch_median = statistics.median(torch_runs)
    results = {name: {case: summary(r) | ({"over_import_torch_s": round(statistics.median(r) - torch_median, 3)}
                                           if case in cases else {})
                      for case, r in cases_runs.items()} for name, cases_runs in runs.items()}
    report = {"meta": stamp(vars(args)), "load_average": {"start": load_start, "end": os.getloadavg()},
              "trees": {name: {"path": str(tree), "commit": commit(tree)} for name, tree in trees.items()},
              "import_torch": summary(torch_runs), "results": results}
    for case in [*cases, *EXITS]:
        print(f"{case:32} " + "  ".join(f"{name} {results[name][case]['median_s']:.2f} s "
                                         f"(min {results[name][case]['min_s']:.2f})" for name in trees),
              file=sys.stderr)
    print(f"{'import torch':32} {torch_median:.2f} s (min {min(torch_runs):.2f})", file=sys.stderr)
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
