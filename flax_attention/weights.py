"""Weights across frameworks: torch names and layouts in and out, as plain arrays or safetensors.

The torch ``state_dict`` of a layer and its Flax parameters correspond one to one:

==========================  ==================================  ==========================
torch key                   Flax variable                       layout
==========================  ==================================  ==========================
``W_query.weight``          ``W_query.kernel``                  ``(d_out, d_in)`` = kernel.T
``W_query.bias``            ``W_query.bias``                    ``(d_out,)``, unchanged
``W_query`` (v1)            ``W_query``                         ``(d_in, d_out)``, unchanged
``mask`` (buffer)           derived from ``context_length``     ``triu(ones, diagonal=1)``
``heads.{i}.…``             ``heads[i].…``                      wrapper heads
``proj_weights.{i}.…``      ``proj_weights[i].…``               document 001 projections
==========================  ==================================  ==========================

Every torch ``nn.Linear`` weight is the transpose of the Flax kernel; everything else keeps its
layout. Buffers are not Flax state: ``mask`` is checked on load and produced on export.
Loading into a module placed by ``flax_attention.shard`` keeps every parameter's sharding.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["IncompatibleKeys", "load_state_dict", "state_dict", "save_file", "load_file"]


class IncompatibleKeys(NamedTuple):
    """What a ``strict=False`` load skipped (all empty after a clean load)."""

    missing_keys: list[str]
    unexpected_keys: list[str]
    mismatched_keys: list[str]


class _Entry(NamedTuple):
    variable: nnx.Variable | None  # None for a buffer
    transpose: bool
    expected: np.ndarray | None  # the buffer's value; None for a parameter


def _torch_entries(module: nnx.Module) -> dict[str, _Entry]:
    """Torch key -> where its value lives in ``module``, in graph order."""
    entries: dict[str, _Entry] = {}
    for path, node in nnx.iter_graph(module):
        name = ".".join(str(part) for part in path)
        if isinstance(node, nnx.Param):
            if path[-1] == "kernel":
                entries[name.removesuffix("kernel") + "weight"] = _Entry(node, True, None)
            else:
                entries[name] = _Entry(node, False, None)
        elif isinstance(node, nnx.Module) and isinstance(
            getattr(type(node), "mask", None), property
        ):
            entries[f"{name}.mask" if name else "mask"] = _Entry(None, False, node.mask)
    return entries


def _torch_shape(entry: _Entry) -> tuple[int, ...]:
    if entry.variable is None:
        return entry.expected.shape
    shape = tuple(entry.variable.shape)
    return shape[::-1] if entry.transpose else shape


def state_dict(module: nnx.Module) -> dict[str, np.ndarray]:
    """The torch ``state_dict`` of ``module``: torch names and layouts, buffers included.

    ``torch_module.load_state_dict({k: torch.from_numpy(v) ...}, strict=True)`` accepts it.
    """
    out = {}
    for name, entry in _torch_entries(module).items():
        if entry.variable is None:
            value = entry.expected
        else:
            value = np.asarray(entry.variable[...])
            value = value.T if entry.transpose else value
        out[name] = np.array(value, order="C")  # a writable copy, torch.from_numpy-safe
    return out


def _describe(value) -> str:
    return f"shape {tuple(value.shape)} dtype {value.dtype}"


def _is_floating(dtype) -> bool:
    """float16, bfloat16 (an ``ml_dtypes`` type NumPy calls kind ``'V'``), float32, float64."""
    return jnp.issubdtype(dtype, jnp.floating)


def _check_value(name, entry: _Entry, value: np.ndarray, expected_shape) -> str | None:
    """What is wrong with ``value`` for ``entry`` (one line naming the key), or ``None``."""
    if entry.variable is None:  # the mask buffer: compared by value, so bool and ints will do
        if not (_is_floating(value.dtype) or value.dtype.kind in "biu"):
            return f"{name}: dtype {value.dtype} must be a real number or bool dtype"
    elif not _is_floating(value.dtype):
        return (
            f"{name}: dtype {value.dtype} must be a floating dtype "
            f"(float16, bfloat16, float32 or float64)"
        )
    if value.shape != expected_shape:
        return f"{name}: shape {value.shape} must be {expected_shape}"
    if not np.all(np.isfinite(value.astype(np.float32) if value.dtype.kind in "biu" else value)):
        return f"{name}: holds NaN or inf ({_describe(value)})"
    if entry.variable is None and not np.array_equal(value, entry.expected):
        return (
            f"{name}: differs from triu(ones({expected_shape[0]}, {expected_shape[1]}), "
            f"diagonal=1), the causal mask of context_length"
        )
    return None


def _cast(name, value: np.ndarray, variable: nnx.Variable) -> tuple[np.ndarray, str | None]:
    """``value`` in the variable's dtype, or a problem if it overflows there (float64 -> float32,
    float32 -> float16: a finite value must stay finite)."""
    with np.errstate(over="ignore"):
        cast = value.astype(variable.dtype)
    if np.all(np.isfinite(cast)):
        return cast, None
    largest = float(np.max(np.abs(value.astype(np.float64))))
    limit = float(jnp.finfo(cast.dtype).max)
    return cast, f"{name}: overflows {cast.dtype} (largest magnitude {largest:.3g} > {limit:.6g})"


def _assign(variable: nnx.Variable, value: np.ndarray) -> None:
    """Replace the variable's value whole, on its current sharding. (``variable[...] = value``
    compiles an XLA scatter per shape and fails on an abstract module made by ``nnx.eval_shape``,
    the usual skeleton to load a checkpoint into.)"""
    current = variable.get_value()
    if isinstance(current, jax.Array):
        variable.set_value(jax.device_put(value, current.sharding))
    else:  # abstract (jax.ShapeDtypeStruct)
        variable.set_value(jax.device_put(value))


def load_state_dict(module: nnx.Module, state_dict, strict: bool = True) -> IncompatibleKeys:
    """Load torch names and layouts (numpy, jax or CPU torch arrays) into ``module``.

    Every value is checked before anything is written: with ``strict=True`` any missing,
    unexpected, mis-shaped, non-floating (integer, bool, ...) or non-finite key, a value that
    overflows the parameter's dtype, and a ``mask`` buffer that differs from the one
    ``context_length`` implies, raises one ``ValueError`` naming every offending key, and
    ``module`` is left exactly as it was. With ``strict=False`` the good keys are loaded and the
    rest are returned in an ``IncompatibleKeys``.
    """
    if not hasattr(state_dict, "keys"):
        raise TypeError(
            f"state_dict ({type(state_dict).__name__}) must be a mapping (str -> array)"
        )
    entries = _torch_entries(module)
    missing = [name for name in entries if name not in state_dict]
    unexpected = [name for name in state_dict if name not in entries]
    mismatched: list[str] = []
    problems: list[str] = []
    updates: list[tuple[nnx.Variable, np.ndarray]] = []
    for name, entry in entries.items():
        if name not in state_dict:
            continue
        try:
            value = np.asarray(state_dict[name])
        except Exception as error:  # noqa: BLE001 - any array-like failure names the key
            mismatched.append(name)
            problems.append(f"{name}: cannot be read as an array ({error})")
            continue
        expected_shape = _torch_shape(entry)
        problem = _check_value(name, entry, value, expected_shape)
        if problem is None and entry.variable is not None:
            value, problem = _cast(name, value.T if entry.transpose else value, entry.variable)
            if problem is None:
                updates.append((entry.variable, value))
        if problem is not None:
            mismatched.append(name)
            problems.append(problem)
    if strict and (missing or unexpected or mismatched):
        lines = [f"missing key {name}" for name in missing]
        lines += [f"unexpected key {name}" for name in unexpected]
        lines += problems
        raise ValueError(
            f"load_state_dict into {type(module).__name__} (strict=True) found "
            f"{len(lines)} problem(s); nothing was loaded:\n  " + "\n  ".join(lines)
        )
    for variable, value in updates:
        _assign(variable, value)
    return IncompatibleKeys(missing, unexpected, mismatched)


def save_file(module: nnx.Module, path: str | os.PathLike) -> None:
    """Write ``state_dict(module)`` to a safetensors file that torch loads as its ``state_dict``."""
    from safetensors.numpy import save_file as _save

    _save(state_dict(module), os.fspath(path))


class _Unreadable:
    """A tensor the file holds but NumPy cannot represent (float8, say): ``np.asarray`` raises,
    so ``load_state_dict`` names the key (strict) or lists it as mismatched (``strict=False``)."""

    def __init__(self, reason: str):
        self.reason = reason

    def __array__(self, dtype=None, copy=None):
        raise TypeError(self.reason)


def load_file(module: nnx.Module, path: str | os.PathLike, strict: bool = True):
    """Read a safetensors file of torch names and layouts into ``module`` (see
    ``load_state_dict``). Only safetensors is read (nothing is unpickled). A file that cannot be
    read (missing, truncated, a header that is not JSON or claims more data than the file holds)
    and a strict load that finds bad keys raise ``ValueError`` naming the file (and the keys);
    ``module`` is then untouched."""
    from safetensors import SafetensorError, safe_open

    name = os.fspath(path)
    try:
        tensors = {}
        with safe_open(name, framework="numpy") as file:
            for key in file.keys():  # noqa: SIM118 - a safe_open handle is not a mapping
                try:
                    tensors[key] = file.get_tensor(key)
                except (AttributeError, TypeError, ValueError) as error:  # a dtype NumPy lacks
                    dtype = file.get_slice(key).get_dtype()
                    tensors[key] = _Unreadable(f"safetensors dtype {dtype}: {error}")
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"path ({name!r}) must be a readable safetensors file: {error}") from error
    try:
        return load_state_dict(module, tensors, strict=strict)
    except ValueError as error:
        raise ValueError(f"load_file({name!r}): {error}") from error
