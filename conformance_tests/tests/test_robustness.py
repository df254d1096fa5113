"""Robustness across both packages: bad input, hostile weight files, extreme numbers, determinism.

- ``BAD_INPUTS``: one table of bad arguments and inputs; each row runs against ``torch_reference``
  and ``flax_attention`` and must raise the same exception with the same message (the README's
  "Errors" section lists every message form; a test keeps the two in step).
- Weight files: truncated, corrupted, pickled, wrong-dtype, NaN-holding, extra- and missing-key
  files, and headers that claim more data than the file holds. Each raises a ``ValueError``
  naming the file (and the keys) and leaves the module untouched, array by array;
  ``strict=False`` reports what it skipped. Nothing in the project unpickles.
- Numerics: inputs scaled by 1e4, all-equal scores, float16/bfloat16 near their range limits and
  fully masked rows on every mask path, against the behaviour the README's "Numerics" section
  writes down.
- Determinism: the same seeds give bit-identical results, within a process and across two.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import re
import struct
import subprocess
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file as torch_load_file
from safetensors.torch import save_file as torch_save_file

import flax_attention as fa
import torch_reference as tr
from conformance_tests import harness, spec
from conformance_tests.tolerances import tolerance

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()

# ---- the bad-input matrix ---------------------------------------------------------------------


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
)  # document 001's query (b, q_len, d_model), key/value (b, k_len, ...)

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
    # ---- masks (document 001) ----
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
    # ---- query/key/value that do not fit together (document 001) ----
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
        r"'blocked'\)$",
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


def _raised(row: BadInput, package: str, run) -> Exception:
    try:
        run()
    except Exception as error:  # noqa: BLE001 - the row says which one it must be
        return error
    pytest.fail(f"{row.id} ({package}): raised nothing, expected {row.error.__name__}")


@pytest.mark.parametrize("row", BAD_INPUTS, ids=[row.id for row in BAD_INPUTS])
def test_bad_input_raises_the_same_clear_error_in_both_packages(row):
    messages = {}
    for package, run in (("torch_reference", row.torch), ("flax_attention", row.flax)):
        if run is None:
            continue
        error = _raised(row, package, run)
        assert type(error) is row.error, (
            f"{row.id} ({package}): {type(error).__name__}: {error} (expected {row.error.__name__})"
        )
        assert re.search(row.match, str(error)), (
            f"{row.id} ({package}): message {str(error)!r} does not match {row.match!r}"
        )
        messages[package] = str(error)
    assert messages, f"{row.id}: runs in neither package"
    if row.same_message and len(messages) == 2:
        assert messages["torch_reference"] == messages["flax_attention"], (
            f"{row.id}: the packages disagree: {messages}"
        )


def test_the_matrix_is_one_table_of_unique_rows():
    ids = [row.id for row in BAD_INPUTS]
    assert len(ids) == len(set(ids)), (
        f"duplicate ids: {sorted({i for i in ids if ids.count(i) > 1})}"
    )
    assert len(BAD_INPUTS) >= 20, f"{len(BAD_INPUTS)} rows"
    assert {row.error for row in BAD_INPUTS} == {ValueError, TypeError}


# ---- weight files -----------------------------------------------------------------------------

_FILE_LAYER = ("MultiHeadAttention", (5, 6, 8, 0.0, 3, True))  # every kind of key, and a mask


def _torch_state(seed=0) -> dict[str, torch.Tensor]:
    name, args = _FILE_LAYER
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in getattr(tr, name)(*args).state_dict().items()}


def _flax_layer(**options):
    name, args = _FILE_LAYER
    return getattr(fa, name)(*args, rngs=nnx.Rngs(7), **options)


def _snapshot(module) -> dict[str, np.ndarray]:
    return {k: np.array(v, copy=True) for k, v in fa.state_dict(module).items()}


def _max_diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max()) if a.shape == b.shape and a.size else float("inf")


def _assert_untouched(module, before, what):
    after = _snapshot(module)
    assert set(after) == set(before), f"{what}: keys changed {sorted(set(after) ^ set(before))}"
    for key, value in before.items():
        assert after[key].dtype == value.dtype and np.array_equal(after[key], value), (
            f"{what}: {key} changed (max abs diff {_max_diff(after[key], value):.3e})"
        )


def _inflate_offsets(data: bytes) -> bytes:
    """The header's last tensor claims to end 1 KiB past the end of the file."""
    (length,) = struct.unpack("<Q", data[:8])
    header = data[8 : 8 + length].decode()
    end = max(int(n) for n in re.findall(r'"data_offsets":\[\d+,(\d+)\]', header))
    header = header.replace(f",{end}]", f",{end + 1024}]")
    header = header.ljust(length).encode()  # keep the header's length (safetensors pads it)
    return data[:8] + header + data[8 + length :]


