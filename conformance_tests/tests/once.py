"""Expensive steps run once per test run, however many pytest-xdist workers ask for them."""

from __future__ import annotations

import os
import pathlib

import pytest
from filelock import FileLock

__all__ = ["run_once"]


def run_once(tmp_path_factory, name: str, make) -> pathlib.Path:
    """``make(directory)`` (which writes its results there) once per test run; every caller gets
    the same directory and reads the results from it.

    A session fixture runs once per xdist worker, so under ``pytest -n 2`` it would run twice.
    This is pytest-xdist's documented pattern: the first worker to ask runs ``make`` holding a
    ``FileLock`` in the run's base directory (``getbasetemp().parent``, which every worker of the
    run shares); the others wait on the lock, then find it done. If ``make`` raised, the others
    fail with its message instead of running it again. Without xdist it simply runs ``make``.
    """
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # one process: no one to share with
        directory = tmp_path_factory.mktemp(name)
        make(directory)
        return directory
    root = tmp_path_factory.getbasetemp().parent
    directory, done, failed = root / name, root / f"{name}.done", root / f"{name}.failed"
    with FileLock(str(root / f"{name}.lock")):
        if failed.exists():
            pytest.fail(f"{name} failed in another worker of this run:\n{failed.read_text()}")
        if not done.exists():
            directory.mkdir(exist_ok=True)
            try:
                make(directory)
            except BaseException as error:  # pytest.fail's Failed is not an Exception
                failed.write_text(f"{type(error).__name__}: {error}")
                raise
            done.touch()
    return directory
