"""The book's Qwen3 (``llms_from_scratch.qwen3``) in Flax NNX: ``Qwen3Model(cfg)``, dense
(0.6B to 32B) or a mixture of experts (30B-A3B), with the book's config dicts and names.

The model is ``models.decoder``'s pieces as the book's ``qwen3.py`` puts them together:
``tok_emb``; ``trf_blocks.{i}`` = ``att`` (``GroupedQueryAttention`` with ``head_dim`` from the
config, which need not be ``emb_dim / n_heads``: 0.6B has 128 against 1024 / 16, and QK-norm),
``ff`` (SwiGLU ``fc1``/``fc2``/``fc3``, or ``models.moe.MoEFeedForward``: ``gate`` and the
experts' ``fc1.{e}``/``fc2.{e}``/``fc3.{e}``), ``norm1``, ``norm2`` (``RMSNorm``, ``scale``);
``final_norm``; ``out_head``. The book's state dicts load through ``fa.load_state_dict`` as
they are; Hugging Face ``Qwen3ForCausalLM``/``Qwen3MoeForCausalLM`` directories through
``Qwen3Model.from_pretrained``.

``cfg``: the book's keys (``QWEN_CONFIG_06_B`` below), ``dtype`` a JAX dtype; optionally
``tie_word_embeddings`` (default ``False``) and ``rms_norm_eps`` (default the book's 1e-6; a
checkpoint's ``config.json`` gives its own).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from flax_attention._checks import check_bool, check_positive_int
from flax_attention._layers import LayerOptions
from flax_attention.models import checkpoints
from flax_attention.models.decoder import (
    FeedForward,
    RMSNorm,
    RotaryDecoder,
    TransformerBlock,
    check_common,
    check_keys,
    hf_rope_scaling,
    read_hf_config,
)
from flax_attention.models.gpt import Config
from flax_attention.models.moe import MoEFeedForward

__all__ = [
    "QWEN3_CONFIG_14B",
    "QWEN3_CONFIG_1_7B",
    "QWEN3_CONFIG_30B_A3B",
    "QWEN3_CONFIG_32B",
    "QWEN3_CONFIG_4B",
    "QWEN3_CONFIG_8B",
    "QWEN_CONFIG_06_B",
    "Qwen3Model",
]


def _dense(emb_dim, n_heads, n_layers, hidden_dim) -> dict:
    return {"vocab_size": 151_936, "context_length": 40_960, "emb_dim": emb_dim,
            "n_heads": n_heads, "n_layers": n_layers, "hidden_dim": hidden_dim, "head_dim": 128,
            "qk_norm": True, "n_kv_groups": 8, "rope_base": 1_000_000.0,
            "dtype": jnp.bfloat16}  # fmt: skip


#: The book's configurations (``llms_from_scratch.qwen3``), ``dtype`` as JAX's.
QWEN_CONFIG_06_B = _dense(1024, 16, 28, 3072)
QWEN3_CONFIG_1_7B = _dense(2048, 16, 28, 6144)
QWEN3_CONFIG_4B = _dense(2560, 32, 36, 9728)
QWEN3_CONFIG_8B = _dense(4096, 32, 36, 12288)
QWEN3_CONFIG_14B = _dense(5120, 40, 40, 17408)
QWEN3_CONFIG_32B = _dense(5120, 64, 64, 25600)
QWEN3_CONFIG_30B_A3B = {
    "vocab_size": 151_936, "context_length": 262_144, "emb_dim": 2048, "n_heads": 32,
    "n_layers": 48, "head_dim": 128, "qk_norm": True, "n_kv_groups": 4,
    "rope_base": 10_000_000.0, "dtype": jnp.bfloat16, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768,
}  # fmt: skip

#: Every Qwen3 config's keys; a dense model adds ``hidden_dim``, a mixture of experts
#: ``MOE_KEYS``.
CONFIG_KEYS = ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "head_dim",
               "qk_norm", "n_kv_groups", "rope_base", "dtype")  # fmt: skip
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
OPTIONAL_KEYS = {"tie_word_embeddings": False, "rms_norm_eps": 1e-6}


def is_moe(cfg) -> bool:
    """The book's test: ``num_experts`` present and positive."""
    return cfg.get("num_experts", 0) > 0


