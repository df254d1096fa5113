"""The package's one decode cache, and a jitted generation loop over it.

The causal layers and the Annotated Transformer's ``DecoderLayer`` (its self-attention's keys and
values; ``flax_attention.models.annotated``) decode on it. A layer with a cache keeps, as
``nnx.Cache`` variables (state, not parameters):

- ``cached_key``, ``cached_value``: ``(..., h, max_length, d)``, heads first, the projected keys
  and values of every token seen so far (``h = 1``, ``d = d_out`` for the single-head
  ``CausalAttention``; the wrapper keeps one cache per head), zeros beyond ``cache_index``;
- ``cache_index``: int32 scalar, how many tokens the cache holds (the position of the next one).

The layer declares all three in ``__init__`` as ``None`` and ``init_cache`` fills them from
``new_cache``; ``__call__(x, decode=True)`` (the ``DecoderLayer``'s ``step``) passes them to
``append``. What this module reads of
a layer is the ``DecodingLayer`` protocol below: those variables, ``context_length`` (the longest
cache) and ``cache_dtype`` (the cache's default dtype); it knows no layer class. What a model
reads of its layers' caches goes through the layers' own methods: ``clear_cache()``,
``cached_length()`` (the next token's position) and ``cache_capacity()`` (``max_length``), and
a model's blocks answer for their attention's the same way (``TransformerBlock``, the
encoder-decoder's ``Decoder``): a model never reads a layer's attributes for its cache.

Every decode loop of the package (``decode_loop`` here, ``flax_attention.models.generate``, the
Annotated Transformer's ``greedy_decode``) and the benchmarks' loops run one step the same way,
``decode_step``: the module merged from its weights (loop constants) and its state (the caches,
RNG counts: what travels), one forward pass with the caches, the last new token's row, and the
state the step left written back out of the module. ``split_for_decode`` makes the three parts
from a module before the loop.

Heads first, because the attention reads the cache as it is stored: XLA's CPU dot takes the
batch axes ``(b, h)`` leading, so a ``(..., max_length, h, d)`` cache was copied into that order
on every step (docs/performance.md measures it); now only the ``n`` new tokens are swapped into
place (``append``) and the core reads the cache with ``kv_layout="hsd"``.

The new tokens' rows are written in place by a native custom call where it runs (one CPU
device, the kernel built: ``kernels.native.cache_write``), else by XLA's ``dynamic_update_slice``.
XLA fused its own update into the attention's operands out of place, so each decode step copied
every layer's whole cache several times (docs/performance.md, "Where the decode step's time
goes").

The cached keys and values carry partition metadata like the keys and values themselves, heads
over ``model`` (``axes.CACHE_HEADS``; ``axes.ONE_HEAD`` for a single head):
``flax_attention.shard`` places them, and ``init_cache`` on a layer already sharded places them
on its mesh (``place_like_parameters``).

``layer(x, decode=True)`` appends ``x``'s ``n >= 1`` tokens (a prompt chunk or one step) at
``cache_index`` and attends from them to every cached token at or before their own position, so
prefill + decode steps give exactly the full causal pass. Outside ``jit`` a call that would
overflow the cache raises ``ValueError``; inside ``jit`` (where the index is not known) it leaves
the cache untouched and returns NaN, never a silently wrong result.
"""

from __future__ import annotations

import functools
import numbers
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx

from flax_attention._checks import check_positive_int
from flax_attention.kernels.native import cache_write
from flax_attention.mesh import (
    CACHE_HEADS,
    ONE_HEAD,
    expand_axes,
    laid_out_like,
    place,
    place_like_parameters,
)

__all__ = [
    "CachedLayer",
    "DecodingLayer",
    "append",
    "append_ring",
    "append_rows",
    "check_max_length",
    "decode_step",
    "decode_loop",
    "new_cache",
    "padded_positions",
    "poison_unless",
    "split_for_decode",
]


@runtime_checkable
class DecodingLayer(Protocol):
    """A layer with a decode cache: the three variables (``None`` until ``init_cache``),
    ``context_length`` (the longest cache), ``cache_dtype`` (the cache's default dtype: the
    layer's computation dtype), ``init_cache``, and the methods a model asks its layers through
    (``clear_cache``, ``cached_length``, ``cache_capacity``; ``clear_cache``, ``cached_length``
    and ``cache_capacity`` below are their bodies). ``CausalAttention``,
    ``MultiHeadAttention`` and the encoder-decoder's ``DecoderLayer`` are decoders; the wrapper
    holds one per head."""

    cached_key: nnx.Cache | None
    cached_value: nnx.Cache | None
    cache_index: nnx.Cache | None
    context_length: int

    @property
    def cache_dtype(self): ...

    def init_cache(self, batch_size, max_length: int | None = None, dtype=None) -> None: ...

    def clear_cache(self) -> None: ...

    def cached_length(self) -> jax.Array: ...

    def cache_capacity(self) -> int | None: ...


