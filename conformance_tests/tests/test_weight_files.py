"""Weight files and mappings that must be refused: truncated, corrupted, pickled, wrong-dtype,
NaN-holding, extra- and missing-key files, and headers that claim more data than the file holds.

Each raises a ``ValueError`` naming the file (and the keys) and leaves the module untouched, array
by array; every line of the message is a form listed in ``docs/errors.md``; ``strict=False``
reports what it skipped. Nothing in the project unpickles.
"""

from __future__ import annotations

import pathlib
import re
import struct

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file as torch_load_file
from safetensors.torch import save_file as torch_save_file

import flax_attention as fa
import torch_reference as tr
from conformance_tests.tests.helpers import (
    assert_untouched,
    error_templates,
    max_diff,
    small_case,
    snapshot,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: Every kind of key (weights, biases, the output projection) and a ``mask`` buffer.
FILE_CASE = small_case("MultiHeadAttention")


def _torch_state(seed=0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    layer = getattr(tr, FILE_CASE.layer)(*FILE_CASE.args)
    return {k: v.clone() for k, v in layer.state_dict().items()}


def _flax_layer(**options):
    """The Flax layer with its own initial weights (seed 7: none equal torch's)."""
    return getattr(fa, FILE_CASE.layer)(*FILE_CASE.args, rngs=nnx.Rngs(7), **options)


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
    before = snapshot(module)
    for strict in (True, False):
        with pytest.raises(ValueError) as error:
            fa.load_file(module, path, strict=strict)
        message = str(error.value)
        assert message.startswith(f"path ({str(path)!r}) must be a readable safetensors file: "), (
            f"{damage}: {message}"
        )
        assert_untouched(module, before, f"{damage} (strict={strict})")
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


@pytest.mark.quick
@pytest.mark.parametrize("case", BAD_CONTENT)
def test_bad_content_raises_naming_file_and_key_and_changes_nothing(case, tmp_path):
    damage, key, kind = BAD_CONTENT[case]
    state = _torch_state()
    damage(state)
    path = tmp_path / f"{case}.safetensors"
    torch_save_file(state, path)
    module = _flax_layer()
    before = snapshot(module)

    with pytest.raises(ValueError) as error:
        fa.load_file(module, path)
    message = str(error.value)
    assert message.startswith(f"load_file({str(path)!r}): load_state_dict into "), message
    assert "found 1 problem(s); nothing was loaded" in message, f"{case}: {message}"
    assert re.search(rf"(?<![\w.]){re.escape(key)}(?![\w.])", message), f"{case}: {message}"
    listed = error_templates("Loading weights")
    for line in message.splitlines():
        assert any(t.match(line.strip()) for t in listed), (
            f"{case}: {line.strip()!r} is not in docs/errors.md's list of weight errors"
        )
    assert_untouched(module, before, f"{case} (strict=True)")

    result = fa.load_file(module, path, strict=False)
    expected = fa.IncompatibleKeys(
        *[[key] if kind == field else [] for field in ("missing", "unexpected", "mismatched")]
    )
    assert result == expected, f"{case}: strict=False reported {result}, expected {expected}"
    after = snapshot(module)
    for name, value in after.items():
        if name == key:
            assert np.array_equal(value, before[name]), f"{case}: skipped {name} changed"
        elif name != "mask":
            loaded = state[name].numpy()
            assert np.array_equal(value, loaded), (
                f"{case}: good key {name} not loaded (max abs diff {max_diff(value, loaded):.3e})"
            )
            assert not np.array_equal(before[name], loaded), f"{case}: {name} was already equal"


@pytest.mark.quick
def test_values_that_overflow_the_parameter_dtype_are_refused(tmp_path):
    state = _torch_state()
    state["W_query.weight"][0, 0] = 1e6  # finite in float32, inf in float16
    path = tmp_path / "big.safetensors"
    torch_save_file(state, path)
    module = _flax_layer(param_dtype=jnp.float16)
    before = snapshot(module)
    with pytest.raises(
        ValueError, match=r"W_query\.weight: overflows float16 \(largest magnitude 1e\+06 > 65504\)"
    ):
        fa.load_file(module, path)
    assert_untouched(module, before, "float16 overflow")
    float64 = {k: v.double().numpy() for k, v in _torch_state().items()}
    float64["out_proj.bias"][0] = 1e300
    module = _flax_layer()
    before = snapshot(module)
    with pytest.raises(
        ValueError, match=r"out_proj\.bias: overflows float32 \(largest magnitude 1e\+300"
    ):
        fa.load_state_dict(module, float64)
    assert_untouched(module, before, "float64 overflow")


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
        assert np.array_equal(value, expected), f"{key}: max abs diff {max_diff(value, expected)}"

    module = _flax_layer(param_dtype=jnp.bfloat16)
    assert fa.load_file(module, path) == fa.IncompatibleKeys([], [], [])
    fa.save_file(module, tmp_path / "back.safetensors")
    back = torch_load_file(tmp_path / "back.safetensors")
    for key, value in state.items():
        expected = value.float() if key == "mask" else value  # the buffer is exported as float32
        assert back[key].dtype == expected.dtype and torch.equal(back[key], expected), key


#: A non-finite value is refused by its own line (a later cast would refuse it too, with a line
#: that blames its size): (damage, the exact line, key), in a file and in a float64 mapping.
NON_FINITE = {
    "nan_weight": ("W_value.weight", (0, 0), float("nan")),
    "inf_bias": ("out_proj.bias", (0,), float("inf")),
    "minus_inf_weight": ("W_query.weight", (1, 2), float("-inf")),
}


@pytest.mark.quick
@pytest.mark.parametrize("case", NON_FINITE)
def test_nan_or_inf_is_refused_by_its_own_line(case, tmp_path):
    key, index, value = NON_FINITE[case]
    state = _torch_state()
    state[key][index] = value
    shape = tuple(state[key].shape)
    path = tmp_path / f"{case}.safetensors"
    torch_save_file(state, path)
    for what, load, dtype in (
        ("file", lambda module: fa.load_file(module, path), "float32"),
        (
            "float64 mapping",
            lambda module: fa.load_state_dict(
                module, {k: v.double().numpy() for k, v in state.items()}
            ),
            "float64",
        ),
    ):
        module = _flax_layer()
        before = snapshot(module)
        with pytest.raises(ValueError) as error:
            load(module)
        lines = [line.strip() for line in str(error.value).splitlines()[1:]]
        assert lines == [f"{key}: holds NaN or inf (shape {shape} dtype {dtype})"], (
            f"{case} ({what}): {lines}"
        )
        assert_untouched(module, before, f"{case} ({what})")


_FORBIDDEN = {
    "torch.load without weights_only=True": re.compile(
        r"torch\.load\((?![^)\n]*weights_only=True)"
    ),
    "pickle": re.compile(r"\bimport\s+(c?pickle|dill|joblib)\b|\bfrom\s+(c?pickle|dill)\b"),
    "pickle.load": re.compile(r"\bpickle\.loads?\("),
    "np.load with pickles": re.compile(r"allow_pickle\s*=\s*True"),
}


@pytest.mark.quick
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


@pytest.mark.quick
def test_a_skeleton_built_under_a_mesh_loads_on_that_mesh_and_nowhere_else():
    """``nnx.eval_shape`` under ``jax.set_mesh`` lays the skeleton's parameters out on an
    abstract mesh: a load inside the same mesh places them there; outside it (or under another
    mesh) it is a ``ValueError`` saying so, and nothing is written."""
    import jax

    real = fa.MultiHeadAttention(8, 8, 6, 0.0, 2, rngs=nnx.Rngs(0))
    weights = fa.state_dict(real)
    mesh = jax.make_mesh((1, 1), ("data", "model"))

    def skeleton():
        return nnx.eval_shape(lambda: fa.MultiHeadAttention(8, 8, 6, 0.0, 2, rngs=nnx.Rngs(1)))

    with jax.set_mesh(mesh):
        inside = skeleton()
        fa.load_state_dict(inside, weights)
    assert inside.W_query.kernel[...].sharding.mesh == mesh
    np.testing.assert_array_equal(inside.W_query.kernel[...], real.W_query.kernel[...])
    with jax.set_mesh(mesh):
        outside = skeleton()
    other = jax.make_mesh((1,), ("data",))
    for context in (None, other):
        with pytest.raises(
            ValueError,
            match=r"set_mesh on AbstractMesh\('data': 1, 'model': 1.*must be loaded under that",
        ):
            if context is None:
                fa.load_state_dict(outside, weights)
            else:
                with jax.set_mesh(context):
                    fa.load_state_dict(outside, weights)
        values = [v.get_value() for _, v in nnx.iter_graph(outside) if isinstance(v, nnx.Param)]
        assert all(isinstance(v, jax.ShapeDtypeStruct) for v in values)  # nothing written
