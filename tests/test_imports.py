"""The Python package has no import cycle: every ``import`` inside pycomm/,
at module level or inside a function (a deferred import is still a cycle,
only a hidden one), points one way.

Imports under ``if TYPE_CHECKING:`` are left out (they never run). A
package's ``__init__`` importing its modules is an edge like any other, and
so is a module reading a name from a package's ``__init__`` (``from . import
x`` where x is not a module): a module that does so from its own package
closes a cycle.

No build needed: the sources are parsed, not imported (but for the last test,
which imports pycomm in a fresh process to see what it pulls in).
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

PACKAGE = Path(__file__).resolve().parent.parent / "pycomm"


def module_name(path: Path) -> str:
    parts = ["pycomm", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> Dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


#: Compiled modules (setup.py's extension): leaves of the graph.
EXTENSIONS = {"pycomm._C"}


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _walk_runtime(node: ast.AST):
    """ast.walk without the bodies of ``if TYPE_CHECKING:`` blocks."""
    for child in ast.iter_child_nodes(node):
        if _type_checking_only(child):
            for other in child.orelse:
                yield other
                yield from _walk_runtime(other)
            continue
        yield child
        yield from _walk_runtime(child)


def imports_of(name: str, path: Path, known: Set[str]) -> Set[str]:
    """The pycomm modules ``name`` imports when its code runs."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out: Set[str] = set()

    def resolve(target: str) -> Optional[str]:
        while target and target not in known:  # pycomm.x.Name -> pycomm.x
            target = target.rpartition(".")[0]
        return target or None

    for node in _walk_runtime(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "pycomm":
                    out.add(resolve(alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "pycomm":
                origin = node.module
            else:
                continue
            for alias in node.names:
                sub = f"{origin}.{alias.name}"
                out.add(sub if sub in known else resolve(origin))
    out.discard(None)
    out.discard(name)
    return out


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph() -> Dict[str, Set[str]]:
    mods = modules()
    known = set(mods) | EXTENSIONS
    graph = {name: imports_of(name, path, known) for name, path in mods.items()}
    return graph


def test_package_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles inside pycomm/ (each line: modules that reach each other through imports):\n" + "\n".join(
        ", ".join(c) for c in found)


def test_graph_sees_deferred_and_relative_imports():
    """The checker itself: it reads the imports the layering relies on, and
    flags a cycle made of a deferred import."""
    graph = import_graph()
    assert "pycomm.communicator" in graph["pycomm.hooks.policy"]
    assert "pycomm.hooks" in graph["pycomm.elastic.ddp"]
    assert "pycomm.communicator" in graph["pycomm.elastic.membership"]  # deferred, inside shrink's helpers
    assert "pycomm.elastic" not in graph["pycomm.communicator"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_layers_point_one_way():
    """elastic builds on the communicator and the hooks, never the reverse;
    the hooks' families build on the policy, never the reverse."""
    graph = import_graph()

    def reaches(src: str, dst: str) -> bool:
        seen, todo = set(), [src]
        while todo:
            v = todo.pop()
            if v == dst:
                return True
            if v not in seen:
                seen.add(v)
                todo.extend(graph.get(v, ()))
        return False

    for low in ("pycomm.communicator", "pycomm.hooks", "pycomm.group", "pycomm.compression", "pycomm.default"):
        assert not reaches(low, "pycomm.elastic"), f"{low} reaches pycomm.elastic"
    for family in ("plain", "compressed", "stale", "local_sgd", "state"):
        assert not reaches("pycomm.hooks.policy", f"pycomm.hooks.{family}")


def test_importing_pycomm_leaves_the_heavy_torch_modules_alone():
    """Every rank imports pycomm at its start: ``torch.distributed.tensor``
    (and sympy with it, ~0.9 s) is looked up when a DTensor may be there, not
    imported."""
    import subprocess
    import sys

    code = ("import sys, pycomm, pycomm.hooks, pycomm.elastic, pycomm.diloco; "
            "print(sorted(m for m in ('torch.distributed.tensor', 'sympy', 'torch._dynamo') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=str(PACKAGE.parent))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]", r.stdout
