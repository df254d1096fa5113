"""Reduced-precision inference: the narrow-weight kernel (``kernels.native.narrow``) against a
float64 NumPy product at every x86-64 level this CPU runs, a bfloat16 ``GPTModel`` against torch's
own bfloat16 book model, and ``models.quantize(model, "int8")`` against the book's torch model
holding the dequantized weights (``conformance_tests/book_gpt.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import flax_attention as fa
from conformance_tests import book_gpt
from flax_attention import models
from flax_attention._layers import (
    FLOAT32_FEW_ROWS,
    FLOAT32_ROWS,
    NARROW_ROWS,
    TILE_BFLOAT16_ROWS,
    rows_dot_general,
)
from flax_attention.kernels.native import narrow
from flax_attention.models import quantized as quantized_module
from flax_attention.models.checkpoints import new_model
from flax_attention.models.quantized import Int8Embed, Int8Linear, Int8Weight, WeightScale

CFG = {
    "vocab_size": 97,
    "context_length": 24,
    "emb_dim": 48,
    "n_heads": 3,
    "n_layers": 2,
    "drop_rate": 0.0,
    "qkv_bias": True,
}

#: The model's logits, compiled once per model and shape (as served; op by op, each operation
#: would compile a program of its own).
_logits = nnx.jit(lambda model, ids: model(jnp.asarray(ids)))

needs_narrow = pytest.mark.skipif(not narrow.available(), reason=str(narrow.why_unavailable()))


def _error(got, reference) -> float:
    got, reference = np.asarray(got, np.float64), np.asarray(reference, np.float64)
    return float(np.abs(got - reference).max() / np.abs(reference).max())


@needs_narrow
@pytest.mark.parametrize("level", sorted(narrow.levels()))
def test_each_copy_of_the_kernel_equals_a_float64_product(level):
    """Rows 1..17 (register blocks of 1-8 rows, a second pass), features that are no multiple
    of any vector width (column tiles, single vectors, scalar tails), both layouts, float32,
    bfloat16 and int8 with scales; up to 8 rows of the ``130 x 509`` weight are split over the
    weight's rows (partial sums added after: it has ``k >= 64`` per thread of a 2-core pool and
    ``m k n >= 2^16`` from one row; one row of a bfloat16 ``(k, n)`` weight with AVX2 takes each
    pair of columns apart without a shuffle, in groups of 32 columns, the rest as before: 70
    and 509 columns). From 16 rows the weights are widened into float32 panels
    (blocks of 6 rows, then 5; a panel wider than the columns left; ``k = 300``: a second block
    of 256 weight rows added to the first). An ``(n, k)`` weight fills those panels transposed,
    in squares of the vector width and one weight at a time at the edges (``k`` and ``n`` no
    multiples of it); 257 rows: many blocks of rows per panel; 2053 rows: the whole weight
    widened into panels first, then blocks of 96 rows across all of them (the last block 37
    rows: 6 blocks of 6, then 1)."""
    rng = np.random.default_rng(level)
    worst = {}
    for rows in (1, 3, 8, 9, 17, 257, 2053):
        shapes = ((7, 5), (33, 70), (130, 509)) if rows < 257 else ((33, 70),)
        for k, n in shapes + (((300, 90),) if rows >= 17 else ()):
            x = rng.standard_normal((rows, k)).astype(np.float32)
            for dtype in ("float32", "bfloat16", "int8"):
                for nk in (False, True):
                    shape = (n, k) if nk else (k, n)
                    scale = None
                    if dtype == "int8":
                        w = rng.integers(-127, 128, shape).astype(np.int8)
                        scale = rng.random(n).astype(np.float32) + 0.5
                        dense = w * (scale[:, None] if nk else scale)
                    else:
                        w = rng.standard_normal(shape).astype(jnp.dtype(dtype))
                        dense = w.astype(np.float64)
                    got = narrow.matmul(jnp.asarray(x), jnp.asarray(w), scale, nk=nk, level=level)
                    want = x.astype(np.float64) @ (dense.T if nk else dense)
                    case = (rows, k, n, dtype, nk)
                    worst[case] = _error(got, want)
    # A scale applies to any weight dtype: one row of a bfloat16 weight, scaled after the sums
    # (k = 100: not split over the weight's rows, so the column loop scales).
    x = rng.standard_normal((1, 100)).astype(np.float32)
    w = rng.standard_normal((100, 509)).astype(jnp.bfloat16)
    scale = rng.random(509).astype(np.float32) + 0.5
    got = narrow.matmul(jnp.asarray(x), jnp.asarray(w), scale, level=level)
    worst["scaled"] = _error(got, x.astype(np.float64) @ w.astype(np.float64) * scale)
    bad = {case: err for case, err in worst.items() if err > 1e-5}
    assert not bad, f"level {level} ({narrow.levels()[level]}): {bad}"
    # From 2048 rows the whole weight is widened first: the same floats summed in the same
    # order as a panel a task, so a row's result does not depend on how many rows came with it.
    x = rng.standard_normal((2053, 300)).astype(np.float32)
    for dtype, shape in (("float32", (300, 90)), ("int8", (90, 300))):
        w = jnp.asarray(rng.standard_normal(shape) * 10).astype(dtype)
        scale = jnp.full((90,), 0.5, jnp.float32) if dtype == "int8" else None
        nk = dtype == "int8"
        whole = narrow.matmul(jnp.asarray(x), w, scale, nk=nk, level=level)
        panels = narrow.matmul(jnp.asarray(x[:2047]), w, scale, nk=nk, level=level)
        np.testing.assert_array_equal(np.asarray(whole)[:2047], np.asarray(panels), err_msg=dtype)


TRANSPOSED = (((1,), (1,)), ((), ()))  # x (m, k) against a weight (n, k)


@pytest.mark.parametrize("vectors", [16, 8], ids=["avx512", "avx2"])
@pytest.mark.parametrize("full_width", [True, False], ids=["widest-copy", "narrower-copy"])
def test_float32_products_run_on_the_kernel_at_many_rows_and_at_a_few_with_avx512(
    monkeypatch, full_width, vectors
):
    """A Linear's float32 product goes to the kernel from ``FLOAT32_ROWS`` rows where the
    kernel's copy runs the CPU's widest vectors (AVX-512 or AVX2; it beats XLA's dot there),
    and at 2 to ``FLOAT32_FEW_ROWS`` rows with a ``(k, n)`` weight where those are AVX-512's;
    else to XLA's (one row; a ``(n, k)`` weight; a one-arch AVX2 build on an AVX-512 CPU). The
    widths are faked (the copy that runs is this CPU's); either way the values are a float64
    product's within float32 rounding, and so are its gradient and its forward-mode derivative
    (XLA's products of the same operands)."""
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.standard_normal((40, 24)), jnp.float32)  # (k, n)
    numbers = (((1,), (0,)), ((), ()))
    kernel = narrow.available() and full_width
    monkeypatch.setattr(narrow, "width", lambda level=None: vectors)
    monkeypatch.setattr(narrow, "cpu_width", lambda: vectors if full_width else 2 * vectors)
    few = FLOAT32_FEW_ROWS
    for rows in (1, 2, few, few + 1, FLOAT32_ROWS - 1, FLOAT32_ROWS):
        x = jnp.asarray(rng.standard_normal((rows, 40)), jnp.float32)
        calls = str(jax.make_jaxpr(lambda x, w: rows_dot_general(x, w, numbers))(x, w))
        wanted = rows >= FLOAT32_ROWS or (vectors == 16 and 2 <= rows <= few)
        assert ("ffi_call" in calls) == (kernel and wanted), (rows, calls)
        # a (n, k) weight: XLA's below FLOAT32_ROWS
        calls = str(jax.make_jaxpr(lambda x, w: rows_dot_general(x, w.T, TRANSPOSED))(x, w))
        assert ("ffi_call" in calls) == (kernel and rows >= FLOAT32_ROWS), (rows, calls)
        got = rows_dot_general(x, w, numbers)
        assert _error(got, np.asarray(x, np.float64) @ np.asarray(w, np.float64)) < 1e-6
        g = jnp.asarray(rng.standard_normal((rows, 24)), jnp.float32)
        grads = jax.grad(lambda x, w, g=g: jnp.sum(rows_dot_general(x, w, numbers) * g), (0, 1))(
            x, w
        )
        x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
        for got, want in zip(grads, (g64 @ w64.T, x64.T @ g64), strict=True):
            assert _error(got, want) < 1e-6
        dx, dw = g[:, :1] * 0.5 + 1.0, jnp.ones_like(w)  # tangents: (rows, 1) broadcast, (k, n)
        dx = jnp.broadcast_to(dx, x.shape)
        _, tangent = jax.jvp(lambda x, w: rows_dot_general(x, w, numbers), (x, w), (dx, dw))
        want = np.asarray(dx, np.float64) @ w64 + x64 @ np.asarray(dw, np.float64)
        assert _error(tangent, want) < 1e-6


@pytest.mark.quick
@needs_narrow
def test_the_library_reads_the_cpu_as_linux_lists_its_flags():
    """``cpu_width``, ``slow_bfloat16_dot`` and ``tile_bfloat16``, which route the products, against
    ``/proc/cpuinfo`` on an x86-64 Linux CPU; elsewhere (nothing to compare with) only that the
    width is one the library can give and no narrower than the copy's."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split()) for line in f if line.startswith("flags")), set())
    except OSError:
        flags = set()
    if "sse2" not in flags:  # not x86-64, or no /proc/cpuinfo: only the answers' kinds
        assert narrow.cpu_width() in (0, 4, 8, 16)
        assert narrow.width() <= narrow.cpu_width() or narrow.cpu_width() == 0
        return
    v4 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= flags
    v3 = {"avx2", "fma", "bmi2", "movbe"} <= flags
    assert narrow.cpu_width() == (16 if v4 and v3 else 8 if v3 else 4)
    assert narrow.slow_bfloat16_dot() == (not flags & {"avx512_bf16", "amx_bf16"})
    assert narrow.tile_bfloat16() == ("amx_bf16" in flags)
    assert narrow.width() <= narrow.cpu_width()


@pytest.mark.quick
@needs_narrow
def test_bfloat16_products_run_on_the_kernel_at_any_rows_where_the_cpu_has_no_bfloat16_pairs(
    monkeypatch,
):
    """Where XLA multiplies bfloat16 pairs (AVX512_BF16), a bfloat16 product goes to the kernel
    up to ``NARROW_ROWS`` rows and to XLA's from there, up to ``TILE_BFLOAT16_ROWS`` where the
    CPU has AMX's bfloat16 tiles; on a CPU without pair products (AVX2) XLA's runs slower than
    the kernel's and the kernel takes every row count. Either way the result is the float32 sum
    of the bfloat16 products, rounded once."""
    rng = np.random.default_rng(6)
    w = jnp.asarray(rng.standard_normal((40, 24)), jnp.bfloat16)  # (k, n)
    numbers = (((1,), (0,)), ((), ()))
    few, tiles = NARROW_ROWS[jnp.dtype(jnp.bfloat16)], TILE_BFLOAT16_ROWS
    for slow, tile in ((False, False), (False, True), (True, False)):
        monkeypatch.setattr(narrow, "slow_bfloat16_dot", lambda slow=slow: slow)
        monkeypatch.setattr(narrow, "tile_bfloat16", lambda tile=tile: tile)
        for rows in (few, few + 1, tiles, tiles + 1, 40):
            x = jnp.asarray(rng.standard_normal((rows, 40)), jnp.bfloat16)
            calls = str(jax.make_jaxpr(lambda x, w: rows_dot_general(x, w, numbers))(x, w))
            wanted = slow or rows <= (tiles if tile else few)
            assert ("ffi_call" in calls) == wanted, (slow, tile, rows)
            got = rows_dot_general(x, w, numbers)
            want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
            assert got.dtype == jnp.bfloat16
            # rounded once to bfloat16: within half a bfloat16 step (2^-9 relative) of the sum,
            # a step where the float32 sum fell on the other side of a rounding boundary
            error = np.abs(np.asarray(got, np.float64) - want)
            assert (error <= 2**-8 * np.abs(want) + 1e-6).all(), (slow, rows, error.max())


@needs_narrow
def test_an_empty_product_is_zeros_of_its_shape_in_each_copy():
    """No rows, no columns or no contracted features: XLA's product gives zeros of ``(m, n)``,
    and so does every copy (``k = 0`` writes zeros; ``n = 0`` divided by zero once)."""
    for level in narrow.levels():
        for m, k, n, nk in ((3, 0, 5, False), (20, 0, 70, True), (3, 4, 0, False), (0, 4, 5, True)):
            w = jnp.ones((n, k) if nk else (k, n), jnp.int8)
            got = narrow.matmul(jnp.ones((m, k)), w, jnp.ones((n,)), nk=nk, level=level)
            np.testing.assert_array_equal(np.asarray(got), np.zeros((m, n), np.float32))


@pytest.mark.quick
@needs_narrow
def test_a_level_this_cpu_does_not_run_is_refused_by_name():
    with pytest.raises(ValueError, match=r"level \(7\) must be one this CPU runs"):
        narrow.matmul(jnp.ones((1, 4)), jnp.ones((4, 4)), level=7)


@pytest.fixture(scope="module")
def twin():
    torch.manual_seed(0)
    return book_gpt.GPTModel(CFG).eval()


def _weights(twin):
    return {key: value.detach().numpy().copy() for key, value in twin.state_dict().items()}


def _torch_logits(model, ids, dtype=torch.float32):
    with torch.no_grad():
        return model.to(dtype)(torch.from_numpy(np.asarray(ids, np.int64))).float().numpy()


IDS = np.random.default_rng(1).integers(0, CFG["vocab_size"], (2, 2))  # 4 rows: the kernel's
# 40 rows: the kernel's float32 panels for int8, and for bfloat16 where the CPU has no bfloat16
# pair products (else XLA's)
IDS_LONG = np.random.default_rng(2).integers(0, CFG["vocab_size"], (2, 20))


def test_bfloat16_logits_are_as_close_to_float32_as_torchs_bfloat16_model(twin):
    """The same weights in bfloat16: the Flax model's error against float32 torch within 1.5x
    of torch's own bfloat16 model's (decode-sized and prefill-sized batches), compiled as served
    (XLA may keep a fusion's intermediates in float32) and, decode-sized, op by op (each
    operation rounding to bfloat16); docs/conformance.md gives the measured ratios."""
    weights = _weights(twin)
    model = new_model(models.GPTModel, CFG, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    fa.load_state_dict(model, weights)
    assert IDS.size <= NARROW_ROWS[jnp.dtype(jnp.bfloat16)] < IDS_LONG.size
    assert NARROW_ROWS[jnp.dtype(jnp.int8)] is None  # every int8 product on the kernel
    for ids in (IDS, IDS_LONG):
        twin32 = book_gpt.GPTModel(CFG).eval()
        twin32.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
        reference = _torch_logits(twin32, ids)
        torch_bf16 = _error(_torch_logits(twin32, ids, torch.bfloat16), reference)
        flax_bf16 = _error(np.asarray(_logits(model, ids), np.float32), reference)
        assert flax_bf16 <= 1.5 * torch_bf16, (ids.shape, flax_bf16, torch_bf16)
        if ids is IDS:
            eager = _error(np.asarray(model(jnp.asarray(ids)), np.float32), reference)
            assert eager <= 1.5 * torch_bf16, (ids.shape, eager, torch_bf16)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_int8_logits_equal_the_books_model_with_the_dequantized_weights(twin, tied):
    cfg = dict(CFG, tie_word_embeddings=tied)
    torch.manual_seed(0)
    source = book_gpt.GPTModel(cfg).eval()
    if tied:
        source.out_head.weight = source.tok_emb.weight
    model = new_model(models.GPTModel, cfg)
    weights = _weights(source)
    if tied:
        weights.pop("out_head.weight")
    fa.load_state_dict(model, weights)
    quantized = models.quantize(model)
    kinds = {type(node) for _, node in nnx.iter_graph(quantized)}
    assert Int8Linear in kinds and (Int8Embed in kinds) == tied
    assert not any(isinstance(node, Int8Linear) for _, node in nnx.iter_graph(model))  # a copy
    dequantized = fa.state_dict(quantized)
    assert set(dequantized) == set(fa.state_dict(model))
    book = book_gpt.GPTModel(cfg).eval()
    book.load_state_dict({k: torch.from_numpy(v) for k, v in dequantized.items()})
    for ids in (IDS, IDS_LONG):
        got = np.asarray(_logits(quantized, ids))
        assert _error(got, _torch_logits(book, ids)) <= 1e-4, ids.shape
    # the int8 weights: a quarter of the float32 bytes, and quantizing again changes nothing
    int8 = sum(x.nbytes for x in jax.tree.leaves(nnx.state(quantized, Int8Weight)))
    unquantized = {"pos_emb.weight", "out_head.weight" if tied else "tok_emb.weight"}
    float32 = sum(
        v.nbytes
        for k, v in fa.state_dict(model).items()
        if v.ndim == 2 and k not in unquantized and not k.endswith(".mask")
    )
    assert int8 * 4 == float32
    # the scheme: each output feature's largest weight is +-127 steps of its scale, and every
    # weight is within half a step of the float one (round to nearest)
    original = fa.state_dict(model)
    for key, value in dequantized.items():
        if value.ndim != 2 or key in unquantized or key.endswith(".mask"):
            continue
        w = original[key].astype(np.float64)  # torch layout: (out, in), a row per feature
        step = np.abs(w).max(axis=1, keepdims=True) / 127
        np.testing.assert_allclose(np.abs(value).max(axis=1, keepdims=True), 127 * step, rtol=1e-6)
        assert (np.abs(value - w) <= step / 2 * (1 + 1e-5)).all(), key
    again = new_model(models.GPTModel, cfg)
    fa.load_state_dict(again, dequantized)
    again = models.quantize(again)
    for kind in (Int8Weight, WeightScale):
        for x, y in zip(
            jax.tree.leaves(nnx.state(quantized, kind)),
            jax.tree.leaves(nnx.state(again, kind)),
            strict=True,
        ):
            np.testing.assert_array_equal(x, y)


def test_int8_generation_equals_the_dequantized_models_and_on_xla_alike(twin, monkeypatch):
    model = new_model(models.GPTModel, CFG)
    fa.load_state_dict(model, _weights(twin))
    quantized = models.quantize(model)
    dense = new_model(models.GPTModel, CFG)
    fa.load_state_dict(dense, fa.state_dict(quantized))
    prompt = np.asarray(IDS, np.int32)
    tokens = np.asarray(models.generate(quantized, prompt, 6, CFG["context_length"]))
    np.testing.assert_array_equal(
        tokens, np.asarray(models.generate(dense, prompt, 6, CFG["context_length"]))
    )
    # Where the kernel is unavailable the products are XLA's, on the dequantized matrices: a
    # new prompt shape traces again without the kernel and gives the dense model's tokens.
    monkeypatch.setattr(narrow, "available", lambda: False)
    short = prompt[:, :5]
    np.testing.assert_array_equal(
        np.asarray(models.generate(quantized, short, 6, CFG["context_length"], prompt_bucket=1)),
        np.asarray(models.generate(dense, short, 6, CFG["context_length"], prompt_bucket=1)),
    )
    logits = np.asarray(_logits(quantized, IDS[:, :5]))
    assert _error(logits, np.asarray(_logits(dense, IDS[:, :5]))) <= 1e-5


def test_int8_layers_compute_in_float32_and_return_the_layers_dtype(twin, monkeypatch):
    """``Int8Linear`` on XLA's path (no kernel) against a float64 product of the dequantized
    weights, at float32's rounding (a bfloat16 dequantization is 2^-9 off); its output dtype
    is the layer's it replaces (``dtype``, else the input's and parameters' promotion) for
    every mix, and a quantized bfloat16 ``GPTModel`` gives bfloat16 logits as its float one,
    as close to the float32 logits as that model's."""
    monkeypatch.setattr(narrow, "available", lambda: False)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 48)).astype(np.float32)
    for dtype, param_dtype, x_dtype in (
        (None, jnp.float32, jnp.float32),
        (jnp.bfloat16, jnp.float32, jnp.float32),
        (jnp.float32, jnp.bfloat16, jnp.bfloat16),
        (None, jnp.bfloat16, jnp.float32),
        (None, jnp.bfloat16, jnp.bfloat16),
    ):
        linear = nnx.Linear(48, 70, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
        layer = Int8Linear(linear)
        got = layer(jnp.asarray(x, x_dtype))
        assert got.dtype == linear(jnp.asarray(x, x_dtype)).dtype, (dtype, param_dtype, x_dtype)
        if got.dtype == jnp.float32 and x_dtype == jnp.float32:
            scale = np.asarray(layer.scale[...], np.float64)[:, None]
            w = (np.asarray(layer.weight[...], np.float64) * scale).T  # (in, out)
            bias = np.asarray(layer.bias[...], np.float64)
            want = x.astype(np.float64) @ w + bias
            assert _error(got, want) <= 1e-6, (dtype, param_dtype)
    weights = _weights(twin)
    model = new_model(models.GPTModel, CFG, dtype=jnp.bfloat16)
    fa.load_state_dict(model, weights)
    quantized = models.quantize(model)
    ids = IDS[:, :5]
    logits, float_logits = _logits(quantized, ids), _logits(model, ids)
    assert logits.dtype == float_logits.dtype == jnp.bfloat16
    reference = _torch_logits(twin, ids)
    assert _error(logits, reference) <= 2 * _error(float_logits, reference)


def test_quantizing_the_dequantized_weights_gives_every_scale_back():
    """One feature per float32 mantissa (a binade; powers of two scale exactly), its largest
    weight that value: dequantized (``q * scale``, as ``state_dict`` exports) and quantized
    again, every scale and q come back bit for bit."""
    amax = (np.arange(2**23, dtype=np.uint32) | np.uint32(0x3F800000)).view(np.float32)
    w = np.stack([amax, -amax / 3], axis=1)  # (out 2^23, in 2): an Int8Linear's weight
    q, scale = (np.asarray(a) for a in quantized_module._quantize(w))
    dequantized = q.astype(np.float32) * scale[:, None]
    q_again, scale_again = (np.asarray(a) for a in quantized_module._quantize(dequantized))
    np.testing.assert_array_equal(scale_again, scale)
    np.testing.assert_array_equal(q_again, q)
    assert (q[:, 0] == 127).all()


def test_a_quantized_model_refuses_training_loading_and_a_second_quantization(twin):
    model = new_model(models.GPTModel, CFG)
    fa.load_state_dict(model, _weights(twin))
    quantized = models.quantize(model)
    ids = jnp.asarray(IDS)
    with pytest.raises(TypeError, match="quantized to int8 .* cannot be trained"):
        nnx.grad(lambda m: m(ids).sum())(quantized)
    held = nnx.Any(nnx.Param, Int8Weight, WeightScale)
    before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(quantized, held))]
    with pytest.raises(TypeError, match=r"module \(GPTModel\) holds int8 weights"):
        fa.load_state_dict(quantized, _weights(twin))
    after = [np.asarray(x) for x in jax.tree.leaves(nnx.state(quantized, held))]
    assert all(np.array_equal(x, y) for x, y in zip(before, after, strict=True))
    with pytest.raises(ValueError, match=r"scheme \('int4'\) must be one of \('int8',\)"):
        models.quantize(model, "int4")
    with pytest.raises(TypeError, match=r"scheme \(8\) must be one of \('int8',\) \(a str\)"):
        models.quantize(model, 8)
    with pytest.raises(TypeError, match=r"model \(Linear\) must be a flax_attention.models"):
        models.quantize(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="already quantized"):
        models.quantize(quantized)


