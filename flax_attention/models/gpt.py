"""The book's chapter 4 ``GPTModel`` in Flax NNX, on ``flax_attention.MultiHeadAttention``.

Chapter 4 of "Build a Large Language Model (From Scratch)" (Sebastian Raschka;
`code <https://github.com/rasbt/LLMs-from-scratch/tree/main/ch04>`_) builds GPT-2 from chapter
3's ``MultiHeadAttention`` with four small modules, each mirrored here with the book's attribute
names, so the book's torch ``state_dict`` loads as it is (``flax_attention.load_state_dict``):

==============================  ===========================================================
book (torch)                    here
==============================  ===========================================================
``LayerNorm(emb_dim)``          ``LayerNorm``: ``scale``, ``shift``, eps 1e-5, biased variance
``GELU()``                      ``GELU``: the tanh approximation, as the book writes it
``FeedForward(cfg)``            ``FeedForward``: ``layers`` = Linear(d, 4d), GELU, Linear(4d, d)
``TransformerBlock(cfg)``       ``TransformerBlock``: ``att``, ``ff``, ``norm1``, ``norm2``,
                                ``drop_resid``; pre-norm, shortcut around each half
``GPTModel(cfg)``               ``GPTModel``: ``tok_emb``, ``pos_emb``, ``drop_emb``,
                                ``trf_blocks``, ``final_norm``, ``out_head``
==============================  ===========================================================

``cfg`` is the book's dict (``GPT_CONFIG_124M`` and its siblings) plus one optional key,
``tie_word_embeddings``: the head reads the token embedding (GPT-2's checkpoints, Hugging Face's
``GPT2LMHeadModel``) instead of an ``out_head`` of its own (the book's model).

Shape legend: ``b`` batch, ``t`` tokens of a call, ``d`` = ``emb_dim``, ``V`` = ``vocab_size``,
``s`` key slots (``t``, or the decode cache's ``max_length``).

Flax additions, all keyword-only so the book's calls read the same: ``rngs``, ``dtype``,
``param_dtype``, ``precision``, ``implementation`` (the attention's); ``model(idx, decode=True)``
continues the sequence held in the attention layers' caches (``init_cache``), and
``attention_mask`` (``(b, s)``, 1 for a token, 0 for left padding) gives each row positions
counted from its first token and hides the padding, as transformers does.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from flax_attention._checks import check_bool, check_int, check_positive_int, check_rate
from flax_attention._inputs import check_model_inputs
from flax_attention._layers import Dropout, Embed, LayerOptions, rows_dot_general
from flax_attention.cache import padded_positions
from flax_attention.core import Implementation
from flax_attention.layouts import ModelNames, Names, gpt_model_names, register
from flax_attention.mesh import (
    FROM_HEADS,
    TO_HEADS,
    LinearAxes,
)
from flax_attention.models import checkpoints
from flax_attention.modern import (
    GroupedQueryAttention,
    MultiHeadAttentionWithSWA,
    MultiHeadLatentAttention,
)
from flax_attention.multihead import MultiHeadAttention

__all__ = [
    "CONFIG_KEYS",
    "Config",
    "DecoderModel",
    "GPT_CONFIG_124M",
    "GELU",
    "FeedForward",
    "GPTModel",
    "LayerNorm",
    "TransformerBlock",
    "check_config",
    "check_model_dtypes",
]

#: The book's configuration of GPT-2 small (chapter 4), untied head.
GPT_CONFIG_124M = {
    "vocab_size": 50257,
    "context_length": 1024,
    "emb_dim": 768,
    "n_heads": 12,
    "n_layers": 12,
    "drop_rate": 0.1,
    "qkv_bias": False,
}

#: Every key ``cfg`` must have (the book's), and the optional one with its default.
CONFIG_KEYS = tuple(GPT_CONFIG_124M)
OPTIONAL_KEYS = {"tie_word_embeddings": False}
#: The book's chapter 4 bonus variants, by the config keys that make them (absent: GPT-2's
#: attention): grouped-query (``n_kv_groups``), latent (``latent_dim``), sliding window
#: (``sliding_window_size`` with ``sliding_window_stride``, the K:1 schedule of window and full
#: layers: ``K > 0`` K window layers then one full, 0 every layer full, negative every layer a
#: window).
VARIANT_KEYS = ("n_kv_groups", "latent_dim", "sliding_window_size", "sliding_window_stride")

#: The head's mesh axes: replicated. GPT-2's vocabulary (50257) divides over no mesh axis, and
#: a replicated head reads its whole kernel per device, which a decode step needs anyway.
_REPLICATED = LinearAxes(kernel=(None, None), bias=(None,))


def _frozen(value):
    """``value`` with its mappings and lists made tuples: hashable (Llama 3's ``rope_freq``)."""
    if isinstance(value, Mapping):
        return tuple((key, _frozen(item)) for key, item in value.items())
    if isinstance(value, list | tuple):
        return tuple(_frozen(item) for item in value)
    return value


class Config(Mapping):
    """The model's ``cfg``, read-only and hashable (part of the model's static structure, so
    ``jit`` can key its compilations on it); ``dict(model.cfg)`` gives the book's dict."""

    def __init__(self, cfg: Mapping):
        if not isinstance(cfg, Mapping):
            raise TypeError(f"cfg ({cfg!r}) must be a mapping (a dict of the model's settings)")
        self._items = dict(cfg)

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)

    def __hash__(self):
        return hash(_frozen(self._items))

    def __eq__(self, other):
        return isinstance(other, Mapping) and dict(self) == dict(other)

    def __repr__(self):
        return repr(self._items)