def _pickle_payload(marker: pathlib.Path) -> bytes:
    """A protocol-0 pickle that creates ``marker`` when unpickled (``open(marker, "w")``)."""
    return f"cbuiltins\nopen\n(S'{marker}'\nS'w'\ntR.".encode()


#: Files that are not readable safetensors: (id, damage(path, valid file bytes, tmp_path)).
UNREADABLE_FILES = {
    "truncated": lambda data, tmp: data[:-17],
    "header_claims_more_data": lambda data, tmp: _inflate_offsets(data),
    "header_length_past_end_of_file": lambda data, tmp: struct.pack("<Q", len(data)) + data[8:],
    "header_length_2_to_the_63": lambda data, tmp: struct.pack("<Q", 2**63) + data[8:],
    "header_not_json": lambda data, tmp: data[:8] + b"{" * (len(data) - 8),
    "empty": lambda data, tmp: b"",
    "eight_bytes": lambda data, tmp: data[:8],
    "pickle_payload": lambda data, tmp: _pickle_payload(tmp / "unpickled"),
    "torch_save_zip": None,  # torch.save of the same state dict (a zip holding a pickle)
    "missing": None,
    "directory": None,
}


@pytest.mark.parametrize("damage", UNREADABLE_FILES)
def test_unreadable_file_raises_naming_it_and_leaves_the_module_untouched(damage, tmp_path):
    path = tmp_path / f"{damage}.safetensors"
    torch_save_file(_torch_state(), path)
    if damage == "torch_save_zip":
        torch.save(_torch_state(), path)
    elif damage == "missing":
        path.unlink()
    elif damage == "directory":
        path.unlink()
        path.mkdir()
    else:
        path.write_bytes(UNREADABLE_FILES[damage](path.read_bytes(), tmp_path))
    module = _flax_layer()
    before = _snapshot(module)
    for strict in (True, False):
        with pytest.raises(ValueError) as error:
            fa.load_file(module, path, strict=strict)
        message = str(error.value)
        assert message.startswith(f"path ({str(path)!r}) must be a readable safetensors file: "), (
            f"{damage}: {message}"
        )
        _assert_untouched(module, before, f"{damage} (strict={strict})")
    assert not (tmp_path / "unpickled").exists(), f"{damage}: the pickle payload ran"


def _set(key, make):
    """A damage that replaces ``key``'s tensor by ``make(tensor)``."""

    def damage(state):
        state[key] = make(state.get(key))

    return damage


def _poke(key, value):
    def damage(state):
        state[key] = state[key].clone()
        state[key].view(-1)[0] = value

    return damage


#: Readable files with bad content: (damage(state), the key, where strict=False reports it).
BAD_CONTENT = {
    "int_weight": (
        _set("W_query.weight", lambda t: t.to(torch.int32)),
        "W_query.weight",
        "mismatched",
    ),
    "int64_bias": (_set("W_key.bias", lambda t: t.to(torch.int64)), "W_key.bias", "mismatched"),
    "bool_bias": (_set("out_proj.bias", lambda t: t > 0), "out_proj.bias", "mismatched"),
    "float8_weight": (
        _set("W_value.weight", lambda t: t.to(torch.float8_e4m3fn)),
        "W_value.weight",
        "mismatched",
    ),
    "nan_weight": (_poke("W_value.weight", float("nan")), "W_value.weight", "mismatched"),
    "inf_bias": (_poke("out_proj.bias", float("inf")), "out_proj.bias", "mismatched"),
    "transposed_weight": (
        _set("W_key.weight", lambda t: t.T.contiguous()),
        "W_key.weight",
        "mismatched",
    ),
    "other_context_mask": (
        _set("mask", lambda t: torch.triu(torch.ones(7, 7), diagonal=1)),
        "mask",
        "mismatched",
    ),
    "mask_not_causal": (_set("mask", lambda t: torch.zeros_like(t)), "mask", "mismatched"),
    "extra_key": (_set("W_extra.weight", lambda t: torch.zeros(2)), "W_extra.weight", "unexpected"),
    "missing_key": (lambda state: state.pop("W_query.bias"), "W_query.bias", "missing"),
}


def _readme_section(title: str) -> str:
    match = re.search(rf"^## {title}\n(.*?)(?=^## )", README, flags=re.S | re.M)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def _templates(table_heading: str) -> list[re.Pattern]:
    """The backticked messages of the README table under ``table_heading`` as regexes
    (``<...>`` stands for any value)."""
    section = _readme_section("Errors")
    table = section.split(table_heading, 1)[1].split("\n\n", 2)[1]
    messages = [row.split("|")[-2].strip().strip("`") for row in table.splitlines()[2:]]
    return [re.compile(re.sub(r"<[^<>]+>", ".+", re.escape(m)) + "$") for m in messages]


