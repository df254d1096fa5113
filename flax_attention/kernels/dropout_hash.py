"""The dropout keep-mask of the fused kernels, as a pure-JAX function of the same hash.

A kernel that never materialises the ``(b, h, t, s)`` weights cannot draw dropout from
``jax.random`` and replay it in its backward. It regenerates each weight's keep bit, in the
forward and again in the backward, from a counter-based hash of ``(seed, batch, head, query,
key)``: ``keep_mask`` below is that hash, so a test can give ``reference`` the very mask the
kernel used. The hash is murmur3's 32-bit finaliser (``fmix32``) chained over the counters::

    mix(state, counter) = fmix32(state ^ (counter * 0x9E3779B9))        (uint32 arithmetic)
    bits = mix(mix(mix(mix(seed, batch), head), query), key)
    keep = bits >= round(rate * 2**32)

``batch`` is the index over the flattened leading axes, ``query`` and ``key`` count from 0 in
the call (the query offset of a decode chunk does not enter). A weight that is kept is scaled by
``1 / (1 - rate)``, as ``nnx.Dropout`` does.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["keep_mask", "key_bits", "row_hash", "threshold"]


def threshold(rate: float) -> int:
    """The uint32 bound below which a weight is dropped: ``round(rate * 2**32)``."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate ({rate}) must be in [0, 1)")
    return min(round(rate * 2**32), 2**32 - 1)


def _fmix32(x):
    x = x ^ (x >> 16)
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _mix(state, counter):
    return _fmix32(state ^ (counter * np.uint32(0x9E3779B9)))


def row_hash(seed, b: int, h: int, t: int):
    """The hash state of every ``(batch, head, query)`` row, uint32 ``(b, h, t)``: what a tiled
    kernel computes once and mixes with each key tile (``key_bits``)."""
    state = jnp.asarray(seed, jnp.uint32)
    state = _mix(state, jnp.arange(b, dtype=jnp.uint32)[:, None, None])  # (b, 1, 1)
    state = _mix(state, jnp.arange(h, dtype=jnp.uint32)[None, :, None])  # (b, h, 1)
    return _mix(state, jnp.arange(t, dtype=jnp.uint32)[None, None, :])  # (b, h, t)


def key_bits(rows, keys):
    """The hash of rows ``(..., t)`` (``row_hash``) against key indices ``(s,)``: ``(..., t, s)``
    uint32, compared with ``threshold(rate)`` to keep a weight."""
    keys = jnp.asarray(keys, jnp.uint32).reshape((1,) * rows.ndim + (-1,))  # (1, ..., s)
    return _mix(rows[..., None], keys)


def keep_mask(seed, shape, rate: float):
    """Boolean ``shape = (b, h, t, s)``: ``True`` where the kernels keep the weight."""
    b, h, t, s = shape
    bits = key_bits(row_hash(seed, b, h, t), jnp.arange(s, dtype=jnp.uint32))  # (b, h, t, s)
    return bits >= np.uint32(threshold(rate))
