"""The book's modern attention (chapter 4 bonus: grouped-query, multi-head latent, sliding-window)
against its code (``torch_reference.modern``): the full pass, decoding in chunks of every kind
against the book's ``use_cache=True`` calls, every parameter's gradient, state dicts both ways,
each cache holding what its variant promises, and what each refuses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import flax_attention as fa
import torch_reference as tr

#: (name, torch layer, Flax layer): the book's arguments, biases on, heads that group.
LAYERS = {
    "gqa": (
        lambda: tr.GroupedQueryAttention(16, 24, 0.0, 6, 2, qkv_bias=True),
        lambda: fa.GroupedQueryAttention(16, 24, 0.0, 6, 2, qkv_bias=True, rngs=nnx.Rngs(0)),
    ),
    "mla": (
        lambda: tr.MultiHeadLatentAttention(16, 24, 0.0, 4, qkv_bias=True, latent_dim=8),
        lambda: fa.MultiHeadLatentAttention(
            16, 24, 0.0, 4, qkv_bias=True, latent_dim=8, rngs=nnx.Rngs(0)
        ),
    ),
    "swa": (
        lambda: tr.MultiHeadAttentionWithSWA(16, 24, 0.0, 4, qkv_bias=True, sliding_window_size=3),
        lambda: fa.MultiHeadAttentionWithSWA(
            16, 24, 0.0, 4, qkv_bias=True, sliding_window_size=3, rngs=nnx.Rngs(0)
        ),
    ),
}
#: Chunkings of 11 tokens: one prefill, a prefill then steps, steps only, chunks past the window.
CHUNKINGS = ([11], [4, 1, 1, 5], [1] * 11, [2, 6, 3])
ATOL = 1e-6


def _pair(name):
    torch.manual_seed(0)
    twin, layer = LAYERS[name][0](), LAYERS[name][1]()
    fa.load_state_dict(layer, {k: v.numpy() for k, v in twin.state_dict().items()})
    return twin, layer


def _x(seed=0, shape=(2, 11, 16)):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.quick
@pytest.mark.parametrize("name", list(LAYERS))
def test_full_pass_and_every_chunking_equal_the_books_cache(name):
    """The full pass, and decoding in chunks (``init_cache`` then ``decode=True``) equal the
    book's ``forward(x)`` and its ``use_cache=True`` calls chunk for chunk."""
    twin, layer = _pair(name)
    x = _x()
    with torch.no_grad():
        expected = twin(torch.tensor(x)).numpy()
    np.testing.assert_allclose(layer(jnp.asarray(x)), expected, rtol=0, atol=ATOL)
    decode = nnx.jit(lambda layer, chunk: layer(chunk, decode=True))
    for chunks in CHUNKINGS:
        twin.reset_cache()
        layer.init_cache(2, 11)
        start = 0
        for size in chunks:
            chunk = x[:, start : start + size]
            with torch.no_grad():
                step = twin(torch.tensor(chunk), use_cache=True).numpy()
            np.testing.assert_allclose(
                decode(layer, jnp.asarray(chunk)), step, rtol=0, atol=ATOL, err_msg=str(chunks)
            )
            start += size
    assert np.abs(expected).max() > 0.1


@pytest.mark.parametrize("name", list(LAYERS))
def test_every_parameters_gradient_and_the_state_dict_equal_the_books(name):
    """Every parameter's gradient equals torch's (the key bias's is exactly 0 on both sides:
    softmax ignores a shift all keys share, so it is held to an absolute floor), and the state
    dict goes back out bit for bit in the book's names."""
    twin, layer = _pair(name)
    x, cotangent = _x(1), _x(2, (2, 11, 24))
    twin(torch.tensor(x)).mul(torch.tensor(cotangent)).sum().backward()

    def loss(layer):
        return (layer(jnp.asarray(x)) * cotangent).sum()

    named = nnx.clone(layer)  # the gradients in the layer's places, to name them as weights
    nnx.update(named, nnx.grad(loss)(layer))
    grads = fa.state_dict(named)
    expected = {k: p.grad.numpy() for k, p in twin.named_parameters()}
    assert sorted(grads) == sorted(expected)
    for key, value in expected.items():
        scale = max(1.0, float(np.abs(value).max()))
        np.testing.assert_allclose(grads[key], value, rtol=0, atol=1e-5 * scale, err_msg=key)
    exported = fa.state_dict(layer)
    assert sorted(exported) == sorted(twin.state_dict())
    for key, value in twin.state_dict().items():
        np.testing.assert_array_equal(exported[key], value.numpy(), err_msg=key)


