"""Argument and input checks shared by both packages, word for word.

The documents use ``assert`` (or nothing) where a user can pass bad input; these checks raise the
``ValueError``/``TypeError`` that the project's error rules ask for. ``torch_reference/_checks.py``
and ``flax_attention/_checks.py`` are the same file (a test compares them), so the two packages
give the same message for the same mistake. Plain Python: no framework import.
"""

import numbers

__all__ = [
    "check_dropout",
    "check_positive_int",
    "check_splits_over_heads",
    "check_features",
    "check_floating",
    "check_num_tokens",
    "check_mask",
    "check_min_rank",
    "check_rank",
    "check_same",
]


def check_positive_int(name, value):
    """``value`` must be a positive ``int`` (``bool`` is rejected)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} ({value!r}) must be an int (a positive integer)")
    if value <= 0:
        raise ValueError(f"{name} ({value}) must be positive (an integer >= 1)")


def check_dropout(value):
    """The dropout rate must be a real number in ``[0, 1)``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"dropout ({value!r}) must be a float (a rate in [0, 1))")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"dropout ({value}) must be in [0, 1) (the probability of zeroing)")


def check_splits_over_heads(name, value, num_heads):
    """``value`` (``d_out`` or ``d_model``) must split evenly over ``num_heads``."""
    if value % num_heads != 0:
        raise ValueError(f"{name} ({value}) must be divisible by num_heads ({num_heads})")


def check_rank(name, shape, ranks, legend):
    """``len(shape)`` must be one of ``ranks``; ``legend`` spells the expected axes."""
    if len(shape) not in ranks:
        expected = " or ".join(str(r) for r in ranks)
        raise ValueError(
            f"{name}.ndim ({len(shape)}, shape {tuple(shape)}) must be {expected} ({legend})"
        )


def check_min_rank(name, shape, min_rank, legend):
    """``len(shape)`` must be at least ``min_rank`` (leading axes are batch axes)."""
    if len(shape) < min_rank:
        raise ValueError(
            f"{name}.ndim ({len(shape)}, shape {tuple(shape)}) must be at least {min_rank} "
            f"({legend})"
        )


def check_features(name, shape, expected, expected_name):
    """The last axis of ``shape`` must equal ``expected``."""
    if shape[-1] != expected:
        raise ValueError(
            f"{name}.shape[-1] ({shape[-1]}, shape {tuple(shape)}) must equal "
            f"{expected_name} ({expected})"
        )


def check_num_tokens(num_tokens, context_length):
    """The causal mask buffer covers ``context_length`` tokens and no more."""
    if num_tokens > context_length:
        raise ValueError(
            f"num_tokens ({num_tokens}) must not exceed context_length ({context_length})"
        )


def check_floating(name, dtype_name, is_floating):
    """Inputs must be floating point (integer and boolean inputs are rejected)."""
    if not is_floating:
        raise TypeError(f"{name}.dtype ({dtype_name}) must be a floating dtype (float16/32/64)")


def check_same(name, value, other_name, other):
    """Two sizes that must agree (batch sizes, key and value lengths)."""
    if value != other:
        raise ValueError(f"{name} ({value}) must equal {other_name} ({other})")


def check_mask(shape, expected, is_valid_dtype, dtype_name):
    """An annotated-transformer mask: 3-D, broadcastable to ``expected`` = (b, q_len, k_len)."""
    if not is_valid_dtype:
        raise TypeError(f"mask.dtype ({dtype_name}) must be bool or a real number dtype")
    ok = len(shape) == 3 and all(m in (1, e) for m, e in zip(shape, expected))
    if not ok:
        raise ValueError(
            f"mask.shape ({tuple(shape)}) must broadcast to (b, q_len, k_len) ({tuple(expected)})"
        )
