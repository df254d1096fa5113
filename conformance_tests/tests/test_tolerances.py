"""Every entry of ``tolerances.py`` earns its place: a row that uses it fails once the error is a
few times the entry, or the entry sits within a small factor of the worst error measured under it.

- Corrupted (``CORRUPTED``): the Flax layer's output is corrupted by a controlled amount, sized
  from a first run so that the worst tensor's error is ``CAUGHT`` (3) times the entry; that
  row must fail, and its measured error must be between 1 and ``CEILING`` (4) times the entry
  (so the corruption that is caught is the size we say). Loosening the entry
  more than ``CAUGHT``-fold makes these tests fail.
- Pinned (``PINNED``): the case that measures the entry's worst error (the report's worst row on
  CPU); the measured worst must be within the entry and the entry at most ``k`` times it.

The error of a row is measured as the pass rule measures it: the worst tensor's
``max_abs_err / max(1, max|reference|)`` (recorded from ``compare`` while the check runs).
"""

from __future__ import annotations

import jax
import pytest

import flax_attention as fa
from conformance_tests import compare as compare_module
from conformance_tests import harness, spec
from conformance_tests.checks import train as train_module
from conformance_tests.optimisers import OPTIMIZERS
from conformance_tests.tolerances import TOLERANCES

CPU_DEVICE = jax.devices("cpu")[0]
CASES = {c.name: c for c in spec.CASES}
CAUGHT = 3.0
CEILING = 4.0


def _backend(precision):
    """The CPU backend, strict, or posing as a GPU (``tf32``) or TPU (``bf16``) at their default
    precision: the rows then use that precision's entries (the CPU computes in float32)."""
    if precision is None:
        return harness.backends(["cpu"])[0]
    name = {"tf32": "gpu", "bf16": "tpu"}[precision]
    return harness.Backend(name, CPU_DEVICE, "cpu", strict=False)


def _run(monkeypatch, tmp_path, case, check, dtype, backend, corrupt=None):
    """``(rows, worst)``: the rows of one check and, for each row that ``compare`` made, its
    worst tensor's error over its scale. ``corrupt(out) -> out`` is applied to every output of
    the case's Flax layer."""
    worst = []
    seen = []
    err_and_scale, compare = compare_module._err_and_scale, compare_module.compare

    def recording_err_and_scale(reference, actual):
        err, scale = err_and_scale(reference, actual)
        seen.append(err / max(1.0, scale))
        return err, scale

    def recording_compare(reference, actual, tol):
        seen.clear()
        result = compare(reference, actual, tol)
        worst.append(max(seen, default=0.0))
        return result

    # train: Adam only (the optimiser whose rows measured the worst), a third of the time
    monkeypatch.setattr(train_module, "OPTIMIZERS", {"adam": OPTIMIZERS["adam"]})
    monkeypatch.setattr(compare_module, "_err_and_scale", recording_err_and_scale)
    monkeypatch.setattr(compare_module, "compare", recording_compare)
    if corrupt is not None:
        layer = getattr(fa, case.layer)
        original = layer.__call__

        def corrupted(self, *args, **kwargs):
            return corrupt(original(self, *args, **kwargs))

        monkeypatch.setattr(layer, "__call__", corrupted)
    # The report compiles its forward passes once per case and shape: traced afresh, so the
    # patched call (and each corruption size) is what runs, and never served afterwards.
    jax.clear_caches()
    rows = harness.run_case(case, check, backend, dtype, str(tmp_path))
    monkeypatch.undo()
    jax.clear_caches()
    compared = [r for r in rows if r.check != "dropout/stats"]
    assert len(compared) == len(worst), (rows, worst)
    for row, error in zip(compared, worst):  # the row's own account: its worst tensor's error
        assert row.err_over_bound * row.tol == pytest.approx(error, rel=1e-12, abs=0), row
    # the statistics row is its own measure, in standard errors
    statistics = [r for r in rows if r.check == "dropout/stats"]
    return compared + statistics, worst + [r.max_abs_err for r in statistics]


def scaled(s):
    """A porting bug that scales the output by ``1 + s``: every compared tensor (outputs,
    gradients) moves by ``s`` times its own size."""
    return lambda out: out * (1 + s)


def leaky(s):
    """A leaky mask: every position sees ``s`` times the mean output over all tokens, the
    future ones included."""
    return lambda out: out + s * out.mean(axis=-2, keepdims=True)


