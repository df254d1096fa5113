"""What a layer built eagerly (outside ``jit``) compiles: the initialisers draw JAX's own values
from a flat draw of a few sizes, the values the traced path (unchanged) gives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flax_attention as fa
from flax_attention import _init, models
from flax_attention.models import lora


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _drawn_shapes(monkeypatch) -> list:
    """The shapes ``jax.random.uniform`` is asked for from now on."""
    shapes, original = [], jax.random.uniform

    def spy(key, shape=(), *args, **kwargs):
        shapes.append(tuple(shape))
        return original(key, shape, *args, **kwargs)

    monkeypatch.setattr(jax.random, "uniform", spy)
    return shapes


def test_the_initialisers_give_jax_s_values_drawn_flat(monkeypatch):
    key = jax.random.key(7)
    kernel_init = jax.nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")
    expected = {  # JAX's own draws of each shape, before the spy
        (shape, dtype): (
            jax.random.uniform(key, shape, dtype, -0.25, 0.5),
            kernel_init(key, shape, dtype),
            jax.random.uniform(key, shape, dtype),
            nnx.initializers.normal(1.0)(key, shape, dtype),
        )
        for shape, dtype in [((3, 5), "float32"), ((2, 3, 4), "bfloat16")]
    }
    bound = 1 / 5**0.5  # the LoRA A matrix: torch's kaiming_uniform_(a=sqrt(5)) of (r, 5)
    lora_a = jax.random.uniform(key, (3, 5), "float32", -bound, bound)
    shapes = _drawn_shapes(monkeypatch)
    for (shape, dtype), (bias, kernel, rand, normal) in expected.items():
        got = _init.uniform(key, shape, dtype, -0.25, 0.5)
        assert got.shape == shape and got.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(_bits(got), _bits(bias))
        got = _init.torch_linear_kernel_init(key, shape, dtype)
        np.testing.assert_array_equal(_bits(got), _bits(kernel))
        np.testing.assert_array_equal(_bits(_init.torch_rand(key, shape, dtype)), _bits(rand))
        got = _init.standard_normal(key, shape, dtype)  # the embeddings'
        np.testing.assert_array_equal(_bits(got), _bits(normal))
    got = lora.torch_kaiming_uniform_a_sqrt5(key, (3, 5), "float32")
    np.testing.assert_array_equal(_bits(got), _bits(lora_a))
    assert shapes == [(16,)] * 3 + [(32,)] * 3 + [(16,)]  # 15 and 24 values, rounded up


def test_the_draw_sizes_are_few_and_close():
    sizes = {n: _init._draw_size(n) for n in (1, 2, 3, 1000, 1 << 20, (1 << 20) + 1, 50257 * 768)}
    assert sizes == {
        1: 1, 2: 2, 3: 4, 1000: 1024, 1 << 20: 1 << 20,
        (1 << 20) + 1: 1179648, 50257 * 768: 41943040,
    }  # fmt: skip
    for n in range((1 << 20) + 1, 1 << 26, 999_983):  # above 2**20: at most an eighth more
        assert n <= _init._draw_size(n) <= 1.125 * n


def test_a_traced_mesh_or_other_generator_draw_is_jax_s_own(monkeypatch):
    shapes = _drawn_shapes(monkeypatch)
    key = jax.random.key(3)
    jax.jit(lambda k: _init.torch_rand(k, (3, 5)))(key)  # traced
    _init.torch_rand(jax.random.key(3, impl="rbg"), (3, 5))  # another generator
    with jax.threefry_partitionable(False):  # values not a function of the index alone
        _init.torch_rand(key, (3, 5))
    with jax.set_mesh(jax.make_mesh((1,), ("data",))):
        _init.torch_rand(key, (3, 5))
    assert shapes == [(3, 5)] * 4
    _init.torch_rand(key, (0, 5))  # nothing to draw
    assert shapes[-1] == (0, 5)


def test_a_layer_built_eagerly_equals_one_built_under_jit():
    cfg = {
        "vocab_size": 13, "context_length": 6, "emb_dim": 8, "n_heads": 2, "n_layers": 1,
        "drop_rate": 0.0, "qkv_bias": True,
    }  # fmt: skip
    for build in (
        lambda: fa.SelfAttention_v1(3, 2, rngs=nnx.Rngs(2)),  # torch.rand
        lambda: models.GPTModel(cfg, rngs=nnx.Rngs(5)),  # Linears, the embeddings' N(0, 1)
    ):
        eager, traced = fa.state_dict(build()), fa.state_dict(nnx.jit(build)())
        assert list(eager) == list(traced)
        for name in eager:
            np.testing.assert_array_equal(_bits(eager[name]), _bits(traced[name]), err_msg=name)
