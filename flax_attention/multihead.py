"""``MultiHeadAttention``: causal heads split from one projection (the chapter 3 notebook and
article).

Shape legend: ``b`` batch (any leading axes), ``t`` = ``num_tokens``, ``d_in`` input features,
``d_out`` output features, ``h`` = ``num_heads`` heads of ``d`` = ``head_dim = d_out // h``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_attention import cache as decode_cache
from flax_attention._checks import check_bool, check_positive_int
from flax_attention._inputs import check_causal_input
from flax_attention.causal import causal_attention, documents_mask, init_causal_layer
from flax_attention.core import BlockSizes, Implementation
from flax_attention.mesh import (
    FROM_HEADS,
    HEADS,
    constrain,
)

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(decode_cache.CachedLayer, nnx.Module):
    """The chapter 3 notebook and article, ``MultiHeadAttention``: split heads, causal attention,
    ``out_proj``.

    ``x`` ``(..., num_tokens, d_in)`` -> ``(..., num_tokens, d_out)``.
    ``torch_reference/multihead.py`` is the documents' code; its ``forward`` maps to
    ``_forward`` here (``__call__`` checks ``x``, then runs it):

    ==================================================  =========================================
    document (``torch_reference/multihead.py``)          here
    ==================================================  =========================================
    ``keys = self.W_key(x)``, ``.view(b, t, h, d)``      ``_split_heads(self.W_key(x))``
    ``.transpose(1, 2)`` (heads before tokens)           none: the core takes ``(..., t, h, d)``
    ``attn_scores = queries @ keys.transpose(2, 3)``     ``attend`` (core)
    ``attn_scores.masked_fill_(mask_bool, -torch.inf)``  ``is_causal=True`` (``-inf`` above the
                                                         diagonal, ``causal_mask``)
    ``torch.softmax(attn_scores / head_dim ** 0.5)``     ``masked_softmax`` (float32 or wider)
    ``attn_weights = self.dropout(attn_weights)``        ``dropout=self.dropout``
    ``(attn_weights @ values).transpose(1, 2)``          the core's weighted sum, ``(..., t, h, d)``
    ``.contiguous().view(b, t, d_out)``                  ``context_vec.reshape(..., t, d_out)``
    ``self.out_proj(context_vec)``                       the same
    ==================================================  =========================================

    The core call is ``causal_attention`` (``flax_attention.causal``), shared with
    ``CausalAttention``. Flax options: ``implementation``, ``block_sizes``, ``init_cache`` and
    ``decode=True`` as in ``CausalAttention``, and for the decoders after GPT-2 (each off by
    default, where the layer is the documents'):

    - ``num_kv_heads``: key and value heads, dividing ``num_heads`` (grouped-query attention:
      ``W_key`` and ``W_value`` are ``(d_in, num_kv_heads * head_dim)``, query head ``i`` reads
      key head ``i // (num_heads // num_kv_heads)``; the core reads the shared heads as they
      are, and the decode cache keeps ``num_kv_heads`` heads);
    - ``window``: a sliding window of ``window`` keys on top of causality (query ``q`` sees keys
      ``q - window < j <= q``);
    - ``rotary``: a function ``rotary(x, positions)`` applied to the queries and keys
      ``(..., t, h, d)`` after their projections (and before the cache keeps the keys), with
      the tokens' positions ``(..., t)``: rotary position embeddings. ``__call__``'s
      ``positions`` gives them (left-padded rows: counted from each row's first token;
      ``flax_attention.cache.padded_positions``); by default they count from 0, or from the
      cache's length with ``decode``;
    - ``out_bias``: ``out_proj``'s bias (the documents': always).
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
        num_kv_heads: int | None = None,
        window: int | None = None,
        rotary=None,
        out_bias: bool = True,
        implementation: Implementation | None = None,
        block_sizes: BlockSizes | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        rngs: nnx.Rngs,
    ):
        check_positive_int("num_heads", num_heads)
        linear = init_causal_layer(
            self, d_in, d_out, context_length, dropout, qkv_bias, implementation=implementation,
            block_sizes=block_sizes, dtype=dtype, param_dtype=param_dtype, precision=precision,
            rngs=rngs, num_heads=num_heads, num_kv_heads=num_kv_heads, window=window,
        )  # fmt: skip
        if rotary is not None and not callable(rotary):
            raise TypeError(f"rotary ({rotary!r}) must be None or a function (x, positions) -> x")
        check_bool("out_bias", out_bias)
        self.rotary = rotary
        self.out_proj = linear(d_out, d_out, use_bias=out_bias, axes=FROM_HEADS)

    @property
    def mask(self) -> np.ndarray:
        """The documents' buffer, ``triu(ones(context_length, context_length), diagonal=1)``."""
        return documents_mask(self.context_length)

    def model_axis_sizes(self) -> dict[str, int]:
        """What ``flax_attention.shard`` splits over ``model``: the heads (and the key heads)."""
        return {"num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads}

    def init_cache(self, batch_size, max_length: int | None = None, dtype=None) -> None:
        """An empty decode cache for ``batch_size`` sequences of ``max_length`` tokens
        (``flax_attention.cache.new_cache``; ``dtype`` defaults to the computation dtype); on a
        sharded layer it is placed on the parameters' mesh at once."""
        decode_cache.install_cache(
            self, batch_size, max_length, dtype, heads=self.num_kv_heads, head_dim=self.head_dim
        )

    def __call__(
        self, x: jax.Array, *, decode: bool = False, mask=None, positions=None
    ) -> jax.Array:
        """``x`` ``(..., t, d_in)`` -> ``(..., t, d_out)``. Flax options: ``decode`` (continue the
        sequence in the decode cache), ``mask``, bool, broadcastable to the weights
        ``(..., h, t, s)`` (``s``: ``t``, or the cache's ``max_length`` with ``decode``):
        ``False`` hides a key (left padding: ``(b, 1, 1, s)``) on top of the causal mask, and
        ``positions``, ints ``(..., t)`` or ``(t,)``, the tokens' positions for ``rotary``
        (refused without it)."""
        check_causal_input(x, self.d_in, self.context_length)
        if positions is not None:
            if self.rotary is None:
                raise ValueError(
                    "positions (given) needs a layer with rotary (MultiHeadAttention(..., "
                    "rotary=...)); without one a token's position is its slot"
                )
            if jnp.shape(positions)[-1:] != x.shape[-2:-1]:
                raise ValueError(
                    f"positions.shape ({jnp.shape(positions)}) must end in x's tokens "
                    f"({x.shape[-2]}): (..., t) or (t,)"
                )
        return self._forward(x, decode=decode, mask=mask, positions=positions)

    def _forward(self, x: jax.Array, *, decode: bool, mask, positions=None) -> jax.Array:
        """``__call__`` on a checked ``x``: what a model's block calls with the hidden states it
        made itself (the model checks its own inputs at its door)."""
        heads = (*x.shape[:-1], -1, self.head_dim)  # (..., t, h, d): h or h_kv heads
        keys = self.W_key(x).reshape(heads)  # (..., t, h_kv, d)
        queries = self.W_query(x).reshape(heads)  # (..., t, h, d)
        values = self.W_value(x).reshape(heads)  # (..., t, h_kv, d)
        if not jax.sharding.get_abstract_mesh().empty:  # on a mesh: each head on its device
            keys, queries, values = (constrain(y, HEADS) for y in (keys, queries, values))
        if self.rotary is not None:
            queries, keys = self._rotate(queries, keys, positions, decode)
        context_vec = self._attend(
            queries,
            keys,
            values,
            cache=(self.cached_key, self.cached_value, self.cache_index) if decode else None,
            mask=mask,
            window=self.window,
            dropout=self.dropout,
            precision=self.precision,
            implementation=self.implementation,
            block_sizes=self.block_sizes,
        )  # (..., t, h, d)
        context_vec = context_vec.reshape(*x.shape[:-1], self.d_out)  # (..., t, d_out)
        # out_proj reduces over the heads; on an explicit mesh its result is laid out like x.
        return self.out_proj(context_vec)  # (..., t, d_out)

    def _rotate(self, queries, keys, positions, decode: bool):
        """``rotary`` applied to the queries and keys ``(..., t, h, d)`` at ``positions``
        (``None``: from 0, or from the cache's length); a layer that transforms them first
        (the models' ``q_norm``/``k_norm``) overrides it."""
        if positions is None:
            start = decode_cache.cached_length(self) if decode else 0
            positions = start + jnp.arange(queries.shape[-3])
        return self.rotary(queries, positions), self.rotary(keys, positions)

    #: The heads' causal attention, with the decode cache when given (``causal_attention``); a
    #: layer with another cache overrides it (``MultiHeadAttentionWithSWA``'s ring).
    _attend = staticmethod(causal_attention)
