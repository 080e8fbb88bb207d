"""How the package imports: no module-level import cycle, and a CLI that imports a verb's module (and
torch) only when that verb runs."""
import ast
import subprocess
import sys
from pathlib import Path

from dsv4cli.cli import MODES, VERBS, load, load_verb
from dsv4cli.config import SPEC

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dsv4cli"


def module_level_imports(stmts: list[ast.stmt]):
    """The import statements run when a module is imported: not those in functions or `if TYPE_CHECKING:`."""
    for s in stmts:
        if isinstance(s, ast.Import | ast.ImportFrom):
            yield s
        elif isinstance(s, ast.If):
            if not (isinstance(s.test, ast.Name) and s.test.id == "TYPE_CHECKING"):
                yield from module_level_imports(s.body)
            yield from module_level_imports(s.orelse)
        elif isinstance(s, ast.Try):
            for block in (s.body, s.orelse, s.finalbody, *(h.body for h in s.handlers)):
                yield from module_level_imports(block)
        elif isinstance(s, ast.With | ast.ClassDef):
            yield from module_level_imports(s.body)


def import_graph() -> dict[str, set[str]]:
    """dsv4cli module -> the dsv4cli modules it imports at module level (`from a import b` counts as
    importing a.b when that is a module, else a)."""
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for s in module_level_imports(ast.parse(path.read_text()).body):
            if isinstance(s, ast.Import):
                targets |= {a.name for a in s.names if a.name in files}
                continue
            base = s.module or ""
            if s.level:
                parent = package.split(".")[: len(package.split(".")) - s.level + 1]
                base = ".".join(parent + ([s.module] if s.module else []))
            for a in s.names:
                targets.add(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base)
        graph[name] = targets & files.keys()
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}        # state: 1 on the current path, 2 done

    def visit(path: list[str]) -> None:
        state[path[-1]] = 1
        for nxt in sorted(graph[path[-1]]):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(path + [nxt])
        state[path[-1]] = 2

    for node in sorted(graph):
        if node not in state:
            visit([node])
    return found


def test_no_module_level_import_cycle():
    graph = import_graph()
    # the graph sees absolute, relative and package imports
    assert {"dsv4cli.options", "dsv4cli.config"} <= graph["dsv4cli.cli"]
    assert "dsv4cli.engine.graphs" in graph["dsv4cli.engine.engine"]
    assert "dsv4cli.platforms" in graph["dsv4cli.platforms.cpu"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"a"}}) == [["a", "a"]]
    assert cycles(graph) == []


def imports_torch(*args: str) -> bool:
    """Run the CLI with `args` in a fresh interpreter; whether torch was imported by the end."""
    code = ("import sys\nfrom dsv4cli.cli import main\ncode = main(sys.argv[1:])\n"
            "print(f'\\nexit {code} torch {\"torch\" in sys.modules}', file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, check=False)
    last = out.stderr.splitlines()[-1]
    assert last.startswith("exit 0 "), out.stderr
    return last.endswith("torch True")


def test_help_and_config_show_start_without_torch():
    assert not imports_torch("--help")
    assert not imports_torch("config", "show")
    assert not imports_torch("config", "show", "--config", "configs/chat.toml")
    assert imports_torch("generate", "--help")          # a verb's own help loads its module


def test_the_verb_and_mode_tables_name_what_runs():
    for name, verb in VERBS.items():
        command = load_verb(name)
        assert command.name == name and " ".join(command.help.split()) == verb.help
    assert tuple(MODES) == SPEC["mode"].choices
    assert all(callable(load(target)) for target in MODES.values())
