"""On a GPU ``implementation=None`` runs cuDNN's fused attention where it keeps the call's
semantics, and the ``jax.nn`` adapter hands it causality as ``is_causal``, not as a mask array.

No GPU is needed: ``jax.default_backend`` is patched to say ``"gpu"`` (and ``jax.local_devices``
to report a compute capability), and ``jax.nn.dot_product_attention`` to record what it is
called with. Where ``xla`` takes the same keywords on the CPU, its outputs and gradients are
compared with ``reference``'s.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_attention as fa
from conformance_tests.tolerances import tolerance
from flax_attention.masking import AttentionMask

#: A supported shape: (b, t, h, d) with 64 x 64 scores a head (the tiled kernels' bound) and
#: GPT-2's head size.
SHAPE = (2, 64, 4, 64)
CAUSAL = AttentionMask(is_causal=True)


def _inputs(dtype, shape=SHAPE, kv_heads=None, tokens=None):
    b, t, h, d = shape
    q = jnp.ones((b, t, h, d), dtype)
    kv = jnp.ones((b, t if tokens is None else tokens, kv_heads or h, d), dtype)
    return q, kv, kv


def _on_gpu(monkeypatch, capability=None):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    if capability is not None:
        device = types.SimpleNamespace(compute_capability=capability)
        monkeypatch.setattr(jax, "local_devices", lambda *args, **kwargs: [device])


@pytest.mark.quick
def test_none_on_a_gpu_runs_cudnn_in_half_precision_else_xla(monkeypatch):
    _on_gpu(monkeypatch)
    select = fa.select_implementation
    for dtype in (jnp.bfloat16, jnp.float16):
        q, k, v = _inputs(dtype)
        assert select(q, k, v) == "cudnn", dtype
        assert select(q, k) == "cudnn", dtype  # values shaped as the keys
        assert select(q, k, v, mask=CAUSAL) == "cudnn", dtype
        assert select(q, k, v, mask=AttentionMask(is_causal=True, window=16)) == "cudnn", dtype
        assert select(*_inputs(dtype, kv_heads=1), mask=CAUSAL) == "cudnn", dtype  # grouped
        assert select(*_inputs(dtype, kv_heads=2)) == "cudnn", dtype
        # what cuDNN cannot take as the other implementations compute it: xla
        assert select(*_inputs(dtype, shape=(2, 64, 4, 12))) == "xla", dtype  # d % 8
        assert select(*_inputs(dtype, shape=(2, 64, 4, 256))) == "xla", dtype  # d > 128
        assert select(q, k, v.astype(jnp.float32)) == "xla", dtype  # mixed dtypes
        assert select(q, k, v[..., :32]) == "xla", dtype  # d_v != d_k
        keep = AttentionMask(jnp.ones((64,), bool), is_causal=True)
        assert select(q, k, v, mask=keep) == "xla", dtype  # a caller's (padding) mask
        assert select(q, k, v, mask=AttentionMask(jnp.ones((64,), bool))) == "xla", dtype
        decode = AttentionMask(is_causal=True, query_offset=3)
        assert select(q, k, v, mask=decode) == "xla", dtype  # the cache's offset
        longer = _inputs(dtype, tokens=128)
        assert select(*longer, mask=CAUSAL) == "xla", dtype  # t != s: causal alignment
        assert select(*longer) == "cudnn", dtype  # no causality: any t and s
        heads_first = jnp.swapaxes(k, 1, 2)
        assert select(q, heads_first, heads_first, kv_layout="hsd") == "xla", dtype
        # what only reference does
        dropout = nnx.Dropout(0.1, rngs=nnx.Rngs(0))
        assert select(q, k, v, dropout=dropout) == "reference", dtype
        assert select(q, k, v, need_weights=True) == "reference", dtype
        assert select(q, k, v, dropout=dropout.eval()) == "cudnn", dtype  # inactive
        small = _inputs(dtype, shape=(2, 63, 4, 64))
        assert select(*small) == "reference", dtype  # under the tiled kernels' bound
    assert select(*_inputs(jnp.float32)) == "xla"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert select(*_inputs(jnp.bfloat16)) == "xla"


@pytest.mark.quick
def test_the_head_size_bound_follows_the_compute_capability(monkeypatch):
    """Up to 256 features a head from compute capability 9.0 (Hopper), 128 before; no fused
    attention before 8.0 (Ampere)."""
    wide = _inputs(jnp.bfloat16, shape=(1, 64, 2, 256))
    for capability, narrow_choice, wide_choice in (
        ("9.0", "cudnn", "cudnn"),
        ("8.6", "cudnn", "xla"),
        ("7.5", "xla", "xla"),
    ):
        _on_gpu(monkeypatch, capability)
        assert fa.select_implementation(*_inputs(jnp.bfloat16)) == narrow_choice, capability
        assert fa.select_implementation(*wide) == wide_choice, capability


@pytest.mark.quick
def test_select_implementation_refuses_a_mask_that_is_not_an_attention_mask():
    q = jnp.ones(SHAPE, jnp.bfloat16)
    message = r"mask \(ndarray\) must be an AttentionMask or None \(e\.g\. AttentionMask\("
    with pytest.raises(TypeError, match=message):
        fa.select_implementation(q, q, mask=np.ones((64, 64), bool))


def _recorded_call(monkeypatch, q, k, v, **kwargs):
    """The keywords ``jax.nn.dot_product_attention`` gets from one call of the core (its
    result: zeros shaped as the queries)."""
    calls = []

    def record(query, key, value, bias=None, mask=None, **options):
        calls.append({"shapes": (query.shape, key.shape, value.shape), "bias": bias,
                      "mask": mask, **options})  # fmt: skip
        return jnp.zeros_like(query)

    monkeypatch.setattr(jax.nn, "dot_product_attention", record)
    out, weights = fa.dot_product_attention(q, k, v, need_weights=False, **kwargs)
    assert weights is None and out.shape == q.shape and not np.asarray(out).any()
    (call,) = calls
    return call


@pytest.mark.quick
def test_the_cudnn_choice_gets_causality_and_the_window_as_keywords(monkeypatch):
    _on_gpu(monkeypatch)
    q, k, v = _inputs(jnp.bfloat16, kv_heads=2)
    call = _recorded_call(monkeypatch, q, k, v, is_causal=True, window=16, implementation=None)
    assert call["implementation"] == "cudnn"
    assert call["is_causal"] is True and call["local_window_size"] == (15, 0)  # q - j <= 15
    assert call["mask"] is None and call["bias"] is None
    assert call["shapes"] == ((2, 64, 4, 64), (2, 64, 2, 64), (2, 64, 2, 64))  # grouped as is

    call = _recorded_call(monkeypatch, q, k, v, is_causal=True, implementation=None)
    assert (call["implementation"], call["is_causal"], call["local_window_size"]) == (
        "cudnn", True, None
    )  # fmt: skip
    call = _recorded_call(monkeypatch, q, k, v, implementation=None)
    assert call["implementation"] == "cudnn" and "is_causal" not in call and call["mask"] is None


@pytest.mark.quick
def test_a_call_cudnn_cannot_take_runs_xla_with_the_mask_materialised(monkeypatch):
    """At the decode cache's offset causality is a mask array (``is_causal`` would put query 0
    at key 0), and the choice is ``xla``; a caller's mask goes in as a mask too."""
    _on_gpu(monkeypatch)
    q, k, v = _inputs(jnp.bfloat16, tokens=128)  # 64 queries after 64 cached keys
    call = _recorded_call(monkeypatch, q, k, v, is_causal=True, query_offset=64,
                          implementation=None)  # fmt: skip
    assert call["implementation"] == "xla" and "is_causal" not in call
    expected = np.arange(128)[None, :] <= 64 + np.arange(64)[:, None]  # (t, s)
    np.testing.assert_array_equal(np.asarray(call["mask"])[0, 0], expected)

    q, k, v = _inputs(jnp.bfloat16)

    keep = np.ones((2, 1, 1, 64), bool)
    keep[1, ..., 7] = False
    call = _recorded_call(monkeypatch, q, k, v, mask=keep, implementation=None)
    assert call["implementation"] == "xla" and call["bias"] is None
    np.testing.assert_array_equal(np.asarray(call["mask"])[:, 0, 0], keep[:, 0, 0])


