"""Every layer and function of both packages described once, as data (no framework code).

The harness, the tests and the parity API read how to call a layer from here, never from a branch
on its name: which positional inputs it takes, whether the caller's mask comes after them (and in
what form), what it returns (and what it keeps as an attribute instead), which constructor
argument is the dropout rate and where the dropout sits, and whether it masks itself causally.

``LAYER_SPECS`` maps the shared name (the same in ``torch_reference`` and ``flax_attention``) to
its ``LayerSpec``; ``layer_spec(name)`` looks one up. ``args_for(sizes)`` and
``input_shapes(...)`` turn named sizes into constructor arguments and input shapes, so a test
that needs "every layer at small sizes" builds them from one dictionary of sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LayerSpec", "LAYER_SPECS", "layer_spec"]


@dataclass(frozen=True)
class LayerSpec:
    """How to build and call one layer (or weight-free function) of both packages.

    Attributes:
      name: the shared name in both packages.
      is_function: a weight-free function (its trailing call arguments are the case's ``args``)
        rather than a class with weights.
      inputs: the names of the positional inputs, in order (``("x",)`` for self-attention,
        ``("query", "key", "value")`` for the annotated-transformer post).
      key_inputs: indices of the inputs that the keys and values come from (a change there can
        only reach the outputs through the attention weights).
      takes_mask: the caller's mask is the positional argument after the inputs (``1`` =
        attend; ``None`` = no mask).
      mask_over_heads: the mask is given with the inputs' head axis (the inputs are already
        split into heads, ``(b, h, t, d)``); otherwise it is ``(b | 1, t | 1, s)`` and the layer
        broadcasts it over its heads.
      outputs: the names of what the call returns, in order (a single array is ``("out",)``).
      kept_outputs: outputs the layer keeps as an attribute of that name after the call rather
        than returning them (the annotated-transformer post's ``attention_score``); they follow
        ``outputs``. The Flax layer keeps one only while its ``keep_<name>`` option (if it has
        one) is true.
      weights_output: the name of the output (returned or kept) that holds the attention
        weights, or ``None``.
      params: what each positional constructor argument means, by the documents' names; the
        wrapper's ``d_out`` is the width of each head, so it is called ``head_dim`` here.
      dropout_arg: the index of the dropout rate among the constructor arguments, or ``None``.
      dropout_on: where the layer's dropout sits (documentation for the dropout check, which
        finds every ``Dropout`` module by path).
      causal: the layer masks the future itself (the causal family).
      batched: the inputs carry a leading batch axis ``(b, t, d)``; otherwise ``(t, d)``.
      equal_clones: the attribute holding sublayers that the torch constructor deep-copies (so
        they start equal); tests that want distinct weights re-initialise them.
    """

    name: str
    is_function: bool = False
    inputs: tuple[str, ...] = ("x",)
    key_inputs: tuple[int, ...] = (0,)
    takes_mask: bool = False
    mask_over_heads: bool = False
    outputs: tuple[str, ...] = ("out",)
    kept_outputs: tuple[str, ...] = ()
    weights_output: str | None = None
    params: tuple[str, ...] = ()
    dropout_arg: int | None = None
    dropout_on: str | None = None
    causal: bool = False
    batched: bool = True
    equal_clones: str | None = None

    @property
    def output_names(self) -> tuple[str, ...]:
        """Every output, returned ones first, then the kept ones."""
        return self.outputs + self.kept_outputs

    @property
    def has_dropout(self) -> bool:
        return self.dropout_arg is not None

    @property
    def feature(self) -> str:
        """The name of the inputs' feature size among ``params`` (``d_in`` or ``d_model``)."""
        return "d_model" if "d_model" in self.params else "d_in"

    def args_for(self, sizes: dict) -> tuple:
        """Positional constructor arguments from named sizes (keys of ``params``)."""
        return tuple(sizes[p] for p in self.params)

    def input_shapes(self, sizes: dict, num_tokens: int, kv_tokens: int | None = None) -> tuple:
        """One shape per input: ``(b, num_tokens, feature)`` (no ``b`` when unbatched); the key
        inputs of a cross-attention layer get ``kv_tokens`` (default ``num_tokens``)."""
        lead = (sizes["batch"],) if self.batched else ()
        feature = sizes[self.feature]
        kv_tokens = num_tokens if kv_tokens is None else kv_tokens
        return tuple(
            (*lead, kv_tokens if i in self.key_inputs and i > 0 else num_tokens, feature)
            for i in range(len(self.inputs))
        )


