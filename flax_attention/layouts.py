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
``llama``       Hugging Face ``LlamaForCausalLM``,     a whole model's: ``model.layers.{i}.
                ``Qwen3ForCausalLM``,                  self_attn.q_proj.weight``, ...,
                ``Qwen3MoeForCausalLM``                ``lm_head.weight`` (``ModelNames``)
==============  =====================================  ==========================================

Which class takes which layout, and under which names, is one registry (``register``, ``Names``),
looked up by class (a registered class's subclasses inherit its entry). Each class's entry also
holds the rest of what is known of it class by class, so that it is written once: how
``interop.from_torch`` reads its constructor's arguments from its ``torch_reference`` twin
(``from_torch_args``, looked up by the torch class's name), and the hooks by which a family of
modules refuses a layout or explains a failed load (``layout_refusal``, ``load_hint``, asked of
every module):

==================================  =============================================================
class                               its ``Names``
==================================  =============================================================
``SelfAttention_v1``, ``_v2``,      ``documents`` only (the graph's own names)
``MultiHeadAttentionWrapper``
``CausalAttention``                 ``documents``; buffer ``mask`` (``triu``, of ``context_length``)
``MultiHeadAttention``              every layout; roles ``W_query``, ``W_key``, ``W_value``,
                                    ``out_proj``; buffer ``mask``
``MultiHeadedAttention``            ``documents``, ``torch_nn``, ``fused_qkv``; roles
                                    ``proj_weights.0`` .. ``.3``
(each of the six above)             ``from_torch_args`` (sizes from the state dict's shapes,
                                    ``dropout`` and ``num_heads`` from the module)
``models.GPTModel``                 ``documents`` (a tied head's ``out_head.weight``), ``gpt2``
                                    (``GPT2LMHeadModel``'s names: ``gpt_model_names``)
``models.annotated.EncoderDecoder`` ``documents`` under the post's names (``linears.{i}``:
                                    ``encoder_decoder_names``)
``models.lora.LinearWithLoRA``,     ``documents`` only (the book's appendix E names);
``LoRALayer``                       ``LoRALayer``'s hooks: a module holding LoRA matrices refuses
                                    the peers' layouts, and a LoRA state dict offered to a plain
                                    model (or the converse) says so in the error's first line
``models.quantized.Int8Linear``,    ``documents``; ``weight`` (``(out, in)``, as torch's) and
``Int8Embed``                       ``embedding`` held as int8, exported times ``scale``
                                    (``dequantized``)
==================================  =============================================================

The layers are registered here; each model is registered by one line where it is defined (the
models import this package, not the converse; ``flax_attention.models`` imports them all, so
their hooks are asked once it is imported). Inside any module the bridge names nnx's variables
as torch does (``TORCH_VARIABLES``: a ``kernel`` is the transpose of ``nn.Linear``'s ``weight``,
an ``embedding`` ``nn.Embedding``'s ``weight``); every other variable keeps its path.

Your own class
--------------
A module of your own (a block, a model around the layers here) is refused by the bridge until it
is registered; then its state dict is its graph's variables under their paths, as above, its
registered layers' buffers included::

    from flax_attention import layouts

    class Block(nnx.Module):  # a MultiHeadAttention and a Linear
        ...

    layouts.register(Block, layouts.Names())  # the documents' names: att.W_query.weight, ...

``Names(layouts=(...), roles={...})`` lets an attention layer of your own take the peers'
layouts (its q, k, v, o projections' own names); ``Names(model=fn)`` gives a model other names,
``fn(model, layout) -> ModelNames`` (as ``gpt_model_names``), and ``buffers`` declares buffers
its torch counterpart carries that are not Flax state. ``layout_refusal`` and ``load_hint``
(``Names``' docstring) give a family of modules of yours its own refusals and hints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

import numpy as np
from flax import nnx

from flax_attention.annotated import MultiHeadedAttention
from flax_attention.causal import CausalAttention, MultiHeadAttentionWrapper, documents_mask
from flax_attention.multihead import MultiHeadAttention
from flax_attention.self_attention import SelfAttention_v1, SelfAttention_v2

__all__ = [
    "LAYOUTS",
    "TORCH_VARIABLES",
    "Buffer",
    "Key",
    "Layout",
    "ModelNames",
    "Names",
    "encoder_decoder_names",
    "gpt_model_names",
    "layers_taking",
    "names_of",
    "register",
    "registered",
]


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
    Causal buffers exist only for causal layers (``n = context_length``, the layer's registered
    ``mask``). ``export``: written by ``state_dict``.
    """

    name: str
    kind: Literal["triu", "tril", "scalar"]
    export: bool


class Layout(NamedTuple):
    """One peer's names. ``alternatives``: a key replaced by others when any of them is given
    (torch's separate projections). ``bias_free``: keys a bias-free peer omits together
    (``torch.nn.MultiheadAttention(bias=False)``): when none is given (and ``when`` is), they
    load as zeros. ``refused``: keys of a peer option no layer here expresses, and why.
    ``square``: the peer's query projection is square. Which classes take it: the registry
    (``layers_taking``)."""

    name: str
    peer: str
    keys: tuple[Key, ...] = ()
    buffers: tuple[Buffer, ...] = ()
    alternatives: tuple[tuple[str, tuple[Key, ...]], ...] = ()
    bias_free: tuple[str, ...] = ()
    bias_free_when: str = ""
    refused: tuple[tuple[str, str], ...] = ()
    square: bool = False


class ModelNames(NamedTuple):
    """A whole model's names in a layout, as its registered ``Names.model`` gives them.

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
        buffers=(Buffer("mask", "triu", export=True),),
    ),
    "torch_nn": Layout(
        "torch_nn",
        "torch.nn.MultiheadAttention",
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
        keys=(
            Key("qkv.weight", _QKV_WEIGHT),
            Key("qkv.bias", _QKV_BIAS, always=False),
            Key("proj.weight", ("o.weight",)),
            Key("proj.bias", ("o.bias",)),
        ),
        buffers=(Buffer("mask", "triu", export=True),),
    ),
    # A model's names only (``models.qwen3``, ``models.llama3``: ``ModelNames.params``).
    "llama": Layout(
        "llama",
        "Hugging Face LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM (a whole model)",
    ),
}

#: nnx's variable names that torch names otherwise, in any module: name -> (torch's name, the
#: torch value is the transpose). ``nn.Linear``'s ``weight`` ``(out, in)`` is the transpose of
#: ``nnx.Linear``'s ``kernel``; ``nn.Embedding``'s ``weight`` is ``nnx.Embed``'s ``embedding``.
TORCH_VARIABLES: dict[str, tuple[str, bool]] = {
    "kernel": ("weight", True),
    "embedding": ("weight", False),
}

#: The roles of the peers' layouts: an attention layer's q, k, v and o projections.
ROLE_NAMES = ("q", "k", "v", "o")


class Names(NamedTuple):
    """How the weight bridge names one class's weights (``register``), and the class's other
    per-class knowledge the bridge and ``interop`` ask for (the one place it is written).

    ``layouts``: the layouts it takes (``"documents"``, the graph's own names, always among
    them). ``roles``: an attention layer's projections, ``{"q": "W_query", "k": ..., "v": ...,
    "o": ...}`` (each an ``nnx.Linear``'s path): the peers' layouts (``torch_nn``, ``gpt2``,
    ``fused_qkv``) are written in these roles. ``buffers``: ``(name, value)`` pairs, a buffer
    the torch module carries that is not Flax state, ``value(module)`` its array; only the
    causal ``mask`` (``triu(ones(n, n), diagonal=1)``) is a buffer the layouts know. ``model``:
    a whole model's names, ``model(module, layout) -> ModelNames`` (renamed parameters, its
    attention layers' prefixes, tied aliases); ``None``: the graph's paths. ``dequantized``:
    ``(weight, scale)`` pairs, a weight held quantized and exported as ``weight * scale`` (one
    scale per output feature), which a load refuses. ``stacked``: ``(variable, pattern,
    transpose)``, a parameter stacked along its first axis that torch holds as one tensor per
    index, ``pattern.format(i)`` under the module (a mixture of experts' ``fc1`` ``(E, d, h)``
    as ``fc1.{i}.weight``, each the transpose of a slice when ``transpose``).

    ``from_torch_args``: for a class the documents define (``torch_reference`` has a class of
    the same name), its constructor's positional arguments read from such a torch module,
    ``from_torch_args(module, state) -> tuple``, ``state`` its ``state_dict()`` as NumPy arrays
    under the documents' names (sizes from the weights, ``dropout`` and the like from the
    module's attributes): ``interop.from_torch`` builds the class with them and loads ``state``.
    ``None``: ``from_torch`` refuses a torch module of that name.

    Two hooks the bridge asks of *every* module, whatever its class (a class's instances may
    sit anywhere in another model's graph, or be absent where a state dict expected them), so
    that what only one family of modules knows stays where that family is defined (appendix
    E's LoRA layers, ``flax_attention.models.lora``). ``layout_refusal(module, layout) -> str``:
    why ``module`` cannot be read or written in ``layout`` (a ``Layout`` other than
    ``"documents"``) though its class takes it, the whole ``ValueError`` message, ``""`` if
    nothing stops it; a layout refused so is never suggested either. ``load_hint(module,
    missing, unexpected, state_dict) -> str``: after a strict load that found problems, the line
    that says what went wrong as a whole (a state dict of models with these modules offered to a
    model without them, or the converse), ``""`` if none; the first non-empty one heads the
    error (else the line naming a better layout, if any).
    """

    layouts: tuple[str, ...] = ("documents",)
    roles: Mapping[str, str] | None = None
    buffers: tuple[tuple[str, Callable[[Any], np.ndarray]], ...] = ()
    model: Callable[[Any, str], ModelNames] | None = None
    dequantized: tuple[tuple[str, str], ...] = ()
    from_torch_args: Callable[[Any, Mapping[str, np.ndarray]], tuple] | None = None
    layout_refusal: Callable[[Any, Layout], str] | None = None
    load_hint: Callable[[Any, list, list, Any], str] | None = None
    stacked: tuple[tuple[str, str, bool], ...] = ()


#: class -> its names, in registration order.
_REGISTRY: dict[type, Names] = {}


def register(cls: type, names: Names) -> type:
    """Register ``cls``'s weight names (``Names``) with the bridge; returns ``cls``. Registering
    a class again replaces its entry. ``load_state_dict``, ``state_dict``, ``load_file`` and
    ``save_file`` take an instance of a registered class or of its subclasses, and refuse any
    other module."""
    if not isinstance(cls, type):
        raise TypeError(f"cls ({cls!r}) must be a class (the module type to name)")
    if not isinstance(names, Names):
        raise TypeError(
            f"names ({type(names).__name__}) must be a flax_attention.layouts.Names "
            "(e.g. Names() for the documents' names)"
        )
    unknown = [layout for layout in names.layouts if layout not in LAYOUTS]
    if unknown or "documents" not in names.layouts:
        raise ValueError(
            f"names.layouts ({names.layouts!r}) must be among {tuple(LAYOUTS)} and include "
            "'documents' (every class's own names)"
        )
    peers = [layout for layout in names.layouts if layout != "documents"]
    roles = names.roles or {}
    if peers and names.model is None and set(roles) != set(ROLE_NAMES):
        raise ValueError(
            f"names.roles ({names.roles!r}) must name the projections {ROLE_NAMES} of "
            f"{cls.__name__} for layouts {tuple(peers)} (or names.model a whole model's names)"
        )
    _REGISTRY[cls] = names
    return cls


def names_of(module) -> tuple[type, Names] | None:
    """The registered class ``module`` is (or derives from) and its ``Names``; ``None`` if no
    class of its type's bases is registered."""
    for cls in type(module).__mro__:
        if cls in _REGISTRY:
            return cls, _REGISTRY[cls]
    return None


def registered() -> tuple[tuple[type, Names], ...]:
    """Every registered class and its ``Names``, in registration order."""
    return tuple(_REGISTRY.items())


def layers_taking(layout: str) -> tuple[str, ...]:
    """The names of the registered classes that take ``layout``, in registration order."""
    return tuple(cls.__name__ for cls, names in _REGISTRY.items() if layout in names.layouts)


def gpt_model_names(cfg: Mapping, layout: str) -> ModelNames:
    """The book's ``GPTModel``'s names in ``layout`` for ``cfg``: ``"documents"`` (the book's:
    only the tied head's second name, ``out_head.weight``) or ``"gpt2"`` (Hugging Face's
    ``GPT2LMHeadModel``)."""
    tied = cfg["tie_word_embeddings"]
    if layout == "documents":
        aliases = (("out_head.weight", "tok_emb.weight"),) if tied else ()
        return ModelNames(aliases=aliases)
    params = [("tok_emb.weight", "wte.weight", False), ("pos_emb.weight", "wpe.weight", False)]
    layers = []
    for i in range(cfg["n_layers"]):
        own, peer = f"trf_blocks.{i}.", f"h.{i}."
        layers.append((own + "att.", peer + "attn."))
        for norm, ln in (("norm1", "ln_1"), ("norm2", "ln_2")):
            params.append((f"{own}{norm}.scale", f"{peer}{ln}.weight", False))
            params.append((f"{own}{norm}.shift", f"{peer}{ln}.bias", False))
        for linear, conv in (("ff.layers.0", "mlp.c_fc"), ("ff.layers.2", "mlp.c_proj")):
            # Conv1D stores (d_in, d_out): the transpose of torch's Linear weight
            params.append((f"{own}{linear}.weight", f"{peer}{conv}.weight", True))
            params.append((f"{own}{linear}.bias", f"{peer}{conv}.bias", False))
    params += [("final_norm.scale", "ln_f.weight", False), ("final_norm.shift", "ln_f.bias", False)]
    head = ("out_head.weight", "lm_head.weight", False)
    return ModelNames(
        params=tuple(params) + (() if tied else (head,)),
        layers=tuple(layers),
        aliases=(("lm_head.weight", "wte.weight"),) if tied else (),
        base_prefixes=("transformer.", ""),
        unprefixed=("lm_head.weight",),
    )


def encoder_decoder_names(model, layout: str) -> ModelNames:
    """The Annotated Transformer post's ``EncoderDecoder`` names (``layout="documents"``, the
    only one it takes): its attention layers' ``linears.{j}`` (ours: ``proj_weights.{j}``)."""
    params = []
    for name, attentions in (("encoder", ("self_attn",)), ("decoder", ("self_attn", "src_attn"))):
        for i in range(len(getattr(model, name).layers)):
            for attention in attentions:
                own = f"{name}.layers.{i}.{attention}."
                for j in range(4):
                    for kind in ("weight", "bias"):
                        params.append(
                            (f"{own}proj_weights.{j}.{kind}", f"{own}linears.{j}.{kind}", False)
                        )
    return ModelNames(params=tuple(params))


def _causal_mask(layer) -> np.ndarray:
    """The documents' buffer, ``triu(ones(context_length, context_length), diagonal=1)``."""
    return documents_mask(layer.context_length)


_MASK = (("mask", _causal_mask),)


# Each layer's constructor arguments read from its torch_reference twin (Names.from_torch_args):
# sizes from the state dict's shapes (torch's (out, in) weights), a bias from its presence,
# context_length from the mask buffer, the rest from the module's attributes.


def _v1_args(module, state) -> tuple:  # SelfAttention_v1(d_in, d_out): W_query (d_in, d_out)
    return tuple(state["W_query"].shape)


def _v2_args(module, state) -> tuple:  # SelfAttention_v2(d_in, d_out, qkv_bias)
    d_out, d_in = state["W_query.weight"].shape
    return d_in, d_out, "W_query.bias" in state


def _causal_args(module, state) -> tuple:
    # CausalAttention(d_in, d_out, context_length, dropout, qkv_bias)
    d_out, d_in = state["W_query.weight"].shape
    bias = "W_query.bias" in state
    return d_in, d_out, state["mask"].shape[0], module.dropout.p, bias


def _wrapper_args(module, state) -> tuple:
    # MultiHeadAttentionWrapper(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
    d_out, d_in = state["heads.0.W_query.weight"].shape
    head = module.heads[0]
    bias = "heads.0.W_query.bias" in state
    context_length = state["heads.0.mask"].shape[0]
    return d_in, d_out, context_length, head.dropout.p, len(module.heads), bias


def _multihead_args(module, state) -> tuple:
    # MultiHeadAttention(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
    d_out, d_in = state["W_query.weight"].shape
    bias = "W_query.bias" in state
    return d_in, d_out, state["mask"].shape[0], module.dropout.p, module.num_heads, bias


def _multiheaded_args(module, state) -> tuple:  # MultiHeadedAttention(num_heads, d_model, dropout)
    return module.num_heads, state["proj_weights.0.weight"].shape[1], module.dropout.p


#: The layouts whose peers hold one key head per query head.
_ONE_KEY_HEAD_A_QUERY_HEAD = ("torch_nn", "gpt2", "fused_qkv")


def _grouped_refusal(module, layout) -> str:
    """The peers' layouts hold one key head per query head (torch's ``nn.MultiheadAttention``,
    GPT-2's ``c_attn``, the fused ``qkv``): a ``MultiHeadAttention`` with grouped key heads in
    ``module`` has no file in them."""
    if layout.name not in _ONE_KEY_HEAD_A_QUERY_HEAD:
        return ""
    for _, node in nnx.iter_graph(module):
        if isinstance(node, MultiHeadAttention) and node.num_kv_heads != node.num_heads:
            return (
                f"layout ({layout.name!r}) must be 'documents' for a MultiHeadAttention with "
                f"grouped key heads (num_kv_heads {node.num_kv_heads} of num_heads "
                f"{node.num_heads}): {layout.name} holds one key head per query head"
            )
    return ""


register(SelfAttention_v1, Names(from_torch_args=_v1_args))
register(SelfAttention_v2, Names(from_torch_args=_v2_args))
register(CausalAttention, Names(buffers=_MASK, from_torch_args=_causal_args))
# its heads are CausalAttention: heads.{i}.mask
register(MultiHeadAttentionWrapper, Names(from_torch_args=_wrapper_args))
register(
    MultiHeadAttention,
    Names(
        layouts=("documents", "torch_nn", "gpt2", "fused_qkv"),
        roles={"q": "W_query", "k": "W_key", "v": "W_value", "o": "out_proj"},
        buffers=_MASK,
        from_torch_args=_multihead_args,
        layout_refusal=_grouped_refusal,
    ),
)
register(
    MultiHeadedAttention,
    Names(
        layouts=("documents", "torch_nn", "fused_qkv"),
        roles={role: f"proj_weights.{i}" for i, role in enumerate(ROLE_NAMES)},
        from_torch_args=_multiheaded_args,
    ),
)
