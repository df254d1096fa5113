"""Scaling out: the layers' parameters, activations and decode caches over a JAX device mesh.

Two mesh axes, by name:

- ``data``: the batch. The caller shards inputs over it (``jax.device_put(x, NamedSharding(mesh,
  P("data")))``); parameters are replicated over it.
- ``model``: the heads. Query/key/value projections split their output features over it
  (kernel ``(d_in, d_out)`` -> ``(None, "model")``, bias ``("model",)``); ``out_proj`` (and
  document 001's fourth projection) splits its input features (kernel ``("model", None)``, bias
  replicated), so its matmul reduces over ``model`` (one all-reduce per layer). Queries, keys and
  values ``(b, t, h, d)`` are constrained to ``("data", None, "model", None)``: each head stays on
  its device, and q/k/v are never all-gathered across heads.

Decode caches ``(b, max_length, h, d)`` carry the same metadata as the keys and values
(``HEADS``; ``ONE_HEAD`` for single-head layers); ``shard`` places them, and ``init_cache`` on a
layer already sharded places them at once (``place_like_parameters``).

Every parameter carries its axes as NNX partition metadata (``out_sharding``, see
``nnx.with_partitioning``; ``nnx.get_partition_spec(nnx.state(layer))`` reads it).
Single-head layers (``SelfAttention_v1/v2``, ``CausalAttention``, and each head of
``MultiHeadAttentionWrapper``, whose heads are separate arrays that SPMD cannot spread one per
device) split their ``d_out`` features over ``model`` the same way; their scores then reduce over
``model`` too. The numbers do not depend on the mesh beyond float32 summation order.

Mechanism (jax 0.10): parameters are created unplaced (``eager_sharding=False``);
``shard(layer, mesh)`` places them. ``constrain`` reads the mesh set by ``jax.set_mesh(mesh)``
(the abstract mesh, also seen under ``jit``), so call sharded layers inside ``with
jax.set_mesh(mesh):``; without a mesh it does nothing and XLA propagates the parameters'
shardings on its own (same numbers). The mesh's ``data`` and ``model`` axes must be
``AxisType.Auto`` (``jax.make_mesh`` defaults to ``Explicit`` axes, under which every contraction
over ``model`` would need an ``out_sharding``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

__all__ = [
    "DATA",
    "MODEL",
    "HEADS",
    "ONE_HEAD",
    "LinearAxes",
    "TO_HEADS",
    "FROM_HEADS",
    "check_shardable",
    "constrain",
    "expand_axes",
    "mesh_axis_size",
    "place_like_parameters",
    "partition_spec",
    "shard",
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
#: Activations and decode caches ``(b, t, h, d)`` (any number of batch axes, ``data`` on the
#: first one): each head on its device.
HEADS = (DATA, ..., None, MODEL, None)
#: The same for single-head layers, ``(b, t, 1, d_out)``: features over ``model``, as their
#: projections' output features.
ONE_HEAD = (DATA, ..., None, None, MODEL)


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
    """Where ``shard`` puts ``variable`` on ``mesh``: its metadata, with axes that ``mesh`` does
    not have (size 1) dropped; ``P()`` (replicated) without metadata."""
    axes = _axes_of(variable)
    if axes is None:
        return PartitionSpec()
    spec = []
    for entry in axes:
        names = tuple(n for n in _names(entry) if n in mesh.axis_names)
        spec.append(names[0] if len(names) == 1 else (names or None))
    return PartitionSpec(*spec)


def _path_name(path) -> str:
    return ".".join(str(part) for part in path) or "<module>"


def _check_mesh(mesh) -> None:
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"mesh ({type(mesh).__name__}) must be a jax.sharding.Mesh (e.g. jax.make_mesh("
            "(2, 4), ('data', 'model'), axis_types=(jax.sharding.AxisType.Auto,) * 2))"
        )
    for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True):
        if name in (DATA, MODEL) and kind != AxisType.Auto:
            raise ValueError(
                f"mesh axis {name!r} ({kind.name}) must be Auto (jax.make_mesh(shape, "
                "names, axis_types=(jax.sharding.AxisType.Auto,) * len(names)))"
            )


def _split_sizes(module) -> list[tuple[str, str, int]]:
    """``(path, name, value)`` of every size a layer splits over ``model``: ``num_heads`` for the
    multi-head layers, ``d_out`` for the single-head ones (and each head of the wrapper)."""
    from flax_attention.annotated import MultiHeadedAttention
    from flax_attention.causal import CausalAttention
    from flax_attention.multihead import MultiHeadAttention
    from flax_attention.self_attention import SelfAttention_v1, SelfAttention_v2

    sizes = []
    for path, node in nnx.iter_graph(module):
        if isinstance(node, (MultiHeadAttention, MultiHeadedAttention)):
            sizes.append((_path_name(path), "num_heads", node.num_heads))
        elif isinstance(node, (CausalAttention, SelfAttention_v1, SelfAttention_v2)):
            sizes.append((_path_name(path), "d_out", node.d_out))
    return sizes


def _check_divisible(module, mesh) -> None:
    model = mesh_axis_size(mesh, MODEL)
    for path, name, value in _split_sizes(module):
        if value % model != 0:
            where = "" if path == "<module>" else f" of {path}"
            raise ValueError(
                f"{name} ({value}){where} must be divisible by the mesh's model axis ({model})"
            )
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Variable):
            _check_variable(node, mesh, _path_name(path))


def _check_variable(variable: nnx.Variable, mesh, name: str) -> None:
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


def place_like_parameters(module: nnx.Module, *names: str) -> None:
    """Put ``module``'s variables ``names`` (new state, e.g. the decode cache ``init_cache``
    makes) on the mesh ``module``'s parameters are on, as their metadata says; nothing if the
    parameters are not on a mesh (not sharded, or traced). A size that does not divide over its
    mesh axis raises ``ValueError`` as in ``shard``."""
    mesh = None
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Param):
            sharding = getattr(node.get_value(), "sharding", None)
            if isinstance(sharding, NamedSharding) and not isinstance(
                node.get_value(), jax.core.Tracer
            ):
                mesh = sharding.mesh
                break
    if mesh is None:
        return
    for name in names:
        _check_variable(getattr(module, name), mesh, name)
    for name in names:
        variable = getattr(module, name)
        sharding = NamedSharding(mesh, partition_spec(variable, mesh))
        variable.set_value(jax.device_put(variable.get_value(), sharding))


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
    module docstring) with inputs sharded over ``data``.

    Raises ``TypeError`` for a ``mesh`` that is not a ``jax.sharding.Mesh``, and ``ValueError``
    for non-``Auto`` ``data``/``model`` axes or a size that does not divide over its mesh axis
    (``num_heads (6) must be divisible by the mesh's model axis (4)``), before anything moves.
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
