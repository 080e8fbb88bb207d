"""How the package imports: no import cycle at any level (functions' imports included), every import pointing
down the layers (front ends -> loading -> engine -> model -> kernels -> platforms), no device-type branch
outside the platforms, and a CLI that imports a verb's module (and torch) only when that verb runs."""
import ast
import re
import subprocess
import sys
from pathlib import Path

from dsv4cli.cli import MODES, VERBS, load, load_verb
from dsv4cli.config import SPEC

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dsv4cli"
# The layers, top first: a module imports its own layer's modules, lower layers' and the shared utilities.
LAYERS = [
    ("front ends", ("dsv4cli", "dsv4cli.__main__", "dsv4cli.cli", "dsv4cli.options", "dsv4cli.generate",
                    "dsv4cli.bench", "dsv4cli.chat", "dsv4cli.batch", "dsv4cli.serve", "dsv4cli.openai",
                    "dsv4cli.tools", "dsv4cli.api", "dsv4cli.terminal", "dsv4cli.structured", "dsv4cli.perplexity")),
    ("loading", ("dsv4cli.config", "dsv4cli.loading", "dsv4cli.parallel", "dsv4cli.hub")),
    ("engine", ("dsv4cli.engine",)),
    ("model", ("dsv4cli.model",)),
    ("kernels", ("dsv4cli.kernels",)),
    ("platforms", ("dsv4cli.platforms",)),
]
# what every layer may use, and which imports none of the layers
SHARED = ("dsv4cli.errors", "dsv4cli.cache", "dsv4cli.units", "dsv4cli.tokenizer", "dsv4cli.encoding")


def runtime_imports(tree: ast.AST):
    """Every import statement a module can run: at module level or in a function, not under
    `if TYPE_CHECKING:` (annotations only)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            todo += node.orelse     # its body is skipped (ast.walk would have queued it before we could)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        else:
            todo += ast.iter_child_nodes(node)


def import_graph() -> dict[str, set[str]]:
    """dsv4cli module -> the dsv4cli modules it imports anywhere (`from a import b` counts as importing a.b
    when that is a module, else a)."""
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for s in runtime_imports(ast.parse(path.read_text())):
            if isinstance(s, ast.Import):
                targets |= {a.name for a in s.names if a.name in files}
                continue
            base = s.module or ""
            if s.level:
                parent = package.split(".")[: len(package.split(".")) - s.level + 1]
                base = ".".join(parent + ([s.module] if s.module else []))
            for a in s.names:
                targets.add(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base)
        graph[name] = (targets & files.keys()) - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}        # state: 1 on the current path, 2 done

    def visit(path):
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


def layer(module: str) -> int | None:
    """The module's layer (0 = front ends), or None for the shared utilities."""
    if module in SHARED:
        return None
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes if p != "dsv4cli") or module == "dsv4cli":
            return i
    raise AssertionError(f"{module}: in no layer of tests/test_imports.py (add it where it belongs)")


def test_no_import_cycle_at_any_level():
    graph = import_graph()
    # the graph sees absolute, relative, package and in-function imports
    assert {"dsv4cli.options", "dsv4cli.config"} <= graph["dsv4cli.cli"]
    assert "dsv4cli.engine.graphs" in graph["dsv4cli.engine.runner"]
    assert "dsv4cli.platforms" in graph["dsv4cli.platforms.cpu"]
    assert "dsv4cli.parallel" in graph["dsv4cli.loading"]            # imported in a function
    assert "dsv4cli.engine.request" not in graph["dsv4cli.engine.api"]    # imported for annotations only
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles(graph) == []


def test_every_import_points_down_the_layers():
    wrong = []
    for module, targets in import_graph().items():
        here = layer(module)
        for target in targets:
            there = layer(target)
            if there is not None and (here is None or there < here):
                wrong.append(f"{module} ({LAYERS[here][0] if here is not None else 'shared'}) imports {target} "
                             f"({LAYERS[there][0]})")
    assert wrong == []


def test_only_the_platforms_branch_on_the_device_type():
    branch = re.compile(r"device\.type|\.is_cuda\b|\.type == \"(cpu|cuda|npu)\"")
    found = [f"{path.relative_to(ROOT)}:{n}" for path in PACKAGE.rglob("*.py") if "platforms" not in path.parts
             for n, line in enumerate(path.read_text().splitlines(), 1) if branch.search(line)]
    assert found == []


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
    assert imports_torch("chat", "--help")              # a verb's own help loads its module


