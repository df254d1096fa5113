"""The shared spec: every case as data (no framework code), read by the tests, the CLI and the
benchmarks.

A case names a layer or function of both packages, its positional constructor arguments, the
shapes of its inputs (or the documents' own input), the mask, the checks that apply and the seed
from which torch makes the weights. How to build and call each layer (its inputs, mask, outputs
and dropout) is in ``layers.py``, once per layer; tolerances live in ``tolerances.py``, keyed by
dtype and check; bad inputs in ``bad_inputs.py``.

Masks (``MultiHeadedAttention`` and ``attention``; the causal family masks itself):

- ``"causal"``: ``tril(ones(t, s))`` as ``(1, t, s)`` (the annotated-transformer post's
  ``__main__``).
- ``"padding"``: ``(b, 1, s)``, each batch row keeps a random prefix of at least one key.
- ``"fully_masked_row"``: causal, with query row 0 of batch 0 masked everywhere (every score is
  ``-1e10``, so that row's weights are uniform over all keys: the annotated-transformer post's
  behaviour).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from conformance_tests.layers import LAYER_SPECS, LayerSpec, layer_spec

__all__ = [
    "ALL_CASES",
    "CASES",
    "CHECKS",
    "Case",
    "FUNCTIONS",
    "LAYERS",
    "MODEL_CASES",
    "MODEL_CHECKS",
    "ModelCase",
    "is_shift_invariant",
    "select",
]

#: Every check a case may run; each is a row kind of the report.
CHECKS = ("forward", "grad", "train", "dropout", "mask", "dtype")

#: Layers (classes with weights) and functions (no weights), by their shared name, in the
#: documents' order: the names of ``layers.LAYER_SPECS``, which says how to call each.
LAYERS = tuple(name for name, layer in LAYER_SPECS.items() if not layer.is_function)
FUNCTIONS = tuple(name for name, layer in LAYER_SPECS.items() if layer.is_function)

#: The documents' 6-token input ``(6, 3)`` and its batch of two copies ``(2, 6, 3)``.
DOCUMENTS = "documents"
DOCUMENTS_BATCH = "documents_batch"


@dataclass(frozen=True)
class Case:
    """One spec case.

    Attributes:
      name: unique id (pytest ids and report rows use it).
      layer: a name in ``LAYERS`` or ``FUNCTIONS``.
      args: positional constructor arguments (layers) or trailing call arguments (functions).
      kwargs: keyword constructor arguments, ``(name, value)`` pairs, the same for both packages
        (the book's modern layers' ``latent_dim``, ``sliding_window_size``, ``qkv_bias``).
      inputs: one shape per positional input, or ``DOCUMENTS``/``DOCUMENTS_BATCH``.
      mask: ``None``, ``"causal"``, ``"padding"`` or ``"fully_masked_row"``.
      checks: the checks that apply (``CHECKS`` minus what makes no sense for the case).
      seed: ``torch.manual_seed`` for the weights; NumPy seed for inputs, masks, cotangents.
      dropout: the rate the ``dropout`` check builds the layer with (layers with dropout only).
      note: why the case is here.
    """

    name: str
    layer: str
    args: tuple = ()
    inputs: tuple = ()
    mask: str | None = None
    checks: tuple[str, ...] = CHECKS
    seed: int = 0
    dropout: float = 0.0
    note: str = ""
    tags: tuple[str, ...] = field(default=())
    kwargs: tuple = ()

    @property
    def layer_spec(self) -> LayerSpec:
        """How to build and call ``layer`` (``layers.LAYER_SPECS``)."""
        return layer_spec(self.layer)

    @property
    def is_function(self) -> bool:
        return self.layer_spec.is_function

    @property
    def call_args(self) -> tuple:
        """Trailing positional call arguments: a function's ``args`` (a layer's are its
        constructor's)."""
        return self.args if self.is_function else ()

    @property
    def uses_documents_input(self) -> bool:
        return self.inputs in (DOCUMENTS, DOCUMENTS_BATCH)


_NO_DROPOUT = ("forward", "grad", "train", "mask", "dtype")
_FUNCTION_CHECKS = ("forward", "grad", "dtype")
#: No dropout and no mask to test: self-attention layers, one-token inputs (nothing to hide).
_UNMASKED = ("forward", "grad", "train", "dtype")

