"""The book's modern attention: grouped-query, multi-head latent and sliding-window attention.

The chapter 4 bonus layers (``torch_reference/modern.py`` is the book's code), in Flax NNX, on
the package's one attention core and its decode cache. Each keeps the book's parameter names, so
the book's state dicts load through ``fa.load_state_dict`` as they are, and each decodes with
``init_cache(batch_size, max_length)`` then ``layer(chunk, decode=True)`` (chunks of any length),
the book's ``forward(x, use_cache=True)``, holding in its cache what its variant promises and no
more (``nnx.Cache`` variables):

==============================  ==================================  ============================
layer                           what attends                        its cache
==============================  ==================================  ============================
``GroupedQueryAttention``       ``num_kv_groups`` key and value     the key and value groups:
                                heads shared by ``num_heads``       ``(b, num_kv_groups,
                                query heads (read as they are,      max_length, head_dim)`` twice
                                never repeated)
``MultiHeadLatentAttention``    keys and values up-projected from   the latent ``(b, max_length,
                                a latent of ``latent_dim`` features  latent_dim)``
``MultiHeadAttentionWithSWA``   a sliding window of                 a ring of the last
                                ``sliding_window_size`` keys        ``sliding_window_size`` keys
                                                                    and values: its size does
                                                                    not grow with ``max_length``
==============================  ==================================  ============================

The book's layers take no ``context_length`` (they have no mask buffer); here it is an optional
keyword, ``None`` by default: no limit on the tokens of a call, and ``init_cache`` then needs its
``max_length``. Shape legend as in ``flax_attention.core``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flax_attention import cache as decode_cache
from flax_attention._checks import check_int, check_positive_int
from flax_attention._inputs import check_causal_input
from flax_attention.causal import PADDING_FILL, causal_attention, init_causal_layer
from flax_attention.core import AttentionMask, BlockSizes, Implementation, attend
from flax_attention.layouts import Names, register
from flax_attention.mesh import (
    DATA,
    FROM_HEADS,
    TO_HEADS,
    LinearAxes,
    expand_axes,
    place_like_parameters,
)
from flax_attention.multihead import MultiHeadAttention

__all__ = ["GroupedQueryAttention", "MultiHeadAttentionWithSWA", "MultiHeadLatentAttention"]

#: The latent's projection is not split over the mesh (every head reads all of it).
_REPLICATED = LinearAxes(kernel=(None, None), bias=(None,))


class GroupedQueryAttention(MultiHeadAttention):
    """The book's ``GroupedQueryAttention`` (``ch04/04_gqa``): ``num_heads`` query heads over
    ``num_kv_groups`` key and value heads, causal; ``out_proj`` without a bias, as the book's.

    ``x`` ``(..., num_tokens, d_in)`` -> ``(..., num_tokens, d_out)``. It is
    ``MultiHeadAttention(..., num_kv_heads=num_kv_groups, out_bias=False)``: the book's
    ``repeat_interleave`` of the key heads is the core's grouped heads (query head ``i`` reads
    group ``i // (num_heads // num_kv_groups)``, the same pairing), and the decode cache holds
    the groups only. Flax options as ``MultiHeadAttention``'s."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        dropout: float,
        num_heads: int,
        num_kv_groups: int,
        *,
        qkv_bias: bool = False,
        context_length: int | None = None,
        implementation: Implementation | None = None,
        block_sizes: BlockSizes | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        rngs: nnx.Rngs,
    ):
        check_positive_int("num_heads", num_heads)
        check_positive_int("num_kv_groups", num_kv_groups)
        if num_heads % num_kv_groups:
            raise ValueError(
                f"num_heads ({num_heads}) must be divisible by num_kv_groups ({num_kv_groups})"
            )
        linear = init_causal_layer(
            self, d_in, d_out, context_length, dropout, qkv_bias, implementation=implementation,
            block_sizes=block_sizes, dtype=dtype, param_dtype=param_dtype, precision=precision,
            rngs=rngs, num_heads=num_heads, num_kv_heads=num_kv_groups, unbounded=True,
        )  # fmt: skip
        self.rotary = None
        self.out_proj = linear(d_out, d_out, use_bias=False, axes=FROM_HEADS)  # as the book's
        self.num_kv_groups = num_kv_groups
        self.group_size = num_heads // num_kv_groups