def check_config(cfg) -> dict:
    """``cfg`` as a complete dict (the optional key filled in), or a ``ValueError``/``TypeError``
    naming the first unknown, missing or ill-typed key."""
    if not isinstance(cfg, Mapping):
        raise TypeError(f"cfg ({type(cfg).__name__}) must be a dict with keys {CONFIG_KEYS}")
    known = CONFIG_KEYS + tuple(OPTIONAL_KEYS) + VARIANT_KEYS
    unknown = sorted(set(cfg) - set(known))
    if unknown:
        raise ValueError(f"cfg key {unknown[0]!r} must be one of {known} (unknown keys: {unknown})")
    missing = [key for key in CONFIG_KEYS if key not in cfg]
    if missing:
        raise ValueError(f"cfg must have key {missing[0]!r} (missing: {missing})")
    cfg = {**OPTIONAL_KEYS, **cfg}
    for key in ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers"):
        check_positive_int(f"cfg[{key!r}]", cfg[key])
    if cfg["emb_dim"] % cfg["n_heads"] != 0:
        raise ValueError(
            f"cfg['emb_dim'] ({cfg['emb_dim']}) must be divisible by cfg['n_heads'] "
            f"({cfg['n_heads']})"
        )
    check_rate("cfg['drop_rate']", cfg["drop_rate"], "the probability of zeroing")
    for key in ("qkv_bias", "tie_word_embeddings"):
        check_bool(f"cfg[{key!r}]", cfg[key])
    _check_variant(cfg)
    return cfg


def _check_variant(cfg) -> None:
    """At most one of the book's variants, its keys complete and valid."""
    given = [key for key in ("n_kv_groups", "latent_dim", "sliding_window_size") if key in cfg]
    if len(given) > 1:
        raise ValueError(f"cfg keys {given} must not be combined: one attention variant a model")
    if ("sliding_window_size" in cfg) != ("sliding_window_stride" in cfg):
        missing = "sliding_window_stride" if "sliding_window_size" in cfg else "sliding_window_size"
        raise ValueError(f"cfg must have key {missing!r} with the other (the book's SWA model)")
    for key in ("n_kv_groups", "latent_dim", "sliding_window_size"):
        if key in cfg:
            check_positive_int(f"cfg[{key!r}]", cfg[key])
    if "sliding_window_stride" in cfg:
        check_int("cfg['sliding_window_stride']", cfg["sliding_window_stride"])
    if "n_kv_groups" in cfg and cfg["n_heads"] % cfg["n_kv_groups"]:
        raise ValueError(
            f"cfg['n_heads'] ({cfg['n_heads']}) must be divisible by cfg['n_kv_groups'] "
            f"({cfg['n_kv_groups']})"
        )


