"""Numerics in both packages: inputs scaled by 1e4, all-equal scores, float16/bfloat16 near
their range limits, fully masked rows on every mask path, and document 001's fill value, against
the behaviour docs' numerics notes write down."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import flax_attention as fa
import torch_reference as tr
from conformance_tests import harness
from conformance_tests.layers import LAYER_SPECS
from conformance_tests.tests.helpers import (
    LAYERS,
    assert_finite,
    forward_and_grads,
    small_case,
    small_pair,
    to_numpy,
)
from conformance_tests.tolerances import tolerance

#: The name that seeds the inputs. (Kept from before the tests were split: at 1e4, torch's
#: ``nn.Linear`` is not bitwise the same for identical rows at every position, and
#: ``test_all_equal_scores_give_uniform_weights`` needs inputs whose projections are.)
NAME = "robustness"

#: The layer that takes the caller's mask and returns its weights (document 001's): the fully
#: masked row tests need both.
ANNOTATED = next(
    name
    for name in LAYERS
    if LAYER_SPECS[name].takes_mask and LAYER_SPECS[name].weights_output is not None
)


@pytest.mark.parametrize("layer", LAYERS)
def test_inputs_scaled_by_1e4_stay_finite_and_agree(layer):
    """Scores of order 1e8: the softmax saturates (one-hot) but nothing overflows in float32."""
    case = small_case(layer, name=NAME)
    tm, fm = small_pair(case)
    inputs = [x * np.float32(1e4) for x in harness.make_inputs(case)]
    t_out, t_grads, f_out, f_grads = forward_and_grads(case, tm, fm, inputs)
    for what, tensors in (
        ("torch outputs", t_out),
        ("torch gradients", t_grads),
        ("flax outputs", f_out),
        ("flax gradients", f_grads),
    ):
        assert_finite(f"{layer} x 1e4, {what}", tensors)
    tol = tolerance("float32", "forward")
    result = harness.compare(t_out, f_out, tol)
    assert result.passed, f"{layer} x 1e4: {result.worst} {result.err_over_bound:.2f} x its bound"
    weights_name = case.layer_spec.weights_output
    if weights_name is not None:  # saturated: each row puts (almost) all weight on one key
        for package, weights in (
            ("torch", t_out[weights_name]),
            ("flax", f_out[weights_name]),
        ):
            top = to_numpy(weights).max(axis=-1)
            assert top.min() > 0.999, f"{package}: a row's largest weight is {top.min():.4f}"
    # bfloat16 keeps float32's range: the same inputs stay finite there too (both packages)
    tm16, fm16 = small_pair(case, torch.bfloat16, "bfloat16")
    with torch.no_grad():
        t16 = harness.call_torch(case, tm16, [torch.from_numpy(x).bfloat16() for x in inputs], None)
    f16 = harness.flax_forward(case, fm16, [jnp.asarray(x, jnp.bfloat16) for x in inputs])
    assert_finite(f"{layer} x 1e4 bfloat16, torch", dict(enumerate(t16)))
    assert_finite(f"{layer} x 1e4 bfloat16, flax", dict(enumerate(f16)))


@pytest.mark.parametrize("scale", [1.0, 1e4])
@pytest.mark.parametrize("layer", LAYERS)
def test_all_equal_scores_give_uniform_weights(layer, scale):
    """Every token the same: every score of a row is equal, so the weights are uniform and every
    output row is the same value vector, in both packages, with finite gradients."""
    case = small_case(layer, name=NAME)
    tm, fm = small_pair(case)
    inputs = [
        np.broadcast_to(x[..., :1, :], x.shape) * np.float32(scale)
        for x in harness.make_inputs(case)
    ]
    inputs = [np.ascontiguousarray(x) for x in inputs]
    t_out, t_grads, f_out, f_grads = forward_and_grads(case, tm, fm, inputs)
    assert_finite(f"{layer} equal scores x {scale}, torch", {**t_out, **t_grads})
    assert_finite(f"{layer} equal scores x {scale}, flax", {**f_out, **f_grads})
    tol = tolerance("float32", "forward")
    for package, outputs in (("torch", t_out), ("flax", f_out)):
        out = to_numpy(outputs["out"])
        first = np.broadcast_to(out[..., :1, :], out.shape)
        err = float(np.abs(out - first).max())
        assert err <= tol * max(1.0, float(np.abs(first).max())), (
            f"{layer} x {scale} ({package}): output rows differ by {err:.3e}"
        )
        if case.layer_spec.weights_output is not None:
            weights = to_numpy(outputs[case.layer_spec.weights_output])
            err = float(np.abs(weights - 1 / weights.shape[-1]).max())
            assert err <= 1e-7, f"{package}: attention_score differs from uniform by {err:.3e}"
    result = harness.compare(t_out, f_out, tol)
    assert result.passed, f"{layer} equal scores x {scale}: {result.worst} {result.max_abs_err:.3e}"


@pytest.mark.quick
def test_softmax_naive_overflows_as_the_document_computes_it():
    """Document 003's ``softmax_naive`` has no max subtraction. Both packages agree up to scores
    of ~86; exp(89) overflows float32, so both give NaN there. Between them the packages differ:
    for a row sum above ~8.5e37 XLA on CPU divides by multiplying with the reciprocal, which is
    subnormal and flushed to zero, so Flax gives 0 where torch still gives the weights. (The
    layers' softmax subtracts the max and never meets this.)"""
    rows = {  # scores: (torch, flax)
        86.0: ([0.5, 0.5], [0.5, 0.5]),
        88.0: ([0.5, 0.5], [0.0, 0.0]),
        89.0: ([np.nan, np.nan], [np.nan, np.nan]),
    }
    for score, (torch_expected, flax_expected) in rows.items():
        x = np.full(2, score, np.float32)
        for package, got, expected in (
            ("torch", tr.softmax_naive(torch.from_numpy(x)).numpy(), torch_expected),
            ("flax", np.asarray(fa.softmax_naive(jnp.asarray(x))), flax_expected),
        ):
            np.testing.assert_allclose(got, expected, rtol=1e-6, err_msg=f"{package} {score}")
    huge = np.full(2, 1e30, np.float32)  # the layers' softmax: all-equal huge scores are fine
    for package, weights in (
        ("torch", torch.softmax(torch.from_numpy(huge), dim=0).numpy()),
        ("flax", np.asarray(fa.masked_softmax(jnp.asarray(huge), 1))),
    ):
        np.testing.assert_array_equal(weights, [0.5, 0.5], err_msg=package)


#: dtype: (largest input whose scores fit, inputs whose scores overflow). With identity weights
#: and two features, every score q . k is 2 c^2 (computed before the division by sqrt(d_k), as
#: the documents do): float16 holds 2 * 180^2 = 64800 but rounds 2 * 181^2 = 65522 to inf.
OVERFLOW = {
    "float16": (180.0, (181.0, 6e4)),
    "bfloat16": (1.3e19, (2e19, 3e38)),
    "float32": (1.3e19, (2e19, 3e38)),
}


@pytest.mark.parametrize("dtype", OVERFLOW)
def test_scores_beyond_the_dtype_range_give_nan_in_both_packages(dtype):
    """Inputs near a dtype's limit: finite and exact while every score fits, all NaN (an inf
    score makes softmax compute inf - inf) once one overflows. torch runs in the dtype, Flax
    computes in it (float32 parameters)."""
    eye = np.eye(2, dtype=np.float32)
    state = {f"{w}.weight": eye for w in ("W_query", "W_key", "W_value")}
    state["mask"] = np.triu(np.ones((4, 4), np.float32), k=1)
    tm = tr.CausalAttention(2, 2, 4, 0.0).eval()
    tm.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    tm = tm.to(getattr(torch, dtype))
    fm = fa.CausalAttention(2, 2, 4, 0.0, dtype=harness.DTYPES[dtype], rngs=nnx.Rngs(0))
    fa.load_state_dict(fm, state)
    fm.eval()
    fits, overflows = OVERFLOW[dtype]
    for c in (fits, *overflows):
        x = np.full((1, 4, 2), c, np.float32)
        with torch.no_grad():
            t_out = tm(torch.from_numpy(x).to(getattr(torch, dtype))).float().numpy()
        f_out = np.asarray(fm(jnp.asarray(x, harness.DTYPES[dtype])), np.float32)
        for package, out in (("torch", t_out), ("flax", f_out)):
            if c == fits:
                expected = np.float32(np.asarray(c, np.float32).astype(harness.DTYPES[dtype]))
                np.testing.assert_array_equal(
                    out, np.full_like(out, expected), err_msg=f"{dtype} {c} {package}"
                )
            else:
                assert np.isnan(out).all(), f"{dtype} inputs {c:g} ({package}): {out.ravel()}"


def test_causal_rows_always_keep_a_key():
    """The causal family cannot mask a whole row: the diagonal is always visible, in both."""
    for context_length in range(1, 9):
        buffer = tr.CausalAttention(1, 1, context_length, 0.0).mask.numpy()
        for t in range(1, context_length + 1):
            keep = np.asarray(fa.causal_mask(t, t))
            np.testing.assert_array_equal(keep, buffer[:t, :t] == 0, err_msg=f"{t} tokens")
            assert keep.sum(axis=-1).min() >= 1, f"a fully masked row at {t} tokens"


def _annotated_masks(b, t, s) -> dict[str, np.ndarray]:
    """Document 001's mask forms, each with at least one fully masked query row."""
    causal = np.tril(np.ones((t, s), np.float32))
    row = np.broadcast_to(causal, (b, t, s)).copy()
    row[0, 1, :] = 0  # (b, t, s): one row of batch 0 sees nothing
    padding = np.ones((b, 1, s), np.float32)
    padding[1] = 0  # (b, 1, s): batch 1 has no key at all
    return {
        "row_float": row,
        "row_bool": row != 0,
        "shared_all_zero": np.zeros((1, t, s), np.float32),  # (1, t, s): every row masked
        "padding_empty": padding,
    }


@pytest.mark.parametrize("form", ["row_float", "row_bool", "shared_all_zero", "padding_empty"])
def test_fully_masked_rows_are_uniform_and_finite(form):
    """``MultiHeadedAttention`` fills ``mask == 0`` with -1e10, so a row with no key left has all
    scores equal: uniform weights 1/k_len over every key, finite outputs and gradients."""
    case = small_case(ANNOTATED, name=NAME)
    tm, fm = small_pair(case)
    inputs = harness.make_inputs(case)
    b, t, _ = inputs[0].shape
    mask = _annotated_masks(b, t, inputs[1].shape[1])[form]
    masked = np.broadcast_to(mask, (b, t, inputs[1].shape[1])).sum(axis=-1) == 0  # (b, t)
    assert masked.any(), "test setup: no fully masked row"
    t_out, t_grads, f_out, f_grads = forward_and_grads(case, tm, fm, inputs, mask)
    assert_finite(f"{form}, torch", {**t_out, **t_grads})
    assert_finite(f"{form}, flax", {**f_out, **f_grads})
    for package, outputs in (("torch", t_out), ("flax", f_out)):
        weights = to_numpy(outputs["attention_score"]).transpose(0, 2, 1, 3)[masked]
        err = float(np.abs(weights - 1 / weights.shape[-1]).max())
        assert err <= 1e-7, f"{form} ({package}): masked rows differ from uniform by {err:.3e}"
    result = harness.compare(t_out, f_out, tolerance("float32", "forward"))
    assert result.passed, f"{form}: {result.worst} max abs diff {result.max_abs_err:.3e}"
    result = harness.compare(t_grads, f_grads, tolerance("float32", "grad"))
    assert result.passed, f"{form}: gradient {result.worst} max abs diff {result.max_abs_err:.3e}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fully_masked_rows_in_half_precision(dtype):
    """Flax clips -1e10 to the dtype's range (float16: -65504), so a fully masked row stays
    uniform; torch_reference in bfloat16 does the same, in float16 it raises as the document's
    ``masked_fill(mask == 0, -1e10)`` does (the fill does not fit a float16)."""
    case = small_case(ANNOTATED, name=NAME)
    inputs = harness.make_inputs(case)
    b, t, _ = inputs[0].shape
    mask = _annotated_masks(b, t, inputs[1].shape[1])["row_float"]
    tm, fm = small_pair(case, getattr(torch, dtype), dtype)
    f_out = fm(*(jnp.asarray(x, harness.DTYPES[dtype]) for x in inputs), jnp.asarray(mask))
    weights = to_numpy(fm.attention_score[...])[0, :, 1, :]  # the masked row, every head
    assert_finite(f"{dtype} flax", {"out": f_out, "attention_score": fm.attention_score[...]})
    eps = float(jnp.finfo(harness.DTYPES[dtype]).eps)
    assert np.abs(weights - 1 / weights.shape[-1]).max() <= eps, f"flax {dtype}: {weights}"
    t_inputs = [torch.from_numpy(x).to(getattr(torch, dtype)) for x in inputs]
    if dtype == "float16":
        with pytest.raises(RuntimeError, match="Half"):
            tm(*t_inputs, torch.from_numpy(mask))
        return
    with torch.no_grad():
        t_out = tm(*t_inputs, torch.from_numpy(mask))
    weights = to_numpy(tm.attention_score)[0, :, 1, :]
    assert_finite(f"{dtype} torch", {"out": t_out, "attention_score": tm.attention_score})
    assert np.abs(weights - 1 / weights.shape[-1]).max() <= eps, f"torch {dtype}: {weights}"


def test_attention_function_fully_masked_row_and_the_core_with_minus_inf():
    """Document 001's ``attention`` (fill -1e10): uniform in both packages. The Flax core with
    ``fill_value=-inf`` (the causal family's fill) gives NaN for a row with no key, as
    ``jax.nn.softmax`` does; no layer passes it such a row."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 4)).astype(np.float32) for _ in range(3))
    mask = np.ones((2, 3, 3), np.float32)
    mask[1, 2] = 0
    t_out, t_weights = tr.attention(*(torch.from_numpy(a) for a in (q, k, v, mask)))
    f_out, f_weights = fa.attention(*(jnp.asarray(a) for a in (q, k, v, mask)))
    for package, out, weights in (("torch", t_out, t_weights), ("flax", f_out, f_weights)):
        assert_finite(f"attention ({package})", {"out": out, "weights": weights})
        row = to_numpy(weights)[1, 2]
        np.testing.assert_allclose(row, np.full(3, 1 / 3), rtol=0, atol=1e-7, err_msg=package)
    scores = jnp.asarray(rng.standard_normal((2, 3)), jnp.float32)
    keep = jnp.asarray([[True, False, True], [False, False, False]])
    weights = np.asarray(fa.masked_softmax(scores, 1, keep))
    assert np.isfinite(weights[0]).all() and np.isnan(weights[1]).all(), weights


def _scores_near_minus_5e9():
    """Document 001's inputs whose scores tell its fill (-1e10) from any other: one query row,
    ``q . k / sqrt(4)`` = -5e9 for key 0, -5.0001e9 for key 1, and -1.25e9 for key 2, which the
    mask hides. With -1e10 the hidden key scores lowest and the row is one-hot on key 0; a fill
    above -5e9 (-1e9, say) would make the hidden key the largest and move all weight onto it."""
    c = np.float32(5e4)
    query = np.full((1, 1, 4), c, np.float32)  # (b, q_len, d_model)
    key = -c * np.array([[1.0], [1.00001], [0.25]], np.float32) * np.ones(4, np.float32)
    key = key[None]  # (b, k_len, d_model)
    value = np.array([[[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0]]], np.float32)
    mask = np.array([[[1, 1, 0]]], np.float32)  # (b, q_len, k_len): key 2 hidden
    return query, key, value, mask


def test_document_001_fill_is_minus_1e10_where_scores_are_near_minus_5e9():
    """The fill value itself, not only "very negative": scores near -5e9 under a mask give the
    same one-hot weights in both packages, through ``attention`` and through the layer (with
    identity projections), and only -1e10 (or lower) gives them."""
    query, key, value, mask = _scores_near_minus_5e9()
    expected_weights = np.array([[[1.0, 0.0, 0.0]]])
    expected_out = value[:, :1]  # key 0's value
    t_out, t_weights = tr.attention(*(torch.from_numpy(a) for a in (query, key, value, mask)))
    f_out, f_weights = fa.attention(*(jnp.asarray(a) for a in (query, key, value, mask)))
    eye = np.eye(4, dtype=np.float32)
    state = {f"proj_weights.{i}.weight": eye for i in range(4)}
    state.update({f"proj_weights.{i}.bias": np.zeros(4, np.float32) for i in range(4)})
    torch_layer = tr.MultiHeadedAttention(1, 4, 0.0).eval()
    torch_layer.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    flax_layer = fa.MultiHeadedAttention(1, 4, 0.0, rngs=nnx.Rngs(0))
    fa.load_state_dict(flax_layer, state)
    flax_layer.eval()
    with torch.no_grad():
        t_layer = torch_layer(*(torch.from_numpy(a) for a in (query, key, value, mask)))
    f_layer = flax_layer(*(jnp.asarray(a) for a in (query, key, value, mask)))
    for what, out, weights in (
        ("torch attention", t_out, t_weights),
        ("flax attention", f_out, f_weights),
        ("torch layer", t_layer, torch_layer.attention_score[:, 0]),
        ("flax layer", f_layer, flax_layer.attention_score[...][:, 0]),
    ):
        np.testing.assert_array_equal(to_numpy(weights), expected_weights, err_msg=what)
        np.testing.assert_array_equal(to_numpy(out), expected_out, err_msg=what)
    # what a fill of -1e9 would give instead: all weight on the hidden key
    scores = np.einsum("bqd,bkd->bqk", query, key) / 2.0
    assert scores.max() < -1e9 and np.where(mask == 0, -1e9, scores).argmax() == 2, scores
