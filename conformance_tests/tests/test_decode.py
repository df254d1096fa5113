"""The decode cache: prefill + decode steps equal the full causal pass, for every cached layer and
implementation, under jit, without retracing; overflow and a missing cache fail loudly; the
generation loop; ``MultiHeadedAttention``'s projected memory; the encoder-decoder's decoder on the
same cache (its overflow guard included).

Flax's own ``MultiHeadAttention`` attends only to position 0 when decoding with a causal mask
(flax issue 5591) and Linen's cache takes one token per call (flax issue 1317): here a chunk of
``n >= 1`` tokens at any position gives the full pass's rows.
"""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_attention as fa
from flax_attention import _layers
from flax_attention import cache as decode_cache
from flax_attention.kernels.native import cache_write, table_rows
from flax_attention.models import annotated

#: The cached layers at small sizes: (class, positional args), d_in = 8, context_length 16.
LAYERS = {
    "causal": (fa.CausalAttention, (8, 8, 16, 0.0, True)),
    "wrapper": (fa.MultiHeadAttentionWrapper, (8, 4, 16, 0.0, 2, True)),
    "mha": (fa.MultiHeadAttention, (8, 8, 16, 0.0, 2, True)),
}
DECODE_ATOL = 1e-5
#: ``blocked``'s tiles: the cache's 16 slots cross 4 key tiles.
SMALL_TILES = fa.BlockSizes(4, 4)


def _layer(name, implementation=None):
    cls, args = LAYERS[name]
    layer = cls(*args, implementation=implementation, block_sizes=SMALL_TILES, rngs=nnx.Rngs(0))
    layer.eval()
    return layer


def _x(batch, num_tokens, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((batch, num_tokens, 8)), jnp.float32)


def _max_diff(a, b):
    return float(jnp.abs(a - b).max())


@pytest.mark.parametrize("implementation", [None, "reference", "xla", "blocked"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_prefill_and_steps_equal_the_full_pass_under_jit(name, implementation):
    layer = _layer(name, implementation)
    x = _x(2, 13)
    with jax.default_matmul_precision("highest"):
        full = layer(x)  # (2, 13, d)
        layer.init_cache(2)
        traces = []

        @nnx.jit
        def step(layer, x):
            traces.append(x.shape)  # runs only while tracing
            return layer(x, decode=True)

        chunks = [step(layer, x[:, :5])]  # a 5-token prompt
        chunks += [step(layer, x[:, i : i + 1]) for i in range(5, 13)]  # then one token a step
    decoded = jnp.concatenate(chunks, axis=1)
    diff = _max_diff(decoded, full)
    assert diff <= DECODE_ATOL, f"{name}/{implementation}: decode vs full pass {diff:.2e}"
    assert traces == [(2, 5, 8), (2, 1, 8)], f"{name}: retraced {traces}"
    caches = [layer] if name != "wrapper" else list(layer.heads)
    assert all(int(c.cache_index[...]) == 13 for c in caches)


@pytest.mark.parametrize("name", list(LAYERS))
def test_chunks_of_any_size_equal_the_full_pass(name):
    layer = _layer(name)
    x = _x(3, 16, seed=1)
    with jax.default_matmul_precision("highest"):
        full = layer(x)
        layer.init_cache(3)
        chunks = [layer(x[:, a:b], decode=True) for a, b in ((0, 1), (1, 7), (7, 9), (9, 16))]
    diff = _max_diff(jnp.concatenate(chunks, axis=1), full)
    assert diff <= DECODE_ATOL, f"{name}: chunked decode vs full pass {diff:.2e}"


def test_cache_holds_the_projected_keys_and_values_in_order():
    layer = _layer("mha", "reference")
    x = _x(1, 6, seed=2)
    layer.init_cache(1, max_length=10)
    layer(x[:, :4], decode=True)
    layer(x[:, 4:6], decode=True)
    keys = jnp.swapaxes(layer.W_key(x).reshape(1, 6, 2, 4), 1, 2)  # (b, h, t, d): heads first
    np.testing.assert_allclose(
        np.asarray(layer.cached_key[...][:, :, :6]), np.asarray(keys), atol=1e-6
    )
    assert float(jnp.abs(layer.cached_key[...][:, :, 6:]).max()) == 0.0  # untouched slots
    assert layer.cached_key.shape == (1, 2, 10, 4) and int(layer.cache_index[...]) == 6


def _transposes_of_size(hlo: str, size: int) -> list[str]:
    """The ``transpose`` instructions of compiled HLO text whose result has ``size`` elements."""
    found = []
    for line in hlo.splitlines():
        match = re.search(r"= \w+\[([\d,]+)\]\S* transpose\(", line)
        if match and np.prod([int(n) for n in match.group(1).split(",")]) == size:
            found.append(line.strip())
    return found


def test_a_decode_step_reads_the_cache_without_copying_it():
    """The cache is stored heads first, ``(b, h, max_length, d)``, the order XLA's CPU dot takes
    its batch axes in: the compiled decode step of ``MultiHeadAttention`` transposes nothing of
    the cache's size. The control: one query against keys and values laid out
    ``(b, max_length, h, d)``, as the cache was stored before, transposes both on every call
    (about half the b8 decode time). (With a batch axis of size 1, a batch of 1 or a single
    head, XLA still transposes the keys, not the values: its choice for a degenerate batch
    axis.)"""
    b, h, s, d = 3, 2, 16, 4
    layer = _layer("mha")
    layer.init_cache(b, max_length=s)
    graphdef, state = nnx.split(layer)
    step = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x, decode=True))
    hlo = step.lower(state, _x(b, 1)).compile().as_text()
    assert not _transposes_of_size(hlo, b * h * s * d), _transposes_of_size(hlo, b * h * s * d)

    def one_query(q, k, v, kv_layout):
        return fa.dot_product_attention(
            q, k, v, is_causal=True, query_offset=s - 1, need_weights=False, kv_layout=kv_layout
        )[0]

    q, kv = jnp.ones((b, 1, h, d)), jnp.ones((b, s, h, d))
    old = jax.jit(one_query, static_argnums=3).lower(q, kv, kv, "shd").compile().as_text()
    assert len(_transposes_of_size(old, b * h * s * d)) == 2, "the control must transpose k, v"
    kv = jnp.swapaxes(kv, 1, 2)  # (b, h, s, d)
    new = jax.jit(one_query, static_argnums=3).lower(q, kv, kv, "hsd").compile().as_text()
    assert not _transposes_of_size(new, b * h * s * d)


