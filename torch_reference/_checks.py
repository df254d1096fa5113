"""Argument and input checks shared by both packages, word for word.

The documents use ``assert`` (or nothing) where a user can pass bad input; these checks raise the
``ValueError``/``TypeError`` that the project's error rules ask for. ``torch_reference/_checks.py``
and ``flax_attention/_checks.py`` are the same file (a test compares them), so the two packages
give the same message for the same mistake. Plain Python: no framework import.

The rule, for every public function and class: a value of the wrong type raises ``TypeError``
(``bool`` is not an int nor a real number here, though Python counts it as one), a value of the
right type that breaks the rule raises ``ValueError``, and the message reads
``<name> (<actual>) must <rule> (<expected>)``. Check an argument with the generic helpers
(``check_int``, ``check_real``, ``check_rate``, ``check_choice``, ``check_bool``,
``check_instance``, ``check_callable``, ``check_at_most``) rather than a message of one's own;
``conformance_tests/tests/test_argument_rule.py`` holds each public name to the rule.
"""

import math
import numbers

__all__ = [
    "check_at_most",
    "check_bool",
    "check_callable",
    "check_choice",
    "check_dropout",
    "check_instance",
    "check_int",
    "check_positive_int",
    "check_rate",
    "check_real",
    "check_splits_over_heads",
    "check_features",
    "check_floating",
    "check_num_tokens",
    "check_mask",
    "check_min_rank",
    "check_rank",
    "check_same",
]


def _why(why):
    return f" ({why})" if why else ""


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_positive_int(name, value):
    """``value`` must be a positive ``int`` (``bool`` is rejected)."""
    if not _is_int(value):
        raise TypeError(f"{name} ({value!r}) must be an int (a positive integer)")
    if value <= 0:
        raise ValueError(f"{name} ({value}) must be positive (an integer >= 1)")


def check_int(name, value, minimum=None, *, optional="", why=""):
    """``value`` must be an ``int`` (``bool`` is rejected), ``>= minimum`` when one is given.

    ``optional`` allows ``None`` and says what it means; ``why`` explains the bound.
    """
    if optional and value is None:
        return
    if not _is_int(value):
        expected = [] if minimum is None else [f"an integer >= {minimum}"]
        expected += [why] if why else []
        expected += [f"or None: {optional}"] if optional else []
        raise TypeError(f"{name} ({value!r}) must be an int{_why('; '.join(expected))}")
    if minimum is not None and value < minimum:
        hint = why or (f"None: {optional}" if optional else "")
        raise ValueError(f"{name} ({value}) must be >= {minimum}{_why(hint)}")


def check_real(name, value, minimum=None, *, finite=False, why=""):
    """``value`` must be a real number (``bool`` is rejected), finite when ``finite``, and
    ``>= minimum`` (NaN is not) when one is given."""
    if not _is_real(value):
        default = "an int or a float" if minimum is None else f"a number >= {minimum}"
        raise TypeError(f"{name} ({value!r}) must be a real number ({why or default})")
    if finite and not math.isfinite(value):
        raise ValueError(f"{name} ({value}) must be finite{_why(why)}")
    if minimum is not None and not value >= minimum:
        raise ValueError(f"{name} ({value}) must be >= {minimum}{_why(why)}")


def check_rate(name, value, why):
    """A rate (a probability) must be a real number in ``[0, 1)``; ``why`` says what it rates."""
    if not _is_real(value):
        raise TypeError(f"{name} ({value!r}) must be a float (a rate in [0, 1))")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} ({value}) must be in [0, 1) ({why})")


def check_dropout(value):
    """The dropout rate must be a real number in ``[0, 1)``."""
    check_rate("dropout", value, "the probability of zeroing")


def check_choice(name, value, options, why=""):
    """``value`` must be one of ``options`` (a tuple): ``TypeError`` when it is of none of their
    types, ``ValueError`` when it is of their type but not among them."""
    kinds = {type(option) for option in options}
    if type(None) in kinds and value is None:
        return
    names = sorted(kind.__name__ for kind in kinds if kind is not type(None))
    if type(None) in kinds:
        names.append("None")
    typed = isinstance(value, tuple(kinds)) and (bool in kinds or not isinstance(value, bool))
    if not typed:
        raise TypeError(f"{name} ({value!r}) must be one of {options} (a {' or '.join(names)})")
    if value not in options:
        raise ValueError(f"{name} ({value!r}) must be one of {options}{_why(why)}")


def check_bool(name, value, why=""):
    """``value`` must be ``True`` or ``False`` (not 0/1, not None)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} ({value!r}) must be a bool (True or False){_why(why)}")


def check_instance(name, value, types, expected):
    """``value`` must be an instance of ``types``; ``expected`` spells it for the user."""
    if not isinstance(value, types):
        raise TypeError(f"{name} ({type(value).__name__}) must be {expected}")


def check_callable(name, value, expected):
    """``value`` must be callable; ``expected`` says what it is called with."""
    if not callable(value):
        raise TypeError(f"{name} ({type(value).__name__}) must be callable ({expected})")


def check_at_most(name, value, limit_name, limit):
    """``value`` must not exceed ``limit`` (named ``limit_name``)."""
    if value > limit:
        raise ValueError(f"{name} ({value}) must not exceed {limit_name} ({limit})")


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
    check_at_most("num_tokens", num_tokens, "context_length", context_length)


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
