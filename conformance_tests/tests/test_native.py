"""The native CPU kernel (``flax_attention.kernels.native``) equals ``reference``, gradients too.

Every case runs ``native_attention`` and ``dot_product_attention(implementation="reference")``
on the same inputs under ``jit(value_and_grad)`` and compares the output and the gradients of
``q``, ``k`` and ``v`` in float32 within ``ATOL``: causal and not, the caller's mask in every
broadcast form the layers produce, fully masked rows with ``-inf`` (NaN, as softmax) and
document 001's ``-1e10`` (uniform), query offsets (also traced), ``s != t``, odd and
tile-crossing lengths, head dims 16 to 256, bfloat16 inputs, ``vmap``, ``shard_map`` over heads,
and dropout inside the tiles against ``reference`` given the same keep-mask
(``dropout_hash.keep_mask``), also on a slice of the batch and heads told its global numbers
(what each device runs on a mesh: ``sharded_tests.py``). The whole module is skipped, with the
reason, where the kernel is not built; ``test_switched_off_says_why`` runs in a subprocess with
the kernel switched off.
"""

from __future__ import annotations

import functools
import itertools
import os
import platform
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_attention.core as core
from flax_attention.kernels import dropout_hash, native
from flax_attention.masking import AttentionMask

#: float32: both sides sum the same products in float32 in another order (errors seen: <= 2e-6).
ATOL = 1e-5

#: bfloat16: the kernel computes in float32 from the bf16 inputs and rounds once to bf16 at the
#: end, output and gradients alike: an error of at most half a unit in the last place, i.e.
#: ``2**-8 * |x|`` relative (bf16 keeps 8 significant bits), plus the float32 ``ATOL``.
BF16_RTOL = 2.0**-8

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_switched_off_says_why():
    """``FLAX_ATTENTION_NATIVE=0``: import works, ``available()`` is False with the reason, and
    a call raises that reason."""
    script = textwrap.dedent(
        """
        import jax.numpy as jnp
        import flax_attention
        from flax_attention.kernels import native
        print(native.available())
        print(native.why_unavailable())
        try:
            native.native_attention(*[jnp.ones((1, 2, 1, 16))] * 3)
        except RuntimeError as error:
            print(error)
        """
    )
    env = {**os.environ, "FLAX_ATTENTION_NATIVE": "0", "PYTHONPATH": ROOT}
    lines = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert lines[0] == "False"
    assert lines[1] == "switched off by the environment (FLAX_ATTENTION_NATIVE=0)"
    assert lines[2].endswith(
        "unavailable: switched off by the environment (FLAX_ATTENTION_NATIVE=0)"
    )


pytestmark_native = pytest.mark.skipif(
    not native.available(), reason=f"native kernel unavailable: {native.why_unavailable()}"
)


