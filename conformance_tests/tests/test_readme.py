"""The README's quickstart runs as written, and its two commands are the ones CI uses."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_quickstart_runs_and_checks_parity():
    (quickstart,) = [b for b in _blocks("python") if "fa.load_state_dict" in b]
    assert len(quickstart.strip().splitlines()) <= 16
    namespace: dict = {}
    exec(compile(quickstart, "README.md quickstart", "exec"), namespace)
    y_flax, y_torch = namespace["y_flax"], namespace["y_torch"]
    assert y_flax.shape == (2, 6, 4)
    assert abs(float((y_flax - y_torch).max())) < 1e-6


def test_ci_runs_the_readme_test_command():
    commands = [b.strip() for b in _blocks("bash")]
    test_command = next(c for c in commands if "pytest" in c)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci.splitlines()
    assert "pip install --quiet torch==2.13.0" in ci
    assert "python -m conformance_tests" in commands[0]
    assert "pip install torch==2.13.0" in commands[0]
