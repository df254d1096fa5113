"""The attention core: every layer of ``flax_attention`` computes attention here and nowhere else.

Shape legend (the same letters in every einsum of the package):

- ``b`` batch (any number of leading axes, written ``...``; the blocked kernel flattens them)
- ``t`` query tokens, ``s`` key/value tokens
- ``h`` heads, ``d`` features per head (``d_k`` for queries/keys, ``d_v`` for values)

Layout is ``(..., t, h, d)`` for queries and ``(..., s, h, d)`` for keys and values, the layout
of ``jax.nn.dot_product_attention``; attention weights are ``(..., h, t, s)``. Single-head layers
pass ``h = 1``.

The steps are the documents': scores ``q . k``, divided by ``sqrt(d_k)``, masked positions filled
(``-inf`` for the causal family, ``-1e10`` for document 001), softmax in at least float32 and cast
back, dropout on the weights, weighted sum of the values.

Implementations (``implementation=``), all the same function of their inputs:

============  =====================================================================  ========
name          how                                                                    weights
============  =====================================================================  ========
reference     the documents' math: the ``(..., h, t, s)`` scores are materialised     yes
xla           ``jax.nn.dot_product_attention(implementation="xla")``                  no
cudnn         ``jax.nn.dot_product_attention(implementation="cudnn")``, GPU only      no
blocked       flash-style tiles with an online softmax, in JAX; tiles that the        no
              causal mask removes entirely are skipped; memory ``O(t * block)``,
              gradients too (a custom VJP that recomputes the tiles)
None          the fastest of these for the backend and shape (``select_implementation``)
============  =====================================================================  ========

Only ``reference`` returns the weights and applies dropout to them; asking another
implementation for either is a ``ValueError`` (``None`` picks ``reference`` then).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = [
    "IMPLEMENTATIONS",
    "causal_mask",
    "masked_softmax",
    "dot_product_attention",
    "select_implementation",
]

#: The ``implementation`` names every causal layer and ``MultiHeadedAttention`` accept.
IMPLEMENTATIONS = (None, "reference", "xla", "cudnn", "blocked")

#: Tile edge of the ``blocked`` kernel (queries and keys); ``None`` picks it per call from
#: ``TILE_BYTES``. Tests set it small to cross many tiles on small inputs.
BLOCK_SIZE = None

#: One tile of float32 scores spans every batch row and head (``B * h * edge**2 * 4`` bytes).
#: ``None`` takes the largest edge in ``TILE_EDGES`` whose tile fits this budget: on a 2-core CPU
#: 64 at b8 x 12 heads (533 -> 455 ms at t1024 over 128) and 256 at b1 (670 -> 585 ms at t4096).
TILE_BYTES = 4 * 2**20
TILE_EDGES = (256, 128, 64)

#: From this many score entries per head (``t * s``) ``None`` runs ``blocked`` on the CPU; below,
#: ``reference`` is as fast and rounds exactly as torch does (measured in ``benchmarks``).
BLOCKED_MIN_SCORES = 64 * 64


def causal_mask(num_queries: int, num_keys: int, offset=0) -> jax.Array:
    """Boolean ``(t, s)`` mask, ``True`` where query ``i`` may attend to key ``j``.

    Query ``i`` sits at absolute position ``offset + i`` and sees keys ``j <= offset + i``: with
    ``offset = 0`` and ``t = s`` this is ``~triu(ones(t, t), diagonal=1)``, the documents'
    ``mask`` buffer sliced to ``[:num_tokens, :num_tokens]``. ``offset`` may be traced (decode).
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