def test_the_verb_and_mode_tables_name_what_runs():
    """A verb's help is written once, in VERBS: its function has no docstring that could say otherwise."""
    for name, verb in VERBS.items():
        command = load_verb(name)
        assert command.name == name and command.help == verb.help and load(verb.command).__doc__ is None
    assert tuple(MODES) == SPEC["mode"].choices
    assert all(callable(load(target)) for target in MODES.values())


def test_the_engine_stays_in_small_parts():
    """Each class of the engine at most 250 lines with one reason to change, no function in it over 60."""
    import ast

    big = []
    for path in sorted((PACKAGE / "engine").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            n = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and n > 250 or \
                    isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and n > 60:
                big.append(f"{path.name}: {node.name} ({n} lines)")
    assert not big, big


def test_the_server_stays_in_small_parts():
    """No function of the server over 60 lines, none with more than 6 parameters (options go in a dataclass):
    its handlers are functions of the `ApiServer` they share, each found by its name."""
    import ast

    big = []
    for path in sorted((PACKAGE / "serve").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                a = node.args
                params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
                if n > 60 or len(params) > 6:
                    big.append(f"{path.name}: {node.name} ({n} lines, {len(params)} parameters)")
    assert not big, big


def test_no_constructor_takes_more_than_six_parameters():
    """Settings that travel together are one object (a dataclass: `EngineOptions`, `BodyRules`, `Results`), not
    a longer and longer parameter list."""
    big = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for init in (f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"):
                a = init.args
                params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg != "self"]
                if len(params) > 6:
                    big.append(f"{path.relative_to(PACKAGE)}: {node.name}({', '.join(params)})")
    assert not big, big


# Backticked dotted names in the architecture doc (`Class.attr`, `module.function`, `pkg.module.Class.method`)
DOTTED = re.compile(r"[A-Za-z_][\w/]*(?:\.[A-Za-z_]\w*)+")
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "toml", "c", "cpp", "h", "bin", "safetensors", "txt"}


def type_names(node: ast.AST | None) -> set[str]:
    """The names an annotation or a call's callee mentions (forward references in strings included)."""
    if node is None:
        return set()
    names = set()
    for n in ast.walk(node.func if isinstance(node, ast.Call) else node):
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Attribute):
            names.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            names |= set(re.findall(r"[A-Za-z_]\w*", n.value))
    return names


def is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def class_members(cls: ast.ClassDef) -> dict[str, set[str]]:
    """A class's own members -> the type names they may hold: methods and properties (their return annotation),
    class-level names and fields (NamedTuple, dataclass, Protocol), and `self.x = ...` in its methods (the
    annotation, the class called or the method whose result is assigned)."""
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    found = {name: type_names(fn.returns) for name, fn in methods.items()}

    def value_types(value: ast.AST | None) -> set[str]:
        if isinstance(value, ast.IfExp):        # `X(...) if on else None`
            return value_types(value.body) | value_types(value.orelse)
        if not isinstance(value, ast.Call):
            return set()
        callee = value.func
        if isinstance(callee, ast.Attribute) and is_self(callee.value) and callee.attr in methods:
            return type_names(methods[callee.attr].returns)
        return type_names(callee)

    statements = [(n, True) for n in cls.body] + [(n, False) for fn in methods.values() for n in ast.walk(fn)]
    for node, in_body in statements:
        if isinstance(node, ast.Assign):
            pairs = [(t, None, node.value) for t in node.targets]
        elif isinstance(node, ast.AnnAssign):
            pairs = [(node.target, node.annotation, node.value)]
        else:
            continue
        for target, annotation, value in pairs:
            several = isinstance(target, ast.Tuple)
            for t in target.elts if several else [target]:
                name = t.id if in_body and isinstance(t, ast.Name) else \
                    t.attr if not in_body and isinstance(t, ast.Attribute) and is_self(t.value) else None
                if name is not None:
                    kinds = type_names(annotation) | (set() if several else value_types(value))
                    found.setdefault(name, set()).update(kinds)
    return found


