"""Property-based parity: random layers, configurations, shapes, dtypes and masks, Flax == torch.

Hypothesis draws one case at a time: a layer (all seven shared classes), its constructor
arguments (``d_in``, ``d_out``, heads, ``context_length``, ``qkv_bias``), the input shape (batch,
``num_tokens`` from 1 up to ``context_length``; a different key length for document 001's cross
attention), the dtype the Flax side computes in and, for ``MultiHeadedAttention``, the mask (none,
causal ``(1, t, s)`` or ``(b, t, s)``, padding ``(b, 1, s)``; float or bool). torch makes the
weights; the Flax layer loads the same ones through ``flax_attention.load_state_dict``. Inputs are
standard normal from the drawn seed (the harness's ``make_inputs``), so the examples probe shapes
and configurations, not pathological numbers (those are in ``test_numerics.py``).

The profiles (``ci``, derandomised; ``dev``, 10x the examples) are in
``conformance_tests/tests/conftest.py``. Tolerances are ``conformance_tests/tolerances.py``'s,
compared as the spec compares them (``harness.compare``: ``max_abs_err <= tol * max(1,
max|reference|)``); the Flax side computes in float32, bfloat16 or float16 (float32 parameters)
against torch in float32, as the spec's ``dtype`` check does.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

from conformance_tests import harness, spec
from conformance_tests.layers import LAYER_SPECS
from conformance_tests.tolerances import tolerance

#: The groups every test runs (``pytest`` parameters, so each is always covered): every layer,
#: and each layer that takes the caller's mask once per mask kind. Hypothesis draws the rest
#: within a group.
GROUPS = [
    (layer, mask)
    for layer in spec.LAYERS
    for mask in ((None, "causal", "padding") if LAYER_SPECS[layer].takes_mask else (None,))
]
GROUP_IDS = [layer if mask is None else f"{layer}-{mask}" for layer, mask in GROUPS]

#: A third as many gradient examples as forward ones, rounded up (a gradient costs about 1.5
#: forward examples): 12 groups x (17 + 6) = 276 examples in the ``ci`` profile.
GRAD_EXAMPLES = -(-settings().max_examples // 3)


@st.composite
def cases(draw, layer, mask, dtypes=("float32", "bfloat16", "float16")) -> tuple[spec.Case, str]:
    """A ``spec.Case`` of ``layer`` (args, input shapes, ``mask``, seed) and the Flax dtype."""
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**16))
    d_in = draw(st.integers(1, 8))
    num_heads = draw(st.integers(1, 4))
    head_dim = draw(st.integers(1, 4))
    d_out = num_heads * head_dim  # every layer's d_out; divisible where it must be
    qkv_bias = draw(st.booleans())
    batch = draw(st.integers(1, 3))
    context_length = draw(st.integers(1, 8))
    # one token, a full context or strictly between, each a third of the time
    kind = draw(st.sampled_from(["one", "full", "between"]))
    if kind == "between" and context_length >= 3:
        num_tokens = draw(st.integers(2, context_length - 1))
    else:
        num_tokens = 1 if kind == "one" else context_length
    layer_spec = LAYER_SPECS[layer]
    sizes = {
        "batch": batch,
        "d_in": d_in,
        "d_out": d_out,
        "d_model": d_out,
        "head_dim": head_dim,  # the wrapper's d_out: each head's width
        "num_heads": num_heads,
        "context_length": context_length,
        "dropout": 0.0,
        "qkv_bias": qkv_bias,
        "num_kv_groups": draw(st.sampled_from([g for g in (1, 2, 4) if num_heads % g == 0])),
    }
    args = layer_spec.args_for(sizes)
    kv_tokens = num_tokens
    if layer_spec.key_inputs != (0,):  # cross-attention: a key length of its own
        kv_tokens = draw(st.one_of(st.just(num_tokens), st.integers(1, 8)))
    inputs = layer_spec.input_shapes(sizes, num_tokens, kv_tokens)
    name = f"fuzz_{layer}_{seed}"
    case = spec.Case(name, layer, args, inputs, mask=mask, checks=("forward",), seed=seed)
    return case, dtype


def _pair(case: spec.Case, dtype: str):
    """The torch layer (document 001's cloned projections made distinct) and a Flax layer
    computing in ``dtype`` with the same weights: ``harness.build_pair`` in memory, the Flax side
    an ``nnx.eval_shape`` skeleton (no initialisation: the weights come from torch), which saves
    an XLA compilation of the initialisers for every new shape."""
    return harness.build_pair(case, None, dtype=dtype, distinct_clones=True)


def _inputs(case: spec.Case, data) -> tuple[list[np.ndarray], np.ndarray | None]:
    """Standard normal inputs from the case's seed; the mask reshaped/typed as drawn."""
    inputs = harness.make_inputs(case)
    mask = harness.make_mask(case, inputs)
    if mask is not None:
        form = data.draw(st.sampled_from(["as made", "over the batch", "bool"]), label="mask")
        if form == "over the batch":  # (1, t, s) -> (b, t, s); a padding mask is (b, 1, s)
            mask = np.broadcast_to(mask, (inputs[0].shape[0], *mask.shape[1:])).copy()
        elif form == "bool":
            mask = mask != 0
    return inputs, mask


def _events(case, dtype, mask):
    """What the example covers, for ``--hypothesis-show-statistics``."""
    event(f"layer {case.layer}")
    event(f"dtype {dtype}")
    layer = case.layer_spec
    if layer.takes_mask:
        event(f"mask {case.mask} {None if mask is None else (mask.shape, mask.dtype.name)}")
    if layer.causal and "context_length" in layer.params:
        t, context_length = case.inputs[0][-2], case.args[layer.params.index("context_length")]
        event(
            "num_tokens "
            + ("1" if t == 1 else "== context_length" if t == context_length else "between")
        )


def _describe(case, dtype, mask) -> str:
    shapes = ", ".join(str(s) for s in case.inputs)
    masked = "" if mask is None else f", mask {case.mask} {mask.shape} {mask.dtype}"
    return f"{case.layer}{case.args} on {shapes} ({dtype}{masked}, seed {case.seed})"


def _failure(what, case, dtype, mask, result) -> str:
    """``result`` (a ``harness.Comparison``): the worst tensor, its error over its bound."""
    return (
        f"{what} of {_describe(case, dtype, mask)}: tensor {result.worst!r} max abs diff "
        f"{result.err_over_bound:.2f} x its bound {result.bound:.1e} (tol * max(1, max|ref|))"
    )


@pytest.mark.parametrize(("layer", "mask"), GROUPS, ids=GROUP_IDS)
@given(data=st.data())
def test_flax_forward_equals_torch(layer, mask, data):
    case, dtype = data.draw(cases(layer, mask), label="case")
    inputs, mask = _inputs(case, data)
    note(_describe(case, dtype, mask))
    _events(case, dtype, mask)
    tm, fm = _pair(case, dtype)
    t_inputs = [torch.from_numpy(x) for x in inputs]
    t_mask = None if mask is None else torch.from_numpy(np.asarray(mask))
    with torch.no_grad():
        reference = harness.call_torch(case, tm, t_inputs, t_mask)
    # conversions in NumPy (ml_dtypes) and device_put: jnp.asarray compiles a jit per shape
    f_inputs = [jax.device_put(x.astype(harness.DTYPES[dtype])) for x in inputs]
    actual = harness.flax_forward(
        case, fm, f_inputs, None if mask is None else jax.device_put(mask)
    )
    names = harness.output_names(case)
    reference, actual = dict(zip(names, reference)), dict(zip(names, actual))
    for name, value in actual.items():
        assert value.dtype == harness.DTYPES[dtype], f"{name}: dtype {value.dtype}, not {dtype}"
        assert value.shape == tuple(reference[name].shape), f"{name}: shape {value.shape}"
        actual[name] = np.asarray(value).astype(np.float32)
    tol = tolerance(dtype, "forward")
    result = harness.compare(reference, actual, tol)
    assert result.passed, _failure("forward", case, dtype, mask, result)


@pytest.mark.quick
@pytest.mark.parametrize(("layer", "mask"), GROUPS, ids=GROUP_IDS)
@settings(max_examples=GRAD_EXAMPLES)
@given(data=st.data())
def test_flax_gradients_equal_torch(layer, mask, data):
    case, dtype = data.draw(cases(layer, mask, dtypes=("float32",)), label="case")
    inputs, mask = _inputs(case, data)
    note(_describe(case, dtype, mask))
    _events(case, dtype, mask)
    tm, fm = _pair(case, dtype)
    t_inputs = [torch.from_numpy(x) for x in inputs]
    t_mask = None if mask is None else torch.from_numpy(np.asarray(mask))
    _, reference, cotangents = harness.torch_grads(case, tm, t_inputs, t_mask)
    f_mask = None if mask is None else jax.device_put(mask)
    f_inputs = [jax.device_put(x) for x in inputs]
    actual = harness.flax_grads(case, fm, f_inputs, f_mask, cotangents, jit=True)
    assert set(actual) == set(reference), (
        f"gradients named differently: {set(actual) ^ set(reference)}"
    )
    tol = tolerance("float32", "grad")
    result = harness.compare(reference, actual, tol)
    assert result.passed, _failure("gradient", case, dtype, mask, result)