def test_decode_without_a_cache_and_past_its_end_raise_outside_jit():
    layer = _layer("mha")
    with pytest.raises(ValueError, match=r"decode \(True\) needs a decode cache"):
        layer(_x(1, 2), decode=True)
    layer.init_cache(1, max_length=4)
    layer(_x(1, 3), decode=True)
    before = np.asarray(layer.cached_key[...])
    with pytest.raises(ValueError, match=r"cache_index \+ num_tokens \(3 \+ 2\) must not exceed"):
        layer(_x(1, 2), decode=True)
    np.testing.assert_array_equal(np.asarray(layer.cached_key[...]), before)  # untouched
    with pytest.raises(ValueError, match=r"batch shape \(\(2,\)\) must equal the cache's"):
        layer(_x(2, 1), decode=True)


def test_overflow_inside_jit_returns_nan_and_leaves_the_cache_alone():
    """Under jit the index is not known: no silent overwrite, the output is NaN instead."""
    layer = _layer("mha")
    layer.init_cache(1, max_length=4)
    step = nnx.jit(lambda layer, x: layer(x, decode=True))
    ok = step(layer, _x(1, 3))
    assert bool(jnp.isfinite(ok).all())
    before = np.asarray(layer.cached_value[...])
    bad = step(layer, _x(1, 3, seed=5))
    assert bool(jnp.isnan(bad).all()), "an overflowing step must not return numbers"
    with pytest.raises(
        ValueError, match=r"num_tokens \(5\) must not exceed the cache's max_length \(4\)"
    ):
        step(layer, _x(1, 5))  # longer than the whole cache: known while tracing
    np.testing.assert_array_equal(np.asarray(layer.cached_value[...]), before)
    assert int(layer.cache_index[...]) == 3


