"""``xla`` and ``cudnn``: ``jax.nn.dot_product_attention`` behind the core's conventions.

The adapter flattens the leading axes into one batch axis ``B`` and turns an ``AttentionMask``
into what ``jax.nn`` takes:

- causality alone (no caller's mask, query 0 at key 0, as many queries as keys): ``is_causal=True``
  and the window as ``local_window_size=(W - 1, 0)``, no mask array; XLA builds the same mask
  (``-0.7 * max`` where hidden) and cuDNN skips the hidden tiles (``implicit_causal``);
- no causality: the caller's mask is ``jax.nn``'s ``mask`` (which fills a large finite
  negative, so a fully masked row is uniform, as with ``-1e10``);
- causality with the caller's mask, or at an offset (the decode cache's): the causal mask (with
  its window, if any) is ``jax.nn``'s ``mask`` and the caller's mask becomes a ``bias`` of
  ``fill_value``, so a causally hidden key stays hidden in a fully masked row.

Grouped heads (fewer key than query heads) go in as they are: ``jax.nn`` takes them.

What cuDNN's fused attention takes (``cudnn_can_run``, what ``implementation=None`` checks
before it picks ``cudnn`` on a GPU), from jax's own checks (``jax.nn.dot_product_attention``
and ``jax._src.cudnn.fused_attention_stablehlo``: ``check_layout``, ``check_is_flash_attention``):
queries, keys and values of one dtype, float16 or bfloat16; one head size for all three (``jax.nn``
wants values shaped as keys), a multiple of 8, at most 128 (256 from compute capability 9.0,
Hopper); keys and values with as many heads as each other, dividing the queries' (grouped heads).
A mask array reaches cuDNN as a bias of its own large negative (``-2**41`` in bfloat16), not
``fill_value``: ``cudnn_can_run`` takes causality and windows only as ``is_causal`` and
``local_window_size``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_attention.masking import AttentionMask, flatten_mask

__all__ = ["cudnn_can_run", "implicit_causal", "jax_nn_attention"]

#: The largest head size cuDNN's fused attention takes, a multiple of 8 (jax's
#: ``check_is_flash_attention``): before compute capability 9.0 (Hopper), and from it.
CUDNN_MAX_HEAD_DIM, CUDNN_MAX_HEAD_DIM_HOPPER = 128, 256


def implicit_causal(attention_mask: AttentionMask, num_queries: int, num_keys: int) -> bool:
    """Whether ``jax.nn`` can be told ``is_causal=True`` (with the window as
    ``local_window_size``) instead of a materialised mask: causality and nothing else (no
    caller's mask), query 0 at key 0 (``query_offset`` the int 0, not traced), and as many
    queries as keys, where every alignment of the causal diagonal agrees."""
    offset = attention_mask.query_offset
    return (
        attention_mask.is_causal
        and attention_mask.keep is None
        and isinstance(offset, int)
        and offset == 0
        and num_queries == num_keys
    )


def _compute_capability() -> tuple[int, ...] | None:
    """The first device's CUDA compute capability, ``None`` where it does not say (not CUDA)."""
    capability = getattr(jax.local_devices()[0], "compute_capability", None)
    if not isinstance(capability, str):
        return None
    return tuple(int(part) for part in capability.split("."))


def cudnn_can_run(queries, keys, values, attention_mask: AttentionMask) -> bool:
    """Whether ``jax_nn_attention(..., implementation="cudnn")`` runs these inputs as the other
    implementations would (the module docstring's constraints): ``(..., t, h, d)`` queries,
    ``(..., s, h_kv, d)`` keys and values. A device that does not report a compute capability is
    taken for one before Hopper (heads of at most 128 features); one before 8.0 (Ampere) has no
    fused attention in cuDNN."""
    dtype = queries.dtype
    if dtype not in (jnp.bfloat16, jnp.float16) or keys.dtype != dtype or values.dtype != dtype:
        return False
    capability = _compute_capability()
    if capability is not None and capability < (8, 0):
        return False
    head_dim = queries.shape[-1]
    hopper = capability is not None and capability >= (9, 0)
    max_head_dim = CUDNN_MAX_HEAD_DIM_HOPPER if hopper else CUDNN_MAX_HEAD_DIM
    if keys.shape[-1] != head_dim or values.shape[-1] != head_dim:
        return False
    if head_dim % 8 or head_dim > max_head_dim:
        return False
    if attention_mask.keep is not None:
        return False
    return not attention_mask.is_causal or implicit_causal(
        attention_mask, queries.shape[-3], keys.shape[-3]
    )


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
    if implicit_causal(attention_mask, t, s):  # no mask array: XLA builds it, cuDNN skips tiles
        window = attention_mask.window
        context_vec = jax.nn.dot_product_attention(
            *flat,
            is_causal=True,
            local_window_size=None if window is None else (window - 1, 0),  # q - j <= W - 1
            implementation=implementation,
        )
        return context_vec.reshape(*lead, *context_vec.shape[1:])  # (..., t, h, d)
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
