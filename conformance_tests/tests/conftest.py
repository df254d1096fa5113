"""Strict settings for every test: highest matmul precision, rank promotion raises, TF32 off;
XLA's CPU code generation without LLVM's optimisation passes (``TEST_CODEGEN``).

Hypothesis profiles for ``test_fuzz.py``, chosen with ``HYPOTHESIS_PROFILE`` (default
``ci``):

- ``ci``: derandomised (the same examples on every run, so CI is never flaky), no example
  database, no deadline; ``FUZZ_EXAMPLES`` forward examples per group of test_fuzz.py (9 groups:
  every layer, the annotated-transformer post's once per mask kind) and a third as many
  gradient examples: 207 in all, about 35 s on 2 CPU cores.
- ``dev``: random examples, 10x as many; ``HYPOTHESIS_PROFILE=dev python -m pytest
  conformance_tests/tests/test_fuzz.py`` (about 12 minutes on 2 cores). A failure prints the
  ``@reproduce_failure`` blob to paste above the test.

``once_per_run`` runs an expensive step once for the whole test run, however many xdist workers
(``-n 2``) ask for it; ``launch_processes`` launches JAX processes.

Under ``pytest -n 2`` (the README's command) the tests that share such a step (``ONCE_PER_RUN``:
the sharded tests' inner pytest, the two-process launch, the benchmarks' quick runs, the
report's whole-model cases) are collected first, so that the first worker takes all of them in
its first batch of tests and starts the steps at once: no worker then waits for a step another
one is running, and no minute-long step is left for the end of the run. Each worker's torch uses
its share of the cores.

The test run keeps one JAX persistent compilation cache (``jax_compilation_cache_dir``, every
program however quickly it compiled), new for each run, in this run's temporary directory, shared
by the xdist workers: the harness builds a new ``jit`` for each case and check, and eager
operations compile one program each, so many programs are ones this worker or the other has
compiled already;
they are then loaded, not compiled again (what runs is the same executable). JAX writes an entry
in place without a lock (its lock comes with a size limit, whose every write scans the
directory): an entry read half-written fails to decompress, and JAX warns and compiles the
program. The processes a test starts keep their own when they run pytest, none otherwise.
"""

import functools
import os
import pathlib
import shutil
import tempfile

import jax
import pytest
import torch
from hypothesis import HealthCheck, settings

from conformance_tests.tests.once import run_once

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_numpy_rank_promotion", "raise")

#: XLA's CPU code generation for the tests: LLVM without its optimisation passes. Most of the
#: suite's time is XLA compiling small programs (a new ``jit`` per case, check and shape, one
#: per eager operation): 70% of the fuzz, docs and implementation tests', and this takes the
#: whole run from 758 s to 552 s on a 2-core Zen 4 (every test passing either way; 519 s with
#: the test below, in another run). What XLA
#: compiles is the same program (its HLO passes, fusions, layouts and custom calls are the
#: defaults'); only the machine code of each fusion is less optimised, so values may round
#: differently within the rules the tests compare by. XLA's default (level 3) stays covered:
#: the CLI runs the spec's most rounding-sensitive cases with it in
#: ``test_spec.py::test_the_report_passes_with_xlas_default_code_generation``, and the processes
#: that tests start with ``XLA_FLAGS`` of their own (the sharded runs, the CLI on a mesh) keep
#: theirs.
#: Set in the environment before XLA's first compilation (the flags are read then), so the
#: processes a test starts inherit it; an ``XLA_FLAGS`` that names a level (``XLA_FLAGS=
#: --xla_backend_optimization_level=3 python -m pytest``: XLA's default) is left as it is.
#: (``QUICK_CODEGEN`` below also turns XLA's fusion emitters off, and with the grad check's
#: fusion passes off as well (``checks.grad.UNFUSED``) the gradients of 25 spec cases came out
#: 0.4-1.3 away from torch's against a bound of 1e-5: not for this process.)
OPTIMIZATION_LEVEL = "--xla_backend_optimization_level="
TEST_CODEGEN = f"{OPTIMIZATION_LEVEL}0"
if OPTIMIZATION_LEVEL not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_CODEGEN}".strip()
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

#: XLA flags for the processes a test starts to run many small programs across devices or
#: processes (the 8-device sharded tests, the two-process launch): their compilations, most of
#: their time, take about a third as long (dropout's random bits 0.2 s instead of 1.3 s). They
#: only change how XLA's CPU backend turns the partitioned program into machine code (LLVM
#: without its optimisation passes; the elemental emitters, XLA's default before its MLIR fusion
#: emitters): the program itself, after sharding propagation and SPMD partitioning, is the same,
#: so every layout, collective and custom call is what the defaults give; values may round
#: differently, within the float32 rule those tests compare by (what they compare bit for bit,
#: random bits and copied or loaded values, does not depend on it; a greedy token would only at
#: a near-tie of two logits). The CLI's ``--mesh`` runs with the defaults. (XLA aborts on a flag
#: it does not know: should one go, the started process's log names it.)
QUICK_CODEGEN = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"

