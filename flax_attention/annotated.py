"""``MultiHeadedAttention``, ``attention`` and ``clones``: the annotated transformer (document 001).

Shape legend: ``b`` batch, ``h`` = ``num_heads``, ``t`` = ``q_len`` query tokens, ``s`` =
``k_len`` key/value tokens, ``d_model`` model features, ``d`` = ``k_dim = d_model // h``.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from flax_attention._checks import (
    check_divisible,
    check_dropout,
    check_features,
    check_floating,
    check_mask,
    check_positive_int,
    check_rank,
    check_same,
)
from flax_attention._init import linear_factory, set_linear_axes
from flax_attention.core import dot_product_attention
from flax_attention.sharding import FROM_HEADS, TO_HEADS

__all__ = ["MultiHeadedAttention", "attention", "clones"]

#: Document 001 fills ``mask == 0`` with this finite value, not ``-inf``.
MASK_FILL_VALUE = -1e10


class AttentionScore(nnx.Intermediate):
    """The last attention weights ``(b, h, q_len, k_len)`` of a ``MultiHeadedAttention`` call."""


class MultiHeadedAttention(nnx.Module):
    """Document 001, ``MultiHeadedAttention(num_heads, d_model, dropout=0.1)``.

    ``query`` ``(b, q_len, d_model)``, ``key`` and ``value`` ``(b, k_len, d_model)``, ``mask``
    ``(b, q_len, k_len)`` or any 3-D shape that broadcasts to it, such as ``(1, q_len, k_len)``
    or a padding mask ``(b, 1, k_len)``; positions where ``mask == 0`` get ``-1e10``. Returns
    ``(b, q_len, d_model)``; the last weights ``(b, h, q_len, k_len)`` stay in
    ``self.attention_score`` (an ``AttentionScore`` variable, ``None`` before the first call).

    As in the document, the four projections are ``clones`` of one ``Linear``: they start equal.
    """

    def __init__(
        self,
        num_heads: int,
        d_model: int,
        dropout: float = 0.1,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        rngs: nnx.Rngs,
    ):
        check_positive_int("num_heads", num_heads)
        check_positive_int("d_model", d_model)
        check_dropout(dropout)
        check_divisible("d_model", d_model, num_heads)
        # Assume v_dim always equals k_dim
        self.k_dim = d_model // num_heads
        self.num_heads = num_heads
        self.precision = precision
        linear = linear_factory(
            dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs
        )
        self.proj_weights = clones(linear(d_model, d_model, axes=TO_HEADS), 4)  # W^Q, W^K, W^V, W^O
        set_linear_axes(self.proj_weights[-1], FROM_HEADS)  # W^O reduces over the heads
        self.attention_score = nnx.data(None)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, query, key, value, mask=None):
        d_model = self.num_heads * self.k_dim
        _check_inputs(query, key, value, mask, d_model)
        if mask is not None:
            mask = jnp.asarray(mask)[:, None]  # (b or 1, 1, t or 1, s)

        # 1) Apply W^Q, W^K, W^V; (b, seq_len, d_model) -> (b, seq_len, h, d)
        query, key, value = [
            proj_weight(x).reshape(*x.shape[:-1], self.num_heads, self.k_dim)
            for proj_weight, x in zip(self.proj_weights, [query, key, value], strict=False)
        ]

        # 2) Attention and the weights, (b, t, h, d) and (b, h, t, s)
        out, attention_score = dot_product_attention(
            query,
            key,
            value,
            None if mask is None else mask != 0,
            fill_value=MASK_FILL_VALUE,
            dropout=self.dropout,
            precision=self.precision,
        )
        self.attention_score = AttentionScore(attention_score)

        # 3) "Concat" output, (b, t, d_model)
        out = out.reshape(*out.shape[:-2], d_model)

        # 4) Apply W^O to get the final output
        return self.proj_weights[-1](out)


def clones(module, N):
    "Produce N identical layers."
    return nnx.List([nnx.clone(module) for _ in range(N)])


def attention(query, key, value, mask=None, dropout=None, *, precision=None):
    """Document 001, ``attention``: scaled dot product with an optional ``mask == 0`` fill.

    Args:
      query: ``(..., q_len, k_dim)``, e.g. ``(b, h, q_len, k_dim)`` as in the document.
      key: ``(..., k_len, k_dim)``.
      value: ``(..., k_len, v_dim)``.
      mask: broadcastable to ``(..., q_len, k_len)``; ``mask == 0`` gets ``-1e10``.
      dropout: an ``nnx.Dropout`` applied to the weights, or ``None``.

    Returns:
      ``out`` ``(..., q_len, v_dim)`` and ``attention_score`` ``(..., q_len, k_len)``.
    """
    # The core's layout is (..., t, h, d): the document's (..., t, d) is one head.
    out, attention_score = dot_product_attention(
        query[..., None, :],
        key[..., None, :],
        value[..., None, :],
        None if mask is None else jnp.asarray(mask)[..., None, :, :] != 0,
        fill_value=MASK_FILL_VALUE,
        dropout=dropout,
        precision=precision,
    )
    return out[..., 0, :], attention_score[..., 0, :, :]


def _check_inputs(query, key, value, mask, d_model):
    for name, x in (("query", query), ("key", key), ("value", value)):
        shape = jnp.shape(x)
        check_rank(name, shape, (3,), "b, seq_len, d_model")
        check_features(name, shape, d_model, "d_model")
        dtype = jnp.result_type(x)
        check_floating(name, str(dtype), jnp.issubdtype(dtype, jnp.floating))
    q_shape, k_shape, v_shape = jnp.shape(query), jnp.shape(key), jnp.shape(value)
    check_same("key.shape[0]", k_shape[0], "query.shape[0]", q_shape[0])
    check_same("value.shape[0]", v_shape[0], "query.shape[0]", q_shape[0])
    check_same("value.shape[1]", v_shape[1], "key.shape[1]", k_shape[1])
    if mask is not None:
        dtype = jnp.result_type(mask)
        valid = jnp.issubdtype(dtype, jnp.bool_) or (
            jnp.issubdtype(dtype, jnp.number) and not jnp.issubdtype(dtype, jnp.complexfloating)
        )
        check_mask(jnp.shape(mask), (q_shape[0], q_shape[1], k_shape[1]), valid, str(dtype))