def _inputs(batch, t, s, h, d_k, d_v, mask_shape, seed=0, drop=0.3):
    """q, k, v, a cotangent, and a mask of ``mask_shape`` (``None``: no mask) with about
    ``drop`` of its entries False."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((*batch, t, h, d_k)).astype(np.float32)
    k = rng.standard_normal((*batch, s, h, d_k)).astype(np.float32)
    v = rng.standard_normal((*batch, s, h, d_v)).astype(np.float32)
    cotangent = rng.standard_normal((*batch, t, h, d_v)).astype(np.float32)
    mask = None if mask_shape is None else rng.random(mask_shape) > drop
    return q, k, v, cotangent, mask


def _run(fn, q, k, v, cotangent, *extra):
    def loss(q, k, v, *extra):
        out = fn(q, k, v, *extra)
        return (out.astype(jnp.float32) * cotangent).sum(), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v, *extra)
    return {"out": out, "d_query": grads[0], "d_key": grads[1], "d_value": grads[2]}


def _reference(mask, is_causal, offset, fill, dropout=None):
    def fn(q, k, v, *traced):
        return core.dot_product_attention(
            q,
            k,
            v,
            mask,
            is_causal=is_causal,
            query_offset=traced[0] if traced else offset,
            fill_value=fill,
            dropout=dropout,
            implementation="reference",
        )[0]

    return fn


def _native(mask, is_causal, offset, fill, **kwargs):
    def fn(q, k, v, *traced):
        attention_mask = AttentionMask.build(
            mask,
            is_causal=is_causal,
            query_offset=traced[0] if traced else offset,
            fill_value=fill,
            dtype=q.dtype,
        )
        return native.native_attention(q, k, v, attention_mask, **kwargs)

    return fn


_REFERENCE_RUNS: dict = {}


def _reference_run(key, mask, is_causal, offset, fill, q, k, v, cotangent) -> dict:
    """``_run`` of ``reference`` on these inputs, once per ``key`` in this process: the kernel
    configurations of one case (key tiles, ...) are compared with the same results."""
    if key not in _REFERENCE_RUNS:
        reference = _reference(mask, is_causal, offset, fill)
        _REFERENCE_RUNS[key] = _run(reference, q, k, v, cotangent)
    return _REFERENCE_RUNS[key]


def _assert_close(expected, actual, what, atol=ATOL, rtol=0.0):
    for name in expected:
        e = np.asarray(expected[name], np.float32)
        a = np.asarray(actual[name], np.float32)
        assert e.shape == a.shape, f"{what} {name}: shape {a.shape} != {e.shape}"
        nan = np.isnan(e)
        assert (np.isnan(a) == nan).all(), f"{what} {name}: NaN where reference has none"
        err = np.abs(a - e)[~nan]
        bound = (atol + rtol * np.abs(e))[~nan]
        worst = float(err.max()) if err.size else 0.0
        assert (err <= bound).all(), f"{what} {name}: max_abs_err {worst:.3e} > tol"


#: (name, batch, t, s, h, d_k, d_v, is_causal, mask shape, offset, fill, block_q)
CASES = [
    ("one_token", (2,), 1, 1, 2, 16, 16, True, None, 0, -np.inf, 0),
    ("odd_7_causal", (2,), 7, 7, 2, 16, 16, True, None, 0, -np.inf, 4),
    ("tiles_65_causal", (1,), 65, 65, 3, 64, 64, True, None, 0, -np.inf, 16),
    ("t300_d100", (1,), 300, 300, 2, 100, 100, False, None, 0, -np.inf, 0),
    ("t300_causal_tiles", (1,), 300, 300, 1, 64, 64, True, None, 0, -np.inf, 64),
    ("head_dim_256", (1,), 33, 33, 2, 256, 256, True, None, 0, -np.inf, 8),
    ("two_batch_axes", (2, 3), 9, 9, 2, 16, 16, True, None, 0, -np.inf, 4),
    ("cross_7_11", (2,), 7, 11, 2, 16, 16, False, None, 0, -np.inf, 4),
    ("v_dim_differs", (2,), 6, 10, 2, 16, 24, False, None, 0, -np.inf, 0),
    ("decode_offset", (2,), 3, 16, 2, 16, 16, True, None, 5, -np.inf, 0),
    ("decode_one_token", (2,), 1, 16, 2, 16, 16, True, None, 9, -np.inf, 0),
    # the caller's mask in the broadcast forms of the layers, document 001's fill
    ("mask_ts", (2,), 7, 11, 2, 16, 16, False, (7, 11), 0, -1e10, 4),
    ("mask_b11s_padding", (2,), 7, 11, 2, 16, 16, False, (2, 1, 1, 11), 0, -1e10, 4),
    ("mask_h1s", (2,), 7, 11, 2, 16, 16, False, (2, 1, 11), 0, -1e10, 4),
    ("mask_bhts", (2,), 65, 65, 2, 16, 16, False, (2, 2, 65, 65), 0, -1e10, 16),
    ("mask_b1t1_rows", (2,), 7, 7, 2, 16, 16, False, (2, 1, 7, 1), 0, -1e10, 4),
    # a key-broadcast mask over several key tiles (block_k=8): each tile reads it at key 0
    ("mask_b1t1_rows_40_keys", (2,), 7, 40, 2, 16, 16, False, (2, 1, 7, 1), 0, -1e10, 4),
    ("mask_bhts_causal", (2,), 65, 65, 2, 16, 16, True, (2, 2, 65, 65), 0, -1e10, 16),
    ("mask_bhts_causal_inf", (2,), 65, 65, 2, 16, 16, True, (2, 2, 65, 65), 0, -np.inf, 16),
    ("mask_offset", (2,), 5, 16, 2, 16, 16, True, (2, 1, 5, 16), 7, -1e10, 4),
]


@pytestmark_native
@pytest.mark.parametrize("block_k", [0, 8], ids=["keys_default", "keys_in_8s"])
@pytest.mark.parametrize(
    (
        "name",
        "batch",
        "t",
        "s",
        "h",
        "d_k",
        "d_v",
        "is_causal",
        "mask_shape",
        "offset",
        "fill",
        "block_q",
    ),
    CASES,
    ids=[c[0] for c in CASES],
)
def test_native_equals_reference(
    name, batch, t, s, h, d_k, d_v, is_causal, mask_shape, offset, fill, block_q, block_k
):
    """Forward and gradients equal ``reference``; ``block_k=8`` runs the forward's online softmax
    over key tiles of 8 (the default tile holds these rows whole)."""
    q, k, v, cotangent, mask = _inputs(batch, t, s, h, d_k, d_v, mask_shape)
    if mask is not None and fill == -np.inf:
        mask[..., 0] = True  # every row keeps a key: no NaN row here (tested below)
    expected = _reference_run(name, mask, is_causal, offset, fill, q, k, v, cotangent)
    kernel = _native(mask, is_causal, offset, fill, block_q=block_q, block_k=block_k)
    actual = _run(kernel, q, k, v, cotangent)
    assert np.isfinite(np.asarray(expected["out"])).all(), f"{name}: reference must be finite"
    _assert_close(expected, actual, name)


def _widest_vectors() -> int:
    """Floats per vector of the widest x86-64 level this CPU runs: 16 (x86-64-v4, AVX-512), 8
    (x86-64-v3, AVX2 and FMA), 4 (baseline, and other machines)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = set(next(line for line in cpuinfo if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return 4
    if platform.machine() != "x86_64":
        return 4
    if {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= flags:
        return 16
    return 8 if {"avx2", "fma", "bmi2"} <= flags else 4


@pytest.mark.quick
@pytestmark_native
def test_products_follow_the_cpu():
    """The portable library's micro-kernel copy is the widest this CPU runs (a one-arch build's
    is its -march's, no wider than the CPU); by default the tiles' products run on the
    micro-kernel exactly where that copy has 16-float vectors (AVX-512), on the BLAS elsewhere;
    ``native_attention(..., products=)`` chooses either for a call (the tests below), and
    nothing else does: no environment variable is read."""
    width = native._micro_width()
    if native._per_cpu_copies():
        assert width == _widest_vectors()
    assert width in (16, 8, 4) and width <= _widest_vectors()
    assert native.products() == ("micro" if width == 16 else "blas")
    q = jnp.zeros((1, 4, 1, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"products \('sgemm'\) must be one of \(None, 'blas'"):
        native.native_attention(q, q, q, products="sgemm")
    # The keyword reaches the kernel: the two sum in different orders, so some last bits differ,
    # and the default is what products() names.
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 70, 2, 64)), jnp.float32) for _ in "qkv")
    causal = AttentionMask(is_causal=True)
    outs = {
        p: np.asarray(native.native_attention(q, k, v, causal, products=p))
        for p in (None, "blas", "micro")
    }
    assert not np.array_equal(outs["blas"], outs["micro"])
    np.testing.assert_array_equal(outs[None], outs[native.products()])