class CachedLayer:
    """The decode-cache methods of a layer with the cache (``CausalAttention``,
    ``MultiHeadAttention``, the encoder-decoder's ``DecoderLayer``), written once: the layer
    keeps the three variables and ``W_query`` (a layer without one overrides ``cache_dtype``),
    and its own ``init_cache`` (which knows its heads); a model asks its layers through
    these."""

    def clear_cache(self) -> None:
        """Drop the decode cache (back to the state of a new layer)."""
        clear_cache(self)

    def cached_length(self) -> jax.Array:
        """Tokens in the decode cache, the next one's position (int32; traced inside jit)."""
        return cached_length(self)

    def cache_capacity(self) -> int | None:
        """The decode cache's ``max_length``; ``None`` without a cache."""
        return cache_capacity(self)

    @property
    def cache_dtype(self):
        """The decode cache's default dtype: the layer's computation dtype."""
        return self.W_query.dtype or self.W_query.param_dtype


def clear_cache(layer: DecodingLayer) -> None:
    """Drop ``layer``'s decode cache: its three variables back to ``None``, as in a new layer."""
    layer.cached_key = layer.cached_value = layer.cache_index = None


def cached_length(layer: DecodingLayer) -> jax.Array:
    """How many tokens ``layer``'s cache holds, the position of the next one: an int32 scalar
    (traced inside ``jit``). No cache raises ``ValueError``."""
    if layer.cache_index is None:
        raise ValueError("decode (True) needs a decode cache (call init_cache(batch_size) first)")
    return layer.cache_index[...]


def cache_capacity(layer: DecodingLayer) -> int | None:
    """The tokens ``layer``'s cache holds at most (its ``max_length``); ``None`` without one."""
    return None if layer.cached_key is None else layer.cached_key.shape[-2]


def new_cache(
    batch_size, max_length: int | None, *, context_length: int, heads: int, head_dim: int, dtype
) -> dict[str, nnx.Cache]:
    """An empty cache for ``batch_size`` sequences of ``max_length`` tokens, by variable name.

    Args:
      batch_size: an int, or a tuple of ints for several leading batch axes.
      max_length: tokens the cache holds; ``None`` means (and it may not exceed) the layer's
        ``context_length``.
      heads, head_dim: the ``(h, d)`` of the layer's keys and values.
      dtype: of the cached keys and values.

    Returns ``{"cached_key", "cached_value", "cache_index"}``: zeros ``(..., h, max_length, d)``
    twice, with heads (one head: its features) over ``model`` (``CACHE_HEADS``, ``ONE_HEAD``),
    and an int32 zero.
    """
    batch_shape = (batch_size,) if isinstance(batch_size, numbers.Integral) else batch_size
    if not isinstance(batch_shape, tuple) or not batch_shape:
        raise TypeError(f"batch_size ({batch_size!r}) must be an int or a non-empty tuple of ints")
    for size in batch_shape:
        check_positive_int("batch_size", size)
    max_length = check_max_length(max_length, context_length)
    shape = (*batch_shape, heads, max_length, head_dim)  # (..., h, max_length, d)
    # Sharded like the keys and values: batch over "data", heads (one head: its features) over
    # "model".
    axes = expand_axes(CACHE_HEADS if heads > 1 else ONE_HEAD, len(shape))
    cache = functools.partial(nnx.Cache, out_sharding=axes, eager_sharding=False)
    return {
        "cached_key": cache(jnp.zeros(shape, dtype)),
        "cached_value": cache(jnp.zeros(shape, dtype)),
        "cache_index": nnx.Cache(jnp.array(0, jnp.int32)),
    }


def check_max_length(max_length, context_length) -> int:
    """A cache's ``max_length``: the one given (a positive int, at most ``context_length`` where
    the layer has one), or the layer's ``context_length``; a layer without one (``None``, the
    book's modern layers) needs it given."""
    if max_length is None:
        if context_length is None:
            raise ValueError(
                "max_length (None) must be given for a layer without a context_length "
                "(init_cache(batch_size, max_length))"
            )
        return context_length
    check_positive_int("max_length", max_length)
    if context_length is not None and max_length > context_length:
        raise ValueError(
            f"max_length ({max_length}) must not exceed context_length ({context_length})"
        )
    return max_length


