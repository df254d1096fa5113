"""Causal attention: masking two ways, ``CausalAttention`` and ``MultiHeadAttentionWrapper``.

Documents 000, 002 and 004, in Flax NNX. Shape legend: ``b`` batch (any leading axes), ``t`` =
``num_tokens``, ``d_in`` input features, ``d_out`` features per head, ``h`` heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_attention._checks import check_dropout, check_num_tokens, check_positive_int
from flax_attention._init import linear_factory
from flax_attention._inputs import check_input
from flax_attention.cache import DecodeCacheMixin, poison_unless
from flax_attention.core import (
    causal_mask,
    check_implementation,
    dot_product_attention,
    masked_softmax,
)
from flax_attention.sharding import ONE_HEAD, TO_HEADS, constrain

__all__ = [
    "causal_attn_weights_renormalized",
    "causal_attn_weights_masked_fill",
    "CausalAttention",
    "MultiHeadAttentionWrapper",
]


def causal_attn_weights_renormalized(attn_scores, d_key):
    """Document 000, causal masking, first way: softmax, zero the future, renormalise the rows.

    ``attn_scores`` ``(..., t, t)`` unscaled; returns the masked weights.
    """
    attn_weights = masked_softmax(attn_scores, d_key)  # (..., t, t)
    sequence_length = attn_scores.shape[-1]
    mask = causal_mask(sequence_length, sequence_length)  # (t, t)
    masked_attn_scores = attn_weights * jnp.broadcast_to(mask, attn_weights.shape)
    row_sums = masked_attn_scores.sum(axis=-1, keepdims=True)  # (..., t, 1)
    return masked_attn_scores / row_sums


def causal_attn_weights_masked_fill(attn_scores, d_key):
    """Document 000, causal masking, second way: fill the future with ``-inf``, then softmax.

    ``attn_scores`` ``(..., t, t)`` unscaled; returns the masked weights.
    """
    sequence_length = attn_scores.shape[-1]
    return masked_softmax(attn_scores, d_key, causal_mask(sequence_length, sequence_length))


def check_causal_args(d_in, d_out, context_length, dropout, implementation=None):
    check_positive_int("d_in", d_in)
    check_positive_int("d_out", d_out)
    check_positive_int("context_length", context_length)
    check_dropout(dropout)
    check_implementation(implementation)


class CausalMaskMixin(DecodeCacheMixin):
    """The documents' ``mask`` buffer, derived from ``context_length`` rather than stored, the
    decode cache, and the attention call every causal layer shares.

    ``mask`` is ``triu(ones(context_length, context_length), diagonal=1)`` as float32, exactly
    the torch buffer; ``state_dict`` exports it and ``load_state_dict`` checks it.
    """

    context_length: int

    @property
    def mask(self) -> np.ndarray:
        ones = np.ones((self.context_length, self.context_length), np.float32)
        return np.triu(ones, k=1)

    def _check_causal_input(self, x):
        check_input("x", x, self.d_in)
        check_num_tokens(x.shape[-2], self.context_length)

    def _causal_attention(self, queries, keys, values, decode):
        """Causal attention of ``(..., t, h, d)`` projections through the core; with ``decode``
        the new keys and values go into the cache first and the queries attend to all of it."""
        offset, fits = 0, None
        if decode:
            keys, values, offset, fits = self._append_to_cache(keys, values)
        context_vec, _ = dot_product_attention(
            queries,
            keys,
            values,
            is_causal=True,
            query_offset=offset,
            dropout=self.dropout,
            precision=self.precision,
            implementation=self.implementation,
            need_weights=False,
        )  # (..., t, h, d)
        return context_vec if fits is None else poison_unless(fits, context_vec)


class CausalAttention(CausalMaskMixin, nnx.Module):
    """Documents 000, 002 and 004, ``CausalAttention``: one head, ``-inf`` above the diagonal.

    ``x`` ``(..., num_tokens, d_in)`` (the documents use ``(b, num_tokens, d_in)``) ->
    ``(..., num_tokens, d_out)``. ``implementation`` picks the attention core's kernel
    (``flax_attention.core``); ``init_cache`` and ``decode=True`` decode token by token
    (``flax_attention.cache``).
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        qkv_bias: bool = False,
        *,
        implementation: str | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        rngs: nnx.Rngs,
    ):
        check_causal_args(d_in, d_out, context_length, dropout, implementation)
        self.d_in = d_in
        self.d_out = d_out
        self.context_length = context_length
        self.implementation = implementation
        self.precision = precision
        linear = linear_factory(
            dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs
        )
        self.W_query = linear(d_in, d_out, use_bias=qkv_bias, axes=TO_HEADS)
        self.W_key = linear(d_in, d_out, use_bias=qkv_bias, axes=TO_HEADS)
        self.W_value = linear(d_in, d_out, use_bias=qkv_bias, axes=TO_HEADS)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def _cache_heads(self):
        return 1, self.d_out

    def __call__(self, x: jax.Array, *, decode: bool = False) -> jax.Array:
        self._check_causal_input(x)
        keys = constrain(self.W_key(x)[..., None, :], ONE_HEAD)  # (..., t, 1, d_out)
        queries = constrain(self.W_query(x)[..., None, :], ONE_HEAD)  # (..., t, 1, d_out)
        values = constrain(self.W_value(x)[..., None, :], ONE_HEAD)  # (..., t, 1, d_out)
        context_vec = self._causal_attention(queries, keys, values, decode)  # (..., t, 1, d_out)
        return context_vec[..., 0, :]  # (..., t, d_out)


class MultiHeadAttentionWrapper(nnx.Module):
    """Document 000, ``MultiHeadAttentionWrapper``: ``num_heads`` stacked ``CausalAttention``.

    ``x`` ``(..., num_tokens, d_in)`` -> ``(..., num_tokens, num_heads * d_out)``.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
        *,
        implementation: str | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        rngs: nnx.Rngs,
    ):
        check_positive_int("num_heads", num_heads)
        check_causal_args(d_in, d_out, context_length, dropout, implementation)
        self.heads = nnx.List(
            [
                CausalAttention(
                    d_in,
                    d_out,
                    context_length,
                    dropout,
                    qkv_bias,
                    implementation=implementation,
                    dtype=dtype,
                    param_dtype=param_dtype,
                    precision=precision,
                    rngs=rngs,
                )
                for _ in range(num_heads)
            ]
        )

    def init_cache(self, batch_size, max_length: int | None = None, dtype=None) -> None:
        """One decode cache per head (``CausalAttention.init_cache``)."""
        for head in self.heads:
            head.init_cache(batch_size, max_length, dtype)

    def __call__(self, x: jax.Array, *, decode: bool = False) -> jax.Array:
        return jnp.concatenate([head(x, decode=decode) for head in self.heads], axis=-1)
