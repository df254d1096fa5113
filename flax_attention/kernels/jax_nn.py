"""``xla`` and ``cudnn``: ``jax.nn.dot_product_attention`` behind the core's conventions.

The adapter flattens the leading axes into one batch axis ``B`` and turns an ``AttentionMask``
into what ``jax.nn`` takes: without causality the caller's mask is ``jax.nn``'s ``mask`` (which
fills a large finite negative, so a fully masked row is uniform, as with ``-1e10``); with
causality the causal mask (with its window, if any) is ``jax.nn``'s ``mask`` and the caller's
mask becomes a ``bias`` of ``fill_value``, so a causally hidden key stays hidden in a fully
masked row. Grouped heads (fewer key than query heads) go in as they are: ``jax.nn`` takes them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_attention.masking import AttentionMask, flatten_mask

__all__ = ["jax_nn_attention"]


def jax_nn_attention(queries, keys, values, attention_mask: AttentionMask, *, implementation):
    """``(..., t, h, d), (..., s, h, d), (..., s, h, d)`` -> ``(..., t, h, d)`` through
    ``jax.nn.dot_product_attention(implementation=implementation)`` (``"xla"`` or ``"cudnn"``)."""
    if implementation == "cudnn" and jax.default_backend() != "gpu":
        raise ValueError(
            f"implementation ('cudnn') must run on an NVIDIA GPU (the default backend is "
            f"{jax.default_backend()!r}; use 'xla' or 'blocked' here)"
        )
    if values.shape[-1] != queries.shape[-1]:
        raise ValueError(
            f"values.shape[-1] ({values.shape[-1]}) must equal queries.shape[-1] "
            f"({queries.shape[-1]}) for implementation {implementation!r} (use 'blocked')"
        )
    lead, h = queries.shape[:-3], queries.shape[-2]
    t, s = queries.shape[-3], keys.shape[-3]
    flat = [x.reshape(-1, *x.shape[-3:]) for x in (queries, keys, values)]  # (B, t|s, h, d)
    mask, bias = attention_mask.keep, None
    if attention_mask.is_causal:
        if mask is not None:  # the caller's mask as a fill_value bias, causality as the mask
            bias = jnp.where(mask, 0.0, attention_mask.fill_value).astype(queries.dtype)
            bias = flatten_mask(bias, lead, h, t, s)
        mask = attention_mask.visible(jnp.arange(t)[:, None], jnp.arange(s)[None, :])  # (t, s)
    if mask is not None:
        mask = flatten_mask(mask, lead, h, t, s)  # (B|1, h|1, t|1, s|1)
    context_vec = jax.nn.dot_product_attention(
        *flat, bias=bias, mask=mask, implementation=implementation
    )
    return context_vec.reshape(*lead, *context_vec.shape[1:])  # (..., t, h, d)
