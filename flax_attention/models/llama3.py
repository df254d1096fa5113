"""The book's Llama 3 (``llms_from_scratch.llama3``) in Flax NNX: ``Llama3Model(cfg)``, with the
book's config dicts (``LLAMA32_CONFIG_1B``, ``LLAMA32_CONFIG_3B``) and names.

The model is ``models.decoder``'s pieces as the book's ``llama3.py`` puts them together:
``tok_emb``; ``trf_blocks.{i}`` = ``att`` (``GroupedQueryAttention``, ``head_dim = emb_dim /
n_heads``, no QK-norm), ``ff`` (SwiGLU ``fc1``/``fc2``/``fc3``), ``norm1``, ``norm2``
(``torch.nn.RMSNorm``'s ``weight``, eps 1e-5); ``final_norm``; ``out_head``. Rotary positions
with Llama 3's frequency scaling (``rope_freq``: ``factor``, ``low_freq_factor``,
``high_freq_factor``, ``original_context_length``; the frequencies fall in three bands, kept,
smoothed or divided by ``factor``). The book's state dicts load through ``fa.load_state_dict``;
Hugging Face ``LlamaForCausalLM`` directories through ``Llama3Model.from_pretrained``.

``cfg``: the book's keys, ``dtype`` a JAX dtype, ``rope_freq`` a dict of the four fields or
``None`` (no scaling); optionally ``tie_word_embeddings`` (default ``False``; Llama 3.2's
checkpoints tie) and ``rms_norm_eps`` (default the book's 1e-5).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
from flax import nnx

from flax_attention._checks import check_positive_int
from flax_attention._layers import LayerOptions
from flax_attention.models import checkpoints
from flax_attention.models.decoder import (
    ROPE_FREQ_KEYS,
    FeedForward,
    RotaryDecoder,
    TorchRMSNorm,
    TransformerBlock,
    check_common,
    check_keys,
    hf_rope_scaling,
    read_hf_config,
)

__all__ = ["LLAMA32_CONFIG_1B", "LLAMA32_CONFIG_3B", "Llama3Model"]

_ROPE_FREQ = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_context_length": 8192}  # fmt: skip
#: The book's configurations (``llms_from_scratch.llama3``), ``dtype`` as JAX's.
LLAMA32_CONFIG_1B = {
    "vocab_size": 128_256, "context_length": 131_072, "emb_dim": 2048, "n_heads": 32,
    "n_layers": 16, "hidden_dim": 8192, "n_kv_groups": 8, "rope_base": 500_000.0,
    "dtype": jnp.bfloat16, "rope_freq": dict(_ROPE_FREQ),
}  # fmt: skip
LLAMA32_CONFIG_3B = {
    "vocab_size": 128_256, "context_length": 131_072, "emb_dim": 3072, "n_heads": 24,
    "n_layers": 28, "hidden_dim": 8192, "n_kv_groups": 8, "rope_base": 500_000.0,
    "dtype": jnp.bfloat16, "rope_freq": dict(_ROPE_FREQ),
}  # fmt: skip

CONFIG_KEYS = ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "hidden_dim",
               "n_kv_groups", "rope_base", "dtype", "rope_freq")  # fmt: skip
OPTIONAL_KEYS = {"tie_word_embeddings": False, "rms_norm_eps": 1e-5}


def check_rope_freq(rope_freq) -> None:
    """``None`` or a mapping with the four fields, each a positive number, ``low_freq_factor <
    high_freq_factor`` (the smoothed band divides by their difference)."""
    if rope_freq is None:
        return
    if not isinstance(rope_freq, Mapping):
        raise TypeError(
            f"cfg['rope_freq'] ({rope_freq!r}) must be None or a dict with {ROPE_FREQ_KEYS}"
        )
    missing = [key for key in ROPE_FREQ_KEYS if key not in rope_freq]
    unknown = sorted(set(rope_freq) - set(ROPE_FREQ_KEYS))
    if missing or unknown:
        raise ValueError(
            f"cfg['rope_freq'] ({dict(rope_freq)!r}) must have exactly the fields "
            f"{ROPE_FREQ_KEYS} (missing: {missing}, unknown: {unknown})"
        )
    for key in ROPE_FREQ_KEYS:
        value = rope_freq[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"cfg['rope_freq'][{key!r}] ({value!r}) must be a number > 0")
    if not rope_freq["low_freq_factor"] < rope_freq["high_freq_factor"]:
        raise ValueError(
            f"cfg['rope_freq']['low_freq_factor'] ({rope_freq['low_freq_factor']}) must be "
            f"below cfg['rope_freq']['high_freq_factor'] ({rope_freq['high_freq_factor']})"
        )


class Llama3Model(RotaryDecoder):
    """The book's ``Llama3Model(cfg)``: token ids ``(b, t)`` -> logits ``(b, t, vocab_size)``.

    Keyword options as ``Qwen3Model``'s. No dropout, as the book's."""

    HF_MODEL_TYPES = ("llama",)

    @classmethod
    def check_config(cls, cfg) -> dict:
        cfg = check_keys(cfg, "Llama3Model", CONFIG_KEYS, OPTIONAL_KEYS)
        for key in ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers",
                    "hidden_dim", "n_kv_groups"):  # fmt: skip
            check_positive_int(f"cfg[{key!r}]", cfg[key])
        if cfg["emb_dim"] % cfg["n_heads"]:
            raise ValueError(
                f"cfg['emb_dim'] ({cfg['emb_dim']}) must be divisible by cfg['n_heads'] "
                f"({cfg['n_heads']})"
            )
        check_common(cfg)
        check_rope_freq(cfg["rope_freq"])
        return cfg

    def norm(self, cfg, options: LayerOptions) -> TorchRMSNorm:
        return TorchRMSNorm(cfg["emb_dim"], cfg["rms_norm_eps"], param_dtype=options.param_dtype)

    def block(self, cfg, options: LayerOptions, rngs: nnx.Rngs) -> TransformerBlock:
        att = self.attention(cfg, options, rngs)
        ff = FeedForward(cfg["emb_dim"], cfg["hidden_dim"], options=options, rngs=rngs)
        return TransformerBlock(att, ff, self.norm(cfg, options), self.norm(cfg, options))

    def hf_config(self) -> dict:
        """A ``config.json`` for transformers' ``LlamaForCausalLM``."""
        cfg = self.cfg
        rope = {"rope_type": "default", "rope_theta": cfg["rope_base"]}
        if cfg["rope_freq"] is not None:
            freq = cfg["rope_freq"]
            rope.update(
                rope_type="llama3",
                factor=freq["factor"],
                low_freq_factor=freq["low_freq_factor"],
                high_freq_factor=freq["high_freq_factor"],
                original_max_position_embeddings=freq["original_context_length"],
            )
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": cfg["vocab_size"],
            "max_position_embeddings": cfg["context_length"],
            "hidden_size": cfg["emb_dim"],
            "intermediate_size": cfg["hidden_dim"],
            "num_hidden_layers": cfg["n_layers"],
            "num_attention_heads": cfg["n_heads"],
            "num_key_value_heads": cfg["n_kv_groups"],
            "head_dim": cfg["emb_dim"] // cfg["n_heads"],
            "hidden_act": "silu",
            "rms_norm_eps": cfg["rms_norm_eps"],
            "rope_theta": cfg["rope_base"],
            "rope_scaling": None if cfg["rope_freq"] is None else dict(rope),
            "rope_parameters": rope,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": cfg["tie_word_embeddings"],
            "dtype": jnp.dtype(cfg["dtype"]).name,
        }


