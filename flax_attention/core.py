"""The attention core: every layer of ``flax_attention`` computes attention here and nowhere else.

Shape legend (the same letters in every einsum of the package):

- ``b`` batch (any number of leading axes, written ``...``; the blocked kernel flattens them)
- ``t`` query tokens, ``s`` key/value tokens
- ``h`` heads, ``d`` features per head (``d_k`` for queries/keys, ``d_v`` for values)

Layout is ``(..., t, h, d)`` for queries and ``(..., s, h, d)`` for keys and values, the layout
of ``jax.nn.dot_product_attention``; attention weights are ``(..., h, t, s)``. Single-head layers
pass ``h = 1``. Keys and values may come heads first, ``(..., h, s, d)`` (``kv_layout="hsd"``),
the layout of the decode cache: ``reference`` and ``blocked`` read it as it is (XLA's CPU dot
wants the batch axes ``(b, h)`` leading: in the ``shd`` layout it copies the keys and values
into that order on every call), ``native`` and ``xla`` swap it back (one copy per call).

Grouped heads: keys and values may have fewer heads than the queries, ``h_kv`` dividing ``h``
(grouped-query attention; one key head is multi-query): query head ``i`` attends with key and
value head ``i // (h // h_kv)``. Every implementation reads the ``h_kv`` heads as they are,
forward and backward; none repeats them to ``h`` in memory.

The steps are the documents': scores ``q . k``, divided by ``sqrt(d_k)``, masked positions filled
(``-inf`` for the causal family, ``-1e10`` for the annotated-transformer post), softmax in at
least float32 and cast back, dropout on the weights, weighted sum of the values.

Implementations (``implementation=``), all the same function of their inputs:

============  =====================================================================  ========
name          how                                                                    weights
============  =====================================================================  ========
reference     the documents' math: the ``(..., h, t, s)`` scores are materialised     yes
              (``_reference`` below)
xla           ``jax.nn.dot_product_attention(implementation="xla")``                  no
              (``kernels/jax_nn.py``)
cudnn         ``jax.nn.dot_product_attention(implementation="cudnn")``, GPU only,     no
              float16/bfloat16, head size a multiple of 8 up to 128 (256 on Hopper);
              causality and windows passed as ``is_causal``/``local_window_size``
              (``kernels/jax_nn.py``, ``cudnn_can_run``)
blocked       flash-style tiles with an online softmax, in JAX; tiles that the        no
              causal mask removes entirely are skipped; memory ``O(t * block)``,
              gradients too (a custom VJP that recomputes the tiles); dropout
              inside the tiles; tile sizes from ``block_sizes``
              (``kernels/blocked.py``)
native        the same tiling as a C++ kernel called through ``jax.ffi``, CPU only,   no
              float32/bfloat16 (computed in float32), forward and backward FFI
              targets; dropout inside the tiles (``kernels/native/``)
None          the fastest of these for the backend and shape (``select_implementation``)
============  =====================================================================  ========

Only ``reference`` returns the weights. Dropout: ``reference`` applies the layer's
``nnx.Dropout`` to the weights; ``native`` and ``blocked`` regenerate a keep-mask per tile from a
counter-based hash of (seed, batch, head, query, key) (``kernels/dropout_hash.py``; the two drop
the same weights for the same seed), the seed drawn from the dropout's own RNG stream, so
training stays ``O(t)`` in memory. Asking another implementation for weights or active dropout
is a ``ValueError`` (``None`` picks one that can).

What is masked, and with what, is one ``AttentionMask`` (``flax_attention.masking``): the
layers build theirs (``is_causal``, the decode cache's ``query_offset``, their ``mask`` and its
fill) and call ``attend``, the one entry, with plain keywords; ``dot_product_attention`` builds
it from its keywords and calls ``attend`` too. Behind ``attend``: the checks of the options, the
choice (``select_implementation``) or the check that the named implementation can do the call,
the mesh (below), and the implementation itself, from one table, ``_KERNELS``: how each runs and
what it can do (read keys and values heads first, return weights, apply which dropout, run
these inputs here). A new implementation is an entry there and its name in ``Implementation``
(and in ``select_implementation`` where ``None`` should pick it).

Meshes: under ``jax.set_mesh`` with ``Explicit`` axes (sharding in types) the implementations run
inside ``jax.sharding.auto_axes`` and return their results laid out like the queries (heads, or
one head's features, over ``model``); with ``Auto`` axes or no mesh they run as they are.
"""

