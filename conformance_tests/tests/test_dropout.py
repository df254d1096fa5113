"""The layers' ``Dropout``: ``nnx.Dropout``'s keep-mask bit for bit, drawn flat (one
dimension) where nothing is split over a mesh, ``nnx.Dropout``'s own call everywhere else."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_attention as fa
from flax_attention import models
from flax_attention._layers import Dropout


def _draw_shapes(fn, *args) -> list[tuple[int, ...]]:
    """The shapes of the random bits ``fn(*args)`` draws (in nested jaxprs too)."""

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "random_bits":
                yield eqn.params["shape"]
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    yield from walk(inner)

    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def _counts(*streams) -> list[int]:
    return [int(stream.count[...]) for stream in streams]


@pytest.mark.parametrize(
    ("shape", "dtype"), [((), "float32"), ((7,), "bfloat16"), ((2, 1, 3, 2), "float32")]
)
def test_the_mask_is_nnx_dropouts_drawn_flat(shape, dtype):
    # no zeros: a zero marks a drop
    x = jnp.arange(1.0, 1.0 + np.prod(shape)).reshape(shape).astype(dtype)
    ours, theirs = Dropout(0.3, rngs=nnx.Rngs(5)), nnx.Dropout(0.3, rngs=nnx.Rngs(5))
    for _ in range(2):  # the stream advances alike
        got, want = ours(x), theirs(x)
        assert got.dtype == want.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    if x.ndim <= 1:  # the stream inside the module, under nnx.jit (nnx's 4-d draw: 1 s more)
        call = nnx.jit(lambda dropout, x: dropout(x))
        np.testing.assert_array_equal(
            np.asarray(call(ours, x), np.float32), np.asarray(call(theirs, x), np.float32)
        )
        assert _counts(ours.rngs, theirs.rngs) == [3, 3]
    # a key, or the Rngs of another collection, given to the call
    key = jax.random.key(9)
    np.testing.assert_array_equal(ours(x, rngs=key), theirs(x, rngs=key))
    mine, yours = nnx.Rngs(other=3), nnx.Rngs(other=3)
    for _ in range(2):
        np.testing.assert_array_equal(
            Dropout(0.3, rng_collection="other")(x, rngs=mine),
            nnx.Dropout(0.3, rng_collection="other")(x, rngs=yours),
        )
    assert _counts(mine.other, yours.other) == [2, 2]
    assert _draw_shapes(lambda x, k: ours(x, rngs=k), x, key) == [(max(1, x.size),)]
    assert _draw_shapes(lambda x, k: theirs(x, rngs=k), x, key) == [shape]


def test_everything_else_is_nnx_dropouts_own_call():
    x = jnp.arange(1.0, 25.0).reshape(2, 3, 4)
    key = jax.random.key(4)
    ours, theirs = Dropout(0.5, broadcast_dims=(1,)), nnx.Dropout(0.5, broadcast_dims=(1,))
    np.testing.assert_array_equal(ours(x, rngs=key), theirs(x, rngs=key))
    assert _draw_shapes(lambda x, k: ours(x, rngs=k), x, key) == [(2, 1, 4)]
    for rate in (0.0, 1.0):  # nothing drawn
        np.testing.assert_array_equal(Dropout(rate)(x, rngs=key), nnx.Dropout(rate)(x, rngs=key))
    np.testing.assert_array_equal(Dropout(0.5)(x, deterministic=True), x)
    with pytest.raises(ValueError, match="No `deterministic` argument"):  # nnx.Dropout's errors
        Dropout(0.5, deterministic=None)(x)
    with pytest.raises(ValueError, match="no `rngs` argument"):
        Dropout(0.5)(x)
    # another generator than Threefry: its own draw, one key from the stream, as nnx.Dropout
    rbg = jax.random.key(4, impl="rbg")
    np.testing.assert_array_equal(Dropout(0.5)(x, rngs=rbg), nnx.Dropout(0.5)(x, rngs=rbg))
    assert _draw_shapes(lambda x: Dropout(0.5)(x, rngs=rbg), x) == [(2, 3, 4)]
    ours = Dropout(0.5, rngs=nnx.Rngs(dropout=rbg))
    theirs = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=rbg))
    np.testing.assert_array_equal(ours(x), theirs(x))
    assert _counts(ours.rngs, theirs.rngs) == [1, 1]
    # a mesh set: nnx.Dropout's draw, laid out like the inputs
    mesh = jax.make_mesh((1,), ("data",))
    with jax.set_mesh(mesh):
        assert _draw_shapes(lambda x, k: Dropout(0.5)(x, rngs=k), x, key) == [(2, 3, 4)]


@pytest.mark.quick
def test_every_layer_and_model_draws_through_it():
    layers = [  # built abstractly: their parameters are not drawn
        lambda: fa.CausalAttention(4, 4, 6, 0.1, rngs=nnx.Rngs(0)),
        lambda: fa.MultiHeadAttention(4, 4, 6, 0.1, 2, rngs=nnx.Rngs(0)),
        lambda: fa.MultiHeadedAttention(2, 4, rngs=nnx.Rngs(0)),
        lambda: models.GPTModel(
            {
                "vocab_size": 11,
                "context_length": 4,
                "emb_dim": 4,
                "n_heads": 2,
                "n_layers": 1,
                "drop_rate": 0.1,
                "qkv_bias": False,
            },
            rngs=nnx.Rngs(0),
        ),
        lambda: models.annotated.make_model(5, 5, N=1, d_model=4, d_ff=8, h=2, rngs=nnx.Rngs(0)),
    ]
    for build in layers:
        layer = nnx.eval_shape(build)
        dropouts = [n for _, n in nnx.iter_graph(layer) if isinstance(n, nnx.Dropout)]
        assert dropouts and all(type(d) is Dropout for d in dropouts), type(layer).__name__