def _window_layer(cfg, i: int) -> bool:
    """Whether block ``i`` of the book's SWA model has the window: its K:1 schedule."""
    stride = int(cfg["sliding_window_stride"])
    if stride <= 0:
        return stride < 0  # 0: every layer full; negative: every layer a window
    return i % (stride + 1) < stride


#: What ``dtype`` and ``param_dtype`` take, as the messages name them.
_FLOATING = "jnp.float32, jnp.bfloat16, jnp.float16 or jnp.float64"


def check_model_dtypes(dtype, param_dtype) -> None:
    """``dtype`` (``None``, or the dtype the model computes in) and ``param_dtype`` (the
    parameters') must be floating dtypes: a ``TypeError`` naming the argument and the value
    otherwise (an integer ``param_dtype`` would reach JAX's initialisers, whose message names
    neither; an integer ``dtype`` would fail only at the first call, in the attention)."""
    for name, value, optional in (("dtype", dtype, True), ("param_dtype", param_dtype, False)):
        if value is None and optional:
            continue
        try:
            found = None if value is None else jnp.dtype(value)
        except TypeError:  # not a dtype at all ('bogus', a list, ...)
            found = None
        if found is None or not jnp.issubdtype(found, jnp.floating):
            shown = repr(value) if found is None else found.name
            rule = "None or a floating dtype" if optional else "a floating dtype"
            raise TypeError(f"{name} ({shown}) must be {rule} ({_FLOATING})")


class LayerNorm(nnx.Module):
    """The book's ``LayerNorm``: ``scale * (x - mean) / sqrt(var + eps) + shift`` over the last
    axis, biased variance, ``eps = 1e-5``; computed in at least float32, cast back."""

    def __init__(self, emb_dim: int, *, dtype=None, param_dtype=jnp.float32):
        check_positive_int("emb_dim", emb_dim)
        self.eps = 1e-5
        self.dtype = dtype
        self.scale = nnx.Param(jnp.ones((emb_dim,), param_dtype))  # replicated on a mesh
        self.shift = nnx.Param(jnp.zeros((emb_dim,), param_dtype))

    def __call__(self, x):
        dtype = self.dtype or jnp.result_type(x, self.scale[...])
        x32 = x.astype(jnp.promote_types(dtype, jnp.float32))
        centered = x32 - x32.mean(axis=-1, keepdims=True)  # (..., d)
        var = (centered * centered).mean(axis=-1, keepdims=True)  # (..., 1), unbiased=False
        # The centred values once and rsqrt, not jnp.var and a division: the same variance, and
        # XLA's CPU code for the gradient is faster (docs/performance.md).
        norm_x = centered * jax.lax.rsqrt(var + self.eps)
        lead = (1,) * (x.ndim - 1)  # explicit broadcasts: rank promotion may raise
        scale = self.scale[...].astype(x32.dtype).reshape(*lead, -1)  # (..., d)
        shift = self.shift[...].astype(x32.dtype).reshape(*lead, -1)  # (..., d)
        return (scale * norm_x + shift).astype(dtype)


class GELU(nnx.Module):
    """The book's ``GELU``: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.

    Computed as ``x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))``, the same function
    (``(1 + tanh(z)) / 2 = sigmoid(2 z)``). For negative ``x``, ``1 + tanh`` cancels: XLA's
    float32 ``tanh`` on CPU errs by up to 2.2e-7 (torch's by 3.2e-8), which made the tanh form
    up to 63000 ulp off at ``x`` in (-4, -1) (torch's 8100); the sigmoid has no cancellation,
    18 ulp there. Adam turns those errors in small gradients into steps: a 5-step parity run
    against transformers drifted 1.04e-5 with the tanh form, 6.6e-6 with this one.
    """

    def __call__(self, x):
        return x * jax.nn.sigmoid(2 * math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))


