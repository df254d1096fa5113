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
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

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


def load_state_dict(module: nnx.Module, state_dict, strict: bool = True) -> IncompatibleKeys:
    """Load torch names and layouts (numpy, jax or CPU torch arrays) into ``module``.

    Every value is checked before anything is written: with ``strict=True`` any missing,
    unexpected, mis-shaped, non-numeric or non-finite key (and a ``mask`` buffer that differs from
    the one ``context_length`` implies) raises one ``ValueError`` naming every offending key, and
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
        if value.dtype.kind not in "fiu":
            mismatched.append(name)
            problems.append(f"{name}: dtype {value.dtype} must be a real number dtype")
        elif value.shape != expected_shape:
            mismatched.append(name)
            problems.append(f"{name}: shape {value.shape} must be {expected_shape}")
        elif not np.all(np.isfinite(value)):
            mismatched.append(name)
            problems.append(f"{name}: holds NaN or inf ({_describe(value)})")
        elif entry.variable is None:
            if not np.array_equal(value, entry.expected):
                mismatched.append(name)
                problems.append(
                    f"{name}: differs from triu(ones({expected_shape[0]}, "
                    f"{expected_shape[1]}), diagonal=1), the causal mask of context_length"
                )
        else:
            value = value.T if entry.transpose else value
            updates.append((entry.variable, value.astype(entry.variable.dtype)))
    if strict and (missing or unexpected or mismatched):
        lines = [f"missing key {name}" for name in missing]
        lines += [f"unexpected key {name}" for name in unexpected]
        lines += problems
        raise ValueError(
            f"load_state_dict into {type(module).__name__} (strict=True) found "
            f"{len(lines)} problem(s); nothing was loaded:\n  " + "\n  ".join(lines)
        )
    for variable, value in updates:
        sharding = getattr(variable.get_value(), "sharding", None)
        if isinstance(sharding, NamedSharding):  # a sharded module stays where shard() put it
            value = jax.device_put(value, sharding)
        variable[...] = value
    return IncompatibleKeys(missing, unexpected, mismatched)


def save_file(module: nnx.Module, path: str | os.PathLike) -> None:
    """Write ``state_dict(module)`` to a safetensors file that torch loads as its ``state_dict``."""
    from safetensors.numpy import save_file as _save

    _save(state_dict(module), os.fspath(path))


def load_file(module: nnx.Module, path: str | os.PathLike, strict: bool = True):
    """Read a safetensors file of torch names and layouts into ``module`` (see
    ``load_state_dict``). A file that cannot be read raises ``ValueError`` naming it, and the
    module is untouched."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file as _load

    try:
        tensors = _load(os.fspath(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(
            f"path ({os.fspath(path)!r}) must be a readable safetensors file: {error}"
        ) from error
    return load_state_dict(module, tensors, strict=strict)