from __future__ import annotations

import functools
import typing
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from flax_attention._checks import check_choice, check_instance
from flax_attention._inputs import check_d_key
from flax_attention.kernels import native
from flax_attention.kernels.blocked import BlockSizes, blocked_attention
from flax_attention.kernels.jax_nn import cudnn_can_run, jax_nn_attention
from flax_attention.masking import AttentionMask, causal_mask
from flax_attention.mesh import attention_out_shardings, explicit_mesh

__all__ = [
    "IMPLEMENTATIONS",
    "AttentionMask",
    "BlockSizes",
    "Implementation",
    "KV_LAYOUTS",
    "KVLayout",
    "attend",
    "causal_mask",
    "masked_softmax",
    "dot_product_attention",
    "select_implementation",
]

#: The ``implementation`` names (``None`` picks one, ``select_implementation``).
Implementation = Literal["reference", "xla", "cudnn", "blocked", "native"]

#: The ``implementation`` values every causal layer and ``MultiHeadedAttention`` accept.
IMPLEMENTATIONS = (None, *typing.get_args(Implementation))

#: The layouts of keys and values: ``(..., s, h, d)`` (as the queries) or heads first.
KVLayout = Literal["shd", "hsd"]
KV_LAYOUTS = typing.get_args(KVLayout)

#: From this many score entries per head (``t * s``) ``None`` runs a tiled or fused kernel; below,
#: on every backend, ``reference``, as fast and rounding exactly as torch does (measured on the
#: CPU in ``benchmarks``).
BLOCKED_MIN_SCORES = 64 * 64

#: With keys and values heads first (the decode cache), ``None`` runs ``native`` from this many
#: queries only: below, its per-call copy of the cache costs more than it saves
#: (``select_implementation``).
NATIVE_MIN_QUERIES_HSD = 64


def masked_softmax(attn_scores, d_key, mask=None, fill_value=-jnp.inf):
    """Scale, fill, softmax: ``softmax(where(mask, attn_scores / sqrt(d_key), fill_value))``.

    ``attn_scores`` ``(..., t, s)``; ``mask`` broadcastable to it, ``True`` = keep, or an
    ``AttentionMask`` (which brings its own fill and causality). The softmax runs in at least
    float32 and the result is cast back to the dtype of ``attn_scores``.
    """
    check_d_key(d_key)
    if not isinstance(mask, AttentionMask):
        mask = AttentionMask.build(mask, fill_value=fill_value, dtype=attn_scores.dtype)
    return _masked_softmax(attn_scores, d_key, mask)


def _masked_softmax(attn_scores, d_key: int, mask: AttentionMask):
    """``masked_softmax`` on the core's own values: ``mask`` an ``AttentionMask``."""
    dtype = attn_scores.dtype
    attn_scores = attn_scores / d_key**0.5
    visible = None
    if mask.is_causal:
        t, s = attn_scores.shape[-2:]
        visible = mask.visible(jnp.arange(t)[:, None], jnp.arange(s)[None, :])  # (t, s)
    attn_scores = mask.apply(attn_scores, mask.keep, visible)
    compute_dtype = jnp.promote_types(dtype, jnp.float32)
    attn_weights = jax.nn.softmax(attn_scores.astype(compute_dtype), axis=-1)
    return attn_weights.astype(dtype)


def check_implementation(implementation) -> None:
    """``implementation`` must be one of ``IMPLEMENTATIONS`` (layers check it at construction)."""
    check_choice("implementation", implementation, IMPLEMENTATIONS)


