"""The benchmarks' tests run under the suite's strict settings, and share one quick run.

The strict settings are ``conformance_tests/tests/conftest.py``'s (highest matmul precision, rank
promotion raises, TF32 off in torch, XLA's code generation for the tests); importing it applies
them here as well, also when only these tests run (``test_conftest.py`` checks they hold).
"""

from __future__ import annotations

import json
import os
import pathlib
import types

import pytest

from benchmarks.tests.helpers import HAVE_MATPLOTLIB, check_ran, once_per_session, run_module
from conformance_tests.tests.conftest import (  # and the strict settings
    OPTIMIZATION_LEVEL,
    QUICK_CODEGEN,
    WORKER_CORES,
)


@pytest.fixture(scope="session")
def quick_run(tmp_path_factory):
    """One ``python -m benchmarks --quick`` run of every section: its JSON (``json_path``,
    ``data``), stdout, stderr and chart folder (``None`` without matplotlib, whose absence the
    run would refuse).

    The run compiles with XLA's quick CPU code generation (``QUICK_CODEGEN``, added to any
    ``XLA_FLAGS`` of the caller's): these tests read what the sections measure and print, never
    how fast; most of the tiny run's time is XLA compiling its programs (23 s instead of 40 s
    alone). The speed figures of docs/performance.md come from runs with the defaults."""

    def make(folder):
        path, chart_dir = folder / "quick.json", folder / "charts"
        args = ["benchmarks", "--quick", "--no-progress", "--json", str(path)]
        # torch's threads: this worker's share of the cores (its default, one per core, spins
        # against the other worker's tests under ``pytest -n 2``: 85 CPU s instead of 60).
        args += ["--torch-threads", str(WORKER_CORES)]
        if HAVE_MATPLOTLIB:
            args += ["--charts", str(chart_dir)]
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if OPTIMIZATION_LEVEL not in f]
        flags = " ".join([*flags, QUICK_CODEGEN])  # its level instead of the tests' own
        return {
            **run_module(args, timeout=300, env={"XLA_FLAGS": flags}),
            "json_path": str(path),
            "chart_dir": str(chart_dir),
        }

    run = once_per_session(tmp_path_factory, "benchmarks_quick", make)
    check_ran(run)
    return types.SimpleNamespace(
        json_path=pathlib.Path(run["json_path"]),
        data=json.loads(pathlib.Path(run["json_path"]).read_text()),
        stdout=run["stdout"],
        stderr=run["stderr"],
        chart_dir=pathlib.Path(run["chart_dir"]) if HAVE_MATPLOTLIB else None,
    )