#: The micro-kernel's own cases, run with ``products="micro"`` so that every
#: CPU runs it (by default only AVX-512 ones do): (name, batch, t, s, h, d_k, d_v, is_causal,
#: mask shape, offset, fill, [(block_q, block_k), ...]). Its blocks are 6 rows x 64 columns, so:
#: - ``tails_causal``: every product meets row blocks that leave 1 to 5 rows (the query tiles'
#:   19, 20, 22 rows and their last 8, 5, 21; the key tiles' lengths for dV and dK), and the
#:   scores' padded rows 16 to 80 floats long leave 16, 32 and 48 columns after their blocks
#:   of 64, as d_k = 48 and d_v = 32 do; with key tiles of 16 the backward adds each tile's dK
#:   and dV into rows j0 on, with d_k != d_v (a stride or offset of the other would show).
#: - ``wide_cross``: d_k = 80 (a block of 64 and 16 columns) against d_v = 16, 70 keys
#:   (rows of 80 floats) for 13 queries, the caller's mask with document 001's fill.
MICRO_CASES = [
    ("tails_causal", (1,), 65, 65, 2, 48, 32, True, None, 0, -np.inf, [(19, 0), (20, 16), (22, 0)]),
    ("wide_cross", (2,), 13, 70, 2, 80, 16, False, (2, 1, 13, 70), 0, -1e10, [(0, 0), (5, 32)]),
]