def check_block_sizes(block_sizes) -> None:
    """``block_sizes`` must be a ``BlockSizes`` or ``None`` (automatic)."""
    expected = "a BlockSizes or None (e.g. BlockSizes(block_q=128, block_k=128))"
    check_instance("block_sizes", block_sizes, (BlockSizes, type(None)), expected)


def _dropout_active(dropout) -> bool:
    """Whether ``dropout`` drops anything: an ``nnx.Dropout`` with a rate in training mode, or
    any other callable (a dropout of the caller's own, which ``reference`` applies as it is)."""
    if dropout is None:
        return False
    if isinstance(dropout, nnx.Dropout):
        return dropout.rate > 0 and not dropout.deterministic
    return True


def select_implementation(
    queries,
    keys,
    values=None,
    *,
    need_weights=False,
    dropout=None,
    kv_layout: KVLayout = "shd",
    mask: AttentionMask | None = None,
) -> str:
    """What ``implementation=None`` runs: the fastest that runs these inputs and does what the
    call needs (``mask``: what the call hides, as ``attend`` takes it; ``None``: nothing, and
    ``AttentionMask(is_causal=True)`` for a causal layer without a cache or padding mask).

    - weights asked for: ``reference`` (the only one that returns them);
    - a dropout callable other than ``nnx.Dropout``, active: ``reference`` (the only one that
      applies it as it is);
    - below ``BLOCKED_MIN_SCORES`` score entries per head, on every backend: ``reference``
      (nothing to tile or fuse; on a GPU it also keeps clear of XLA refusing to compile the
      fused attention's half-precision scores product, float32 accumulation at ``highest``
      precision, when one query meets one key: "Unsupported dot precision algorithm");
    - GPU: ``cudnn`` (cuDNN's fused flash attention) where ``kernels.jax_nn.cudnn_can_run``
      the call: queries, keys and values all float16 or all bfloat16, no dropout active, keys
      and values ``(..., s, h, d)`` (``kv_layout="shd"``), one head size for all three, a
      multiple of 8 up to 128 (256 from compute capability 9.0), no caller's mask, and
      causality (and its window) only from query 0 over as many keys as queries (it goes in as
      ``is_causal``, not as a mask array); else as on a TPU (the selection is not yet measured
      on a GPU: ``docs/performance.md``);
    - TPU (and a GPU where ``cudnn`` cannot take the call): ``xla`` (XLA's attention), or
      ``reference`` while dropout is active;
    - CPU: ``native`` where ``native.can_run`` the inputs (the kernel built, queries, keys
      and, when given, values float32 or bfloat16; ``native.why_unavailable()`` says why not),
      else ``blocked`` (the tiled kernels skip the causal half and never materialise the
      scores). An active ``nnx.Dropout`` changes nothing here: ``native`` and ``blocked``
      apply its rate inside their tiles.

    Keys and values heads first (``kv_layout="hsd"``, the decode cache), on the CPU: ``native``
    would copy the whole cache into its ``(..., s, h, d)`` order on every call, so it runs from
    ``NATIVE_MIN_QUERIES_HSD`` queries only (where that copy is small against the attention);
    fewer queries run ``blocked`` (reads the cache in place), and a single query (one decode
    step) ``reference``, whose scores are one row per head (the measurements behind these
    thresholds: ``docs/performance.md``, "Choosing an implementation").
    """
    check_choice("kv_layout", kv_layout, KV_LAYOUTS)
    expected = "an AttentionMask or None (e.g. AttentionMask(is_causal=True))"
    check_instance("mask", mask, (AttentionMask, type(None)), expected)
    mask = AttentionMask() if mask is None else mask
    return _select(queries, keys, values, need_weights, dropout, kv_layout, mask)