def test_each_cache_holds_what_its_variant_promises():
    """Grouped-query: the key groups only; latent: the latent only; sliding window: a ring of
    the window, the same size for any ``max_length``."""
    gqa, mla, swa = (_pair(name)[1] for name in LAYERS)
    gqa.init_cache(2, 40)
    assert gqa.cached_key.shape == gqa.cached_value.shape == (2, 2, 40, 4)  # 2 of 6 heads
    mla.init_cache(2, 40)
    assert mla.cached_latent.shape == (2, 40, 8) and mla.cached_key is None
    for max_length in (11, 500):
        swa.init_cache(2, max_length)
        assert swa.cached_key.shape == (2, 4, 3, 6)  # the window's 3 tokens
        assert swa.cache_capacity() == max_length
    swa.init_cache(2, 2)
    assert swa.cached_key.shape == (2, 4, 2, 6)  # never more than max_length


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_chunk_past_the_cache_is_refused_and_nan_inside_jit(name):
    _, layer = _pair(name)
    layer.init_cache(2, 6)
    layer(jnp.asarray(_x()[:, :4]), decode=True)
    with pytest.raises(ValueError, match=r"cache_index \+ num_tokens \(4 \+ 3\) must not exceed"):
        layer(jnp.asarray(_x()[:, :3]), decode=True)
    assert int(layer.cached_length()) == 4  # nothing written
    out = nnx.jit(lambda layer, x: layer(x, decode=True))(layer, jnp.asarray(_x()[:, :3]))
    assert np.isnan(np.asarray(out)).all() and int(layer.cached_length()) == 4
    with pytest.raises(ValueError, match=r"max_length \(None\) must be given"):
        layer.init_cache(2)


def test_bad_arguments_and_another_variants_state_dict_are_refused_by_name():
    rngs = nnx.Rngs(0)
    with pytest.raises(
        ValueError, match=r"^num_heads \(6\) must be divisible by num_kv_groups \(4\)"
    ):
        fa.GroupedQueryAttention(16, 24, 0.0, 6, 4, rngs=rngs)
    with pytest.raises(ValueError, match=r"^num_kv_groups \(0\) must be positive"):
        fa.GroupedQueryAttention(16, 24, 0.0, 6, 0, rngs=rngs)
    with pytest.raises(ValueError, match=r"^latent_dim \(0\) must be >= 1"):
        fa.MultiHeadLatentAttention(16, 24, 0.0, 4, latent_dim=0, rngs=rngs)
    with pytest.raises(ValueError, match=r"^sliding_window_size \(0\) must be >= 1"):
        fa.MultiHeadAttentionWithSWA(16, 24, 0.0, 4, sliding_window_size=0, rngs=rngs)
    with pytest.raises(ValueError, match=r"^d_out \(24\) must be divisible by num_heads \(5\)"):
        fa.MultiHeadLatentAttention(16, 24, 0.0, 5, rngs=rngs)
    for torch_layer, book_message in (
        (lambda: tr.GroupedQueryAttention(16, 24, 0.0, 6, 4), "num_heads (6) must be divisible"),
        (lambda: tr.MultiHeadLatentAttention(16, 24, 0.0, 4, latent_dim=0), "latent_dim (0)"),
    ):
        with pytest.raises(ValueError, match=book_message.replace("(", r"\(").replace(")", r"\)")):
            torch_layer()
    swa = _pair("swa")[1]
    before = np.asarray(swa.W_key.kernel[...]).copy()
    gqa_state = {k: v.numpy() for k, v in _pair("gqa")[0].state_dict().items()}
    with pytest.raises(ValueError, match=r"W_key.weight.*\(8, 16\).*\(24, 16\)"):
        fa.load_state_dict(swa, gqa_state)
    np.testing.assert_array_equal(swa.W_key.kernel[...], before)  # nothing loaded
    mla = _pair("mla")[1]
    with pytest.raises(ValueError, match=r"W_key"):
        fa.load_state_dict(mla, gqa_state)


