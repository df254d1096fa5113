"""The checks of the arrays a Flax layer or model is called with, in one place.

The messages are those of ``_checks`` (the file both packages share word for word, so
``torch_reference`` and ``flax_attention`` say the same thing for the same mistake); this module
reads the shapes and dtypes of JAX arrays and hands them to those checks. Constructor arguments
are checked with ``_checks`` directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flax_attention._checks import (
    check_at_most,
    check_features,
    check_floating,
    check_mask,
    check_min_rank,
    check_num_tokens,
    check_positive_int,
    check_rank,
    check_same,
)
from flax_attention.mesh import fetch

__all__ = [
    "check_annotated_inputs",
    "check_causal_input",
    "check_input",
    "check_model_inputs",
    "check_projected_inputs",
    "check_token_ids",
    "check_zero_one",
]


def check_array(name, x, min_rank: int, legend: str) -> None:
    """``x`` must be an array (a ``jax.Array``, a NumPy array, anything with a ``shape``) of at
    least ``min_rank`` dimensions (``legend`` spells them): the documents' bare functions."""
    if not hasattr(x, "shape") or isinstance(x, (str, bytes)):
        raise TypeError(f"{name} ({type(x).__name__}) must be an array ({legend})")
    check_min_rank(name, tuple(x.shape), min_rank, legend)


def check_d_key(d_key) -> None:
    """The softmax's scale ``sqrt(d_key)``: a positive int (the keys' features)."""
    check_positive_int("d_key", d_key)


def check_input(name, x, d_in, legend="..., num_tokens, d_in"):
    """``x`` ``(..., num_tokens, d_in)``: at least 2-D, ``d_in`` features, floating dtype."""
    shape = jnp.shape(x)
    check_min_rank(name, shape, 2, legend)
    check_features(name, shape, d_in, "d_in" if legend.endswith("d_in") else "d_model")
    _check_floating(name, x)


def check_causal_input(x, d_in, context_length):
    """A causal layer's ``x``: as ``check_input``, and no more tokens than ``context_length``
    (``None``: no limit, the book's modern layers)."""
    check_input("x", x, d_in)
    if context_length is not None:
        check_num_tokens(x.shape[-2], context_length)


def _check_floating(name, x):
    dtype = jnp.result_type(x)
    check_floating(name, str(dtype), jnp.issubdtype(dtype, jnp.floating))


# The annotated transformer's ``MultiHeadedAttention``: ``(b, seq_len, d_model)`` inputs.


def _check_model_features(*named, d_model):
    for name, x in named:
        shape = jnp.shape(x)
        check_rank(name, shape, (3,), "b, seq_len, d_model")
        check_features(name, shape, d_model, "d_model")
        _check_floating(name, x)


def _check_annotated_mask(mask, expected):
    """``mask`` (or ``None``) against ``expected`` = ``(b, q_len, k_len)``."""
    if mask is not None:
        dtype = jnp.result_type(mask)
        valid = jnp.issubdtype(dtype, jnp.bool_) or (
            jnp.issubdtype(dtype, jnp.number) and not jnp.issubdtype(dtype, jnp.complexfloating)
        )
        check_mask(jnp.shape(mask), expected, valid, str(dtype))


def check_annotated_inputs(query, key, value, mask, d_model):
    """``query``, ``key``, ``value`` ``(b, len, d_model)`` of one batch, keys and values of one
    length, ``mask`` broadcastable to ``(b, q_len, k_len)``."""
    _check_model_features(("query", query), ("key", key), ("value", value), d_model=d_model)
    q_shape, k_shape, v_shape = jnp.shape(query), jnp.shape(key), jnp.shape(value)
    check_same("key.shape[0]", k_shape[0], "query.shape[0]", q_shape[0])
    check_same("value.shape[0]", v_shape[0], "query.shape[0]", q_shape[0])
    check_same("value.shape[1]", v_shape[1], "key.shape[1]", k_shape[1])
    _check_annotated_mask(mask, (q_shape[0], q_shape[1], k_shape[1]))


def check_projected_inputs(query, kv, mask, num_heads, k_dim):
    """A call with projected keys and values ``kv`` (``(b, k_len, h, d)`` each) and ``query``."""
    _check_model_features(("query", query), d_model=num_heads * k_dim)
    expected = (jnp.shape(query)[0], jnp.shape(kv.keys)[1], num_heads, k_dim)
    check_same("kv.keys.shape", tuple(jnp.shape(kv.keys)), "(b, k_len, h, d)", expected)
    check_same("kv.values.shape", tuple(jnp.shape(kv.values)), "kv.keys.shape", expected)
    _check_annotated_mask(mask, (expected[0], jnp.shape(query)[1], expected[1]))


# The models: token ids and 0/1 attention masks.


def check_token_ids(name: str, ids: np.ndarray, vocab_size: int) -> None:
    """``ids`` (concrete) are integers below ``vocab_size``: the lookup fills an id out of range
    with NaN, which reaches every later position through the attention."""
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"{name} (dtype {ids.dtype}) must hold integer token ids")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(
            f"{name} (ids {ids.min()}..{ids.max()}) must lie in 0..{vocab_size - 1} (vocab_size)"
        )


def check_zero_one(mask: np.ndarray) -> None:
    """An ``attention_mask`` (concrete) holds only 0 and 1: a 2 would count as two positions."""
    if not np.all((mask == 0) | (mask == 1)):
        values = sorted({v.item() for v in np.unique(mask)})[:5]
        raise ValueError(f"attention_mask (values {values}) must hold only 0 and 1")


def check_model_inputs(in_idx, attention_mask, vocab_size: int, context_length: int) -> None:
    """A model's door: no more tokens than ``context_length`` (the layers inside take the hidden
    states as they are); outside ``jit`` (concrete arrays) the ids and the mask, traced values
    unchecked.

    An array spread over several JAX processes (a batch from ``global_batch``) is read whole in
    every process (``fetch``: a compiled copy of each, run by every process as each calls the
    model), so each process checks the same values and raises the same error, before any
    collective of the forward pass that the others would wait on."""
    check_at_most("num_tokens", in_idx.shape[-1], "context_length", context_length)
    for name, x in (("in_idx", in_idx), ("attention_mask", attention_mask)):
        if x is None or isinstance(x, jax.core.Tracer):
            continue
        spread = isinstance(x, jax.Array) and not x.is_fully_addressable
        x = fetch([x])[0] if spread else np.asarray(x)
        if name == "in_idx":
            check_token_ids(name, x, vocab_size)
        else:
            check_zero_one(x)
