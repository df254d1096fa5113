"""``blocked``: flash-style attention in JAX, tiles with an online softmax and a custom VJP.

Equal to ``reference`` (``flax_attention.core``) without its ``(t, s)`` scores in memory: query
block ``i`` visits key blocks ``0 .. last_key_block(i)`` only (all of them without causality),
so the tiles the causal mask removes entirely are skipped; memory ``O(t * block)``, gradients
too (the backward recomputes the tiles).

Dropout on the weights happens inside the tiles: each tile's keep-mask is regenerated, in the
forward and again in the backward, from the counter-based hash of (seed, batch, head, query,
key) of ``dropout_hash`` (global indices, so the native kernel with the same seed drops the same
weights, and ``reference`` given ``dropout_hash.keep_mask`` computes the same function); kept
weights are scaled by ``1 / (1 - rate)``.

Layout inside the kernel: keys and values ``(B, h_kv, n, d)`` with the leading axes flattened
into ``B``, queries ``(B, h_kv, g, n, d)``: the ``g = h // h_kv`` query heads of each key head
(grouped-query attention; ``g = 1`` otherwise) meet its keys in one product, nothing repeated,
and the backward sums their key and value gradients in that product too. The query axis is
padded to a multiple of ``block_q``, the key axis to a multiple of ``block_k``.

A sliding ``window`` (``AttentionMask.window``) skips the key tiles before it as causality skips
those after the diagonal: query block ``i`` visits key blocks ``_first_key_block(i) ..
_key_blocks(i)`` only, and in the backward key block ``j`` the query blocks up to
``_query_blocks(j)``. The tile
sizes are a ``BlockSizes`` argument; ``BlockSizes.automatic`` picks them from the shape.

Work per tile, kept small: the ``1 / sqrt(d_k)`` scale is folded into the queries once, before
the tiles (exact when ``d_k`` is a power of 4, e.g. 16, 64, 256; one rounding of ``q`` else);
the causal and padding ``where`` runs only on the tiles that need it, the tiles the diagonal
crosses and the last key tile when the key length does not divide the tile (the loops over key
blocks, and in the backward over query blocks, are split into a masked and an unmasked range).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from flax_attention._checks import check_positive_int
from flax_attention.kernels import dropout_hash
from flax_attention.masking import AttentionMask, flatten_mask

__all__ = ["TILE_BYTES", "TILE_EDGES", "BlockSizes", "blocked_attention"]

#: One tile of float32 scores spans every batch row and head (``B * h * edge**2 * 4`` bytes).
#: ``BlockSizes.automatic`` takes the largest edge in ``TILE_EDGES`` whose tile fits this budget
#: (64 at b8 x 12 heads, 256 at b1; measured in ``docs/performance.md``, "Choosing an
#: implementation").
TILE_BYTES = 4 * 2**20
TILE_EDGES = (256, 128, 64)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile edges of the ``blocked`` kernel: ``block_q`` queries by ``block_k`` keys.

    An edge larger than the sequence is cut to it. Pass one as ``block_sizes=`` to
    ``dot_product_attention`` or to a layer; ``None`` there means ``BlockSizes.automatic``.
    """

    block_q: int
    block_k: int

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            check_positive_int(name, getattr(self, name))

    @classmethod
    def square(cls, edge: int) -> BlockSizes:
        """``edge`` by ``edge`` tiles."""
        return cls(edge, edge)

    @classmethod
    def automatic(cls, batch_heads: int) -> BlockSizes:
        """The largest square tile of ``TILE_EDGES`` whose float32 scores for ``batch_heads``
        (batch rows times heads) fit ``TILE_BYTES``."""
        for edge in TILE_EDGES:
            if batch_heads * edge * edge * 4 <= TILE_BYTES:
                return cls.square(edge)
        return cls.square(TILE_EDGES[-1])


