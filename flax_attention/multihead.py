"""``MultiHeadAttention``: causal heads split from one projection (documents 000 and 002).

Shape legend: ``b`` batch (any leading axes), ``t`` = ``num_tokens``, ``d_in`` input features,
``d_out`` output features, ``h`` = ``num_heads`` heads of ``d`` = ``head_dim = d_out // h``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flax_attention._checks import check_divisible, check_positive_int
from flax_attention._init import linear_factory
from flax_attention.causal import CausalMaskMixin, check_causal_args
from flax_attention.sharding import FROM_HEADS, HEADS, TO_HEADS, constrain

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(CausalMaskMixin, nnx.Module):
    """Documents 000 and 002, ``MultiHeadAttention``: split heads, causal attention, ``out_proj``.

    ``x`` ``(..., num_tokens, d_in)`` -> ``(..., num_tokens, d_out)``. ``implementation``,
    ``init_cache`` and ``decode=True`` as in ``CausalAttention``.
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
        check_divisible("d_out", d_out, num_heads)
        self.d_in = d_in
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.context_length = context_length
        self.implementation = implementation
        self.precision = precision
        linear = linear_factory(
            dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs
        )
        self.W_query = linear(d_in, d_out, use_bias=qkv_bias, axes=TO_HEADS)
        self.W_key = linear(d_in, d_out, use_bias=qkv_bias, axes=TO_HEADS)
        self.W_value = linear(d_in, d_out, use_bias=qkv_bias, axes=TO_HEADS)
        self.out_proj = linear(d_out, d_out, axes=FROM_HEADS)  # always biased, as in the documents
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def _split_heads(self, x):
        x = x.reshape(*x.shape[:-1], self.num_heads, self.head_dim)  # (..., t, h, d)
        return constrain(x, HEADS)  # on a mesh: each head stays on its device

    def _cache_heads(self):
        return self.num_heads, self.head_dim

    def __call__(self, x: jax.Array, *, decode: bool = False) -> jax.Array:
        self._check_causal_input(x)
        keys = self._split_heads(self.W_key(x))  # (..., t, h, d)
        queries = self._split_heads(self.W_query(x))  # (..., t, h, d)
        values = self._split_heads(self.W_value(x))  # (..., t, h, d)
        context_vec = self._causal_attention(queries, keys, values, decode)  # (..., t, h, d)
        context_vec = context_vec.reshape(*x.shape[:-1], self.d_out)  # (..., t, d_out)
        return self.out_proj(context_vec)  # (..., t, d_out)
