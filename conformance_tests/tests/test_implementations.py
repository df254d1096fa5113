"""Every ``implementation`` of the attention core equals ``reference`` and torch, gradients too.

Two levels:

1. The spec's cases for every layer with an ``implementation`` option: torch's weights loaded into
   the Flax layer, the layer switched to ``xla`` or ``blocked`` (``MultiHeadedAttention`` with
   ``keep_attention_score=False``: only ``reference`` returns weights), outputs and gradients
   compared with torch through the harness, under the spec's float32 tolerances, each side
   compiled as one program (as a user's ``jit`` runs it; the report's gradient rows compile with
   XLA's fusion off, in ``test_spec.py``). ``blocked``
   runs with 4-token tiles (``BlockSizes(4, 4)``, passed as an argument) so the documents' 6 and
   7 tokens cross several tiles and end in a partial one.
2. The core function on the shapes the layers do not reach: one token, cross lengths, a key
   length that is not a multiple of the tile, padding and arbitrary masks, a fully masked row,
   queries at an offset (decode), ``v_dim != k_dim``.
3. Dropout inside the tiles: ``blocked`` (and ``native``) with the hash's keep-mask equal
   ``reference`` given ``dropout_hash.keep_mask`` as its dropout, forward and gradients, and
   ``blocked`` equals ``native`` for the same layer seed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_attention as fa
import flax_attention.core as core
from conformance_tests import harness, spec
from conformance_tests.tolerances import tolerance
from flax_attention.kernels import blocked, dropout_hash, native
from flax_attention.masking import AttentionMask

CPU = harness.backends(["cpu"])[0]
#: The faster implementations on this machine: ``native`` where its kernel is built here.
FAST = ("xla", "blocked", *(("native",) if native.available() else ()))
LAYERS = ("CausalAttention", "MultiHeadAttentionWrapper", "MultiHeadAttention")
CASES = [
    c
    for c in spec.CASES
    if (c.layer in LAYERS or c.layer == "MultiHeadedAttention") and "large" not in c.tags
]
LARGE = [c for c in spec.CASES if c.name in ("gpt2_mha", "gpt2_annotated")]


#: 4 x 4 tiles: the documents' 6 and 7 tokens cross several and end in a partial one.
SMALL_TILES = fa.BlockSizes(4, 4)


def set_implementation(module, implementation, block_sizes=SMALL_TILES):
    """Switch every attention layer inside ``module`` to ``implementation`` (and its tiles)."""
    for _, node in nnx.iter_graph(module):
        if hasattr(node, "implementation"):
            node.implementation = implementation
            node.block_sizes = block_sizes
        if isinstance(node, fa.MultiHeadedAttention):
            node.keep_attention_score = implementation in (None, "reference")


def _out_only(case, named):
    """``MultiHeadedAttention`` returns its weights only in ``reference``: compare ``out``."""
    return {k: v for k, v in named.items() if k != "attention_score"}


def _pair(case, tmp_path, implementation, block_sizes=SMALL_TILES):
    tm, fm = harness.build_pair(case, str(tmp_path))
    set_implementation(fm, implementation, block_sizes)
    inputs = harness.make_inputs(case)
    mask = harness.make_mask(case, inputs)
    return tm, fm, *harness.prepare(CPU, inputs, mask)


def _assert_close(reference, actual, tol, what):
    result = harness.compare(reference, actual, tol)
    assert result.passed, (
        f"{what}: {result.worst!r} max_abs_err over its bound {result.err_over_bound:.2f} "
        f"(bound {result.bound:.1e}: tol {tol:.1e} * max(1, max|reference|))"
    )


@pytest.mark.parametrize("implementation", FAST)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_layer_forward_equals_torch(case, implementation, tmp_path):
    tm, fm, t_inputs, t_mask, f_inputs, f_mask = _pair(case, tmp_path, implementation)
    with jax.default_matmul_precision("highest"):
        reference = _out_only(
            case, harness.named(case, harness.call_torch(case, tm, t_inputs, t_mask))
        )
        actual = {"out": harness.flax_forward(case, fm, f_inputs, f_mask)[0]}
    key = "forward:documents" if case.uses_documents_input else "forward"
    _assert_close(reference, actual, tolerance("float32", key), f"{case.name} {implementation}")


@pytest.mark.parametrize("implementation", FAST)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_layer_gradients_equal_torch(case, implementation, tmp_path):
    tm, fm, t_inputs, t_mask, f_inputs, f_mask = _pair(case, tmp_path, implementation)
    _, _, cotangents = harness.torch_grads(case, tm, t_inputs, t_mask)
    cotangents = cotangents[:1]  # the output only: the fast paths return no weights
    _, reference, _ = harness.torch_grads(case, tm, t_inputs, t_mask, cotangents)
    with jax.default_matmul_precision("highest"):
        actual = harness.flax_grads(case, fm, f_inputs, f_mask, cotangents, jit=True)
    _assert_close(reference, actual, tolerance("float32", "grad"), f"{case.name} {implementation}")


@pytest.mark.slow
@pytest.mark.parametrize("case", LARGE, ids=lambda c: c.name)
def test_gpt2_size_blocked_equals_torch(case, tmp_path):
    tiles = fa.BlockSizes.square(128)  # the default tile, 8 x 8 tiles, half skipped
    tm, fm, t_inputs, t_mask, f_inputs, f_mask = _pair(case, tmp_path, "blocked", tiles)
    import torch

    with torch.no_grad():
        reference = {"out": harness.call_torch(case, tm, t_inputs, t_mask)[0]}
    with jax.default_matmul_precision("highest"):
        actual = {"out": harness.call_flax(case, fm, f_inputs, f_mask)[0]}
    _assert_close(reference, actual, tolerance("float32", "forward"), case.name)


# ---- the core function ------------------------------------------------------------------------

#: (name, batch, t, s, h, d_k, d_v, is_causal, mask kind, query_offset, fill_value)
CORE_CASES = [
    ("one_token", (2,), 1, 1, 2, 4, 4, True, None, 0, -np.inf),
    ("partial_tile", (2,), 13, 13, 3, 4, 4, True, None, 0, -np.inf),
    ("two_batch_axes", (2, 3), 9, 9, 2, 4, 4, True, None, 0, -np.inf),
    ("cross_padding", (3,), 7, 11, 2, 4, 4, False, "padding", 0, -1e10),
    ("cross_random_mask", (2,), 7, 11, 2, 4, 4, False, "random", 0, -1e10),
    ("fully_masked_row", (1,), 7, 7, 2, 4, 4, False, "row0", 0, -1e10),
    ("causal_fully_masked_row", (1,), 7, 7, 2, 4, 4, True, "row0", 0, -1e10),
    ("decode_offset", (2,), 3, 16, 2, 4, 4, True, None, 5, -np.inf),
    ("decode_one_token", (2,), 1, 16, 2, 4, 4, True, None, 9, -np.inf),
    ("v_dim_differs", (2,), 6, 10, 2, 4, 7, False, None, 0, -np.inf),
]


def _core_inputs(batch, t, s, h, d_k, d_v, mask_kind, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((*batch, t, h, d_k)).astype(np.float32)
    k = rng.standard_normal((*batch, s, h, d_k)).astype(np.float32)
    v = rng.standard_normal((*batch, s, h, d_v)).astype(np.float32)
    mask = None
    if mask_kind == "padding":  # (b, 1, 1, s), each row keeps a prefix of >= 1 key
        keep = rng.integers(1, s + 1, size=batch)
        mask = (np.arange(s) < keep[..., None])[..., None, None, :]
    elif mask_kind == "random":
        mask = rng.random((*batch, h, t, s)) > 0.3
    elif mask_kind == "row0":
        mask = np.ones((1, 1, t, s), bool)
        mask[..., 0, :] = False
    cotangent = rng.standard_normal((*batch, t, h, d_v)).astype(np.float32)
    return q, k, v, mask, cotangent


#: ``reference``'s output and gradients for each core case, by name (computed by the first test
#: of the case that runs in this process).
_CORE_REFERENCES: dict = {}


@pytest.mark.parametrize(
    ("name", "batch", "t", "s", "h", "d_k", "d_v", "is_causal", "mask_kind", "offset", "fill"),
    CORE_CASES,
    ids=[c[0] for c in CORE_CASES],
)
@pytest.mark.parametrize("implementation", FAST)
def test_core_equals_reference(
    implementation, name, batch, t, s, h, d_k, d_v, is_causal, mask_kind, offset, fill
):
    if implementation == "xla" and d_v != d_k:
        with pytest.raises(ValueError, match=r"values.shape\[-1\] \(7\) must equal"):
            core.dot_product_attention(
                *_core_inputs(batch, t, s, h, d_k, d_v, mask_kind)[:3],
                implementation="xla",
                need_weights=False,
            )
        return
    q, k, v, mask, cotangent = _core_inputs(batch, t, s, h, d_k, d_v, mask_kind)

    def run(impl):
        def loss(q, k, v):
            out, _ = core.dot_product_attention(
                q,
                k,
                v,
                mask,
                is_causal=is_causal,
                query_offset=offset,
                fill_value=fill,
                implementation=impl,
                need_weights=impl == "reference",
                block_sizes=SMALL_TILES,
            )
            return (out * cotangent).sum(), out

        with jax.default_matmul_precision("highest"):
            (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
        return {"out": out, "d_query": grads[0], "d_key": grads[1], "d_value": grads[2]}

    if name not in _CORE_REFERENCES:  # once per case: every implementation is compared with it
        _CORE_REFERENCES[name] = run("reference")
    reference, actual = dict(_CORE_REFERENCES[name]), run(implementation)
    assert np.isfinite(np.asarray(reference["out"])).all(), "reference must be finite here"
    _assert_close(
        {"out": reference["out"]}, {"out": actual["out"]}, tolerance("float32", "forward"), name
    )
    del reference["out"], actual["out"]
    _assert_close(reference, actual, tolerance("float32", "grad"), name)


#: Grouped heads and sliding windows against torch's ``scaled_dot_product_attention``
#: (``enable_gqa``, the window and causality as its boolean ``attn_mask``): (name, query heads,
#: key heads, window, queries, keys), the queries the last ones (a decode chunk where fewer).
GROUPED_CASES = [
    ("grouped", 4, 2, None, 13, 13),
    ("multi_query_window", 3, 1, 4, 13, 13),
    ("window_chunk", 2, 2, 3, 5, 12),
]


@pytest.mark.parametrize(
    ("name", "heads", "kv_heads", "window", "t", "s"),
    GROUPED_CASES,
    ids=[c[0] for c in GROUPED_CASES],
)
@pytest.mark.parametrize("implementation", ["reference", *FAST])
def test_grouped_heads_and_window_equal_torch(implementation, name, heads, kv_heads, window, t, s):
    """Every implementation with fewer key than query heads and a sliding window equals torch's
    ``scaled_dot_product_attention(..., enable_gqa=True)`` with the same visibility as its
    mask, forward and gradients (a key of one batch row hidden too; tiles of 4 cross the
    window's edges)."""
    import torch

    rng = np.random.default_rng(len(name))
    q = rng.standard_normal((2, t, heads, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, s, kv_heads, 8)).astype(np.float32) for _ in range(2))
    cotangent = rng.standard_normal((2, t, heads, 8)).astype(np.float32)
    offset = s - t
    keep = np.ones((2, 1, 1, s), bool)
    keep[1, ..., s - t + 1] = False  # a key the second row's later queries skip
    positions = offset + np.arange(t)[:, None], np.arange(s)[None, :]
    visible = positions[1] <= positions[0]
    if window is not None:
        visible &= positions[0] - positions[1] < window
    tq, tk, tv = (torch.tensor(x.transpose(0, 2, 1, 3), requires_grad=True) for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=torch.tensor(keep & visible), enable_gqa=True
    )  # (b, h, t, d)
    (out * torch.tensor(cotangent.transpose(0, 2, 1, 3))).sum().backward()
    names = ("out", "dq", "dk", "dv")
    tensors = (out.detach(), tq.grad, tk.grad, tv.grad)
    expected = {n: x.numpy().transpose(0, 2, 1, 3) for n, x in zip(names, tensors)}

    def loss(q, k, v):
        out, _ = core.dot_product_attention(
            q, k, v, keep, is_causal=True, query_offset=offset, window=window,
            implementation=implementation, need_weights=implementation == "reference",
            block_sizes=SMALL_TILES,
        )  # fmt: skip
        return (out * cotangent).sum(), out

    with jax.default_matmul_precision("highest"):
        (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    assert np.isfinite(expected["out"]).all()
    _assert_close({"out": expected["out"]}, {"out": out}, tolerance("float32", "forward"), name)
    actual = dict(zip(("dq", "dk", "dv"), grads))
    del expected["out"]
    _assert_close(expected, actual, tolerance("float32", "grad"), name)


def test_causal_fully_masked_row_attends_to_its_first_key_only():
    """With ``is_causal`` and a mask that hides all of row 0, the causal exclusion (``-inf``)
    still holds: the only key left is key 0 at ``fill_value``, so row 0's output is ``v[0]``."""
    q, k, v, mask, _ = _core_inputs((1,), 5, 5, 1, 4, 4, "row0")
    for impl in ("reference", *FAST):
        out, _ = core.dot_product_attention(
            q,
            k,
            v,
            mask,
            is_causal=True,
            fill_value=-1e10,
            implementation=impl,
            need_weights=False,
            block_sizes=SMALL_TILES,
        )
        np.testing.assert_allclose(np.asarray(out)[0, 0], v[0, 0], atol=1e-6, err_msg=impl)


@pytest.mark.quick
def test_blocked_skips_the_tiles_the_causal_mask_removes():
    """Query tile ``i`` visits key tiles ``0..i``: with 4 x 4 tiles over 16 tokens that is 10 of
    the 16 tiles, counted from the kernel's own bound."""
    config = blocked._Config(4, 4, 16, 16, True, -np.inf, None)
    visited = [int(blocked._key_blocks(config, 0, i)) for i in range(4)]
    assert visited == [1, 2, 3, 4]
    dense = blocked._Config(4, 4, 16, 16, False, -np.inf, None)
    assert [int(blocked._key_blocks(dense, 0, i)) for i in range(4)] == [4, 4, 4, 4]
    # A key tile's first query tile (the backward's bound): tile j is first seen by tile j.
    assert [int(blocked._first_query_block(config, 0, j)) for j in range(4)] == [0, 1, 2, 3]


@pytest.mark.quick
def test_blocked_masks_only_the_tiles_that_need_it():
    """The causal and padding ``where`` runs on the diagonal tiles and on a last key tile that
    holds padding only: query tile ``i`` sees key tiles ``0..i-1`` entirely (the diagonal tile
    ``i`` is masked), key tile ``j`` is seen entirely from query tile ``j + 1``; at an offset
    the diagonal moves; a key length that does not divide the tile masks its last key tile for
    every query tile."""
    config = blocked._Config(4, 4, 16, 16, True, -np.inf, None)
    assert [int(blocked._full_key_blocks(config, 0, i)) for i in range(4)] == [0, 1, 2, 3]
    assert [int(blocked._first_full_query_block(config, 0, j)) for j in range(4)] == [1, 2, 3, 4]
    # Decode chunk: 4 queries at offset 5 over 16 keys: query 5 sees key tile 0 and key 5 of 1.
    chunk = blocked._Config(4, 4, 4, 16, True, -np.inf, None)
    assert int(blocked._full_key_blocks(chunk, 5, 0)) == 1
    assert int(blocked._key_blocks(chunk, 5, 0)) == 3
    assert [int(blocked._first_full_query_block(chunk, 5, j)) for j in range(4)] == [0, 1, 1, 1]
    padded = blocked._Config(4, 4, 16, 14, False, -np.inf, None)  # 14 keys: 2 of padding
    assert [int(blocked._full_key_blocks(padded, 0, i)) for i in range(4)] == [3, 3, 3, 3]
    assert [int(blocked._first_full_query_block(padded, 0, j)) for j in range(4)] == [0, 0, 0, 4]
    dense = blocked._Config(4, 4, 16, 16, False, -np.inf, None)
    assert [int(blocked._full_key_blocks(dense, 0, i)) for i in range(4)] == [4, 4, 4, 4]
    assert [int(blocked._first_full_query_block(dense, 0, j)) for j in range(4)] == [0, 0, 0, 0]


def test_blocked_at_a_query_offset_with_taller_query_tiles_equals_reference():
    """A prefill continuation: 32 queries at offset 8 over 40 keys, causal, in 16 x 8 tiles
    (``block_q > block_k``). Query tile 0 (positions 8..23) needs key tiles 0..2, query tile 1
    (24..39) all 5: a key-tile count short by one tile, or counted in query tiles, or from the
    tile's first query, drops keys a query sees. Output and gradients equal ``reference``."""
    q, k, v, _, cotangent = _core_inputs((2,), 32, 40, 2, 4, 4, None)

    def attend(implementation):
        def fn(q, k, v):
            return core.dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                query_offset=8,
                implementation=implementation,
                need_weights=False,
                block_sizes=fa.BlockSizes(block_q=16, block_k=8),
            )[0]

        return fn

    expected = _grads(attend("reference"), q, k, v, cotangent)
    actual = _grads(attend("blocked"), q, k, v, cotangent)
    _assert_all_close(expected, actual, "blocked, 16 x 8 tiles at query offset 8")


