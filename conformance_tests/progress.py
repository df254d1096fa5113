"""The progress bar of the command lines (``python -m conformance_tests``, ``python -m benchmarks``)
on stderr.

A loop advances it once per step (``Bar.update``) and may say what it is on (``Bar.status``).
Drawn with rich (which flax brings) only when stderr is a terminal, and gone when done, so the
tables printed on stdout stay as printed.
"""

from __future__ import annotations

import contextlib
import sys

__all__ = ["Bar", "progress_bar"]


class Bar:
    """What the loops see of a progress bar: ``update(n)`` and ``status(text)``, which do
    nothing when no bar is drawn."""

    def __init__(self, progress=None, task=None):
        self._progress, self._task = progress, task

    def update(self, advance: int = 1) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=advance)

    def status(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, status=text)


@contextlib.contextmanager
def progress_bar(total: int, description: str, enabled: bool = True):
    """A ``Bar`` counting ``total`` steps, labelled ``description``; drawn on stderr only when
    ``enabled`` and stderr is a terminal. Lines printed to stdout meanwhile stay on stdout."""
    if not (enabled and sys.stderr.isatty()):
        yield Bar()
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"),
    )
    # Printed lines go through the bar's console only when stdout is the same terminal; a
    # redirected stdout (a file, a pipe) keeps every row.
    progress = Progress(
        *columns,
        console=Console(stderr=True),
        transient=True,
        redirect_stdout=sys.stdout.isatty(),
        redirect_stderr=False,
    )
    with progress:
        yield Bar(progress, progress.add_task(description, total=total, status=""))
