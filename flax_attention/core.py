"""The attention core: every layer of ``flax_attention`` computes attention here and nowhere else.

Shape legend (the same letters in every einsum of the package):

- ``b`` batch (any number of leading axes, written ``...``)
- ``t`` query tokens, ``s`` key/value tokens
- ``h`` heads, ``d`` features per head (``d_k`` for queries/keys, ``d_v`` for values)

Layout is ``(..., t, h, d)`` for queries and ``(..., s, h, d)`` for keys and values, the layout
of ``jax.nn.dot_product_attention``; attention weights are ``(..., h, t, s)``. Single-head layers
pass ``h = 1``.

The steps are the documents': scores ``q . k``, divided by ``sqrt(d_k)``, masked positions filled
(``-inf`` for the causal family, ``-1e10`` for document 001), softmax in at least float32 and cast
back, dropout on the weights, weighted sum of the values.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = [
    "causal_mask",
    "masked_softmax",
    "dot_product_attention",
]


def causal_mask(num_queries: int, num_keys: int, offset=0) -> jax.Array:
    """Boolean ``(t, s)`` mask, ``True`` where query ``i`` may attend to key ``j``.

    Query ``i`` sits at absolute position ``offset + i`` and sees keys ``j <= offset + i``: with
    ``offset = 0`` and ``t = s`` this is ``~triu(ones(t, t), diagonal=1)``, the documents'
    ``mask`` buffer sliced to ``[:num_tokens, :num_tokens]``. ``offset`` may be traced.
    """
    rows = jnp.arange(num_queries)[:, None] + offset  # (t, 1)
    cols = jnp.arange(num_keys)[None, :]  # (1, s)
    return cols <= rows  # (t, s)


def _representable(fill_value, dtype):
    """A finite fill (document 001's ``-1e10``) clipped to ``dtype``'s range, so float16 keeps a
    finite fill (``-65504``) instead of overflowing to ``-inf`` (which would turn a fully masked
    row into NaN). Float32, bfloat16 and ``-inf`` are unchanged."""
    if math.isfinite(fill_value) and jnp.issubdtype(dtype, jnp.floating):
        return max(float(fill_value), float(jnp.finfo(dtype).min))
    return fill_value


def masked_softmax(attn_scores, d_key, mask=None, fill_value=-jnp.inf):
    """Scale, fill, softmax: ``softmax(where(mask, attn_scores / sqrt(d_key), fill_value))``.

    ``attn_scores`` ``(..., t, s)``; ``mask`` broadcastable to it, ``True`` = keep. The softmax
    runs in at least float32 and the result is cast back to the dtype of ``attn_scores``.
    """
    dtype = attn_scores.dtype
    attn_scores = attn_scores / d_key**0.5
    if mask is not None:
        mask = jnp.broadcast_to(mask, attn_scores.shape)  # explicit: rank promotion may raise
        fill_value = _representable(fill_value, dtype)
        attn_scores = jnp.where(mask, attn_scores, jnp.asarray(fill_value, attn_scores.dtype))
    compute_dtype = jnp.promote_types(dtype, jnp.float32)
    attn_weights = jax.nn.softmax(attn_scores.astype(compute_dtype), axis=-1)
    return attn_weights.astype(dtype)


def dot_product_attention(
    queries,
    keys,
    values,
    mask=None,
    *,
    fill_value=-jnp.inf,
    dropout: nnx.Dropout | None = None,
    precision=None,
):
    """Scaled dot-product attention, returning ``(context_vec, attn_weights)``.

    Args:
      queries: ``(..., t, h, d_k)``.
      keys: ``(..., s, h, d_k)``.
      values: ``(..., s, h, d_v)``.
      mask: broadcastable to the weights ``(..., h, t, s)``; ``True`` keeps a position, ``False``
        fills its score with ``fill_value``.
      fill_value: ``-inf`` (the causal family) or ``-1e10`` (document 001).
      dropout: an ``nnx.Dropout`` applied to the weights (its own ``deterministic`` flag, set by
        ``.eval()``/``.train()``, decides), or ``None``.
      precision: passed to both einsums.

    Returns:
      ``context_vec`` ``(..., t, h, d_v)`` and ``attn_weights`` ``(..., h, t, s)`` (after
      dropout, as the documents return them).
    """
    d_key = queries.shape[-1]
    attn_scores = jnp.einsum("...thd,...shd->...hts", queries, keys, precision=precision)
    attn_weights = masked_softmax(attn_scores, d_key, mask, fill_value)  # (..., h, t, s)
    if dropout is not None:
        attn_weights = dropout(attn_weights)
    context_vec = jnp.einsum(
        "...hts,...shd->...thd", attn_weights, values, precision=precision
    )  # (..., t, h, d_v)
    return context_vec, attn_weights