def test_block_sizes_are_an_argument_that_changes_the_tiles_not_the_numbers():
    """The same call with 4 x 4, 3 x 5 and automatic tiles: the same output (to float32
    rounding); ``BlockSizes.automatic`` follows ``TILE_BYTES``; bad sizes are refused."""
    q, k, v, _, _ = _core_inputs((2,), 13, 13, 3, 4, 4, None)
    outs = [
        core.dot_product_attention(
            q, k, v, is_causal=True, implementation="blocked", need_weights=False, block_sizes=b
        )[0]
        for b in (fa.BlockSizes(4, 4), fa.BlockSizes(3, 5), None)
    ]
    for out in outs[1:]:
        np.testing.assert_allclose(np.asarray(out), np.asarray(outs[0]), atol=1e-6)
    assert fa.BlockSizes.automatic(1) == fa.BlockSizes(256, 256)
    assert fa.BlockSizes.automatic(8 * 12) == fa.BlockSizes(64, 64)  # 96 * 128**2 * 4 > 4 MiB
    with pytest.raises(ValueError, match=r"block_q \(0\) must be positive"):
        fa.BlockSizes(0, 4)
    with pytest.raises(TypeError, match=r"block_k \(2.5\) must be an int"):
        fa.BlockSizes(4, 2.5)
    with pytest.raises(TypeError, match=r"block_sizes \(int\) must be a BlockSizes or None"):
        core.dot_product_attention(q, k, v, block_sizes=4)
    with pytest.raises(TypeError, match=r"block_sizes \(tuple\) must be a BlockSizes or None"):
        fa.MultiHeadAttention(4, 4, 4, 0.0, 2, block_sizes=(4, 4), rngs=nnx.Rngs(0))


