"""The package's layout: no import cycle inside ``flax_attention``, counting every import
statement (module level and inside functions), and ``flax_attention.sharding`` never imports a
layer module (it knows layers only through ``model_axis_sizes``)."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "flax_attention"
LAYER_MODULES = {
    "flax_attention.annotated",
    "flax_attention.causal",
    "flax_attention.multihead",
    "flax_attention.self_attention",
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, modules: set[str], name: str | None = None) -> set[str]:
    """Package modules that ``path`` imports anywhere (functions and classes included): for
    ``import a.b``, ``a.b``; for ``from a.b import c``, ``a.b.c`` if that is a module, else
    ``a.b`` (whose attributes it needs); relative imports resolved. A dotted import also runs
    the parent packages' ``__init__``, but those are already being imported when a submodule
    runs, so they are not edges (as in pylint's cyclic-import check); an explicit import of the
    package itself (``import flax_attention``, ``from flax_attention import shard``) is."""
    name = name or _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names]
            targets = [t if t in modules else base for t in targets]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or ``None`` (depth-first search)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if state.get(nxt) is None and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if state.get(node) is None and (found := visit(node)):
            return found
    return None


@pytest.mark.quick
def test_the_import_graph_of_flax_attention_has_no_cycle():
    graph = import_graph()
    assert "flax_attention.core" in graph and "flax_attention.kernels.blocked" in graph
    # A submodule that imports the package root closes a cycle through __init__: reported.
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.quick
def test_sharding_imports_no_layer_and_the_bottom_modules_import_nothing_of_the_package():
    graph = import_graph()
    assert not graph["flax_attention.sharding"] & LAYER_MODULES, graph["flax_attention.sharding"]
    # The bottom modules import nothing of the package but its argument checks and its graph
    # walk, which import nothing.
    below = {"flax_attention._checks", "flax_attention._graph"}
    for module in below:
        assert graph[module] == set(), f"{module} imports {graph[module]}"
    bottoms = ("mesh", "masking", "kernels.dropout_hash")
    for bottom in (f"flax_attention.{name}" for name in bottoms):
        assert graph[bottom] <= below, f"{bottom} imports {graph[bottom]}"
    # The kernels see only the mask description (and the tiled kernels the dropout hash they
    # share), never the core that dispatches to them; the native kernel also reads the mesh
    # module (its shard_map specs), to run once per device on a mesh.
    hashed = {"flax_attention.masking", "flax_attention.kernels.dropout_hash"}
    expected = {
        "flax_attention.kernels.blocked": hashed | {"flax_attention._checks"},
        "flax_attention.kernels.native": hashed | {"flax_attention.mesh"},
        "flax_attention.kernels.jax_nn": {"flax_attention.masking"},
    }
    for kernel, imports in expected.items():
        assert graph[kernel] == imports, f"{kernel}: {graph[kernel]}"


@pytest.mark.quick
@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import flax_attention.core", {"flax_attention.core"}),
        ("def f():\n    from flax_attention.causal import x\n", {"flax_attention.causal"}),
        ("class A:\n    def f(self):\n        import flax_attention\n", {"flax_attention"}),
        (
            "from flax_attention import cache as c, shard",
            {"flax_attention.cache", "flax_attention"},
        ),
        ("from . import core", {"flax_attention.core"}),
        ("from .kernels.blocked import BlockSizes", {"flax_attention.kernels.blocked"}),
    ],
)
def test_the_checker_sees_every_kind_of_import(tmp_path, source, expected):
    """The parser counts dotted, function-level, method-level, ``from package import module``
    and relative imports (a probe module, named as if it sat in the package)."""
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    assert _imports(probe, modules, name="flax_attention.probe") == expected


@pytest.mark.quick
def test_the_checker_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