CASES: tuple[Case, ...] = (
    # ---- functions and the documents' inputs ----------------------------------------------
    Case(
        "softmax_naive_fn",
        "softmax_naive",
        inputs=((6,),),
        checks=_FUNCTION_CHECKS,
        note="the self-attention notebook: the naive softmax on random scores",
    ),
    Case(
        "doc_simplified_self_attention",
        "simplified_self_attention",
        inputs=DOCUMENTS,
        checks=_FUNCTION_CHECKS,
        note="the chapter 3 and self-attention notebooks: weight-free self-attention",
    ),
    Case(
        "causal_renormalized_fn",
        "causal_attn_weights_renormalized",
        args=(2,),
        inputs=((6, 6),),
        checks=_FUNCTION_CHECKS,
        note="the chapter 3 notebook: causal mask after softmax, rows renormalised",
    ),
    Case(
        "causal_masked_fill_fn",
        "causal_attn_weights_masked_fill",
        args=(2,),
        inputs=((6, 6),),
        checks=_FUNCTION_CHECKS,
        note="the chapter 3 notebook: -inf above the diagonal before softmax",
    ),
    Case(
        "doc_v1_seed123",
        "SelfAttention_v1",
        (3, 2),
        DOCUMENTS,
        seed=123,
        checks=_UNMASKED,
        note="the self-attention notebook: SelfAttention_v1(3, 2) after seed 123",
    ),
    Case(
        "doc_v2_seed789",
        "SelfAttention_v2",
        (3, 2),
        DOCUMENTS,
        seed=789,
        checks=_UNMASKED,
        note="the self-attention notebook: SelfAttention_v2(3, 2) after seed 789",
    ),
    Case(
        "doc_selfattention_seed123",
        "SelfAttention",
        (3, 2),
        DOCUMENTS,
        seed=123,
        checks=_UNMASKED,
        note="the chapter 3 notebook: SelfAttention(3, 2) after seed 123",
    ),
    Case(
        "doc_causal_batch",
        "CausalAttention",
        (3, 2, 6, 0.0),
        DOCUMENTS_BATCH,
        seed=123,
        dropout=0.5,
        note="the chapter 3 notebook and the CausalAttention listing: CausalAttention on the "
        "(2, 6, 3) batch",
    ),
    Case(
        "doc_wrapper_2heads",
        "MultiHeadAttentionWrapper",
        (3, 2, 6, 0.0, 2),
        DOCUMENTS_BATCH,
        seed=123,
        dropout=0.5,
        note="the chapter 3 notebook: the wrapper with 2 heads -> (2, 6, 4)",
    ),
    Case(
        "doc_mha_2heads",
        "MultiHeadAttention",
        (3, 4, 6, 0.0, 2),
        DOCUMENTS_BATCH,
        seed=123,
        dropout=0.5,
        note="the chapter 3 notebook and article: MultiHeadAttention on the documents' batch",
    ),
    Case(
        "doc_annotated_main",
        "MultiHeadedAttention",
        (2, 8, 0.0),
        ((6, 3, 8),) * 3,
        "causal",
        seed=0,
        dropout=0.1,
        note="the annotated-transformer post's __main__: b 6, seq_len 3, d_model 8, causal",
    ),
    # ---- random configurations ---------------------------------------------------------------
    Case(
        "v1_wide",
        "SelfAttention_v1",
        (16, 24),
        ((10, 16),),
        # No ``train``: torch.rand weights (all positive) on standard normal inputs saturate the
        # softmax (scaled scores near +-100), W_key's gradient becomes a cancellation with a
        # float32 relative error of ~2.5e-4 on either side, and Adam's per-entry normalisation
        # turns that into a 1.3e-4 drift in 50 steps. v1 trains in ``doc_v1_seed123`` instead.
        checks=("forward", "grad", "dtype"),
        note="d_in != d_out, saturated softmax",
    ),
    Case(
        "v2_bias",
        "SelfAttention_v2",
        (8, 8, True),
        ((7, 8),),
        checks=_UNMASKED,
        note="qkv_bias on",
    ),
    Case("v2_one_token", "SelfAttention_v2", (5, 3), ((1, 5),), checks=_UNMASKED, note="one token"),
    Case(
        "causal_bias_full_context",
        "CausalAttention",
        (8, 12, 9, 0.0, True),
        ((3, 9, 8),),
        dropout=0.25,
        note="qkv_bias on, num_tokens == context_length, d_in != d_out",
    ),
    Case(
        "causal_batch1_short",
        "CausalAttention",
        (6, 4, 16, 0.0),
        ((1, 5, 6),),
        dropout=0.25,
        note="batch 1, num_tokens < context_length",
    ),
    Case(
        "causal_one_token",
        "CausalAttention",
        (4, 4, 8, 0.0, True),
        ((2, 1, 4),),
        checks=_UNMASKED,
        note="one token: the only weight is 1",
    ),
    Case(
        "wrapper_3heads_bias",
        "MultiHeadAttentionWrapper",
        (6, 5, 7, 0.0, 3, True),
        ((2, 7, 6),),
        dropout=0.25,
        note="odd head count, qkv_bias on, full context",
    ),
    Case(
        "mha_odd_heads",
        "MultiHeadAttention",
        (10, 15, 12, 0.0, 3),
        ((2, 11, 10),),
        dropout=0.25,
        note="3 heads of 5, d_in != d_out",
    ),
    Case(
        "mha_bias_batch1",
        "MultiHeadAttention",
        (16, 16, 8, 0.0, 4, True),
        ((1, 8, 16),),
        dropout=0.25,
        note="qkv_bias on, batch 1, num_tokens == context_length",
    ),
    Case(
        "mha_one_token",
        "MultiHeadAttention",
        (8, 8, 4, 0.0, 2),
        ((3, 1, 8),),
        checks=_UNMASKED,
        note="one token",
    ),
    Case(
        "annotated_self_causal",
        "MultiHeadedAttention",
        (4, 16, 0.0),
        ((2, 9, 16),) * 3,
        "causal",
        dropout=0.25,
        note="self-attention, (1, t, t) causal mask",
    ),
    Case(
        "annotated_cross_padding",
        "MultiHeadedAttention",
        (3, 12, 0.0),
        ((2, 5, 12), (2, 8, 12), (2, 8, 12)),
        "padding",
        dropout=0.25,
        note="cross-attention q_len 5, k_len 8, padding mask (b, 1, s), odd heads",
    ),
    Case(
        "annotated_fully_masked_row",
        "MultiHeadedAttention",
        (2, 8, 0.0),
        ((2, 4, 8),) * 3,
        "fully_masked_row",
        checks=_NO_DROPOUT,
        note="one query row masked everywhere: uniform weights, finite gradients",
    ),
    Case(
        "annotated_no_mask_one_token",
        "MultiHeadedAttention",
        (1, 6, 0.0),
        ((3, 1, 6), (3, 4, 6), (3, 4, 6)),
        None,
        checks=_UNMASKED,
        note="one query token, no mask, one head",
    ),
    Case(
        "attention_fn_padding",
        "attention",
        inputs=((2, 3, 4, 5), (2, 3, 6, 5), (2, 3, 6, 7)),
        mask="padding",
        checks=_FUNCTION_CHECKS,
        note="the annotated-transformer post's attention(): cross lengths, v_dim != k_dim, "
        "padding mask",
    ),
    # ---- GPT-2 small sizes (forward and grad only: the float32 parity claim at scale) ---------
    Case(
        "gpt2_v2",
        "SelfAttention_v2",
        (768, 768, True),
        ((1024, 768),),
        checks=("forward",),
        tags=("large",),
        note="GPT-2 small sizes, one unbatched sequence",
    ),
    Case(
        "gpt2_causal",
        "CausalAttention",
        (768, 768, 1024, 0.0, True),
        ((1, 1024, 768),),
        checks=("forward",),
        tags=("large",),
        note="GPT-2 small sizes, one head of 768",
    ),
    Case(
        "gpt2_wrapper",
        "MultiHeadAttentionWrapper",
        (768, 64, 1024, 0.0, 12, True),
        ((1, 1024, 768),),
        checks=("forward",),
        tags=("large",),
        note="GPT-2 small: 12 stacked heads of 64",
    ),
    # ---- the book's modern attention (chapter 4 bonus; keyword arguments as both take them) ----
    Case(
        "gqa_6heads_2groups",
        "GroupedQueryAttention",
        (12, 18, 0.0, 6, 2),
        ((2, 9, 12),),
        dropout=0.25,
        note="6 query heads over 2 key groups, d_in != d_out, no out_proj bias (the book's)",
    ),
    Case(
        "gqa_multi_query_bias",
        "GroupedQueryAttention",
        (16, 16, 0.0, 4, 1),
        ((1, 7, 16),),
        dropout=0.25,
        kwargs=(("qkv_bias", True),),
        note="one key head for all 4 (multi-query), qkv_bias on",
    ),
    Case(
        "mla_default_latent",
        "MultiHeadLatentAttention",
        (12, 16, 0.0, 4),
        ((2, 9, 12),),
        dropout=0.25,
        note="the book's default latent, max(16, d_out // 8) = 16",
    ),
    Case(
        "mla_latent6_bias",
        "MultiHeadLatentAttention",
        (16, 24, 0.0, 3),
        ((2, 8, 16),),
        dropout=0.25,
        kwargs=(("qkv_bias", True), ("latent_dim", 6)),
        note="a latent narrower than a head's features, biases on",
    ),
    Case(
        "swa_window3",
        "MultiHeadAttentionWithSWA",
        (12, 16, 0.0, 4),
        ((2, 11, 12),),
        dropout=0.25,
        kwargs=(("sliding_window_size", 3),),
        note="a window of 3 over 11 tokens",
    ),
    Case(
        "swa_no_window_bias",
        "MultiHeadAttentionWithSWA",
        (16, 16, 0.0, 2),
        ((1, 6, 16),),
        dropout=0.25,
        kwargs=(("qkv_bias", True), ("sliding_window_size", None)),
        note="no window: chapter 3's layer, qkv_bias on",
    ),
    Case(
        "gpt2_mha",
        "MultiHeadAttention",
        (768, 768, 1024, 0.0, 12, True),
        ((1, 1024, 768),),
        checks=("forward", "grad"),
        tags=("large",),
        note="GPT-2 small: d 768, 12 heads, 1024 tokens",
    ),
    Case(
        "gpt2_annotated",
        "MultiHeadedAttention",
        (12, 768, 0.0),
        ((1, 1024, 768),) * 3,
        "causal",
        checks=("forward",),
        tags=("large",),
        note="GPT-2 small sizes through the annotated-transformer post's layer",
    ),
)


