"""Placement: values onto a device mesh and back, and where each variable goes.

The vocabulary (mesh axes, which dimension goes where) is ``flax_attention.axes``; this module
uses it to move values: ``place(value, sharding)`` puts anything the package puts on devices
there (each process builds only the slices of its own devices, ``jax.make_array_from_callback``,
so the same calls work when a mesh spans several JAX processes, ``jax.distributed.initialize``,
where a process cannot address the others' devices); ``fetch`` brings arrays back to NumPy in
every process; ``partition_spec`` and ``check_variable`` read a variable's partition metadata
against a mesh; ``parameters_mesh`` and ``place_like_parameters`` find a placed module's mesh
and put new state (decode caches) beside its parameters. ``flax_attention.shard`` places whole
layers with them.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from flax_attention._checks import check_instance
from flax_attention.axes import axis_names, mesh_axis_size, spec_entry

__all__ = [
    "check_variable",
    "fetch",
    "parameters_mesh",
    "partition_spec",
    "place",
    "place_like_parameters",
]


def _axes_of(variable: nnx.Variable):
    """The variable's partition metadata (``out_sharding``), or ``None`` (replicated)."""
    metadata = variable.get_metadata()
    return metadata.get("out_sharding") or None


def partition_spec(variable: nnx.Variable, mesh) -> PartitionSpec:
    """Where ``variable`` goes on ``mesh``: its metadata, with axes that ``mesh`` does not have
    (size 1) dropped; ``P()`` (replicated) without metadata."""
    check_instance("variable", variable, nnx.Variable, "an nnx.Variable (e.g. an nnx.Param)")
    axes = _axes_of(variable)
    if axes is None:
        return PartitionSpec()
    spec = []
    for entry in axes:
        spec.append(spec_entry(n for n in axis_names(entry) if n in mesh.axis_names))
    return PartitionSpec(*spec)


def check_variable(variable: nnx.Variable, mesh, name: str) -> None:
    """Each dimension named by ``variable``'s metadata divides over its mesh axes."""
    check_instance("variable", variable, nnx.Variable, "an nnx.Variable (e.g. an nnx.Param)")
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
    check_instance("sharding", sharding, jax.sharding.Sharding, "a jax.sharding.Sharding")
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
    if not hasattr(values, "__iter__"):
        raise TypeError(f"values ({type(values).__name__}) must be an iterable of arrays")
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
    check_instance("module", module, nnx.Pytree, "an nnx.Module or other nnx.Pytree")
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
    check_instance("variables", variables, dict, "a dict of nnx.Variable by name")
    for name, variable in variables.items():
        check_instance(f"variables[{name!r}]", variable, nnx.Variable, "an nnx.Variable")
    mesh = parameters_mesh(module)
    if mesh is None:
        return
    for name, variable in variables.items():
        check_variable(variable, mesh, name)
    for variable in variables.values():
        sharding = NamedSharding(mesh, partition_spec(variable, mesh))
        variable.set_value(place(variable.get_value(), sharding))