class FeedForward(nnx.Module):
    """The book's ``FeedForward``: ``layers`` = Linear(d, 4d), GELU, Linear(4d, d).

    On a mesh the first Linear splits its output features over ``model`` and the second its
    input features (as the attention's projections into and out of heads), so the MLP costs one
    all-reduce."""

    def __init__(self, cfg, *, dtype=None, param_dtype=jnp.float32, precision=None, rngs):
        cfg = check_config(cfg)
        linear = LayerOptions(dtype, param_dtype, precision).linear(rngs)
        d = cfg["emb_dim"]
        self.layers = nnx.List(
            [linear(d, 4 * d, axes=TO_HEADS), GELU(), linear(4 * d, d, axes=FROM_HEADS)]
        )

    def model_axis_sizes(self) -> dict[str, int]:
        """What ``flax_attention.shard`` splits over ``model``: the hidden features."""
        return {"4 * emb_dim": self.layers[0].out_features}

    def __call__(self, x):
        hidden = self.layers[1](self.layers[0](x))  # (b, t, 4d)
        return self.layers[2](hidden)  # (b, t, d)


class BlockCache:
    """A block's decode cache is its attention's (``att``): what a model asks its blocks
    (``TransformerBlock`` here, ``models.decoder.TransformerBlock``)."""

    def init_cache(self, batch_size, max_length: int | None = None, dtype=None) -> None:
        """An empty decode cache in the attention (``MultiHeadAttention.init_cache``)."""
        self.att.init_cache(batch_size, max_length, dtype)

    def clear_cache(self) -> None:
        """Drop the attention's decode cache."""
        self.att.clear_cache()

    def cached_length(self) -> jax.Array:
        """Tokens in the decode cache, the next one's position (int32; traced inside jit)."""
        return self.att.cached_length()

    def cache_capacity(self) -> int | None:
        """The decode cache's ``max_length``; ``None`` without a cache."""
        return self.att.cache_capacity()


class TransformerBlock(BlockCache, nnx.Module):
    """The book's ``TransformerBlock``: ``x + drop_resid(att(norm1(x)))``, then
    ``x + drop_resid(ff(norm2(x)))``.

    Its decode cache is its attention's (``flax_attention.cache``); the model asks the block
    through ``init_cache``, ``clear_cache``, ``cached_length`` and ``cache_capacity``."""

    def __init__(
        self,
        cfg,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        implementation: Implementation | None = None,
        rngs: nnx.Rngs,
    ):
        cfg = check_config(cfg)
        options = LayerOptions(dtype, param_dtype, precision, implementation)
        d, heads, rate = cfg["emb_dim"], cfg["n_heads"], cfg["drop_rate"]
        common = dict(context_length=cfg["context_length"], qkv_bias=cfg["qkv_bias"])
        common.update(options.attention(), rngs=rngs)
        if "n_kv_groups" in cfg:  # the book's variants: ch04/04_gqa, 05_mla, 06_swa
            self.att = GroupedQueryAttention(d, d, rate, heads, cfg["n_kv_groups"], **common)
        elif "latent_dim" in cfg:
            self.att = MultiHeadLatentAttention(
                d, d, rate, heads, latent_dim=cfg["latent_dim"], **common
            )
        elif "sliding_window_size" in cfg:  # GPTModel sets each block's window (its schedule)
            self.att = MultiHeadAttentionWithSWA(
                d, d, rate, heads, sliding_window_size=cfg["sliding_window_size"], **common
            )
        else:
            common.pop("qkv_bias")
            self.att = MultiHeadAttention(
                d, d, dropout=rate, num_heads=heads, qkv_bias=cfg["qkv_bias"], **common
            )
        self.ff = FeedForward(cfg, **options.dense(), rngs=rngs)
        self.norm1 = LayerNorm(cfg["emb_dim"], **options.norm())
        self.norm2 = LayerNorm(cfg["emb_dim"], **options.norm())
        self.drop_resid = Dropout(cfg["drop_rate"], rngs=rngs)

    def __call__(self, x, *, decode: bool = False, mask=None):
        shortcut = x
        x = self.att._forward(self.norm1(x), decode=decode, mask=mask)  # (b, t, d)
        x = self.drop_resid(x) + shortcut
        shortcut = x
        x = self.ff(self.norm2(x))  # (b, t, d)
        return self.drop_resid(x) + shortcut