#: Parameters whose true gradient is exactly zero: softmax ignores a shift shared by all keys,
#: and the key bias adds ``q . b_k`` to every key's score of a query. Adam turns rounding noise in
#: their gradients into full-size steps, so ``train`` checks them by their (nil) effect and their
#: gradients, not by their values (see the README). ``linears.1.bias``: the key projection of
#: the Annotated Transformer's whole model (``annotated_model.py``, the post's attribute names).
#: ``W_UK.bias``: latent attention's key up-projection, whose bias is the keys' shared shift too.
SHIFT_INVARIANT_SUFFIXES = ("W_key.bias", "proj_weights.1.bias", "linears.1.bias", "W_UK.bias")


def is_shift_invariant(torch_name: str) -> bool:
    return torch_name.endswith(SHIFT_INVARIANT_SUFFIXES)


# ---- whole models ---------------------------------------------------------------------------


#: The checks a whole-model case runs (``whole_models.py``): no dropout or mask rows.
MODEL_CHECKS = ("forward", "grad", "train", "dtype")


@dataclass(frozen=True)
class ModelCase:
    """A whole model of ``flax_attention.models`` against its torch twin in ``conformance_tests``.

    Attributes:
      name: unique id (report rows use it); the cases start ``model_``.
      model: ``"GPTModel"`` (the book's, twin ``book_gpt.py``), ``"annotated"`` (the
        Annotated Transformer's encoder-decoder, twin ``annotated_model.py``), or
        ``"Qwen3Model"`` and ``"Llama3Model"`` (twin the book's own package,
        ``llms_from_scratch.qwen3`` and ``.llama3``).
      config: the model's sizes as ``(key, value)`` pairs (the tests' small sizes; a dict
        value, Llama 3's ``rope_freq``, as pairs too), without ``dtype`` (each side adds its
        own).
      checks: a subset of ``MODEL_CHECKS`` (``dtype``: bfloat16 rows only).
      seed: ``torch.manual_seed`` for the twin's weights (NumPy's for the book's package's
        models, whose experts torch does not draw); NumPy seed for the batches.
      steps: the ``train`` check's optimiser steps.
      note: why the case is here.
    """

    name: str
    model: str
    config: tuple[tuple[str, object], ...]
    checks: tuple[str, ...] = MODEL_CHECKS
    seed: int = 0
    steps: int = 20
    note: str = ""
    tags: tuple[str, ...] = field(default=())