def _select(queries, keys, values, need_weights, dropout, kv_layout, mask) -> str:
    """``select_implementation`` on the core's own values (``mask`` an ``AttentionMask``)."""
    if need_weights:
        return "reference"
    if _dropout_active(dropout) and not isinstance(dropout, nnx.Dropout):
        return "reference"
    queries_count = queries.shape[-3]
    keys_count = keys.shape[-2] if kv_layout == "hsd" else keys.shape[-3]
    if queries_count * keys_count < BLOCKED_MIN_SCORES:
        return "reference"
    if jax.default_backend() != "cpu":
        if _dropout_active(dropout):
            return "reference"
        on_gpu = jax.default_backend() == "gpu" and kv_layout == "shd"
        values = keys if values is None else values  # jax.nn: values shaped as keys
        fused = on_gpu and cudnn_can_run(queries, keys, values, mask)
        return "cudnn" if fused else "xla"
    if kv_layout == "hsd" and queries_count < NATIVE_MIN_QUERIES_HSD:
        return "reference" if queries_count == 1 else "blocked"
    operands = (queries, keys) if values is None else (queries, keys, values)
    return "native" if native.can_run(*operands) else "blocked"


def _check_options(implementation, block_sizes, kv_layout) -> None:
    check_implementation(implementation)
    check_block_sizes(block_sizes)
    check_choice("kv_layout", kv_layout, KV_LAYOUTS)


def _check_choice(implementation, queries, keys, values, *, need_weights, dropout) -> None:
    """An ``implementation`` the caller named must do what the call asks, here (what it can
    do: its ``_Kernel`` entry)."""
    kernel = _KERNELS[implementation]
    if need_weights and not kernel.weights:
        raise ValueError(
            f"implementation ({implementation!r}) must be 'reference' (or None) to return "
            "attention weights (need_weights=False for the others)"
        )
    tiled_dropout = kernel.dropout == "tiled" and isinstance(dropout, nnx.Dropout)
    if _dropout_active(dropout) and kernel.dropout != "any" and not tiled_dropout:
        raise ValueError(
            f"implementation ({implementation!r}) must be 'reference', 'blocked', 'native' "
            "or None while dropout is active (call .eval(), or use implementation=None); "
            "'blocked' and 'native' take an nnx.Dropout only"
        )
    if kernel.check is not None:
        kernel.check(queries, keys, values)


class _Call(typing.NamedTuple):
    """What one call asks of its implementation, beside the arrays and the mask (built once by
    ``attend``; each implementation reads what it uses)."""

    dropout: object  # an nnx.Dropout, another callable, or None
    precision: object
    block_sizes: BlockSizes | None
    kv_layout: KVLayout
    need_weights: bool
    dropout_key: jax.Array | None = None  # drawn outside (explicit meshes), else by the dropout


def attend(
    queries,
    keys,
    values,
    mask: AttentionMask | None = None,
    *,
    dropout=None,
    precision=None,
    implementation: Implementation | None = None,
    need_weights: bool = False,
    block_sizes: BlockSizes | None = None,
    kv_layout: KVLayout = "shd",
):
    """The one entry of every layer: attention of ``queries`` over ``keys`` and ``values``
    with what ``mask`` (an ``AttentionMask``, built by the caller; ``None``: nothing hidden)
    hides. Chooses the implementation (``None``: ``select_implementation``) or checks the named
    one can do the call, runs it, under ``jax.sharding.auto_axes`` on an explicit mesh. Returns
    ``context_vec``, or ``(context_vec, attn_weights)`` with ``need_weights``; the arguments are
    ``dot_product_attention``'s, whose options (``implementation``, ``block_sizes``,
    ``kv_layout``) are checked where they are given: the layers at construction,
    ``dot_product_attention`` at each call."""
    heads, kv_heads = queries.shape[-2], keys.shape[-3 if kv_layout == "hsd" else -2]
    if heads % kv_heads or values.shape[-3 if kv_layout == "hsd" else -2] != kv_heads:
        raise ValueError(
            f"keys' and values' heads ({kv_heads}, "
            f"{values.shape[-3 if kv_layout == 'hsd' else -2]}) must be equal and divide the "
            f"queries' heads ({heads}) (grouped-query attention)"
        )
    if mask is None:
        mask = AttentionMask.build(dtype=jnp.result_type(queries, keys))
    elif not isinstance(mask, AttentionMask):
        given = f"an array {jnp.shape(mask)}" if hasattr(mask, "shape") else type(mask).__name__
        raise TypeError(
            f"mask ({given}) must be an AttentionMask or None (AttentionMask.build makes one "
            "from a boolean mask; dot_product_attention takes the boolean mask itself)"
        )
    if implementation is None:
        implementation = _select(queries, keys, values, need_weights, dropout, kv_layout, mask)
    else:  # the caller's choice must do what the call asks, here
        _check_choice(
            implementation, queries, keys, values, need_weights=need_weights, dropout=dropout
        )
    kernel = _KERNELS[implementation]
    if kv_layout == "hsd" and not kernel.heads_first:
        keys, values = jnp.swapaxes(keys, -3, -2), jnp.swapaxes(values, -3, -2)  # (..., s, h, d)
        kv_layout = "shd"
    call = _Call(dropout, precision, block_sizes, kv_layout, need_weights)
    if jax.sharding.get_abstract_mesh().empty or explicit_mesh() is None:
        return kernel.run(queries, keys, values, mask, call)
    return _run_with_auto_axes(kernel.run, queries, keys, values, mask, call)


