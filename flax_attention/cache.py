"""The decode cache of the causal layers, and a jitted generation loop over it.

A layer with a cache keeps, as ``nnx.Cache`` variables (state, not parameters):

- ``cached_key``, ``cached_value``: ``(..., h, max_length, d)``, heads first, the projected keys
  and values of every token seen so far (``h = 1``, ``d = d_out`` for the single-head
  ``CausalAttention``; the wrapper keeps one cache per head), zeros beyond ``cache_index``;
- ``cache_index``: int32 scalar, how many tokens the cache holds (the position of the next one).

The layer declares all three in ``__init__`` as ``None`` and ``init_cache`` fills them from
``new_cache``; ``__call__(x, decode=True)`` passes them to ``append``. What this module reads of
a layer is the ``Decoder`` protocol below: those variables, ``context_length`` (the longest
cache) and ``W_query`` (whose dtype is the cache's default); it knows no layer class.

Heads first, because the attention reads the cache as it is stored: XLA's CPU dot takes the
batch axes ``(b, h)`` leading, so a ``(..., max_length, h, d)`` cache was copied into that order
on every step (docs/performance.md measures it); now only the ``n`` new tokens are swapped into
place (``append``) and the core reads the cache with ``kv_layout="hsd"``.

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
from flax_attention.axes import (
    CACHE_HEADS,
    ONE_HEAD,
    expand_axes,
    explicit_mesh,
    place,
    place_like_parameters,
)

__all__ = ["Decoder", "append", "generate", "new_cache", "poison_unless"]


@runtime_checkable
class Decoder(Protocol):
    """A layer with a decode cache: the three variables (``None`` until ``init_cache``),
    ``init_cache``, and what ``install_cache`` reads: ``context_length`` and the query projection
    ``W_query`` (an ``nnx.Linear``). ``CausalAttention`` and ``MultiHeadAttention`` are decoders;
    the wrapper holds one per head."""

    cached_key: nnx.Cache | None
    cached_value: nnx.Cache | None
    cache_index: nnx.Cache | None
    context_length: int
    W_query: nnx.Linear

    def init_cache(self, batch_size, max_length: int | None = None, dtype=None) -> None: ...


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
    max_length = context_length if max_length is None else max_length
    check_positive_int("max_length", max_length)
    if max_length > context_length:
        raise ValueError(
            f"max_length ({max_length}) must not exceed context_length ({context_length})"
        )
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


def install_cache(
    layer: Decoder, batch_size, max_length, dtype, *, heads: int, head_dim: int
) -> None:
    """``new_cache`` for a ``Decoder`` (``context_length``, ``W_query``, the three declared cache
    variables): placed on the layer's mesh if its parameters are sharded, then set on it.
    ``dtype`` defaults to the layer's computation dtype."""
    cache = new_cache(
        batch_size,
        max_length,
        context_length=layer.context_length,
        heads=heads,
        head_dim=head_dim,
        dtype=dtype or layer.W_query.dtype or layer.W_query.param_dtype,
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
    if num_new > max_length:  # static: too long at any position, inside jit too
        raise ValueError(
            f"num_tokens ({num_new}) must not exceed the cache's max_length ({max_length})"
        )
    index = cache_index[...]
    if not isinstance(index, jax.core.Tracer) and int(index) + num_new > max_length:
        raise ValueError(
            f"cache_index + num_tokens ({int(index)} + {num_new}) must not exceed the "
            f"cache's max_length ({max_length}) (init_cache(..., max_length) or a new cache)"
        )
    fits = index + num_new <= max_length

    def write(cache, new):  # only the new tokens' slots; the old ones again if no fit
        axis = cache.ndim - 2
        new = jnp.swapaxes(new, -3, -2).astype(cache.dtype)  # (..., h, n, d): n tokens only
        if explicit_mesh() is not None:  # laid out as the cache (tokens of a replicated batch)
            new = jax.sharding.reshard(new, jax.typeof(cache).sharding.spec)
        old = jax.lax.dynamic_slice_in_dim(cache, index, num_new, axis)
        new = jnp.where(fits, new, old)
        return jax.lax.dynamic_update_slice_in_dim(cache, new, index, axis)

    cached_key[...] = write(cached_key[...], keys)
    cached_value[...] = write(cached_value[...], values)
    cache_index[...] = jnp.where(fits, index + num_new, index)
    return cached_key[...], cached_value[...], index, fits


def poison_unless(fits, x):
    """``x`` where the tokens fitted in the cache, NaN where they did not (inside jit)."""
    return jnp.where(fits, x, jnp.asarray(jnp.nan, x.dtype))


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _generate(graphdef, params, state, prompt, num_steps, next_input):
    """The parameters go in only; the rest (the caches, any RNG state) goes in and comes out.
    Returning the parameters too would copy them on every call and hand back committed arrays
    where the caller's were not, which compiles the function a second time."""
    module = nnx.merge(graphdef, params, state)
    y = module(prompt, decode=True)[..., -1:, :]  # (..., 1, d_out)

    def step(carry, _):
        state, y = carry
        module = nnx.merge(graphdef, params, state)
        y = module(next_input(y), decode=True)  # (..., 1, d_out)
        return (nnx.state(module, nnx.Not(nnx.Param)), y), y[..., 0, :]

    carry = (nnx.state(module, nnx.Not(nnx.Param)), y)
    (state, _), ys = jax.lax.scan(step, carry, length=num_steps)
    first = y[..., 0, :]
    return state, jnp.concatenate([first[None], ys], axis=0)  # (steps + 1, ..., d_out)


def _identity(y):
    return y


def generate(module, prompt, num_steps: int, next_input=_identity):
    """Prefill the cache with ``prompt`` and run ``num_steps`` decode steps, all in one ``jit``.

    ``module``'s cache must be initialised (``init_cache``); each step feeds
    ``next_input(y)`` (``(..., 1, d_out) -> (..., 1, d_in)``, identity by default, so
    ``d_in == d_out``) of the previous output ``y``. The loop is a ``lax.scan``: no Python work
    per token, one compilation per (module structure, prompt shape, ``num_steps``,
    ``next_input``). The cache state is written back to ``module``.

    Returns ``(..., num_steps + 1, d_out)``: the prompt's last output, then one per step.
    """
    check_positive_int("num_steps", num_steps)
    layers = [node for _, node in nnx.iter_graph(module) if isinstance(node, Decoder)]
    if not layers or any(layer.cache_index is None for layer in layers):
        raise ValueError("module must have a decode cache (call init_cache(batch_size) first)")
    for layer in layers:
        index, max_length = int(layer.cache_index[...]), layer.cached_key.shape[-2]
        needed = prompt.shape[-2] + num_steps
        if index + needed > max_length:
            raise ValueError(
                f"cache_index + prompt tokens + num_steps ({index} + {prompt.shape[-2]} + "
                f"{num_steps}) must not exceed the cache's max_length ({max_length})"
            )
    graphdef, params, state = nnx.split(module, nnx.Param, ...)
    # What comes back from the jit is committed to its devices; commit what goes in alike (a
    # fresh cache, a fresh RNG count) so the second call does not compile again.
    state = jax.tree.map(lambda x: place(x, x.sharding) if isinstance(x, jax.Array) else x, state)
    state, ys = _generate(graphdef, params, state, prompt, num_steps, next_input)
    nnx.update(module, state)
    return jnp.moveaxis(ys, 0, -2)  # (..., num_steps + 1, d_out)