def install_cache(
    layer: DecodingLayer, batch_size, max_length, dtype, *, heads: int, head_dim: int
) -> None:
    """``new_cache`` for a ``DecodingLayer`` (``context_length``, ``cache_dtype``, the three
    declared cache variables): placed on the layer's mesh if its parameters are sharded, then
    set on it. ``dtype`` defaults to the layer's ``cache_dtype``."""
    cache = new_cache(
        batch_size,
        max_length,
        context_length=layer.context_length,
        heads=heads,
        head_dim=head_dim,
        dtype=dtype or layer.cache_dtype,
    )
    place_like_parameters(layer, cache)
    layer.cached_key = cache["cached_key"]
    layer.cached_value = cache["cached_value"]
    layer.cache_index = cache["cache_index"]


def append(cached_key, cached_value, cache_index, keys, values):
    """Write ``keys``/``values`` ``(..., n, h, d)`` into the cache at ``cache_index``.

    The three ``nnx.Cache`` variables are updated in place (``None`` for a layer without a cache
    raises). Returns the whole cache ``(..., h, max_length, d)`` twice (heads first: attend with
    ``kv_layout="hsd"``), the position of the first new token (the queries' offset) and whether
    the tokens fitted (always ``True`` outside jit; inside, an overflow leaves the cache as it
    was and the caller poisons its output).
    """
    if cached_key is None or cached_value is None or cache_index is None:
        raise ValueError("decode (True) needs a decode cache (call init_cache(batch_size) first)")
    cache_shape = cached_key.shape
    num_new, max_length = keys.shape[-3], cache_shape[-2]
    if keys.shape[:-3] != cache_shape[:-3]:
        raise ValueError(
            f"x's batch shape ({keys.shape[:-3]}) must equal the cache's batch shape "
            f"({cache_shape[:-3]}) (init_cache(batch_size))"
        )
    index = cache_index[...]
    fits = _check_fit(index, num_new, max_length)

    def write(cache, new):  # only the new tokens' slots
        new = jnp.swapaxes(new, -3, -2).astype(cache.dtype)  # (..., h, n, d): n tokens only
        return _write_rows(cache, laid_out_like(new, cache), index, fits)

    cached_key[...] = write(cached_key[...], keys)
    cached_value[...] = write(cached_value[...], values)
    cache_index[...] = jnp.where(fits, index + num_new, index)
    return cached_key[...], cached_value[...], index, fits


def padded_positions(attention_mask, offset, num_tokens: int):
    """Left-padded rows: ``(positions, key_mask)`` of ``num_tokens`` tokens at slots ``offset``
    on (``0`` for a whole prompt, the cache's length for a decode step).

    ``attention_mask`` ``(b, s)`` is 1 for a token and 0 for padding (``s``: the tokens, or the
    cache's ``max_length``). ``positions`` ``(b, num_tokens)`` count from each row's first token
    (transformers' ``cumsum(mask) - 1``, padding at 0): what position embeddings (``GPTModel``'s
    table, a layer's ``rotary``) read, the same in a full pass and step by step. ``key_mask``
    ``(b, 1, 1, s)`` bool hides the padding keys (the layers' ``mask``)."""
    attention_mask = jnp.asarray(attention_mask)
    counts = jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1  # (b, s)
    index = offset + jnp.arange(num_tokens)  # (t,) the new tokens' slots
    positions = jnp.maximum(jnp.take(counts, index, axis=-1), 0)  # (b, t)
    return positions, attention_mask.astype(bool)[:, None, None, :]


def _write_rows(cache, rows, index, fits):
    """``cache`` ``(..., S, F)`` with ``rows`` ``(..., n, F)`` written at ``index`` along axis
    -2, the old rows again where they do not fit (``fits`` false). In place through the native
    write where it can take ``cache`` (``kernels.native.cache_write.usable``; XLA's update copies
    the whole cache each decode step, docs/performance.md), else XLA's ``dynamic_update_slice``."""
    if cache_write.usable(cache):
        return _native_write(cache, rows, index)
    return _xla_write(cache, rows, index, fits)