def test_overflow_by_exactly_one_token_inside_jit_is_nan_and_a_fitting_step_still_fits():
    """3 tokens, then 2 into ``max_length=4`` (one too many): NaN, index still 3, cache as it
    was; then 1 token (filling the cache exactly) fits: finite, the full pass's last row, index
    4. An off-by-one in the overflow check fails one half or the other."""
    layer = _layer("mha")
    x = _x(1, 4, seed=8)
    with jax.default_matmul_precision("highest"):
        full = layer(x)  # (1, 4, 8)
        layer.init_cache(1, max_length=4)
        step = nnx.jit(lambda layer, x: layer(x, decode=True))
        assert bool(jnp.isfinite(step(layer, x[:, :3])).all())
        keys_before = np.asarray(layer.cached_key[...])
        bad = step(layer, _x(1, 2, seed=5))  # 3 + 2 > 4
        assert bool(jnp.isnan(bad).all()), "overflowing by one token must not return numbers"
        assert int(layer.cache_index[...]) == 3
        np.testing.assert_array_equal(np.asarray(layer.cached_key[...]), keys_before)
        last = step(layer, x[:, 3:])  # 3 + 1 == 4: fits exactly
    assert int(layer.cache_index[...]) == 4
    diff = _max_diff(last, full[:, 3:])
    assert diff <= DECODE_ATOL, f"the step that fills the cache exactly: {diff:.2e}"


@pytest.mark.quick
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"batch_size": 0}, ValueError, r"batch_size \(0\) must be positive"),
        ({"batch_size": 2.0}, TypeError, r"batch_size \(2.0\) must be an int"),
        ({"batch_size": 1, "max_length": 17}, ValueError, r"max_length \(17\) must not exceed"),
        ({"batch_size": 1, "max_length": 0}, ValueError, r"max_length \(0\) must be positive"),
    ],
)
def test_init_cache_checks_its_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        _layer("mha").init_cache(**kwargs)


