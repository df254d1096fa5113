"""Weight layouts: how other attention modules name, split and transpose the same weights.

A layout is one description (``Layout``) read by the one checking and copying path in
``flax_attention.weights``. Its keys are written in *roles*: ``q``, ``k``, ``v`` (the three input
projections) and ``o`` (the output projection), each with a ``weight`` in torch's ``nn.Linear``
layout ``(out, in)`` and a ``bias``. ``ROLES`` says which of a layer's own (documents') keys plays
each role. A layout key lists the roles it concatenates along the first axis (q, k, v stacked:
``(3·d_out, d_in)``) and whether the peer stores that concatenation transposed (``Conv1D``:
``(d_in, 3·d_out)``).

==============  =====================================  ==========================================
layout          peer                                   keys
==============  =====================================  ==========================================
``documents``   the documents (``torch_reference``)    the layer's own names (``W_query.weight``)
``torch_nn``    ``torch.nn.MultiheadAttention``        ``in_proj_weight`` (or ``q_proj_weight``,
                                                       ``k_proj_weight``, ``v_proj_weight``),
                                                       ``in_proj_bias``, ``out_proj.weight``/
                                                       ``.bias``
``gpt2``        Hugging Face ``GPT2Attention``         ``c_attn.weight`` ``(d_in, 3·d_out)``,
                                                       ``c_attn.bias``, ``c_proj.weight``
                                                       ``(d_out, d_out)``, ``c_proj.bias``;
                (``GPT2LMHeadModel`` for a model)      a model: ``transformer.h.{i}.…`` or
                                                       ``h.{i}.…`` (``ModelNames``)
``fused_qkv``   the book's combined-QKV variant,       ``qkv.weight`` ``(3·d_out, d_in)``,
                nanoGPT-style code                     ``qkv.bias``, ``proj.weight``/``.bias``
==============  =====================================  ==========================================
"""

from __future__ import annotations

from typing import Literal, NamedTuple

__all__ = ["LAYOUTS", "ROLES", "Buffer", "Key", "Layout", "ModelNames"]

#: The documents' keys that play each role, per layer class (``documents`` takes every layer).
ROLES: dict[str, dict[str, str]] = {
    "MultiHeadAttention": {"q": "W_query", "k": "W_key", "v": "W_value", "o": "out_proj"},
    "MultiHeadedAttention": {
        "q": "proj_weights.0",
        "k": "proj_weights.1",
        "v": "proj_weights.2",
        "o": "proj_weights.3",
    },
}


class Key(NamedTuple):
    """One key of a peer's state dict.

    ``parts``: roles (``"q.weight"``, ...) concatenated along the first axis of torch's layout.
    ``transpose``: the peer stores the concatenation transposed (``Conv1D``, ``(in, out)``).
    ``always``: the peer has the key even where the layer lacks those parameters (a layer built
    with ``qkv_bias=False`` against GPT-2's always-present ``c_attn.bias``): they are exported
    as zeros and must load as zeros. Otherwise such a key is simply not part of the layout.
    ``hint``: added to a wrong-shape message (what the peer calls the mismatched size).
    """

    name: str
    parts: tuple[str, ...]
    transpose: bool = False
    always: bool = True
    hint: str = ""


class Buffer(NamedTuple):
    """A buffer the peer may carry: never required; one that is present is checked.

    ``kind``: ``"triu"`` the documents' ``mask``, ``triu(ones(n, n), diagonal=1)``;
    ``"tril"`` old GPT-2 checkpoints' ``bias``, ``tril(ones(n, n)).view(1, 1, n, n)`` (bool or
    uint8); ``"scalar"`` old GPT-2 checkpoints' ``masked_bias`` (the fill value ``-1e4`` that
    code used instead of ``-inf``: any finite scalar is accepted, its value is not used).
    Causal buffers exist only for causal layers (``n = context_length``). ``export``: written by
    ``state_dict``.
    """

    name: str
    kind: Literal["triu", "tril", "scalar"]
    export: bool


class Layout(NamedTuple):
    """One peer's names. ``layers``: the layer classes it applies to. ``alternatives``: a key
    replaced by others when any of them is given (torch's separate projections). ``bias_free``:
    keys a bias-free peer omits together (``torch.nn.MultiheadAttention(bias=False)``): when
    none is given (and ``when`` is), they load as zeros. ``refused``: keys of a peer option no
    layer here expresses, and why. ``square``: the peer's query projection is square."""

    name: str
    peer: str
    layers: tuple[str, ...]
    keys: tuple[Key, ...] = ()
    buffers: tuple[Buffer, ...] = ()
    alternatives: tuple[tuple[str, tuple[Key, ...]], ...] = ()
    bias_free: tuple[str, ...] = ()
    bias_free_when: str = ""
    refused: tuple[tuple[str, str], ...] = ()
    square: bool = False