def _xla_write(cache, rows, index, fits):
    axis = cache.ndim - 2
    old = jax.lax.dynamic_slice_in_dim(cache, index, rows.shape[-2], axis)
    rows = jnp.where(fits, rows, old)
    return jax.lax.dynamic_update_slice_in_dim(cache, rows, index, axis)


@jax.custom_jvp
def _native_write(cache, rows, index):
    return cache_write.write(cache, rows, index)  # checks the fit itself


@_native_write.defjvp
def _native_write_jvp(primals, tangents):
    """The write is linear in the cache and the rows: their tangents are written alike (by
    XLA's update, which JAX can transpose), so a decode step stays differentiable."""
    cache, rows, index = primals
    cache_dot, rows_dot, _ = tangents
    fits = index + rows.shape[-2] <= cache.shape[-2]
    return _native_write(cache, rows, index), _xla_write(cache_dot, rows_dot, index, fits)


def _check_fit(index, num_new: int, max_length: int):
    """Outside jit, an overflow is a ``ValueError``; returns whether the tokens fit (traced
    inside jit, where the caller poisons its output)."""
    if num_new > max_length:  # static: too long at any position, inside jit too
        raise ValueError(
            f"num_tokens ({num_new}) must not exceed the cache's max_length ({max_length})"
        )
    if not isinstance(index, jax.core.Tracer) and int(index) + num_new > max_length:
        raise ValueError(
            f"cache_index + num_tokens ({int(index)} + {num_new}) must not exceed the "
            f"cache's max_length ({max_length}) (init_cache(..., max_length) or a new cache)"
        )
    return index + num_new <= max_length


def append_rows(cached, cache_index, rows):
    """A cache of rows (multi-head latent attention's latent ``(..., max_length, F)``): write
    ``rows`` ``(..., n, F)`` at ``cache_index``, as ``append`` writes keys. Returns the whole
    cache, the first new token's position and whether the rows fitted."""
    if cached is None or cache_index is None:
        raise ValueError("decode (True) needs a decode cache (call init_cache(batch_size) first)")
    index, num_new = cache_index[...], rows.shape[-2]
    if rows.shape[:-2] != cached.shape[:-2]:
        raise ValueError(
            f"x's batch shape ({rows.shape[:-2]}) must equal the cache's batch shape "
            f"({cached.shape[:-2]}) (init_cache(batch_size))"
        )
    fits = _check_fit(index, num_new, cached.shape[-2])
    cached[...] = _write_rows(cached[...], rows.astype(cached.dtype), index, fits)
    cache_index[...] = jnp.where(fits, index + num_new, index)
    return cached[...], index, fits


def append_ring(cached_key, cached_value, cache_index, keys, values, max_length: int):
    """A sliding window's ring (``cached_key``/``cached_value`` ``(..., h, W, d)``: the last
    ``W`` tokens' keys and values, in order): ``keys``/``values`` ``(..., n, h, d)`` join it.

    Returns the ring followed by the new tokens, ``(..., h, W + n, d)`` twice (heads first: the
    queries, at ``query_offset=W``, attend to these), ``keep`` ``(W + n,)`` bool (``False`` for
    the ring's slots no token has filled yet) and whether the tokens fitted under ``max_length``
    (``cache_index`` counts every token seen); the ring keeps the last ``W`` of the two."""
    if cached_key is None or cached_value is None or cache_index is None:
        raise ValueError("decode (True) needs a decode cache (call init_cache(batch_size) first)")
    if keys.shape[:-3] != cached_key.shape[:-3]:
        raise ValueError(
            f"x's batch shape ({keys.shape[:-3]}) must equal the cache's batch shape "
            f"({cached_key.shape[:-3]}) (init_cache(batch_size))"
        )
    index, num_new, ring = cache_index[...], keys.shape[-3], cached_key.shape[-2]
    fits = _check_fit(index, num_new, max_length)
    seen = []
    for cache, new in ((cached_key, keys), (cached_value, values)):
        new = jnp.swapaxes(new, -3, -2).astype(cache.dtype)  # (..., h, n, d)
        both = jnp.concatenate([cache[...], new], axis=-2)  # (..., h, W + n, d)
        cache[...] = jnp.where(fits, both[..., num_new:, :], cache[...])  # the last W
        seen.append(both)
    keep = jnp.arange(ring + num_new) >= ring - jnp.minimum(index, ring)  # filled slots
    cache_index[...] = jnp.where(fits, index + num_new, index)
    return seen[0], seen[1], keep, fits