@pytestmark_native
@pytest.mark.parametrize("case", MICRO_CASES, ids=[c[0] for c in MICRO_CASES])
def test_micro_kernel_equals_reference(case):
    """``products="micro"``: the micro-kernel's copy for this CPU (AVX-512,
    AVX2 or baseline vectors, the same blocking) runs every product, forward and gradients equal
    to ``reference`` for each tiling."""
    name, batch, t, s, h, d_k, d_v, is_causal, mask_shape, offset, fill, tilings = case
    if native._micro_width() == 0:
        pytest.skip("the library has no micro-kernel (a compiler without vector shuffles)")
    q, k, v, cotangent, mask = _inputs(batch, t, s, h, d_k, d_v, mask_shape)
    expected = _reference_run(("micro", name), mask, is_causal, offset, fill, q, k, v, cotangent)
    assert np.isfinite(np.asarray(expected["out"])).all(), f"{name}: reference must be finite"
    for block_q, block_k in tilings:
        kernel = _native(
            mask, is_causal, offset, fill, block_q=block_q, block_k=block_k, products="micro"
        )
        what = f"{name} on the micro-kernel, block_q {block_q}, block_k {block_k}"
        _assert_close(expected, _run(kernel, q, k, v, cotangent), what)


def _micro_gemm_at(width, a, b, c, *, trans_a, alpha, accumulate):
    """``c = alpha op(a) b (+ c)`` on the library's copy of the products with ``width`` floats per
    vector (``op(a)`` is ``a.T`` when ``trans_a``: the kernel's ``dS^T`` form, read with strides);
    False where that copy is not here."""
    import ctypes

    floats = ctypes.POINTER(ctypes.c_float)
    function = native._LIBRARY[0].FlaxAttentionMicroGemmAt
    function.restype = ctypes.c_int
    i64 = ctypes.c_int64
    m, k_len = (a.shape[1], a.shape[0]) if trans_a else a.shape
    am, ak = (1, a.shape[1]) if trans_a else (a.shape[1], 1)
    return bool(
        function(
            ctypes.c_int(width), i64(m), i64(b.shape[1]), i64(k_len),
            a.ctypes.data_as(floats), i64(am), i64(ak), b.ctypes.data_as(floats),
            i64(b.shape[1]), c.ctypes.data_as(floats), i64(c.shape[1]),
            ctypes.c_float(alpha), ctypes.c_int(int(accumulate)),
        )
    )  # fmt: skip