class DecoderModel(nnx.Module):
    """What the book's decoder-only models share beyond their blocks (``GPTModel``,
    ``models.qwen3.Qwen3Model``, ``models.llama3.Llama3Model``): ``tok_emb``, ``trf_blocks``
    (each with ``init_cache``, ``clear_cache``, ``cached_length``, ``cache_capacity``),
    ``out_head`` (``None``: tied to ``tok_emb``) and ``precision``; the decode caches, left
    padding's positions and the head (``generation.CausalLM``)."""

    # ---- decoding ------------------------------------------------------------------------------

    def init_cache(self, batch_size: int, max_length: int | None = None, dtype=None) -> None:
        """An empty decode cache of ``max_length`` tokens (default ``context_length``) in every
        block (``TransformerBlock.init_cache``: its attention's)."""
        for block in self.trf_blocks:
            block.init_cache(batch_size, max_length, dtype)

    def clear_cache(self) -> None:
        """Drop the decode caches (back to the state of a new model)."""
        for block in self.trf_blocks:
            block.clear_cache()

    def _positions(self, in_idx, decode: bool, attention_mask):
        """The model's door: ``in_idx`` ``(b, t)`` and ``attention_mask`` checked, then the
        tokens' positions (``(1, t)`` from 0 or the caches' length; with left padding ``(b, t)``
        counted from each row's first token, transformers' ``cumsum(mask) - 1``, padding at 0)
        and the key mask (``None``, or ``(b, 1, 1, s)`` hiding the padding)."""
        if jnp.ndim(in_idx) != 2:
            raise ValueError(
                f"in_idx.ndim ({jnp.ndim(in_idx)}, shape {jnp.shape(in_idx)}) must be 2 (b, t)"
            )
        check_model_inputs(
            in_idx, attention_mask, self.cfg["vocab_size"], self.cfg["context_length"]
        )
        batch, seq_len = in_idx.shape
        offset = self.trf_blocks[0].cached_length() if decode else 0
        if attention_mask is None:
            return (offset + jnp.arange(seq_len))[None], None  # (1, t)
        slots = self.trf_blocks[0].cache_capacity() if decode else seq_len
        if attention_mask.shape != (batch, slots):
            where = "the cache's max_length" if decode else "in_idx's tokens"
            raise ValueError(
                f"attention_mask.shape ({tuple(attention_mask.shape)}) must be (batch, {where}) "
                f"({(batch, slots)})"
            )
        return padded_positions(attention_mask, offset, seq_len)

    def logits(self, x):
        """The head: ``x`` ``(..., d)`` -> ``(..., V)``; tied, it contracts ``tok_emb``'s
        ``(V, d)`` matrix as stored."""
        if self.out_head is None:
            if hasattr(self.tok_emb, "attend") and not isinstance(self.tok_emb, nnx.Embed):
                return self.tok_emb.attend(x)  # an int8 embedding (models.quantize)
            embedding = self.tok_emb.embedding[...].astype(x.dtype)  # (V, d)
            contract = (((x.ndim - 1,), (1,)), ((), ()))
            return rows_dot_general(x, embedding, contract, precision=self.precision)
        return self.out_head(x)