def poison_unless(fits, x):
    """``x`` where the tokens fitted in the cache, NaN where they did not (inside jit)."""
    return jnp.where(fits, x, jnp.asarray(jnp.nan, x.dtype))


def split_for_decode(module: nnx.Module, weights=nnx.Param):
    """``(graphdef, weights, state)`` of ``module`` for a decode loop: ``weights`` (a filter,
    parameters by default) are what the loop holds constant, ``state`` (everything else: the
    caches, RNG counts) what travels through it. What comes back from a ``jit`` is committed to
    its devices; the state is committed alike (a fresh cache, a fresh RNG count), so the
    second call with the same shapes does not compile again."""
    graphdef, weights, state = nnx.split(module, weights, ...)
    return graphdef, weights, jax.tree.map(_committed, state)


def _committed(x):
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return place(x, x.sharding)
    return x


def decode_step(graphdef, weights, state, forward, *inputs, head=None, weights_filter=nnx.Param):
    """One step of a decode loop on a module split by ``split_for_decode``: ``(state, y)``.

    The module is merged from ``graphdef``, ``weights`` and ``state``; ``forward(module,
    *inputs)`` runs it on the new tokens, ``(..., n, F)`` out, its cached layers appending the
    tokens' keys and values at their ``cache_index`` and advancing it; ``y`` is the last new
    token's row ``(..., F)`` (the one the next token comes from), through ``head(module, y)``
    where one is given (a model's logits: only the last row pays for the head). ``state`` is
    the module's state as the step left it, everything but ``weights_filter`` (the filter
    ``weights`` was split with), to pass to the next step or ``nnx.update`` the module with.
    """
    module = nnx.merge(graphdef, weights, state)
    y = forward(module, *inputs)[..., -1, :]  # (..., F)
    if head is not None:
        y = head(module, y)
    return nnx.state(module, nnx.Not(weights_filter)), y


def _decode(module, x):
    """``decode_loop``'s forward: the layer (or any module) on ``x`` with its cache."""
    return module(x, decode=True)


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _decode_loop(graphdef, params, state, prompt, num_steps, next_input):
    """The parameters go in only; the rest (the caches, any RNG state) goes in and comes out.
    Returning the parameters too would copy them on every call and hand back committed arrays
    where the caller's were not, which compiles the function a second time."""
    state, first = decode_step(graphdef, params, state, _decode, prompt)  # (..., d_out)

    def step(state_y, _):
        state, y = state_y
        state, y = decode_step(graphdef, params, state, _decode, next_input(y[..., None, :]))
        return (state, y), y

    (state, _), ys = jax.lax.scan(step, (state, first), length=num_steps)
    return state, jnp.concatenate([first[None], ys], axis=0)  # (steps + 1, ..., d_out)


def _identity(y):
    return y


def decode_loop(module, prompt, num_steps: int, next_input=_identity):
    """Prefill the cache with ``prompt`` and run ``num_steps`` decode steps, all in one ``jit``.

    ``module``'s cache must be initialised (``init_cache``); each step feeds
    ``next_input(y)`` (``(..., 1, d_out) -> (..., 1, d_in)``, identity by default, so
    ``d_in == d_out``) of the previous output ``y``. The loop is a ``lax.scan`` of
    ``decode_step``: no Python work per token, one compilation per (module structure, prompt
    shape, ``num_steps``, ``next_input``). The cache state is written back to ``module``.

    Returns ``(..., num_steps + 1, d_out)``: the prompt's last output, then one per step.
    """
    check_positive_int("num_steps", num_steps)
    layers = [node for _, node in nnx.iter_graph(module) if isinstance(node, DecodingLayer)]
    if not layers or any(layer.cache_capacity() is None for layer in layers):
        raise ValueError("module must have a decode cache (call init_cache(batch_size) first)")
    for layer in layers:
        index, max_length = int(layer.cached_length()), layer.cache_capacity()
        needed = prompt.shape[-2] + num_steps
        if index + needed > max_length:
            raise ValueError(
                f"cache_index + prompt tokens + num_steps ({index} + {prompt.shape[-2]} + "
                f"{num_steps}) must not exceed the cache's max_length ({max_length})"
            )
    graphdef, params, state = split_for_decode(module)
    state, ys = _decode_loop(graphdef, params, state, prompt, num_steps, next_input)
    nnx.update(module, state)
    return jnp.moveaxis(ys, 0, -2)  # (..., num_steps + 1, d_out)