@pytest.mark.quick
@pytestmark_native
def test_every_copy_of_the_micro_kernel_multiplies_right():
    """Each copy of the products this CPU runs (16-float vectors with AVX-512, 8 with AVX2, 4
    everywhere), called by its width: the loader runs only the widest, so without this an AVX-512
    machine never runs the 8-float copy's 6 x 16 blocks. Rows leaving 0 to 5 in the last block of
    6, columns of 16 to 80 (every tail of 64), strided and transposed ``A``, accumulation into
    ``C``: all equal to NumPy's product."""
    if native._micro_width() == 0:
        pytest.skip("the library has no micro-kernel (a compiler without vector shuffles)")
    rng = np.random.default_rng(7)
    ran = []
    for width in (16, 8, 4):
        for m, n, k_len, trans_a, accumulate in itertools.product(
            (1, 5, 6, 13), (16, 48, 80), (3, 64), (False, True), (False, True)
        ):
            a = rng.standard_normal((k_len, m) if trans_a else (m, k_len)).astype(np.float32)
            b = rng.standard_normal((k_len, n)).astype(np.float32)
            c = rng.standard_normal((m, n)).astype(np.float32)
            expected = 0.5 * ((a.T if trans_a else a).astype(np.float64) @ b)
            expected += c if accumulate else 0
            if not _micro_gemm_at(
                width, a, b, c, trans_a=trans_a, alpha=0.5, accumulate=accumulate
            ):
                break  # this CPU does not run the copy
            np.testing.assert_allclose(
                c, expected, rtol=1e-5, atol=1e-4,
                err_msg=f"{width}-float copy, m {m} n {n} k {k_len} trans_a {trans_a}",
            )  # fmt: skip
        else:
            ran.append(width)
    assert native._micro_width() in ran, (ran, native._micro_width())
    assert 4 in ran or not native._per_cpu_copies(), ran


#: Cases whose head dims are multiples of 16 (the micro-kernel's, by default where the CPU has
#: AVX-512), run again on the BLAS's products: both ways equal ``reference``.
BLAS_CASES = ["tiles_65_causal", "head_dim_256", "cross_7_11", "mask_bhts_causal"]


@pytestmark_native
@pytest.mark.parametrize("name", BLAS_CASES)
def test_blas_products_equal_reference(name):
    """``products="blas"``: scipy-openblas32's sgemm for
    every product, forward and gradients equal to ``reference``, over key tiles of 8 too."""
    case = next(c for c in CASES if c[0] == name)
    _, batch, t, s, h, d_k, d_v, is_causal, mask_shape, offset, fill, block_q = case
    q, k, v, cotangent, mask = _inputs(batch, t, s, h, d_k, d_v, mask_shape)
    expected = _reference_run(name, mask, is_causal, offset, fill, q, k, v, cotangent)
    for block_k in (0, 8):
        kernel = _native(
            mask, is_causal, offset, fill, block_q=block_q, block_k=block_k, products="blas"
        )
        _assert_close(expected, _run(kernel, q, k, v, cotangent), f"{name} on the BLAS")


