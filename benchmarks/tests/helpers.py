"""What the benchmarks' tests share: running ``python -m ...`` from the repository root, once per
test session.

``once_per_session(tmp_path_factory, name, make)`` runs ``make(folder)`` once for the whole
session, also under ``pytest -n N``: xdist starts one process per worker, so a module or session
fixture would run once in each. The first worker to take the lock runs it and writes its
JSON-able result beside the workers' temporary folders; the others wait on the lock and read it
(pytest-xdist's documented pattern). A failed run is kept as its result too, so every worker
reports the same failure instead of running it again.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

from conformance_tests.tests.once import run_once

__all__ = ["HAVE_MATPLOTLIB", "ROOT", "check_ran", "once_per_session", "run_module"]

ROOT = pathlib.Path(__file__).resolve().parents[2]
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def once_per_session(tmp_path_factory, name, make):
    """``make(folder)``'s result (JSON-able), computed by one worker of the session only
    (``conformance_tests.tests.once.run_once``; a result that records a failure is shared
    like any other)."""

    def write(folder):
        (folder / "result.json").write_text(json.dumps(make(folder)))

    folder = run_once(tmp_path_factory, name, write)
    return json.loads((folder / "result.json").read_text())


def run_module(args, timeout, env=None):
    """``python -m ARGS`` from the repository root with its packages first on the path (and the
    variables ``env`` sets): ``{"command", "returncode", "stdout", "stderr"}`` (``returncode``
    ``None``: timed out)."""
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", *args]
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"command": " ".join(args), "returncode": None, "stdout": "",
                "stderr": f"timed out after {timeout} s"}  # fmt: skip
    return {
        "command": " ".join(args),
        "returncode": done.returncode,
        "stdout": done.stdout,
        "stderr": done.stderr,
    }


def check_ran(run):
    assert run["returncode"] == 0, f"python -m {run['command']} failed:\n{run['stderr'][-3000:]}"
