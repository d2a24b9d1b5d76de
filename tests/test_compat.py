"""Private torch and torchtitan names are used from titan_fold/compat/ only, and each of compat's
entries says why it exists.

A use is private (`private_uses`, by the module's syntax tree; the bases of rule 5 are looked up
in torch and torchtitan) when:
  1. an import names a torch or torchtitan module with a component of one leading underscore
     (`torch._dynamo`, `torch.distributed._functional_collectives`: torch's semi-public modules
     count too), or imports an underscore name from one (`from torch.x import _y`);
  2. an attribute chain on a name bound to a torch or torchtitan module has such a component
     (`torch._grouped_mm`, `dist.distributed_c10d._set_pg_timeout`);
  3. an attribute `obj._name` is read, or named to getattr / hasattr, where no module of
     titan_fold outside compat binds `_name` (as a def, class, assignment, parameter or
     import): it is a library's (`mesh._flatten`, the inherited `self._create_checkpoint_id`);
  4. a method `def _name` of a class whose base, imported from torch or torchtitan, has
     `_name`: an override of a private hook (`ParallelDims._validate`);
  5. `obj.name = MethodType(...)` where `name` is a method of torch's nn.Module or Optimizer:
     a swap of torch's method (`opt.step`).
Dunder names are not private; EXEMPT names the public ones of other libraries. Not seen: a
private name held as data (a string in a tuple): compat keeps those too (WRAPPER_ATTRIBUTES).
"""

import ast
import importlib
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "titan_fold"
COMPAT = "compat"
LIBRARIES = ("torch", "torchtitan")
# underscore attributes titan_fold reads that are no private torch or torchtitan name
EXEMPT = {
    "_exit": "os._exit: the standard library's documented exit without cleanup",
    "_gemm_execute": "QuACK's launch replay (moe/quack.py): quack-kernels, not torch or torchtitan",
}


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def library(path: str) -> bool:
    return path.split(".")[0] in LIBRARIES


def aliases(tree: ast.Module) -> dict[str, str]:
    """Each name an import binds -> the dotted path it stands for."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def chain(node: ast.AST) -> list[str] | None:
    """`a.b.c` -> ["a", "b", "c"]; None when the root is not a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def bound_names(trees: dict[Path, ast.Module]) -> set[str]:
    """Every name the modules bind: defs, classes, assignments, parameters, imports."""
    out = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                out.add(node.attr)
            elif isinstance(node, ast.arg):
                out.add(node.arg)
            elif isinstance(node, ast.alias):
                out.add(node.asname or node.name.split(".")[0])
    return out


def resolve(path: str):
    """The object a dotted path of a library names, or None."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part, None)
        return obj
    return None


def swappable() -> set[str]:
    import torch

    return {n for n in dir(torch.nn.Module) + dir(torch.optim.Optimizer) if not n.startswith("__")}


def private_uses(root: Path, skip: str = COMPAT) -> list[str]:
    """`file:line: what` for each private torch or torchtitan name used in the package at `root`
    outside its `skip` subpackage (the rules in this file's docstring)."""
    trees = {
        path: ast.parse(path.read_text(), str(path))
        for path in sorted(root.rglob("*.py"))
        if path.relative_to(root).parts[0] not in (skip, f"{skip}.py")
    }
    bound, methods, found = bound_names(trees), swappable(), []
    for path, tree in trees.items():
        names = aliases(tree)
        where = f"{root.name}/{path.relative_to(root)}"

        def flag(node, what, where=where):
            found.append(f"{where}:{node.lineno}: {what}")

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if library(a.name) and any(map(private, a.name.split("."))):
                        flag(node, f"import {a.name}")
            elif isinstance(node, ast.ImportFrom) and node.module and library(node.module):
                hidden = [a.name for a in node.names if private(a.name)]
                if any(map(private, node.module.split("."))) or hidden:
                    flag(node, f"from {node.module} import {', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and private(node.attr):
                parts = chain(node)
                rooted = parts is not None and library(names.get(parts[0], ""))
                if node.attr not in EXEMPT and (rooted or node.attr not in bound):
                    flag(node, ast.unparse(node))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id in ("getattr", "hasattr") and len(node.args) > 1:
                    name = node.args[1]
                    if isinstance(name, ast.Constant) and isinstance(name.value, str) and private(name.value):
                        if name.value not in bound and name.value not in EXEMPT:
                            flag(node, ast.unparse(node))
            elif isinstance(node, ast.ClassDef):
                for base in node.bases:
                    parts = chain(base)
                    if parts is None or not library(names.get(parts[0], "")):
                        continue
                    cls = resolve(".".join([names[parts[0]], *parts[1:]]))
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef) and private(item.name) and hasattr(cls, item.name):
                            flag(item, f"{node.name}.{item.name} overrides {ast.unparse(base)}.{item.name}")
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                func = node.value.func
                if (func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)) == "MethodType":
                    for target in node.targets:
                        if isinstance(target, ast.Attribute) and target.attr in methods:
                            flag(node, f"{ast.unparse(target)} = MethodType(...): torch's method swapped")
    return sorted(found)