@pytest.mark.quick
@needs_narrow
def test_vmap_over_few_rows_is_one_kernel_call_and_equals_each_elements_product():
    """``vmap`` over elements of 3 rows each (the kernel's, every CPU): one custom call on the
    stacked rows, no loop of calls; the values, per-element gradients and a mapped weight's
    products are float64's within float32 rounding of the bfloat16 weight's sums."""
    rng = np.random.default_rng(8)
    w = jnp.asarray(rng.standard_normal((40, 24)), jnp.bfloat16)  # (k, n)
    x = jnp.asarray(rng.standard_normal((5, 3, 40)), jnp.float32)  # 5 elements of 3 rows
    numbers = (((1,), (0,)), ((), ()))

    def one(x, w):
        return rows_dot_general(x, w, numbers, preferred_element_type=jnp.float32)

    jaxpr = str(jax.make_jaxpr(jax.vmap(one, (0, None)))(x, w))
    # one call whose result is the 15 stacked rows' (not a call per element, (5, 3, 24))
    assert jaxpr.count("ffi_call") == 1 and "f32[15,24] = ffi_call" in jaxpr, jaxpr
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    want = np.einsum("emk,kn->emn", x64, w64)
    assert _error(jax.jit(jax.vmap(one, (0, None)))(x, w), want) < 1e-5
    grads = jax.vmap(jax.grad(lambda x, w: jnp.sum(one(x, w) ** 2)), (0, None))(x, w)
    assert _error(grads, 2 * np.einsum("emn,kn->emk", want, w64)) < 1e-4
    ws = jnp.stack([w, -w])  # a weight per element
    got = jax.vmap(one)(x[:2], ws)
    assert _error(got, np.stack([want[0], -np.einsum("mk,kn->mn", x64[1], w64)])) < 1e-5
