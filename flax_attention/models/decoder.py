"""What the book's Qwen3 and Llama 3 share: rotary positions, RMSNorm, the SwiGLU feed-forward,
grouped-query attention with optional QK-norm, the pre-norm block and the model around them.

The book's package (``llms_from_scratch.qwen3`` and ``.llama3`` of
https://github.com/rasbt/LLMs-from-scratch, ``pkg/``) writes each model in its own file with
its own copies of these pieces; here they are written once (``models.qwen3`` and
``models.llama3`` build their models from them) and keep the book's module and parameter names,
so its state dicts load as they are:

==========================================  =====================================================
book (torch)                                here
==========================================  =====================================================
``compute_rope_params`` + ``apply_rope``    ``Rope``: the same float32 frequencies (Llama 3's
                                            three-band scaling with ``freq_config``), angles
                                            computed at the tokens' ``positions``
Qwen3's ``RMSNorm(emb_dim, eps=1e-6)``      ``RMSNorm``: ``scale`` (float32), computed in float32
``torch.nn.RMSNorm`` (Llama 3's)            ``TorchRMSNorm``: ``weight``, normalised in float32
                                            then cast to the input's dtype before the weight
``FeedForward(cfg)``                        ``FeedForward``: ``fc3(silu(fc1(x)) * fc2(x))``
``GroupedQueryAttention``                   ``GroupedQueryAttention``: ``W_query``, ``W_key``,
                                            ``W_value``, ``out_proj`` (``(h * head_dim) ->
                                            d_in``), ``q_norm``/``k_norm`` before the rotation;
                                            the package's attention core with grouped key heads
                                            (never repeated) and its decode cache
``TransformerBlock(cfg)``                   ``TransformerBlock``: ``att``, ``ff``, ``norm1``,
                                            ``norm2``, pre-norm, a shortcut around each half
==========================================  =====================================================

``RotaryDecoder`` is the model both build on: ``tok_emb``, ``trf_blocks``, ``final_norm``,
``out_head`` (``None`` when the checkpoint ties it to ``tok_emb``), the decode caches, left
padding (positions counted from each row's first token, as transformers) and Hugging Face
checkpoints (``from_pretrained``/``save_pretrained``: ``layout="llama"``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_attention._checks import check_bool, check_positive_int
from flax_attention._layers import Embed, LayerOptions
from flax_attention.causal import init_causal_layer
from flax_attention.core import Implementation
from flax_attention.layouts import ModelNames, Names, register
from flax_attention.mesh import FROM_HEADS, TO_HEADS, LinearAxes
from flax_attention.models import checkpoints
from flax_attention.models.gpt import BlockCache, Config, DecoderModel, check_model_dtypes
from flax_attention.multihead import MultiHeadAttention

__all__ = [
    "FeedForward",
    "GroupedQueryAttention",
    "RMSNorm",
    "Rope",
    "RotaryDecoder",
    "TorchRMSNorm",
    "TransformerBlock",
    "rope_frequencies",
]

#: The head's mesh axes: replicated, as GPT-2's.
_REPLICATED = LinearAxes(kernel=(None, None), bias=(None,))
#: Llama 3's ``rope_freq`` fields (the book's names).
ROPE_FREQ_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_context_length")


def rope_frequencies(head_dim: int, theta_base: float, freq_config=None) -> np.ndarray:
    """The book's ``compute_rope_params`` frequencies, float32 ``(head_dim // 2,)``:
    ``1 / theta_base ** (2i / head_dim)``; with ``freq_config`` (Llama 3's ``rope_freq``) the
    low frequencies divided by ``factor``, the high ones kept, the band between smoothed."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32)[: head_dim // 2] / np.float32(head_dim)
    inv_freq = np.float32(1.0) / np.power(np.float32(theta_base), exponents)
    if freq_config is None:
        return inv_freq.astype(np.float32)
    factor, low, high, original = (np.float32(freq_config[key]) for key in ROPE_FREQ_KEYS)
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    wavelen = np.float32(2 * np.pi) / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * (inv_freq / factor) + smooth * inv_freq
    medium = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary position embedding (the book's ``apply_rope``, rotate-half form):
    ``rope(x, positions)`` rotates ``x`` ``(..., t, h, d)`` by the angles ``positions * inv_freq``
    (``positions`` ``(..., t)`` or ``(t,)``), in float32, cast back to ``x``'s dtype. Hashable:
    it is part of a layer's static structure (``MultiHeadAttention(rotary=...)``)."""

    inv_freq: tuple[float, ...]

    @classmethod
    def of(cls, head_dim: int, theta_base: float, freq_config=None) -> Rope:
        return cls(tuple(float(f) for f in rope_frequencies(head_dim, theta_base, freq_config)))

    def __call__(self, x, positions):
        positions = jnp.asarray(positions).astype(jnp.float32)
        inv_freq = jnp.asarray(np.asarray(self.inv_freq, np.float32))
        angles = positions[..., None] * inv_freq.reshape((1,) * positions.ndim + (-1,))
        angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]  # (..., t, 1, d)
        angles = angles.reshape((1,) * (x.ndim - angles.ndim) + angles.shape)
        half = x.shape[-1] // 2
        rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return (x * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """The book's Qwen3 ``RMSNorm(emb_dim, eps=1e-6, bias=False, qwen3_compatible=True)``:
    ``x / sqrt(mean(x^2) + eps) * scale (+ shift)``, computed in float32 (``qwen3_compatible``)
    and cast back to the input's dtype; ``scale`` (and ``shift``) float32, as the book's
    ``nn.Parameter(torch.ones(emb_dim))``."""

    def __init__(self, emb_dim: int, eps: float = 1e-6, bias: bool = False,
                 qwen3_compatible: bool = True, *, param_dtype=jnp.float32):  # fmt: skip
        check_positive_int("emb_dim", emb_dim)
        check_bool("bias", bias)
        self.eps, self.qwen3_compatible = float(eps), bool(qwen3_compatible)
        self.scale = nnx.Param(jnp.ones((emb_dim,), param_dtype))
        self.shift = nnx.Param(jnp.zeros((emb_dim,), param_dtype)) if bias else nnx.data(None)

    def __call__(self, x):
        input_dtype = x.dtype
        if self.qwen3_compatible:
            x = x.astype(jnp.float32)
        variance = jnp.mean(x * x, axis=-1, keepdims=True)
        lead = (1,) * (x.ndim - 1)  # explicit broadcasts
        norm_x = x * jax.lax.rsqrt(variance + self.eps) * self.scale[...].reshape(*lead, -1)
        if self.shift is not None:
            norm_x = norm_x + self.shift[...].reshape(*lead, -1)
        return norm_x.astype(input_dtype)


class TorchRMSNorm(nnx.Module):
    """``torch.nn.RMSNorm(emb_dim, eps, dtype)`` (the book's Llama 3): ``weight``; the
    normalisation in at least float32, cast to the input's dtype, then times ``weight``."""

    def __init__(self, emb_dim: int, eps: float = 1e-5, *, param_dtype=jnp.float32):
        check_positive_int("emb_dim", emb_dim)
        self.eps = float(eps)
        self.weight = nnx.Param(jnp.ones((emb_dim,), param_dtype))

    def __call__(self, x):
        x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        norm_x = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(x.dtype)
        return norm_x * self.weight[...].reshape((1,) * (x.ndim - 1) + (-1,))


class FeedForward(nnx.Module):
    """The book's SwiGLU ``FeedForward``: ``fc3(silu(fc1(x)) * fc2(x))``, no biases, hidden
    ``hidden_dim``. On a mesh ``fc1``/``fc2`` split their outputs over ``model`` and ``fc3`` its
    inputs (one all-reduce), as GPT-2's."""

    def __init__(self, emb_dim: int, hidden_dim: int, *, options: LayerOptions, rngs: nnx.Rngs):
        linear = options.linear(rngs)
        self.fc1 = linear(emb_dim, hidden_dim, use_bias=False, axes=TO_HEADS)
        self.fc2 = linear(emb_dim, hidden_dim, use_bias=False, axes=TO_HEADS)
        self.fc3 = linear(hidden_dim, emb_dim, use_bias=False, axes=FROM_HEADS)

    def model_axis_sizes(self) -> dict[str, int]:
        """What ``flax_attention.shard`` splits over ``model``: the hidden features."""
        return {"hidden_dim": self.fc1.out_features}

    def __call__(self, x):
        return self.fc3(nnx.silu(self.fc1(x)) * self.fc2(x))


class GroupedQueryAttention(MultiHeadAttention):
    """The book's Qwen3 and Llama 3 ``GroupedQueryAttention``: ``num_heads`` query heads of
    ``head_dim`` (``None``: ``d_in // num_heads``) over ``num_kv_groups`` key and value heads,
    ``q_norm``/``k_norm`` (``RMSNorm(head_dim, norm_eps)``) when ``qk_norm``, then ``rope`` on
    queries and keys, causal attention, ``out_proj`` ``(num_heads * head_dim) -> d_in``; no
    biases, no dropout. It is a ``MultiHeadAttention`` (``rotary=rope``, ``num_kv_heads``):
    ``layer(x, positions=...)``, ``init_cache``, ``decode=True`` as there."""

    def __init__(
        self,
        d_in: int,
        num_heads: int,
        num_kv_groups: int,
        head_dim: int | None = None,
        qk_norm: bool = False,
        *,
        rope: Rope,
        norm_eps: float = 1e-6,
        context_length: int,
        implementation: Implementation | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        rngs: nnx.Rngs,
    ):
        check_positive_int("num_heads", num_heads)
        check_positive_int("num_kv_groups", num_kv_groups)
        check_bool("qk_norm", qk_norm)
        if num_heads % num_kv_groups:
            raise ValueError(
                f"num_heads ({num_heads}) must be divisible by num_kv_groups ({num_kv_groups})"
            )
        if head_dim is None:
            check_positive_int("d_in", d_in)
            if d_in % num_heads:
                raise ValueError(
                    f"d_in ({d_in}) must be divisible by num_heads ({num_heads}) when head_dim "
                    "is None"
                )
            head_dim = d_in // num_heads
        check_positive_int("head_dim", head_dim)
        if head_dim % 2:
            raise ValueError(f"head_dim ({head_dim}) must be even (rotary pairs its features)")
        linear = init_causal_layer(
            self, d_in, num_heads * head_dim, context_length, 0.0, False,
            implementation=implementation, block_sizes=None, dtype=dtype,
            param_dtype=param_dtype, precision=precision, rngs=rngs, num_heads=num_heads,
            num_kv_heads=num_kv_groups,
        )  # fmt: skip
        self.rotary = rope
        self.out_proj = linear(num_heads * head_dim, d_in, use_bias=False, axes=FROM_HEADS)
        self.num_kv_groups = num_kv_groups
        self.group_size = num_heads // num_kv_groups
        if qk_norm:
            self.q_norm, self.k_norm = RMSNorm(head_dim, norm_eps), RMSNorm(head_dim, norm_eps)
        else:
            self.q_norm = self.k_norm = nnx.data(None)

    def _rotate(self, queries, keys, positions, decode: bool):
        if self.q_norm is not None:  # per head, before the rotation (the book's order)
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        return super()._rotate(queries, keys, positions, decode)


class TransformerBlock(BlockCache, nnx.Module):
    """The book's Qwen3/Llama 3 ``TransformerBlock``: ``x + att(norm1(x))``, then
    ``x + ff(norm2(x))``. Its decode cache is its attention's."""

    def __init__(self, att: GroupedQueryAttention, ff: nnx.Module, norm1, norm2):
        self.att, self.ff, self.norm1, self.norm2 = att, ff, norm1, norm2

    def __call__(self, x, *, decode: bool = False, mask=None, positions=None):
        x = x + self.att._forward(self.norm1(x), decode=decode, mask=mask, positions=positions)
        return x + self.ff(self.norm2(x))


def check_keys(cfg, model: str, required: tuple, optional: Mapping) -> dict:
    """``cfg`` (a mapping with ``required`` keys, and ``optional`` ones) as a dict with the
    optional keys filled in; an unknown or missing key is a ``ValueError`` naming it."""
    if not isinstance(cfg, Mapping):
        raise TypeError(f"cfg ({type(cfg).__name__}) must be a dict with keys {required}")
    known = tuple(required) + tuple(optional)
    unknown = sorted(set(cfg) - set(known))
    if unknown:
        raise ValueError(
            f"cfg key {unknown[0]!r} must be one of {known} for {model} (unknown keys: "
            f"{unknown}; another model's config?)"
        )
    missing = [key for key in required if key not in cfg]
    if missing:
        raise ValueError(f"cfg must have key {missing[0]!r} for {model} (missing: {missing})")
    return {**optional, **cfg}


def check_common(cfg) -> None:
    """What Qwen3's and Llama 3's configs share: grouped heads, the rotary base, the dtype,
    the optional keys."""
    if cfg["n_heads"] % cfg["n_kv_groups"]:
        raise ValueError(
            f"cfg['n_heads'] ({cfg['n_heads']}) must be divisible by cfg['n_kv_groups'] "
            f"({cfg['n_kv_groups']})"
        )
    base = cfg["rope_base"]
    if isinstance(base, bool) or not isinstance(base, int | float) or not base > 1:
        raise ValueError(f"cfg['rope_base'] ({base!r}) must be a number > 1 (RoPE's theta)")
    eps = cfg["rms_norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps > 0:
        raise ValueError(f"cfg['rms_norm_eps'] ({eps!r}) must be a number > 0")
    try:
        check_model_dtypes(None, cfg["dtype"])
    except TypeError:
        raise TypeError(
            f"cfg['dtype'] ({cfg['dtype']!r}) must be a floating dtype (jnp.bfloat16, "
            "jnp.float32, ...: the parameters' dtype)"
        ) from None
    check_bool("cfg['tie_word_embeddings']", cfg["tie_word_embeddings"])


class RotaryDecoder(DecoderModel):
    """The decoder-only model the book's Qwen3 and Llama 3 are: ``tok_emb``, ``trf_blocks``,
    ``final_norm``, ``out_head``. A subclass says how its config is checked (``check_config``),
    and builds its norms (``norm``) and blocks (``block``); the rest is here.

    ``cfg["dtype"]`` (a JAX dtype, the book's ``torch.bfloat16`` as ``jnp.bfloat16``) is the
    parameters' dtype unless ``param_dtype`` says otherwise; ``dtype`` the computation's
    (``None``: the parameters'). ``cfg["tie_word_embeddings"]`` (optional, default ``False``)
    leaves ``out_head`` ``None``: the head reads ``tok_emb``'s matrix, as tied checkpoints."""

    #: Hugging Face ``model_type``s whose directories ``from_pretrained`` reads, and the
    #: weight bridge's layout of their names.
    HF_MODEL_TYPES: tuple[str, ...] = ()
    HF_LAYOUT = "llama"

    def __init__(
        self,
        cfg,
        *,
        rngs: nnx.Rngs,
        dtype=None,
        param_dtype=None,
        precision=None,
        implementation: Implementation | None = None,
    ):
        cfg = self.check_config(cfg)
        param_dtype = cfg["dtype"] if param_dtype is None else param_dtype
        check_model_dtypes(dtype, param_dtype)
        self.cfg = Config(cfg)
        self.precision = precision
        options = LayerOptions(dtype, param_dtype, precision, implementation)
        self.tok_emb = Embed(
            cfg["vocab_size"], cfg["emb_dim"], **options.norm(),
            embedding_init=nnx.initializers.normal(1.0), rngs=rngs,
        )  # fmt: skip  # torch's nn.Embedding draws from N(0, 1)
        self.trf_blocks = nnx.List([self.block(cfg, options, rngs) for _ in range(cfg["n_layers"])])
        self.final_norm = self.norm(cfg, options)
        if cfg["tie_word_embeddings"]:
            self.out_head = nnx.data(None)
        else:
            self.out_head = options.linear(rngs)(
                cfg["emb_dim"], cfg["vocab_size"], use_bias=False, axes=_REPLICATED
            )

    @classmethod
    def check_config(cls, cfg) -> dict:  # pragma: no cover - each model defines it
        raise NotImplementedError

    def norm(self, cfg, options: LayerOptions) -> nnx.Module:  # pragma: no cover
        raise NotImplementedError

    def block(self, cfg, options: LayerOptions, rngs: nnx.Rngs) -> TransformerBlock:
        raise NotImplementedError  # pragma: no cover

    def attention(self, cfg, options: LayerOptions, rngs, **extra) -> GroupedQueryAttention:
        """A block's attention, ``rope`` from ``cfg`` (``rope_frequencies``)."""
        head_dim = extra.get("head_dim") or cfg["emb_dim"] // cfg["n_heads"]
        rope = Rope.of(head_dim, cfg["rope_base"], cfg.get("rope_freq"))
        return GroupedQueryAttention(
            cfg["emb_dim"], cfg["n_heads"], cfg["n_kv_groups"], **extra, rope=rope,
            context_length=cfg["context_length"], **options.attention(), rngs=rngs,
        )  # fmt: skip

    # ---- the forward pass ------------------------------------------------------------------------

    def hidden_states(self, in_idx, *, decode: bool = False, attention_mask=None):
        """``in_idx`` ``(b, t)`` -> the final norm's output ``(b, t, d)``."""
        positions, key_mask = self._positions(in_idx, decode, attention_mask)
        x = self.tok_emb(in_idx)  # (b, t, d)
        for block in self.trf_blocks:
            x = block(x, decode=decode, mask=key_mask, positions=positions)  # (b, t, d)
        return self.final_norm(x)

    def __call__(self, in_idx, *, decode: bool = False, attention_mask=None):
        """Logits ``(b, t, V)`` of token ids ``in_idx`` ``(b, t)`` (``GPTModel``'s arguments)."""
        return self.logits(self.hidden_states(in_idx, decode=decode, attention_mask=attention_mask))

    def model_axis_sizes(self) -> dict[str, int]:
        return {}

    # ---- Hugging Face checkpoints ---------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, seed: int = 0, mesh=None, **options):
        """A complete model (eval mode) from a local Hugging Face checkpoint directory
        (``config.json`` and safetensors, sharded or not; its ``model_type`` must be one of
        ``HF_MODEL_TYPES``), as ``GPTModel.from_pretrained``."""
        return checkpoints.load_pretrained(cls, path, seed=seed, mesh=mesh, **options)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write a directory transformers loads (``checkpoints.save_pretrained``)."""
        checkpoints.save_pretrained(self, path)

    def hf_config(self) -> dict:  # pragma: no cover - each model defines it
        raise NotImplementedError


def read_hf_config(hf: Mapping, model: str, fixed: Mapping) -> dict:
    """What Qwen3's and Llama 3's ``config.json`` share, as the book's cfg keys: sizes, grouped
    heads, the rotary base (``rope_theta``, or transformers 5's ``rope_parameters``), the norms'
    eps, a tied head, the dtype. ``fixed``: ``{name: (default, allowed values, why)}``, the
    options the book's model does not have (a ``ValueError`` naming the first one set)."""
    fixed = {"hidden_act": ("silu", ("silu",), "the book's FeedForward is SwiGLU"),
             "attention_bias": (False, (False,), "the book's projections have no bias"),
             **fixed}  # fmt: skip
    for name, (default, allowed, why) in fixed.items():
        value = hf.get(name, default)
        if value not in allowed:
            raise ValueError(
                f"config {name} ({value!r}) must be one of {allowed} for {model} ({why})"
            )
    rope = hf.get("rope_parameters") or {}
    dtype = hf.get("dtype", hf.get("torch_dtype")) or "float32"
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"config dtype ({dtype!r}) must be a floating dtype's name") from None
    heads = hf["num_attention_heads"]
    return {
        "vocab_size": hf["vocab_size"],
        "context_length": hf["max_position_embeddings"],
        "emb_dim": hf["hidden_size"],
        "n_heads": heads,
        "n_layers": hf["num_hidden_layers"],
        "n_kv_groups": hf.get("num_key_value_heads") or heads,
        "rope_base": float(hf.get("rope_theta", rope.get("rope_theta", 10_000.0))),
        "dtype": getattr(jnp, dtype.name, dtype.type),  # jnp.bfloat16, as the book's dicts
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "tie_word_embeddings": hf.get("tie_word_embeddings", False),
    }


def hf_rope_scaling(hf: Mapping) -> dict:
    """The rotary scaling a ``config.json`` asks for (``rope_scaling``, or transformers 5's
    ``rope_parameters``), ``{}`` for none; its ``rope_type`` (``type`` in old files) under
    ``"rope_type"``."""
    scaling = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    scaling.pop("rope_theta", None)
    return {} if kind == "default" and not scaling else {"rope_type": kind, **scaling}


def hf_names(model: RotaryDecoder, layout: str) -> ModelNames:
    """The model's names: the book's (``"documents"``; a tied head's second name
    ``out_head.weight``) or Hugging Face's (``"llama"``: ``model.layers.{i}.self_attn.q_proj``,
    ``mlp.gate_proj``, ...)."""
    tied = model.out_head is None
    if layout == "documents":
        return ModelNames(aliases=(("out_head.weight", "tok_emb.weight"),) if tied else ())
    params = [("tok_emb.weight", "embed_tokens.weight", False)]
    for i, block in enumerate(model.trf_blocks):
        own, peer = f"trf_blocks.{i}.", f"layers.{i}."
        for name, hf in (("W_query", "q_proj"), ("W_key", "k_proj"), ("W_value", "v_proj"),
                         ("out_proj", "o_proj")):  # fmt: skip
            params.append((f"{own}att.{name}.weight", f"{peer}self_attn.{hf}.weight", False))
        if block.att.q_norm is not None:
            for name in ("q_norm", "k_norm"):
                params.append((f"{own}att.{name}.scale", f"{peer}self_attn.{name}.weight", False))
        for name, hf in (("norm1", "input_layernorm"), ("norm2", "post_attention_layernorm")):
            params.append((f"{own}{name}.{_norm_param(block.norm1)}", f"{peer}{hf}.weight", False))
        params += [(f"{own}ff.{own_name}", f"{peer}mlp.{hf}", False)
                   for own_name, hf in _feed_forward_names(block.ff)]  # fmt: skip
    params.append((f"final_norm.{_norm_param(model.final_norm)}", "norm.weight", False))
    if not tied:
        params.append(("out_head.weight", "lm_head.weight", False))
    return ModelNames(
        params=tuple(params),
        aliases=(("lm_head.weight", "embed_tokens.weight"),) if tied else (),
        base_prefixes=("model.",),
        unprefixed=("lm_head.weight",),
    )


def _norm_param(norm) -> str:
    return "scale" if isinstance(norm, RMSNorm) else "weight"


def _feed_forward_names(ff) -> list[tuple[str, str]]:
    """``(own, Hugging Face)`` names inside a block's feed-forward: the SwiGLU's ``gate_proj``,
    ``up_proj``, ``down_proj`` (a mixture of experts names its own: ``feed_forward_names``)."""
    names = getattr(ff, "hf_names", None)
    if names is not None:
        return names()
    return [("fc1.weight", "gate_proj.weight"), ("fc2.weight", "up_proj.weight"),
            ("fc3.weight", "down_proj.weight")]  # fmt: skip


register(GroupedQueryAttention, Names())  # the book's names, no mask buffer
register(RotaryDecoder, Names(layouts=("documents", "llama"), model=hf_names))
