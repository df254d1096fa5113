"""Causal attention: masking two ways, ``CausalAttention`` and ``MultiHeadAttentionWrapper``.

The chapter 3 notebook and article and the ``CausalAttention`` listing, in Flax NNX. Shape legend:
``b`` batch (any leading axes), ``t`` = ``num_tokens``, ``d_in`` input features, ``d_out``
features per head, ``h`` heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_attention import cache as decode_cache
from flax_attention._checks import (
    check_dropout,
    check_int,
    check_positive_int,
    check_splits_over_heads,
)
from flax_attention._inputs import check_causal_input, check_d_key
from flax_attention._layers import Dropout, linear_factory
from flax_attention.core import (
    AttentionMask,
    BlockSizes,
    Implementation,
    attend,
    causal_mask,
    check_block_sizes,
    check_implementation,
    masked_softmax,
)
from flax_attention.masking import check_window
from flax_attention.mesh import (
    ONE_HEAD,
    TO_HEADS,
    constrain,
    features_whole,
)

__all__ = [
    "causal_attn_weights_renormalized",
    "causal_attn_weights_masked_fill",
    "CausalAttention",
    "MultiHeadAttentionWrapper",
]


def causal_attn_weights_renormalized(attn_scores, d_key):
    """The chapter 3 notebook, causal masking, first way: softmax, zero the future, renormalise the
    rows.

    ``attn_scores`` ``(..., t, t)`` unscaled; returns the masked weights.
    """
    check_d_key(d_key)
    attn_weights = masked_softmax(attn_scores, d_key)  # (..., t, t)
    sequence_length = attn_scores.shape[-1]
    mask = causal_mask(sequence_length, sequence_length)  # (t, t)
    masked_attn_scores = attn_weights * jnp.broadcast_to(mask, attn_weights.shape)
    row_sums = masked_attn_scores.sum(axis=-1, keepdims=True)  # (..., t, 1)
    return masked_attn_scores / row_sums


def causal_attn_weights_masked_fill(attn_scores, d_key):
    """The chapter 3 notebook, causal masking, second way: fill the future with ``-inf``, then
    softmax.

    ``attn_scores`` ``(..., t, t)`` unscaled; returns the masked weights.
    """
    check_d_key(d_key)
    sequence_length = attn_scores.shape[-1]
    return masked_softmax(attn_scores, d_key, causal_mask(sequence_length, sequence_length))


def check_causal_args(
    d_in, d_out, context_length, dropout, implementation=None, block_sizes=None, unbounded=False
):
    check_positive_int("d_in", d_in)
    check_positive_int("d_out", d_out)
    if unbounded:  # the book's modern layers: None, no limit
        check_int("context_length", context_length, 1, optional="no limit on the tokens")
    else:
        check_positive_int("context_length", context_length)
    check_dropout(dropout)
    check_implementation(implementation)
    check_block_sizes(block_sizes)


def init_causal_layer(
    layer,
    d_in: int,
    d_out: int,
    context_length: int,
    dropout: float,
    qkv_bias: bool,
    *,
    implementation,
    block_sizes,
    dtype,
    param_dtype,
    precision,
    rngs: nnx.Rngs,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    window: int | None = None,
    projections: bool = True,
    unbounded: bool = False,
):
    """The constructor body of ``CausalAttention`` and ``MultiHeadAttention`` (``num_heads``:
    checked positive by the caller, ``d_out`` must split over it; ``num_kv_heads``, ``None`` or
    dividing it: the key and value heads), checked: their sizes and options, ``W_query``
    ``(d_in, d_out)``, ``W_key``/``W_value`` ``(d_in, num_kv_heads * head_dim)`` (split over
    ``model`` by output features), the weights' ``dropout``, the causal ``window`` and the
    decode cache's three variables, declared empty (``init_cache`` fills them: keys and values
    ``(..., h_kv, max_length, d)``, the index). Returns the Linear factory, for the layer's own
    further projections. ``unbounded``: ``context_length`` may be ``None``, no limit on the
    tokens (the book's modern layers); ``projections=False``: no ``W_query``/``W_key``/
    ``W_value`` (the layer makes its own)."""
    check_causal_args(d_in, d_out, context_length, dropout, implementation, block_sizes, unbounded)
    check_window(window)
    d_kv = d_out
    if num_heads is not None:
        check_splits_over_heads("d_out", d_out, num_heads)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_positive_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads}) "
                "(each key head serves num_heads // num_kv_heads query heads)"
            )
        layer.num_heads = num_heads
        layer.num_kv_heads = num_kv_heads
        layer.head_dim = d_out // num_heads
        d_kv = num_kv_heads * layer.head_dim
    layer.d_in = d_in
    layer.d_out = d_out
    layer.context_length = context_length
    layer.implementation = implementation
    layer.block_sizes = block_sizes
    layer.precision = precision
    layer.window = window
    linear = linear_factory(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
    if projections:
        layer.W_query = linear(d_in, d_out, use_bias=qkv_bias, axes=TO_HEADS)
        layer.W_key = linear(d_in, d_kv, use_bias=qkv_bias, axes=TO_HEADS)
        layer.W_value = linear(d_in, d_kv, use_bias=qkv_bias, axes=TO_HEADS)
    layer.dropout = Dropout(dropout, rngs=rngs)
    layer.cached_key = nnx.data(None)
    layer.cached_value = nnx.data(None)
    layer.cache_index = nnx.data(None)
    return linear


def documents_mask(context_length: int) -> np.ndarray:
    """The documents' ``mask`` buffer: ``triu(ones(context_length, context_length), diagonal=1)``
    as float32, exactly the torch buffer (``state_dict`` exports it, ``load_state_dict`` checks
    it). The Flax layers derive it rather than store it; attention uses ``is_causal=True``."""
    ones = np.ones((context_length, context_length), np.float32)
    return np.triu(ones, k=1)


#: The fill of keys a caller's ``mask`` hides in the causal layers (left padding): finite, as
#: the annotated-transformer post's, so a padding query that sees no real key gives finite
#: (unused) values instead of NaN, which would reach the real tokens through ``0 * NaN``;
#: ``exp(-1e10 - max)`` is exactly 0, so the real tokens' outputs equal those of the unpadded
#: sequence.
PADDING_FILL = -1e10


def causal_attention(
    queries,
    keys,
    values,
    *,
    cache: tuple[nnx.Cache | None, nnx.Cache | None, nnx.Cache | None] | None,
    mask=None,
    window=None,
    dropout,
    precision,
    implementation,
    block_sizes,
):
    """Causal attention of ``(..., t, h, d)`` projections through the core, as every causal
    layer runs it. With ``cache`` (the layer's ``(cached_key, cached_value, cache_index)``, for
    ``decode=True``) the new keys and values go into the cache first and the queries attend to
    all of it from their own position; an overflow inside jit gives NaN. ``mask`` (optional,
    broadcastable to the weights ``(..., h, t, s)``, ``s`` the cache's length with ``cache``)
    hides the keys where it is ``False`` (padding) with ``PADDING_FILL``, a finite fill, so a
    query that sees only hidden keys stays finite; causality (and ``window``, a sliding window
    of that many keys) still applies on top. Keys and values may have fewer heads than the
    queries (grouped-query attention; the core reads them as they are)."""
    offset, fits, kv_layout = 0, None, "shd"
    if cache is not None:  # the whole cache, heads first
        keys, values, offset, fits = decode_cache.append(*cache, keys, values)
        kv_layout = "hsd"
    attention_mask = AttentionMask.build(
        mask,
        is_causal=True,
        query_offset=offset,
        fill_value=PADDING_FILL,
        window=window,
        dtype=jnp.result_type(queries, keys),
    )
    context_vec = attend(
        queries,
        keys,
        values,
        attention_mask,
        dropout=dropout,
        precision=precision,
        implementation=implementation,
        block_sizes=block_sizes,
        kv_layout=kv_layout,
    )  # (..., t, h, d)
    return context_vec if fits is None else decode_cache.poison_unless(fits, context_vec)


class CausalAttention(decode_cache.CachedLayer, nnx.Module):
    """The chapter 3 notebook and article and the ``CausalAttention`` listing:
    ``CausalAttention``: one head, ``-inf`` above the diagonal.

    ``x`` ``(..., num_tokens, d_in)`` (the documents use ``(b, num_tokens, d_in)``) ->
    ``(..., num_tokens, d_out)``. ``torch_reference/causal.py`` is the documents' code; its
    ``forward`` maps to ``__call__`` here line by line:

    =======================================================  ====================================
    document (``torch_reference/causal.py``)                  here
    =======================================================  ====================================
    ``keys = self.W_key(x)`` (and queries, values)            the same, as ``(..., t, 1, d_out)``
    ``attn_scores = queries @ keys.transpose(1, 2)``          ``attend`` (core)
    ``attn_scores.masked_fill_(self.mask.bool()[:t, :t],      ``is_causal=True``: ``-inf`` where
    -torch.inf)``                                             ``causal_mask`` is ``False``
    ``torch.softmax(attn_scores / keys.shape[-1] ** 0.5)``    ``masked_softmax`` (float32 or wider)
    ``attn_weights = self.dropout(attn_weights)``             ``dropout=self.dropout``
    ``context_vec = attn_weights @ values``                   the core's weighted sum
    =======================================================  ====================================

    The ``mask`` buffer is a property (``documents_mask``), exported and checked by the weight
    bridge. Flax options: ``implementation`` and ``block_sizes`` pick the core's kernel
    (``flax_attention.core``); ``init_cache`` and ``decode=True`` decode token by token
    (``flax_attention.cache``); the cache's variables are ``None`` until ``init_cache``.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        qkv_bias: bool = False,
        *,
        implementation: Implementation | None = None,
        block_sizes: BlockSizes | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        rngs: nnx.Rngs,
    ):
        init_causal_layer(
            self, d_in, d_out, context_length, dropout, qkv_bias, implementation=implementation,
            block_sizes=block_sizes, dtype=dtype, param_dtype=param_dtype, precision=precision,
            rngs=rngs,
        )  # fmt: skip

    @property
    def mask(self) -> np.ndarray:
        """The documents' buffer, ``triu(ones(context_length, context_length), diagonal=1)``."""
        return documents_mask(self.context_length)

    def model_axis_sizes(self) -> dict[str, int]:
        """What ``flax_attention.shard`` splits over ``model``: the features of the one head."""
        return {"d_out": self.d_out}

    def init_cache(self, batch_size, max_length: int | None = None, dtype=None) -> None:
        """An empty decode cache for ``batch_size`` sequences of ``max_length`` tokens
        (``flax_attention.cache.new_cache``; ``dtype`` defaults to the computation dtype); on a
        sharded layer it is placed on the parameters' mesh at once."""
        decode_cache.install_cache(
            self, batch_size, max_length, dtype, heads=1, head_dim=self.d_out
        )

    def __call__(self, x: jax.Array, *, decode: bool = False) -> jax.Array:
        check_causal_input(x, self.d_in, self.context_length)
        keys = self.W_key(x)[..., None, :]  # (..., t, 1, d_out)
        queries = self.W_query(x)[..., None, :]  # (..., t, 1, d_out)
        values = self.W_value(x)[..., None, :]  # (..., t, 1, d_out)
        if not jax.sharding.get_abstract_mesh().empty:  # on a mesh: the one head's features
            keys, queries, values = (constrain(y, ONE_HEAD) for y in (keys, queries, values))
        context_vec = causal_attention(
            queries,
            keys,
            values,
            cache=(self.cached_key, self.cached_value, self.cache_index) if decode else None,
            dropout=self.dropout,
            precision=self.precision,
            implementation=self.implementation,
            block_sizes=self.block_sizes,
        )  # (..., t, 1, d_out)
        return context_vec[..., 0, :]  # (..., t, d_out)


class MultiHeadAttentionWrapper(nnx.Module):
    """The chapter 3 notebook, ``MultiHeadAttentionWrapper``: ``num_heads`` stacked
    ``CausalAttention``.

    ``x`` ``(..., num_tokens, d_in)`` -> ``(..., num_tokens, num_heads * d_out)``. As in
    ``torch_reference/causal.py``: ``torch.cat([head(x) for head in self.heads], dim=-1)``, each
    head a ``CausalAttention`` (whose docstring maps the attention lines to the core call).
    ``init_cache`` gives every head its own cache.
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
        implementation: Implementation | None = None,
        block_sizes: BlockSizes | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        rngs: nnx.Rngs,
    ):
        check_positive_int("num_heads", num_heads)
        check_causal_args(d_in, d_out, context_length, dropout, implementation, block_sizes)
        self.heads = nnx.List(
            [
                CausalAttention(
                    d_in,
                    d_out,
                    context_length,
                    dropout,
                    qkv_bias,
                    implementation=implementation,
                    block_sizes=block_sizes,
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

    def clear_cache(self) -> None:
        """Drop every head's decode cache."""
        for head in self.heads:
            head.clear_cache()

    def __call__(self, x: jax.Array, *, decode: bool = False) -> jax.Array:
        outs = [head(x, decode=decode) for head in self.heads]  # each (..., t, d_out)
        # On an Explicit mesh each head's d_out features are over "model": gathered first.
        outs = [features_whole(out) for out in outs]
        return jnp.concatenate(outs, axis=-1)  # (..., t, num_heads * d_out)