def test_a_cache_over_two_batch_axes_and_in_bfloat16():
    layer = _layer("causal")
    x = _x(6, 5, seed=3).reshape(2, 3, 5, 8)
    full = layer(x)
    layer.init_cache((2, 3), dtype=jnp.bfloat16)
    assert layer.cached_key.dtype == jnp.bfloat16
    decoded = jnp.concatenate(
        [layer(x[..., :2, :], decode=True), layer(x[..., 2:, :], decode=True)], -2
    )
    # keys and values rounded to bfloat16 in the cache: 8 significant bits
    assert _max_diff(decoded, full) <= 3e-2


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_layer_answers_for_its_cache_through_its_own_methods(name):
    """What a model asks of its layers' caches: ``cache_capacity`` (``max_length``),
    ``cached_length`` (the next position, under jit too), ``cache_dtype`` (``init_cache``'s
    default: the computation dtype) and ``clear_cache``; the wrapper clears every head."""
    layer = _layer(name)
    heads = list(layer.heads) if name == "wrapper" else [layer]
    assert all(isinstance(head, fa.cache.DecodingLayer) for head in heads)
    assert all(head.cache_capacity() is None for head in heads)
    with pytest.raises(ValueError, match=r"^decode \(True\) needs a decode cache"):
        heads[0].cached_length()
    layer.init_cache(2, max_length=10)
    layer(_x(2, 3), decode=True)
    assert [(head.cache_capacity(), int(head.cached_length())) for head in heads] == [
        (10, 3)
    ] * len(heads)
    assert int(nnx.jit(lambda head: head.cached_length())(heads[0])) == 3
    layer.clear_cache()
    assert all(head.cached_key is None and head.cache_capacity() is None for head in heads)
    cls, args = LAYERS[name]
    bf16 = cls(*args, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    one = bf16.heads[0] if name == "wrapper" else bf16
    assert (heads[0].cache_dtype, one.cache_dtype) == (jnp.float32, jnp.bfloat16)


@pytest.mark.parametrize("name", ["mha", "wrapper"])
def test_decode_loop_equals_the_full_pass_over_its_own_outputs(name):
    """``decode_loop`` feeds each output back; the full pass over [prompt, y_0, y_1, ...] must give
    the same rows, and the loop compiles once for a given structure and length."""
    cls, args = LAYERS[name]
    layer = _layer(name)
    prompt = _x(2, 4, seed=4)
    with jax.default_matmul_precision("highest"):
        layer.init_cache(2)
        ys = fa.decode_loop(layer, prompt, 6)  # (2, 7, 8): prompt's last output + 6 steps
        sequence = jnp.concatenate([prompt, ys[:, :-1]], axis=1)  # what the layer was fed
        full = _layer(name)(sequence)
    assert ys.shape == (2, 7, 8)
    diff = _max_diff(ys, full[:, 3:])
    assert diff <= DECODE_ATOL, f"{name}: decode_loop vs full pass {diff:.2e}"
    caches = [layer] if name != "wrapper" else list(layer.heads)
    assert all(int(c.cache_index[...]) == 10 for c in caches)
    with pytest.raises(ValueError, match=r"\(10 \+ 4 \+ 6\) must not exceed the cache's"):
        fa.decode_loop(layer, prompt, 6)
    with pytest.raises(ValueError, match="must have a decode cache"):
        fa.decode_loop(_layer(name), prompt, 2)


def test_decode_loop_fills_the_cache_exactly_and_refuses_one_step_more():
    """A slot holds one token's key and value: a 4-token prompt and 6 steps fill 10 slots
    exactly (the last step's row still equals the full pass); 7 steps would need 11."""
    layer = _layer("mha")
    prompt = _x(1, 4, seed=5)
    with jax.default_matmul_precision("highest"):
        layer.init_cache(1, max_length=10)
        ys = fa.decode_loop(layer, prompt, 6)  # (1, 7, 8)
        full = _layer("mha")(jnp.concatenate([prompt, ys[:, :-1]], axis=1))  # (1, 10, 8)
    assert int(layer.cache_index[...]) == 10
    diff = _max_diff(ys, full[:, 3:])
    assert diff <= DECODE_ATOL, f"decode_loop into 10 slots vs full pass {diff:.2e}"
    layer.init_cache(1, max_length=10)
    message = r"\(0 \+ 4 \+ 7\) must not exceed the cache's max_length \(10\)"
    with pytest.raises(ValueError, match=message):
        fa.decode_loop(layer, prompt, 7)


def test_decode_loop_does_not_recompile_for_a_new_cache_of_the_same_shape():
    layer = _layer("mha")
    prompt = _x(1, 3)
    layer.init_cache(1)
    fa.decode_loop(layer, prompt, 4)
    before = fa.cache._decode_loop._cache_size()
    layer.init_cache(1)
    fa.decode_loop(layer, _x(1, 3, seed=9), 4)
    assert fa.cache._decode_loop._cache_size() == before


@pytest.mark.quick
def test_decode_loop_compiles_once_from_a_fresh_layer_with_an_rng_stream(caplog):
    """Loaded weights and a fresh cache are not committed to a device; what the jit hands back
    is, and XLA compiles again for committed inputs (the trace is reused, so only the compile
    log shows it). Parameters only go in and the rest is committed before the call, so later
    calls find the first one's compilation."""
    layer = fa.MultiHeadAttention(8, 8, 16, 0.1, 2, qkv_bias=True, rngs=nnx.Rngs(0))
    # weights from a file, as numpy arrays: not committed (the case that compiled twice)
    fa.load_state_dict(layer, {k: np.asarray(v) for k, v in fa.state_dict(layer).items()})
    layer.eval()
    assert jax.tree.leaves(nnx.state(layer, nnx.RngState))  # the dropout's stream is state
    outputs, compiles = [], []
    fa.cache._decode_loop.clear_cache()  # so the first call compiles, and the log must show it
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        for seed in (1, 2, 3):
            caplog.clear()
            layer.init_cache(1)
            outputs.append(fa.decode_loop(layer, _x(1, 3, seed=seed), 4))
            messages = [r.getMessage() for r in caplog.records]
            compiles.append(sum("Compiling jit(_decode_loop)" in m for m in messages))
    assert compiles == [1, 0, 0], compiles
    assert all(o.shape == (1, 5, 8) for o in outputs)
    assert float(jnp.abs(outputs[0] - outputs[1]).max()) > 0.0  # other prompts, other outputs


def test_multiheaded_attention_projects_the_memory_once():
    """A decoder's cross-attention: ``project_kv`` once, then every step reuses it."""
    layer = fa.MultiHeadedAttention(2, 8, 0.0, rngs=nnx.Rngs(0))
    layer.eval()
    query, memory = _x(2, 5, seed=6), _x(2, 9, seed=7)
    mask = jnp.ones((2, 1, 9)).at[1, 0, 6:].set(0)  # batch 1 pads its last 3 keys
    full = layer(query, memory, memory, mask)
    weights = layer.attention_score[...]
    kv = layer.project_kv(memory, memory)
    assert kv.keys.shape == (2, 9, 2, 4)
    steps = [layer(query[:, i : i + 1], mask=mask, kv=kv) for i in range(5)]
    assert _max_diff(jnp.concatenate(steps, axis=1), full) <= 1e-6
    assert _max_diff(layer.attention_score[...], weights[:, :, 4:5]) <= 1e-6
    with pytest.raises(ValueError, match="key and value must be None when kv"):
        layer(query, memory, memory, mask, kv=kv)
    with pytest.raises(ValueError, match=r"kv.keys.shape"):
        layer(query[:1], mask=mask[:1], kv=kv)


# ---- the encoder-decoder's decoder (flax_attention.models.annotated) on the same cache ------


def _encoder_decoder():
    """The post's model, small (vocabularies 11, N 2, d_model 8, 2 heads of 4), in eval mode,
    with a padded batch of two sources and its source mask."""
    model = annotated.make_model(11, 11, N=2, d_model=8, d_ff=16, h=2, rngs=nnx.Rngs(0))
    model.eval()
    src = np.array([[1, 5, 7, 2, 9], [1, 3, 4, 0, 0]])
    return model, src, src[:, None, :] != 0


def test_the_encoder_decoders_decode_cache_is_the_causal_layers_cache():
    """``init_cache`` gives every decoder layer ``flax_attention.cache``'s three variables
    (``new_cache``: keys and values ``(b, h, max_length, d)`` heads first, an int32 index) and
    nothing else of its own; the model answers through its own methods, ``clear_cache`` drops
    them, and ``greedy_decode`` leaves none behind."""
    model, src, mask = _encoder_decoder()
    model.init_cache(2, max_length=6)
    layers = list(model.decoder.layers)
    assert all(isinstance(layer, fa.cache.DecodingLayer) for layer in layers)
    paths = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Cache))}
    assert paths == {
        f"decoder.layers.{i}.{name}"
        for i in range(2)
        for name in ("cached_key", "cached_value", "cache_index")
    }
    for layer in layers:
        assert layer.cached_key.shape == layer.cached_value.shape == (2, 2, 6, 4)
        assert layer.cache_index.dtype == jnp.int32 and layer.cache_capacity() == 6
    assert (model.decoder.cache_capacity(), int(model.decoder.cached_length())) == (6, 0)
    kv_memory = model.project_memory(model.encode(src, mask))
    model.decode_cached(kv_memory, mask, jnp.array([[1, 4], [1, 6]]))
    assert [int(layer.cached_length()) for layer in layers] == [2, 2]
    model.clear_cache()
    assert all(layer.cached_key is None and layer.cache_capacity() is None for layer in layers)
    annotated.greedy_decode(model, src, mask, 4, 1)
    assert not jax.tree.leaves(nnx.state(model, nnx.Cache)), "greedy_decode left a cache behind"


