"""The progress bar of ``python -m benchmarks`` on stderr, one per section.

A section's ``run(config, progress)`` advances it once per timed call (``Bar.update``); the
section's ``plan_calls(config)`` is the total. Drawn with rich (which flax brings) only when
stderr is a terminal, and gone when the section is done, so the tables on stdout stay as printed.
"""

from __future__ import annotations

import contextlib
import sys

__all__ = ["Bar", "progress_bar"]


class Bar:
    """What the sections see of a progress bar: ``update(n)``, which does nothing when no bar is
    drawn."""

    def __init__(self, progress=None, task=None):
        self._progress, self._task = progress, task

    def update(self, advance: int = 1) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=advance)


@contextlib.contextmanager
def progress_bar(total: int, description: str, enabled: bool = True):
    """A ``Bar`` counting ``total`` calls, labelled ``description``; drawn on stderr only when
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
        yield Bar(progress, progress.add_task(description, total=total))
