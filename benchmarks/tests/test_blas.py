"""``python -m benchmarks.blas --quick`` runs with the installed BLAS and returns sound numbers.

One subprocess (the run registers FFI targets and clears JAX's caches: kept out of this process),
once per test session (``helpers.once_per_session``), builds the sgemm timing loop and the native
kernel against scipy-openblas32 through the benchmark's shim header, and the test checks what it
returns: every sgemm call equals numpy's float64 product within the float32 error bound of a sum
of ``k`` products, the kernel built with the shim equals torch's SDPA forward and gradients, and
every time is finite and positive. No timing is asserted. ``python -m benchmarks.march`` (the
portable build against ``-march=native``) runs once on a small shape: its two builds must agree;
its ``-march=native`` build is the quick run's, kept in the run's build cache (the same source,
shim and command).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil

import pytest

from benchmarks import blas as bench
from benchmarks.tests.helpers import check_ran, once_per_session, run_module

#: float32, as ``test_native.ATOL``: both sides sum the same products in another order.
ATOL = 1e-5


def _why_not() -> str | None:
    if importlib.util.find_spec("scipy_openblas32") is None:
        return "scipy-openblas32 is not installed"
    if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")):
        return "no C++ compiler to build the kernel with"
    from flax_attention.kernels import native

    return None if native.available() else f"native kernel off: {native.why_unavailable()}"


@pytest.fixture(scope="session")
def blas_run(tmp_path_factory):
    if reason := _why_not():
        pytest.skip(reason)

    def make(folder):
        path, builds = folder / "quick.json", folder / "builds"
        # The kernel built once, for this CPU (``setup.py``'s knob): the portable build compiles
        # its hot functions three times (9.5 s against 5 s); the march test below builds it, and
        # takes this one from the build cache.
        march = {"FLAX_ATTENTION_MARCH": os.environ.get("FLAX_ATTENTION_MARCH") or "native"}
        args = ["benchmarks.blas", "--quick", "--json", str(path), "--build-cache", str(builds)]
        run = run_module(args, timeout=600, env=march)
        result = json.loads(path.read_text()) if run["returncode"] == 0 else None
        return {**run, "result": result, "builds": str(builds)}

    run = once_per_session(tmp_path_factory, "benchmarks_blas_quick", make)
    check_ran(run)
    return {**run["result"], "build_cache": run["builds"]}


def _positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_machine_and_blas_are_recorded(blas_run):
    machine = blas_run["machine"]
    assert machine["cpu"] and machine["cores"] >= 1
    assert len(machine["load_before"]) == 3 and len(machine["load_after"]) == 3
    openblas = blas_run["blas"]["openblas32"]
    assert openblas["qualifies"] is True
    assert openblas["config"].startswith("OpenBLAS"), openblas
    assert openblas["corename"], openblas


def test_sgemm_equals_numpy_on_every_call_kind(blas_run):
    rows = [r for r in blas_run["sgemm"] if r["blas"] == "openblas32"]
    measured = {(r["op"], r["bq"], r["kend"]) for r in rows}
    expected = {(op, bq, kend) for op in bench.OPS for bq, kend in bench.QUICK_SGEMM_SHAPES}
    assert measured == expected
    for row in rows:
        # |sgemm - float64 product| within k * 2**-24 * (|A| |B| + |beta C|), elementwise.
        assert 0 <= row["error_over_bound"] <= 1, row
        assert row["calls"] >= 1, row
        for key in ("median_us", "gflops"):
            assert _positive(row[key]), (key, row)
        assert row["ratio_vs_openblas32"] == 1.0, row


def test_kernel_built_with_the_shim_equals_sdpa(blas_run):
    rows = blas_run["kernel"]
    shapes = {f"b{b} t{t}" for b, t in bench.QUICK_KERNEL_SHAPES}
    assert {(r["shape"], r["mode"]) for r in rows} == {
        (shape, mode) for shape in shapes for mode in ("fwd", "fwd+bwd")
    }
    for row in rows:
        assert row["blas"] == "openblas32"
        assert row["products"] == "blas", row  # the build's BLAS, not the kernel's micro-kernel
        assert row["max_abs_diff_vs_sdpa"] <= ATOL, row
        for key in ("median_ms", "sdpa_ms", "ratio_vs_sdpa"):
            assert _positive(row[key]), (key, row)


@pytest.mark.quick
def test_sgemm_check_catches_a_wrong_product(tmp_path):
    """The check is not vacuous: a timing loop that skips the call leaves C wrong, and the
    error it reports is far above the bound."""
    if reason := _why_not():
        pytest.skip(reason)
    import numpy as np

    blas = bench.openblas32()
    broken = bench._BENCH_SOURCE.replace("for (int64_t i = 0; i < calls; ++i)", "if (0)")
    assert broken != bench._BENCH_SOURCE
    timer = bench.SgemmTimer(bench.build(blas, broken, tmp_path, "broken"))
    good = bench.SgemmTimer(bench.build(blas, bench._BENCH_SOURCE, tmp_path, "good"))
    case = bench.SgemmCase("PV", 32, 128)
    assert bench.check_sgemm(good, case, np.random.default_rng(0)) <= 1
    assert bench.check_sgemm(timer, case, np.random.default_rng(0)) > 100


def test_portable_and_native_builds_run_and_agree(blas_run, tmp_path):
    """``python -m benchmarks.march`` on one small shape, one round: the portable build and the
    ``-march=native`` one both load and run in one process, their outputs and gradients agree,
    and every time is finite and positive. The ``-march=native`` build is the quick run's (its
    build cache): only the portable one is compiled here."""
    path = tmp_path / "march.json"
    args = ["benchmarks.march", "--repeats", "1", "--shapes", "1x128", "--json", str(path),
            "--build-cache", blas_run["build_cache"]]  # fmt: skip
    check_ran(run_module(args, timeout=600))
    rows = json.loads(path.read_text())["rows"]
    assert [(r["shape"], r["mode"]) for r in rows] == [("b1 t128", "fwd"), ("b1 t128", "fwd+bwd")]
    for row in rows:
        assert row["max_abs_diff"] <= ATOL, row
        for key in ("portable_ms", "native_ms", "portable_over_native"):
            assert _positive(row[key]), (key, row)
