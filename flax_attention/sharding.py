"""Scaling out: ``shard`` places a layer's parameters and decode caches on a JAX device mesh.

The vocabulary (the ``data`` and ``model`` axes, which dimension goes where, ``constrain``),
moving values onto a mesh and back, and every layout JAX cannot choose alone live in
``flax_attention.mesh``, which the layers import; each name has that one import path. This
module sits on top and knows the layers only through what they declare:

- every variable's partition metadata (``out_sharding``, see ``nnx.with_partitioning``;
  ``nnx.get_partition_spec(nnx.state(layer))`` reads it): query/key/value projections split
  their output features over ``model`` (kernel ``(None, "model")``, bias ``("model",)``),
  ``out_proj`` (and the annotated-transformer post's fourth projection) its input features (kernel
  ``("model", None)``, bias replicated), so its matmul reduces over ``model`` (one all-reduce
  per layer); decode caches ``(b, h, max_length, d)`` split batch over ``data`` and heads over
  ``model`` (one head: its features);
- every layer's ``model_axis_sizes()`` (``axes.SplitsOverModel``): the sizes it splits over
  ``model`` (``num_heads``, or ``d_out`` for a single head), which the mesh's ``model`` axis must
  divide.

Queries, keys and values ``(b, t, h, d)`` stay split by heads: each head on its device, never
all-gathered. Single-head layers (``SelfAttention_v1/v2``, ``CausalAttention``, and each head
of ``MultiHeadAttentionWrapper``) split their ``d_out`` features over ``model``; their scores
then reduce over ``model``. The numbers do not depend on the mesh beyond float32 summation order.

Meshes (jax 0.10): ``jax.make_mesh((2, 4), ("data", "model"))`` gives ``Explicit`` axes
(sharding in types) by default; ``axis_types=(AxisType.Auto,) * 2`` gives ``Auto`` axes. Both
work: call a sharded layer inside ``with jax.set_mesh(mesh):`` with inputs split over ``data``
(``jax.device_put(x, NamedSharding(mesh, P("data")))``). With ``Auto`` axes ``constrain`` places
the activations and XLA propagates the rest; with ``Explicit`` axes the types carry the layout,
``out_proj`` names its result's sharding and the attention core runs its kernels under
``jax.sharding.auto_axes``. Parameters are created unplaced (``eager_sharding=False``);
``shard(layer, mesh)`` places them.

A mesh may span several JAX processes (``jax.distributed.initialize``; ``flax_attention.launch``
starts them on one machine). Placing goes through ``flax_attention.mesh.place``, so each
process builds only its own devices' slices; ``global_batch`` makes the global batch from each
process's own rows (``data_slices``), and refuses a mesh that does not span every process's
devices or whose ``data`` axis the processes do not divide.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from flax_attention._checks import check_instance, check_int, check_positive_int
from flax_attention.mesh import (
    DATA,
    MODEL,
    SplitsOverModel,
    check_variable,
    mesh_axis_size,
    partition_spec,
    place,
)

__all__ = [
    # Placing a layer.
    "check_shardable",
    "shard",
    # Feeding a mesh that spans processes.
    "data_slices",
    "global_batch",
    "check_data_over_processes",
]


def _path_name(path) -> str:
    return ".".join(str(part) for part in path) or "<module>"


def _check_mesh(mesh) -> None:
    expected = "a jax.sharding.Mesh (e.g. jax.make_mesh((2, 4), ('data', 'model')))"
    check_instance("mesh", mesh, jax.sharding.Mesh, expected)


def _check_spans_processes(mesh) -> None:
    """With several JAX processes, a mesh over all their devices (each process then holds its
    share of every split; a process without devices in the mesh could hold nothing)."""
    if jax.process_count() > 1 and mesh.devices.size != jax.device_count():
        raise ValueError(
            f"mesh ({mesh.devices.size} devices, {dict(mesh.shape)}) must span every device of "
            f"the {jax.process_count()} processes ({jax.device_count()} devices)"
        )


def _check_splits_over_model(module, mesh) -> None:
    """Each size a layer splits over the ``model`` axis (``model_axis_sizes``), and each
    partitioned dimension of every variable, divides over its mesh axes."""
    model = mesh_axis_size(mesh, MODEL)
    for path, node in nnx.iter_graph(module):
        if not isinstance(node, SplitsOverModel):
            continue
        for name, value in node.model_axis_sizes().items():
            if value % model != 0:
                where = "" if not path else f" of {_path_name(path)}"
                raise ValueError(
                    f"{name} ({value}){where} must be divisible by the mesh's model axis ({model})"
                )
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Variable):
            check_variable(node, mesh, _path_name(path))


def check_shardable(module: nnx.Module, mesh: jax.sharding.Mesh) -> None:
    """Raise what ``shard(module, mesh)`` would raise, without moving anything."""
    expected = "an nnx.Module or other nnx.Pytree (a layer, a model, an nnx.Optimizer)"
    check_instance("module", module, nnx.Pytree, expected)
    _check_mesh(mesh)
    _check_spans_processes(mesh)
    _check_splits_over_model(module, mesh)


def shard(module: nnx.Module, mesh: jax.sharding.Mesh) -> nnx.Module:
    """Place every variable of ``module`` on ``mesh`` as its partition metadata says; return it.

    Parameters (and decode caches, after ``init_cache``) go where their ``out_sharding`` metadata
    says, with mesh axes the mesh lacks counted as size 1; everything else (RNG state, the cache
    index, the last attention weights) is replicated. ``module`` is changed in place (and also
    returned). It may be called again, e.g. after ``init_cache``, or under ``nnx.jit`` to create
    a layer directly sharded. Call the sharded layer inside ``with jax.set_mesh(mesh):`` (see the
    module docstring) with inputs sharded over ``data``. The mesh's axes may be ``Explicit``
    (``jax.make_mesh``'s default) or ``Auto``.

    An abstract module (``nnx.eval_shape``) gets, for each parameter, a ``jax.ShapeDtypeStruct``
    with its sharding: ``load_state_dict``/``load_file`` then place each tensor straight there.
    On a mesh over several processes each process places only its own devices' slices of what
    it holds (every process must hold the same values: the same seed, the same file).

    Raises ``TypeError`` for a ``mesh`` that is not a ``jax.sharding.Mesh``, and ``ValueError``
    for a size that does not divide over its mesh axis (``num_heads (6) must be divisible by the
    mesh's model axis (4)``) and, with several processes, for a mesh that does not span all
    their devices, before anything moves.
    """
    check_shardable(module, mesh)
    for _, node in nnx.iter_graph(module):
        if not isinstance(node, nnx.Variable):
            continue
        sharding = NamedSharding(mesh, partition_spec(node, mesh))
        value = node.get_value()
        if isinstance(value, jax.ShapeDtypeStruct):  # abstract: where a load will place it
            node.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))
        elif isinstance(value, (jax.Array, np.ndarray)):  # a tracer under jit: a constraint
            node.set_value(place(value, sharding))
    return module


def data_slices(mesh: jax.sharding.Mesh, process: int | None = None) -> tuple[int, ...]:
    """The positions along the mesh's ``data`` axis that ``process`` (default: this one) has
    devices at: whose batch rows it feeds. ``(0,)`` on a mesh without ``data``."""
    _check_mesh(mesh)
    if process is None:
        process = jax.process_index()
    check_int("process", process, 0, why="a JAX process index")
    if DATA not in mesh.axis_names:
        return (0,) if any(d.process_index == process for d in mesh.devices.flat) else ()
    axis = mesh.axis_names.index(DATA)
    found = {
        position[axis]
        for position, device in np.ndenumerate(mesh.devices)
        if device.process_index == process
    }
    return tuple(sorted(found))


def check_data_over_processes(data: int, held: dict[int, tuple[int, ...]]) -> None:
    """The processes along a mesh's ``data`` axis (of size ``data``) divide it: ``held`` (each
    process's ``data_slices``) are, process by process, the same slices or disjoint ones of one
    size, so each process feeds whole slices that no other group feeds. Else ``ValueError``:
    ``the mesh's data axis (3) must be divisible by the processes along it (2): process 0 holds
    data slices [0, 1], process 1 [1, 2]``."""
    check_int("data", data, 1, why="the size of the mesh's data axis")
    groups = sorted(set(held.values()))
    for p, mine in held.items():
        for q, theirs in held.items():
            if mine != theirs and (set(mine) & set(theirs) or len(mine) != len(theirs)):
                raise ValueError(
                    f"the mesh's data axis ({data}) must be divisible by the processes along it "
                    f"({len(groups)}): process {p} holds data slices {list(mine)}, process {q} "
                    f"{list(theirs)}"
                )


def global_batch(local, mesh: jax.sharding.Mesh, batch_size: int | None = None) -> jax.Array:
    """The global batch, split over the mesh's ``data`` axis, of which this process holds
    ``local``: the rows of its own ``data`` slices (``data_slices``), in order. Every process
    calls it with its own rows (``jax.make_array_from_process_local_data``); with one process
    ``local`` is the whole batch. ``batch_size``: the global batch's rows, checked when given.

    Raises ``ValueError`` naming the numbers for: a mesh that does not span every process's
    devices, processes that do not divide the ``data`` axis (two processes sharing a slice),
    a ``local`` whose rows are not this process's share (``local.shape[0] (3) must be this
    process's share of the batch (4): batch_size 8 over the data axis (2), 1 slice(s) here``),
    and a ``batch_size`` the ``data`` axis does not divide."""
    _check_mesh(mesh)
    _check_spans_processes(mesh)
    processes = range(jax.process_count())
    check_data_over_processes(
        mesh_axis_size(mesh, DATA), {p: data_slices(mesh, p) for p in processes}
    )
    local = np.asarray(local)
    if local.ndim == 0:
        raise ValueError(f"local (shape {local.shape}) must have a batch axis first")
    data = mesh_axis_size(mesh, DATA)
    mine = len(data_slices(mesh))
    rows = local.shape[0]
    if batch_size is None:
        if rows % mine != 0:
            raise ValueError(
                f"local.shape[0] ({rows}) must be divisible by this process's data slices "
                f"({mine}) of the mesh's data axis ({data})"
            )
        batch_size = rows // mine * data
    else:
        check_positive_int("batch_size", batch_size)
        if batch_size % data != 0:
            raise ValueError(
                f"batch_size ({batch_size}) must be divisible by the mesh's data axis ({data})"
            )
        share = batch_size // data * mine
        if rows != share:
            raise ValueError(
                f"local.shape[0] ({rows}) must be this process's share of the batch ({share}): "
                f"batch_size {batch_size} over the data axis ({data}), {mine} slice(s) here"
            )
    spec = PartitionSpec(DATA) if DATA in mesh.axis_names else PartitionSpec()
    return jax.make_array_from_process_local_data(
        NamedSharding(mesh, spec), local, (batch_size, *local.shape[1:])
    )