def config_from_hf(hf) -> dict:
    """A Llama (``model_type`` ``"llama"``) ``config.json`` as the book's cfg: ``rope_freq`` from
    its ``llama3`` rope scaling (``None`` without one), its ``rms_norm_eps`` and tied head;
    options the book's model does not have are a ``ValueError`` naming them."""
    fixed = {"mlp_bias": (False, (False,), "the book's FeedForward has no bias"),
             "pretraining_tp": (1, (1,), "the book's projections are unsplit")}  # fmt: skip
    cfg = read_hf_config(hf, "Llama3Model", fixed)
    head_dim = hf.get("head_dim") or cfg["emb_dim"] // cfg["n_heads"]
    if head_dim * cfg["n_heads"] != cfg["emb_dim"]:
        raise ValueError(
            f"config head_dim ({head_dim}) must be hidden_size / num_attention_heads "
            f"({cfg['emb_dim']} / {cfg['n_heads']}) for Llama3Model (the book's heads split "
            "emb_dim)"
        )
    scaling = hf_rope_scaling(hf)
    if scaling and scaling["rope_type"] != "llama3":
        raise ValueError(
            f"config rope_scaling type ({scaling['rope_type']!r}) must be 'llama3' or none for "
            "Llama3Model (the book's frequency scaling)"
        )
    rope_freq = None
    if scaling:
        rope_freq = {
            "factor": scaling["factor"],
            "low_freq_factor": scaling["low_freq_factor"],
            "high_freq_factor": scaling["high_freq_factor"],
            "original_context_length": scaling["original_max_position_embeddings"],
        }
    cfg.update(hidden_dim=hf["intermediate_size"], rope_freq=rope_freq)
    return cfg


checkpoints.CONFIG_READERS.update(llama=config_from_hf)