class GPTModel(DecoderModel):
    """The book's ``GPTModel``: token ids ``in_idx`` ``(b, t)`` -> logits ``(b, t, V)``.

    Args:
      cfg: the book's dict (``vocab_size``, ``context_length``, ``emb_dim``, ``n_heads``,
        ``n_layers``, ``drop_rate``, ``qkv_bias``) and optionally ``tie_word_embeddings``
        (default ``False``: an ``out_head`` of its own, as the book; ``True``: the head is
        ``tok_emb``'s matrix, as GPT-2's checkpoints). An unknown or missing key is a
        ``ValueError`` naming it.
      rngs: parameters and dropout (``nnx.Rngs(seed)``).
      dtype, param_dtype, precision: as for the attention layers; every sublayer gets them.
      implementation: the attention core's (``None``: the fastest for the call).

    ``.eval()``/``.train()`` turn every dropout off and on. Checkpoints: the book's state dict
    through ``flax_attention.load_state_dict``/``state_dict``, Hugging Face GPT-2 through
    ``from_pretrained``/``save_pretrained`` (``flax_attention.models.checkpoints``).
    """

    #: Hugging Face ``model_type``s ``from_pretrained`` reads, in the weight bridge's layout.
    HF_MODEL_TYPES = ("gpt2",)
    HF_LAYOUT = "gpt2"

    def __init__(
        self,
        cfg,
        *,
        rngs: nnx.Rngs,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        implementation: Implementation | None = None,
    ):
        cfg = check_config(cfg)
        check_model_dtypes(dtype, param_dtype)
        self.cfg = Config(cfg)
        self.precision = precision
        options = LayerOptions(dtype, param_dtype, precision, implementation)  # checked above
        embed = functools.partial(
            Embed, **options.norm(), embedding_init=nnx.initializers.normal(1.0), rngs=rngs
        )  # torch's nn.Embedding draws from N(0, 1); replicated on a mesh
        self.tok_emb = embed(cfg["vocab_size"], cfg["emb_dim"])
        self.pos_emb = embed(cfg["context_length"], cfg["emb_dim"])
        self.drop_emb = Dropout(cfg["drop_rate"], rngs=rngs)
        self.trf_blocks = nnx.List(
            [
                TransformerBlock(cfg, **options.attention(), rngs=rngs)
                for _ in range(cfg["n_layers"])
            ]
        )
        if "sliding_window_size" in cfg:  # the book's K:1 schedule of window and full layers
            for i, block in enumerate(self.trf_blocks):
                if not _window_layer(cfg, i):
                    block.att.sliding_window_size = block.att.window = None
        self.final_norm = LayerNorm(cfg["emb_dim"], **options.norm())
        if cfg["tie_word_embeddings"]:
            self.out_head = nnx.data(None)
        else:
            self.out_head = options.linear(rngs)(
                cfg["emb_dim"], cfg["vocab_size"], use_bias=False, axes=_REPLICATED
            )

    # ---- the forward pass ------------------------------------------------------------------------

    def hidden_states(self, in_idx, *, decode: bool = False, attention_mask=None):
        """``in_idx`` ``(b, t)`` -> the final norm's output ``(b, t, d)`` (``__call__`` without
        the head)."""
        positions, key_mask = self._positions(in_idx, decode, attention_mask)
        tok_embeds = self.tok_emb(in_idx)  # (b, t, d)
        pos_embeds = self.pos_emb(positions)
        x = self.drop_emb(tok_embeds + pos_embeds)  # (b, t, d)
        for block in self.trf_blocks:
            x = block(x, decode=decode, mask=key_mask)  # (b, t, d)
        return self.final_norm(x)

    def __call__(self, in_idx, *, decode: bool = False, attention_mask=None):
        """Logits ``(b, t, V)`` of ``in_idx`` ``(b, t)`` (ints below ``vocab_size``).

        ``decode=True``: the tokens continue the sequence in the caches (``init_cache`` first);
        their positions start at the cache's index. ``attention_mask`` ``(b, s)`` (``s = t``, or
        the cache's ``max_length`` with ``decode``): 1 for a token, 0 for left padding."""
        return self.logits(self.hidden_states(in_idx, decode=decode, attention_mask=attention_mask))

    # ---- the weight bridge's names ------------------------------------------------------------

    def model_axis_sizes(self) -> dict[str, int]:
        """Nothing of the model itself splits over ``model`` (its blocks say what they split)."""
        return {}

    # ---- Hugging Face checkpoints ---------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, seed: int = 0, mesh=None, **options
    ) -> GPTModel:
        """A complete model (eval mode) from a local Hugging Face GPT-2 checkpoint directory
        (``flax_attention.models.checkpoints.load_pretrained``; a hub name is never
        downloaded): ``options`` are the keyword
        options above, ``seed`` seeds the dropout streams, ``mesh`` (a ``jax.sharding.Mesh``)
        places it as ``flax_attention.shard`` does, reading each process's slices only."""
        return checkpoints.load_pretrained(cls, path, seed=seed, mesh=mesh, **options)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write a checkpoint directory ``transformers.GPT2LMHeadModel.from_pretrained`` loads
        (``flax_attention.models.checkpoints.save_pretrained``)."""
        checkpoints.save_pretrained(self, path)

    def hf_config(self) -> dict:
        """The ``config.json`` ``save_pretrained`` writes (``checkpoints.config_to_hf``)."""
        return checkpoints.config_to_hf(self.cfg)


def describe_head(out_head) -> str:
    """``Linear(32 -> 2, with bias)``: what ``out_head`` is, as messages name it."""
    if out_head is None:
        return "None (tied to tok_emb)"
    if not isinstance(out_head, nnx.Linear):
        return type(out_head).__name__
    bias = "with bias" if out_head.bias is not None else "no bias"
    return f"Linear({out_head.in_features} -> {out_head.out_features}, {bias})"


def head_outputs(model) -> int:
    """How many logits ``model``'s head gives per token: ``vocab_size`` for the book's and a
    tied head, ``num_classes`` for chapter 6's (an ``nnx.Linear``, a module wrapping one as
    ``.linear``, or any module, whose output is then traced for its shape)."""
    head = model.out_head
    if head is None:
        return model.cfg["vocab_size"]
    for linear in (head, getattr(head, "linear", None)):
        if isinstance(linear, nnx.Linear):
            return linear.out_features
    x = jax.ShapeDtypeStruct((1, model.cfg["emb_dim"]), jnp.float32)
    return jax.eval_shape(lambda x: head(x), x).shape[-1]


def head_problem(model) -> str | None:
    """``None`` when ``model``'s head is the vocabulary's as ``cfg`` has it (tied, or
    ``Linear(emb_dim -> vocab_size)`` without bias); else what it is and what was expected."""
    cfg, head = model.cfg, model.out_head
    if cfg["tie_word_embeddings"]:
        if head is None:
            return None
        expected = "None (tied to tok_emb, cfg['tie_word_embeddings'])"
    else:
        expected = f"Linear({cfg['emb_dim']} -> {cfg['vocab_size']}, no bias)"
        if (
            isinstance(head, nnx.Linear)
            and head.bias is None
            and (head.in_features, head.out_features) == (cfg["emb_dim"], cfg["vocab_size"])
        ):
            return None
    return f"model.out_head ({describe_head(head)}) must be the vocabulary's head ({expected})"


def weight_names(model: GPTModel, layout: str) -> ModelNames:
    """How the weight bridge names ``model`` in ``layout`` (``flax_attention.layouts.
    gpt_model_names``), for the head it has now: a head put in place of the book's (chapter 6's
    ``model.out_head = nnx.Linear(emb_dim, num_classes, ...)``) is exported and loaded under
    ``out_head.`` with its own shape in the book's names; Hugging Face's have no such head."""
    variant = [key for key in VARIANT_KEYS if key in model.cfg]
    if layout != "documents" and variant:
        raise ValueError(
            f"layout ({layout!r}) must be 'documents' for the book's {variant[0]} variant: "
            "Hugging Face's GPT2LMHeadModel has no such attention"
        )
    if layout != "documents":
        problem = head_problem(model)
        if problem:
            raise ValueError(
                f"{problem} for layout ({layout!r}): Hugging Face's GPT2LMHeadModel has no "
                "other head; use layout='documents' (the book's names, which take any out_head)"
            )
    return gpt_model_names({**model.cfg, "tie_word_embeddings": model.out_head is None}, layout)


register(GPTModel, Names(layouts=("documents", "gpt2"), model=weight_names))