def blocked_attention(
    queries,
    keys,
    values,
    attention_mask: AttentionMask,
    *,
    precision=None,
    block_sizes: BlockSizes | None = None,
    dropout_rate: float = 0.0,
    dropout_seed=None,
    kv_heads_first: bool = False,
):
    """``(..., t, h, d_k), (..., s, h, d_k), (..., s, h, d_v)`` -> ``(..., t, h, d_v)``, with
    what ``attention_mask`` hides; equal to ``reference`` without its scores in memory.
    ``kv_heads_first``: keys and values come as ``(..., h, s, d)`` (the kernel's own order:
    not transposed).

    ``dropout_rate`` > 0 drops weights inside the tiles where ``dropout_hash.keep_mask(
    dropout_seed, (B, h, t, s), dropout_rate)`` is ``False`` (``B`` the flattened leading axes)
    and scales the others by ``1 / (1 - rate)``; ``dropout_seed`` (uint32, an int or a traced
    scalar) is then required.
    """
    drop_threshold = dropout_hash.threshold(dropout_rate)
    if drop_threshold and dropout_seed is None:
        raise ValueError(
            f"dropout_seed (None) must be given when dropout_rate ({dropout_rate}) > 0"
        )
    lead, (t, h, _) = queries.shape[:-3], queries.shape[-3:]
    s = keys.shape[-2] if kv_heads_first else keys.shape[-3]
    kv_heads = keys.shape[-3] if kv_heads_first else keys.shape[-2]
    if block_sizes is None:
        block_sizes = BlockSizes.automatic(math.prod(lead) * h)
    dtype = queries.dtype
    bq, bk = min(block_sizes.block_q, t), min(block_sizes.block_k, s)
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk

    def to_kernel(x, length, padded, heads_first=False):  # -> (B, h, n_padded, d)
        x = x.reshape(-1, *x.shape[-3:])  # (B, n, h, d), or (B, h, n, d) heads first
        if not heads_first:
            x = jnp.swapaxes(x, 1, 2)
        return jnp.pad(x, ((0, 0), (0, 0), (0, padded - length), (0, 0)))

    # The scale folded into the queries once (in float32, back to their dtype); its gradient is
    # JAX's, outside the custom VJP.
    scale = jnp.float32(queries.shape[-1] ** -0.5)
    scaled = (queries.astype(jnp.float32) * scale).astype(dtype)
    q = to_kernel(scaled, t, tp)  # (B, h, tp, d)
    q = q.reshape(q.shape[0], kv_heads, h // kv_heads, *q.shape[2:])  # (B, h_kv, g, tp, d)
    k, v = (to_kernel(x, s, sp, kv_heads_first) for x in (keys, values))  # (B, h_kv, sp, d)
    keep = attention_mask.keep
    if keep is not None:
        keep = flatten_mask(keep, lead, h, t, s)  # (B|1, h|1, t|1, s|1)
        pads = [(0, 0), (0, 0), (0, tp - t if keep.shape[2] > 1 else 0)]
        keep = jnp.pad(keep, [*pads, (0, sp - s if keep.shape[3] > 1 else 0)])
        groups = (kv_heads, h // kv_heads) if keep.shape[1] > 1 else (1, 1)
        keep = keep.reshape(keep.shape[0], *groups, *keep.shape[2:])  # (B|1, h_kv|1, g|1, ...)
    config = _Config(
        bq,
        bk,
        t,
        s,
        attention_mask.is_causal,
        attention_mask.fill_value,
        precision,
        drop_threshold,
        1.0 / (1.0 - dropout_rate),
        attention_mask.window,
    )
    offset = jnp.asarray(attention_mask.query_offset, jnp.int32)
    seed = jnp.asarray(0 if dropout_seed is None else dropout_seed, jnp.uint32)
    out = _blocked(config, q, k, v, keep, offset, seed)  # (B, h_kv, g, tp, d_v)
    out = out.reshape(out.shape[0], h, tp, out.shape[-1])  # (B, h, tp, d_v)
    out = jnp.swapaxes(out[:, :, :t], 1, 2).astype(dtype)  # (B, t, h, d_v)
    return out.reshape(*lead, *out.shape[1:])


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static settings of one blocked call (hashable, for ``nondiff_argnums``)."""

    bq: int
    bk: int
    t: int
    s: int
    is_causal: bool
    fill_value: float
    precision: object
    drop_threshold: int = 0  # dropout: keep a weight where its hash >= this (0: no dropout)
    drop_scale: float = 1.0  # 1 / (1 - rate)
    window: int | None = None  # the sliding window (AttentionMask.window)

    def mask(self, offset) -> AttentionMask:
        """The call's ``AttentionMask`` without the caller's mask (passed to the tiles apart)."""
        return AttentionMask(None, self.fill_value, self.is_causal, offset, self.window)


def _tile_scores(config, q_i, k_j, keep, offset, i, j, masked=True):
    """Masked float32 scores of query block ``i`` (already scaled) against key block ``j``, and
    the caller's keep-mask tile (``None`` without a mask). ``masked=False``: the tile needs no
    causal or padding mask (``_full_key_blocks``, ``_first_full_query_block``)."""
    scores = jnp.einsum(
        "bhgtd,bhsd->bhgts",
        q_i,
        k_j,
        precision=config.precision,
        preferred_element_type=jnp.float32,
    )  # (B, h_kv, g, bq, bk)
    tile = None
    if keep is not None:
        rows = (
            jax.lax.dynamic_slice_in_dim(keep, i * config.bq, config.bq, 3)
            if keep.shape[3] > 1
            else keep
        )
        tile = (
            jax.lax.dynamic_slice_in_dim(rows, j * config.bk, config.bk, 4)
            if keep.shape[4] > 1
            else rows
        )
    mask = config.mask(offset)
    if not masked:
        return mask.apply(scores, tile), tile
    key_pos = j * config.bk + jnp.arange(config.bk)[None, :]  # (1, bk)
    visible = key_pos < config.s  # padding keys never count
    if config.is_causal:
        query_pos = i * config.bq + jnp.arange(config.bq)[:, None]  # (bq, 1)
        visible = visible & mask.visible(query_pos, key_pos)  # (bq, bk)
    return mask.apply(scores, tile, visible), tile


def _row_hashes(config, seed, batch, kv_heads, groups, tp):
    """The dropout hash of every query row ``(B, h_kv, g, tp)``, numbered by query head
    ``h_kv * g`` (``None`` without dropout)."""
    if not config.drop_threshold:
        return None
    return dropout_hash.row_hash(seed, batch, kv_heads * groups, tp).reshape(
        batch, kv_heads, groups, tp
    )


def _dropout_tile(config, hashes, i, j):
    """The dropout factor of tile ``(i, j)``, ``(B, h_kv, g, bq, bk)`` float32: ``1 / (1 -
    rate)`` where the hash keeps the weight, else 0. ``hashes``: ``_row_hashes``."""
    rows_i = jax.lax.dynamic_slice_in_dim(hashes, i * config.bq, config.bq, 3)  # (B, h_kv, g, bq)
    keys = (j * config.bk + jnp.arange(config.bk)).astype(jnp.uint32)  # (bk,)
    kept = dropout_hash.key_bits(rows_i, keys) >= jnp.uint32(config.drop_threshold)
    return jnp.where(kept, jnp.float32(config.drop_scale), jnp.float32(0.0))


def _key_blocks(config, offset, i):
    """How many key blocks query block ``i`` needs (the causal mask removes the rest)."""
    nk = -(-config.s // config.bk)
    if not config.is_causal:
        return nk
    last_query = offset + (i + 1) * config.bq - 1
    return jnp.clip(last_query // config.bk + 1, 1, nk)


def _first_key_block(config, offset, i):
    """The first key block query block ``i`` needs: 0, or with a window the block of the first
    query's earliest key (the window removes the blocks before)."""
    if config.window is None:
        return 0
    nk = -(-config.s // config.bk)
    return jnp.clip((offset + i * config.bq - config.window + 1) // config.bk, 0, nk)


def _first_query_block(config, offset, j):
    """The first query block that sees any key of block ``j``."""
    if not config.is_causal:
        return 0
    return jnp.clip((j * config.bk - offset) // config.bq, 0, None)


def _query_blocks(config, offset, j):
    """How many query blocks, from 0, can see a key of block ``j``: all of them, or with a
    window those up to the last query whose window still holds the block's last key."""
    nq = -(-config.t // config.bq)
    if config.window is None:
        return nq
    last_query = (j + 1) * config.bk - 1 + config.window - 1 - offset
    return jnp.clip(last_query // config.bq + 1, 0, nq)


def _padded_keys(config) -> bool:
    """Whether the last key block holds padding (the key length does not divide the tile)."""
    return config.s % config.bk != 0


def _full_key_blocks(config, offset, i):
    """How many key blocks, from 0, query block ``i`` sees entirely: no causal or padding mask
    on them. The key blocks from there to ``_key_blocks`` need the mask."""
    nk = -(-config.s // config.bk)
    last = nk - 1 if _padded_keys(config) else nk
    if not config.is_causal:
        return last
    # Block j is entirely visible from the block's first query: (j + 1) * bk - 1 <= offset + i * bq.
    full = (offset + i * config.bq + 1) // config.bk
    return jnp.clip(full, 0, jnp.minimum(last, _key_blocks(config, offset, i)))


def _unmasked_key_blocks(config, offset, i):
    """Query block ``i``'s key blocks, ``(first, lo, hi, needed)``: it visits key blocks
    ``first .. needed``; those from ``lo`` to ``hi`` need no mask (every row of the block sees
    every key of them), the rest do."""
    first, needed = _first_key_block(config, offset, i), _key_blocks(config, offset, i)
    lo = first
    if config.window is not None:  # the block's last query sees the tile's first key
        lo = -(-(offset + (i + 1) * config.bq - config.window) // config.bk)
        lo = jnp.clip(lo, first, needed)
    hi = jnp.clip(_full_key_blocks(config, offset, i), lo, needed)
    return first, lo, hi, needed


def _unmasked_query_blocks(config, offset, j):
    """Key block ``j``'s query blocks, ``(first, lo, hi, end)``: it is seen by query blocks
    ``first .. end``; those from ``lo`` to ``hi`` need no mask, the rest do."""
    first, end = _first_query_block(config, offset, j), _query_blocks(config, offset, j)
    lo = jnp.clip(_first_full_query_block(config, offset, j), first, end)
    hi = end
    if config.window is not None:  # the block's last query still sees the tile's first key
        hi = jnp.clip((config.window + j * config.bk - offset) // config.bq, lo, end)
    return first, lo, hi, end


def _first_full_query_block(config, offset, j):
    """The first query block that sees every key of block ``j`` (no causal or padding mask from
    there on); the blocks from ``_first_query_block`` up to it need the mask."""
    nq, nk = -(-config.t // config.bq), -(-config.s // config.bk)
    full = first = _first_query_block(config, offset, j)
    if config.is_causal:  # the block's first query sees its last key: (j + 1) * bk - 1 <= ...
        full = jnp.clip(-(-((j + 1) * config.bk - 1 - offset) // config.bq), first, nq)
    if _padded_keys(config):  # the last key block holds padding: masked for every query block
        full = jnp.where(j == nk - 1, nq, full)
    return full


def _blocked_forward(config, q, k, v, keep, offset, seed):
    """``(out, m, denom)``: ``(B, h_kv, g, tp, d_v)`` float32, the rows' running max and softmax
    denominator ``(B, h_kv, g, tp)``, kept apart: ``m + log(denom)`` loses ``log(denom)`` when
    ``m`` is ``-1e10``."""
    batch, kv_heads, groups, tp, _ = q.shape
    d_v = v.shape[-1]
    hashes = _row_hashes(config, seed, batch, kv_heads, groups, tp)
    rows = (batch, kv_heads, groups, config.bq)

    def query_block(i):
        q_i = jax.lax.dynamic_slice_in_dim(q, i * config.bq, config.bq, 3)  # (B, h_kv, g, bq, d)

        def key_block(j, carry, masked):
            m, denom, acc = carry
            k_j = jax.lax.dynamic_slice_in_dim(k, j * config.bk, config.bk, 2)
            v_j = jax.lax.dynamic_slice_in_dim(v, j * config.bk, config.bk, 2)
            scores, _ = _tile_scores(config, q_i, k_j, keep, offset, i, j, masked)  # (B, h, bq, bk)
            m_new = jnp.maximum(m, scores.max(-1))
            m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # rows with nothing seen yet
            p = jnp.exp(scores - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            denom = alpha * denom + p.sum(-1)  # the softmax's, before dropout
            if hashes is not None:
                p = p * _dropout_tile(config, hashes, i, j)
            pv = jnp.einsum(
                "bhgts,bhsd->bhgtd",
                p.astype(v.dtype),
                v_j,
                precision=config.precision,
                preferred_element_type=jnp.float32,
            )
            return m_new, denom, alpha[..., None] * acc + pv

        init = (
            jnp.full(rows, -jnp.inf, jnp.float32),
            jnp.zeros(rows, jnp.float32),
            jnp.zeros((*rows, d_v), jnp.float32),
        )
        first, lo, hi, needed = _unmasked_key_blocks(config, offset, i)
        ranges = ((first, lo, True), (lo, hi, False), (hi, needed, True))
        carry = init
        for start, stop, masked in ranges[config.window is None :]:  # no window: lo = first
            carry = jax.lax.fori_loop(
                start, stop, functools.partial(key_block, masked=masked), carry
            )
        m, denom, acc = carry
        m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
        return acc / denom[..., None], m_safe, denom  # a fully masked -inf row: 0/0, as softmax

    out, m, denom = jax.lax.map(query_block, jnp.arange(tp // config.bq))  # (nq, *rows, ...)
    out = jnp.moveaxis(out, 0, 3).reshape(batch, kv_heads, groups, tp, d_v)
    m, denom = (jnp.moveaxis(x, 0, 3).reshape(batch, kv_heads, groups, tp) for x in (m, denom))
    # Padding rows past a window may see no key: output 0 and denominator 1, so the backward's
    # weights of those rows are 0, not 0 / 0 (their outputs are cut off; real rows keep
    # softmax's NaN).
    real = jnp.arange(tp) < config.t
    return jnp.where(real[:, None], out, 0.0), m, jnp.where(real, denom, 1.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blocked(config, q, k, v, keep, offset, seed):
    return _blocked_forward(config, q, k, v, keep, offset, seed)[0]


def _blocked_fwd(config, q, k, v, keep, offset, seed):
    out, m, denom = _blocked_forward(config, q, k, v, keep, offset, seed)
    return out, (q, k, v, keep, offset, seed, out, m, denom)


def _blocked_bwd(config, residuals, d_out):
    """Flash-attention backward: per key block, recompute its tiles, accumulate dK, dV (carried)
    and dQ (one ``(B, h, tp, d)`` buffer updated in place); memory ``O(t * block)``. With
    dropout factors ``D`` (the forward's): ``dV += (P * D)^T dO``, ``dP = (dO V^T) * D``."""
    q, k, v, keep, offset, seed, out, m, denom = residuals
    d_out = d_out.astype(jnp.float32)
    delta = (d_out * out).sum(-1)  # (B, h_kv, g, tp): rowsum(dO * O) = rowsum(P * dP)
    hashes = _row_hashes(config, seed, *q.shape[:4])

    def dot(spec, a, b):
        return jnp.einsum(
            spec, a, b, precision=config.precision, preferred_element_type=jnp.float32
        )

    def key_block(j, d_q):
        k_j = jax.lax.dynamic_slice_in_dim(k, j * config.bk, config.bk, 2)  # (B, h_kv, bk, d)
        v_j = jax.lax.dynamic_slice_in_dim(v, j * config.bk, config.bk, 2)

        def query_block(i, carry, masked):
            d_k, d_v, d_q = carry

            def rows(x):  # query block i of a (B, h_kv, g, tp, ...) array
                return jax.lax.dynamic_slice_in_dim(x, i * config.bq, config.bq, 3)

            q_i, d_out_i, m_i, denom_i, delta_i = map(rows, (q, d_out, m, denom, delta))
            scores, tile = _tile_scores(config, q_i, k_j, keep, offset, i, j, masked)
            p = jnp.exp(scores - m_i[..., None]) / denom_i[..., None]  # the forward's weights
            d_p = dot("bhgtd,bhsd->bhgts", d_out_i, v_j)
            if hashes is None:
                d_v = d_v + dot("bhgts,bhgtd->bhsd", p, d_out_i)  # summed over the group
            else:
                drop = _dropout_tile(config, hashes, i, j)
                d_v = d_v + dot("bhgts,bhgtd->bhsd", p * drop, d_out_i)
                d_p = d_p * drop
            d_s = p * (d_p - delta_i[..., None])  # d(scores of the scaled queries)
            if tile is not None:  # a filled score is a constant: no gradient flows through it
                d_s = jnp.where(tile, d_s, 0.0)
            d_k = d_k + dot("bhgts,bhgtd->bhsd", d_s, q_i)
            d_q_i = rows(d_q) + dot("bhgts,bhsd->bhgtd", d_s, k_j)
            d_q = jax.lax.dynamic_update_slice_in_dim(d_q, d_q_i, i * config.bq, 3)
            return d_k, d_v, d_q

        carry = (jnp.zeros(k_j.shape, jnp.float32), jnp.zeros(v_j.shape, jnp.float32), d_q)
        first, lo, hi, end = _unmasked_query_blocks(config, offset, j)
        ranges = ((first, lo, True), (lo, hi, False), (hi, end, True))
        for start, stop, masked in ranges[: 3 - (config.window is None)]:  # no window: hi = end
            carry = jax.lax.fori_loop(
                start, stop, functools.partial(query_block, masked=masked), carry
            )
        d_k, d_v, d_q = carry
        return d_q, (d_k, d_v)

    d_q0 = jnp.zeros(q.shape, jnp.float32)
    d_q, (d_k, d_v) = jax.lax.scan(
        lambda d_q, j: key_block(j, d_q), d_q0, jnp.arange(k.shape[2] // config.bk)
    )
    d_k = jnp.moveaxis(d_k, 0, 2).reshape(k.shape)  # (nk, B, h, bk, d) -> (B, h, sp, d)
    d_v = jnp.moveaxis(d_v, 0, 2).reshape(v.shape)
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None, None, None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)