@pytest.mark.parametrize("case", BAD_CONTENT)
def test_bad_content_raises_naming_file_and_key_and_changes_nothing(case, tmp_path):
    damage, key, kind = BAD_CONTENT[case]
    state = _torch_state()
    damage(state)
    path = tmp_path / f"{case}.safetensors"
    torch_save_file(state, path)
    module = _flax_layer()
    before = _snapshot(module)

    with pytest.raises(ValueError) as error:
        fa.load_file(module, path)
    message = str(error.value)
    assert message.startswith(f"load_file({str(path)!r}): load_state_dict into "), message
    assert "found 1 problem(s); nothing was loaded" in message, f"{case}: {message}"
    assert re.search(rf"(?<![\w.]){re.escape(key)}(?![\w.])", message), f"{case}: {message}"
    templates = _templates("Loading weights")
    for line in message.splitlines():
        assert any(t.match(line.strip()) for t in templates), (
            f"{case}: {line.strip()!r} is not in the README's list of weight errors"
        )
    _assert_untouched(module, before, f"{case} (strict=True)")

    result = fa.load_file(module, path, strict=False)
    expected = fa.IncompatibleKeys(
        *[[key] if kind == field else [] for field in ("missing", "unexpected", "mismatched")]
    )
    assert result == expected, f"{case}: strict=False reported {result}, expected {expected}"
    after = _snapshot(module)
    for name, value in after.items():
        if name == key:
            assert np.array_equal(value, before[name]), f"{case}: skipped {name} changed"
        elif name != "mask":
            loaded = state[name].numpy()
            assert np.array_equal(value, loaded), (
                f"{case}: good key {name} not loaded (max abs diff {_max_diff(value, loaded):.3e})"
            )
            assert not np.array_equal(before[name], loaded), f"{case}: {name} was already equal"


def test_values_that_overflow_the_parameter_dtype_are_refused(tmp_path):
    state = _torch_state()
    state["W_query.weight"][0, 0] = 1e6  # finite in float32, inf in float16
    path = tmp_path / "big.safetensors"
    torch_save_file(state, path)
    module = _flax_layer(param_dtype=jnp.float16)
    before = _snapshot(module)
    with pytest.raises(
        ValueError, match=r"W_query\.weight: overflows float16 \(largest magnitude 1e\+06 > 65504\)"
    ):
        fa.load_file(module, path)
    _assert_untouched(module, before, "float16 overflow")
    float64 = {k: v.double().numpy() for k, v in _torch_state().items()}
    float64["out_proj.bias"][0] = 1e300
    module = _flax_layer()
    before = _snapshot(module)
    with pytest.raises(
        ValueError, match=r"out_proj\.bias: overflows float32 \(largest magnitude 1e\+300"
    ):
        fa.load_state_dict(module, float64)
    _assert_untouched(module, before, "float64 overflow")


def test_bfloat16_files_load_exactly(tmp_path):
    """torch bfloat16 weights load into a float32 layer exactly, and a bfloat16 layer's own file
    goes back to torch bit for bit (NumPy reports bfloat16 as kind 'V'; it is a float)."""
    state = {k: v.to(torch.bfloat16) for k, v in _torch_state().items()}
    path = tmp_path / "bf16.safetensors"
    torch_save_file(state, path)
    module = _flax_layer()
    assert fa.load_file(module, path) == fa.IncompatibleKeys([], [], [])
    for key, value in fa.state_dict(module).items():
        expected = state[key].float().numpy()
        assert np.array_equal(value, expected), f"{key}: max abs diff {_max_diff(value, expected)}"

    module = _flax_layer(param_dtype=jnp.bfloat16)
    assert fa.load_file(module, path) == fa.IncompatibleKeys([], [], [])
    fa.save_file(module, tmp_path / "back.safetensors")
    back = torch_load_file(tmp_path / "back.safetensors")
    for key, value in state.items():
        expected = value.float() if key == "mask" else value  # the buffer is exported as float32
        assert back[key].dtype == expected.dtype and torch.equal(back[key], expected), key


_FORBIDDEN = {
    "torch.load without weights_only=True": re.compile(
        r"torch\.load\((?![^)\n]*weights_only=True)"
    ),
    "pickle": re.compile(r"\bimport\s+(c?pickle|dill|joblib)\b|\bfrom\s+(c?pickle|dill)\b"),
    "pickle.load": re.compile(r"\bpickle\.loads?\("),
    "np.load with pickles": re.compile(r"allow_pickle\s*=\s*True"),
}