#: entry -> (case, check, dtype, precision, corruption, caught): cheap cases, each with one
#: output. ``caught`` is the error the row must catch, written out (``CAUGHT`` times the entry
#: as it stands): a corruption sized from the entry itself would follow a loosened entry.
CORRUPTED = {
    ("float32", "forward:documents"): ("doc_mha_2heads", "forward", "float32", None, scaled, 3e-6),
    ("float32", "forward"): ("mha_odd_heads", "forward", "float32", None, scaled, 3e-5),
    ("float32", "grad"): ("mha_odd_heads", "grad", "float32", None, scaled, 3e-5),
    ("float32", "dropout"): ("doc_mha_2heads", "dropout", "float32", None, scaled, 3e-5),
    ("float32", "mask"): ("doc_causal_batch", "mask", "float32", None, leaky, 3e-6),
    ("bfloat16", "forward"): ("mha_odd_heads", "dtype", "bfloat16", None, scaled, 0.18),
    ("float16", "forward"): ("mha_odd_heads", "dtype", "float16", None, scaled, 0.024),
    ("float32", "forward:tf32"): ("doc_mha_2heads", "forward", "float32", "tf32", scaled, 6e-3),
    ("float32", "grad:tf32"): ("doc_mha_2heads", "grad", "float32", "tf32", scaled, 6e-2),
    ("float32", "train:tf32"): ("doc_mha_2heads", "train", "float32", "tf32", scaled, 0.15),
    ("float32", "dropout:tf32"): ("doc_mha_2heads", "dropout", "float32", "tf32", scaled, 3e-2),
    ("float32", "forward:bf16"): ("doc_mha_2heads", "forward", "float32", "bf16", scaled, 0.18),
    ("float32", "grad:bf16"): ("doc_mha_2heads", "grad", "float32", "bf16", scaled, 0.3),
    ("float32", "train:bf16"): ("doc_mha_2heads", "train", "float32", "bf16", scaled, 0.6),
    ("float32", "dropout:bf16"): ("doc_mha_2heads", "dropout", "float32", "bf16", scaled, 0.3),
}

#: entry -> (case, check, k): the case whose row measured the entry's worst error in the report
#: on CPU, and how far above that worst the entry may sit. ``train``: 50 Adam steps amplify
#: float32 roundoff into a drift from torch's float64 run that varies with the CPU's vector
#: width and summation order. The case (the worst of the train cases' rows; the next is at
#: most 0.13 of its bound) measured 6.1e-6 (Adam) and 6.5e-6 (AdamW) on an Intel Xeon with
#: AVX-512 and 4.3e-6 (Adam) on a Zen 3 (AVX2 only), 2026-12-07: the entry keeps 1.5x over the
#: largest and k = 4 over a drift down to 2.5e-6. (Against torch's float32 run the pin was
#: ``annotated_cross_padding``, 1.43e-6 to 4.2e-6 across the machines; it measures 1.0e-6
#: against float64.) ``dropout:stats`` is in standard
#: errors: the worst of 11 cases' z-scores (each the largest of hundreds of near-normal
#: deviations) is 3.6, and 5 is where a correct layer fails about once in 10^4 such maxima;
#: k = 2.
PINNED = {
    ("float32", "train"): ("gqa_6heads_2groups", "train", 4.0),
    ("float32", "dropout:stats"): ("wrapper_3heads_bias", "dropout", 2.0),
}


@pytest.mark.quick
def test_every_entry_is_corrupted_or_pinned():
    assert set(CORRUPTED) | set(PINNED) == set(TOLERANCES)
    assert not set(CORRUPTED) & set(PINNED)


@pytest.mark.parametrize("entry", CORRUPTED, ids=[":".join(e) for e in CORRUPTED])
def test_a_corruption_a_few_times_the_entry_fails_its_row(entry, monkeypatch, tmp_path):
    name, check, dtype, precision, corruption, caught = CORRUPTED[entry]
    case, backend = CASES[name], _backend(precision)
    tol = TOLERANCES[entry]

    def run(size):
        rows, worst = _run(monkeypatch, tmp_path, case, check, dtype, backend, corruption(size))
        assert all(r.tol == tol for r in rows if r.check != "dropout/stats"), rows
        pairs = [(r, e) for r, e in zip(rows, worst) if r.check != "dropout/stats"]
        return max(pairs, key=lambda pair: pair[1])  # the row with the largest error

    # the corruption's effect is linear in its size: measure it at ``caught``, then rescale
    _, error = run(caught)
    row, error = run(caught * caught / error)
    assert not row.passed, f"{entry}: {row} passed an error of {error:.3e} (tol {tol})"
    assert tol < error <= CEILING / CAUGHT * caught, f"{entry}: measured {error:.3e}, tol {tol}"


@pytest.mark.parametrize("entry", PINNED, ids=[":".join(e) for e in PINNED])
def test_the_entry_is_pinned_to_its_measured_worst(entry, monkeypatch, tmp_path):
    name, check, k = PINNED[entry]
    tol = TOLERANCES[entry]
    rows, worst = _run(monkeypatch, tmp_path, CASES[name], check, "float32", _backend(None))
    measured = [error for row, error in zip(rows, worst) if row.tol == tol]
    assert measured, rows
    measured = max(measured)
    assert measured <= tol <= k * measured, f"{entry}: worst {measured:.3e}, tol {tol}, k {k}"