def test_grouped_queries_train_as_the_books_layer():
    """20 SGD steps on the same batches: the parameters stay with the book's layer's."""
    twin, layer = _pair("gqa")
    twin.train()
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.05)
    x, target = _x(3), _x(4, (2, 11, 24))

    @nnx.jit
    def step(layer):
        def loss(layer):
            return ((layer(jnp.asarray(x)) - target) ** 2).mean()

        grads = nnx.grad(loss)(layer)
        params = nnx.state(layer, nnx.Param)
        nnx.update(layer, jax.tree.map(lambda p, g: p - 0.05 * g, params, nnx.state(grads)))

    for _ in range(20):
        optimizer.zero_grad()
        ((twin(torch.tensor(x)) - torch.tensor(target)) ** 2).mean().backward()
        optimizer.step()
        step(layer)
    exported = fa.state_dict(layer)
    for key, value in twin.state_dict().items():
        np.testing.assert_allclose(exported[key], value.numpy(), rtol=0, atol=1e-5, err_msg=key)


#: The book's GPT variants, small: each file's config keys on a 3-layer model.
GPT_CFG = {"vocab_size": 61, "context_length": 32, "emb_dim": 24, "n_heads": 6, "n_layers": 3,
           "drop_rate": 0.0, "qkv_bias": True}  # fmt: skip
