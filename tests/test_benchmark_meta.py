"""benchmarks/meta.py: a benchmark measures the package of its own tree, not whichever checkout the environment
has installed (a worktree of an older commit, run for a before/after comparison, is the case)."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def other_tree(tmp_path: Path, probe: str) -> tuple[Path, Path]:
    """A checkout beside the installed one: benchmarks/meta.py as it is here, a dsv4cli package that says where
    it was imported from (also as `python -m dsv4cli`), and benchmarks/probe.py with `probe` as its text."""
    tree = tmp_path / "other"
    (tree / "benchmarks").mkdir(parents=True)
    (tree / "dsv4cli").mkdir()
    shutil.copy(ROOT / "benchmarks" / "meta.py", tree / "benchmarks" / "meta.py")
    (tree / "dsv4cli" / "__init__.py").write_text("")
    (tree / "dsv4cli" / "__main__.py").write_text("import dsv4cli\nprint(dsv4cli.__file__)\n")
    (tree / "benchmarks" / "probe.py").write_text(probe)
    return tree, tree / "benchmarks" / "probe.py"


def test_a_benchmark_imports_its_own_trees_package_and_so_do_the_processes_it_starts(tmp_path):
    tree, probe = other_tree(tmp_path, "import subprocess, sys\nimport meta\nimport dsv4cli\n"
                                       "print(dsv4cli.__file__)\n"
                                       "subprocess.run([sys.executable, '-m', 'dsv4cli'], check=True)\n"
                                       "meta.stamp({})\n")
    out = subprocess.run([sys.executable, str(probe)], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(tree / "dsv4cli" / "__init__.py")] * 2


def test_a_result_is_not_stamped_when_the_package_came_from_elsewhere(tmp_path):
    """dsv4cli imported before meta (from the installed checkout): the stamp would name the wrong code."""
    _, probe = other_tree(tmp_path, "import dsv4cli\nimport meta\nmeta.stamp({})\n")
    out = subprocess.run([sys.executable, str(probe)], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode != 0 and "import meta before dsv4cli" in out.stderr