def test_the_encoder_decoders_cached_chunks_equal_its_full_decode():
    """Target tokens through the caches in chunks (1, 3, then 2 tokens) give the rows of the
    post's ``decode`` over the whole target with ``subsequent_mask``."""
    model, src, mask = _encoder_decoder()
    tgt = jnp.array([[1, 4, 6, 8, 2, 3], [1, 9, 9, 5, 7, 10]])
    with jax.default_matmul_precision("highest"):
        memory = model.encode(src, mask)
        full = model.decode(memory, mask, tgt, annotated.subsequent_mask(6))  # (2, 6, 8)
        model.init_cache(2, max_length=6)
        kv_memory = model.project_memory(memory)
        chunks = [
            model.decode_cached(kv_memory, mask, tgt[:, a:b]) for a, b in ((0, 1), (1, 4), (4, 6))
        ]
    diff = _max_diff(jnp.concatenate(chunks, axis=1), full)
    assert diff <= DECODE_ATOL, f"cached chunks vs the full decode {diff:.2e}"


def test_the_encoder_decoders_cache_refuses_an_overflow():
    """As the causal layers' cache: outside jit a step past ``max_length`` is a ``ValueError``
    naming the numbers and leaves the caches as they were; inside jit (the index unknown) the
    step gives NaN, the caches untouched, and a step that still fits is finite."""
    model, src, mask = _encoder_decoder()
    model.init_cache(2, max_length=3)
    kv_memory = model.project_memory(model.encode(src, mask))
    model.decode_cached(kv_memory, mask, jnp.array([[1, 4], [1, 6]]))
    layer = model.decoder.layers[0]
    before = np.asarray(layer.cached_key[...])
    message = r"^cache_index \+ num_tokens \(2 \+ 2\) must not exceed the cache's max_length \(3\)"
    with pytest.raises(ValueError, match=message):
        model.decode_cached(kv_memory, mask, jnp.array([[5, 5], [7, 7]]))
    np.testing.assert_array_equal(np.asarray(layer.cached_key[...]), before)
    assert int(model.decoder.cached_length()) == 2

    step = nnx.jit(lambda model, kv, mask, tgt: model.decode_cached(kv, mask, tgt))
    bad = step(model, kv_memory, mask, jnp.array([[5, 5], [7, 7]]))  # 2 + 2 > 3
    assert bool(jnp.isnan(bad).all()), "an overflowing step must not return numbers"
    np.testing.assert_array_equal(np.asarray(layer.cached_key[...]), before)
    assert [int(layer.cached_length()) for layer in model.decoder.layers] == [2, 2]
    last = step(model, kv_memory, mask, jnp.array([[5], [7]]))  # 2 + 1 == 3: fits exactly
    assert bool(jnp.isfinite(last).all()) and int(model.decoder.cached_length()) == 3


