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

Every value the package puts on devices goes through ``place(value, sharding)``: each process
builds only the slices of its own devices (``jax.make_array_from_callback``), so the same calls
work when a mesh spans several JAX processes (``jax.distributed.initialize``), where a process
cannot address the others' devices.
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
    "axis_names",
    "axis_types",
    "check_variable",
    "constrain",
    "expand_axes",
    "explicit_mesh",
    "fetch",
    "lookup_sharding",
    "mesh_axis_size",
    "out_sharding_like",
    "parameters_mesh",
    "partition_spec",
    "place",
    "place_like_parameters",
    "spec_entry",
    "spec_of",
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


def out_sharding_like(x, last=None):
    """Under an ``Explicit`` mesh, ``x``'s sharding with its last dimension over ``last``
    (``None``: replicated), for the ``out_sharding`` of a contraction whose result is laid out
    like its input (``out_proj``: ``(b, t, d_out)`` like ``x``); ``None`` otherwise."""
    if explicit_mesh() is None:
        return None
    return PartitionSpec(*spec_of(x)[:-1], last)


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
        spec.append(spec_entry(n for n in axis_names(entry) if n in mesh.axis_names))
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
        for axis in axis_names(entry):
            if size % mesh_axis_size(mesh, axis) != 0:
                raise ValueError(
                    f"{name}.shape[{dim}] ({size}) must be divisible by the mesh's {axis} axis "
                    f"({mesh_axis_size(mesh, axis)})"
                )


def _is_key(value) -> bool:
    return isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)


def _index_key(index) -> tuple:
    """A hashable form of a ``make_array_from_callback`` index (a tuple of slices)."""
    return tuple((i.start, i.stop, i.step) if isinstance(i, slice) else i for i in index)


def place(value, sharding: jax.sharding.Sharding):
    """``value`` laid out as ``sharding`` says, also where ``sharding`` spans devices this
    process cannot address (a mesh over several JAX processes).

    ``value`` may be a NumPy array, anything with ``shape``, ``dtype`` and NumPy slicing (read
    only where this process needs it: a lazily read file tensor), or a ``jax.Array``. Host values
    go through ``jax.make_array_from_callback``: each process materialises only the slices of
    its own devices (each slice once, however many of its devices hold it), and every process
    must pass the same value (the same seed, the same file). A ``jax.Array`` on this process's
    devices moves with ``jax.device_put`` when ``sharding`` is also all this process's (one
    process: no copy through the host), else through the host as above; one already spread over
    processes is returned if it is laid out so, else resharded by a compiled identity. Typed PRNG
    keys travel as their key data (``jax.random.key_data``, ``wrap_key_data``). Under ``jit``
    (a tracer) this is ``with_sharding_constraint``.
    """
    if isinstance(value, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(value, sharding)
    if _is_key(value):
        data = place(jax.random.key_data(value), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(value))
    if isinstance(value, jax.Array):
        if not value.is_fully_addressable:  # already spread over processes
            if value.sharding.is_equivalent_to(sharding, value.ndim):
                return value
            return jax.jit(_identity, out_shardings=sharding)(value)
        if sharding.is_fully_addressable:
            return jax.device_put(value, sharding)
        value = np.asarray(value)  # this process's whole copy, sliced below
    elif not all(hasattr(value, name) for name in ("shape", "dtype", "__getitem__")):
        value = np.asarray(value)
    slices: dict = {}

    def read(index):
        key = _index_key(index)
        if key not in slices:
            slices[key] = np.asarray(value[index])
        return slices[key]

    shape = tuple(value.shape)
    dtype = jax.dtypes.canonicalize_dtype(value.dtype)  # float64 is float32 without x64
    return jax.make_array_from_callback(shape, sharding, read, dtype=dtype)


def _identity(x):
    return x


def fetch(values) -> list[np.ndarray]:
    """NumPy copies of ``values`` (arrays), in every process. Those spread over processes (not
    fully addressable) are first replicated by one compiled program: a collective, which every
    process must run with the same ``values``."""
    values = list(values)
    spread = [
        i
        for i, value in enumerate(values)
        if isinstance(value, jax.Array) and not value.is_fully_addressable
    ]
    if spread:
        shardings = [NamedSharding(values[i].sharding.mesh, PartitionSpec()) for i in spread]
        gathered = jax.jit(_identity, out_shardings=shardings)([values[i] for i in spread])
        for i, value in zip(spread, gathered, strict=True):
            values[i] = value
    return [np.asarray(value) for value in values]


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
        variable.set_value(place(variable.get_value(), sharding))
