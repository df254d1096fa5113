"""The README's examples run as written, and its two commands are the ones CI uses."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


@pytest.mark.quick
def test_readme_is_short():
    lines = len(README.splitlines())
    assert lines <= 160, f"README.md has {lines} lines: reference material belongs in docs/"


def test_flax_only_example_runs_without_torch():
    """The first example needs only the layers' dependencies: run in a fresh interpreter, it
    imports neither torch nor torch_reference, and its decode steps equal the full pass."""
    example = _blocks("python")[0]
    assert "import flax_attention" in example and "import torch" not in example, example
    check = (
        "\nimport sys\n"
        "assert y.shape == (2, 16, 64), y.shape\n"
        "assert not {'torch', 'torch_reference'} & set(sys.modules), 'torch was imported'\n"
        "leaves = jax.tree.leaves(nnx.state(grads))\n"
        "assert len(leaves) == 8 and all(float(abs(g).max()) > 0 for g in leaves), leaves\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", example + check],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.quick
def test_quickstart_runs_and_checks_parity():
    (quickstart,) = [b for b in _blocks("python") if "fa.load_state_dict" in b]
    assert len(quickstart.strip().splitlines()) <= 16
    namespace: dict = {}
    exec(compile(quickstart, "README.md quickstart", "exec"), namespace)
    y_flax, y_torch = namespace["y_flax"], namespace["y_torch"]
    assert y_flax.shape == (2, 6, 4)
    assert abs(float((y_flax - y_torch).max())) < 1e-6
    torch_mha, x = namespace["torch_mha"], namespace["x"]
    back = torch_mha(namespace["torch"].from_numpy(x)).detach().numpy()
    assert abs(back - y_torch).max() == 0.0, "the weights sent back to torch changed its output"


@pytest.mark.quick
def test_ci_runs_the_readme_commands():
    commands = [b.strip() for b in _blocks("bash")]
    (report,) = [c for c in commands if "python -m conformance_tests" in c]
    (test_command,) = [c for c in commands if "pytest" in c]
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci.splitlines()
    assert report.startswith("python3 -m venv .venv")
    assert 'pip install torch==2.13.0 && pip install -e ".[dev]"' in report
    assert "python -m pip install --quiet torch==2.13.0" in ci.splitlines()
    assert 'python -m pip install --quiet -e ".[dev]"' in ci.splitlines()
    book = "pip install --no-deps llms-from-scratch==1.0.19"  # the book's package, its pins off
    assert f"python -m {book.replace('install', 'install --quiet')}" in ci.splitlines()
    install = ci.index("torch==2.13.0"), ci.index('-e ".[dev]"'), ci.index(book.split()[-1])
    install += (ci.index(test_command),)
    assert list(install) == sorted(install), "CI must install torch, the project, then test"
    # the development install of "Install" is the report command without its last step
    (develop,) = [c for c in commands if c.endswith(book)]
    assert report == develop + " && python -m conformance_tests"


@pytest.mark.quick
def test_layer_table_names_every_layer_and_spec_case():
    """Every name in the layer table exists in both packages, every spec-case pattern matches a
    case, and every case and public layer of the documents is in the table."""
    import fnmatch

    import flax_attention as fa
    import torch_reference as tr
    from conformance_tests.spec import CASES

    table = README.split("## The layers\n\n", 1)[1].split("\n\n", 1)[0]
    rows = [[cell.strip() for cell in row.split("|")[1:-1]] for row in table.splitlines()[2:]]
    assert len(rows) >= 9, table
    layers, patterns = set(), set()
    for _, torch_cell, flax_cell, cases in rows:
        assert flax_cell.startswith("same"), flax_cell
        layers |= set(re.findall(r"`(\w+)(?:\(|`)", torch_cell))
        patterns |= set(re.findall(r"`([\w*]+)`", cases))
    assert layers == set(tr.__all__), layers ^ set(tr.__all__)
    assert all(hasattr(fa, name) for name in layers)
    names = [case.name for case in CASES]
    for pattern in patterns:
        assert fnmatch.filter(names, pattern), f"{pattern} matches no spec case"
    missed = [n for n in names if not any(fnmatch.fnmatch(n, p) for p in patterns)]
    assert not missed, f"spec cases the table does not name: {missed}"


@pytest.mark.quick
def test_the_quick_marker_the_readme_names_holds_tests_of_every_file():
    """``-m quick`` (the README's edit loop) runs some tests of every test file: each file marks
    at least one function ``@pytest.mark.quick``, and the marker is registered."""
    import ast

    unmarked = []
    for path in sorted(
        [*ROOT.glob("conformance_tests/tests/test_*.py"), *ROOT.glob("benchmarks/tests/test_*.py")]
    ):
        tree = ast.parse(path.read_text())
        marks = {
            ast.unparse(decorator)
            for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
            for decorator in node.decorator_list
        }
        if "pytest.mark.quick" not in marks:
            unmarked.append(path.name)
    assert not unmarked, unmarked
    assert "`-m quick`: each file's fastest tests" in README
    assert '"quick:' in (ROOT / "pyproject.toml").read_text()