def entries(folder: Path = ROOT / COMPAT) -> dict[str, str]:
    """compat's entries -> why each exists: every top-level def, class and assignment with the
    nearest `# why` comment above it, every re-export (__all__) with the comment line naming it."""
    out = {}
    for path in sorted(folder.glob("*.py")):
        text = path.read_text()
        lines, tree = text.splitlines(), ast.parse(text)
        comments = [(i + 1, line.strip()) for i, line in enumerate(lines) if line.strip().startswith("#")]
        exported: list[str] = []
        for node in tree.body:
            names = []
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
                if targets == ["__all__"]:
                    exported = [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]
                    continue
                names = targets
            first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            whys = [c for n, c in comments if n < first and c.startswith("# why")]
            for name in names:
                if not private(name):
                    out[f"{path.stem}.{name}"] = whys[-1] if whys else ""
        for name in exported:
            lines_naming = [c for _, c in comments if name in re.split(r"[\s,#]+", c.split(":")[0])]
            out[f"{path.stem}.{name}"] = lines_naming[0] if lines_naming else ""
    return out


def test_private_names_are_used_from_compat_only():
    assert private_uses(ROOT) == []


def test_every_compat_entry_says_why():
    listed = entries()
    assert len(listed) > 30, "compat's entries are read from its modules"
    assert [name for name, why in listed.items() if not why] == []


def test_compat_uses_only_library_names():
    """compat is the lowest layer: it imports torch and torchtitan, nothing of titan_fold."""
    for path in (ROOT / COMPAT).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("titan_fold"), f"{path.name} imports {node.module}"


@pytest.mark.parametrize(
    "source, found",
    [
        pytest.param("import torch._dynamo\n", "import torch._dynamo", id="private module"),
        pytest.param("from torch.utils._pytree import tree_leaves\n", "from torch.utils._pytree", id="from private"),
        pytest.param("from torch.nn.utils.stateless import _reparametrize_module\n", "_reparametrize", id="name"),
        pytest.param("import torch\n\ndef f(t):\n    torch._check(t)\n", "torch._check", id="module attribute"),
        pytest.param("def f(mesh):\n    return mesh._flatten()\n", "mesh._flatten", id="object attribute"),
        pytest.param("import torch\nok = hasattr(torch, '_grouped_mm')\n", "hasattr(torch", id="by name"),
        pytest.param(
            "from torchtitan.distributed import ParallelDims\n\nclass L(ParallelDims):\n    def _validate(self):\n"
            "        pass\n",
            "L._validate overrides ParallelDims._validate",
            id="override",
        ),
        pytest.param(
            "from types import MethodType\n\ndef f(opt, g):\n    opt.step = MethodType(g, opt)\n",
            "opt.step = MethodType",
            id="swap",
        ),
    ],
)
def test_a_planted_private_use_is_found(tmp_path, source, found):
    """Each rule on a one-module package; the same module inside its compat folder passes."""
    pkg = tmp_path / "pkg"
    (pkg / COMPAT).mkdir(parents=True)
    (pkg / "mod.py").write_text(textwrap.dedent(source))
    (pkg / COMPAT / "mod.py").write_text(textwrap.dedent(source))
    uses = private_uses(pkg)
    assert len(uses) == 1 and uses[0].startswith("pkg/mod.py:") and found in uses[0], uses


def test_own_underscore_names_are_not_flagged(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "mod.py").write_text(
        "from types import MethodType\n\nclass A:\n    def _helper(self):\n        return self._helper()\n\n"
        "def f(m, g):\n    m.overlap_step = MethodType(g, m)\n"
    )
    assert private_uses(pkg) == []
