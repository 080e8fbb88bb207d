"""What a benchmark result says about its own run: the code's commit, the date, the machine and the settings.

Every script here that writes a JSON result puts `"meta": stamp(settings)` in it, so a result can be
traced to the tree that produced it (`-dirty` when tracked files had changes) and compared only with
runs on the same machine. Importing this module (before `dsv4cli`) makes the script measure its own tree's
package, in its own process and the `dsv4` / `python -m dsv4cli` it starts, even where the environment has
another checkout installed (an editable install): a script run from a worktree of an older commit would
otherwise time the installed tree's code under the older commit's name.
"""
import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def commit() -> str:
    """HEAD's commit, with "-dirty" when tracked files differ from it; "unknown" outside a git checkout."""
    head = _git("rev-parse", "HEAD")
    if head is None:
        return "unknown"
    return head + ("-dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux; `platform.processor()` often says only "x86_64")."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = None
    return {"platform": platform.platform(), "cpu": cpu_model(), "cores": cores, "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "torch": torch}


def stamp(settings: dict) -> dict:
    """The `meta` of a result: commit, date (ISO 8601, UTC), machine and the run's settings (an argparse
    namespace's `vars`; values JSON can't hold, such as paths, as strings)."""
    plain = (str, int, float, bool, list, dict, type(None))
    package = sys.modules.get("dsv4cli")
    if package is not None and not Path(package.__file__).resolve().is_relative_to(ROOT):
        raise SystemExit(f"benchmarks/meta.py: dsv4cli was imported from {package.__file__}, not {ROOT}: "
                         "import meta before dsv4cli")
    return {"commit": commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "settings": {k: v if isinstance(v, plain) else str(v) for k, v in settings.items()}}
