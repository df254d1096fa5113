"""The mesh-axis vocabulary: which tensor dimension goes over which device-mesh axis.

The bottom of the package's sharding: the layers, the decode cache and ``flax_attention.shard``
import from here, and this module imports nothing from the package but its argument checks.

Two mesh axes, by name:

- ``data`` (``DATA``): the batch. Inputs are split over it, parameters replicated.
- ``model`` (``MODEL``): the heads. Query/key/value projections split their output features over
  it (``TO_HEADS``), ``out_proj`` its input features (``FROM_HEADS``); queries, keys and values
  ``(b, t, h, d)`` split their heads (``HEADS``), decode caches ``(b, h, max_length, d)`` theirs
  (``CACHE_HEADS``), single-head layers their features (``ONE_HEAD``, both layouts).

A layer declares which of its sizes it splits over ``model`` by a ``model_axis_sizes()`` method
(``SplitsOverModel``); ``flax_attention.shard`` checks those sizes and knows nothing else about
the layers.

Both kinds of mesh axes that ``jax.make_mesh`` makes are supported. ``Auto`` axes
(``axis_types=(AxisType.Auto,) * 2``): ``constrain`` places activations with
``with_sharding_constraint`` and XLA propagates the rest. ``Explicit`` axes (the default of
``jax.make_mesh`` in jax 0.10, sharding in the types): ``constrain`` does nothing (the types
already say where each array lives); what JAX cannot infer is chosen in three places: the
row-parallel products' result (``_init.rows_dot_general``) and embedding lookups (``_init.Embed``),
a relayout where two layouts meet (``features_whole``, ``laid_out_like``), and the attention
core, which runs its kernels under ``jax.sharding.auto_axes`` (``explicit_mesh``). Each of these
returns at its first line when no mesh is set.

Putting values on devices and bringing them back (``place``, ``fetch``, a variable's partition
spec) is ``flax_attention.placement``, the module above this one.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import jax
import numpy as np
from jax.sharding import AxisType, PartitionSpec

from flax_attention._checks import check_choice, check_instance, check_int

__all__ = [
    "DATA",
    "MODEL",
    "HEADS",
    "CACHE_HEADS",
    "ONE_HEAD",
    "LinearAxes",
    "TO_HEADS",
    "FROM_HEADS",
    "SplitsOverModel",
    "constrain",
    "expand_axes",
    "mesh_axis_size",
]

DATA = "data"
MODEL = "model"


class _LinearAxes(NamedTuple):
    kernel: tuple
    bias: tuple


class LinearAxes(_LinearAxes):
    """Mesh axes of an ``nnx.Linear``'s kernel ``(d_in, d_out)`` and bias ``(d_out,)``: a tuple
    of two entries and a tuple of one, each ``None``, a mesh axis's name or a tuple of them."""

    __slots__ = ()

    def __new__(cls, kernel: tuple, bias: tuple):
        for name, value, size in (("kernel", kernel, 2), ("bias", bias, 1)):
            check_instance(
                name, value, tuple, f"a tuple of {size} mesh axes (e.g. (None, 'model'))"
            )
            if len(value) != size:
                raise ValueError(f"{name} ({value!r}) must name {size} mesh axes (or None)")
        return super().__new__(cls, kernel, bias)


#: Projections into heads (``W_query``, ``W_key``, ``W_value``): output features over ``model``.
TO_HEADS = LinearAxes(kernel=(None, MODEL), bias=(MODEL,))
#: Projections out of heads (``out_proj``): input features over ``model``, bias replicated.
FROM_HEADS = LinearAxes(kernel=(MODEL, None), bias=(None,))
#: Activations ``(b, t, h, d)`` (any number of batch axes, ``data`` on the first one): each head
#: on its device.
HEADS = (DATA, ..., None, MODEL, None)
#: Decode caches, stored heads first ``(b, h, max_length, d)``: each head on its device.
CACHE_HEADS = (DATA, ..., MODEL, None, None)
#: The same for single-head layers, ``(b, t, 1, d_out)`` and their caches
#: ``(b, 1, max_length, d_out)``: features over ``model``, as their projections' output features.
ONE_HEAD = (DATA, ..., None, None, MODEL)


@runtime_checkable
class SplitsOverModel(Protocol):
    """A layer that splits some of its sizes over the ``model`` axis.

    ``model_axis_sizes()`` returns them by name, e.g. ``{"num_heads": 8}`` for a multi-head
    layer or ``{"d_out": 64}`` for a single-head one; ``flax_attention.shard`` refuses a mesh
    whose ``model`` axis does not divide each of them, naming it.
    """

    def model_axis_sizes(self) -> dict[str, int]: ...


def mesh_axis_size(mesh, name: str) -> int:
    """Size of axis ``name`` (``DATA`` or ``MODEL``) of ``mesh`` (a ``Mesh`` or
    ``AbstractMesh``); 1 when absent."""
    check_choice("name", name, (DATA, MODEL))
    return int(dict(mesh.shape).get(name, 1))


