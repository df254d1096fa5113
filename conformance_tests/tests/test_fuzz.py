"""Property-based parity: random layers, configurations, shapes, dtypes and masks, Flax == torch.

Hypothesis draws one case at a time: a layer (all seven shared classes), its constructor
arguments (``d_in``, ``d_out``, heads, ``context_length``, ``qkv_bias``), the input shape (batch,
``num_tokens`` from 1 up to ``context_length``; a different key length for document 001's cross
attention), the dtype the Flax side computes in and, for ``MultiHeadedAttention``, the mask (none,
causal ``(1, t, s)`` or ``(b, t, s)``, padding ``(b, 1, s)``; float or bool). torch makes the
weights; the Flax layer loads the same ones through ``flax_attention.load_state_dict``. Inputs are
standard normal from the drawn seed (the harness's ``make_inputs``), so the examples probe shapes
and configurations, not pathological numbers (those are in ``test_robustness.py``).

The profiles (``ci``, derandomised; ``dev``, 10x the examples) are in
``conformance_tests/conftest.py``. Tolerances are ``conformance_tests/tolerances.py``'s,
compared as the spec compares them (``harness.compare``: ``max_abs_err <= tol * max(1,
max|reference|)``); the Flax side computes in float32, bfloat16 or float16 (float32 parameters)
against torch in float32, as the spec's ``dtype`` check does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

import flax_attention as fa
import torch_reference as tr
from conformance_tests import harness, spec
from conformance_tests.tolerances import tolerance

#: The groups every test runs (``pytest`` parameters, so each is always covered): every layer,
#: and document 001's layer once per mask kind. Hypothesis draws the rest within a group.
GROUPS = [(layer, None) for layer in spec.LAYERS if layer != "MultiHeadedAttention"] + [
    ("MultiHeadedAttention", mask) for mask in (None, "causal", "padding")
]
GROUP_IDS = [layer if mask is None else f"{layer}-{mask}" for layer, mask in GROUPS]

#: A third as many gradient examples as forward ones, rounded up (a gradient costs about 1.5
#: forward examples): 9 groups x (17 + 6) = 207 examples in the ``ci`` profile.
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
    if layer == "SelfAttention_v1":
        args, inputs = (d_in, d_out), ((num_tokens, d_in),)
    elif layer in ("SelfAttention_v2", "SelfAttention"):
        args, inputs = (d_in, d_out, qkv_bias), ((num_tokens, d_in),)
    elif layer == "CausalAttention":
        args = (d_in, d_out, context_length, 0.0, qkv_bias)
        inputs = ((batch, num_tokens, d_in),)
    elif layer == "MultiHeadAttentionWrapper":
        args = (d_in, head_dim, context_length, 0.0, num_heads, qkv_bias)
        inputs = ((batch, num_tokens, d_in),)
    elif layer == "MultiHeadAttention":
        args = (d_in, d_out, context_length, 0.0, num_heads, qkv_bias)
        inputs = ((batch, num_tokens, d_in),)
    else:  # MultiHeadedAttention(num_heads, d_model, dropout): query, key, value (and mask)
        kv_tokens = draw(st.one_of(st.just(num_tokens), st.integers(1, 8)))
        args = (num_heads, d_out, 0.0)
        q, kv = (batch, num_tokens, d_out), (batch, kv_tokens, d_out)
        inputs = (q, kv, kv)
    name = f"fuzz_{layer}_{seed}"
    case = spec.Case(name, layer, args, inputs, mask=mask, checks=("forward",), seed=seed)
    return case, dtype


def _torch_layer(case: spec.Case) -> torch.nn.Module:
    torch.manual_seed(case.seed)
    module = getattr(tr, case.layer)(*case.args).eval()
    if case.layer == "MultiHeadedAttention":  # clones start equal: make W^Q, W^K, W^V, W^O differ
        for proj in module.proj_weights:
            proj.reset_parameters()
    return module


def _pair(case: spec.Case, dtype: str):
    """The torch layer and a Flax layer computing in ``dtype`` with the same weights.

    The Flax layer is an ``nnx.eval_shape`` skeleton (no initialisation: the weights come from
    torch), which saves an XLA compilation of the initialisers for every new shape.
    """
    tm = _torch_layer(case)
    layer = getattr(fa, case.layer)
    fm = nnx.eval_shape(lambda: layer(*case.args, dtype=harness.DTYPES[dtype], rngs=nnx.Rngs(0)))
    fa.load_state_dict(fm, {k: v.numpy() for k, v in tm.state_dict().items()}, strict=True)
    fm.eval()
    return tm, fm


def _flax_forward(case, fm, inputs, mask):
    """``harness.call_flax`` under one ``jax.jit`` (one compilation instead of one per op)."""
    graphdef, params, rest = nnx.split(fm, nnx.Param, ...)

    @jax.jit
    def run(params, inputs, mask):
        return harness.call_flax(case, nnx.merge(graphdef, params, rest), inputs, mask)

    return run(params, inputs, mask)


def _flax_grads(case, fm, inputs, mask, cotangents) -> dict:
    """``harness.flax_grads`` under one ``jax.jit``: gradients by torch name and layout."""
    graphdef, params, rest = nnx.split(fm, nnx.Param, ...)

    @jax.jit
    def grads(params, inputs, mask, cotangents):
        def loss(params, inputs):
            outputs = harness.call_flax(case, nnx.merge(graphdef, params, rest), inputs, mask)
            return sum((o.astype(jnp.float32) * c).sum() for o, c in zip(outputs, cotangents))

        return jax.grad(loss, argnums=(0, 1))(params, inputs)

    g_params, g_inputs = grads(params, inputs, mask, [jax.device_put(c) for c in cotangents])
    by_name = fa.state_dict(nnx.merge(graphdef, g_params, rest))
    out = {f"input.{i}": g for i, g in enumerate(g_inputs)}
    out.update({n: v for n, v in by_name.items() if not n.endswith("mask")})
    return out


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
    if case.layer == "MultiHeadedAttention":
        event(f"mask {case.mask} {None if mask is None else (mask.shape, mask.dtype.name)}")
    if case.layer in ("CausalAttention", "MultiHeadAttentionWrapper", "MultiHeadAttention"):
        t, context_length = case.inputs[0][-2], case.args[2]
        event(
            "num_tokens "
            + ("1" if t == 1 else "== context_length" if t == context_length else "between")
        )


def _describe(case, dtype, mask) -> str:
    shapes = ", ".join(str(s) for s in case.inputs)
    masked = "" if mask is None else f", mask {case.mask} {mask.shape} {mask.dtype}"
    return f"{case.layer}{case.args} on {shapes} ({dtype}{masked}, seed {case.seed})"


def _failure(what, case, dtype, mask, err, tol, worst) -> str:
    return (
        f"{what} of {_describe(case, dtype, mask)}: tensor {worst!r} max abs diff {err:.3e} "
        f"exceeds tol {tol:.1e} * max(1, max|ref|)"
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
    actual = _flax_forward(case, fm, f_inputs, None if mask is None else jax.device_put(mask))
    names = harness.output_names(case)
    reference, actual = dict(zip(names, reference)), dict(zip(names, actual))
    for name, value in actual.items():
        assert value.dtype == harness.DTYPES[dtype], f"{name}: dtype {value.dtype}, not {dtype}"
        assert value.shape == tuple(reference[name].shape), f"{name}: shape {value.shape}"
        actual[name] = np.asarray(value).astype(np.float32)
    tol = tolerance(dtype, "forward")
    err, _, passed, worst = harness.compare(reference, actual, tol)
    assert passed, _failure("forward", case, dtype, mask, err, tol, worst)


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
    actual = _flax_grads(case, fm, [jax.device_put(x) for x in inputs], f_mask, cotangents)
    assert set(actual) == set(reference), (
        f"gradients named differently: {set(actual) ^ set(reference)}"
    )
    tol = tolerance("float32", "grad")
    err, _, passed, worst = harness.compare(reference, actual, tol)
    assert passed, _failure("gradient", case, dtype, mask, err, tol, worst)
