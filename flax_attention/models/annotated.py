"""The Annotated Transformer's whole model in Flax NNX, on ``flax_attention.MultiHeadedAttention``.

"The Annotated Transformer" (harvardnlp; `code
<https://github.com/harvardnlp/annotated-transformer>`_, ``the_annotated_transformer.py``) builds
the encoder-decoder of "Attention Is All You Need" around its ``MultiHeadedAttention``. Each of
its modules is mirrored here with the post's attribute names, so the post's torch ``state_dict``
loads as it is (``flax_attention.load_state_dict``):

===============================================  ==============================================
the post (torch)                                 here
===============================================  ==============================================
``EncoderDecoder(encoder, decoder, src_embed,    ``EncoderDecoder``: the same five attributes;
tgt_embed, generator)``                          ``__call__`` (the post's ``forward``),
                                                 ``encode``, ``decode``
``Generator(d_model, vocab)``                    ``Generator``: ``proj``, log-softmax
``Encoder(layer, N)``, ``Decoder(layer, N)``     ``Encoder``, ``Decoder``: ``layers``, ``norm``
``EncoderLayer``, ``DecoderLayer``               the same: ``self_attn``, (``src_attn``),
                                                 ``feed_forward``, ``sublayer``
``SublayerConnection(size, dropout)``            ``SublayerConnection``: ``x + dropout(sublayer(
                                                 norm(x)))``, the norm first
``LayerNorm(features, eps=1e-6)``                ``LayerNorm``: ``a_2 * (x - mean) / (std +
                                                 eps) + b_2``, torch's unbiased ``std``
``PositionwiseFeedForward(d_model, d_ff)``       ``PositionwiseFeedForward``: ``w_1``, ReLU,
                                                 dropout, ``w_2``
``Embeddings(d_model, vocab)``                   ``Embeddings``: ``lut``, times
                                                 ``sqrt(d_model)``
``PositionalEncoding(d_model, dropout,           ``PositionalEncoding``: the ``pe`` buffer
max_len=5000)``                                  ``(1, max_len, d_model)``, dropout
``MultiHeadedAttention(h, d_model)``             ``flax_attention.MultiHeadedAttention``; the
                                                 post's ``linears`` are its ``proj_weights``
                                                 (the state dict says ``linears``)
``make_model(src_vocab, tgt_vocab, N, d_model,   ``make_model``: the same, Glorot-uniform for
d_ff, h, dropout)``                              every parameter of rank > 1
``subsequent_mask``, ``Batch``, ``data_gen``,    the same names (NumPy masks and batches)
``LabelSmoothing``, ``rate``, ``greedy_decode``
===============================================  ==============================================

The post's quirks are its spec: ``make_model`` builds its attention as
``MultiHeadedAttention(h, d_model)``, so every attention's dropout is that layer's default 0.1
whatever ``dropout`` says (``attention_dropout`` sets it; its default is the post's 0.1);
``LayerNorm`` adds ``eps`` to the unbiased standard deviation, not to the variance.

Shape legend: ``b`` batch, ``s`` source tokens, ``t`` target tokens, ``d`` = ``d_model``,
``V`` a vocabulary.

Masks as the post makes them: ``src_mask`` ``(b, 1, s)`` (``src != pad``), ``tgt_mask``
``(b, t, t)`` (``tgt != pad`` and ``subsequent_mask``); ``0``/``False`` hides a key.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from flax_attention._checks import (
    check_at_most,
    check_dropout,
    check_instance,
    check_int,
    check_positive_int,
    check_rate,
)
from flax_attention._layers import Dropout, Embed, LayerOptions
from flax_attention.annotated import MultiHeadedAttention, ProjectedKV
from flax_attention.cache import (
    CachedLayer,
    append,
    decode_step,
    install_cache,
    poison_unless,
    split_for_decode,
)
from flax_attention.core import Implementation
from flax_attention.layouts import Names, encoder_decoder_names, register
from flax_attention.mesh import (
    DATA,
    FROM_HEADS,
    TO_HEADS,
    LinearAxes,
    mesh_axis_size,
    parameters_mesh,
)
from flax_attention.models._modes import in_eval_mode
from flax_attention.weights import CheckedBuffer

__all__ = [
    "Batch",
    "Decoder",
    "DecoderLayer",
    "Embeddings",
    "Encoder",
    "EncoderDecoder",
    "EncoderLayer",
    "Generator",
    "LabelSmoothing",
    "LayerNorm",
    "PositionalEncoding",
    "PositionwiseFeedForward",
    "SublayerConnection",
    "adam",
    "data_gen",
    "greedy_decode",
    "loss_compute",
    "make_model",
    "positional_encoding",
    "rate",
    "rate_schedule",
    "subsequent_mask",
    "train_step",
]

_REPLICATED = LinearAxes(kernel=(None, None), bias=(None,))


class LayerNorm(nnx.Module):
    """The post's ``LayerNorm``: ``a_2 * (x - mean) / (std + eps) + b_2`` over the last axis,
    ``std`` unbiased (torch's ``x.std(-1)``), ``eps = 1e-6`` added to it; computed in at least
    float32, cast back."""

    def __init__(self, features: int, eps: float = 1e-6, *, dtype=None, param_dtype=jnp.float32):
        self.eps = eps
        self.dtype = dtype
        self.a_2 = nnx.Param(jnp.ones((features,), param_dtype))
        self.b_2 = nnx.Param(jnp.zeros((features,), param_dtype))

    def __call__(self, x):
        dtype = self.dtype or jnp.result_type(x, self.a_2[...])
        x32 = x.astype(jnp.promote_types(dtype, jnp.float32))
        mean = x32.mean(axis=-1, keepdims=True)  # (..., 1)
        centered = x32 - mean  # (..., d)
        std = jnp.sqrt((centered * centered).sum(axis=-1, keepdims=True) / (x.shape[-1] - 1))
        lead = (1,) * (x.ndim - 1)  # explicit broadcasts: rank promotion may raise
        a_2 = self.a_2[...].astype(x32.dtype).reshape(*lead, -1)  # (..., d)
        b_2 = self.b_2[...].astype(x32.dtype).reshape(*lead, -1)
        return (a_2 * centered / (std + self.eps) + b_2).astype(dtype)


class SublayerConnection(nnx.Module):
    """``x + dropout(sublayer(norm(x)))``: the post's residual, its norm first."""

    def __init__(self, size: int, dropout: float, *, dtype=None, param_dtype=jnp.float32, rngs):
        self.norm = LayerNorm(size, dtype=dtype, param_dtype=param_dtype)
        self.dropout = Dropout(dropout, rngs=rngs)

    def __call__(self, x, sublayer):
        return x + self.dropout(sublayer(self.norm(x)))


class PositionwiseFeedForward(nnx.Module):
    """``w_2(dropout(relu(w_1(x))))``; on a mesh ``w_1`` splits its outputs over ``model``."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.1, *, linear, rngs):
        self.w_1 = linear(d_model, d_ff, axes=TO_HEADS)
        self.w_2 = linear(d_ff, d_model, axes=FROM_HEADS)
        self.dropout = Dropout(dropout, rngs=rngs)

    def model_axis_sizes(self) -> dict[str, int]:
        """What ``flax_attention.shard`` splits over ``model``: the hidden features."""
        return {"d_ff": self.w_1.out_features}

    def __call__(self, x):
        hidden = self.dropout(jax.nn.relu(self.w_1(x)))  # (b, t, d_ff)
        return self.w_2(hidden)  # (b, t, d)


class Embeddings(nnx.Module):
    """``lut(x) * sqrt(d_model)``."""

    def __init__(self, d_model: int, vocab: int, *, dtype=None, param_dtype=jnp.float32, rngs):
        self.lut = Embed(vocab, d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.d_model = d_model

    def __call__(self, x):
        return self.lut(x) * math.sqrt(self.d_model)  # (b, t, d)


def positional_encoding(d_model: int, max_len: int) -> np.ndarray:
    """The post's sinusoids ``(1, max_len, d_model)`` in float32: ``sin`` on the even features,
    ``cos`` on the odd, of ``position * exp(-(2i) log(10000) / d_model)``."""
    position = np.arange(max_len, dtype=np.float32)[:, None]  # (max_len, 1)
    div_term = np.exp(
        np.arange(0, d_model, 2, dtype=np.float32) * np.float32(-(math.log(10000.0) / d_model))
    )
    pe = np.zeros((max_len, d_model), np.float32)
    pe[:, 0::2] = np.sin(position * div_term)
    pe[:, 1::2] = np.cos(position * div_term)[:, : d_model // 2]
    return pe[None]


def _check_pe(value: np.ndarray) -> str | None:
    """A loaded ``pe`` must be the post's sinusoids to float32 rounding: the argument
    ``position * div_term`` is rounded to float32 (torch's ``exp`` and ours may differ by an ulp
    of ``div_term``), so position ``p`` may differ by about ``p * 2**-22``, 1.2e-3 at 5000."""
    expected = positional_encoding(value.shape[-1], value.shape[-2])  # (1, max_len, d)
    allowed = 1e-6 + np.arange(value.shape[-2])[None, :, None] * 2.0**-22
    excess = np.abs(np.asarray(value, np.float64) - expected) - allowed
    if np.any(excess > 0):
        position = int(np.argwhere(excess > 0)[0][1])
        return (
            f"differs from the sinusoidal positional encoding at position {position} by more "
            "than float32 rounding"
        )
    return None


class PositionalEncoding(nnx.Module):
    """``dropout(x + pe[:, :t])``; ``pe`` ``(1, max_len, d_model)`` the post's buffer (loaded
    and exported with a state dict, checked against the sinusoids when loaded)."""

    def __init__(self, d_model: int, dropout: float, max_len: int = 5000, *, rngs):
        self.dropout = Dropout(dropout, rngs=rngs)
        self.pe = CheckedBuffer(jnp.asarray(positional_encoding(d_model, max_len)), check=_check_pe)

    def __call__(self, x):
        if x.shape[1] > self.pe.shape[1]:
            raise ValueError(
                f"tokens ({x.shape[1]}) must not exceed the positional table's max_len "
                f"({self.pe.shape[1]})"
            )
        return self.dropout(x + self.pe[:, : x.shape[1]].astype(x.dtype))  # (b, t, d)

    def at(self, x, position):
        """``x`` ``(b, n, d)``, ``n`` tokens from ``position`` on (a traced int): a decode step."""
        pe = jax.lax.dynamic_slice_in_dim(self.pe[...], position, x.shape[1], axis=1)  # (1, n, d)
        return self.dropout(x + pe.astype(x.dtype))


class Generator(nnx.Module):
    """``log_softmax(proj(x))``: log-probabilities ``(..., V)``."""

    def __init__(self, d_model: int, vocab: int, *, linear):
        self.proj = linear(d_model, vocab, axes=_REPLICATED)

    def __call__(self, x):
        return jax.nn.log_softmax(self.proj(x).astype(jnp.float32), axis=-1).astype(x.dtype)


class EncoderLayer(nnx.Module):
    """``self_attn`` then ``feed_forward``, each in a ``SublayerConnection``."""

    def __init__(self, size: int, self_attn, feed_forward, dropout: float, *, norm, rngs):
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.sublayer = nnx.List(
            [SublayerConnection(size, dropout, **norm, rngs=rngs) for _ in range(2)]
        )
        self.size = size

    def __call__(self, x, mask):
        x = self.sublayer[0](x, lambda x: self.self_attn(x, x, x, mask))
        return self.sublayer[1](x, self.feed_forward)


class DecoderLayer(CachedLayer, nnx.Module):
    """``self_attn``, ``src_attn`` (on the encoder's ``memory``), ``feed_forward``.

    A decoder with the package's decode cache (``flax_attention.cache``, its ``Decoder``
    protocol): ``init_cache`` fills ``cached_key`` and ``cached_value`` ``(b, h, max_length,
    d)``, the self-attention's projected keys and values of every token so far, heads first,
    and ``cache_index`` (``None`` outside a decode), as the causal layers keep theirs;
    ``step`` appends to them through ``flax_attention.cache.append``, so a step past
    ``max_length`` raises ``ValueError`` outside jit and gives NaN inside. ``context_length``
    (keyword-only, not the post's) is the longest cache: ``make_model`` passes the positional
    table's ``max_len``. The model asks it through ``init_cache``, ``clear_cache``,
    ``cached_length``, ``cache_capacity``, ``project_memory`` and ``step``."""

    def __init__(
        self,
        size: int,
        self_attn,
        src_attn,
        feed_forward,
        dropout,
        *,
        norm,
        rngs,
        context_length: int = 5000,
    ):
        check_positive_int("context_length", context_length)
        self.size = size
        self.self_attn = self_attn
        self.src_attn = src_attn
        self.feed_forward = feed_forward
        self.sublayer = nnx.List(
            [SublayerConnection(size, dropout, **norm, rngs=rngs) for _ in range(3)]
        )
        self.context_length = context_length
        self.cached_key: nnx.Cache | None = nnx.data(None)
        self.cached_value: nnx.Cache | None = nnx.data(None)
        self.cache_index: nnx.Cache | None = nnx.data(None)

    def __call__(self, x, memory, src_mask, tgt_mask):
        m = memory
        x = self.sublayer[0](x, lambda x: self.self_attn(x, x, x, tgt_mask))
        x = self.sublayer[1](x, lambda x: self.src_attn(x, m, m, src_mask))
        return self.sublayer[2](x, self.feed_forward)

    @property
    def cache_dtype(self):
        """The decode cache's default dtype: the self-attention's computation dtype."""
        w_key = self.self_attn.proj_weights[1]
        return w_key.dtype or w_key.param_dtype

    def init_cache(self, batch_size, max_length: int | None = None, dtype=None) -> None:
        """An empty decode cache for ``batch_size`` sequences of ``max_length`` tokens (default
        ``context_length``; ``flax_attention.cache.new_cache``, heads and head size the
        self-attention's); on a sharded layer it is placed on the parameters' mesh at once."""
        install_cache(
            self,
            batch_size,
            max_length,
            dtype,
            heads=self.self_attn.num_heads,
            head_dim=self.self_attn.k_dim,
        )

    def project_memory(self, memory) -> ProjectedKV:
        """The source attention's keys and values of ``memory`` ``(b, s, d)``, ``(b, s, h, d)``
        each: projected once, for every ``step``."""
        return self.src_attn.project_kv(memory, memory)

    def step(self, x, kv_memory: ProjectedKV, src_mask):
        """``x`` ``(b, n, d)``, the next ``n`` target tokens: their keys and values appended to
        the cache at ``cache_index``, the self-attention reading the cache up to each token's
        own position (the post's ``subsequent_mask``), the source attention ``kv_memory``
        (``project_memory``). An overflow: ``ValueError`` outside jit, NaN inside."""
        norm_x = self.sublayer[0].norm(x)
        new = self.self_attn.project_kv(norm_x, norm_x)  # (b, n, h, d) each
        cache = (self.cached_key, self.cached_value, self.cache_index)
        keys, values, offset, fits = append(*cache, new.keys, new.values)  # (b, h, max_len, d)
        slots = jnp.arange(keys.shape[-2])  # (max_len,)
        positions = offset + jnp.arange(x.shape[1])  # (n,) the new tokens'
        self_mask = (slots[None, :] <= positions[:, None])[None]  # (1, n, max_len)
        kv_self = ProjectedKV(keys, values)

        def self_attention(x):
            out = self.self_attn._forward(x, kv_self, self_mask, kv_layout="hsd")
            return poison_unless(fits, out)  # (b, n, d)

        x = self.sublayer[0](x, self_attention)
        x = self.sublayer[1](x, lambda x: self.src_attn(x, mask=src_mask, kv=kv_memory))
        return self.sublayer[2](x, self.feed_forward)


class Encoder(nnx.Module):
    """``N`` layers, then ``norm``."""

    def __init__(self, layers: list, size: int, *, norm):
        self.layers = nnx.List(layers)
        self.norm = LayerNorm(size, **norm)

    def __call__(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)


class Decoder(nnx.Module):
    """``N`` layers, then ``norm``; with decode caches (``init_cache``), ``step`` runs new
    tokens through every layer's cache."""

    def __init__(self, layers: list, size: int, *, norm):
        self.layers = nnx.List(layers)
        self.norm = LayerNorm(size, **norm)

    def __call__(self, x, memory, src_mask, tgt_mask):
        for layer in self.layers:
            x = layer(x, memory, src_mask, tgt_mask)
        return self.norm(x)

    def init_cache(self, batch_size, max_length: int | None = None, dtype=None) -> None:
        """An empty decode cache in every layer (``DecoderLayer.init_cache``)."""
        for layer in self.layers:
            layer.init_cache(batch_size, max_length, dtype)

    def clear_cache(self) -> None:
        """Drop every layer's decode cache."""
        for layer in self.layers:
            layer.clear_cache()

    def cached_length(self) -> jax.Array:
        """Tokens in the decode caches, the next one's position (int32; traced inside jit)."""
        return self.layers[0].cached_length()

    def cache_capacity(self) -> int | None:
        """The decode caches' ``max_length``; ``None`` without caches."""
        return self.layers[0].cache_capacity()

    def project_memory(self, memory) -> list[ProjectedKV]:
        """Each layer's source-attention keys and values of ``memory``, projected once."""
        return [layer.project_memory(memory) for layer in self.layers]

    def step(self, x, kv_memory: list[ProjectedKV], src_mask):
        """``x`` ``(b, n, d)`` through every layer's ``step`` (``kv_memory``: one
        ``project_memory`` per layer), then ``norm``."""
        for layer, kv in zip(self.layers, kv_memory, strict=True):
            x = layer.step(x, kv, src_mask)
        return self.norm(x)


class EncoderDecoder(nnx.Module):
    """The post's ``EncoderDecoder``: ``model(src, tgt, src_mask, tgt_mask)`` is the decoder's
    output ``(b, t, d)`` (log-probabilities: ``model.generator`` of it).

    Decoding with the decoder layers' caches (``flax_attention.cache``'s, as the causal layers
    keep): ``init_cache(batch_size, max_length)``, ``memory = encode(src, src_mask)``,
    ``kv_memory = project_memory(memory)`` once, then ``decode_cached(kv_memory, src_mask,
    tgt)`` for each chunk of new target tokens; ``clear_cache()`` after. ``greedy_decode``
    runs exactly that in one jit."""

    def __init__(self, encoder, decoder, src_embed, tgt_embed, generator):
        self.encoder = encoder
        self.decoder = decoder
        self.src_embed = src_embed
        self.tgt_embed = tgt_embed
        self.generator = generator

    def __call__(self, src, tgt, src_mask, tgt_mask):
        """Take in and process masked src and target sequences."""
        return self.decode(self.encode(src, src_mask), src_mask, tgt, tgt_mask)

    def encode(self, src, src_mask):
        """``src`` ``(b, s)`` ids, ``src_mask`` ``(b, 1, s)`` -> ``memory`` ``(b, s, d)``."""
        tokens = np.shape(src)[1] if _ndim(src) == 2 else 0
        src_mask = _check_post_mask("src_mask", src_mask, np.shape(src)[0], tokens, tokens)
        return self.encoder(_embed(self.src_embed, "src", src), src_mask)

    def decode(self, memory, src_mask, tgt, tgt_mask):
        """``tgt`` ``(b, t)`` ids and ``tgt_mask`` ``(b, t, t)`` on ``memory`` ``(b, s, d)``
        -> ``(b, t, d)``."""
        tokens = np.shape(tgt)[1] if _ndim(tgt) == 2 else 0
        src_mask = _check_post_mask("src_mask", src_mask, memory.shape[0], tokens, memory.shape[1])
        tgt_mask = _check_post_mask("tgt_mask", tgt_mask, np.shape(tgt)[0], tokens, tokens)
        return self.decoder(_embed(self.tgt_embed, "tgt", tgt), memory, src_mask, tgt_mask)

    # ---- decoding ------------------------------------------------------------------------------

    def init_cache(self, batch_size, max_length: int | None = None, dtype=None) -> None:
        """An empty decode cache of ``max_length`` tokens (default: the positional table's
        ``max_len``) in every decoder layer (``DecoderLayer.init_cache``)."""
        self.decoder.init_cache(batch_size, max_length, dtype)

    def clear_cache(self) -> None:
        """Drop the decode caches (back to the state of a new model)."""
        self.decoder.clear_cache()

    def project_memory(self, memory) -> list[ProjectedKV]:
        """The encoder's ``memory`` ``(b, s, d)`` through every source attention's keys and
        values, once for a whole decode (``decode_cached``)."""
        return self.decoder.project_memory(memory)

    def decode_cached(self, kv_memory: list[ProjectedKV], src_mask, tgt):
        """``decode`` of the next target tokens ``tgt`` ``(b, n)`` continuing the sequence in
        the decode caches (``init_cache`` first; their positions count from the caches'
        length), on the memory as ``project_memory`` gave it -> ``(b, n, d)``."""
        _check_ids(self.tgt_embed, "tgt", tgt)
        x = self.tgt_embed[0](tgt)  # (b, n, d)
        x = self.tgt_embed[1].at(x, self.decoder.cached_length())
        return self.decoder.step(x, kv_memory, src_mask)

    def model_axis_sizes(self) -> dict[str, int]:
        """Nothing of the model itself splits over ``model`` (its layers say what they split)."""
        return {}


register(EncoderDecoder, Names(model=encoder_decoder_names))  # the post's names (linears.{i})


def _ndim(x) -> int:
    return len(np.shape(x))


def _embed(embed, name: str, ids):
    """``ids`` ``(b, t)`` integers below the embedding's vocabulary, through ``embed``."""
    _check_ids(embed, name, ids)
    return embed[1](embed[0](ids))


def _check_ids(embed, name: str, ids) -> None:
    """``ids`` ``(b, t)``: integers, no more than ``embed``'s positional table holds, and (when
    concrete) below its vocabulary."""
    if _ndim(ids) != 2:
        raise ValueError(f"{name}.ndim ({_ndim(ids)}, shape {np.shape(ids)}) must be 2 (b, tokens)")
    if not jnp.issubdtype(jnp.asarray(ids).dtype, jnp.integer):
        raise TypeError(f"{name} (dtype {jnp.asarray(ids).dtype}) must hold integer token ids")
    table = embed[1].pe.shape[1]
    if np.shape(ids)[1] > table:
        raise ValueError(
            f"{name} tokens ({np.shape(ids)[1]}) must not exceed the positional table's max_len "
            f"({table})"
        )
    vocab = embed[0].lut.num_embeddings
    if not isinstance(ids, jax.core.Tracer) and np.asarray(ids).size:
        low, high = int(np.min(ids)), int(np.max(ids))
        if low < 0 or high >= vocab:
            raise ValueError(
                f"{name} (ids {low}..{high}) must lie in 0..{vocab - 1} (vocab {vocab})"
            )


def _check_post_mask(name: str, mask, batch: int, queries: int | None, keys: int):
    """``mask`` must broadcast to ``(batch, queries, keys)`` (3-D; ``queries`` ``None``: any)."""
    shape = tuple(np.shape(mask))
    rows_ok = len(shape) == 3 and (queries is None or shape[1] in (1, queries))
    if not rows_ok or shape[0] not in (1, batch) or shape[2] != keys:
        rows = "q" if queries is None else f"{queries} or 1"
        raise ValueError(f"{name}.shape ({shape}) must broadcast to ({batch} or 1, {rows}, {keys})")
    return mask


def make_model(
    src_vocab: int,
    tgt_vocab: int,
    N: int = 6,
    d_model: int = 512,
    d_ff: int = 2048,
    h: int = 8,
    dropout: float = 0.1,
    *,
    rngs: nnx.Rngs,
    attention_dropout: float = 0.1,
    max_len: int = 5000,
    dtype=None,
    param_dtype=jnp.float32,
    precision=None,
    implementation: Implementation | None = None,
) -> EncoderDecoder:
    """The post's ``make_model``: ``N`` encoder and decoder layers, initialised as the post
    does (Glorot/Xavier uniform for every parameter of rank > 1, torch's defaults for the
    rest). ``attention_dropout``: every attention's dropout (the post's layers keep their
    default 0.1, whatever ``dropout`` is). ``implementation``: the attention core's
    (``None``: the fastest for each call; the layers keep no attention weights)."""
    sizes = {
        "src_vocab": src_vocab,
        "tgt_vocab": tgt_vocab,
        "N": N,
        "d_model": d_model,
        "d_ff": d_ff,
        "h": h,
        "max_len": max_len,
    }
    for name, value in sizes.items():
        check_positive_int(name, value)
    check_dropout(dropout)
    check_dropout(attention_dropout)
    options = LayerOptions(dtype, param_dtype, precision, implementation)
    linear, norm = options.linear(rngs), options.norm()
    attn = functools.partial(
        MultiHeadedAttention,
        h,
        d_model,
        attention_dropout,
        keep_attention_score=False,
        **options.attention(),
        rngs=rngs,
    )

    def ff():
        return PositionwiseFeedForward(d_model, d_ff, dropout, linear=linear, rngs=rngs)

    def embed(vocab):
        return nnx.List(
            [
                Embeddings(d_model, vocab, **norm, rngs=rngs),
                PositionalEncoding(d_model, dropout, max_len, rngs=rngs),
            ]
        )

    layer = functools.partial(EncoderLayer, norm=norm, rngs=rngs)
    encoder = Encoder([layer(d_model, attn(), ff(), dropout) for _ in range(N)], d_model, norm=norm)
    layer = functools.partial(DecoderLayer, norm=norm, rngs=rngs, context_length=max_len)
    decoder = Decoder(
        [layer(d_model, attn(), attn(), ff(), dropout) for _ in range(N)], d_model, norm=norm
    )
    model = EncoderDecoder(
        encoder,
        decoder,
        embed(src_vocab),
        embed(tgt_vocab),
        Generator(d_model, tgt_vocab, linear=linear),
    )
    # "This was important from their code. Initialize parameters with Glorot / fan_avg."
    glorot = jax.nn.initializers.glorot_uniform()
    for _, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param) and param.ndim > 1:
            param.set_value(glorot(rngs.params(), param.shape, param.dtype))
    return model


# ---- masks and batches ----------------------------------------------------------------------


def subsequent_mask(size: int) -> np.ndarray:
    """``(1, size, size)`` bool: ``True`` on and below the diagonal (what a position may see)."""
    check_positive_int("size", size)
    return np.triu(np.ones((1, size, size), np.uint8), k=1) == 0


class Batch:
    """The post's ``Batch``: ``src`` ``(b, s)`` and ``src_mask`` ``(b, 1, s)`` (``src !=
    pad``); with ``tgt`` ``(b, t + 1)``: ``tgt`` its first ``t`` tokens, ``tgt_y`` its last
    ``t``, ``tgt_mask`` ``(b, t, t)`` (not padding and not future) and ``ntokens`` (``tgt_y``'s
    tokens other than ``pad``). NumPy arrays."""

    def __init__(self, src, tgt=None, pad: int = 2):  # 2 = <blank>
        self.src = np.asarray(src)
        self.src_mask = (self.src != pad)[:, None, :]
        if tgt is not None:
            tgt = np.asarray(tgt)
            self.tgt = tgt[:, :-1]
            self.tgt_y = tgt[:, 1:]
            self.tgt_mask = self.make_std_mask(self.tgt, pad)
            self.ntokens = int((self.tgt_y != pad).sum())

    @staticmethod
    def make_std_mask(tgt, pad: int) -> np.ndarray:
        """Create a mask to hide padding and future words: ``(b, t, t)`` bool."""
        tgt = np.asarray(tgt)
        return (tgt != pad)[:, None, :] & subsequent_mask(tgt.shape[-1])


def data_gen(V: int, batch_size: int, nbatches: int, *, rng: np.random.Generator | None = None):
    """The post's copy task: ``nbatches`` batches of ``batch_size`` rows of 10 ids in
    ``1..V-1``, the first 1 (the start symbol), ``src == tgt``, padding id 0."""
    rng = np.random.default_rng() if rng is None else rng
    for _ in range(nbatches):
        data = rng.integers(1, V, size=(batch_size, 10))
        data[:, 0] = 1
        yield Batch(data, data.copy(), 0)


# ---- training ------------------------------------------------------------------------------


class LabelSmoothing:
    """The post's label smoothing as a loss: ``KLDivLoss(reduction="sum")`` of the
    log-probabilities ``x`` ``(n, size)`` against ``true_dist``: ``1 - smoothing`` on the
    target, ``smoothing / (size - 2)`` on every other class but the padding column, and rows
    whose target is ``padding_idx`` all zero."""

    def __init__(self, size: int, padding_idx: int, smoothing: float = 0.0):
        check_int("size", size, 3, why="smoothing spreads over size - 2")
        check_int("padding_idx", padding_idx, 0)
        if padding_idx >= size:
            raise ValueError(f"padding_idx ({padding_idx}) must lie in 0..{size - 1}")
        check_rate("smoothing", smoothing, "the mass spread over the other classes")
        self.size = size
        self.padding_idx = padding_idx
        self.smoothing = smoothing
        self.confidence = 1.0 - smoothing

    def true_dist(self, target):
        """``(n, size)``: the smoothed targets of ``target`` ``(n,)``."""
        fill = self.smoothing / (self.size - 2)
        one_hot = jax.nn.one_hot(target, self.size, dtype=jnp.float32)  # (n, size)
        dist = jnp.where(one_hot > 0, self.confidence, fill)
        dist = dist.at[:, self.padding_idx].set(0.0)
        return jnp.where((target == self.padding_idx)[:, None], 0.0, dist)

    def __call__(self, x, target):
        if x.ndim != 2 or x.shape[1] != self.size:
            raise ValueError(f"x.shape ({x.shape}) must be (n, size {self.size})")
        dist = self.true_dist(target)
        # torch's kl_div: target * (log(target) - x), 0 where the target is 0
        return jnp.sum(
            jnp.where(dist > 0, dist * (jnp.log(jnp.where(dist > 0, dist, 1.0)) - x), 0.0)
        )


def rate(step, model_size, factor, warmup):
    """The post's schedule: ``factor * model_size**-0.5 * min(step**-0.5, step *
    warmup**-1.5)``, step 0 counted as 1 (``LambdaLR`` calls it from 0)."""
    step = jnp.maximum(step, 1)
    return factor * (model_size ** (-0.5) * jnp.minimum(step ** (-0.5), step * warmup ** (-1.5)))


def rate_schedule(model_size: int, factor: float, warmup: int, base_lr: float = 1.0):
    """An optax schedule stepping as the post's ``LambdaLR(optimizer, lambda step: rate(step,
    ...))`` on a learning rate of ``base_lr``: update ``k`` (from 0) uses ``base_lr * rate(k)``."""
    for name, value in (("model_size", model_size), ("warmup", warmup)):
        check_positive_int(name, value)

    def schedule(count):
        return base_lr * rate(jnp.asarray(count, jnp.float32), model_size, factor, warmup)

    return schedule


def adam(model_size: int, factor: float = 1.0, warmup: int = 400, base_lr: float = 0.5):
    """The post's optimiser: Adam with ``betas=(0.9, 0.98)``, ``eps=1e-9`` on ``rate``'s
    schedule (``example_simple_model``'s defaults)."""
    return optax.adam(rate_schedule(model_size, factor, warmup, base_lr), b1=0.9, b2=0.98, eps=1e-9)


def loss_compute(model: EncoderDecoder, criterion: LabelSmoothing, batch):
    """The post's ``SimpleLossCompute`` of a forward: ``criterion(generator(out), tgt_y) /
    ntokens`` (what ``backward`` runs on)."""
    src, tgt, src_mask, tgt_mask, tgt_y, ntokens = batch
    out = model(src, tgt, src_mask, tgt_mask)  # (b, t, d)
    x = model.generator(out)  # (b, t, V)
    return criterion(x.reshape(-1, x.shape[-1]).astype(jnp.float32), tgt_y.reshape(-1)) / ntokens


@functools.partial(nnx.jit, static_argnums=2)
def _train_step(model, optimizer, criterion, batch):
    loss, grads = nnx.value_and_grad(loss_compute)(model, criterion, batch)
    optimizer.update(model, grads)
    return loss


def train_step(
    model: EncoderDecoder, optimizer: nnx.Optimizer, criterion: LabelSmoothing, batch: Batch
):
    """One step of the post's ``run_epoch`` in ``"train"`` mode: the loss of ``batch`` over its
    ``ntokens``, its gradient, the optimiser's update. Returns that loss (the post's ``sloss``;
    its ``loss`` value is ``sloss * ntokens``)."""
    arrays = (
        batch.src,
        batch.tgt,
        batch.src_mask,
        batch.tgt_mask,
        batch.tgt_y,
        jnp.float32(batch.ntokens),
    )
    return _train_step(model, optimizer, criterion, arrays)


# ---- greedy decoding -------------------------------------------------------------------------


def greedy_decode(model: EncoderDecoder, src, src_mask, max_len: int, start_symbol: int):
    """The post's ``greedy_decode`` for a batch: ``(b, max_len)`` ids, ``start_symbol`` first,
    then ``max_len - 1`` greedy tokens per row, each row the post's loop on that source alone.

    In one jit: the encoder once, each source attention's keys and values projected once, and
    each decoder self-attention reading a cache of the steps so far (``init_cache`` of
    ``max_len`` tokens, dropped afterwards; its keys and values written one token per step),
    instead of the post's whole decoder run again per token."""
    check_instance("model", model, EncoderDecoder, "an EncoderDecoder")
    check_int("max_len", max_len, 1, why="the start symbol included")
    table = model.tgt_embed[1].pe.shape[1]
    check_at_most("max_len", max_len, "the positional table's max_len", table)
    vocab = model.tgt_embed[0].lut.num_embeddings
    check_int("start_symbol", start_symbol, 0)
    if not 0 <= start_symbol < vocab:
        raise ValueError(f"start_symbol ({start_symbol}) must lie in 0..{vocab - 1}")
    if _ndim(src) == 2 and not isinstance(src, jax.core.Tracer):
        low, high = int(np.min(src)), int(np.max(src))
        src_vocab = model.src_embed[0].lut.num_embeddings
        if low < 0 or high >= src_vocab:
            raise ValueError(f"src (ids {low}..{high}) must lie in 0..{src_vocab - 1}")
    src = jnp.asarray(src)
    _check_post_mask(
        "src_mask", src_mask, src.shape[0], None, src.shape[1] if _ndim(src) == 2 else 0
    )
    mesh = parameters_mesh(model)
    if mesh is not None and src.shape[0] % mesh_axis_size(mesh, DATA):
        raise ValueError(
            f"src batch ({src.shape[0]}) must be divisible by the mesh's data axis "
            f"({mesh_axis_size(mesh, DATA)}): the model is sharded, and its decoder's caches "
            "split the batch over data"
        )
    return _decode_in_eval_mode(model, src, jnp.asarray(src_mask), max_len, start_symbol)


@in_eval_mode
def _decode_in_eval_mode(model, src, src_mask, max_len: int, start_symbol: int):
    """``_greedy_decode`` on ``model`` in eval mode (its dropout modes put back after), with
    decode caches of ``max_len`` tokens, dropped afterwards."""
    model.init_cache(src.shape[0], max_len)
    try:
        graphdef, weights, state = split_for_decode(model, _CONSTANT)
        return _greedy_decode(
            graphdef, weights, state, src, src_mask, max_len=max_len, start_symbol=start_symbol
        )
    finally:
        model.clear_cache()


#: What ``greedy_decode``'s loop holds constant: everything but the decode caches.
_CONSTANT = nnx.Not(nnx.Cache)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "start_symbol"))
def _greedy_decode(graphdef, weights, state, src, src_mask, *, max_len, start_symbol):
    """The encoder once, each source attention's keys and values projected once
    (``project_memory``); then ``max_len - 1`` ``decode_step``s, one token each through the
    decoder layers' caches (``state``: empty caches of ``max_len`` tokens)."""
    model = nnx.merge(graphdef, weights, state)
    memory = model.encode(src, src_mask)  # (b, s, d)
    kv_memory = model.project_memory(memory)  # per decoder layer: (b, s, h, d) twice
    step = functools.partial(
        decode_step, graphdef, weights, head=_log_probs, weights_filter=_CONSTANT
    )
    ys = jnp.full_like(src[:, :1], start_symbol, jnp.int32)  # (b, 1)
    ys = jnp.broadcast_to(ys, (src.shape[0], max_len))  # (b, max_len)

    def body(i, carry):
        state, ys = carry
        word = jax.lax.dynamic_slice_in_dim(ys, i, 1, axis=1)  # (b, 1), at position i
        state, prob = step(state, _decode_cached, kv_memory, src_mask, word)  # (b, V)
        next_word = jnp.argmax(prob, axis=-1).astype(jnp.int32)  # (b,)
        return state, jax.lax.dynamic_update_slice_in_dim(ys, next_word[:, None], i + 1, axis=1)

    return jax.lax.fori_loop(0, max_len - 1, body, (state, ys))[1]


def _decode_cached(model, kv_memory, src_mask, word):
    """``greedy_decode``'s forward: ``word`` ``(b, 1)`` through the decoder's caches ->
    ``(b, 1, d)``."""
    return model.decode_cached(kv_memory, src_mask, word)


def _log_probs(model, x):
    """``greedy_decode``'s head: the generator's log-probabilities ``(b, V)``."""
    return model.generator(x)
