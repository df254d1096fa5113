"""The mesh-axis vocabulary: which tensor dimension goes over which device-mesh axis.

The bottom of the package's sharding: the layers, the decode cache and ``flax_attention.shard``
import from here, and this module imports nothing from the package.

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
already say where each array lives) and the few contractions over a sharded ``model`` dimension
name their result's sharding (``out_sharding_like``); the attention core runs its kernels under
``jax.sharding.auto_axes`` (``explicit_mesh``).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

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
    "check_variable",
    "constrain",
    "expand_axes",
    "explicit_mesh",
    "mesh_axis_size",
    "out_sharding_like",
    "parameters_mesh",
    "partition_spec",
    "place_like_parameters",
]

DATA = "data"
MODEL = "model"


class LinearAxes(NamedTuple):
    """Mesh axes of an ``nnx.Linear``'s kernel ``(d_in, d_out)`` and bias ``(d_out,)``."""

    kernel: tuple
    bias: tuple


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
    """Size of axis ``name`` of ``mesh`` (a ``Mesh`` or ``AbstractMesh``); 1 when absent."""
    return int(dict(mesh.shape).get(name, 1))


def expand_axes(axes, ndim: int) -> tuple:
    """``axes`` for ``ndim`` dimensions: ``...`` becomes as many ``None`` as needed; a tensor with
    fewer dimensions than ``axes`` names (an unbatched input) drops the leftmost names."""
    axes = tuple(axes)
    if ... in axes:
        i = axes.index(...)
        head, tail = axes[:i], axes[i + 1 :]
        fill = max(0, ndim - len(head) - len(tail))
        axes = head + (None,) * fill + tail
    return axes[max(0, len(axes) - ndim) :]


def _names(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def explicit_mesh():
    """The mesh set by ``jax.set_mesh`` if its ``data`` or ``model`` axis is ``Explicit``
    (sharding in types), else ``None`` (no mesh, or ``Auto`` axes: nothing to do by hand)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    if any(types.get(name) == AxisType.Explicit for name in (DATA, MODEL)):
        return mesh
    return None


def out_sharding_like(x, last=None):
    """Under an ``Explicit`` mesh, ``x``'s sharding with its last dimension over ``last``
    (``None``: replicated), for the ``out_sharding`` of a contraction whose result is laid out
    like its input (``out_proj``: ``(b, t, d_out)`` like ``x``); ``None`` otherwise."""
    if explicit_mesh() is None:
        return None
    spec = tuple(jax.typeof(x).sharding.spec)
    spec = spec + (None,) * (np.ndim(x) - len(spec))
    return PartitionSpec(*spec[:-1], last)


def constrain(x: jax.Array, axes) -> jax.Array:
    """``jax.lax.with_sharding_constraint(x, P(*axes))`` on the mesh set by ``jax.set_mesh``.

    ``axes`` names a mesh axis (or ``None``) per dimension of ``x``; ``...`` stands for any
    number of unconstrained dimensions (``HEADS`` = ``("data", ..., None, "model", None)``). Names
    the mesh does not have, axes that are not ``Auto`` (explicit axes carry their sharding in the
    type; manual ones, inside ``shard_map``, are already per device) and axes that do not divide
    their dimension are left unconstrained: this is a layout hint, never a change of numbers.
    Without a mesh (``jax.sharding.get_abstract_mesh()`` empty) it returns ``x`` unchanged.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    spec = []
    for size, entry in zip(x.shape, expand_axes(axes, x.ndim), strict=True):
        names = tuple(n for n in _names(entry) if types.get(n) == AxisType.Auto)
        if names and size % int(np.prod([mesh_axis_size(mesh, n) for n in names])) != 0:
            names = ()
        spec.append(names[0] if len(names) == 1 else (names or None))
    if all(entry is None for entry in spec):
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))


def _axes_of(variable: nnx.Variable):
    """The variable's partition metadata (``out_sharding``), or ``None`` (replicated)."""
    metadata = variable.get_metadata()
    return metadata.get("out_sharding") or None


def partition_spec(variable: nnx.Variable, mesh) -> PartitionSpec:
    """Where ``variable`` goes on ``mesh``: its metadata, with axes that ``mesh`` does not have
    (size 1) dropped; ``P()`` (replicated) without metadata."""
    axes = _axes_of(variable)
    if axes is None:
        return PartitionSpec()
    spec = []
    for entry in axes:
        names = tuple(n for n in _names(entry) if n in mesh.axis_names)
        spec.append(names[0] if len(names) == 1 else (names or None))
    return PartitionSpec(*spec)


def check_variable(variable: nnx.Variable, mesh, name: str) -> None:
    """Each dimension named by ``variable``'s metadata divides over its mesh axes."""
    if _axes_of(variable) is None:
        return
    shape = np.shape(variable.get_value())
    spec = partition_spec(variable, mesh)
    if len(spec) != len(shape):
        raise ValueError(
            f"{name} partition axes ({_axes_of(variable)}) must name one mesh axis or None per "
            f"dimension (shape {shape})"
        )
    for dim, (size, entry) in enumerate(zip(shape, spec, strict=True)):
        for axis in _names(entry):
            if size % mesh_axis_size(mesh, axis) != 0:
                raise ValueError(
                    f"{name}.shape[{dim}] ({size}) must be divisible by the mesh's {axis} axis "
                    f"({mesh_axis_size(mesh, axis)})"
                )


def parameters_mesh(module: nnx.Module):
    """The mesh ``module``'s parameters are placed on (``flax_attention.shard``), or ``None``
    (not sharded, or traced)."""
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Param):
            value = node.get_value()
            sharding = getattr(value, "sharding", None)
            if isinstance(sharding, NamedSharding) and not isinstance(value, jax.core.Tracer):
                return sharding.mesh
    return None


def place_like_parameters(module: nnx.Module, variables: dict[str, nnx.Variable]) -> None:
    """Put ``variables`` (new state by name, e.g. the decode cache ``init_cache`` makes) on the
    mesh ``module``'s parameters are on, as their metadata says; nothing if the parameters are
    not on a mesh (not sharded, or traced). A size that does not divide over its mesh axis raises
    ``ValueError`` as in ``shard``, before anything moves."""
    mesh = parameters_mesh(module)
    if mesh is None:
        return
    for name, variable in variables.items():
        check_variable(variable, mesh, name)
    for variable in variables.values():
        sharding = NamedSharding(mesh, partition_spec(variable, mesh))
        variable.set_value(jax.device_put(variable.get_value(), sharding))