needs_cache_write = pytest.mark.skipif(
    not cache_write.usable(jax.ShapeDtypeStruct((1, 1), jnp.float32)),
    reason="the native cache write runs on one CPU device, kernel built",
)


@pytest.mark.quick
@needs_cache_write
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_the_native_cache_write_equals_xlas_update(dtype):
    """``cache_write.write`` against XLA's ``dynamic_update_slice``: rows written at a traced
    index in every leading slice, the cache unchanged where they do not fit, the caller's array
    untouched (the alias is the program's own buffer)."""
    rng = np.random.default_rng(0)
    cache = jnp.asarray(rng.standard_normal((2, 3, 10, 4)) * 50, dtype)  # (b, h, S, d)
    before = np.asarray(cache).copy()
    for n, index in ((1, 0), (3, 4), (2, 8), (1, 9), (3, 8), (1, 10)):  # the last two do not fit
        rows = jnp.asarray(rng.standard_normal((2, 3, n, 4)) * 50, dtype)
        written = jax.jit(cache_write.write)(cache, rows, jnp.int32(index))
        expected = np.array(before)
        if index + n <= 10:
            expected[:, :, index : index + n] = np.asarray(rows)
        np.testing.assert_array_equal(np.asarray(written), expected, err_msg=f"{n} at {index}")
        np.testing.assert_array_equal(np.asarray(cache), before)