class SourceIndex:
    """dsv4cli's modules, their top-level names and their classes' members, read with ast (nothing imported):
    resolves a dotted reference the way a reader looks it up."""

    def __init__(self):
        self.modules: dict[str, ast.Module] = {}
        self.packages: set[str] = set()
        self.classes: dict[str, list[ast.ClassDef]] = {}
        self.members: dict[int, dict[str, set[str]]] = {}      # by id of the class: `class_members`
        for path in PACKAGE.rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            self.modules[name] = tree = ast.parse(path.read_text())
            if path.name == "__init__.py":
                self.packages.add(name)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, []).append(node)

    def in_class(self, cls: ast.ClassDef, rest: list[str], seen: frozenset = frozenset()) -> bool:
        """Whether `rest` names a member of `cls` or its bases (then a member of that member's type)."""
        if not rest:
            return True
        if id(cls) in seen:
            return False
        seen |= {id(cls)}
        if id(cls) not in self.members:
            self.members[id(cls)] = class_members(cls)
        members = self.members[id(cls)]
        if rest[0] in members:
            return len(rest) == 1 or any(self.in_class(c, rest[1:], seen) for kind in members[rest[0]]
                                         for c in self.classes.get(kind, []))
        return any(self.in_class(base, rest, seen) for kind in type_names(ast.Tuple(cls.bases))
                   for base in self.classes.get(kind, []))

    def in_module(self, module: str, rest: list[str]) -> bool:
        """Whether `rest` names something of `module`: a submodule, a class (and its members), a function or a
        module-level name defined there; a package's imports count too (they are its API), a module's don't."""
        if not rest:
            return True
        name, more = rest[0], rest[1:]
        if f"{module}.{name}" in self.modules:
            return self.in_module(f"{module}.{name}", more)
        for node in self.modules[module].body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return self.in_class(node, more)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                return not more
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return not more
            if module in self.packages and isinstance(node, ast.ImportFrom) and node.level:
                package = module.split(".")[: len(module.split(".")) - node.level + 1]
                source = ".".join(package + ([node.module] if node.module else []))
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return self.in_module(source, [alias.name, *more])
        return False

    def resolves(self, ref: str) -> bool | None:
        """Whether a dotted reference names something in dsv4cli: after its longest prefix that names a module
        (`dsv4cli.serve.app`, `serve.app`, `app`, `batch/runner`), else after a class named by its first part;
        None where it is another package's (`torch.compile`, `os._exit`)."""
        import importlib.util

        parts = ref.replace("/", ".").split(".")
        ours = parts[0] in self.classes
        for n in range(len(parts), 0, -1):
            dotted = ".".join(parts[:n])
            for module in [m for m in self.modules if m == dotted or m.endswith("." + dotted)]:
                ours = True
                if self.in_module(module, parts[n:]):
                    return True
        if any(self.in_class(c, parts[1:]) for c in self.classes.get(parts[0], [])):
            return True
        return False if ours or importlib.util.find_spec(parts[0]) is None else None


def dotted_references(doc: str) -> set[str]:
    """The backticked dotted names of a markdown text outside its code blocks (a call's arguments dropped:
    `kernels.module_for(device)`), file names left out."""
    spans = re.findall(r"`([^`\s]+)`", re.sub(r"```.*?```", "", doc, flags=re.S))
    return {ref for ref in (span.split("(")[0] for span in spans)
            if DOTTED.fullmatch(ref) and ref.rsplit(".", 1)[1] not in FILE_SUFFIXES}


def test_the_architecture_doc_names_what_is_there():
    """docs/architecture.md: at most 250 lines, and every module, file and class it names exists, and every
    `Class.attr` or `module.function` it names resolves in the source (`SourceIndex`); history stays in git
    ("stop N" nowhere in the docs or the code)."""
    import builtins
    import os
    import re

    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert len(doc.splitlines()) <= 250
    text = "\n".join(p.read_text() for p in [*PACKAGE.rglob("*.py")])
    missing = []
    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".")]        # .venv, .git
        files += [f"{folder}/{name}" for name in names if name.endswith((".py", ".md"))]
    for name in set(re.findall(r"`([\w/]+\.(?:py|md))`", doc)):
        if not any(f.endswith(name) for f in files):
            missing.append(name)
    for name in set(re.findall(r"`([A-Z][A-Za-z]+)(?:[.(`])", doc)) - set(dir(builtins)):
        if not re.search(rf"^\s*(class|def) {name}\b|^{name} = ", text, re.M):
            missing.append(name)
    # `Class.attr`, `module.function`, `module.Class.method`: looked up in the source as a reader would
    index = SourceIndex()
    assert index.resolves("Engine.step") and index.resolves("SlotState.cache.drafter")     # the lookup finds what is
    assert index.resolves("Engine.confidence") is False and index.resolves("torch.compile") is None    # ... not
    missing += sorted(ref for ref in dotted_references(doc) if index.resolves(ref) is False)
    assert not missing, missing
    for path in [ROOT / "README.md", *ROOT.glob("docs/*.md"), ROOT / "benchmarks" / "README.md",
                 *PACKAGE.rglob("*.py")]:
        assert not re.search(r"\bstop \d+\b", path.read_text(), re.I), path