@pytest.mark.quick
def test_implementations_reject_what_they_cannot_do():
    q = jnp.ones((1, 4, 1, 2))
    with pytest.raises(ValueError, match=r"implementation \('fast'\) must be one of"):
        core.dot_product_attention(q, q, q, implementation="fast")
    with pytest.raises(ValueError, match=r"implementation \('blocked'\) must be 'reference'"):
        core.dot_product_attention(q, q, q, implementation="blocked", need_weights=True)
    dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="while dropout is active"):
        core.dot_product_attention(
            q, q, q, dropout=dropout, implementation="xla", need_weights=False
        )
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match=r"implementation \('cudnn'\) must run on an NVIDIA"):
            core.dot_product_attention(q, q, q, implementation="cudnn", need_weights=False)
    with pytest.raises(ValueError, match=r"implementation \('flash'\) must be one of"):
        fa.MultiHeadAttention(4, 4, 4, 0.0, 2, implementation="flash", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="keep_attention_score"):
        fa.MultiHeadedAttention(2, 4, 0.0, implementation="xla", rngs=nnx.Rngs(0))


def test_the_implementations_are_one_table_and_attend_takes_an_attention_mask():
    """Every name of ``Implementation`` is an entry of ``core._KERNELS`` and nothing else is;
    ``attend``, the layers' entry, takes the mask as an ``AttentionMask`` (``None``: nothing
    hidden) and equals ``dot_product_attention`` on the same description."""
    import typing

    assert tuple(core._KERNELS) == typing.get_args(core.Implementation)
    assert core.IMPLEMENTATIONS == (None, *core._KERNELS)
    q = jax.random.normal(jax.random.key(0), (2, 5, 2, 4))
    keep = jnp.arange(5) < 4
    with pytest.raises(
        TypeError, match=r"mask \(an array \(5,\)\) must be an AttentionMask or None"
    ):
        core.attend(q, q, q, keep)
    mask = AttentionMask.build(keep, is_causal=True, fill_value=-1e10, dtype=q.dtype)
    expected, weights = core.dot_product_attention(q, q, q, keep, is_causal=True, fill_value=-1e10)
    context, same_weights = core.attend(
        q, q, q, mask, implementation="reference", need_weights=True
    )
    np.testing.assert_array_equal(context, expected)
    np.testing.assert_array_equal(same_weights, weights)
    unmasked, _ = core.dot_product_attention(q, q, q)
    np.testing.assert_array_equal(core.attend(q, q, q, implementation="reference"), unmasked)