class ModelNames(NamedTuple):
    """A whole model's names in a layout, as the model declares them (``peer_names(layout)``).

    ``params``: ``(own key, layout key, transposed)`` for the parameters outside the attention
    layers: the own key is the documents' (torch) name, ``transposed`` says the layout stores
    the transpose of torch's layout (``Conv1D``). ``layers``: ``(own prefix, layout prefix)`` of
    each attention layer, whose own layout of the same name applies under the prefix.
    ``aliases``: ``(layout key, key it repeats)``, a second name of a tied parameter (GPT-2's
    ``lm_head.weight`` for ``wte.weight``): never required, loaded only if equal to what it
    repeats, exported as a copy. ``base_prefixes``: the spellings of the layout's common start
    (Hugging Face's ``transformer.`` or the hub's bare names); the first is exported, a load
    takes the one its keys use. ``unprefixed``: layout keys outside that start.
    """

    params: tuple[tuple[str, str, bool], ...] = ()
    layers: tuple[tuple[str, str], ...] = ()
    aliases: tuple[tuple[str, str], ...] = ()
    base_prefixes: tuple[str, ...] = ("",)
    unprefixed: tuple[str, ...] = ()


_QKV_WEIGHT = ("q.weight", "k.weight", "v.weight")
_QKV_BIAS = ("q.bias", "k.bias", "v.bias")
_ADD_BIAS_KV = (
    "torch.nn.MultiheadAttention(add_bias_kv=True) appends a learned key and value to every "
    "sequence; no layer here does"
)

LAYOUTS: dict[str, Layout] = {
    "documents": Layout(
        "documents",
        "the documents (torch_reference)",
        (
            "SelfAttention_v1",
            "SelfAttention_v2",
            "CausalAttention",
            "MultiHeadAttentionWrapper",
            "MultiHeadAttention",
            "MultiHeadedAttention",
            "GPTModel",
            "EncoderDecoder",
            "LinearWithLoRA",  # the book's appendix E (flax_attention.models.lora)
            "LoRALayer",
        ),
        buffers=(Buffer("mask", "triu", export=True),),
    ),
    "torch_nn": Layout(
        "torch_nn",
        "torch.nn.MultiheadAttention",
        ("MultiHeadAttention", "MultiHeadedAttention"),
        keys=(
            Key("in_proj_weight", _QKV_WEIGHT),
            Key("in_proj_bias", _QKV_BIAS),
            Key("out_proj.weight", ("o.weight",)),
            Key("out_proj.bias", ("o.bias",)),
        ),
        alternatives=(
            (
                "in_proj_weight",
                (
                    Key("q_proj_weight", ("q.weight",)),
                    Key("k_proj_weight", ("k.weight",), hint="torch's kdim must equal d_in"),
                    Key("v_proj_weight", ("v.weight",), hint="torch's vdim must equal d_in"),
                ),
            ),
        ),
        bias_free=("in_proj_bias", "out_proj.bias"),
        bias_free_when="out_proj.weight",
        refused=(("bias_k", _ADD_BIAS_KV), ("bias_v", _ADD_BIAS_KV)),
        square=True,
    ),
    "gpt2": Layout(
        "gpt2",
        "Hugging Face GPT2Attention (GPT2LMHeadModel for a GPTModel)",
        ("MultiHeadAttention", "GPTModel"),
        keys=(
            Key("c_attn.weight", _QKV_WEIGHT, transpose=True),
            Key("c_attn.bias", _QKV_BIAS),
            Key("c_proj.weight", ("o.weight",), transpose=True),
            Key("c_proj.bias", ("o.bias",)),
        ),
        buffers=(Buffer("bias", "tril", export=False), Buffer("masked_bias", "scalar", False)),
    ),
    "fused_qkv": Layout(
        "fused_qkv",
        "one Linear for q, k, v (the book's combined-QKV variant, nanoGPT)",
        ("MultiHeadAttention", "MultiHeadedAttention"),
        keys=(
            Key("qkv.weight", _QKV_WEIGHT),
            Key("qkv.bias", _QKV_BIAS, always=False),
            Key("proj.weight", ("o.weight",)),
            Key("proj.bias", ("o.bias",)),
        ),
        buffers=(Buffer("mask", "triu", export=True),),
    ),
}
