"""What ``pip install .`` installs and needs: the layers import only their declared dependencies
(checked on every import statement, function-level ones included, and on a fresh interpreter),
the extras hold what the reference, the report and the tests import, and ``python -m
conformance_tests`` without torch or matplotlib says what to install."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest
import setuptools

from conformance_tests import cli

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
OWN = {"flax_attention", "torch_reference", "conformance_tests", "benchmarks"}
#: Import name -> distribution name, where they differ.
DISTRIBUTION = {
    "orbax": "orbax-checkpoint",
    "yaml": "pyyaml",
    "scipy_openblas32": "scipy-openblas32",
}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()


def _extra(name: str) -> set[str]:
    """The distributions of an extra, following ``flax-attention[...]`` references."""
    names = set()
    for requirement in PROJECT["optional-dependencies"][name]:
        if _name(requirement) == "flax-attention":
            inner = re.search(r"\[(.*)\]", requirement).group(1)
            for other in inner.split(","):
                names |= _extra(other.strip())
        else:
            names.add(_name(requirement))
    return names


DEPENDENCIES = {_name(r) for r in PROJECT["dependencies"]}


def _imports(paths) -> dict[str, set[str]]:
    """Top-level third-party module -> the files importing it (every ``import`` in the tree)."""
    found: dict[str, set[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in OWN and top != "__future__":
                    found.setdefault(DISTRIBUTION.get(top, top), set()).add(path.name)
    return found


def _is_test(path: pathlib.Path) -> bool:
    return "tests" in path.relative_to(ROOT).parts[1:-1] or path.name == "conftest.py"


def _files(package: str, tests: bool = False):
    return [f for f in sorted((ROOT / package).rglob("*.py")) if _is_test(f) == tests]


#: Imports of ``flax_attention`` made only when one function is called, never on import:
#: ``flax_attention.models.read_pth`` reads the book's ``.pth`` with torch, and says what to
#: install when torch is absent.
AT_CALL_ONLY = {"torch": {"checkpoints.py"}}


def test_the_layers_need_exactly_the_declared_dependencies():
    # scipy-openblas32: the BLAS the native kernel is built against and loads at run time;
    # optax: the models' training step.
    assert DEPENDENCIES == {"jax", "flax", "numpy", "optax", "safetensors", "scipy-openblas32"}
    imported = _imports(_files("flax_attention"))
    for name, files in AT_CALL_ONLY.items():
        assert imported.pop(name, set()) == files, f"{name} imported outside {files}"
    assert set(imported) <= DEPENDENCIES, f"undeclared: {set(imported) - DEPENDENCIES}"
    assert DEPENDENCIES <= set(imported)


@pytest.mark.quick
def test_the_reference_report_and_tests_need_only_their_extras():
    assert _imports(_files("torch_reference")).keys() <= {"torch"} | DEPENDENCIES
    assert "torch" in _extra("torch")
    report = DEPENDENCIES | _extra("report")
    assert {"torch", "matplotlib"} <= _extra("report")
    imported = _imports(_files("conformance_tests")) | _imports(_files("benchmarks"))
    # the book's package: installed with --no-deps (its pins pull tensorflow), by .ci/run, and
    # named by the report when a case needs it (cli.BOOK_INSTALL); what it imports, the extra has
    assert imported.pop("llms_from_scratch") == {"whole_models.py"}
    assert "pip install --quiet --no-deps llms-from-scratch" in (ROOT / ".ci" / "run").read_text()
    assert "tiktoken" in _extra("report")
    assert set(imported) <= report, f"undeclared for the report: {set(imported) - report}"
    dev = report | _extra("dev")
    tests = _files("conformance_tests", tests=True) + _files("benchmarks", tests=True)
    imported = _imports(tests + _files("examples"))
    imported.pop("llms_from_scratch")
    assert set(imported) <= dev, f"undeclared for the tests: {set(imported) - dev}"
    assert {"pytest", "pytest-xdist", "hypothesis", "ruff", "transformers", "tokenizers"} <= dev


@pytest.mark.quick
def test_lower_bounds_are_the_checked_versions():
    bounds = dict(re.match(r"([\w-]+)>=([\d.]+)$", r).groups() for r in PROJECT["dependencies"])
    assert bounds["jax"] == "0.8.1" and bounds["flax"] == "0.12.4", bounds
    readme = (ROOT / "README.md").read_text()
    assert "jax 0.8.1 and flax 0.12.4" in readme, "the README must name the checked versions"


@pytest.mark.quick
def test_no_generic_top_level_package_is_installed_and_types_are_shipped():
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(include) == ["conformance_tests*", "flax_attention*", "torch_reference*"]
    assert PYPROJECT["tool"]["setuptools"]["package-data"]["flax_attention"] == ["py.typed"]
    assert (ROOT / "flax_attention" / "py.typed").is_file()


@pytest.mark.quick
def test_the_wheel_ships_no_test_modules():
    """The packages ``pip install .`` ships, found as the build finds them (pyproject's
    ``packages.find``, namespaces on, its default there), and the modules in them: the layers,
    the reference, the report, no test package, ``test_*.py`` or ``conftest.py``."""
    find = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    packages = setuptools.find_namespace_packages(
        str(ROOT), include=find["include"], exclude=find["exclude"]
    )
    assert {"flax_attention.kernels.native", "torch_reference", "conformance_tests.checks"} <= set(
        packages
    ), packages
    modules = [f for p in packages for f in sorted((ROOT / p.replace(".", "/")).glob("*.py"))]
    assert ROOT / "conformance_tests" / "cli.py" in modules
    tests = [f for f in modules if _is_test(f) or f.name.startswith("test_")]
    assert not tests, f"test modules in the wheel: {tests}"
    without = setuptools.find_namespace_packages(str(ROOT), include=find["include"])
    assert "conformance_tests.tests" in without, "the exclude is what keeps the tests out"


def test_importing_the_layers_loads_no_torch_matplotlib_or_tqdm():
    code = (
        "import sys, flax_attention, flax_attention.models\n"
        "loaded = {'torch', 'matplotlib', 'tqdm'} & {m.split('.')[0] for m in sys.modules}\n"
        "assert not loaded, loaded\n"
        "print(len(flax_attention.__all__))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) >= 20


@pytest.mark.quick
def test_the_report_without_torch_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # what find_spec sees when it is absent
    assert cli.main(["--cases", "doc_*"]) == 2
    message = capsys.readouterr().err
    assert message.startswith("python -m conformance_tests needs torch, which is not installed")
    lines = message.splitlines()
    assert lines[1].split("#")[0].strip() == "pip install torch==2.13.0", message
    assert lines[2].split("#")[0].strip() == "pip install 'flax-attention[report]'", message
    assert "pip install -e '.[report]'" in lines[2], message


@pytest.mark.quick
def test_the_report_without_the_books_package_says_so_only_for_its_cases(monkeypatch, capsys):
    """The Qwen3 and Llama 3 cases' torch side is the book's package, installed without its
    pins: a run selecting them names it and the README's install line, before anything runs;
    the other cases run without it."""
    monkeypatch.setitem(sys.modules, "llms_from_scratch", None)
    assert cli.missing_requirements() is None
    assert cli.missing_requirements(book=cli._needs_book("doc_*")) is None
    for pattern in (None, "model_*", "model_llama3_book"):
        assert cli._needs_book(pattern), pattern
    assert cli.main(["--cases", "model_qwen3*"]) == 2
    message = capsys.readouterr().err
    assert message.startswith("python -m conformance_tests needs llms_from_scratch, which is not")
    assert "the book's package for the Qwen3 and Llama 3 cases" in message
    assert message.splitlines()[1].strip() == "pip install --no-deps llms-from-scratch==1.0.19"
    readme = (ROOT / "README.md").read_text()
    assert cli.BOOK_INSTALL.strip() in readme, "the README's install line"


@pytest.mark.quick
def test_the_report_without_matplotlib_says_so_only_for_plots(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli.missing_requirements(plots=False) is None
    assert cli.main(["--plots", str(tmp_path)]) == 2
    message = capsys.readouterr().err
    assert message.startswith("python -m conformance_tests needs matplotlib, which is not")
    assert "pip install 'flax-attention[report]'" in message
    assert not any(tmp_path.iterdir()), "nothing runs before the check"
