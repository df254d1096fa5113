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
``proj_weights.{i}.…``      ``proj_weights[i].…``               annotated-transformer projections
==========================  ==================================  ==========================

Every torch ``nn.Linear`` weight is the transpose of the Flax kernel; everything else keeps its
layout. Buffers are not Flax state: ``mask`` is checked on load (when present) and produced on
export. Loading into a module placed by ``flax_attention.shard`` keeps every parameter's sharding.

Which modules these functions take, and under which names, is the registry in
``flax_attention.layouts`` (``register(cls, Names(...))``, looked up by class): every layer here,
and each model class where ``flax_attention.models`` defines it; a module of another class is
refused until its class is registered (``docs/weights.md``, "Your own modules"). What only one
family of modules knows (a layout its modules cannot take, the line that explains a failed load
of its state dicts) is not written here either: each registered ``Names``' ``layout_refusal``
and ``load_hint`` are asked, for every module, where this module would otherwise need to know
them. Other peers' names (``layout="torch_nn"``, ``"gpt2"``, ``"fused_qkv"``) are
descriptions there too: each of their keys is a concatenation of the documents' keys (q, k, v
stacked), stored transposed or not. Every layout goes through the same checks below, so a key's
problems read the same whatever the layout; ``prefix`` picks one layer's keys out of a model's.
Safetensors files are opened in one place, ``open_safetensors`` (``load_file`` and
``models.checkpoints``' sharded directories), their tensors read only when checked and placed,
and written in one, ``write_safetensors`` (``save_file`` and ``models.checkpoints``'
``save_pretrained``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_attention._checks import check_bool, check_choice
from flax_attention.layouts import (
    LAYOUTS,
    TORCH_VARIABLES,
    Buffer,
    Key,
    Layout,
    ModelNames,
    Names,
    layers_taking,
    names_of,
    registered,
)
from flax_attention.mesh import fetch, place

__all__ = ["IncompatibleKeys", "load_state_dict", "state_dict", "save_file", "load_file"]


class IncompatibleKeys(NamedTuple):
    """What a ``strict=False`` load skipped (all empty after a clean load)."""

    missing_keys: list[str]
    unexpected_keys: list[str]
    mismatched_keys: list[str]


class CheckedBuffer(nnx.Variable):
    """A buffer a torch module carries in its ``state_dict`` whose exact value a peer may hold
    to its own rounding (the Annotated Transformer's positional table ``pe``): not a parameter
    (no ``nnx.Param`` filter trains it), loaded and exported as it is, after ``check(value)``
    (a NumPy array of the right shape -> a problem's text, or ``None``) passes."""

    def __init__(self, value, *, check, **metadata):
        super().__init__(value, check=check, **metadata)


class _Entry(NamedTuple):
    variable: nnx.Variable | None  # None for a buffer
    transpose: bool
    expected: np.ndarray | None  # the buffer's value; None for a parameter
    scale: nnx.Variable | None = None  # an int8 weight's scales (models.quantize), per feature
    index: int | None = None  # a slice of a stacked variable (Names.stacked): its leading index


def _torch_entries(module: nnx.Module) -> dict[str, _Entry]:
    """Torch key -> where its value lives in ``module``, in graph order: every parameter (and
    ``CheckedBuffer``) under its path, nnx's names made torch's (``TORCH_VARIABLES``); every
    buffer the registry declares for a submodule's class (``Names.buffers``: the causal
    ``mask``); a quantized weight (``Names.dequantized``) with its scale."""
    scales = {  # a quantized weight's variable -> its scales'
        id(getattr(node, weight)): getattr(node, scale)
        for _, node in nnx.iter_graph(module)
        if isinstance(node, nnx.Module) and (names := _names(node)) is not None
        for weight, scale in names.dequantized
    }
    stacked = {  # a stacked variable -> its torch keys' pattern and transpose
        id(getattr(node, variable)): (pattern, transpose)
        for _, node in nnx.iter_graph(module)
        if isinstance(node, nnx.Module) and (names := _names(node)) is not None
        for variable, pattern, transpose in names.stacked
    }
    entries: dict[str, _Entry] = {}
    for path, node in nnx.iter_graph(module):
        name = ".".join(str(part) for part in path)
        if isinstance(node, nnx.Module) and (names := _names(node)) is not None:
            for buffer, value in names.buffers:
                entries[f"{name}.{buffer}" if name else buffer] = _Entry(None, False, value(node))
        elif isinstance(node, nnx.Param) and id(node) in stacked:  # one key per leading index
            pattern, transpose = stacked[id(node)]
            start = name.removesuffix(str(path[-1]))
            for index in range(node.shape[0]):
                entries[start + pattern.format(index)] = _Entry(node, transpose, None, None, index)
        elif isinstance(node, (nnx.Param, CheckedBuffer)) or (
            isinstance(node, nnx.Variable) and id(node) in scales
        ):
            torch_name, transpose = TORCH_VARIABLES.get(str(path[-1]), (str(path[-1]), False))
            key = name.removesuffix(str(path[-1])) + torch_name
            # a quantized weight is exported dequantized: the float weight it stands for
            entries[key] = _Entry(node, transpose, None, scales.get(id(node)))
    return entries


def _torch_shape(entry: _Entry) -> tuple[int, ...]:
    if entry.variable is None:
        return entry.expected.shape
    shape = tuple(entry.variable.shape)[0 if entry.index is None else 1 :]
    return shape[::-1] if entry.transpose else shape


class _Part(NamedTuple):
    """One documents key inside a layout key: its entry (``None``: a bias the layer does not
    have, exported as zeros and loaded only as zeros), its torch shape and its name."""

    entry: _Entry | None
    shape: tuple[int, ...]
    name: str


class _Target(NamedTuple):
    """One key of a layout: a buffer (``buffer`` set: checked, never loaded) or parameters
    (``parts``, concatenated along torch's first axis; ``transpose``: stored transposed)."""

    parts: tuple[_Part, ...] = ()
    transpose: bool = False
    buffer: Buffer | None = None
    expected: np.ndarray | None = None  # the buffer's value (None: any value of its shape)
    shape: tuple[int, ...] = ()  # the buffer's shape
    hint: str = ""
    alias: str = ""  # a tied parameter's second name: the key whose value this must repeat

    @property
    def layout_shape(self) -> tuple[int, ...]:
        if self.buffer is not None:
            return self.shape
        first = self.parts[0].shape
        shape = (sum(part.shape[0] for part in self.parts), *first[1:])
        return shape[::-1] if self.transpose else shape


def _names(module) -> Names | None:
    """``module``'s registered names (``flax_attention.layouts.register``), ``None`` if its
    class is not registered."""
    found = names_of(module)
    return None if found is None else found[1]


def _class_name(module: nnx.Module) -> str:
    """The name of the registered class ``module`` is (or derives from), as messages say it."""
    found = names_of(module)
    return (type(module) if found is None else found[0]).__name__


def _takes(module: nnx.Module) -> tuple[str, ...]:
    """The layouts ``module``'s registered class takes, in ``LAYOUTS``' order."""
    names = _names(module)
    return tuple(n for n in LAYOUTS if names is not None and n in names.layouts)


def _layout(module: nnx.Module, layout) -> Layout:
    check_choice("layout", layout, tuple(LAYOUTS))
    spec = LAYOUTS[layout]
    if names_of(module) is None:
        name = type(module).__name__
        raise TypeError(
            f"module ({type(module).__module__}.{name}) must be of a class the weight bridge "
            f"knows ({', '.join(layers_taking('documents'))}, or their subclasses): register "
            f"yours with flax_attention.layouts.register({name}, flax_attention.layouts.Names()) "
            "to name its weights by their paths"
        )
    if layout not in _takes(module):
        raise ValueError(
            f"layout ({layout!r}) must be one of the layouts {_class_name(module)} takes "
            f"{_takes(module)} (layout {layout!r} is for {', '.join(layers_taking(layout))})"
        )
    refusal = _layout_refusal(module, spec)
    if refusal:
        raise ValueError(refusal)
    return spec


def _layout_refusal(module: nnx.Module, spec: Layout) -> str:
    """Why ``module`` cannot take ``spec`` though its class does: the first registered
    ``Names.layout_refusal`` that says so (every registered class's, whatever ``module``'s
    class: such modules may be anywhere in its graph); ``""`` if none does, and always for the
    documents' own names."""
    if spec.name == "documents":
        return ""
    for _, names in registered():
        refusal = names.layout_refusal(module, spec) if names.layout_refusal else ""
        if refusal:
            return refusal
    return ""


def _load_hint(module: nnx.Module, missing, unexpected, state_dict) -> str:
    """The line that heads a failed strict load's error: the first registered
    ``Names.load_hint`` that gives one (every registered class's, whatever ``module``'s class:
    the offered state dict may be of modules this one lacks); ``""`` if none does."""
    for _, names in registered():
        hint = names.load_hint(module, missing, unexpected, state_dict) if names.load_hint else ""
        if hint:
            return hint
    return ""


def _buffer_target(buffer: Buffer, mask: np.ndarray) -> _Target:
    n = mask.shape[0]
    if buffer.kind == "triu":
        return _Target(buffer=buffer, expected=mask, shape=mask.shape)
    if buffer.kind == "tril":
        tril = np.tril(np.ones((n, n), bool)).reshape(1, 1, n, n)
        return _Target(buffer=buffer, expected=tril, shape=tril.shape)
    return _Target(buffer=buffer, shape=())  # "scalar": any finite value


def _buffer_rule(target: _Target) -> str:
    n = target.expected.shape[-1]
    if target.buffer.kind == "tril":
        return f"tril(ones({n}, {n})).view(1, 1, {n}, {n})"
    return f"triu(ones({n}, {n}), diagonal=1)"


def _targets(module: nnx.Module, spec: Layout, given=()) -> dict[str, _Target]:
    """Layout key -> ``_Target``, in the layout's order. ``given`` (the keys offered to a load)
    picks an alternative form (torch's separate ``q_proj_weight``, ...) when it holds one."""
    entries = _torch_entries(module)
    masks = {name: e.expected for name, e in entries.items() if e.variable is None}
    registered = _names(module)
    names = registered.model(module, spec.name) if registered.model is not None else None
    if spec.name == "documents":
        targets = {}
        for name, entry in entries.items():
            if entry.variable is None:
                targets[name] = _buffer_target(spec.buffers[0], entry.expected)
            else:
                targets[name] = _Target(parts=(_Part(entry, _torch_shape(entry), name),))
        for alias, of in names.aliases if names is not None else ():
            targets[alias] = targets[of]._replace(alias=of)
        for own, peer, _ in names.params if names is not None else ():  # the model's own names
            targets[peer] = targets.pop(own)
        return targets
    if names is not None:
        return _model_targets(module, spec, names, entries, given)

    roles = registered.roles

    def part(role: str) -> _Part:
        owner, param = role.split(".")
        name = f"{roles[owner]}.{param}"
        if name in entries:
            return _Part(entries[name], _torch_shape(entries[name]), name)
        rows = _torch_shape(entries[f"{roles[owner]}.weight"])[0]  # a bias the layer lacks
        return _Part(None, (rows,), name)

    q_weight = _torch_shape(entries[f"{roles['q']}.weight"])
    if spec.square and q_weight[0] != q_weight[1]:
        raise ValueError(
            f"d_in ({q_weight[1]}) must equal d_out ({q_weight[0]}) for layout {spec.name!r} "
            f"({spec.peer} projects the query with an (embed_dim, embed_dim) weight)"
        )
    keys: list[Key] = []
    alternatives = dict(spec.alternatives)
    for key in spec.keys:
        others = alternatives.get(key.name, ())
        keys += others if any(other.name in given for other in others) else [key]
    targets = {}
    for key in keys:
        parts = tuple(part(role) for role in key.parts)
        if key.always or any(p.entry is not None for p in parts):
            targets[key.name] = _Target(parts=parts, transpose=key.transpose, hint=key.hint)
    if masks:  # a causal layer: its buffers, from the one mask of context_length
        (mask,) = masks.values()
        for buffer in spec.buffers:
            targets[buffer.name] = _buffer_target(buffer, mask)
    return targets


def _submodule(module: nnx.Module, prefix: str) -> nnx.Module:
    """The submodule at the dotted ``prefix`` (``"trf_blocks.3.att."``)."""
    for part in prefix.strip(".").split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module


def _model_targets(module, spec: Layout, names: ModelNames, entries, given) -> dict[str, _Target]:
    """A whole model's targets in ``spec``: each attention layer's own layout under its prefix,
    the other parameters renamed (``names.params``), the tied aliases; all under the base
    prefix the offered keys use (the first one on export)."""
    base = next(
        (
            p
            for p in names.base_prefixes
            if any(k.startswith(p) and k not in names.unprefixed for k in given)
        ),
        names.base_prefixes[0],
    )

    def full(key: str) -> str:
        return key if key in names.unprefixed else base + key

    targets: dict[str, _Target] = {}
    covered = set()
    for own, peer in names.layers:
        start = full(peer)
        inner = {key[len(start) :] for key in given if key.startswith(start)}
        for name, target in _targets(_submodule(module, own), spec, inner).items():
            targets[start + name] = target
        covered |= {name for name in entries if name.startswith(own)}
    for own, peer, transposed in names.params:
        entry = entries[own]
        part = _Part(entry, _torch_shape(entry), own)
        targets[full(peer)] = _Target(parts=(part,), transpose=transposed)
        covered.add(own)
    for alias, of in names.aliases:
        targets[full(alias)] = targets[full(of)]._replace(alias=full(of))
    left = [name for name, entry in entries.items() if entry.variable is not None]
    if any(name not in covered for name in left):  # the model's names and its graph disagree
        raise RuntimeError(
            f"the registered names of {_class_name(module)} in layout {spec.name!r} "
            f"(flax_attention.layouts.register) leave out "
            f"{[name for name in left if name not in covered]}"
        )
    return targets


def _export(target: _Target, dtype, hosted: dict) -> np.ndarray:
    if target.buffer is not None:
        return target.expected
    pieces = []
    for part in target.parts:
        if part.entry is None:
            pieces.append(np.zeros(part.shape, dtype))
        else:
            value = hosted[id(part.entry.variable)]
            value = value if part.entry.index is None else value[part.entry.index]
            pieces.append(value.T if part.entry.transpose else value)
    value = np.concatenate(pieces, axis=0) if len(pieces) > 1 else pieces[0]
    return value.T if target.transpose else value


def _check_prefix(prefix) -> None:
    if not isinstance(prefix, str):
        raise TypeError(f"prefix ({prefix!r}) must be a str (the keys' common start, or '')")


def state_dict(
    module: nnx.Module, *, layout: str = "documents", prefix: str = ""
) -> dict[str, np.ndarray]:
    """The torch ``state_dict`` of ``module`` in ``layout``'s names and shapes, each key
    preceded by ``prefix``. ``"documents"``: buffers included, so
    ``torch_module.load_state_dict({k: torch.from_numpy(v) ...}, strict=True)`` accepts it; the
    other layouts load into their peer the same way (see ``flax_attention.layouts``). On a
    mesh spread over processes every process must call it (the values are gathered) and gets
    the whole dict.
    """
    spec = _layout(module, layout)
    _check_prefix(prefix)
    targets = _targets(module, spec)
    params = [t.parts[0].entry for t in targets.values() if t.buffer is None and t.parts[0].entry]
    dtype = params[0].variable.dtype if params else np.float32
    if not jnp.issubdtype(dtype, jnp.floating):  # an int8 weight first: its floats
        dtype = np.float32
    variables = {
        id(part.entry.variable): part.entry.variable
        for target in targets.values()
        for part in target.parts
        if part.entry is not None
    }
    # On a mesh spread over processes every process gathers every value (one collective).
    hosted = dict(zip(variables, fetch(v[...] for v in variables.values()), strict=True))
    scaled = {  # int8 weights (a tied one is two targets' part): times their scales
        id(part.entry.variable): part.entry
        for target in targets.values()
        for part in target.parts
        if part.entry is not None and part.entry.scale is not None
    }
    for key, entry in scaled.items():
        scale = np.asarray(fetch([entry.scale[...]])[0], np.float32)  # per output feature
        value = hosted[key].astype(np.float32)
        hosted[key] = value * (scale if entry.transpose else scale[:, None])
    out = {}
    for name, target in targets.items():
        if target.buffer is not None and not target.buffer.export:
            continue
        # a writable copy, torch.from_numpy-safe
        out[prefix + name] = np.array(_export(target, dtype, hosted), order="C")
    return out


def _describe(value) -> str:
    return f"shape {tuple(value.shape)} dtype {value.dtype}"


def _is_floating(dtype) -> bool:
    """float16, bfloat16 (an ``ml_dtypes`` type NumPy calls kind ``'V'``), float32, float64."""
    return jnp.issubdtype(dtype, jnp.floating)


def _check_value(name, target: _Target, value: np.ndarray) -> str | None:
    """What is wrong with ``value`` for ``target`` (one line naming the key), or ``None``."""
    expected_shape = target.layout_shape
    if target.buffer is not None:  # compared by value, so bool and ints will do
        if not (_is_floating(value.dtype) or value.dtype.kind in "biu"):
            return f"{name}: dtype {value.dtype} must be a real number or bool dtype"
    elif not _is_floating(value.dtype):
        return (
            f"{name}: dtype {value.dtype} must be a floating dtype "
            f"(float16, bfloat16, float32 or float64)"
        )
    if value.shape != expected_shape:
        hint = f" ({target.hint})" if target.hint else ""
        return f"{name}: shape {value.shape} must be {expected_shape}{hint}"
    if not np.all(np.isfinite(value.astype(np.float32) if value.dtype.kind in "biu" else value)):
        return f"{name}: holds NaN or inf ({_describe(value)})"
    if target.expected is not None and not np.array_equal(value, target.expected):
        return f"{name}: differs from {_buffer_rule(target)}, the causal mask of context_length"
    variable = target.parts[0].entry.variable if len(target.parts) == 1 else None
    if isinstance(variable, CheckedBuffer) and variable.get_metadata()["check"](value):
        return f"{name}: {variable.get_metadata()['check'](value)}"
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


class _Piece:
    """One parameter's value inside a layout key's array, read only where it is sliced: the
    variable's ``index`` maps back to the stored array (``source``, NumPy or a ``FileTensor``)
    through the layout key's transpose, the part's rows and the part's own transpose, and the
    slice read is cast to the variable's dtype. ``flax_attention.mesh.place`` slices it once
    per device slice this process holds, so a process of a mesh spread over several reads (a
    file's tensor: from disk) and keeps only its own devices' slices."""

    def __init__(self, source, rows: slice, transpose_key: bool, transpose_part: bool, variable,
                 index: int | None = None):  # fmt: skip
        self.source, self.rows, self.index = source, rows, index
        self.transpose_key, self.transpose_part = transpose_key, transpose_part
        self.shape = tuple(variable.shape)[0 if index is None else 1 :]
        self.dtype = np.dtype(variable.dtype)

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (len(self.shape) - len(index))
        if self.transpose_part:
            index = index[::-1]
        if index:  # the part's rows of the (transposed) key
            start, stop, step = index[0].indices(self.rows.stop - self.rows.start)
            index = (slice(self.rows.start + start, self.rows.start + stop, step), *index[1:])
        if self.transpose_key:
            index = index[::-1]
        value = np.asarray(self.source[index])
        value = value.T if self.transpose_key else value
        value = value.T if self.transpose_part else value
        return value.astype(self.dtype)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        value = self[(slice(None),) * len(self.shape)]
        return value if dtype is None else value.astype(dtype)


def _cut_fused(name, target: _Target, value: np.ndarray, updates: list, source=None) -> str | None:
    """Cut a layout key's ``value`` into its parts (a fused key such as GPT-2's ``c_attn``: q,
    k, v stacked) and append ``(variable, _Piece)`` for each part to ``updates`` (read from
    ``source`` when placed, ``value`` itself if ``None``); or return the first problem (a part
    that overflows, nonzero where the layer has no such bias) and append nothing, so a key
    loads whole or not at all."""
    source = value if source is None else source
    value = value.T if target.transpose else value
    start = 0
    pending = []
    for part in target.parts:
        piece = value[start : start + part.shape[0]]
        if part.entry is None:
            if np.any(piece != 0):
                return (
                    f"{name}[{start}:{start + part.shape[0]}]: must be zeros, as the layer has "
                    f"no {part.name} (qkv_bias=False)"
                )
        else:
            _, problem = _cast(
                name, piece.T if part.entry.transpose else piece, part.entry.variable
            )
            if problem is not None:
                return problem
            rows = slice(start, start + part.shape[0])
            variable, index = part.entry.variable, part.entry.index
            lazy = _Piece(source, rows, target.transpose, part.entry.transpose, variable, index)
            pending.append((variable, lazy))
        start += part.shape[0]
    updates += pending
    return None


class _Stacked:
    """A stacked variable's new value (``Names.stacked``) from the pieces of its slices, read
    only where it is sliced, as ``_Piece``; a slice no piece gives (a non-strict load) keeps
    the variable's current value."""

    def __init__(self, variable: nnx.Variable, pieces: dict[int, _Piece]):
        self.variable, self.pieces = variable, pieces
        self.shape, self.dtype = tuple(variable.shape), np.dtype(variable.dtype)

    def _slice(self, index: int, rest: tuple) -> np.ndarray:
        if index in self.pieces:
            return self.pieces[index][rest]
        return np.asarray(self.variable.get_value()[index])[rest].astype(self.dtype)

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (len(self.shape) - len(index))
        rows = range(self.shape[0])[index[0]]
        return np.stack([self._slice(i, index[1:]) for i in rows])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        value = self[(slice(None),) * len(self.shape)]
        return value if dtype is None else value.astype(dtype)


def _stack_updates(updates: list) -> list:
    """``updates`` with the slices of each stacked variable gathered into one ``_Stacked``."""
    out, stacks = [], {}
    for variable, piece in updates:
        if piece.index is None:
            out.append((variable, piece))
        elif id(variable) in stacks:
            stacks[id(variable)][1].pieces[piece.index] = piece
        else:
            stacks[id(variable)] = (variable, _Stacked(variable, {piece.index: piece}))
            out.append(stacks[id(variable)])
    return out


def _check_alias(name, of, value: np.ndarray, repeated) -> str | None:
    """A tied parameter's second name must repeat the first (``repeated``; ``None`` if absent,
    then the first is reported missing)."""
    if repeated is None:
        return None
    try:
        same = np.array_equal(value, np.asarray(repeated))
    except Exception:  # noqa: BLE001 - the first name's own check reports it
        return None
    if same:
        return None
    return f"{name}: differs from {of} (the head is tied to the token embedding: one matrix)"


def _placement(variable: nnx.Variable):
    """Where ``_assign`` puts ``variable``'s new value: its current sharding (an abstract mesh's,
    from ``nnx.eval_shape`` under ``jax.set_mesh``, on the mesh set now), or ``None`` for this
    process's default device, uncommitted (``variable[...] = value`` compiles an XLA scatter per
    shape and fails on an abstract module. A loaded parameter committed next to uncommitted
    state, a fresh optimiser's moments, gave a jitted training step other argument placements on
    its first call than on the next ones, all committed, and so two compilations.)

    Raises ``ValueError`` for an abstract mesh that the mesh set now (none, or another) is not."""
    current = variable.get_value()
    sharding = getattr(current, "sharding", None)
    if sharding is None or (isinstance(current, jax.Array) and not current.committed):
        return None
    mesh = getattr(sharding, "mesh", None)
    if isinstance(mesh, jax.sharding.AbstractMesh):
        concrete = jax.sharding.get_mesh()
        if concrete.empty or concrete.abstract_mesh != mesh:
            now = "none" if concrete.empty else concrete.abstract_mesh
            raise ValueError(
                f"module's parameters (laid out by nnx.eval_shape under jax.set_mesh on {mesh}) "
                f"must be loaded under that mesh (set now: {now}): load inside "
                "`with jax.set_mesh(mesh):`, or place the module with "
                "flax_attention.shard(module, mesh) first"
            )
        # The same axes and sizes as when nnx.eval_shape laid it out, which JAX refuses for a
        # size that does not divide: every shape fits.
        sharding = jax.sharding.NamedSharding(concrete, sharding.spec)
    return sharding


def _assign(variable: nnx.Variable, value, sharding) -> None:
    """Replace the variable's value whole, where ``_placement`` said (``place``: each process of
    a mesh spread over several reads only its own devices' slices of ``value``). An abstract
    variable (``jax.ShapeDtypeStruct``, the usual skeleton to load a checkpoint into, made by
    ``nnx.eval_shape``) goes where its ``sharding`` says (``flax_attention.shard`` of the
    skeleton), else on this process's default device."""
    if sharding is None:
        variable.set_value(jnp.asarray(np.asarray(value)))
    else:
        variable.set_value(place(value, sharding))


def load_state_dict(
    module: nnx.Module,
    state_dict,
    strict: bool = True,
    *,
    layout: str = "documents",
    prefix: str = "",
) -> IncompatibleKeys:
    """Load ``layout``'s names and shapes (numpy, jax or CPU torch arrays) into ``module``.

    Only the keys that start with ``prefix`` are read (``"transformer.h.3.attn."`` picks one
    layer out of a model's state dict); the rest of ``state_dict`` is ignored, and strictness
    applies to the keys under ``prefix``. Every value is checked before anything is written:
    with ``strict=True`` any missing, unexpected, mis-shaped, non-floating (integer, bool, ...)
    or non-finite key, a value that overflows the parameter's dtype, and a causal buffer
    (``mask``, GPT-2's ``bias``) that differs from the one ``context_length`` implies, raises one
    ``ValueError`` naming every offending key, and ``module`` is left exactly as it was. Buffers
    are never required. With ``strict=False`` the good keys are loaded and the rest are
    returned in an ``IncompatibleKeys`` (full key names, ``prefix`` included).
    """
    if not hasattr(state_dict, "keys"):
        raise TypeError(
            f"state_dict ({type(state_dict).__name__}) must be a mapping (str -> array)"
        )
    spec = _layout(module, layout)
    _check_prefix(prefix)
    if any(entry.scale is not None for entry in _torch_entries(module).values()):
        raise TypeError(
            f"module ({type(module).__name__}) holds int8 weights (flax_attention.models."
            "quantize): load_state_dict into the float model, then quantize it"
        )
    given = {  # layout key -> the key as offered, prefix included
        key[len(prefix) :]: key
        for key in state_dict.keys()
        if isinstance(key, str) and key.startswith(prefix)
    }
    targets = _targets(module, spec, given)
    values = _offered_values(spec, targets, state_dict, given)
    missing = [
        prefix + name
        for name, t in targets.items()
        if name not in values and t.buffer is None and not t.alias
    ]
    unexpected = [full for name, full in given.items() if name not in targets]
    if not prefix:  # a key that is not a string cannot be any layer's
        unexpected += [key for key in state_dict.keys() if not isinstance(key, str)]
    mismatched, problems, updates = _check_values(targets, values, prefix)
    if strict and (missing or unexpected or mismatched):
        hint = _load_hint(module, missing, unexpected, state_dict)
        if unexpected and not hint:
            hint = _other_layout(module, spec, targets, given)
        raise _strict_error(module, spec, prefix, missing, unexpected, problems, hint)
    updates = _stack_updates(updates)
    placements = [_placement(variable) for variable, _ in updates]
    for (variable, value), sharding in zip(updates, placements, strict=True):
        _assign(variable, value, sharding)  # all checked: written only now
    return IncompatibleKeys(missing, unexpected, mismatched)


def _offered_values(spec: Layout, targets: dict[str, _Target], state_dict, given: dict) -> dict:
    """Layout key -> the value offered for it (``given`` maps it to its key in
    ``state_dict``); a bias-free peer's absent biases as the zeros they stand for."""
    values = {name: state_dict[full] for name, full in given.items()}
    if (
        spec.bias_free_when in given
        and spec.bias_free
        and not any(name in given for name in spec.bias_free)
    ):  # a bias-free peer (torch.nn.MultiheadAttention(bias=False)): its biases are zeros
        for name in spec.bias_free:
            values[name] = np.zeros(targets[name].layout_shape, np.float32)
    return values


def _check_values(
    targets: dict[str, _Target], values: dict, prefix: str
) -> tuple[list[str], list[str], list[tuple[nnx.Variable, _Piece]]]:
    """Check every offered value against its target, writing nothing: the mismatched keys
    (full names), one problem line for each, and ``(variable, _Piece)`` for every parameter
    of the keys that passed."""
    mismatched: list[str] = []
    problems: list[str] = []
    updates: list[tuple[nnx.Variable, _Piece]] = []
    for name, target in targets.items():
        if name not in values:
            continue
        full = prefix + name
        try:
            value = np.asarray(values[name])
        except Exception as error:  # noqa: BLE001 - any array-like failure names the key
            mismatched.append(full)
            problems.append(f"{full}: cannot be read as an array ({error})")
            continue
        problem = _check_value(full, target, value)
        if problem is None and target.alias:
            problem = _check_alias(full, prefix + target.alias, value, values.get(target.alias))
        elif problem is None and target.buffer is None:
            # A file's tensor is read again, by slices, when placed; held values are kept.
            source = values[name] if isinstance(values[name], FileTensor) else None
            problem = _cut_fused(full, target, value, updates, source)
        if problem is not None:
            mismatched.append(full)
            problems.append(problem)
    return mismatched, problems, updates


def _other_layout(module, spec: Layout, targets: dict[str, _Target], given: dict) -> str:
    """The line that names the layout the offered keys are written in, when another layout
    the module takes knows more of them than ``spec`` does (Hugging Face's GPT-2 names offered
    to the default layout, the book's names with ``layout="gpt2"``); else ``""``."""
    known = sum(name in targets for name in given)
    best, best_known = None, known
    for other in LAYOUTS.values():
        if other.name == spec.name or other.name not in _takes(module):
            continue
        if _layout_refusal(module, other):  # refused for this module (a Names.layout_refusal)
            continue
        try:
            fits = sum(name in _targets(module, other, given) for name in given)
        except ValueError:  # a layout this layer's shapes cannot take (torch_nn, d_in != d_out)
            continue
        if fits > best_known:
            best, best_known = other, fits
    if best is None:
        return ""
    return (
        f"layout ({spec.name!r}) must be {best.name!r} for these keys: {best_known} of the "
        f"{len(given)} are that layout's names ({best.peer}), {known} are {spec.name!r} names; "
        f"pass layout={best.name!r}"
    )


def _strict_error(
    module, spec: Layout, prefix: str, missing, unexpected, problems, hint: str = ""
) -> ValueError:
    """The one error of a strict load that found problems: a line per offending key, after
    the line that names a better layout (``hint``) if there is one."""
    refused = dict(spec.refused)  # a peer's key no layer here takes -> why
    lines = [f"missing key {name}" for name in missing]
    for key in unexpected:
        if not isinstance(key, str):
            lines.append(f"unexpected key {key!r}")
            continue
        name = key[len(prefix) :]
        lines.append(f"unexpected key {key}" + (f" ({refused[name]})" if name in refused else ""))
    lines += problems
    shown = [hint, *lines] if hint else lines
    return ValueError(
        f"load_state_dict into {type(module).__name__} (strict=True) found "
        f"{len(lines)} problem(s); nothing was loaded:\n  " + "\n  ".join(shown)
    )


def save_file(
    module: nnx.Module, path: str | os.PathLike, *, layout: str = "documents", prefix: str = ""
) -> None:
    """Write ``state_dict(module, layout=layout, prefix=prefix)`` to a safetensors file that
    torch loads as its ``state_dict``."""
    write_safetensors(state_dict(module, layout=layout, prefix=prefix), path)


def write_safetensors(
    tensors: dict[str, np.ndarray], path: str | os.PathLike, metadata: dict[str, str] | None = None
) -> None:
    """Write ``tensors`` (NumPy arrays by name, as ``state_dict`` gives them) to the safetensors
    file ``path``, with ``metadata`` in its header when given (a Hugging Face checkpoint's
    ``{"format": "pt"}``); the package's one writer, as ``open_safetensors`` is its one
    reader."""
    from safetensors.numpy import save_file as _save

    _save(tensors, os.fspath(path), metadata=metadata)


class FileTensor:
    """A tensor of an open safetensors file, read when asked: whole by ``np.asarray`` (the
    checks), by slices when placed (``_Piece``). A dtype NumPy cannot represent (float8, say)
    raises on reading, so ``load_state_dict`` names the key (strict) or lists it as mismatched
    (``strict=False``)."""

    def __init__(self, handle, key: str):
        self._handle, self._key = handle, key

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        try:
            value = self._handle.get_tensor(self._key)
        except (AttributeError, TypeError, ValueError) as error:  # a dtype NumPy lacks
            found = self._handle.get_slice(self._key).get_dtype()
            raise TypeError(f"safetensors dtype {found}: {error}") from error
        return value if dtype is None else value.astype(dtype)

    def __getitem__(self, index) -> np.ndarray:
        return self._handle.get_slice(self._key)[index]


@contextlib.contextmanager
def open_safetensors(paths, prefix: str = "") -> Iterator[dict[str, FileTensor]]:
    """The tensors of the safetensors files ``paths`` (one file, or a checkpoint's shards) whose
    keys start with ``prefix``, as ``FileTensor`` s read only when asked (nothing is read here
    but the headers; nothing is unpickled); the files stay open inside the ``with`` block. A
    file that cannot be opened (missing, a header that is not JSON or claims more data than the
    file holds) raises ``safetensors.SafetensorError`` or ``OSError``, every file opened so far
    closed again."""
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        tensors = {}
        for path in paths:
            handle = stack.enter_context(safe_open(os.fspath(path), framework="numpy"))
            for key in handle.keys():  # noqa: SIM118 - a safe_open handle is not a mapping
                if key.startswith(prefix):  # another layer's keys are not even read
                    tensors[key] = FileTensor(handle, key)
        yield tensors


def load_file(
    module: nnx.Module,
    path: str | os.PathLike,
    strict: bool = True,
    *,
    layout: str = "documents",
    prefix: str = "",
):
    """Read a safetensors file of ``layout``'s names into ``module`` (see ``load_state_dict``;
    ``prefix`` picks one layer of a whole model's file). Only safetensors is read (nothing is
    unpickled). A file that cannot be read (missing, truncated, a header that is not JSON or
    claims more data than the file holds) and a strict load that finds bad keys raise
    ``ValueError`` naming the file (and the keys); ``module`` is then untouched.

    Tensors are read one at a time to be checked, then, once all pass, again by the slices that
    this process's devices hold (``get_slice``): loading into a module placed on a mesh spread
    over processes holds only each process's own slices."""
    check_bool("strict", strict, why="False: load what matches, report the rest")
    from safetensors import SafetensorError

    spec = _layout(module, layout)  # a bad layout or prefix before the file is read
    _check_prefix(prefix)
    name = os.fspath(path)
    with contextlib.ExitStack() as stack:
        try:
            tensors = stack.enter_context(open_safetensors([name], prefix))
        except (SafetensorError, OSError, ValueError) as error:
            message = f"path ({name!r}) must be a readable safetensors file: {error}"
            raise ValueError(message) from error
        try:
            return load_state_dict(module, tensors, strict=strict, layout=spec.name, prefix=prefix)
        except ValueError as error:
            raise ValueError(f"load_file({name!r}): {error}") from error