def _check_axes(axes, ndim: int) -> tuple:
    """``axes`` as a tuple naming every one of ``ndim`` dimensions (or holding ``...``)."""
    check_instance("axes", axes, (tuple, list), "a tuple of mesh axes, one per dimension, or ...")
    axes = tuple(axes)
    if ... not in axes and len(axes) < ndim:
        raise ValueError(
            f"axes ({axes!r}) must name each of the {ndim} dimensions (or hold ... for the rest)"
        )
    return axes


def expand_axes(axes, ndim: int) -> tuple:
    """``axes`` for ``ndim`` dimensions: ``...`` becomes as many ``None`` as needed; a tensor with
    fewer dimensions than ``axes`` names (an unbatched input) drops the leftmost names."""
    check_int("ndim", ndim, 1)
    axes = _check_axes(axes, ndim)
    if ... in axes:
        i = axes.index(...)
        head, tail = axes[:i], axes[i + 1 :]
        fill = max(0, ndim - len(head) - len(tail))
        axes = head + (None,) * fill + tail
    return axes[max(0, len(axes) - ndim) :]


# The partition-spec vocabulary, once: an entry of a ``PartitionSpec`` is ``None``, one mesh
# axis name, or a tuple of them (one dimension over several axes).


def axis_names(entry) -> tuple[str, ...]:
    """The mesh axis names of one partition-spec entry: ``None`` -> ``()``, ``"model"`` ->
    ``("model",)``, a tuple as it is."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entry(names) -> str | tuple[str, ...] | None:
    """The partition-spec entry for ``names`` (the inverse of ``axis_names``)."""
    names = tuple(names)
    return names[0] if len(names) == 1 else (names or None)


def axis_types(mesh) -> dict[str, AxisType]:
    """Each axis of ``mesh`` (a ``Mesh`` or ``AbstractMesh``) by name: ``Auto``, ``Explicit`` or
    ``Manual``."""
    return dict(zip(mesh.axis_names, mesh.axis_types, strict=True))


def spec_of(x) -> tuple:
    """``x``'s partition spec in its type (``Explicit`` axes only), one entry per dimension."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return spec + (None,) * (np.ndim(x) - len(spec))


def explicit_mesh():
    """The mesh set by ``jax.set_mesh`` if its ``data`` or ``model`` axis is ``Explicit``
    (sharding in types), else ``None`` (no mesh, or ``Auto`` axes: nothing to do by hand)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    types = axis_types(mesh)
    if any(types.get(name) == AxisType.Explicit for name in (DATA, MODEL)):
        return mesh
    return None


def features_whole(x: jax.Array) -> jax.Array:
    """Under an ``Explicit`` mesh, ``x`` resharded with its last dimension replicated (before
    concatenating heads whose features are split over ``model``: a concatenation along a split
    dimension has no one layout); ``x`` unchanged otherwise."""
    if explicit_mesh() is None:
        return x
    return jax.sharding.reshard(x, PartitionSpec(*spec_of(x)[:-1], None))


def laid_out_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """Under an ``Explicit`` mesh, ``x`` resharded to ``like``'s layout (new tokens written into
    a decode cache); ``x`` unchanged otherwise."""
    if explicit_mesh() is None:
        return x
    return jax.sharding.reshard(x, jax.typeof(like).sharding.spec)


def lookup_sharding(ids):
    """Under an ``Explicit`` mesh, the ``out_sharding`` of an embedding lookup ``table[ids]``
    ``(*ids.shape, d)``: laid out like ``ids``, features whole (``jnp.take`` cannot tell on its
    own when ``ids`` is split over ``data``); ``None`` otherwise."""
    if explicit_mesh() is None:
        return None
    return PartitionSpec(*spec_of(ids), None)


def constrain(x: jax.Array, axes) -> jax.Array:
    """``jax.lax.with_sharding_constraint(x, P(*axes))`` on the mesh set by ``jax.set_mesh``.

    ``axes`` names a mesh axis (or ``None``) per dimension of ``x``; ``...`` stands for any
    number of unconstrained dimensions (``HEADS`` = ``("data", ..., None, "model", None)``). Names
    the mesh does not have, axes that are not ``Auto`` (explicit axes carry their sharding in the
    type; manual ones, inside ``shard_map``, are already per device) and axes that do not divide
    their dimension are left unconstrained: this is a layout hint, never a change of numbers.
    Without a mesh (``jax.sharding.get_abstract_mesh()`` empty) it returns ``x`` unchanged.
    """
    _check_axes(axes, x.ndim)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    types = axis_types(mesh)
    spec = []
    for size, entry in zip(x.shape, expand_axes(axes, x.ndim), strict=True):
        names = tuple(n for n in axis_names(entry) if types.get(n) == AxisType.Auto)
        if names and size % int(np.prod([mesh_axis_size(mesh, n) for n in names])) != 0:
            names = ()
        spec.append(spec_entry(names))
    if all(entry is None for entry in spec):
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))