def dot_product_attention(
    queries,
    keys,
    values,
    mask=None,
    *,
    is_causal: bool = False,
    query_offset=0,
    fill_value=-jnp.inf,
    window: int | None = None,
    dropout=None,
    precision=None,
    implementation: Implementation | None = "reference",
    need_weights: bool = True,
    block_sizes: BlockSizes | None = None,
    kv_layout: KVLayout = "shd",
):
    """Scaled dot-product attention, returning ``(context_vec, attn_weights)``.

    Args:
      queries: ``(..., t, h, d_k)``.
      keys: ``(..., s, h_kv, d_k)``, or ``(..., h_kv, s, d_k)`` with ``kv_layout="hsd"``;
        ``h_kv`` divides ``h`` (``h_kv < h``: grouped-query attention, query head ``i`` with key
        head ``i // (h // h_kv)``).
      values: ``(..., s, h_kv, d_v)``, or ``(..., h_kv, s, d_v)`` with ``kv_layout="hsd"``.
      mask: broadcastable to the weights ``(..., h, t, s)``; ``True`` keeps a position, ``False``
        fills its score with ``fill_value``.
      is_causal: query ``i`` sees keys ``j <= query_offset + i`` only; the others get ``-inf``.
      query_offset: absolute position of query 0 (the decode cache's index; may be traced).
      fill_value: ``-inf`` (the causal family) or ``-1e10`` (the annotated transformer) for
        ``mask``.
      window: with ``is_causal``, a sliding window of ``window`` keys: query ``q`` (absolute
        position) sees keys ``q - window < j <= q`` only; ``None``: every earlier key.
      dropout: applied to the weights: an ``nnx.Dropout`` (its own ``deterministic`` flag, set
        by ``.eval()``/``.train()``, decides; ``reference``, ``blocked`` and ``native`` apply
        it), any other callable ``weights -> weights`` (a dropout of your own, such as fixed
        keep-masks; ``reference`` only, always active), or ``None``.
      precision: passed to every matmul.
      implementation: one of ``IMPLEMENTATIONS`` (module docstring).
      need_weights: return the weights (``reference`` only); ``False`` lets ``None`` choose a
        faster implementation, and the second result is then ``None``.
      block_sizes: the ``blocked`` kernel's tiles (``BlockSizes``); ``None`` picks them from
        the shape (``BlockSizes.automatic``). The other implementations ignore it.
      kv_layout: ``"shd"`` (keys and values laid out as the queries) or ``"hsd"`` (heads first,
        as the decode cache stores them; module docstring).

    Returns:
      ``context_vec`` ``(..., t, h, d_v)`` and ``attn_weights`` ``(..., h, t, s)`` (after
      dropout, as the documents return them) or ``None``.
    """
    _check_options(implementation, block_sizes, kv_layout)
    # The one description of what is hidden, consumed by every implementation.
    attention_mask = AttentionMask.build(
        mask,
        is_causal=is_causal,
        query_offset=query_offset,
        fill_value=fill_value,
        window=window,
        dtype=jnp.result_type(queries, keys),  # the scores' dtype
    )
    out = attend(
        queries,
        keys,
        values,
        attention_mask,
        dropout=dropout,
        precision=precision,
        implementation=implementation,
        need_weights=need_weights,
        block_sizes=block_sizes,
        kv_layout=kv_layout,
    )
    return out if need_weights else (out, None)