@pytestmark_native
@pytest.mark.parametrize("block_k", [0, 2], ids=["keys_default", "keys_in_2s"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("fill", [-np.inf, -1e10], ids=["inf", "1e10"])
def test_fully_masked_row(is_causal, fill, block_k):
    """Row 2 masked entirely: ``-1e10`` gives the uniform row over the causally visible keys
    (equal to ``reference``, gradients too); ``-inf`` gives NaN in that row only, as softmax."""
    q, k, v, cotangent, _ = _inputs((2,), 7, 7, 2, 16, 16, None)
    mask = np.ones((1, 1, 7, 7), bool)
    mask[..., 2, :] = False
    key = ("fully_masked_row", is_causal, fill)
    expected = _reference_run(key, mask, is_causal, 0, fill, q, k, v, cotangent)
    actual = _run(_native(mask, is_causal, 0, fill, block_q=4, block_k=block_k), q, k, v, cotangent)
    if fill == -np.inf:
        out = np.asarray(actual["out"])
        assert np.isnan(out[:, 2]).all() and np.isfinite(np.delete(out, 2, axis=1)).all()
        _assert_close({"out": expected["out"]}, {"out": actual["out"]}, "fully masked -inf")
    else:
        _assert_close(expected, actual, "fully masked -1e10")
        if is_causal:  # row 2 sees keys 0..2 at -1e10: their mean
            np.testing.assert_allclose(np.asarray(actual["out"])[:, 2], v[:, :3].mean(1), atol=ATOL)


@pytestmark_native
@pytest.mark.parametrize(
    ("is_causal", "offset"), [(False, 0), (True, 20)], ids=["full", "causal_offset_20"]
)
@pytest.mark.parametrize("fill", [-np.inf, -1e10], ids=["inf", "1e10"])
def test_rows_whose_first_key_tiles_are_all_masked(fill, is_causal, offset):
    """The online softmax starts on tiles with nothing the caller keeps (max -inf, or -1e10 for
    every key) and meets its keys in a later tile: rescaled from there, equal to ``reference``,
    gradients too. 20 queries, 40 keys in tiles of 8; rows keep keys 17-35, every third row
    only keys 17-19 (causal at offset 20: every row sees keys 0-20 at least)."""
    q, k, v, cotangent, _ = _inputs((2,), 20, 40, 2, 16, 16, None)
    mask = np.zeros((2, 1, 20, 40), bool)
    mask[..., 17:36] = True
    mask[..., ::3, 20:] = False
    expected = _run(_reference(mask, is_causal, offset, fill), q, k, v, cotangent)
    kernel = _native(mask, is_causal, offset, fill, block_q=4, block_k=8)
    actual = _run(kernel, q, k, v, cotangent)
    assert np.isfinite(np.asarray(expected["out"])).all()  # every row keeps a key it sees
    _assert_close(expected, actual, f"first tiles masked, fill {fill}")


@pytestmark_native
def test_traced_offset():
    """A decode chunk's ``query_offset`` is a traced int32 under ``jit``."""
    q, k, v, cotangent, _ = _inputs((2,), 3, 16, 2, 16, 16, None)
    offset = jnp.asarray(6, jnp.int32)
    expected = _run(_reference(None, True, None, -np.inf), q, k, v, cotangent, offset)
    actual = _run(_native(None, True, None, -np.inf), q, k, v, cotangent, offset)
    _assert_close(expected, actual, "traced offset")


@pytestmark_native
def test_bfloat16_inputs():
    """bf16 in and out, float32 inside: within one bf16 rounding of the float32 reference on
    the same (bf16-rounded) inputs."""
    q, k, v, cotangent, _ = _inputs((2,), 65, 65, 2, 64, 64, None)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    # The bf16 output's cotangent reaches the kernel rounded to bf16: give reference the same.
    cotangent = np.asarray(jnp.asarray(cotangent, jnp.bfloat16).astype(jnp.float32))
    expected = _run(
        _reference(None, True, 0, -np.inf), *(x.astype(jnp.float32) for x in (q, k, v)), cotangent
    )
    actual = _run(_native(None, True, 0, -np.inf, block_q=16), q, k, v, cotangent)
    assert all(actual[n].dtype == jnp.bfloat16 for n in actual)
    _assert_close(expected, actual, "bf16", rtol=BF16_RTOL)


@pytest.mark.quick
@pytestmark_native
def test_vmap_equals_batch():
    """``vmap`` over a leading axis (each mapped element runs the kernel) equals one call on the
    stacked batch, forward and gradients."""
    q, k, v, cotangent, _ = _inputs((3, 2), 9, 9, 2, 16, 16, None)
    fn = _native(None, True, 0, -np.inf, block_q=4)
    expected = _run(fn, q, k, v, cotangent)
    actual = _run(jax.vmap(fn), q, k, v, cotangent)
    _assert_close(expected, actual, "vmap")


@pytestmark_native
@pytest.mark.parametrize("block_k", [0, 16], ids=["keys_default", "keys_in_16s"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_dropout_equals_reference_with_the_same_mask(is_causal, block_k):
    """Dropout inside the tiles equals ``reference`` whose dropout applies
    ``dropout_hash.keep_mask`` (scaled by ``1 / (1 - rate)``), gradients too."""
    rate, seed = 0.3, 1234
    q, k, v, cotangent, mask = _inputs((2,), 65, 40, 2, 16, 16, (2, 1, 1, 40))
    keep = dropout_hash.keep_mask(seed, (2, 2, 65, 40), rate)  # (b, h, t, s)

    def dropout(weights):
        return jnp.where(keep, weights / (1 - rate), 0.0)

    expected = _run(_reference(mask, is_causal, 0, -1e10, dropout), q, k, v, cotangent)
    actual = _run(
        _native(
            mask,
            is_causal,
            0,
            -1e10,
            dropout_rate=rate,
            dropout_seed=seed,
            block_q=16,
            block_k=block_k,
        ),
        q,
        k,
        v,
        cotangent,
    )
    _assert_close(expected, actual, "dropout")
    clean = _run(_native(mask, is_causal, 0, -1e10, block_q=16), q, k, v, cotangent)
    assert float(jnp.abs(clean["out"] - actual["out"]).max()) > 0.1  # dropout changed it


@pytestmark_native
def test_dropout_hashes_the_batch_and_head_numbers_it_is_given():
    """What a device on a mesh runs: the kernel on a slice of the batch and heads, told their
    global numbers (``batch_index``, ``head_index``), drops the slice of the whole call's
    keep-mask. Read back through zero queries (uniform weights) and one-hot values: the output
    is ``keep / ((1 - rate) s)``."""
    b, t, h, rate, seed = 4, 8, 6, 0.4, 99
    config = native._Config(
        False, False, -np.inf, dropout_hash.threshold(rate), 1 / (1 - rate), 0, 0
    )
    q = jnp.zeros((2, t, 3, 4), jnp.float32)  # batch rows 2, 3; heads 3, 4, 5
    v = jnp.broadcast_to(jnp.eye(t, dtype=jnp.float32)[None, :, None, :], (2, t, 3, t))
    ids = jnp.arange(2, 4, dtype=jnp.uint32), jnp.arange(3, 6, dtype=jnp.uint32)
    mask, offset, seed_ = jnp.ones((1, 1, 1, 1), bool), jnp.int32(0), jnp.uint32(seed)
    out = native._native(config, q, q, v, mask, offset, seed_, *ids) * ((1 - rate) * t)
    whole = np.asarray(dropout_hash.keep_mask(seed, (b, h, t, t), rate))[2:4, 3:6]
    np.testing.assert_allclose(np.asarray(out), whole.transpose(0, 2, 1, 3), atol=1e-6)
    local = np.asarray(dropout_hash.keep_mask(seed, (2, 3, t, t), rate))
    assert (local != whole).any()  # numbering the slice from 0 would drop other weights


def test_dropout_hash_keeps_one_minus_rate():
    """The hash's keep-mask keeps ``1 - rate`` of the weights, independently of the position
    (per query row and per key column), and a seed changes it."""
    keep = np.asarray(dropout_hash.keep_mask(7, (2, 3, 256, 256), 0.1))
    assert abs(keep.mean() - 0.9) < 0.005
    assert np.abs(keep.mean(axis=(0, 1, 3)) - 0.9).max() < 0.05  # per query
    assert np.abs(keep.mean(axis=(0, 1, 2)) - 0.9).max() < 0.05  # per key
    other = np.asarray(dropout_hash.keep_mask(8, (2, 3, 256, 256), 0.1))
    assert 0.15 < (keep != other).mean() < 0.2  # about 2 * 0.1 * 0.9 differ
    assert np.asarray(dropout_hash.keep_mask(7, (1, 1, 4, 4), 0.0)).all()
    with pytest.raises(ValueError, match=r"dropout rate \(1.0\) must be in \[0, 1\)"):
        dropout_hash.threshold(1.0)


@pytest.mark.quick
@pytestmark_native
def test_bad_inputs_name_the_argument():
    x = jnp.ones((1, 4, 1, 16), jnp.float16)
    with pytest.raises(TypeError, match=r"queries.dtype \(float16\) must be float32 or bfloat16"):
        native.native_attention(x, x, x)
    y = jnp.ones((1, 4, 1, 16))
    with pytest.raises(ValueError, match=r"dropout_seed \(None\) must be given"):
        native.native_attention(y, y, y, dropout_rate=0.1)
    with pytest.raises(ValueError, match=r"block_q \(2048\) must be from 0 to 1024"):
        native.native_attention(y, y, y, block_q=2048)
    with pytest.raises(ValueError, match=r"block_k \(-1\) must be 0 or more"):
        native.native_attention(y, y, y, block_k=-1)
    with pytest.raises(TypeError, match=r"block_k \(8.0\) must be an int"):
        native.native_attention(y, y, y, block_k=8.0)


@pytestmark_native
def test_shard_map_over_heads():
    """Two CPU devices, the heads split between them with ``shard_map``: each shard runs the
    kernel on its heads; the result equals the unsharded call."""
    script = textwrap.dedent(
        """
        import numpy as np, jax, jax.numpy as jnp
        from jax.sharding import Mesh, PartitionSpec as P
        from flax_attention.kernels import native
        from flax_attention.masking import AttentionMask
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.standard_normal((2, 33, 4, 16)), jnp.float32) for _ in "qkv")
        mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
        spec = P(None, None, "model", None)
        def attend(q, k, v):
            return native.native_attention(q, k, v, AttentionMask(is_causal=True))
        sharded = jax.jit(jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
        out = sharded(q, k, v)
        print(len(jax.devices()), float(jnp.abs(out - attend(q, k, v)).max()))
        """
    )
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "PYTHONPATH": ROOT,
    }
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    devices, err = result.stdout.split()
    assert devices == "2" and float(err) == 0.0


@pytest.mark.quick
@pytestmark_native
def test_the_library_records_the_jaxlib_whose_ffi_it_was_built_for():
    """The loader compares this with the running jaxlib before registering: a library built
    for another FFI API version would otherwise break the whole CPU backend."""
    import ctypes
    import importlib.metadata

    (library,) = sorted(native._HERE.glob("_attention*.so"))[-1:]
    assert native._built_with(ctypes.CDLL(str(library))) == importlib.metadata.version("jaxlib")


@pytestmark_native
def test_grouped_heads_and_a_window_on_both_products():
    """Grouped key heads (4 query heads over 2) and a sliding window of 5 on the BLAS's and the
    micro-kernel's products (its keys transposed per key head), tiles that cross the window's
    edge and skip the tiles before it: forward and gradients equal ``reference``."""
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((2, 37, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 37, 2, 16)), jnp.float32) for _ in "kv")
    cotangent = jnp.asarray(rng.standard_normal((2, 37, 4, 16)), jnp.float32)
    mask = AttentionMask(is_causal=True, window=5)

    def grads(attend):
        def loss(q, k, v):
            out = attend(q, k, v)
            return (out * cotangent).sum(), out

        (_, out), (dq, dk, dv) = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
        return {"out": out, "dq": dq, "dk": dk, "dv": dv}

    expected = grads(
        lambda q, k, v: core.dot_product_attention(q, k, v, is_causal=True, window=5)[0]
    )
    products = ["blas", *(["micro"] if native._micro_width() else [])]
    for name, (block_q, block_k) in itertools.product(products, [(0, 0), (8, 16)]):
        tiles = {"block_q": block_q, "block_k": block_k, "products": name}
        actual = grads(functools.partial(native.native_attention, attention_mask=mask, **tiles))
        _assert_close(expected, actual, f"{name}, block_q {block_q}, block_k {block_k}")