class MultiHeadLatentAttention(decode_cache.CachedLayer, nnx.Module):
    """The book's ``MultiHeadLatentAttention`` (``ch04/05_mla``): queries ``W_query(x)``, a
    latent ``W_DKV(x)`` of ``latent_dim`` features (``None``: the book's ``max(16, d_out //
    8)``), keys ``W_UK(latent)`` and values ``W_UV(latent)``, causal attention, ``out_proj``.

    The decode cache holds the latent, ``cached_latent`` ``(..., max_length, latent_dim)``, and
    up-projects all of it at each call, as the book's cache does. Flax options as
    ``MultiHeadAttention``'s."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        dropout: float,
        num_heads: int,
        *,
        qkv_bias: bool = False,
        latent_dim: int | None = None,
        context_length: int | None = None,
        implementation: Implementation | None = None,
        block_sizes: BlockSizes | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        rngs: nnx.Rngs,
    ):
        check_positive_int("num_heads", num_heads)
        check_int("latent_dim", latent_dim, 1, optional="the book's max(16, d_out // 8)")
        linear = init_causal_layer(
            self, d_in, d_out, context_length, dropout, qkv_bias, implementation=implementation,
            block_sizes=block_sizes, dtype=dtype, param_dtype=param_dtype, precision=precision,
            rngs=rngs, num_heads=num_heads, projections=False, unbounded=True,
        )  # fmt: skip
        self.latent_dim = max(16, d_out // 8) if latent_dim is None else latent_dim
        self.W_query = linear(d_in, d_out, use_bias=qkv_bias, axes=TO_HEADS)
        self.W_DKV = linear(d_in, self.latent_dim, use_bias=qkv_bias, axes=_REPLICATED)
        self.W_UK = linear(self.latent_dim, d_out, use_bias=qkv_bias, axes=TO_HEADS)
        self.W_UV = linear(self.latent_dim, d_out, use_bias=qkv_bias, axes=TO_HEADS)
        self.out_proj = linear(d_out, d_out, axes=FROM_HEADS)
        self.cached_latent = nnx.data(None)

    def model_axis_sizes(self) -> dict[str, int]:
        """What ``flax_attention.shard`` splits over ``model``: the heads."""
        return {"num_heads": self.num_heads}

    def init_cache(self, batch_size, max_length: int | None = None, dtype=None) -> None:
        """An empty latent cache for ``batch_size`` sequences of ``max_length`` tokens:
        ``cached_latent`` ``(..., max_length, latent_dim)`` (the batch over ``data`` on a mesh)
        and ``cache_index``."""
        cache = decode_cache.new_cache(
            batch_size, max_length, context_length=self.context_length, heads=1,
            head_dim=self.latent_dim, dtype=dtype or self.cache_dtype,
        )  # fmt: skip
        latent = cache["cached_key"][...][..., 0, :, :]  # (..., max_length, latent_dim)
        axes = expand_axes((DATA, ..., None, None), latent.ndim)
        variables = {
            "cached_latent": nnx.Cache(latent, out_sharding=axes, eager_sharding=False),
            "cache_index": cache["cache_index"],
        }
        place_like_parameters(self, variables)
        self.cached_latent = variables["cached_latent"]
        self.cache_index = variables["cache_index"]

    def clear_cache(self) -> None:
        self.cached_latent = self.cache_index = None

    def cache_capacity(self) -> int | None:
        return None if self.cached_latent is None else self.cached_latent.shape[-2]

    def __call__(self, x: jax.Array, *, decode: bool = False, mask=None) -> jax.Array:
        """``x`` ``(..., t, d_in)`` -> ``(..., t, d_out)``; ``decode`` and ``mask`` (bool,
        broadcastable to the weights, ``False`` hides a key: left padding) as
        ``MultiHeadAttention``'s."""
        check_causal_input(x, self.d_in, self.context_length)
        return self._forward(x, decode=decode, mask=mask)

    def _heads(self, x):
        return x.reshape(*x.shape[:-1], self.num_heads, self.head_dim)  # (..., t, h, d)

    def _forward(self, x: jax.Array, *, decode: bool = False, mask=None) -> jax.Array:
        queries = self._heads(self.W_query(x))  # (..., t, h, d)
        latent = self.W_DKV(x)  # (..., t, latent_dim)
        offset, fits = 0, None
        if decode:
            latent, offset, fits = decode_cache.append_rows(
                self.cached_latent, self.cache_index, latent
            )  # the whole cache, (..., max_length, latent_dim)
        keys, values = self._heads(self.W_UK(latent)), self._heads(self.W_UV(latent))
        attention_mask = AttentionMask.build(
            mask, is_causal=True, query_offset=offset, fill_value=PADDING_FILL,
            dtype=jnp.result_type(queries, keys),
        )  # fmt: skip
        context_vec = attend(
            queries, keys, values, attention_mask, dropout=self.dropout,
            precision=self.precision, implementation=self.implementation,
            block_sizes=self.block_sizes,
        )  # fmt: skip
        if fits is not None:
            context_vec = decode_cache.poison_unless(fits, context_vec)
        return self.out_proj(context_vec.reshape(*x.shape[:-1], self.d_out))