@pytest.mark.quick
@pytest.mark.skipif(
    not table_rows.usable(jax.ShapeDtypeStruct((2, 2), jnp.bfloat16), jnp.zeros(1, jnp.int32)),
    reason="the native lookup runs on one CPU device, kernel built",
)
def test_a_bfloat16_embedding_lookup_is_jnp_takes_and_widens_no_table_in_a_loop():
    """The models' ``Embed`` on a bfloat16 table (``kernels.native.table_rows``) against
    ``nnx.Embed``'s ``jnp.take``: the rows at ids of two dimensions (a negative id counts from
    the end), NaN rows out of range, the table's gradient; and a loop of lookups compiled (as
    ``generate``'s) makes no float32 table, where XLA's gather widened the whole table and
    hoisted that out of the loop."""
    dtype = jnp.bfloat16
    embed = _layers.Embed(11, 6, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    ids = jnp.array([[0, 3, 10], [-1, -11, 4]])
    for batch in (ids, jnp.array([11, -12, 2])):  # the last: two out of range
        want = nnx.Embed.__call__(embed, batch)
        got = embed(batch)
        assert got.dtype == want.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert bool(jnp.isnan(embed(jnp.array([11, -12]))).all())
    table = embed.embedding[...]
    weights = jnp.arange(2 * 3 * 6, dtype=jnp.float32).reshape(2, 3, 6)
    grads = [
        jax.grad(lambda t, take=take: (take(t, ids).astype(jnp.float32) * weights).sum())(table)
        for take in (table_rows.take, lambda t, i: jnp.take(t, i, axis=0))
    ]
    np.testing.assert_array_equal(*(np.asarray(g, np.float32) for g in grads))
    graphdef, state = nnx.split(embed)

    def lookups(state, token):
        e = nnx.merge(graphdef, state)
        zeros = jnp.zeros((1, 6), jnp.float32)
        return jax.lax.fori_loop(0, 4, lambda j, c: c + e(token + j).astype(jnp.float32), zeros)

    text = jax.jit(lookups).lower(state, jnp.array([1])).compile().as_text()
    assert "f32[11,6]" not in text, "the loop widens the whole table"


def _cache_copies(layer, dtype):
    """The instructions of ``decode_loop``'s loop body (its compiled program, 4 steps) that
    produce a whole cache-shaped array by a copy, or by a fusion that converts one (XLA widening
    a bfloat16 cache to float32 to update it). The entry's one copy of the caller's cache (not
    donated) is outside the loop."""
    layer.init_cache(1, 12, dtype=dtype)
    graphdef, params, state = decode_cache.split_for_decode(layer)
    prompt = _x(1, 2)
    decode_cache._decode_loop.clear_cache()  # traced again: the write path is read at trace
    lowered = decode_cache._decode_loop.lower(
        graphdef, params, state, prompt, 4, decode_cache._identity
    )
    text = lowered.compile().as_text()
    computations = dict(re.findall(r"\n(%[\w.-]+) [^\n]*\{\n(.*?)\n\}", text, flags=re.S))
    (body,) = re.findall(r" while\(.*?body=(%[\w.-]+)", text)
    found = []
    for line in computations[body].splitlines():
        match = re.search(r"= \w+\[1,2,12,4\]\S* (copy|fusion)\(.*?(?:calls=(%[\w.-]+))?$", line)
        if match and (
            match.group(1) == "copy" or "f32[1,2,12,4]" in computations.get(match.group(2), "")
        ):
            found.append(line.strip()[:120])
    return found


@needs_cache_write
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_step_writes_its_cache_in_place(monkeypatch, dtype):
    """A decode loop's program neither copies a whole cache nor widens one to update it; with
    XLA's own update (the native write switched off) it does both, every step."""
    dtype = jnp.dtype(dtype)
    layer = _layer("mha")
    assert _cache_copies(layer, dtype) == []
    monkeypatch.setattr(cache_write, "usable", lambda cache: False)
    try:
        assert _cache_copies(_layer("mha"), dtype) != []
    finally:  # no later test may reuse the trace made with the write switched off
        monkeypatch.undo()
        decode_cache._decode_loop.clear_cache()


@needs_cache_write
def test_gradients_through_decode_steps_equal_xlas_update(monkeypatch):
    """The native write is differentiable (its tangents written by XLA's update): gradients
    through a prefill and two steps equal those with XLA's update."""

    def gradient():
        def loss(x):
            layer = _layer("mha")  # made inside: its cache is this trace's
            layer.init_cache(2)
            y = layer(x[:, :3], decode=True)
            z = layer(x[:, 3:4], decode=True)
            return y.sum() + (z**2).sum() + (layer(x[:, 4:5], decode=True) ** 3).sum()

        return jax.grad(loss)(_x(2, 5, seed=3))

    native = gradient()
    monkeypatch.setattr(cache_write, "usable", lambda cache: False)
    xla = gradient()
    assert float(jnp.abs(xla).max()) > 0.1
    np.testing.assert_allclose(np.asarray(native), np.asarray(xla), rtol=0, atol=1e-6)