#: The pytest-xdist workers of this run (``pytest -n 2``: 2), which share the machine's cores.
XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
#: Each worker's share of the cores (all of them without xdist).
WORKER_CORES = max(1, len(os.sched_getaffinity(0)) // XDIST_WORKERS)
if XDIST_WORKERS > 1:
    # torch's OpenMP pool takes a thread per core in every worker: under ``-n 2`` on 2 cores,
    # 4 threads that wait for each other spinning on 2 cores (a small layer's backward then took
    # 0.1 s instead of 1 ms). Each worker gets its share of the cores; the numbers are torch's.
    torch.set_num_threads(WORKER_CORES)
    # The same for the processes a test starts (examples, command lines, the second process of
    # the determinism test): their torch and OpenBLAS read it when they start.
    os.environ.setdefault("OMP_NUM_THREADS", str(WORKER_CORES))

#: Examples per test in the ``ci`` profile (test_fuzz.py: 9 groups x (17 forward + 6 gradient)).
FUZZ_EXAMPLES = 17

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    max_examples=10 * FUZZ_EXAMPLES,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: The fixtures whose expensive step runs once per test run (``run_once``): the tests that use
#: one are collected first under pytest-xdist (``pytest_collection_modifyitems``).
ONCE_PER_RUN = (
    "sharded_run",  # test_sharding.py: the inner pytest of sharded_tests.py on 8 devices
    "two_processes",  # test_multiprocess.py: examples/multiprocess.py as 2 JAX processes
    "quick_run",  # benchmarks/tests: python -m benchmarks --quick
    "blas_run",  # benchmarks/tests/test_blas.py: python -m benchmarks.blas --quick
    "model_report",  # test_spec.py: python -m conformance_tests --cases 'model_*'
)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the tests that use an ``ONCE_PER_RUN`` fixture first, the others
    after them, each part in its own order."""
    if XDIST_WORKERS < 2:
        return

    def shares_a_step(item):
        return any(name in ONCE_PER_RUN for name in getattr(item, "fixturenames", ()))

    items.sort(key=lambda item: not shares_a_step(item))  # stable: each part keeps its order


_OWN_CACHE_DIR = None  # the run's cache, when this process made it (no xdist): removed at the end


def pytest_configure(config):
    """The run's compilation cache, before anything compiles: under xdist in the workers'
    shared temporary directory (``run_once``'s), else a directory of this process's own. A
    cache the environment names (``JAX_COMPILATION_CACHE_DIR``) is left as it is."""
    global _OWN_CACHE_DIR
    if jax.config.jax_compilation_cache_dir is not None:
        return
    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        if not config.option.basetemp:
            return
        directory = pathlib.Path(config.option.basetemp).parent / "jax_compilation_cache"
    elif getattr(config.option, "dist", "no") != "no":  # xdist's controller: runs no test
        return
    else:
        directory = _OWN_CACHE_DIR = pathlib.Path(tempfile.mkdtemp(prefix="jax_cache_"))
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    if _OWN_CACHE_DIR is not None:
        shutil.rmtree(_OWN_CACHE_DIR, ignore_errors=True)


@pytest.fixture
def fresh_traces():
    """JAX's trace and compilation caches cleared before and after the test: for a test that
    monkeypatches something a jitted function traces (the report compiles its forward passes
    once per case and shape). Before: a program compiled earlier in this process, unpatched,
    would run instead of the patched code. After: the patched program must not serve the tests
    that follow. (The persistent cache keys on the lowered program, which the patch changes.)"""
    import jax

    jax.clear_caches()
    yield
    jax.clear_caches()


@pytest.fixture(scope="session")
def launch_processes():
    """``run(command, log_dir, processes=2, devices_per_process=2, timeout=300, xla_flags="")``:
    ``command`` as JAX processes on this machine (``flax_attention.launch``: a free localhost
    port as coordinator, each process in its own process group, all killed when one fails or the
    timeout passes), from the repository root with its ``flax_attention`` first on the path, with
    ``xla_flags`` as ``XLA_FLAGS`` (``QUICK_CODEGEN``, say). Fails the test with every process's
    log unless each exited 0; returns the ``Launch``."""
    from flax_attention.launch import launch

    def run(command, log_dir, processes=2, devices_per_process=2, timeout=300, xla_flags=""):
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT)
        env.pop("XLA_FLAGS", None)  # the device count is the launcher's
        if xla_flags:
            env["XLA_FLAGS"] = xla_flags
        result = launch(
            command, processes, devices_per_process, timeout=timeout, env=env,
            log_dir=log_dir, cwd=ROOT,
        )  # fmt: skip
        if not result.ok:
            logs = "\n".join(
                f"--- process {i} (exit {code}) ---\n"
                + (pathlib.Path(log_dir) / f"process_{i}.log").read_text()[-6000:]
                for i, code in enumerate(result.returncodes)
            )
            pytest.fail(f"{' '.join(command)}: {result}\n{logs}")
        return result

    return run


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory):
    """``once(name, make) -> directory``: ``once.run_once`` with this run's temporary
    directories (``make(directory)`` runs once per test run, also under ``pytest -n 2``)."""

    return functools.partial(run_once, tmp_path_factory)