def check_implementation(implementation) -> None:
    """``implementation`` must be one of ``IMPLEMENTATIONS`` (layers check it at construction)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation ({implementation!r}) must be one of {IMPLEMENTATIONS}")


def _dropout_active(dropout) -> bool:
    if dropout is None:
        return False
    if isinstance(dropout, nnx.Dropout):
        return dropout.rate > 0 and not dropout.deterministic
    return True  # any other callable (the conformance harness injects fixed masks)


def select_implementation(queries, keys, *, need_weights=False, dropout=None) -> str:
    """What ``implementation=None`` runs: the fastest that does what the call needs.

    - weights asked for, or dropout active: ``reference`` (the only one that has both);
    - GPU and TPU: ``xla`` (XLA's fused attention; ``cudnn`` is opt-in, it takes half
      precision only and is not yet measured here);
    - CPU: ``blocked`` from ``BLOCKED_MIN_SCORES`` score entries per head (it skips the causal
      half and never materialises the scores), ``reference`` below.
    """
    if need_weights or _dropout_active(dropout):
        return "reference"
    if jax.default_backend() != "cpu":
        return "xla"
    if queries.shape[-3] * keys.shape[-3] >= BLOCKED_MIN_SCORES:
        return "blocked"
    return "reference"


def dot_product_attention(
    queries,
    keys,
    values,
    mask=None,
    *,
    is_causal: bool = False,
    query_offset=0,
    fill_value=-jnp.inf,
    dropout=None,
    precision=None,
    implementation: str | None = "reference",
    need_weights: bool = True,
):
    """Scaled dot-product attention, returning ``(context_vec, attn_weights)``.

    Args:
      queries: ``(..., t, h, d_k)``.
      keys: ``(..., s, h, d_k)``.
      values: ``(..., s, h, d_v)``.
      mask: broadcastable to the weights ``(..., h, t, s)``; ``True`` keeps a position, ``False``
        fills its score with ``fill_value``.
      is_causal: query ``i`` sees keys ``j <= query_offset + i`` only; the others get ``-inf``.
      query_offset: absolute position of query 0 (the decode cache's index; may be traced).
      fill_value: ``-inf`` (the causal family) or ``-1e10`` (document 001) for ``mask``.
      dropout: an ``nnx.Dropout`` applied to the weights (its own ``deterministic`` flag, set by
        ``.eval()``/``.train()``, decides), or ``None``.
      precision: passed to every matmul.
      implementation: one of ``IMPLEMENTATIONS`` (module docstring).
      need_weights: return the weights (``reference`` only); ``False`` lets ``None`` choose a
        faster implementation, and the second result is then ``None``.

    Returns:
      ``context_vec`` ``(..., t, h, d_v)`` and ``attn_weights`` ``(..., h, t, s)`` (after
      dropout, as the documents return them) or ``None``.
    """
    check_implementation(implementation)
    if implementation is None:
        implementation = select_implementation(
            queries, keys, need_weights=need_weights, dropout=dropout
        )
    if implementation != "reference":
        if need_weights:
            raise ValueError(
                f"implementation ({implementation!r}) must be 'reference' (or None) to return "
                "attention weights (need_weights=False for the others)"
            )
        if _dropout_active(dropout):
            raise ValueError(
                f"implementation ({implementation!r}) must be 'reference' (or None) while "
                "dropout is active (call .eval(), or use implementation=None)"
            )
    if implementation == "reference":
        return _reference(
            queries, keys, values, mask, is_causal, query_offset, fill_value, dropout, precision
        )
    if implementation == "blocked":
        context_vec = blocked_attention(
            queries,
            keys,
            values,
            mask,
            is_causal=is_causal,
            query_offset=query_offset,
            fill_value=fill_value,
            precision=precision,
        )
        return context_vec, None
    return _jax_nn(
        queries, keys, values, mask, is_causal, query_offset, fill_value, implementation
    ), None


def _reference(queries, keys, values, mask, is_causal, query_offset, fill_value, dropout, prec):
    """The documents' math, weights materialised."""
    d_key = queries.shape[-1]
    attn_scores = jnp.einsum("...thd,...shd->...hts", queries, keys, precision=prec)
    if is_causal:
        causal = causal_mask(queries.shape[-3], keys.shape[-3], query_offset)  # (t, s)
        if mask is None:
            mask, fill_value = causal, -jnp.inf
        else:  # -inf where causality hides a key (kept through the fill), fill_value elsewhere
            causal = jnp.broadcast_to(causal, attn_scores.shape)  # (..., h, t, s)
            attn_scores = jnp.where(causal, attn_scores, -jnp.inf)
            mask = jnp.logical_or(jnp.broadcast_to(mask, causal.shape), jnp.logical_not(causal))
    attn_weights = masked_softmax(attn_scores, d_key, mask, fill_value)  # (..., h, t, s)
    if dropout is not None:
        attn_weights = dropout(attn_weights)
    context_vec = jnp.einsum(
        "...hts,...shd->...thd", attn_weights, values, precision=prec
    )  # (..., t, h, d_v)
    return context_vec, attn_weights


def _jax_nn(queries, keys, values, mask, is_causal, query_offset, fill_value, implementation):
    """``jax.nn.dot_product_attention`` on ``(B, t, h, d)`` (leading axes flattened to one)."""
    if implementation == "cudnn" and jax.default_backend() != "gpu":
        raise ValueError(
            f"implementation ('cudnn') must run on an NVIDIA GPU (the default backend is "
            f"{jax.default_backend()!r}; use 'xla' or 'blocked' here)"
        )
    # jax.nn fills with a large finite negative: a fully masked row is uniform, as with -1e10.
    if values.shape[-1] != queries.shape[-1]:
        raise ValueError(
            f"values.shape[-1] ({values.shape[-1]}) must equal queries.shape[-1] "
            f"({queries.shape[-1]}) for implementation {implementation!r} (use 'blocked')"
        )
    lead = queries.shape[:-3]
    t, s = queries.shape[-3], keys.shape[-3]
    flat = [x.reshape(-1, *x.shape[-3:]) for x in (queries, keys, values)]  # (B, t|s, h, d)
    bias = None
    if is_causal:
        causal = causal_mask(t, s, query_offset)  # (t, s)
        if mask is not None:  # the caller's mask as a fill_value bias, causality as the mask
            fill = _representable(fill_value, queries.dtype)
            bias = jnp.where(jnp.asarray(mask, bool), 0.0, fill).astype(queries.dtype)
            bias = _flatten_mask(bias, lead, queries.shape[-2], t, s)
        mask = causal
    if mask is not None:
        mask = _flatten_mask(jnp.asarray(mask, bool), lead, queries.shape[-2], t, s)
    context_vec = jax.nn.dot_product_attention(
        *flat, bias=bias, mask=mask, implementation=implementation
    )
    return context_vec.reshape(*lead, *context_vec.shape[1:])  # (..., t, h, d_v)


def _flatten_mask(mask, lead, h, t, s):
    """A mask (or bias) broadcastable to ``(..., h, t, s)`` as ``(B|1, h|1, t|1, s|1)``."""
    mask = mask.reshape((1,) * (len(lead) + 3 - mask.ndim) + mask.shape)
    if any(m != 1 for m in mask.shape[:-3]):
        mask = jnp.broadcast_to(mask, (*lead, *mask.shape[-3:]))
    return mask.reshape(-1, *mask.shape[-3:])


# ---- blocked: flash-style tiles, online softmax, custom VJP -------------------------------------
#
# Layout inside the kernel: (B, h, t, d) with the leading axes flattened into B; the query axis
# padded to a multiple of the block ``bq``, the key axis to a multiple of ``bk``. Query block
# ``i`` visits key blocks ``0 .. last_key_block(i)`` only (all of them without ``is_causal``).


def blocked_attention(
    queries,
    keys,
    values,
    mask=None,
    *,
    is_causal=False,
    query_offset=0,
    fill_value=-jnp.inf,
    precision=None,
    block_size=None,
):
    """Flash-style attention: ``(..., t, h, d_k), (..., s, h, d_k), (..., s, h, d_v)`` ->
    ``(..., t, h, d_v)``, equal to ``reference`` without its ``(t, s)`` scores in memory."""
    lead, (t, h, _), s = queries.shape[:-3], queries.shape[-3:], keys.shape[-3]
    block = block_size or BLOCK_SIZE or _tile_edge(math.prod(lead) * h)
    dtype = queries.dtype
    bq, bk = min(block, t), min(block, s)
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk

    def to_kernel(x, length, padded):  # (..., n, h, d) -> (B, h, n_padded, d)
        x = jnp.swapaxes(x.reshape(-1, *x.shape[-3:]), 1, 2)
        return jnp.pad(x, ((0, 0), (0, 0), (0, padded - length), (0, 0)))

    q, k, v = to_kernel(queries, t, tp), to_kernel(keys, s, sp), to_kernel(values, s, sp)
    if mask is not None:
        mask = _flatten_mask(jnp.asarray(mask, bool), lead, h, t, s)  # (B|1, h|1, t|1, s|1)
        pads = [(0, 0), (0, 0), (0, tp - t if mask.shape[2] > 1 else 0)]
        mask = jnp.pad(mask, [*pads, (0, sp - s if mask.shape[3] > 1 else 0)])
    config = _BlockConfig(
        bq, bk, t, s, bool(is_causal), _representable(fill_value, dtype), precision
    )
    offset = jnp.asarray(query_offset, jnp.int32)
    out = _blocked(config, q, k, v, mask, offset)  # (B, h, tp, d_v)
    out = jnp.swapaxes(out[:, :, :t], 1, 2).astype(dtype)  # (B, t, h, d_v)
    return out.reshape(*lead, *out.shape[1:])


def _tile_edge(batch_heads: int) -> int:
    """The largest of ``TILE_EDGES`` whose float32 score tile fits ``TILE_BYTES``."""
    for edge in TILE_EDGES:
        if batch_heads * edge * edge * 4 <= TILE_BYTES:
            return edge
    return TILE_EDGES[-1]


class _BlockConfig(tuple):
    """Static settings of one blocked call (hashable, for ``nondiff_argnums``)."""

    def __new__(cls, bq, bk, t, s, is_causal, fill_value, precision):
        return super().__new__(cls, (bq, bk, t, s, is_causal, fill_value, precision))

    bq = property(lambda self: self[0])
    bk = property(lambda self: self[1])
    t = property(lambda self: self[2])
    s = property(lambda self: self[3])
    is_causal = property(lambda self: self[4])
    fill_value = property(lambda self: self[5])
    precision = property(lambda self: self[6])


def _tile_scores(config, q_i, k_j, mask, offset, i, j):
    """Scaled, masked float32 scores of query block ``i`` against key block ``j``, and the
    caller's keep-mask tile (``None`` without a mask)."""
    scores = jnp.einsum(
        "bhtd,bhsd->bhts",
        q_i,
        k_j,
        precision=config.precision,
        preferred_element_type=jnp.float32,
    ) / jnp.float32(q_i.shape[-1] ** 0.5)  # (B, h, bq, bk)
    if mask is not None:
        rows = (
            jax.lax.dynamic_slice_in_dim(mask, i * config.bq, config.bq, 2)
            if mask.shape[2] > 1
            else mask
        )
        tile = (
            jax.lax.dynamic_slice_in_dim(rows, j * config.bk, config.bk, 3)
            if mask.shape[3] > 1
            else rows
        )
        scores = jnp.where(tile, scores, jnp.float32(config.fill_value))
    else:
        tile = None
    key_pos = j * config.bk + jnp.arange(config.bk)[None, :]  # (1, bk)
    valid = key_pos < config.s  # padding keys never count
    if config.is_causal:
        query_pos = offset + i * config.bq + jnp.arange(config.bq)[:, None]  # (bq, 1)
        valid = valid & (key_pos <= query_pos)
    return jnp.where(valid, scores, -jnp.inf), tile


def _key_blocks(config, offset, i):
    """How many key blocks query block ``i`` needs (the causal mask removes the rest)."""
    nk = -(-config.s // config.bk)
    if not config.is_causal:
        return nk
    last_query = offset + (i + 1) * config.bq - 1
    return jnp.clip(last_query // config.bk + 1, 1, nk)


def _first_query_block(config, offset, j):
    """The first query block that sees any key of block ``j``."""
    if not config.is_causal:
        return 0
    return jnp.clip((j * config.bk - offset) // config.bq, 0, None)


def _blocked_forward(config, q, k, v, mask, offset):
    """``(out, m, denom)``: ``(B, h, tp, d_v)`` float32, the rows' running max and softmax
    denominator ``(B, h, tp)``, kept apart: ``m + log(denom)`` loses ``log(denom)`` when ``m``
    is ``-1e10``."""
    batch, heads, tp, _ = q.shape
    d_v = v.shape[-1]

    def query_block(i):
        q_i = jax.lax.dynamic_slice_in_dim(q, i * config.bq, config.bq, 2)  # (B, h, bq, d)

        def key_block(j, carry):
            m, denom, acc = carry
            k_j = jax.lax.dynamic_slice_in_dim(k, j * config.bk, config.bk, 2)
            v_j = jax.lax.dynamic_slice_in_dim(v, j * config.bk, config.bk, 2)
            scores, _ = _tile_scores(config, q_i, k_j, mask, offset, i, j)  # (B, h, bq, bk)
            m_new = jnp.maximum(m, scores.max(-1))
            m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # rows with nothing seen yet
            p = jnp.exp(scores - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            denom = alpha * denom + p.sum(-1)
            pv = jnp.einsum(
                "bhts,bhsd->bhtd",
                p.astype(v.dtype),
                v_j,
                precision=config.precision,
                preferred_element_type=jnp.float32,
            )
            return m_new, denom, alpha[..., None] * acc + pv

        init = (
            jnp.full((batch, heads, config.bq), -jnp.inf, jnp.float32),
            jnp.zeros((batch, heads, config.bq), jnp.float32),
            jnp.zeros((batch, heads, config.bq, d_v), jnp.float32),
        )
        m, denom, acc = jax.lax.fori_loop(0, _key_blocks(config, offset, i), key_block, init)
        m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
        return acc / denom[..., None], m_safe, denom  # a fully masked -inf row: 0/0, as softmax

    out, m, denom = jax.lax.map(query_block, jnp.arange(tp // config.bq))  # (nq, B, h, bq, ...)
    out = jnp.moveaxis(out, 0, 2).reshape(batch, heads, tp, d_v)
    m, denom = (jnp.moveaxis(x, 0, 2).reshape(batch, heads, tp) for x in (m, denom))
    return out, m, denom


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blocked(config, q, k, v, mask, offset):
    return _blocked_forward(config, q, k, v, mask, offset)[0]


def _blocked_fwd(config, q, k, v, mask, offset):
    out, m, denom = _blocked_forward(config, q, k, v, mask, offset)
    return out, (q, k, v, mask, offset, out, m, denom)


def _blocked_bwd(config, residuals, d_out):
    """Flash-attention backward: per key block, recompute its tiles, accumulate dK, dV (carried)
    and dQ (one ``(B, h, tp, d)`` buffer updated in place); memory ``O(t * block)``."""
    q, k, v, mask, offset, out, m, denom = residuals
    d_out = d_out.astype(jnp.float32)
    delta = (d_out * out).sum(-1)  # (B, h, tp): rowsum(dO * O)
    scale = jnp.float32(q.shape[-1] ** -0.5)
    nq = q.shape[2] // config.bq

    def dot(spec, a, b):
        return jnp.einsum(
            spec, a, b, precision=config.precision, preferred_element_type=jnp.float32
        )

    def key_block(j, d_q):
        k_j = jax.lax.dynamic_slice_in_dim(k, j * config.bk, config.bk, 2)  # (B, h, bk, d)
        v_j = jax.lax.dynamic_slice_in_dim(v, j * config.bk, config.bk, 2)

        def query_block(i, carry):
            d_k, d_v, d_q = carry

            def rows(x):  # query block i of a (B, h, tp, ...) array
                return jax.lax.dynamic_slice_in_dim(x, i * config.bq, config.bq, 2)

            q_i, d_out_i, m_i, denom_i, delta_i = map(rows, (q, d_out, m, denom, delta))
            scores, keep = _tile_scores(config, q_i, k_j, mask, offset, i, j)  # (B, h, bq, bk)
            p = jnp.exp(scores - m_i[..., None]) / denom_i[..., None]  # the forward's weights
            d_v = d_v + dot("bhts,bhtd->bhsd", p, d_out_i)
            d_p = dot("bhtd,bhsd->bhts", d_out_i, v_j)
            d_s = p * (d_p - delta_i[..., None]) * scale  # d(raw scores)
            if keep is not None:  # a filled score is a constant: no gradient flows through it
                d_s = jnp.where(keep, d_s, 0.0)
            d_k = d_k + dot("bhts,bhtd->bhsd", d_s, q_i)
            d_q_i = rows(d_q) + dot("bhts,bhsd->bhtd", d_s, k_j)
            d_q = jax.lax.dynamic_update_slice_in_dim(d_q, d_q_i, i * config.bq, 2)
            return d_k, d_v, d_q

        init = (jnp.zeros(k_j.shape, jnp.float32), jnp.zeros(v_j.shape, jnp.float32), d_q)
        d_k, d_v, d_q = jax.lax.fori_loop(
            _first_query_block(config, offset, j), nq, query_block, init
        )
        return d_q, (d_k, d_v)

    d_q0 = jnp.zeros(q.shape, jnp.float32)
    d_q, (d_k, d_v) = jax.lax.scan(
        lambda d_q, j: key_block(j, d_q), d_q0, jnp.arange(k.shape[2] // config.bk)
    )
    d_k = jnp.moveaxis(d_k, 0, 2).reshape(k.shape)  # (nk, B, h, bk, d) -> (B, h, sp, d)
    d_v = jnp.moveaxis(d_v, 0, 2).reshape(v.shape)
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None, None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)