_WEIGHTS_DROPOUT = "on the attention weights, after softmax"
_CAUSAL = ("d_in", "d_out", "context_length", "dropout")

#: The shared layers (classes with weights), then the weight-free functions, in the documents'
#: order. ``spec.LAYERS`` and ``spec.FUNCTIONS`` are their names.
LAYER_SPECS: dict[str, LayerSpec] = {
    spec.name: spec
    for spec in (
        LayerSpec("SelfAttention_v1", params=("d_in", "d_out"), batched=False),
        LayerSpec("SelfAttention_v2", params=("d_in", "d_out", "qkv_bias"), batched=False),
        LayerSpec("SelfAttention", params=("d_in", "d_out", "qkv_bias"), batched=False),
        LayerSpec(
            "CausalAttention",
            params=(*_CAUSAL, "qkv_bias"),
            dropout_arg=3,
            dropout_on=_WEIGHTS_DROPOUT,
            causal=True,
        ),
        LayerSpec(
            "MultiHeadAttentionWrapper",
            params=("d_in", "head_dim", "context_length", "dropout", "num_heads", "qkv_bias"),
            dropout_arg=3,
            dropout_on=_WEIGHTS_DROPOUT + ", in each head",
            causal=True,
        ),
        LayerSpec(
            "MultiHeadAttention",
            params=(*_CAUSAL, "num_heads", "qkv_bias"),
            dropout_arg=3,
            dropout_on=_WEIGHTS_DROPOUT,
            causal=True,
        ),
        *(
            LayerSpec(
                name,
                params=("d_in", "d_out", "dropout", "num_heads", *extra),
                dropout_arg=2,
                dropout_on=_WEIGHTS_DROPOUT,
                causal=True,
            )
            for name, extra in (
                ("GroupedQueryAttention", ("num_kv_groups",)),
                ("MultiHeadLatentAttention", ()),
                ("MultiHeadAttentionWithSWA", ()),
            )
        ),
        LayerSpec(
            "MultiHeadedAttention",
            inputs=("query", "key", "value"),
            key_inputs=(1, 2),
            takes_mask=True,
            kept_outputs=("attention_score",),
            weights_output="attention_score",
            params=("num_heads", "d_model", "dropout"),
            dropout_arg=2,
            dropout_on=_WEIGHTS_DROPOUT
            + " (the annotated-transformer post's attention(..., dropout))",
            equal_clones="proj_weights",
        ),
        # ---- weight-free functions ----
        LayerSpec("softmax_naive", is_function=True, batched=False),
        LayerSpec(
            "simplified_self_attention",
            is_function=True,
            inputs=("inputs",),
            outputs=("attn_scores", "attn_weights", "context_vecs"),
            weights_output="attn_weights",
            batched=False,
        ),
        LayerSpec(
            "causal_attn_weights_renormalized",
            is_function=True,
            inputs=("attn_scores",),
            batched=False,
        ),
        LayerSpec(
            "causal_attn_weights_masked_fill",
            is_function=True,
            inputs=("attn_scores",),
            batched=False,
        ),
        LayerSpec(
            "attention",
            is_function=True,
            inputs=("query", "key", "value"),
            key_inputs=(1, 2),
            takes_mask=True,
            mask_over_heads=True,
            outputs=("out", "attention_score"),
            weights_output="attention_score",
        ),
    )
}


def layer_spec(name: str) -> LayerSpec:
    """The ``LayerSpec`` of ``name`` (a layer or function of both packages)."""
    try:
        return LAYER_SPECS[name]
    except KeyError:
        raise ValueError(
            f"layer ({name!r}) must be one of the shared names ({', '.join(LAYER_SPECS)})"
        ) from None
