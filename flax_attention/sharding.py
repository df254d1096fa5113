"""Scaling out: ``shard`` places a layer's parameters and decode caches on a JAX device mesh.

The vocabulary (the ``data`` and ``model`` axes, which dimension goes where, ``constrain``)
lives in ``flax_attention.axes``, which the layers import; this module sits on top and knows the
layers only through what they declare:

- every variable's partition metadata (``out_sharding``, see ``nnx.with_partitioning``;
  ``nnx.get_partition_spec(nnx.state(layer))`` reads it): query/key/value projections split
  their output features over ``model`` (kernel ``(None, "model")``, bias ``("model",)``),
  ``out_proj`` (and document 001's fourth projection) its input features (kernel
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
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from flax_attention.axes import (
    DATA,
    FROM_HEADS,
    HEADS,
    MODEL,
    ONE_HEAD,
    TO_HEADS,
    LinearAxes,
    SplitsOverModel,
    check_variable,
    constrain,
    expand_axes,
    mesh_axis_size,
    partition_spec,
    place_like_parameters,
)

__all__ = [
    # The vocabulary, from ``flax_attention.axes`` (imported here for convenience).
    "DATA",
    "MODEL",
    "HEADS",
    "ONE_HEAD",
    "LinearAxes",
    "TO_HEADS",
    "FROM_HEADS",
    "constrain",
    "expand_axes",
    "mesh_axis_size",
    "place_like_parameters",
    # Placing a layer.
    "check_shardable",
    "partition_spec",
    "shard",
]


def _path_name(path) -> str:
    return ".".join(str(part) for part in path) or "<module>"


def _check_mesh(mesh) -> None:
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"mesh ({type(mesh).__name__}) must be a jax.sharding.Mesh (e.g. jax.make_mesh("
            "(2, 4), ('data', 'model')))"
        )


def _check_divisible(module, mesh) -> None:
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
    _check_mesh(mesh)
    _check_divisible(module, mesh)


def shard(module: nnx.Module, mesh: jax.sharding.Mesh) -> nnx.Module:
    """Place every variable of ``module`` on ``mesh`` as its partition metadata says; return it.

    Parameters (and decode caches, after ``init_cache``) go where their ``out_sharding`` metadata
    says, with mesh axes the mesh lacks counted as size 1; everything else (RNG state, the cache
    index, the last attention weights) is replicated. ``module`` is changed in place (and also
    returned). It may be called again, e.g. after ``init_cache``, or under ``nnx.jit`` to create
    a layer directly sharded. Call the sharded layer inside ``with jax.set_mesh(mesh):`` (see the
    module docstring) with inputs sharded over ``data``. The mesh's axes may be ``Explicit``
    (``jax.make_mesh``'s default) or ``Auto``.

    Raises ``TypeError`` for a ``mesh`` that is not a ``jax.sharding.Mesh``, and ``ValueError``
    for a size that does not divide over its mesh axis (``num_heads (6) must be divisible by the
    mesh's model axis (4)``), before anything moves.
    """
    check_shardable(module, mesh)
    for _, node in nnx.iter_graph(module):
        if not isinstance(node, nnx.Variable):
            continue
        sharding = NamedSharding(mesh, partition_spec(node, mesh))
        value = node.get_value()
        if isinstance(value, jax.core.Tracer):  # under jit: the compiled output is placed
            node.set_value(jax.lax.with_sharding_constraint(value, sharding))
        elif isinstance(value, (jax.Array, np.ndarray)):
            node.set_value(jax.device_put(value, sharding))
    return module
