"""The package's shape: no import circle (function-level imports count), no module above 600
lines, and every package importing only from itself and the packages below it."""

import ast
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "titan_fold"

# lowest first: a package may import from itself and from the packages before it; the
# top-level modules (the commands users run) may import from any
LAYERS = ["compat", "common", "moe", "models", "data", "parallel", "checkpoint", "planning", "trainer", "dryrun"]
COMMANDS = "commands"
MAX_LINES = 600


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package at `root` (a package is its __init__)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its body (module level, functions,
    methods). `import a.b.c` imports a.b.c; `from a.b import c` imports a.b (its __init__ runs
    the names it binds) and a.b.c when that is a module; relative imports are resolved."""
    mods = modules(root)
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                if target in mods and target != name:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else COMMANDS


def test_no_import_circle():
    assert circles(import_graph(ROOT)) == []


def test_packages_depend_only_downwards():
    graph = import_graph(ROOT)
    known = set(LAYERS) | {COMMANDS}
    assert {layer(m) for m in graph} <= known, "a new package: give it its place in LAYERS"
    upward = []
    for module, targets in graph.items():
        here = layer(module)
        if here == COMMANDS:
            continue
        for target in targets:
            there = layer(target)
            if there == COMMANDS or LAYERS.index(there) > LAYERS.index(here):
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_modules_stay_short():
    long = {name: n for name, path in modules(ROOT).items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_every_module_says_what_it_is_for():
    silent = [
        name
        for name, path in modules(ROOT).items()
        if path.read_text().strip() and not ast.get_docstring(ast.parse(path.read_text()))
    ]
    assert silent == []


@pytest.mark.parametrize("kind", ["function-level", "through a package __init__", "relative"])
def test_a_planted_circle_is_found(tmp_path, kind):
    """The walker on a small package with one circle of each kind the real package once had."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "import os\n",
        "b.py": "from pkg.a import x\n",
        "sub/__init__.py": "from pkg.sub.inner import y\n",
        "sub/inner.py": "",
    }
    if kind == "function-level":
        files["a.py"] = "def f():\n    from pkg.b import g\n"
    elif kind == "through a package __init__":
        files["sub/inner.py"] = "def f():\n    from pkg.sub import helper\n"
        files["sub/helper.py"] = ""
    else:
        files["sub/inner.py"] = "from .. import b\n"
        files["b.py"] = "from pkg.sub.inner import z\n"
    for rel, text in files.items():
        (pkg / rel).write_text(textwrap.dedent(text))
    found = circles(import_graph(pkg))
    assert len(found) == 1
    expected = {
        "function-level": ["pkg.a", "pkg.b"],
        "through a package __init__": ["pkg.sub", "pkg.sub.inner"],
        "relative": ["pkg.b", "pkg.sub.inner"],
    }[kind]
    assert found[0] == expected


# titan_fold uses torchtitan's functions as they are: no copy of one whose globals are swapped
SWAPPED_GLOBALS = re.compile(r"with_names|FunctionType\(|__globals__")
# the MoE layers run the same code in a real run and a dry run (its counts: dryrun/fake_counts.py)
BACKEND_CHECK = re.compile(r"get_backend\(|[\"']fake[\"']")


def matches(pattern: re.Pattern, root: Path) -> list[str]:
    """`file:line` of every line under root that the pattern finds."""
    return [
        f"{path.relative_to(root.parent)}:{n}"
        for path in sorted(root.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]


def test_no_function_runs_with_swapped_globals():
    assert matches(SWAPPED_GLOBALS, ROOT) == []


def test_moe_has_no_backend_check():
    assert matches(BACKEND_CHECK, ROOT / "moe") == []


@pytest.mark.parametrize(
    "pattern, line",
    [
        (SWAPPED_GLOBALS, "copy = types.FunctionType(f.__code__, names)"),
        (SWAPPED_GLOBALS, "    g = with_names(Trainer.train, time=fake_time)"),
        (SWAPPED_GLOBALS, "scope = {**f.__globals__, **names}"),
        (BACKEND_CHECK, "        self.fake = dist.get_backend() == 'fake'"),
        (BACKEND_CHECK, '    if dist.get_backend(group) == "fake":'),
    ],
)
def test_a_planted_line_is_found(tmp_path, pattern, line):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f'"""A module."""\n{line}\n')
    assert matches(pattern, tmp_path / "pkg") == ["pkg/m.py:2"]