def _run_with_auto_axes(run, queries, keys, values, attention_mask, call):
    """``run`` under an explicit mesh: the kernels run with ``Auto`` axes inside, their results
    come back laid out like the queries (heads, or a single head's features, over ``model``).
    Arrays cross as arguments: the mask's, and the dropout key, drawn here from the layer's
    stream (the same draw the dropout would make inside)."""
    dropout_key = None
    if isinstance(call.dropout, nnx.Dropout) and _dropout_active(call.dropout):
        dropout_key = call.dropout.rngs()

    def run_auto(queries, keys, values, keep, query_offset, dropout_key):
        inside = attention_mask.replace(keep=keep, query_offset=query_offset)
        return run(queries, keys, values, inside, call._replace(dropout_key=dropout_key))

    out_sharding = attention_out_shardings(queries, values, call.need_weights)
    return jax.sharding.auto_axes(run_auto, out_sharding=out_sharding)(
        queries, keys, values, attention_mask.keep, attention_mask.query_offset, dropout_key
    )


def _tiled_dropout(call: _Call):
    """``(rate, seed)`` of a tiled kernel's dropout: ``(0.0, None)`` when inactive, else the
    layer's rate and a uint32 seed drawn from its RNG stream (``dropout_key``: drawn outside)."""
    dropout = call.dropout
    if not _dropout_active(dropout):
        return 0.0, None
    dropout_key = dropout.rngs() if call.dropout_key is None else call.dropout_key
    return dropout.rate, jax.random.bits(dropout_key, dtype=jnp.uint32)


def _run_reference(queries, keys, values, attention_mask, call: _Call):
    dropout = call.dropout if _dropout_active(call.dropout) else None
    if dropout is not None and call.dropout_key is not None:
        dropout = functools.partial(dropout, rngs=call.dropout_key)
    context_vec, attn_weights = _reference(
        queries, keys, values, attention_mask, dropout, call.precision, call.kv_layout
    )
    return (context_vec, attn_weights) if call.need_weights else context_vec


def _run_blocked(queries, keys, values, attention_mask, call: _Call):
    rate, seed = _tiled_dropout(call)
    return blocked_attention(
        queries,
        keys,
        values,
        attention_mask,
        precision=call.precision,
        block_sizes=call.block_sizes,
        dropout_rate=rate,
        dropout_seed=seed,
        kv_heads_first=call.kv_layout == "hsd",
    )


def _run_native(queries, keys, values, attention_mask, call: _Call):
    rate, seed = _tiled_dropout(call)
    return native._attend(queries, keys, values, attention_mask, rate, seed)


def _check_native(queries, keys, values) -> None:
    reason = native.why_not_here()
    if reason is not None:
        raise ValueError(
            f"implementation ('native') must run on the CPU with the kernel built "
            f"({reason}; use 'blocked')"
        )
    native.check_dtypes(queries=queries, keys=keys, values=values)


def _jax_nn(name):
    def run(queries, keys, values, attention_mask, call: _Call):
        return jax_nn_attention(queries, keys, values, attention_mask, implementation=name)

    return run


class _Kernel(typing.NamedTuple):
    """One implementation: how it runs and what it can do (``_KERNELS``)."""

    run: typing.Callable  # (queries, keys, values, attention_mask, call: _Call) -> result
    heads_first: bool  # reads keys and values laid out (..., h, s, d) as they are
    weights: bool  # can return the attention weights
    dropout: str | None  # "any": applies the dropout callable; "tiled": an nnx.Dropout's rate
    check: typing.Callable | None = None  # (queries, keys, values): raises where it cannot run