class Qwen3Model(RotaryDecoder):
    """The book's ``Qwen3Model(cfg)``: token ids ``(b, t)`` -> logits ``(b, t, vocab_size)``.

    Keyword options as ``GPTModel``'s (``rngs``, ``dtype``, ``param_dtype`` (default
    ``cfg["dtype"]``), ``precision``, ``implementation``); ``model(idx, decode=True)`` and
    ``attention_mask`` as there. The book's model has no dropout, nor does this one."""

    HF_MODEL_TYPES = ("qwen3", "qwen3_moe")

    @classmethod
    def check_config(cls, cfg) -> dict:
        moe = isinstance(cfg, dict | Config) and is_moe(cfg)
        required = CONFIG_KEYS + (MOE_KEYS if moe else ("hidden_dim",))
        if not moe and isinstance(cfg, dict | Config) and "num_experts" in cfg:
            required += ("num_experts",)  # a dense config may say 0, as the book's test does
        cfg = check_keys(cfg, "Qwen3Model", required, OPTIONAL_KEYS)
        for key in ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers",
                    "n_kv_groups") + (MOE_KEYS if moe else ("hidden_dim",)):  # fmt: skip
            check_positive_int(f"cfg[{key!r}]", cfg[key])
        if cfg["head_dim"] is not None:
            check_positive_int("cfg['head_dim']", cfg["head_dim"])
        elif cfg["emb_dim"] % cfg["n_heads"]:
            raise ValueError(
                f"cfg['emb_dim'] ({cfg['emb_dim']}) must be divisible by cfg['n_heads'] "
                f"({cfg['n_heads']}) when cfg['head_dim'] is None"
            )
        check_common(cfg)
        if moe and cfg["num_experts_per_tok"] > cfg["num_experts"]:
            raise ValueError(
                f"cfg['num_experts_per_tok'] ({cfg['num_experts_per_tok']}) must be at most "
                f"cfg['num_experts'] ({cfg['num_experts']})"
            )
        check_bool("cfg['qk_norm']", cfg["qk_norm"])
        return cfg

    def norm(self, cfg, options: LayerOptions) -> RMSNorm:
        return RMSNorm(cfg["emb_dim"], cfg["rms_norm_eps"])  # float32 scale, as the book's

    def block(self, cfg, options: LayerOptions, rngs: nnx.Rngs) -> TransformerBlock:
        att = self.attention(
            cfg, options, rngs, head_dim=cfg["head_dim"], qk_norm=cfg["qk_norm"],
            norm_eps=cfg["rms_norm_eps"],
        )  # fmt: skip
        if is_moe(cfg):
            ff = MoEFeedForward(cfg, options=options, rngs=rngs)
        else:
            ff = FeedForward(cfg["emb_dim"], cfg["hidden_dim"], options=options, rngs=rngs)
        return TransformerBlock(att, ff, self.norm(cfg, options), self.norm(cfg, options))

    def hf_config(self) -> dict:
        """A ``config.json`` for transformers' ``Qwen3ForCausalLM`` (``Qwen3MoeForCausalLM``
        for a mixture of experts)."""
        cfg = self.cfg
        out = {
            "architectures": ["Qwen3MoeForCausalLM" if is_moe(cfg) else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if is_moe(cfg) else "qwen3",
            "vocab_size": cfg["vocab_size"],
            "max_position_embeddings": cfg["context_length"],
            "hidden_size": cfg["emb_dim"],
            "num_hidden_layers": cfg["n_layers"],
            "num_attention_heads": cfg["n_heads"],
            "num_key_value_heads": cfg["n_kv_groups"],
            "head_dim": self.trf_blocks[0].att.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": cfg["rms_norm_eps"],
            "rope_theta": cfg["rope_base"],
            "attention_bias": False,
            "tie_word_embeddings": cfg["tie_word_embeddings"],
            "dtype": jnp.dtype(cfg["dtype"]).name,
        }
        if is_moe(cfg):
            out.update(
                num_experts=cfg["num_experts"],
                num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                intermediate_size=cfg["moe_intermediate_size"],
            )
        else:
            out["intermediate_size"] = cfg["hidden_dim"]
        return out


def config_from_hf(hf) -> dict:
    """A Qwen3 (``model_type`` ``"qwen3"``) or Qwen3-MoE (``"qwen3_moe"``) ``config.json`` as
    the book's cfg, its ``rms_norm_eps`` and tied head included; options the book's model does
    not have are a ``ValueError`` naming them."""
    moe = hf.get("model_type") == "qwen3_moe"
    fixed = {
        "use_sliding_window": (False, (False,), "the book's Qwen3 attends to every token"),
        "mlp_only_layers": ([], ([], None), "the book's MoE model has experts in every layer"),
        "decoder_sparse_step": (1, (1,), "the book's MoE model has experts in every layer"),
        "norm_topk_prob": (True, (True,), "the book's MoE softmaxes the chosen experts' scores"),
    }
    cfg = read_hf_config(hf, "Qwen3Model", fixed)
    scaling = hf_rope_scaling(hf)
    if scaling:
        raise ValueError(
            f"config rope_scaling ({scaling!r}) must be null for Qwen3Model (the book's rotary "
            "positions are unscaled)"
        )
    cfg.update(head_dim=hf.get("head_dim") or cfg["emb_dim"] // cfg["n_heads"], qk_norm=True)
    if moe:
        cfg.update(
            num_experts=hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"],
            num_experts_per_tok=hf["num_experts_per_tok"],
            moe_intermediate_size=hf["moe_intermediate_size"],
        )
    else:
        cfg["hidden_dim"] = hf["intermediate_size"]
    return cfg


checkpoints.CONFIG_READERS.update(qwen3=config_from_hf, qwen3_moe=config_from_hf)