class MultiHeadAttentionWithSWA(MultiHeadAttention):
    """The book's ``MultiHeadAttentionWithSWA`` (``ch04/06_swa``): chapter 3's
    ``MultiHeadAttention`` with a sliding window of ``sliding_window_size`` keys (``None``: no
    window): query ``q`` sees keys ``q - W < k <= q``, in the core's one mask rule (the tiled
    kernels skip the tiles outside it).

    Its decode cache is a ring: ``cached_key``, ``cached_value`` ``(..., h, W, d)`` hold the last
    ``W`` tokens' keys and values in order (a chunk of ``n`` tokens attends to them and to
    itself, then the last ``W`` of the two stay), so its size does not grow with ``max_length``;
    ``cache_index`` counts the tokens seen, up to ``max_length``. Without a window the cache is
    ``MultiHeadAttention``'s."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        dropout: float,
        num_heads: int,
        *,
        qkv_bias: bool = False,
        sliding_window_size: int | None = None,
        context_length: int | None = None,
        implementation: Implementation | None = None,
        block_sizes: BlockSizes | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        rngs: nnx.Rngs,
    ):
        check_positive_int("num_heads", num_heads)
        check_int("sliding_window_size", sliding_window_size, 1, optional="no window")
        linear = init_causal_layer(
            self, d_in, d_out, context_length, dropout, qkv_bias, implementation=implementation,
            block_sizes=block_sizes, dtype=dtype, param_dtype=param_dtype, precision=precision,
            rngs=rngs, num_heads=num_heads, window=sliding_window_size, unbounded=True,
        )  # fmt: skip
        self.rotary = None
        self.out_proj = linear(d_out, d_out, axes=FROM_HEADS)
        self.sliding_window_size = sliding_window_size
        self.max_length = None  # static: the cache's token limit, set by init_cache

    def init_cache(self, batch_size, max_length: int | None = None, dtype=None) -> None:
        """An empty decode cache for ``batch_size`` sequences of up to ``max_length`` tokens: a
        ring of ``min(sliding_window_size, max_length)`` keys and values, or without a window
        ``MultiHeadAttention``'s whole cache."""
        window = self.sliding_window_size
        limit = decode_cache.check_max_length(max_length, self.context_length)
        decode_cache.install_cache(
            self, batch_size, limit if window is None else min(window, limit), dtype,
            heads=self.num_kv_heads, head_dim=self.head_dim,
        )  # fmt: skip
        self.max_length = limit

    def clear_cache(self) -> None:
        super().clear_cache()
        self.max_length = None

    def cache_capacity(self) -> int | None:
        return None if self.cached_key is None else self.max_length

    def _attend(self, queries, keys, values, *, cache, mask, window, **options):
        """``causal_attention``, or with the decode cache and a window, over the ring."""
        if cache is None or window is None:
            return causal_attention(
                queries, keys, values, cache=cache, mask=mask, window=window, **options
            )
        index = cache[2][...]  # the first new token's position
        keys, values, keep, fits = decode_cache.append_ring(
            *cache, keys, values, self.max_length
        )  # the ring and the new tokens, (..., h, W + n, d), in order
        ring = self.cached_key.shape[-2]  # the queries sit after it
        if mask is not None:  # over the cache's max_length slots: the ring's and the new ones
            mask = jnp.asarray(mask, bool)
            pad = [(0, 0)] * (mask.ndim - 1) + [(ring, 0)]  # slots before the first: hidden
            slots = jax.lax.dynamic_slice_in_dim(
                jnp.pad(mask, pad), index, keys.shape[-2], mask.ndim - 1
            )
            keep = keep.reshape((1,) * (slots.ndim - 1) + keep.shape) & slots
        attention_mask = AttentionMask.build(
            keep, is_causal=True, query_offset=ring, fill_value=PADDING_FILL, window=window,
            dtype=jnp.result_type(queries, keys),
        )  # fmt: skip
        context_vec = attend(queries, keys, values, attention_mask, kv_layout="hsd", **options)
        return decode_cache.poison_unless(fits, context_vec)


register(GroupedQueryAttention, Names())
register(MultiHeadLatentAttention, Names())
register(MultiHeadAttentionWithSWA, Names())
