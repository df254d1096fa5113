"""Which scores attention fills, and with what: one description for every implementation.

``dot_product_attention`` turns its ``is_causal``, ``query_offset``, ``mask`` and ``fill_value``
into one ``AttentionMask``; every kernel (``reference`` in ``flax_attention.core``, ``blocked``,
``native`` and the ``jax.nn`` adapter in ``flax_attention.kernels``) reads that and nothing
else. The rule, written once in ``AttentionMask.apply``:

1. where the caller's mask is ``False``, the (scaled) score becomes ``fill_value``, clipped to
   the dtype's finite range (the annotated-transformer post's ``-1e10`` is ``-65504`` in float16);
2. where causality hides a key (key ``j`` after query ``q = query_offset + i``, or, with a
   ``window`` ``W``, a key ``W`` or more positions before it: ``q - j >= W``), the score becomes
   ``-inf``, after step 1: a causally hidden key stays ``-inf`` even in a row that the caller
   masks entirely, so such a row attends to its visible keys uniformly and never to the future.
   Visible is ``j <= q`` and ``q - j < W``: the sliding window of the book's later models
   (``W`` keys, the query's own included).

Shape legend as in ``flax_attention.core``: ``t`` query tokens, ``s`` key tokens, ``h`` heads.
Of the package, this module imports only its argument checks (``flax_attention._checks``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from flax_attention._checks import check_bool, check_int, check_positive_int

__all__ = ["AttentionMask", "causal_mask", "check_window", "flatten_mask", "representable"]


def check_window(window, is_causal: bool = True) -> None:
    """``window`` ``None`` or a positive int, and only with ``is_causal`` (the window slides
    back from each query's own position)."""
    if window is None:
        return
    check_positive_int("window", window)
    if not is_causal:
        raise ValueError(f"window ({window}) needs is_causal=True (it slides back from the query)")


def causal_mask(num_queries: int, num_keys: int, offset=0) -> jax.Array:
    """Boolean ``(t, s)`` mask, ``True`` where query ``i`` may attend to key ``j``.

    Query ``i`` sits at absolute position ``offset + i`` and sees keys ``j <= offset + i``: with
    ``offset = 0`` and ``t = s`` this is ``~triu(ones(t, t), diagonal=1)``, the documents'
    ``mask`` buffer sliced to ``[:num_tokens, :num_tokens]``. ``offset`` may be traced (decode).
    """
    check_int("num_queries", num_queries, 0)
    check_int("num_keys", num_keys, 0)
    rows = jnp.arange(num_queries)[:, None] + offset  # (t, 1)
    cols = jnp.arange(num_keys)[None, :]  # (1, s)
    return cols <= rows  # (t, s)


def representable(fill_value, dtype):
    """A finite fill (the annotated-transformer post's ``-1e10``) clipped to ``dtype``'s range,
    so float16 keeps a finite fill (``-65504``) instead of overflowing to ``-inf`` (which would
    turn a fully masked row into NaN). Float32, bfloat16 and ``-inf`` are unchanged."""
    if math.isfinite(fill_value) and jnp.issubdtype(dtype, jnp.floating):
        return max(float(fill_value), float(jnp.finfo(dtype).min))
    return fill_value


def flatten_mask(mask, lead, h, t, s):
    """A mask (or bias) broadcastable to ``(..., h, t, s)`` as ``(B|1, h|1, t|1, s|1)``, the
    leading axes ``lead`` flattened into one, as the kernels take their inputs."""
    mask = mask.reshape((1,) * (len(lead) + 3 - mask.ndim) + mask.shape)
    if any(m != 1 for m in mask.shape[:-3]):
        mask = jnp.broadcast_to(mask, (*lead, *mask.shape[-3:]))
    return mask.reshape(-1, *mask.shape[-3:])


@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """What attention hides, for one call.

    Attributes:
      keep: the caller's mask, bool, broadcastable to the weights ``(..., h, t, s)``; ``True``
        keeps a score, ``False`` fills it with ``fill_value``. ``None``: no caller's mask.
      fill_value: the fill for ``keep == False``, already representable in the scores' dtype
        (``-inf`` for the causal family, ``-1e10`` for the annotated-transformer post).
      is_causal: query ``i`` sees keys ``j <= query_offset + i`` only; the others get ``-inf``.
      query_offset: absolute position of query 0 (the decode cache's index; may be traced).
      window: ``None``, or with ``is_causal`` the sliding window ``W``: query ``q`` sees keys
        ``q - W < j <= q`` only (``W`` keys, its own included).
    """

    keep: jax.Array | None = None
    fill_value: float = -math.inf
    is_causal: bool = False
    query_offset: int | jax.Array = 0
    window: int | None = None

    def __post_init__(self):
        check_bool("is_causal", self.is_causal)
        if self.window is not None:
            check_window(self.window, self.is_causal)

    @classmethod
    def build(
        cls,
        mask=None,
        *,
        is_causal=False,
        query_offset=0,
        fill_value=-math.inf,
        window=None,
        dtype,
    ) -> AttentionMask:
        """The one step from ``dot_product_attention``'s arguments to the description: the mask
        as bool, the fill clipped to ``dtype`` (the scores' dtype)."""
        keep = None if mask is None else jnp.asarray(mask, bool)
        return cls(keep, representable(fill_value, dtype), bool(is_causal), query_offset, window)

    def replace(self, **changes) -> AttentionMask:
        """A copy with ``changes`` (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def visible(self, query_pos, key_pos) -> jax.Array:
        """Causality (and the window) on absolute positions: key ``key_pos`` is visible from
        query ``query_pos`` (counted from this call's first query). ``causal_mask`` is the same
        on whole ranges, without a window."""
        query_pos = self.query_offset + query_pos
        visible = key_pos <= query_pos
        if self.window is not None:
            visible = visible & (query_pos - key_pos < self.window)
        return visible

    def apply(self, scores, keep=None, visible=None) -> jax.Array:
        """The rule (module docstring) on ``scores`` (scaled; the whole ``(..., h, t, s)`` or one
        tile): ``keep`` (this block of the caller's mask, or ``None``) fills ``fill_value``,
        then ``visible`` (this block's causal visibility, and for a kernel with padded blocks
        the padding, or ``None``) fills ``-inf``."""
        if keep is not None:  # explicit broadcasts: rank promotion may raise
            keep = jnp.broadcast_to(keep, scores.shape)
            scores = jnp.where(keep, scores, jnp.asarray(self.fill_value, scores.dtype))
        if visible is not None:
            visible = jnp.broadcast_to(visible, scores.shape)
            scores = jnp.where(visible, scores, jnp.asarray(-jnp.inf, scores.dtype))
        return scores
