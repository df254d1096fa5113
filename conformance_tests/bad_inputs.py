"""Bad arguments and inputs, as data beside the spec: one table, ``BAD_INPUTS``.

Each row says what to run in ``torch_reference`` and in ``flax_attention`` (``None`` where a
package has no such feature, e.g. the Flax-only decode cache) and the error it must raise: the
same exception with the same message in both packages, which names the argument, the value and
what was expected. ``tests/test_bad_inputs.py`` runs every row; ``docs/errors.md`` lists every
message form, and a test keeps the two in step (``messages()`` is what the rows raise).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import flax_attention as fa
import torch_reference as tr

__all__ = ["BAD_INPUTS", "BadInput", "call", "construct", "messages", "raised"]


@dataclasses.dataclass(frozen=True)
class BadInput:
    """One row of the matrix: what to run in each package and the error it must raise.

    ``torch`` and ``flax`` are zero-argument callables (``None`` where a package has no such
    feature, e.g. a Flax-only decode cache); ``construct`` and ``call`` below make both from one
    description. ``match`` is a regex searched in the message; it names the argument, the value
    and what was expected. Both messages must be identical unless ``same_message=False`` (the
    Flax layers take leading batch axes, so their rank message says "at least").
    """

    id: str
    torch: Callable[[], object] | None
    flax: Callable[[], object] | None
    error: type[Exception]
    match: str
    same_message: bool = True


def construct(layer: str, *args) -> tuple[Callable[[], object], Callable[[], object]]:
    """``(torch, flax)``: build ``layer(*args)`` in each package (Flax adds ``rngs``)."""
    return (
        lambda: getattr(tr, layer)(*args),
        lambda: getattr(fa, layer)(*args, rngs=nnx.Rngs(0)),
    )


def _array(x) -> np.ndarray:
    """A shape means float32 zeros; an array is used as given."""
    return np.zeros(x, np.float32) if isinstance(x, tuple) else np.asarray(x)


def call(layer: str, args: tuple, *inputs, mask=None) -> tuple[Callable, Callable]:
    """``(torch, flax)``: build a valid ``layer(*args)`` and call it on ``inputs`` (and ``mask``,
    for ``MultiHeadedAttention``); each input is a shape (float32 zeros) or a NumPy array."""
    arrays = [_array(x) for x in inputs] + ([] if mask is None else [_array(mask)])

    def torch_side():
        return getattr(tr, layer)(*args)(*(torch.from_numpy(a) for a in arrays))

    def flax_side():
        return getattr(fa, layer)(*args, rngs=nnx.Rngs(0))(*(jnp.asarray(a) for a in arrays))

    return torch_side, flax_side


_MHA = (3, 4, 6, 0.0, 2)  # MultiHeadAttention(d_in=3, d_out=4, context_length=6, dropout, heads=2)
_CAUSAL = (3, 2, 6, 0.0)  # CausalAttention(d_in=3, d_out=2, context_length=6, dropout)
_ANNOTATED = (2, 4, 0.0)  # MultiHeadedAttention(num_heads=2, d_model=4, dropout)
_Q, _KV = (
    (2, 3, 4),
    (2, 5, 4),
)  # the annotated-transformer post's query (b, q_len, d_model), key/value (b, k_len, ...)

BAD_INPUTS: list[BadInput] = [
    # ---- constructor arguments ----
    BadInput(
        "mha_d_out_not_divisible_by_heads",
        *construct("MultiHeadAttention", 4, 10, 6, 0.0, 3),
        ValueError,
        r"^d_out \(10\) must be divisible by num_heads \(3\)$",
    ),
    BadInput(
        "annotated_d_model_not_divisible_by_heads",
        *construct("MultiHeadedAttention", 3, 10),
        ValueError,
        r"^d_model \(10\) must be divisible by num_heads \(3\)$",
    ),
    BadInput(
        "mha_num_heads_zero",
        *construct("MultiHeadAttention", 4, 4, 6, 0.0, 0),
        ValueError,
        r"^num_heads \(0\) must be positive \(an integer >= 1\)$",
    ),
    BadInput(
        "wrapper_num_heads_negative",
        *construct("MultiHeadAttentionWrapper", 3, 2, 6, 0.0, -1),
        ValueError,
        r"^num_heads \(-1\) must be positive",
    ),
    BadInput(
        "annotated_num_heads_bool",
        *construct("MultiHeadedAttention", True, 4),
        TypeError,
        r"^num_heads \(True\) must be an int \(a positive integer\)$",
    ),
    BadInput(
        "v1_d_in_zero",
        *construct("SelfAttention_v1", 0, 2),
        ValueError,
        r"^d_in \(0\) must be positive \(an integer >= 1\)$",
    ),
    BadInput(
        "v2_d_in_float",
        *construct("SelfAttention_v2", 3.0, 2),
        TypeError,
        r"^d_in \(3\.0\) must be an int \(a positive integer\)$",
    ),
    BadInput(
        "causal_d_out_negative",
        *construct("CausalAttention", 3, -2, 6, 0.0),
        ValueError,
        r"^d_out \(-2\) must be positive",
    ),
    BadInput(
        "annotated_d_model_zero",
        *construct("MultiHeadedAttention", 1, 0),
        ValueError,
        r"^d_model \(0\) must be positive",
    ),
    BadInput(
        "causal_context_length_zero",
        *construct("CausalAttention", 3, 2, 0, 0.0),
        ValueError,
        r"^context_length \(0\) must be positive",
    ),
    BadInput(
        "mha_context_length_negative",
        *construct("MultiHeadAttention", 3, 4, -6, 0.0, 2),
        ValueError,
        r"^context_length \(-6\) must be positive",
    ),
    BadInput(
        "causal_dropout_one",
        *construct("CausalAttention", 3, 2, 6, 1.0),
        ValueError,
        r"^dropout \(1\.0\) must be in \[0, 1\) \(the probability of zeroing\)$",
    ),
    BadInput(
        "mha_dropout_negative",
        *construct("MultiHeadAttention", 3, 4, 6, -0.1, 2),
        ValueError,
        r"^dropout \(-0\.1\) must be in \[0, 1\)",
    ),
    BadInput(
        "annotated_dropout_nan",
        *construct("MultiHeadedAttention", 2, 4, float("nan")),
        ValueError,
        r"^dropout \(nan\) must be in \[0, 1\)",
    ),
    BadInput(
        "wrapper_dropout_str",
        *construct("MultiHeadAttentionWrapper", 3, 2, 6, "0.1", 2),
        TypeError,
        r"^dropout \('0\.1'\) must be a float \(a rate in \[0, 1\)\)$",
    ),
    # ---- num_tokens > context_length ----
    BadInput(
        "causal_num_tokens_past_context",
        *call("CausalAttention", _CAUSAL, (1, 7, 3)),
        ValueError,
        r"^num_tokens \(7\) must not exceed context_length \(6\)$",
    ),
    BadInput(
        "wrapper_num_tokens_past_context",
        *call("MultiHeadAttentionWrapper", (*_CAUSAL, 2), (2, 9, 3)),
        ValueError,
        r"^num_tokens \(9\) must not exceed context_length \(6\)$",
    ),
    BadInput(
        "mha_num_tokens_past_context",
        *call("MultiHeadAttention", _MHA, (1, 7, 3)),
        ValueError,
        r"^num_tokens \(7\) must not exceed context_length \(6\)$",
    ),
    # ---- wrong rank ----
    BadInput(
        "causal_rank_1",
        *call("CausalAttention", _CAUSAL, (3,)),
        ValueError,
        r"^x\.ndim \(1, shape \(3,\)\) must be (3 \(b|at least 2 \(\.\.\.), num_tokens, d_in\)$",
        same_message=False,
    ),
    BadInput(
        "v1_rank_1",
        *call("SelfAttention_v1", (3, 2), (3,)),
        ValueError,
        r"^x\.ndim \(1, shape \(3,\)\) must be (2|at least 2) \((\.\.\., )?num_tokens, d_in\)$",
        same_message=False,
    ),
    BadInput(
        "annotated_query_rank_2",
        *call("MultiHeadedAttention", _ANNOTATED, (3, 4), _KV, _KV),
        ValueError,
        r"^query\.ndim \(2, shape \(3, 4\)\) must be 3 \(b, seq_len, d_model\)$",
    ),
    # ---- wrong feature size ----
    BadInput(
        "mha_features",
        *call("MultiHeadAttention", _MHA, (1, 5, 4)),
        ValueError,
        r"^x\.shape\[-1\] \(4, shape \(1, 5, 4\)\) must equal d_in \(3\)$",
    ),
    BadInput(
        "v2_features",
        *call("SelfAttention_v2", (3, 2), (6, 2)),
        ValueError,
        r"^x\.shape\[-1\] \(2, shape \(6, 2\)\) must equal d_in \(3\)$",
    ),
    BadInput(
        "annotated_key_features",
        *call("MultiHeadedAttention", _ANNOTATED, _Q, (2, 5, 6), _KV),
        ValueError,
        r"^key\.shape\[-1\] \(6, shape \(2, 5, 6\)\) must equal d_model \(4\)$",
    ),
    # ---- integer and boolean inputs ----
    BadInput(
        "causal_int_input",
        *call("CausalAttention", _CAUSAL, np.zeros((1, 4, 3), np.int32)),
        TypeError,
        r"^x\.dtype \(int32\) must be a floating dtype",
    ),
    BadInput(
        "v1_bool_input",
        *call("SelfAttention_v1", (3, 2), np.zeros((4, 3), bool)),
        TypeError,
        r"^x\.dtype \(bool\) must be a floating dtype",
    ),
    BadInput(
        "annotated_int_value",
        *call("MultiHeadedAttention", _ANNOTATED, _Q, _KV, np.zeros(_KV, np.int32)),
        TypeError,
        r"^value\.dtype \(int32\) must be a floating dtype",
    ),
    # ---- masks (the annotated-transformer post) ----
    BadInput(
        "mask_2d",
        *call("MultiHeadedAttention", _ANNOTATED, _Q, _KV, _KV, mask=(3, 5)),
        ValueError,
        r"^mask\.shape \(\(3, 5\)\) must broadcast to \(b, q_len, k_len\) \(\(2, 3, 5\)\)$",
    ),
    BadInput(
        "mask_4d",
        *call("MultiHeadedAttention", _ANNOTATED, _Q, _KV, _KV, mask=(2, 1, 3, 5)),
        ValueError,
        r"^mask\.shape \(\(2, 1, 3, 5\)\) must broadcast to \(b, q_len, k_len\)",
    ),
    BadInput(
        "mask_wrong_k_len",
        *call("MultiHeadedAttention", _ANNOTATED, _Q, _KV, _KV, mask=(2, 3, 4)),
        ValueError,
        r"^mask\.shape \(\(2, 3, 4\)\) must broadcast to \(b, q_len, k_len\) \(\(2, 3, 5\)\)$",
    ),
    BadInput(
        "mask_wrong_batch",
        *call("MultiHeadedAttention", _ANNOTATED, _Q, _KV, _KV, mask=(3, 1, 5)),
        ValueError,
        r"^mask\.shape \(\(3, 1, 5\)\) must broadcast to \(b, q_len, k_len\) \(\(2, 3, 5\)\)$",
    ),
    BadInput(
        "mask_complex",
        *call(
            "MultiHeadedAttention", _ANNOTATED, _Q, _KV, _KV, mask=np.ones((2, 3, 5), np.complex64)
        ),
        TypeError,
        r"^mask\.dtype \(complex64\) must be bool or a real number dtype$",
    ),
    # ---- query/key/value that do not fit together (the annotated-transformer post) ----
    BadInput(
        "key_batch_mismatch",
        *call("MultiHeadedAttention", _ANNOTATED, _Q, (1, 5, 4), (1, 5, 4)),
        ValueError,
        r"^key\.shape\[0\] \(1\) must equal query\.shape\[0\] \(2\)$",
    ),
    BadInput(
        "value_batch_mismatch",
        *call("MultiHeadedAttention", _ANNOTATED, _Q, _KV, (3, 5, 4)),
        ValueError,
        r"^value\.shape\[0\] \(3\) must equal query\.shape\[0\] \(2\)$",
    ),
    BadInput(
        "value_length_mismatch",
        *call("MultiHeadedAttention", _ANNOTATED, _Q, _KV, (2, 6, 4)),
        ValueError,
        r"^value\.shape\[1\] \(6\) must equal key\.shape\[1\] \(5\)$",
    ),
    # ---- Flax only: the attention core's implementations and the decode cache ----
    BadInput(
        "unknown_implementation",
        None,
        lambda: fa.MultiHeadAttention(*_MHA, implementation="flash", rngs=nnx.Rngs(0)),
        ValueError,
        r"^implementation \('flash'\) must be one of \(None, 'reference', 'xla', 'cudnn', "
        r"'blocked', 'native'\)$",
    ),
    BadInput(
        "decode_without_init_cache",
        None,
        lambda: _decoder(None)(np.zeros((1, 1, 3), np.float32), decode=True),
        ValueError,
        r"^decode \(True\) needs a decode cache \(call init_cache\(batch_size\) first\)$",
    ),
    BadInput(
        "decode_past_the_cache",
        None,
        lambda: _decoder(4, filled=3)(np.zeros((1, 2, 3), np.float32), decode=True),
        ValueError,
        r"^cache_index \+ num_tokens \(3 \+ 2\) must not exceed the cache's max_length \(4\) "
        r"\(init_cache\(\.\.\., max_length\) or a new cache\)$",
    ),
    BadInput(
        "decode_longer_than_the_cache",
        None,
        lambda: _decoder(4)(np.zeros((1, 5, 3), np.float32), decode=True),
        ValueError,
        r"^num_tokens \(5\) must not exceed the cache's max_length \(4\)$",
    ),
    BadInput(
        "cache_longer_than_context",
        None,
        lambda: _decoder(7),
        ValueError,
        r"^max_length \(7\) must not exceed context_length \(6\)$",
    ),
    BadInput(
        "shard_heads_do_not_divide",
        None,
        lambda: fa.shard(fa.MultiHeadAttention(3, 6, 6, 0.0, 6, rngs=nnx.Rngs(0)), _mesh(1, 4)),
        ValueError,
        r"^num_heads \(6\) must be divisible by the mesh's model axis \(4\)$",
    ),
]


def _mesh(data, model):
    """A ``(data, model)`` mesh of this process's one device, repeated: ``shard`` checks the
    axis sizes before it places anything, so the check runs without 8 devices."""
    devices = np.array([jax.devices()[0]] * (data * model)).reshape(data, model)
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.sharding.Mesh(devices, ("data", "model"), axis_types=auto)


def _decoder(max_length, filled=0):
    """A Flax ``MultiHeadAttention`` (``_MHA``) with a cache of ``max_length`` (``None``: none)
    that already holds ``filled`` tokens."""
    layer = fa.MultiHeadAttention(*_MHA, rngs=nnx.Rngs(0))
    if max_length is not None:
        layer.init_cache(1, max_length)
    if filled:
        layer(np.zeros((1, filled, 3), np.float32), decode=True)
    return layer


def raised(row: BadInput, package: str) -> Exception | None:
    """The exception ``row`` raises in ``package`` (``"torch_reference"`` or
    ``"flax_attention"``), or ``None`` if it raises nothing."""
    run = row.torch if package == "torch_reference" else row.flax
    try:
        run()
    except Exception as error:  # noqa: BLE001 - the row says which one it must be
        return error
    return None


def messages() -> list[tuple[str, str]]:
    """``(where, message)`` of every row in every package that has it."""
    found = []
    for row in BAD_INPUTS:
        for package, run in (("torch_reference", row.torch), ("flax_attention", row.flax)):
            if run is not None:
                found.append((f"{row.id} ({package})", str(raised(row, package))))
    return found