@pytest.mark.quick
def test_none_picks_reference_for_weights_and_a_tiled_kernel_for_long_inputs():
    short, long = jnp.ones((1, 8, 1, 2)), jnp.ones((1, 512, 1, 2))
    dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
    tiled = "native" if native.available() else "blocked"
    assert core.select_implementation(long, long, need_weights=True) == "reference"
    if jax.default_backend() == "cpu":  # an nnx.Dropout runs inside the tiles
        assert core.select_implementation(long, long, dropout=dropout) == tiled
        assert core.select_implementation(long.astype(jnp.float16), long, dropout=dropout) == (
            "blocked"
        )
        # Any other dropout callable (the harness's fixed masks): reference.
        assert core.select_implementation(long, long, dropout=lambda w: w) == "reference"
        assert core.select_implementation(short, short, dropout=dropout) == "reference"
        dropout.eval()
        assert core.select_implementation(long, long, dropout=dropout) == tiled
        assert core.select_implementation(short, short) == "reference"
        assert core.select_implementation(long.astype(jnp.float16), long) == "blocked"
        # the values count too: native takes float32/bfloat16 values only
        assert core.select_implementation(long, long, long.astype(jnp.float16)) == "blocked"


def test_a_dropout_of_your_own_is_applied_to_the_weights_by_reference():
    """``dropout`` may be any callable on the weights (documented in ``dot_product_attention``):
    ``reference`` applies it as it is, ``None`` picks ``reference`` for it, the tiled kernels
    refuse it."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 6, 3, 4)), jnp.float32) for _ in range(3))
    keep = jnp.asarray(rng.random((2, 3, 6, 6)) >= 0.5, jnp.float32)  # (b, h, t, s)
    fixed = lambda w: w * keep / 0.5  # noqa: E731  (fixed keep-masks, as the report injects)
    out, weights = core.dot_product_attention(q, k, v, is_causal=True, dropout=fixed)
    _, plain = core.dot_product_attention(q, k, v, is_causal=True)
    expected = jnp.einsum("bhts,bshd->bthd", plain * keep / 0.5, v)
    assert np.abs(np.asarray(weights - plain * keep / 0.5)).max() == 0.0
    assert np.abs(np.asarray(out - expected)).max() < 1e-6
    chosen, _ = core.dot_product_attention(
        q, k, v, is_causal=True, dropout=fixed, implementation=None, need_weights=False
    )
    assert np.abs(np.asarray(chosen - out)).max() == 0.0
    with pytest.raises(ValueError, match="take an nnx.Dropout only"):
        core.dot_product_attention(
            q, k, v, dropout=fixed, implementation="blocked", need_weights=False
        )


@pytest.mark.quick
@pytest.mark.skipif(not native.available(), reason=f"native: {native.why_unavailable()}")
def test_naming_native_checks_the_values_dtype_once_in_the_core():
    q = jnp.ones((1, 8, 1, 4))
    with pytest.raises(TypeError, match=r"values.dtype \(float16\) must be float32 or bfloat16"):
        core.dot_product_attention(
            q, q, q.astype(jnp.float16), implementation="native", need_weights=False
        )


def test_none_runs_float32_queries_with_float16_values():
    """The default picks what runs: float16 values are not native's (it would raise)."""
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((1, 96, 2, 8)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((1, 96, 2, 8)), jnp.float16)
    out, _ = core.dot_product_attention(q, k, v, implementation=None, need_weights=False)
    ref, _ = core.dot_product_attention(q, k, v, implementation="reference")
    assert out.shape == (1, 96, 2, 8)
    assert np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32)).max() < 1e-2