#: The Qwen3 and Llama 3 tests' configs (``tests/test_qwen3_llama3.py``'s ``QWEN``,
#: ``QWEN_MOE``, ``LLAMA``), without ``dtype``.
_QWEN3 = (("vocab_size", 97), ("context_length", 64), ("emb_dim", 32), ("n_heads", 4),
          ("n_layers", 2), ("hidden_dim", 48), ("head_dim", 16), ("qk_norm", True),
          ("n_kv_groups", 2), ("rope_base", 10_000.0))  # fmt: skip
_QWEN3_MOE = (*(kv for kv in _QWEN3 if kv[0] != "hidden_dim"), ("num_experts", 6),
              ("num_experts_per_tok", 2), ("moe_intermediate_size", 24))  # fmt: skip
_LLAMA3 = (("vocab_size", 97), ("context_length", 64), ("emb_dim", 64), ("n_heads", 4),
           ("n_layers", 2), ("hidden_dim", 48), ("n_kv_groups", 2), ("rope_base", 500_000.0),
           ("rope_freq", (("factor", 8.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
                          ("original_context_length", 1024))))  # fmt: skip

MODEL_CASES: tuple[ModelCase, ...] = (
    ModelCase(
        "model_gpt_book",
        "GPTModel",
        (
            ("vocab_size", 97),
            ("context_length", 16),
            ("emb_dim", 32),
            ("n_heads", 2),
            ("n_layers", 2),
            ("drop_rate", 0.0),
            ("qkv_bias", True),
        ),
        note="the book's chapter 4 GPTModel (qkv_bias on: every key of GPT-2's checkpoints) on "
        "batches of 2 x 16 token ids: logits and chapter 5's loss, every parameter's gradient "
        "of that loss, 20 AdamW steps of chapter 5's loop (lr 4e-4, weight decay 0.1); "
        "models.quantize's int8 model against the book's model holding its dequantized "
        "weights, and the model in bfloat16 against torch's own bfloat16 model",
    ),
    ModelCase(
        "model_annotated_post",
        "annotated",
        (("V", 11), ("N", 2), ("d_model", 32), ("d_ff", 64), ("h", 4)),
        note="the Annotated Transformer's make_model, every dropout 0: encoder memory, decoder "
        "output and log-probs of a padded batch, every gradient of the label-smoothed loss "
        "(smoothing 0.1), 20 Adam steps of the copy task on the post's schedule",
        checks=("forward", "grad", "train"),
    ),
    ModelCase(
        "model_qwen3_book",
        "Qwen3Model",
        _QWEN3,
        note="the book's package's Qwen3Model (llms_from_scratch.qwen3) at the Qwen3 tests' "
        "sizes: head_dim 16 where emb_dim / n_heads is 8, QK-norm, 4 query heads over 2 key "
        "heads, the norms' scales away from 1; the GPT's batches, loss, AdamW steps and "
        "bfloat16 rows (the book's model built in bfloat16 as its configs build it)",
    ),
    ModelCase(
        "model_qwen3_moe_book",
        "Qwen3Model",
        _QWEN3_MOE,
        seed=1,
        note="the book's mixture-of-experts Qwen3 (6 experts, 2 a token; the book's experts "
        "are on the meta device, so it loads the weights with assign=True): 16-token rows run "
        "every expert, as the book does. Seed 1: at seeds 0 and 2 one weight's first gradient "
        "is a cancellation near Adam's eps (1.9e-9 against 2.2e-9, 9.7e-9 against 1.1e-8: "
        "rounding), which AdamW's first step turns into steps 1e-5 and 7.6e-6 apart, 1.0 and "
        "1.2 of the train row's bound (docs/conformance.md)",
    ),
    ModelCase(
        "model_llama3_book",
        "Llama3Model",
        _LLAMA3,
        note="the book's package's Llama3Model (llms_from_scratch.llama3): rope_freq's "
        "original_context_length 1024 puts the 8 frequencies in all three bands of Llama 3's "
        "scaling (kept, smoothed, divided by factor)",
    ),
)

#: Every case the report runs: the layers' and functions', then the whole models'.
ALL_CASES: tuple[Case | ModelCase, ...] = CASES + MODEL_CASES


def select(pattern: str | None = None, cases=ALL_CASES) -> list[Case | ModelCase]:
    """The cases whose name matches the glob ``pattern`` (all when ``None``)."""
    if not pattern:
        return list(cases)
    return [c for c in cases if fnmatch.fnmatch(c.name, pattern)]