#: Every implementation, by name: the one table a new implementation is added to (and
#: ``Implementation``; ``select_implementation`` where ``None`` should pick it).
_KERNELS: dict[str, _Kernel] = {
    "reference": _Kernel(_run_reference, heads_first=True, weights=True, dropout="any"),
    "xla": _Kernel(_jax_nn("xla"), heads_first=False, weights=False, dropout=None),
    "cudnn": _Kernel(_jax_nn("cudnn"), heads_first=False, weights=False, dropout=None),
    "blocked": _Kernel(_run_blocked, heads_first=True, weights=False, dropout="tiled"),
    "native": _Kernel(
        _run_native, heads_first=False, weights=False, dropout="tiled", check=_check_native
    ),
}


def _one_query_scores(queries, keys, kv_heads: int, precision):
    """One query's scores against a heads-first cache: ``(..., 1, h, d)`` and ``(..., h_kv, s,
    d)`` -> ``(..., h, 1, s)``, as ``keys @ query`` (the cache the product's left operand, rows
    of ``d`` as they lie) then turned round, one row per head. As ``query @ keys.T`` XLA's CPU
    compiler laid the keys out ``(d, s)`` for its dot, so each decode step copied every layer's
    whole key cache transposed after writing it (``docs/performance.md``, "The decode step's
    key cache, read where it lies")."""
    *lead, _, heads, d_key = queries.shape
    q = queries.reshape(*lead, kv_heads, heads // kv_heads, d_key)  # (..., h_kv, g, d)
    scores = jnp.einsum("...hsd,...hgd->...hgs", keys, q, precision=precision)
    return scores.reshape(*lead, heads, 1, keys.shape[-2])  # (..., h, 1, s)


def _reference(queries, keys, values, attention_mask, dropout, precision, kv_layout="shd"):
    """The documents' math, weights materialised. Keys and values heads first
    (``kv_layout="hsd"``) enter the two matmuls as they are. Grouped heads (keys and values with
    ``h_kv`` heads, ``h = g * h_kv`` query heads): the queries are viewed ``(..., t, h_kv, g,
    d)`` and each group meets its one key head in the same two matmuls; nothing is repeated."""
    d_key, heads = queries.shape[-1], queries.shape[-2]
    kv = "...shd" if kv_layout == "shd" else "...hsd"
    kv_heads = keys.shape[-2] if kv_layout == "shd" else keys.shape[-3]
    if kv_layout == "hsd" and queries.shape[-3] == 1:  # a decode step against its cache
        attn_scores = _one_query_scores(queries, keys, kv_heads, precision)  # (..., h, 1, s)
    elif kv_heads == heads:
        attn_scores = jnp.einsum(
            f"...thd,{kv}->...hts", queries, keys, precision=precision
        )  # (..., h, t, s)
    else:  # grouped: (..., t, h_kv, g, d) against (..., s, h_kv, d)
        grouped = queries.reshape(*queries.shape[:-2], kv_heads, heads // kv_heads, d_key)
        attn_scores = jnp.einsum(
            f"...thgd,{kv}->...hgts", grouped, keys, precision=precision
        )  # (..., h_kv, g, t, s)
        attn_scores = attn_scores.reshape(*attn_scores.shape[:-4], heads, *attn_scores.shape[-2:])
    attn_weights = _masked_softmax(attn_scores, d_key, attention_mask)  # (..., h, t, s)
    if dropout is not None:
        attn_weights = dropout(attn_weights)
    if kv_heads == heads:
        context_vec = jnp.einsum(
            f"...hts,{kv}->...thd", attn_weights, values, precision=precision
        )  # (..., t, h, d_v)
        return context_vec, attn_weights
    grouped = attn_weights.reshape(
        *attn_weights.shape[:-3], kv_heads, heads // kv_heads, *attn_weights.shape[-2:]
    )  # (..., h_kv, g, t, s)
    context_vec = jnp.einsum(f"...hgts,{kv}->...thgd", grouped, values, precision=precision)
    return context_vec.reshape(*context_vec.shape[:-3], heads, values.shape[-1]), attn_weights