def test_nothing_in_the_project_unpickles():
    # the patterns catch what they must (spelt in pieces so this file does not match itself)
    load = "torch.load" + "("
    assert _FORBIDDEN["torch.load without weights_only=True"].search(load + "path)")
    assert not _FORBIDDEN["torch.load without weights_only=True"].search(
        load + "path, weights_only=True)"
    )
    assert _FORBIDDEN["pickle"].search("import " + "pickle")
    assert _FORBIDDEN["pickle.load"].search("pickle" + ".loads(data)")
    files = [
        path
        for package in ("flax_attention", "torch_reference", "conformance_tests")
        for path in sorted((ROOT / package).rglob("*.py"))
    ]
    assert len(files) > 10, files
    found = [
        f"{path.relative_to(ROOT)}:{n}: {what}: {line.strip()}"
        for path in files
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        for what, pattern in _FORBIDDEN.items()
        if pattern.search(line)
    ]
    assert not found, "unpickling found:\n" + "\n".join(found)


def _matrix_messages() -> list[tuple[str, str]]:
    messages = []
    for row in BAD_INPUTS:
        for package, run in (("torch_reference", row.torch), ("flax_attention", row.flax)):
            if run is not None:
                messages.append((f"{row.id} ({package})", str(_raised(row, package, run))))
    return messages


def test_readme_lists_every_message_of_the_matrix():
    templates = _templates("Arguments and inputs")
    messages = _matrix_messages()
    for where, message in messages:
        assert any(t.match(message) for t in templates), (
            f"{where}: {message!r} is not in the README's 'Errors' table"
        )
    for template in templates:
        assert any(template.match(m) for _, m in messages), (
            f"README 'Errors' lists {template.pattern!r}, which no row of BAD_INPUTS raises"
        )


# ---- numerics ---------------------------------------------------------------------------------

#: (constructor arguments, input shapes): small, with the shapes shared so eager ops compile once.
NUMERIC_LAYERS = {
    "SelfAttention_v1": ((4, 6), ((5, 4),)),
    "SelfAttention_v2": ((4, 6, True), ((5, 4),)),
    "CausalAttention": ((4, 6, 5, 0.0, True), ((2, 5, 4),)),
    "MultiHeadAttentionWrapper": ((4, 3, 5, 0.0, 2, True), ((2, 5, 4),)),
    "MultiHeadAttention": ((4, 6, 5, 0.0, 2, True), ((2, 5, 4),)),
    "MultiHeadedAttention": ((2, 6, 0.0), ((2, 5, 6),) * 3),
}


def _case(layer: str, mask=None) -> spec.Case:
    args, inputs = NUMERIC_LAYERS[layer]
    return spec.Case(f"robustness_{layer}", layer, args, inputs, mask=mask, checks=("forward",))


def _numeric_pair(case: spec.Case, torch_dtype=torch.float32, flax_dtype=None):
    """torch's layer (weights from seed 0, document 001's four projections made distinct) and
    the Flax layer with the same weights, both in eval mode."""
    torch.manual_seed(0)
    tm = getattr(tr, case.layer)(*case.args).eval()
    if case.layer == "MultiHeadedAttention":
        for proj in tm.proj_weights:
            proj.reset_parameters()
    fm = getattr(fa, case.layer)(*case.args, dtype=flax_dtype, rngs=nnx.Rngs(0))
    fa.load_state_dict(fm, {k: v.numpy() for k, v in tm.state_dict().items()})
    fm.eval()
    return tm.to(torch_dtype), fm


