"""Run one program as N JAX processes on this machine, or join a cluster's processes.

A program that spans processes calls ``initialize()`` before anything else touches JAX's
devices; it reads what this launcher sets, so the same program runs

- here, as N local processes: ``python -m flax_attention.launch --processes 2
  --devices-per-process 2 -- python prog.py`` starts ``python prog.py`` twice, with a free
  localhost port as coordinator, and ``initialize()`` calls
  ``jax.distributed.initialize("localhost:PORT", 2, i)`` in process ``i``;
- on a cluster (SLURM, Open MPI, Kubernetes, Cloud TPU), started by its own tools: without this
  launcher's variables ``initialize()`` calls ``jax.distributed.initialize()`` plain, which finds
  the coordinator itself.

The variables: ``FLAX_ATTENTION_COORDINATOR`` (``host:port``), ``FLAX_ATTENTION_NUM_PROCESSES``,
``FLAX_ATTENTION_PROCESS_ID``; ``--devices-per-process D`` also sets JAX's own
``JAX_NUM_CPU_DEVICES=D`` and ``JAX_PLATFORMS=cpu`` (D CPU devices per process, JAX's default
gloo collectives between them). The processes end together: when one fails or the timeout
passes, the others are killed (each runs in a process group of its own, killed whole), so a
process waiting on a collective never hangs the run.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import NamedTuple

from flax_attention._checks import check_positive_int

__all__ = ["COORDINATOR", "NUM_PROCESSES", "PROCESS_ID", "Launch", "initialize", "launch", "main"]

COORDINATOR = "FLAX_ATTENTION_COORDINATOR"
NUM_PROCESSES = "FLAX_ATTENTION_NUM_PROCESSES"
PROCESS_ID = "FLAX_ATTENTION_PROCESS_ID"


def initialize(initialization_timeout: int = 300) -> None:
    """``jax.distributed.initialize`` for this process: with the launcher's variables
    (``FLAX_ATTENTION_COORDINATOR``, ``..._NUM_PROCESSES``, ``..._PROCESS_ID``), the coordinator,
    process count and index they name; without them, plain (a cluster's own detection). Nothing
    if JAX's distributed runtime is already up. A variable that is not a number is a
    ``ValueError`` naming it."""
    import jax

    check_positive_int("initialization_timeout", initialization_timeout)
    if jax.distributed.is_initialized():
        return
    if COORDINATOR not in os.environ:
        jax.distributed.initialize(initialization_timeout=initialization_timeout)
        return
    numbers = {}
    for name in (NUM_PROCESSES, PROCESS_ID):
        text = os.environ.get(name, "")
        if not text.isdigit():
            raise ValueError(
                f"{name} ({text!r}) must be a non-negative integer when {COORDINATOR} is set"
            )
        numbers[name] = int(text)
    jax.distributed.initialize(
        os.environ[COORDINATOR],
        numbers[NUM_PROCESSES],
        numbers[PROCESS_ID],
        initialization_timeout=initialization_timeout,
    )


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


class Launch(NamedTuple):
    """What ``launch`` saw: each process's exit status (negative: killed by that signal), whether
    the timeout ended the run, its wall time in seconds, and the first process seen failing
    (``None`` if none did; the others were then killed)."""

    returncodes: list[int]
    timed_out: bool
    seconds: float
    failed: int | None = None

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(code == 0 for code in self.returncodes)


def launch(
    command: Sequence[str],
    processes: int,
    devices_per_process: int | None = None,
    *,
    timeout: float = 600.0,
    env: dict[str, str] | None = None,
    log_dir: str | os.PathLike | None = None,
    cwd: str | os.PathLike | None = None,
) -> Launch:
    """Run ``command`` as ``processes`` JAX processes on this machine and wait for them.

    Each gets the variables ``initialize()`` reads (a fresh free port as coordinator) on top of
    ``env`` (default: this process's environment); ``devices_per_process`` CPU devices each if
    given. ``log_dir``: each process's stdout and stderr go to ``log_dir/process_{i}.log``
    (else they are this process's). When one process fails, or ``timeout`` seconds pass, the
    rest are killed with their children. ``ValueError`` for a count that is not a positive int
    or an empty command."""
    check_positive_int("processes", processes)
    if devices_per_process is not None:
        check_positive_int("devices_per_process", devices_per_process)
    if not command:
        raise ValueError("command ([]) must name a program to run")
    base = dict(os.environ if env is None else env)
    base[COORDINATOR] = f"localhost:{free_port()}"
    base[NUM_PROCESSES] = str(processes)
    if devices_per_process is not None:
        base["JAX_NUM_CPU_DEVICES"] = str(devices_per_process)
        base["JAX_PLATFORMS"] = "cpu"
    logs = []
    children = []
    start = time.monotonic()
    try:
        for i in range(processes):
            out = None
            if log_dir is not None:
                out = open(pathlib.Path(log_dir) / f"process_{i}.log", "w")  # noqa: SIM115
                logs.append(out)
            children.append(
                subprocess.Popen(
                    list(command),
                    env={**base, PROCESS_ID: str(i)},
                    cwd=cwd,
                    stdout=out,
                    stderr=subprocess.STDOUT if out is not None else None,
                    start_new_session=True,  # its own process group, killed whole
                )
            )
        timed_out, failed = False, None
        while True:
            codes = [child.poll() for child in children]  # every one, each time
            bad = [i for i, code in enumerate(codes) if code]
            if bad or all(code is not None for code in codes):
                failed = bad[0] if bad else None
                break  # all done, or one failed: the rest are killed below
            if time.monotonic() - start > timeout:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        for child in children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
        for child in children:
            child.wait()
        for out in logs:
            out.close()
    codes = [child.returncode for child in children]
    return Launch(codes, timed_out, time.monotonic() - start, failed)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (``python -m flax_attention.launch``): ``argv`` its arguments (``None``:
    ``sys.argv[1:]``); a bad command line exits 2 with the usage, as argparse does."""
    if argv is not None and (
        isinstance(argv, str)
        or not isinstance(argv, Sequence)
        or not all(isinstance(a, str) for a in argv)
    ):
        raise TypeError(f"argv ({argv!r}) must be a list of str or None (sys.argv[1:])")
    parser = argparse.ArgumentParser(
        prog="python -m flax_attention.launch",
        description="Run a JAX program as N processes on this machine (it calls "
        "flax_attention.launch.initialize() first).",
    )
    parser.add_argument("--processes", type=int, required=True, help="how many processes")
    parser.add_argument(
        "--devices-per-process", type=int, default=None, help="CPU devices of each process"
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds before every process is killed"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program and its arguments")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        result = launch(command, args.processes, args.devices_per_process, timeout=args.timeout)
    except ValueError as error:
        parser.error(str(error))
    if result.timed_out:
        print(f"launch: timed out after {args.timeout:g} s; every process was killed",
              file=sys.stderr)  # fmt: skip
        return 124
    if result.failed is not None:
        code = result.returncodes[result.failed]
        print(f"launch: process {result.failed} exited with {code}; the others were killed",
              file=sys.stderr)  # fmt: skip
        return code if code > 0 else 128 - code
    return 0


if __name__ == "__main__":
    sys.exit(main())