VARIANTS = {
    "gqa": {"n_kv_groups": 2},
    "mla": {"latent_dim": 8},
    "swa": {"sliding_window_size": 4, "sliding_window_stride": 1},  # window, full, window
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_books_gpt_variants_load_and_generate_its_cached_tokens(variant):
    """``GPTModel(cfg)`` with a variant's keys is the book's file's model: its state dict loads
    as it is, the logits equal, and ``generate`` (through the decode caches: the groups, the
    latent, the rings) makes the tokens of the book's ``generate_text_simple_cached``; a
    left-padded row makes its own tokens."""
    from conformance_tests import book_modern
    from flax_attention import models

    cfg = {**GPT_CFG, **VARIANTS[variant]}
    torch.manual_seed(0)
    twin = book_modern.GPTModel(cfg).eval()
    model = models.GPTModel(cfg, rngs=nnx.Rngs(0))
    fa.load_state_dict(model, {k: v.numpy() for k, v in twin.state_dict().items()})
    if variant == "swa":
        assert [block.att.window for block in model.trf_blocks] == [4, None, 4]
    prompt = np.random.default_rng(5).integers(0, cfg["vocab_size"], (1, 6))
    with torch.no_grad():
        expected = twin(torch.tensor(prompt)).numpy()
    np.testing.assert_allclose(model(jnp.asarray(prompt)), expected, rtol=0, atol=2e-5)
    batch = np.concatenate([prompt, np.concatenate([np.zeros((1, 3), int), prompt[:, :3]], 1)])
    mask = (np.arange(6) >= [[0], [3]]).astype(np.int32)  # the second row left-padded by 3
    out = np.asarray(models.generate(model, batch, 14, 32, attention_mask=mask))
    for row, (ids, start) in enumerate(((prompt, 0), (prompt[:, :3], 3))):
        tokens = book_modern.generate_text_simple_cached(twin, torch.tensor(ids), 14)
        np.testing.assert_array_equal(out[row, start:], tokens.numpy()[0])


def test_the_books_gpt_variant_keys_are_checked_by_name():
    from flax_attention import models

    bad = (
        ({"n_kv_groups": 4}, r"cfg\['n_heads'\] \(6\) must be divisible by cfg\['n_kv_groups'\]"),
        ({"n_kv_groups": 2, "latent_dim": 8}, r"must not be combined"),
        ({"sliding_window_size": 4}, r"must have key 'sliding_window_stride'"),
        ({"latent_dim": 0}, r"cfg\['latent_dim'\] \(0\) must be positive"),
    )
    for keys, message in bad:
        with pytest.raises(ValueError, match=message):
            models.GPTModel({**GPT_CFG, **keys}, rngs=nnx.Rngs(0))
    model = models.GPTModel({**GPT_CFG, "latent_dim": 8}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"must be 'documents' for the book's latent_dim variant"):
        fa.state_dict(model, layout="gpt2")
    model = models.GPTModel({**GPT_CFG, "n_kv_groups": 2}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"layout \('gpt2'\) must be 'documents' for a MultiHead"):
        fa.state_dict(model, layout="gpt2")  # its grouped heads, which the layout cannot hold


def _book_kv_bytes(batch, tokens, head_dim, kv_heads, layers, nbytes):
    """The book's estimators' formula (``memory_estimator_gqa.py``, ``_swa.py``): keys and values
    of every cached token, per layer."""
    return batch * tokens * head_dim * kv_heads * 2 * nbytes * layers


def test_each_variants_cache_bytes_are_the_books_estimate():
    """A whole model's decode caches, in bytes, against the book's memory estimators: full
    attention and grouped heads ``b * T * head_dim * kv_heads * 2`` per layer, the latent ``b * T
    * latent_dim`` (``memory_estimator_mla.py``), a window layer ``min(T, W)`` tokens (``_swa.py``,
    its K:1 schedule); bfloat16 halves each."""
    from flax_attention import models

    cfg, batch, tokens = {**GPT_CFG, "n_layers": 4}, 2, 32
    head_dim, heads = cfg["emb_dim"] // cfg["n_heads"], cfg["n_heads"]

    def cache_bytes(keys, dtype=jnp.float32):
        model = models.GPTModel({**cfg, **keys}, rngs=nnx.Rngs(0))
        model.init_cache(batch, tokens, dtype=dtype)
        arrays = [
            getattr(block.att, name)
            for block in model.trf_blocks
            for name in ("cached_key", "cached_value", "cached_latent")
            if getattr(block.att, name, None) is not None
        ]
        return sum(a.size * a.dtype.itemsize for a in arrays)

    def book(kv_heads, nbytes=4, layers=4, cached=tokens):
        return _book_kv_bytes(batch, cached, head_dim, kv_heads, layers, nbytes)

    assert cache_bytes({}) == book(heads)
    assert cache_bytes({}, jnp.bfloat16) == book(heads, 2)
    assert cache_bytes({"n_kv_groups": 2}) == book(2)  # the layer's 2 key heads
    assert cache_bytes({"latent_dim": 8}) == batch * tokens * 4 * 8 * 4
    swa = {"sliding_window_size": 4, "sliding_window_stride": 3}  # 3 window layers, 1 full
    assert cache_bytes(swa) == book(heads, layers=3, cached=4) + book(heads, layers=1)


def test_the_book_estimators_printed_totals_are_the_layers_caches():
    """The book's READMEs print their estimators' totals (17.18 GB of MHA cache, 4.29 GB
    grouped, 3.14 GB with 5:1 sliding windows, 0.81 GB of latent); the layers' own caches, built
    abstractly at those settings (``benchmarks.cache_memory``), hold exactly that much."""
    from benchmarks import cache_memory

    rows = {(setting, variant): n for setting, variant, n, _ in cache_memory.table()}
    assert len(cache_memory.BOOK) == 4
    for key, printed in cache_memory.BOOK.items():
        assert cache_memory.gigabytes(rows[key]) == printed, key
    gpt2 = "GPT-2 small, 1024 tokens, fp32"
    assert rows[(gpt2, "MHA")] == 12 * 1024 * 768 * 2 * 4  # 12 layers of keys and values
    assert rows[(gpt2, "MLA (latent 96)")] == 12 * 1024 * 96 * 4