def test_train_mode_dropout_still_works_with_the_default_implementation():
    """Dropout lives in ``reference``, ``blocked`` and ``native``: ``None`` picks one in train
    mode."""
    layer = fa.MultiHeadAttention(8, 8, 128, 0.5, 2, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 128, 8)), jnp.float32)
    layer.eval()
    clean = layer(x)
    layer.train()
    dropped = layer(x)
    assert float(jnp.abs(dropped - clean).max()) > 1e-2  # dropout changed the output
    layer.eval()
    np.testing.assert_array_equal(np.asarray(layer(x)), np.asarray(clean))


# ---- dropout inside the tiles -----------------------------------------------------------------


def _grads(fn, q, k, v, cotangent):
    def loss(q, k, v):
        out = fn(q, k, v)
        return (out * cotangent).sum(), out

    with jax.default_matmul_precision("highest"):
        (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return {"out": out, "d_query": grads[0], "d_key": grads[1], "d_value": grads[2]}


def _assert_all_close(expected, actual, what):
    _assert_close(
        {"out": expected["out"]}, {"out": actual["out"]}, tolerance("float32", "forward"), what
    )
    grads = [n for n in expected if n != "out"]
    _assert_close(
        {n: expected[n] for n in grads},
        {n: actual[n] for n in grads},
        tolerance("float32", "grad"),
        what,
    )


@pytest.mark.parametrize(
    ("is_causal", "heads", "kv_heads", "window"),
    [(False, 2, 2, None), (True, 2, 2, None), (True, 4, 2, 3)],
    ids=["full", "causal", "grouped_window"],
)
def test_blocked_dropout_equals_reference_with_the_same_mask(is_causal, heads, kv_heads, window):
    """``blocked`` with dropout inside its tiles equals ``reference`` whose dropout applies
    ``dropout_hash.keep_mask(seed, (B, h, t, s), rate)`` scaled by ``1 / (1 - rate)`` (two
    batch axes flattened into ``B``, tiles crossing the lengths, a padding mask with document
    001's fill; grouped heads and a window too, where the hash numbers the query heads),
    forward and gradients; and ``native`` with the same seed drops the same weights."""
    rate, seed = 0.3, 1234
    q, k, v, mask, cotangent = _core_inputs((2, 3), 13, 11, heads, 4, 4, "padding")
    k, v = k[..., :kv_heads, :], v[..., :kv_heads, :]
    keep = dropout_hash.keep_mask(seed, (6, heads, 13, 11), rate).reshape(2, 3, heads, 13, 11)

    def reference(q, k, v):
        def dropout(weights):
            return jnp.where(keep, weights / (1 - rate), 0.0)

        return core.dot_product_attention(
            q, k, v, mask, is_causal=is_causal, fill_value=-1e10, window=window, dropout=dropout
        )[0]

    def tiled(kernel, **kwargs):
        def fn(q, k, v):
            attention_mask = AttentionMask.build(
                mask, is_causal=is_causal, fill_value=-1e10, window=window, dtype=q.dtype
            )
            return kernel(q, k, v, attention_mask, dropout_rate=rate, dropout_seed=seed, **kwargs)

        return fn

    expected = _grads(reference, q, k, v, cotangent)
    actual = _grads(tiled(blocked.blocked_attention, block_sizes=SMALL_TILES), q, k, v, cotangent)
    _assert_all_close(expected, actual, "blocked dropout")
    clean = core.dot_product_attention(
        q,
        k,
        v,
        mask,
        is_causal=is_causal,
        fill_value=-1e10,
        window=window,
        implementation="blocked",
        need_weights=False,
        block_sizes=SMALL_TILES,
    )[0]
    assert float(jnp.abs(clean - actual["out"]).max()) > 0.1  # dropout changed it
    if native.available():
        fast = _grads(tiled(native.native_attention, block_q=4), q, k, v, cotangent)
        _assert_all_close(actual, fast, "blocked vs native dropout")


@pytest.mark.parametrize("implementation", [i for i in FAST if i != "xla"])
def test_tiled_dropout_draws_its_seed_from_the_layers_stream(implementation):
    """Through the core with an active ``nnx.Dropout``: ``blocked`` and ``native`` take a uint32
    seed from the dropout's own RNG stream (``jax.random.bits``) and equal ``reference`` given
    that seed's ``keep_mask``, gradients too; the next call draws a new seed."""
    rate = 0.2
    q, k, v, _, cotangent = _core_inputs((2,), 9, 9, 3, 4, 4, None)
    seed = jax.random.bits(nnx.Dropout(rate, rngs=nnx.Rngs(7)).rngs(), dtype=jnp.uint32)
    keep = dropout_hash.keep_mask(seed, (2, 3, 9, 9), rate)

    def reference(q, k, v):
        def dropout(weights):
            return jnp.where(keep, weights / (1 - rate), 0.0)

        return core.dot_product_attention(q, k, v, is_causal=True, dropout=dropout)[0]

    class Layer(nnx.Module):  # trained as a layer is: nnx transforms carry the RNG count
        def __init__(self):
            self.q, self.k, self.v = nnx.Param(q), nnx.Param(k), nnx.Param(v)
            self.dropout = nnx.Dropout(rate, rngs=nnx.Rngs(7))

        def __call__(self):
            return core.dot_product_attention(
                self.q[...],
                self.k[...],
                self.v[...],
                is_causal=True,
                dropout=self.dropout,
                implementation=implementation,
                need_weights=False,
                block_sizes=SMALL_TILES,
            )[0]

    @nnx.jit
    def step(layer):
        def loss(layer):
            out = layer()
            return (out * cotangent).sum(), out

        with jax.default_matmul_precision("highest"):
            (_, out), grads = nnx.value_and_grad(loss, has_aux=True)(layer)
        return {"out": out, "d_query": grads.q[...], "d_key": grads.k[...], "d_value": grads.v[...]}

    layer = Layer()
    expected = _grads(reference, q, k, v, cotangent)
    first = step(layer)
    _assert_all_close(expected, first, implementation)
    second = step(layer)
    assert np.abs(np.asarray(first["out"]) - np.asarray(second["out"])).max() > 0.1  # new seed


# ---- keys and values heads first (the decode cache's layout) ----------------------------------


@pytest.mark.parametrize(
    ("implementation", "name"),
    [
        (implementation, name)
        for implementation in ("reference", *FAST)
        for name in ("cross_random_mask", "decode_offset", "v_dim_differs")
        if not (implementation == "xla" and name == "v_dim_differs")  # xla needs d_v == d_k
    ],
)
def test_keys_and_values_heads_first_give_the_same_call(implementation, name):
    """``kv_layout="hsd"`` (keys and values ``(..., h, s, d)``) equals the same call with them
    laid out as the queries, forward and gradients (the key and value gradients come back in
    the layout they were given)."""
    case = next(c for c in CORE_CASES if c[0] == name)
    _, batch, t, s, h, d_k, d_v, is_causal, mask_kind, offset, fill = case
    q, k, v, mask, cotangent = _core_inputs(batch, t, s, h, d_k, d_v, mask_kind)

    def run(kv_layout, k, v):
        def fn(q, k, v):
            return core.dot_product_attention(
                q,
                k,
                v,
                mask,
                is_causal=is_causal,
                query_offset=offset,
                fill_value=fill,
                implementation=implementation,
                need_weights=False,
                block_sizes=SMALL_TILES,
                kv_layout=kv_layout,
            )[0]

        return _grads(fn, q, k, v, cotangent)

    expected = run("shd", k, v)
    actual = run("hsd", np.swapaxes(k, -3, -2), np.swapaxes(v, -3, -2))
    actual["d_key"] = jnp.swapaxes(actual["d_key"], -3, -2)
    actual["d_value"] = jnp.swapaxes(actual["d_value"], -3, -2)
    _assert_all_close(expected, actual, f"{implementation} {name}")


@pytest.mark.quick
def test_none_on_a_gpu_or_tpu_runs_xla_from_the_tiled_kernels_bound_reference_below(monkeypatch):
    """Off the CPU: ``xla`` (``reference`` while dropout is active); below
    ``BLOCKED_MIN_SCORES`` scores per head ``reference`` on every backend (one query and one key
    in float16 at ``highest`` precision: XLA's GPU compiler refused the fused attention's scores
    product, "Unsupported dot precision algorithm: 4", jax 0.11.2 on an H100)."""
    one, short, long = (jnp.ones((1, t, 1, 2)) for t in (1, 63, 64))
    dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
    for backend in ("gpu", "tpu"):
        monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
        assert core.select_implementation(long, long) == "xla"
        assert core.select_implementation(long.astype(jnp.float16), long) == "xla"
        assert core.select_implementation(one.astype(jnp.float16), one) == "reference"
        assert core.select_implementation(short, long) == "reference"
        assert core.select_implementation(long, long, dropout=dropout) == "reference"
        assert core.select_implementation(one, long, kv_layout="hsd") == "reference"


def test_none_with_keys_heads_first_reads_them_in_place():
    """Keys and values heads first (the decode cache) on the CPU: one query runs ``reference``,
    a few ``blocked`` (both read them in place), from ``NATIVE_MIN_QUERIES_HSD`` the usual
    tiled kernel (``native`` copies them into its order once per call); a bad layout is
    refused."""
    keys = jnp.ones((1, 1, 4096, 2))  # (b, h, s, d)
    one, few, many = (jnp.ones((1, t, 1, 2)) for t in (1, 16, core.NATIVE_MIN_QUERIES_HSD))
    tiled = "native" if native.available() else "blocked"
    if jax.default_backend() == "cpu":
        assert core.select_implementation(one, keys, kv_layout="hsd") == "reference"
        assert core.select_implementation(few, keys, kv_layout="hsd") == "blocked"
        assert core.select_implementation(many, keys, kv_layout="hsd") == tiled
        shd = jnp.swapaxes(keys, 1, 2)
        assert core.select_implementation(one, shd) == tiled
        short = jnp.ones((1, 1, 64, 2))  # 64 scores per head: under the tiled kernels' bound
        assert core.select_implementation(few, short, kv_layout="hsd") == "reference"
    with pytest.raises(ValueError, match=r"kv_layout \('bshd'\) must be one of \('shd', 'hsd'\)"):
        core.dot_product_attention(one, keys, keys, kv_layout="bshd")
