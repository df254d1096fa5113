"""No import cycle among the repository's packages: every ``import`` statement counted, the
ones inside functions included (they hide a cycle from the interpreter, not from a reader), those
under ``if TYPE_CHECKING:`` not (they never run)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("flax_attention", "torch_reference", "conformance_tests", "benchmarks", "examples")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:``."""
    return {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for child in node.body
        for inner in ast.walk(child)
    }


def _imported(name: str, path: pathlib.Path, node, modules) -> list[str]:
    """The repository modules ``node`` (an import statement in module ``name``) imports."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:  # ast.ImportFrom: a submodule where one is named, else the module itself
        module = node.module
        if node.level:  # relative: from the package of ``name``
            package = name.split(".")[: None if path.name == "__init__.py" else -1]
            package = package[: len(package) - node.level + 1]
            module = ".".join(package + ([node.module] if node.module else []))
        targets = [
            f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module
            for alias in node.names
        ]
    found = []
    for target in targets:
        while target and target not in modules:  # ``import a.b.c`` of a name inside a.b
            target = target.rpartition(".")[0]
        if target and target != name:
            found.append(target)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the repository modules it imports, anywhere in its file."""
    paths = {
        _module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
    }
    graph = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_only(tree)
        graph[name] = {
            target
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip
            for target in _imported(name, path, node, paths)
        }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each module that some import path leads back to,
    each cycle once."""
    found, seen = [], set()
    for start in sorted(graph):
        paths, visited = [[start]], {start}
        while paths:  # breadth first: a shortest path back to ``start``
            path = paths.pop(0)
            nexts = sorted(graph[path[-1]])
            if start in nexts:
                cycle = [*path, start]
                if frozenset(cycle) not in seen:
                    seen.add(frozenset(cycle))
                    found.append(cycle)
                break
            for module in nexts:
                if module not in visited:
                    visited.add(module)
                    paths.append([*path, module])
    return found


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    # The memory benchmark's worker imports torch_reference and torch_modules inside a function.
    assert "torch_reference" in graph["benchmarks.memory"]
    assert "benchmarks.torch_modules" in graph["benchmarks.memory"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


@pytest.mark.quick
def test_no_import_cycles():
    found = [" -> ".join(cycle) for cycle in cycles(import_graph())]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_every_name_in_every_all_exists():
    """``from module import *`` works for every module of the packages users import: each name
    its ``__all__`` lists is defined (``kernels.native`` once listed a ``run`` it did not have)."""
    import importlib

    missing = {}
    for package in ("flax_attention", "torch_reference", "conformance_tests"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = _module_name(path)
            if ".tests" in name or name.endswith("__main__"):
                continue
            module = importlib.import_module(name)
            absent = [n for n in getattr(module, "__all__", ()) if not hasattr(module, n)]
            if absent:
                missing[name] = absent
    assert not missing, missing
