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
from flax_attention._init import Dropout


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


@pytest.mark.parametrize("shape", [(7,), (2, 1, 3, 2)])
def test_the_mask_is_nnx_dropouts_drawn_flat(shape):
    x = jnp.arange(1.0, 1.0 + np.prod(shape)).reshape(shape)  # no zeros: a zero marks a drop
    ours, theirs = Dropout(0.3, rngs=nnx.Rngs(5)), nnx.Dropout(0.3, rngs=nnx.Rngs(5))
    for _ in range(2):  # the stream advances alike
        got, want = np.asarray(ours(x)), np.asarray(theirs(x))
        np.testing.assert_array_equal(got, want)
    # a key or a stream given to the call, under jit too
    key = jax.random.key(9)
    np.testing.assert_array_equal(ours(x, rngs=key), theirs(x, rngs=key))
    np.testing.assert_array_equal(
        ours(x, rngs=nnx.Rngs(dropout=3)), theirs(x, rngs=nnx.Rngs(dropout=3))
    )
    jitted = jax.jit(lambda x, k: ours(x, rngs=k))(x, key)
    np.testing.assert_array_equal(jitted, theirs(x, rngs=key))
    assert _draw_shapes(lambda x, k: ours(x, rngs=k), x, key) == [(x.size,)]
    assert _draw_shapes(lambda x, k: theirs(x, rngs=k), x, key) == [shape]


def test_everything_else_is_nnx_dropouts_own_call():
    x = jnp.arange(1.0, 25.0).reshape(2, 3, 4)
    key = jax.random.key(4)
    for kwargs in ({"broadcast_dims": (1,)}, {"rng_collection": "other"}):
        ours, theirs = Dropout(0.5, **kwargs), nnx.Dropout(0.5, **kwargs)
        np.testing.assert_array_equal(ours(x, rngs=key), theirs(x, rngs=key))
    assert _draw_shapes(lambda x, k: Dropout(0.5, broadcast_dims=(1,))(x, rngs=k), x, key) == [
        (2, 1, 4)
    ]
    for rate in (0.0, 1.0):  # nothing drawn
        np.testing.assert_array_equal(Dropout(rate)(x, rngs=key), nnx.Dropout(rate)(x, rngs=key))
    np.testing.assert_array_equal(Dropout(0.5)(x, deterministic=True), x)
    with pytest.raises(Exception, match="deterministic"):
        Dropout(0.5, deterministic=None)(x)  # nnx's own error, as nnx.Dropout
    with pytest.raises(Exception, match="rngs"):
        Dropout(0.5)(x)
    # another generator than Threefry: its own draw, as nnx.Dropout
    rbg = jax.random.key(4, impl="rbg")
    np.testing.assert_array_equal(Dropout(0.5)(x, rngs=rbg), nnx.Dropout(0.5)(x, rngs=rbg))
    assert _draw_shapes(lambda x: Dropout(0.5)(x, rngs=rbg), x) == [(2, 3, 4)]
    # a mesh set: nnx.Dropout's draw, laid out like the inputs
    mesh = jax.make_mesh((1,), ("data",))
    with jax.set_mesh(mesh):
        assert _draw_shapes(lambda x, k: Dropout(0.5)(x, rngs=k), x, key) == [(2, 3, 4)]


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