@pytest.mark.parametrize(("kv_heads", "window"), [(4, None), (2, 5), (1, 1)])
def test_xla_with_is_causal_and_the_window_equals_reference(kv_heads, window):
    """On the CPU: ``xla`` with causality as ``is_causal`` and the window as
    ``local_window_size`` computes what ``reference`` does, forward and gradients (grouped
    heads; a window of one key is the diagonal alone)."""
    rng = np.random.default_rng(kv_heads)
    q = rng.standard_normal((2, 13, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 13, kv_heads, 8)).astype(np.float32) for _ in range(2))
    cotangent = rng.standard_normal(q.shape).astype(np.float32)

    def run(implementation):
        def loss(q, k, v):
            out, _ = fa.dot_product_attention(
                q, k, v, is_causal=True, window=window, implementation=implementation,
                need_weights=False,
            )  # fmt: skip
            return (out * cotangent).sum(), out

        with jax.default_matmul_precision("highest"):
            (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
        return {"out": out, "d_query": grads[0], "d_key": grads[1], "d_value": grads[2]}

    expected, actual = run("reference"), run("xla")
    for name, want in expected.items():
        check = "forward" if name == "out" else "grad"
        diff = float(np.max(np.abs(np.asarray(actual[name]) - np.asarray(want))))
        assert diff <= tolerance("float32", check), f"{name}: max diff {diff:.1e}"
