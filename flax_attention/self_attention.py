"""Self-attention without and with trainable weights (the chapter 3 notebook and article, the
self-attention notebook), in Flax NNX.

Shape legend: ``t`` = ``num_tokens``, ``d_in`` input features, ``d_out`` output features. The
documents take one sequence ``(num_tokens, d_in)``; these layers also take leading batch axes
``(..., num_tokens, d_in)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flax_attention._checks import check_positive_int
from flax_attention._init import partitioned, torch_rand
from flax_attention._inputs import check_array, check_input
from flax_attention._layers import linear_factory
from flax_attention.core import attend, masked_softmax
from flax_attention.mesh import ONE_HEAD, TO_HEADS, constrain

__all__ = [
    "softmax_naive",
    "simplified_self_attention",
    "SelfAttention_v1",
    "SelfAttention_v2",
    "SelfAttention",
]


def softmax_naive(x):
    """The self-attention notebook, step 1: ``exp(x) / sum(exp(x))`` over the first axis (no max
    subtraction)."""
    check_array("x", x, 1, "scores; the softmax runs over the first axis")
    return jnp.exp(x) / jnp.exp(x).sum(axis=0)


def simplified_self_attention(inputs, *, precision=None):
    """The chapter 3 notebook and the self-attention notebook: attention without weights.

    ``inputs`` ``(num_tokens, d_in)``; returns ``(attn_scores, attn_weights, context_vecs)`` with
    shapes ``(num_tokens, num_tokens)``, ``(num_tokens, num_tokens)``, ``(num_tokens, d_in)``.
    No scaling, as in the documents (``d_key = 1`` for the shared softmax).
    """
    check_array("inputs", inputs, 2, "num_tokens, d_in")
    attn_scores = jnp.matmul(inputs, inputs.T, precision=precision)  # (t, t)
    attn_weights = masked_softmax(attn_scores, 1)  # (t, t)
    context_vecs = jnp.matmul(attn_weights, inputs, precision=precision)  # (t, d_in)
    return attn_scores, attn_weights, context_vecs


def _project(x, kernel, precision):
    return jnp.matmul(x, kernel, precision=precision)


class SelfAttention_v1(nnx.Module):
    """The self-attention notebook, ``SelfAttention_v1``: raw ``(d_in, d_out)`` matrices drawn like
    ``torch.rand``.

    ``x`` ``(..., num_tokens, d_in)`` -> ``(..., num_tokens, d_out)``. The lines of
    ``torch_reference/self_attention.py`` and the calls that replace them here:

    ===============================================  ===========================================
    document (``torch_reference/self_attention.py``)  here
    ===============================================  ===========================================
    ``keys = x @ self.W_key`` (queries, values)       ``_project``, as ``(..., t, 1, d_out)``
    ``attn_scores = queries @ keys.T``                ``attend`` (core)
    (no mask)                                         no ``mask``, ``is_causal=False``
    ``torch.softmax(attn_scores / d_k ** 0.5)``       ``masked_softmax`` (float32 or wider)
    (no dropout)                                      no ``dropout``
    ``context_vec = attn_weights @ values``           the core's weighted sum
    ===============================================  ===========================================
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        rngs: nnx.Rngs,
    ):
        check_positive_int("d_in", d_in)
        check_positive_int("d_out", d_out)
        self.d_in = d_in
        self.d_out = d_out
        self.dtype = dtype
        self.precision = precision
        init = partitioned(torch_rand, TO_HEADS.kernel)  # (d_in, d_out): d_out over "model"
        self.W_query = nnx.Param(init(rngs.params(), (d_in, d_out), param_dtype))
        self.W_key = nnx.Param(init(rngs.params(), (d_in, d_out), param_dtype))
        self.W_value = nnx.Param(init(rngs.params(), (d_in, d_out), param_dtype))

    def model_axis_sizes(self) -> dict[str, int]:
        """What ``flax_attention.shard`` splits over ``model``: the features of the one head."""
        return {"d_out": self.d_out}

    def __call__(self, x: jax.Array) -> jax.Array:
        check_input("x", x, self.d_in)
        x, W_query, W_key, W_value = nnx.nn.dtypes.promote_dtype(
            (x, self.W_query[...], self.W_key[...], self.W_value[...]), dtype=self.dtype
        )
        keys = constrain(_project(x, W_key, self.precision)[..., None, :], ONE_HEAD)
        queries = constrain(_project(x, W_query, self.precision)[..., None, :], ONE_HEAD)
        values = constrain(_project(x, W_value, self.precision)[..., None, :], ONE_HEAD)
        # keys, queries, values: (..., t, 1, d_out)
        context_vec = attend(queries, keys, values, precision=self.precision)
        return context_vec[..., 0, :]  # (..., t, d_out)


class SelfAttention_v2(nnx.Module):
    """The self-attention notebook, ``SelfAttention_v2`` (the chapter 3 notebook and article call it
    ``SelfAttention``).

    ``nnx.Linear`` projections with torch's initialisers, optional bias.
    ``x`` ``(..., num_tokens, d_in)`` -> ``(..., num_tokens, d_out)``. The lines of
    ``torch_reference/self_attention.py`` and the calls that replace them here:

    ===============================================  ===========================================
    document (``torch_reference/self_attention.py``)  here
    ===============================================  ===========================================
    ``keys = self.W_key(x)`` (queries, values)        the same, as ``(..., t, 1, d_out)``
    ``attn_scores = queries @ keys.T``                ``attend`` (core)
    (no mask)                                         no ``mask``, ``is_causal=False``
    ``torch.softmax(attn_scores / d_k ** 0.5,         ``masked_softmax`` over the keys (float32
    dim=1)``                                          or wider)
    (no dropout)                                      no ``dropout``
    ``context_vec = attn_weights @ values``           the core's weighted sum
    ===============================================  ===========================================
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        qkv_bias: bool = False,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        rngs: nnx.Rngs,
    ):
        check_positive_int("d_in", d_in)
        check_positive_int("d_out", d_out)
        self.d_in = d_in
        self.d_out = d_out
        self.precision = precision
        linear = linear_factory(
            dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs
        )
        self.W_query = linear(d_in, d_out, use_bias=qkv_bias, axes=TO_HEADS)
        self.W_key = linear(d_in, d_out, use_bias=qkv_bias, axes=TO_HEADS)
        self.W_value = linear(d_in, d_out, use_bias=qkv_bias, axes=TO_HEADS)

    def model_axis_sizes(self) -> dict[str, int]:
        """What ``flax_attention.shard`` splits over ``model``: the features of the one head."""
        return {"d_out": self.d_out}

    def __call__(self, x: jax.Array) -> jax.Array:
        check_input("x", x, self.d_in)
        keys = constrain(self.W_key(x)[..., None, :], ONE_HEAD)  # (..., t, 1, d_out)
        queries = constrain(self.W_query(x)[..., None, :], ONE_HEAD)  # (..., t, 1, d_out)
        values = constrain(self.W_value(x)[..., None, :], ONE_HEAD)  # (..., t, 1, d_out)
        context_vec = attend(queries, keys, values, precision=self.precision)
        return context_vec[..., 0, :]  # (..., t, d_out)


#: The chapter 3 notebook and article name the same layer ``SelfAttention``.
SelfAttention = SelfAttention_v2
