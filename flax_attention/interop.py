"""Live modules in: ``from_torch`` and ``from_nnx`` build the matching Flax layer, weights included.

==================================  ===================================  ========================
peer                                becomes                              you say
==================================  ===================================  ========================
a ``torch_reference`` layer         the same class, same arguments       nothing
``torch.nn.MultiheadAttention``     ``MultiHeadedAttention``             nothing (not causal)
``torch.nn.MultiheadAttention``     ``MultiHeadAttention(E, E, n, ...)``  ``causal=True,
                                                                         context_length=n``
``GPT2Attention`` (transformers)    ``MultiHeadAttention(E, E,           nothing (its config)
                                    n_positions, attn_pdrop, n_head,
                                    qkv_bias=True)``
``flax.nnx.MultiHeadAttention``     ``MultiHeadedAttention``             nothing (not causal)
``flax.nnx.MultiHeadAttention``     ``MultiHeadAttention(in, qkv, n,     ``causal=True,
                                    ...)``                               context_length=n``
==================================  ===================================  ========================

The weights go through ``load_state_dict`` (``layout="documents"``, ``"torch_nn"``, ``"gpt2"``),
so they are checked as any file is. What a peer does that no layer here does (torch's
``add_bias_kv``/``add_zero_attn``/``kdim``/``vdim``, GPT-2's cross attention or unscaled or
layer-scaled scores, nnx's ``normalize_qk``, grouped key/value heads or another
``attention_fn``) is a ``ValueError`` naming the option. The new layer is in ``eval()`` mode when
the peer is (torch ``training``, nnx ``deterministic``).

What a ``torch_reference`` layer becomes is the registry's (``flax_attention.layouts``): the
registered class of the torch class's name, built with the arguments its ``Names.from_torch_args``
reads from the torch module; a class registered without one is refused as any other module is.

This module never imports torch: a torch module is read through its attributes and
``state_dict()`` (``tensor.detach().cpu().numpy()``), so ``import flax_attention`` stays torch-free.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from flax_attention._checks import check_bool
from flax_attention.annotated import MultiHeadedAttention
from flax_attention.layouts import registered
from flax_attention.mesh import fetch
from flax_attention.multihead import MultiHeadAttention
from flax_attention.weights import load_state_dict

__all__ = ["from_torch", "from_nnx"]

#: Flax options every ``from_*`` passes to the new layer's constructor.
_FLAX_OPTIONS = ("rngs", "dtype", "param_dtype", "precision", "implementation")


def _numpy(tensor) -> np.ndarray:
    """A torch tensor as a NumPy array, without importing torch (bfloat16, which NumPy lacks,
    goes through float32 exactly)."""
    tensor = tensor.detach().cpu()
    if str(tensor.dtype) == "torch.bfloat16":
        tensor = tensor.float()
    return tensor.numpy()


def _torch_state(module) -> dict[str, np.ndarray]:
    return {name: _numpy(value) for name, value in module.state_dict().items()}


def _check_options(peer: str, options: dict, allowed: tuple[str, ...]) -> dict:
    unknown = [name for name in options if name not in allowed]
    if unknown:
        raise TypeError(
            f"options ({', '.join(unknown)}) must be among those {peer} does not carry "
            f"({', '.join(allowed)})"
        )
    flax = {name: options[name] for name in _FLAX_OPTIONS if options.get(name) is not None}
    flax.setdefault("rngs", nnx.Rngs(0))
    return flax


def _refuse(option: str, value, rule: str) -> None:
    raise ValueError(f"{option} ({value!r}) must {rule}")


def _causal_options(peer: str, options: dict) -> int | None:
    """``context_length`` when ``causal=True`` is asked for, ``None`` for a non-causal layer."""
    causal = options.pop("causal", False)
    context_length = options.pop("context_length", None)
    check_bool("causal", causal)
    if causal and context_length is None:
        raise ValueError(
            f"context_length (None) must be given with causal=True ({peer} does not carry it)"
        )
    if not causal and context_length is not None:
        raise ValueError(
            f"context_length ({context_length!r}) must be given only with causal=True "
            "(the non-causal layer has no context length)"
        )
    return context_length


def _reference_layer(name: str):
    """The registered class named ``name`` (a ``torch_reference`` class's name) and how its
    arguments are read from the torch module (``Names.from_torch_args``); ``None`` if no
    registered class of that name has one."""
    for cls, names in registered():
        if cls.__name__ == name and names.from_torch_args is not None:
            return cls, names.from_torch_args
    return None


def _mode(layer, training: bool):
    if not training:
        layer.eval()
    return layer


def _from_reference(module, layer_class: type, from_torch_args, options: dict):
    """``layer_class(*from_torch_args(module, state))`` with ``module``'s weights (``state``)."""
    name = type(module).__name__
    flax = _check_options(f"a torch_reference {name}", options, _FLAX_OPTIONS)
    state = _torch_state(module)
    layer = layer_class(*from_torch_args(module, state), **flax)
    load_state_dict(layer, state)
    return _mode(layer, module.training)


def _from_torch_nn(module, options: dict):
    peer = "torch.nn.MultiheadAttention"
    context_length = _causal_options(peer, options)
    flax = _check_options(peer, options, _FLAX_OPTIONS)
    embed_dim = module.embed_dim
    if module.bias_k is not None:
        _refuse(
            "add_bias_kv",
            True,
            "be False (a learned key and value appended to every sequence: no layer here has one)",
        )
    if module.add_zero_attn:
        _refuse(
            "add_zero_attn",
            True,
            "be False (a zero key and value appended to every sequence: no layer here has one)",
        )
    for option in ("kdim", "vdim"):
        if getattr(module, option) != embed_dim:
            _refuse(
                option,
                getattr(module, option),
                f"equal embed_dim ({embed_dim}): "
                "the layers here take keys and values of the query's size",
            )
    bias = module.in_proj_bias is not None
    if context_length is None:
        layer = MultiHeadedAttention(module.num_heads, embed_dim, module.dropout, **flax)
    else:
        layer = MultiHeadAttention(
            embed_dim, embed_dim, context_length, module.dropout, module.num_heads, bias, **flax
        )
    load_state_dict(layer, _torch_state(module), layout="torch_nn")
    return _mode(layer, module.training)


def _from_gpt2(module, options: dict):
    peer = "GPT2Attention"
    flax = _check_options(peer, options, _FLAX_OPTIONS)
    config = module.config
    if getattr(module, "is_cross_attention", False):
        _refuse(
            "is_cross_attention",
            True,
            "be False (GPT-2 cross attention: q_attn and "
            "c_attn of keys and values; no layer here is that)",
        )
    if not config.scale_attn_weights:
        _refuse(
            "config.scale_attn_weights",
            False,
            "be True (the layers here divide the scores by sqrt(head_dim))",
        )
    if config.scale_attn_by_inverse_layer_idx:
        _refuse(
            "config.scale_attn_by_inverse_layer_idx",
            True,
            "be False (the layers here do not scale the scores by 1 / (layer_idx + 1))",
        )
    # reorder_and_upcast_attn computes the same function in float32: accepted.
    layer = MultiHeadAttention(
        module.embed_dim,
        module.embed_dim,
        config.n_positions,
        module.attn_dropout.p,
        module.num_heads,
        True,
        **flax,
    )
    load_state_dict(layer, _torch_state(module), layout="gpt2")
    return _mode(layer, module.training)


def from_torch(module, **options):
    """The Flax layer that computes what the torch ``module`` computes, with its weights.

    ``module``: a ``torch_reference`` layer (becomes the same class with the same arguments), a
    ``torch.nn.MultiheadAttention`` (becomes ``MultiHeadedAttention(num_heads, embed_dim,
    dropout)``, or with ``causal=True, context_length=n`` the causal
    ``MultiHeadAttention(embed_dim, embed_dim, n, dropout, num_heads, qkv_bias=bias)``; the
    layer is batch-first: a ``batch_first=False`` module's ``(t, b, E)`` inputs become
    ``(b, t, E)``), or a Hugging Face ``GPT2Attention`` (becomes ``MultiHeadAttention(n_embd,
    n_embd, n_positions, attn_pdrop, n_head, qkv_bias=True)``; its ``resid_dropout`` after
    ``c_proj`` is the block's, not part of the layer). ``options``: ``causal`` and
    ``context_length`` (``torch.nn.MultiheadAttention`` only), and the Flax options ``rngs``
    (default ``nnx.Rngs(0)``), ``dtype``, ``param_dtype``, ``precision``, ``implementation``.
    """
    name = type(module).__name__
    reference = None
    if type(module).__module__.startswith("torch_reference"):
        reference = _reference_layer(name)  # None: no registered class of that name has one
    if reference is not None:
        return _from_reference(module, *reference, dict(options))
    if name == "MultiheadAttention" and hasattr(module, "embed_dim"):
        return _from_torch_nn(module, dict(options))
    if name == "GPT2Attention" and hasattr(module, "c_attn"):
        return _from_gpt2(module, dict(options))
    raise TypeError(
        f"module ({type(module).__module__}.{name}) must be a torch_reference layer, a "
        "torch.nn.MultiheadAttention or a transformers GPT2Attention"
    )


def from_nnx(module, **options):
    """The layer here that computes what ``flax.nnx.MultiHeadAttention`` ``module`` computes,
    with its weights (kernels ``(in, heads, head_dim)`` and ``(heads, head_dim, out)``
    reshaped to ``(in, heads * head_dim)`` and ``(heads * head_dim, out)``).

    Becomes ``MultiHeadedAttention(num_heads, in_features, dropout_rate)`` (``in_features``,
    ``qkv_features`` and ``out_features`` equal), or with ``causal=True, context_length=n`` the
    causal ``MultiHeadAttention(in_features, qkv_features, n, dropout_rate, num_heads,
    qkv_bias=use_bias)`` (``out_features == qkv_features``). ``dtype``, ``param_dtype`` and
    ``precision`` are the module's; ``options`` also takes ``rngs`` and ``implementation``.
    ``use_bias=False`` gives zero biases where the layer has them. The decode cache is not
    copied; dropout keeps its rate (nnx's ``broadcast_dropout`` draws its mask differently).
    """
    if type(module).__name__ != "MultiHeadAttention" or not hasattr(module, "in_kv_features"):
        raise TypeError(
            f"module ({type(module).__module__}.{type(module).__name__}) must be a "
            "flax.nnx.MultiHeadAttention"
        )
    options = dict(options)
    context_length = _causal_options("flax.nnx.MultiHeadAttention", options)
    flax = _check_options("flax.nnx.MultiHeadAttention", options, ("rngs", "implementation"))
    flax.update(dtype=module.dtype, param_dtype=module.param_dtype, precision=module.precision)
    _check_nnx_module(module, causal=context_length is not None)
    heads, d_in, qkv = module.num_heads, module.in_features, module.qkv_features
    if context_length is None:
        layer = MultiHeadedAttention(heads, d_in, module.dropout_rate, **flax)
        names = [f"proj_weights.{i}" for i in range(4)]
    else:
        layer = MultiHeadAttention(
            d_in, qkv, context_length, module.dropout_rate, heads, module.use_bias, **flax
        )
        names = ["W_query", "W_key", "W_value", "out_proj"]
    load_state_dict(layer, _nnx_state(module, names, always_biased=context_length is None))
    return _mode(layer, not module.deterministic if module.deterministic is not None else True)


def _check_nnx_module(module, causal: bool) -> None:
    """Refuse, naming the option, what ``module`` does that the layer it becomes (causal
    ``MultiHeadAttention``, else ``MultiHeadedAttention``) does not."""
    heads, d_in = module.num_heads, module.in_features
    qkv, out = module.qkv_features, module.out_features
    if module.num_kv_heads != heads:
        _refuse(
            "num_kv_heads",
            module.num_kv_heads,
            f"equal num_heads ({heads}): grouped key/value heads are not a layer here",
        )
    if module.normalize_qk:
        _refuse("normalize_qk", True, "be False (no layer here normalises queries and keys)")
    if module.attention_fn is not nnx.dot_product_attention:
        _refuse("attention_fn", module.attention_fn, "be flax.nnx.dot_product_attention")
    for option in (
        "qkv_dot_general",
        "out_dot_general",
        "qkv_dot_general_cls",
        "out_dot_general_cls",
    ):
        if getattr(module, option, None) is not None:
            _refuse(option, getattr(module, option), "be None (the layers here use jnp.dot)")
    if module.in_kv_features != d_in:
        _refuse(
            "in_kv_features",
            module.in_kv_features,
            f"equal in_features ({d_in}): the layers here take keys and values of the query's size",
        )
    if causal:
        if out != qkv:
            _refuse("out_features", out, f"equal qkv_features ({qkv}) for MultiHeadAttention")
        return
    for option, value in (("qkv_features", qkv), ("out_features", out)):
        if value != d_in:
            _refuse(
                option,
                value,
                f"equal in_features ({d_in}) for MultiHeadedAttention "
                "(or pass causal=True, context_length=n for MultiHeadAttention)",
            )


def _nnx_state(module, names: list[str], always_biased: bool) -> dict[str, np.ndarray]:
    """``module``'s weights as the documents' state dict of the layer whose query, key, value
    and output projections are ``names``: kernels reshaped to ``(in, out)`` and transposed to
    torch's ``(out, in)``, a missing bias as zeros where the layer has one (``always_biased``:
    ``MultiHeadedAttention``; the output projection always)."""
    d_in, qkv, out = module.in_features, module.qkv_features, module.out_features

    def value(variable) -> np.ndarray:  # gathered first if spread over processes
        return fetch([variable[...]])[0]

    state = {}
    for name, linear in zip(names, (module.query, module.key, module.value)):
        state[f"{name}.weight"] = value(linear.kernel).reshape(d_in, qkv).T  # (d_out, d_in)
        if linear.bias is not None:
            state[f"{name}.bias"] = value(linear.bias).reshape(qkv)
        elif always_biased:
            state[f"{name}.bias"] = np.zeros(qkv, np.float32)
    state[f"{names[3]}.weight"] = value(module.out.kernel).reshape(qkv, out).T  # (out, qkv)
    bias = module.out.bias
    state[f"{names[3]}.bias"] = np.zeros(out, np.float32) if bias is None else value(bias)
    return state