def _np(x) -> np.ndarray:
    """float64 NumPy of a torch tensor (bfloat16 included) or a jax array (exact)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy().astype(np.float64)
    return np.asarray(x).astype(np.float64)


def _assert_finite(what: str, tensors: dict):
    for name, value in tensors.items():
        value = _np(value)
        bad = int((~np.isfinite(value)).sum())
        assert bad == 0, f"{what}: {name} holds {bad} NaN/inf of {value.size}"


@functools.partial(jax.jit, static_argnums=(0, 1))
def _jit_forward(case, graphdef, params, rest, inputs, mask):
    return harness.call_flax(case, nnx.merge(graphdef, params, rest), inputs, mask)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _jit_grads(case, graphdef, params, rest, inputs, mask, cotangents):
    def loss(params, inputs):
        outputs = harness.call_flax(case, nnx.merge(graphdef, params, rest), inputs, mask)
        return sum((o.astype(jnp.float32) * c).sum() for o, c in zip(outputs, cotangents))

    return jax.grad(loss, argnums=(0, 1))(params, inputs)


def flax_forward(case, fm, inputs, mask=None) -> tuple:
    """``harness.call_flax`` compiled once per case and shape (one XLA compilation, not one per
    op: these tests share their layers and shapes, so most calls hit the cache)."""
    graphdef, params, rest = nnx.split(fm, nnx.Param, ...)
    return _jit_forward(case, graphdef, params, rest, list(inputs), mask)


def flax_grads(case, fm, inputs, mask, cotangents) -> dict:
    """``harness.flax_grads``, compiled: gradients w.r.t. inputs and parameters by torch name."""
    graphdef, params, rest = nnx.split(fm, nnx.Param, ...)
    cotangents = [jnp.asarray(c) for c in cotangents]
    g_params, g_inputs = _jit_grads(case, graphdef, params, rest, list(inputs), mask, cotangents)
    grads = {f"input.{i}": g for i, g in enumerate(g_inputs)}
    by_name = fa.state_dict(nnx.merge(graphdef, g_params, rest))
    grads.update({n: v for n, v in by_name.items() if not n.endswith("mask")})
    return grads


def _forward_and_grads(case, tm, fm, inputs, mask=None):
    """Outputs and gradients (inputs and parameters, by torch name) of both sides in float32."""
    t_inputs = [torch.from_numpy(x) for x in inputs]
    t_mask = None if mask is None else torch.from_numpy(mask)
    t_out, t_grads, cotangents = harness.torch_grads(case, tm, t_inputs, t_mask)
    f_inputs = [jnp.asarray(x) for x in inputs]
    f_mask = None if mask is None else jnp.asarray(mask)
    f_out = flax_forward(case, fm, f_inputs, f_mask)
    f_grads = flax_grads(case, fm, f_inputs, f_mask, cotangents)
    names = harness.output_names(case)
    return dict(zip(names, t_out)), t_grads, dict(zip(names, f_out)), f_grads


@pytest.mark.parametrize("layer", NUMERIC_LAYERS)
def test_inputs_scaled_by_1e4_stay_finite_and_agree(layer):
    """Scores of order 1e8: the softmax saturates (one-hot) but nothing overflows in float32."""
    case = _case(layer)
    tm, fm = _numeric_pair(case)
    inputs = [x * np.float32(1e4) for x in harness.make_inputs(case)]
    t_out, t_grads, f_out, f_grads = _forward_and_grads(case, tm, fm, inputs)
    for what, tensors in (
        ("torch outputs", t_out),
        ("torch gradients", t_grads),
        ("flax outputs", f_out),
        ("flax gradients", f_grads),
    ):
        _assert_finite(f"{layer} x 1e4, {what}", tensors)
    tol = tolerance("float32", "forward")
    err, _, passed, worst = harness.compare(t_out, f_out, tol)
    assert passed, f"{layer} x 1e4: {worst} max abs diff {err:.3e} > {tol} * max(1, max|ref|)"
    if layer == "MultiHeadedAttention":  # saturated: each row puts (almost) all weight on one key
        for package, weights in (
            ("torch", t_out["attention_score"]),
            ("flax", f_out["attention_score"]),
        ):
            top = _np(weights).max(axis=-1)
            assert top.min() > 0.999, f"{package}: a row's largest weight is {top.min():.4f}"
    # bfloat16 keeps float32's range: the same inputs stay finite there too (both packages)
    tm16, fm16 = _numeric_pair(case, torch.bfloat16, jnp.bfloat16)
    with torch.no_grad():
        t16 = harness.call_torch(case, tm16, [torch.from_numpy(x).bfloat16() for x in inputs], None)
    f16 = flax_forward(case, fm16, [jnp.asarray(x, jnp.bfloat16) for x in inputs])
    _assert_finite(f"{layer} x 1e4 bfloat16, torch", dict(enumerate(t16)))
    _assert_finite(f"{layer} x 1e4 bfloat16, flax", dict(enumerate(f16)))


@pytest.mark.parametrize("scale", [1.0, 1e4])
@pytest.mark.parametrize("layer", NUMERIC_LAYERS)
def test_all_equal_scores_give_uniform_weights(layer, scale):
    """Every token the same: every score of a row is equal, so the weights are uniform and every
    output row is the same value vector, in both packages, with finite gradients."""
    case = _case(layer)
    tm, fm = _numeric_pair(case)
    inputs = [
        np.broadcast_to(x[..., :1, :], x.shape) * np.float32(scale)
        for x in harness.make_inputs(case)
    ]
    inputs = [np.ascontiguousarray(x) for x in inputs]
    t_out, t_grads, f_out, f_grads = _forward_and_grads(case, tm, fm, inputs)
    _assert_finite(f"{layer} equal scores x {scale}, torch", {**t_out, **t_grads})
    _assert_finite(f"{layer} equal scores x {scale}, flax", {**f_out, **f_grads})
    tol = tolerance("float32", "forward")
    for package, outputs in (("torch", t_out), ("flax", f_out)):
        out = _np(outputs["out"])
        first = np.broadcast_to(out[..., :1, :], out.shape)
        err = float(np.abs(out - first).max())
        assert err <= tol * max(1.0, float(np.abs(first).max())), (
            f"{layer} x {scale} ({package}): output rows differ by {err:.3e}"
        )
        if layer == "MultiHeadedAttention":
            weights = _np(outputs["attention_score"])
            err = float(np.abs(weights - 1 / weights.shape[-1]).max())
            assert err <= 1e-7, f"{package}: attention_score differs from uniform by {err:.3e}"
    err, _, passed, worst = harness.compare(t_out, f_out, tol)
    assert passed, f"{layer} equal scores x {scale}: {worst} max abs diff {err:.3e}"


def test_softmax_naive_overflows_as_the_document_computes_it():
    """Document 003's ``softmax_naive`` has no max subtraction. Both packages agree up to scores
    of ~86; exp(89) overflows float32, so both give NaN there. Between them the packages differ:
    for a row sum above ~8.5e37 XLA on CPU divides by multiplying with the reciprocal, which is
    subnormal and flushed to zero, so Flax gives 0 where torch still gives the weights. (The
    layers' softmax subtracts the max and never meets this.)"""
    rows = {  # scores: (torch, flax)
        86.0: ([0.5, 0.5], [0.5, 0.5]),
        88.0: ([0.5, 0.5], [0.0, 0.0]),
        89.0: ([np.nan, np.nan], [np.nan, np.nan]),
    }
    for score, (torch_expected, flax_expected) in rows.items():
        x = np.full(2, score, np.float32)
        for package, got, expected in (
            ("torch", tr.softmax_naive(torch.from_numpy(x)).numpy(), torch_expected),
            ("flax", np.asarray(fa.softmax_naive(jnp.asarray(x))), flax_expected),
        ):
            np.testing.assert_allclose(got, expected, rtol=1e-6, err_msg=f"{package} {score}")
    huge = np.full(2, 1e30, np.float32)  # the layers' softmax: all-equal huge scores are fine
    for package, weights in (
        ("torch", torch.softmax(torch.from_numpy(huge), dim=0).numpy()),
        ("flax", np.asarray(fa.masked_softmax(jnp.asarray(huge), 1))),
    ):
        np.testing.assert_array_equal(weights, [0.5, 0.5], err_msg=package)


#: dtype: (largest input whose scores fit, inputs whose scores overflow). With identity weights
#: and two features, every score q . k is 2 c^2 (computed before the division by sqrt(d_k), as
#: the documents do): float16 holds 2 * 180^2 = 64800 but rounds 2 * 181^2 = 65522 to inf.
OVERFLOW = {
    "float16": (180.0, (181.0, 6e4)),
    "bfloat16": (1.3e19, (2e19, 3e38)),
    "float32": (1.3e19, (2e19, 3e38)),
}


@pytest.mark.parametrize("dtype", OVERFLOW)
def test_scores_beyond_the_dtype_range_give_nan_in_both_packages(dtype):
    """Inputs near a dtype's limit: finite and exact while every score fits, all NaN (an inf
    score makes softmax compute inf - inf) once one overflows. torch runs in the dtype, Flax
    computes in it (float32 parameters)."""
    eye = np.eye(2, dtype=np.float32)
    state = {f"{w}.weight": eye for w in ("W_query", "W_key", "W_value")}
    state["mask"] = np.triu(np.ones((4, 4), np.float32), k=1)
    tm = tr.CausalAttention(2, 2, 4, 0.0).eval()
    tm.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    tm = tm.to(getattr(torch, dtype))
    fm = fa.CausalAttention(2, 2, 4, 0.0, dtype=harness.DTYPES[dtype], rngs=nnx.Rngs(0))
    fa.load_state_dict(fm, state)
    fm.eval()
    fits, overflows = OVERFLOW[dtype]
    for c in (fits, *overflows):
        x = np.full((1, 4, 2), c, np.float32)
        with torch.no_grad():
            t_out = tm(torch.from_numpy(x).to(getattr(torch, dtype))).float().numpy()
        f_out = np.asarray(fm(jnp.asarray(x, harness.DTYPES[dtype])), np.float32)
        for package, out in (("torch", t_out), ("flax", f_out)):
            if c == fits:
                expected = np.float32(np.asarray(c, np.float32).astype(harness.DTYPES[dtype]))
                np.testing.assert_array_equal(
                    out, np.full_like(out, expected), err_msg=f"{dtype} {c} {package}"
                )
            else:
                assert np.isnan(out).all(), f"{dtype} inputs {c:g} ({package}): {out.ravel()}"


def test_causal_rows_always_keep_a_key():
    """The causal family cannot mask a whole row: the diagonal is always visible, in both."""
    for context_length in range(1, 9):
        buffer = tr.CausalAttention(1, 1, context_length, 0.0).mask.numpy()
        for t in range(1, context_length + 1):
            keep = np.asarray(fa.causal_mask(t, t))
            np.testing.assert_array_equal(keep, buffer[:t, :t] == 0, err_msg=f"{t} tokens")
            assert keep.sum(axis=-1).min() >= 1, f"a fully masked row at {t} tokens"


def _annotated_masks(b, t, s) -> dict[str, np.ndarray]:
    """Document 001's mask forms, each with at least one fully masked query row."""
    causal = np.tril(np.ones((t, s), np.float32))
    row = np.broadcast_to(causal, (b, t, s)).copy()
    row[0, 1, :] = 0  # (b, t, s): one row of batch 0 sees nothing
    padding = np.ones((b, 1, s), np.float32)
    padding[1] = 0  # (b, 1, s): batch 1 has no key at all
    return {
        "row_float": row,
        "row_bool": row != 0,
        "shared_all_zero": np.zeros((1, t, s), np.float32),  # (1, t, s): every row masked
        "padding_empty": padding,
    }


@pytest.mark.parametrize("form", ["row_float", "row_bool", "shared_all_zero", "padding_empty"])
def test_fully_masked_rows_are_uniform_and_finite(form):
    """``MultiHeadedAttention`` fills ``mask == 0`` with -1e10, so a row with no key left has all
    scores equal: uniform weights 1/k_len over every key, finite outputs and gradients."""
    case = _case("MultiHeadedAttention")
    tm, fm = _numeric_pair(case)
    inputs = harness.make_inputs(case)
    b, t, _ = inputs[0].shape
    mask = _annotated_masks(b, t, inputs[1].shape[1])[form]
    masked = np.broadcast_to(mask, (b, t, inputs[1].shape[1])).sum(axis=-1) == 0  # (b, t)
    assert masked.any(), "test setup: no fully masked row"
    t_out, t_grads, f_out, f_grads = _forward_and_grads(case, tm, fm, inputs, mask)
    _assert_finite(f"{form}, torch", {**t_out, **t_grads})
    _assert_finite(f"{form}, flax", {**f_out, **f_grads})
    for package, outputs in (("torch", t_out), ("flax", f_out)):
        weights = _np(outputs["attention_score"]).transpose(0, 2, 1, 3)[masked]
        err = float(np.abs(weights - 1 / weights.shape[-1]).max())
        assert err <= 1e-7, f"{form} ({package}): masked rows differ from uniform by {err:.3e}"
    err, _, passed, worst = harness.compare(t_out, f_out, tolerance("float32", "forward"))
    assert passed, f"{form}: {worst} max abs diff {err:.3e}"
    err, _, passed, worst = harness.compare(t_grads, f_grads, tolerance("float32", "grad"))
    assert passed, f"{form}: gradient {worst} max abs diff {err:.3e}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fully_masked_rows_in_half_precision(dtype):
    """Flax clips -1e10 to the dtype's range (float16: -65504), so a fully masked row stays
    uniform; torch_reference in bfloat16 does the same, in float16 it raises as the document's
    ``masked_fill(mask == 0, -1e10)`` does (the fill does not fit a float16)."""
    case = _case("MultiHeadedAttention")
    inputs = harness.make_inputs(case)
    b, t, _ = inputs[0].shape
    mask = _annotated_masks(b, t, inputs[1].shape[1])["row_float"]
    tm, fm = _numeric_pair(case, getattr(torch, dtype), harness.DTYPES[dtype])
    f_out = fm(*(jnp.asarray(x, harness.DTYPES[dtype]) for x in inputs), jnp.asarray(mask))
    weights = _np(fm.attention_score[...])[0, :, 1, :]  # the masked row, every head
    _assert_finite(f"{dtype} flax", {"out": f_out, "attention_score": fm.attention_score[...]})
    eps = float(jnp.finfo(harness.DTYPES[dtype]).eps)
    assert np.abs(weights - 1 / weights.shape[-1]).max() <= eps, f"flax {dtype}: {weights}"
    t_inputs = [torch.from_numpy(x).to(getattr(torch, dtype)) for x in inputs]
    if dtype == "float16":
        with pytest.raises(RuntimeError, match="Half"):
            tm(*t_inputs, torch.from_numpy(mask))
        return
    with torch.no_grad():
        t_out = tm(*t_inputs, torch.from_numpy(mask))
    weights = _np(tm.attention_score)[0, :, 1, :]
    _assert_finite(f"{dtype} torch", {"out": t_out, "attention_score": tm.attention_score})
    assert np.abs(weights - 1 / weights.shape[-1]).max() <= eps, f"torch {dtype}: {weights}"


def test_attention_function_fully_masked_row_and_the_core_with_minus_inf():
    """Document 001's ``attention`` (fill -1e10): uniform in both packages. The Flax core with
    ``fill_value=-inf`` (the causal family's fill) gives NaN for a row with no key, as
    ``jax.nn.softmax`` does; no layer passes it such a row."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 4)).astype(np.float32) for _ in range(3))
    mask = np.ones((2, 3, 3), np.float32)
    mask[1, 2] = 0
    t_out, t_weights = tr.attention(*(torch.from_numpy(a) for a in (q, k, v, mask)))
    f_out, f_weights = fa.attention(*(jnp.asarray(a) for a in (q, k, v, mask)))
    for package, out, weights in (("torch", t_out, t_weights), ("flax", f_out, f_weights)):
        _assert_finite(f"attention ({package})", {"out": out, "weights": weights})
        row = _np(weights)[1, 2]
        np.testing.assert_allclose(row, np.full(3, 1 / 3), rtol=0, atol=1e-7, err_msg=package)
    scores = jnp.asarray(rng.standard_normal((2, 3)), jnp.float32)
    keep = jnp.asarray([[True, False, True], [False, False, False]])
    weights = np.asarray(fa.masked_softmax(scores, 1, keep))
    assert np.isfinite(weights[0]).all() and np.isnan(weights[1]).all(), weights


# ---- determinism ------------------------------------------------------------------------------

#: Layers with dropout, at rate 0.5, so a train-mode call draws a mask.
_DROPOUT_ARGS = {
    "CausalAttention": (4, 6, 5, 0.5, True),
    "MultiHeadAttentionWrapper": (4, 3, 5, 0.5, 2, True),
    "MultiHeadAttention": (4, 6, 5, 0.5, 2, True),
    "MultiHeadedAttention": (2, 6, 0.5),
}


def _run_everything(layer: str) -> dict[str, np.ndarray]:
    """Every number a user gets from seeds alone, on CPU: torch's and Flax's initial weights,
    eval outputs and (where there is dropout) a train-mode output."""
    args, shapes = NUMERIC_LAYERS[layer]
    args = _DROPOUT_ARGS.get(layer, args)
    case = spec.Case(f"determinism_{layer}", layer, args, shapes, checks=("forward",))
    inputs = harness.make_inputs(case)
    out: dict[str, np.ndarray] = {}
    torch.manual_seed(0)
    tm = getattr(tr, layer)(*args)
    out.update({f"torch init {k}": v.numpy().copy() for k, v in tm.state_dict().items()})
    fm = getattr(fa, layer)(*args, rngs=nnx.Rngs(params=0, dropout=1))
    out.update({f"flax init {k}": v for k, v in fa.state_dict(fm).items()})
    t_inputs = [torch.from_numpy(x) for x in inputs]
    f_inputs = [jnp.asarray(x) for x in inputs]
    for mode in ("eval", "train") if layer in _DROPOUT_ARGS else ("eval",):
        getattr(tm, mode)()
        getattr(fm, mode)()
        torch.manual_seed(1)
        with torch.no_grad():
            t_out = harness.call_torch(case, tm, t_inputs, None)
        out.update({f"torch {mode} {i}": _np(v) for i, v in enumerate(t_out)})
        f_out = flax_forward(case, fm, f_inputs)  # train mode draws from fm's dropout rngs
        out.update({f"flax {mode} {i}": _np(v) for i, v in enumerate(f_out)})
    return out


#: The layers the fingerprint covers: nn.Linear initialisers, causal split heads and document
#: 001's masked heads, both with dropout (the other layers are made of the same parts; each
#: layer costs a fresh process a few XLA compilations).
FINGERPRINT_LAYERS = ("MultiHeadAttention", "MultiHeadedAttention")


def fingerprint() -> dict[str, str]:
    """sha256 of every array ``_run_everything`` makes for ``FINGERPRINT_LAYERS``."""
    with jax.default_matmul_precision("highest"):
        return {
            f"{layer}: {name}": hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()
            for layer in FINGERPRINT_LAYERS
            for name, value in _run_everything(layer).items()
        }


def test_same_seeds_give_bit_identical_results_in_one_process_and_across_two():
    """Initial weights, eval outputs and dropout draws from the same seeds: the same
    bits twice in this process and once more in a fresh one (started first, run alongside)."""
    code = (
        "import json, jax; jax.config.update('jax_numpy_rank_promotion', 'raise');"
        "from conformance_tests.tests.test_robustness import fingerprint;"
        "print(json.dumps(fingerprint()))"
    )
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    other = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = fingerprint()
        second = fingerprint()
        stdout, stderr = other.communicate(timeout=300)
    finally:
        other.kill()
    assert first == second, [name for name in first if first[name] != second.get(name)][:10]
    assert other.returncode == 0, stderr[-3000:]
    theirs = json.loads(stdout.strip().splitlines()[-1])
    assert theirs.keys() == first.keys(), sorted(set(theirs) ^ set(first))
    differ = [name for name in first if first[name] != theirs[name]]
    assert not differ, f"{len(differ)} arrays differ between two processes: {differ[:10]}"
    for layer in FINGERPRINT_LAYERS:  # a train-mode draw is a real draw, not the eval output
        if layer in _DROPOUT_ARGS:
            for package in ("torch", "flax"):
                train, eval_ = (
                    first[f"{layer}: {package} train 0"],
                    first[f"{layer}: {package} eval 0"],
                )
                assert train != eval_, f"{layer} {package}: dropout drew nothing"
