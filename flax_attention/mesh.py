"""The mesh module: every sharding decision of the package, and nothing else.

Which tensor dimension goes over which device-mesh axis (the vocabulary), where values go on a
mesh and how they come back (placement), and each layout JAX cannot choose alone (the
decisions). The layers, the attention core and its kernels, the decode cache, generation,
weight loading and ``flax_attention.shard`` call it; with no mesh set (``jax.set_mesh``) a
forward pass calls none of it (``conformance_tests/tests/test_call_path.py``): a caller asks
``jax.sharding.get_abstract_mesh().empty`` first.

**Vocabulary.** Two mesh axes, by name:

- ``data`` (``DATA``): the batch. Inputs are split over it, parameters replicated.
- ``model`` (``MODEL``): the heads. Query/key/value projections split their output features over
  it (``TO_HEADS``), ``out_proj`` its input features (``FROM_HEADS``); queries, keys and values
  ``(b, t, h, d)`` split their heads (``HEADS``), decode caches ``(b, h, max_length, d)`` theirs
  (``CACHE_HEADS``), single-head layers their features (``ONE_HEAD``, both layouts).

A layer declares which of its sizes it splits over ``model`` by a ``model_axis_sizes()`` method
(``SplitsOverModel``); ``flax_attention.shard`` checks those sizes and knows nothing else about
the layers.

**Decisions.** Both kinds of mesh axes that ``jax.make_mesh`` makes are supported. ``Auto`` axes
(``axis_types=(AxisType.Auto,) * 2``): ``constrain`` places activations with
``with_sharding_constraint`` and XLA propagates the rest. ``Explicit`` axes (the default of
``jax.make_mesh`` in jax 0.10, sharding in the types): ``constrain`` does nothing (the types
already say where each array lives); what JAX cannot infer is chosen here: the row-parallel
products' result (``reduced_sharding``, for ``_init.rows_dot_general``), embedding lookups
(``lookup_sharding``), a relayout where two layouts meet (``features_whole``,
``laid_out_like``), the attention core's results under ``jax.sharding.auto_axes``
(``explicit_mesh``, ``attention_out_shardings``), the native kernel's ``shard_map``
(``kernel_shard_specs``, ``reshard_for_kernel``), a dropout's draw (``unsplit``) and
generation's token rows (``rows_sharding``).

**Placement.** ``place(value, sharding)`` puts anything the package puts on devices there (each
process builds only the slices of its own devices, ``jax.make_array_from_callback``, so the same
calls work when a mesh spans several JAX processes, ``jax.distributed.initialize``, where a
process cannot address the others' devices); ``fetch`` brings arrays back to NumPy in every
process; ``partition_spec`` and ``check_variable`` read a variable's partition metadata against
a mesh; ``parameters_mesh`` and ``place_like_parameters`` find a placed module's mesh and put new
state (decode caches) beside its parameters.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from flax_attention._checks import check_choice, check_instance, check_int
from flax_attention._graph import walk

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
    "check_variable",
    "fetch",
    "parameters_mesh",
    "partition_spec",
    "place",
    "place_like_parameters",
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
    for node in walk(module).variables:
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


# ---- the decisions the layers, kernels and generation ask for ------------------------------


def reduced_sharding(lhs, rhs, rhs_contracting):
    """Under an ``Explicit`` mesh, the ``out_sharding`` of ``x (..., d_in) @ w`` whose
    contracted features are split over a mesh axis (a row-parallel product: ``out_proj``, the
    MLP's second Linear, after the heads or hidden features were split over ``model``): the sum
    over that axis laid out like ``x``'s leading axes, its features as ``w``'s output axis. JAX
    cannot choose it alone (the sum could stay split); every other product's layout it infers.
    ``None`` where there is nothing to choose."""
    if explicit_mesh() is None or spec_of(lhs)[-1] is None:
        return None
    return jax.sharding.PartitionSpec(*spec_of(lhs)[:-1], spec_of(rhs)[1 - rhs_contracting[0]])


def unsplit(x) -> bool:
    """Whether ``x`` is traced or placed with no mesh in play: none set, none in its type."""
    return jax.sharding.get_abstract_mesh().empty and jax.typeof(x).sharding.mesh.empty


def attention_out_shardings(queries, values, need_weights):
    """Where the results go on an explicit mesh: ``context_vec`` ``(..., t, h, d_v)`` like the
    queries (``d_v`` like the values'), the weights ``(..., h, t, s)`` like the queries' heads."""
    q, v = spec_of(queries), spec_of(values)
    context = PartitionSpec(*q[:-1], v[-1])
    if not need_weights:
        return context
    return context, PartitionSpec(*q[:-3], q[-2], q[-3], None)


def kernel_shard_specs(queries, keep, kv_heads=None):
    """How to run the kernel once per device under a mesh (``jax.set_mesh``): ``(mesh,
    in_specs, out_spec)`` for ``shard_map``, or ``None`` (no mesh, or nothing to split).

    Only the leading (batch) axes and the heads split: a shard needs all its queries' keys and
    every feature. With ``Explicit`` mesh axes the queries' type says where those go; with
    ``Auto`` axes (also inside ``jax.sharding.auto_axes``, where the attention core runs its
    kernels) the package's layout does (``flax_attention.axes.HEADS``: the first leading axis
    over ``data``, the heads over ``model``), where the axis divides. Keys, values and the mask
    follow the queries; XLA moves what is elsewhere. With grouped heads (``kv_heads`` key heads
    for the queries' ``h``) the heads split only where the mesh axis divides both.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or queries.ndim < 4:
        return None
    types = axis_types(mesh)
    spec = spec_of(queries)  # Explicit axes only
    lead, heads = list(spec[:-3]), spec[-2]
    if lead[0] is None and types.get(DATA) == AxisType.Auto:
        lead[0] = DATA
    if heads is None and types.get(MODEL) == AxisType.Auto:
        heads = MODEL
    used: set = set()
    lead = [_usable(entry, n, mesh, types, used) for entry, n in zip(lead, queries.shape)]
    h = queries.shape[-2]
    heads = _usable(heads, math.gcd(h, kv_heads or h), mesh, types, used)
    if all(entry is None for entry in (*lead, heads)):
        return None
    x_spec = PartitionSpec(*lead, None, heads, None)
    keep_spec = PartitionSpec(
        *(entry if n > 1 else None for entry, n in zip(lead, keep.shape[:-3])),
        heads if keep.shape[-3] > 1 else None,
        None,
        None,
    )
    scalar = PartitionSpec()
    in_specs = (
        x_spec,
        x_spec,
        x_spec,
        keep_spec,
        scalar,
        scalar,
        PartitionSpec(*lead),
        PartitionSpec(heads),
    )
    return mesh, in_specs, x_spec


def _usable(entry, size: int, mesh, types: dict, used: set):
    """``entry`` (mesh axis names of one dimension) if each is an ``Auto`` or ``Explicit`` axis
    of ``mesh`` not ``used`` by another dimension and together they divide ``size``, else
    ``None``; the names are added to ``used``."""
    names = axis_names(entry)
    splits = (AxisType.Auto, AxisType.Explicit)
    if not names or any(types.get(n) not in splits or n in used for n in names):
        return None
    if size % math.prod(dict(mesh.shape)[n] for n in names) != 0:
        return None
    used.update(names)
    return spec_entry(names)


def reshard_for_kernel(x, spec: PartitionSpec, mesh):
    """``x`` laid out as ``spec`` says on the mesh's ``Explicit`` axes (``shard_map`` takes the
    operands' types as they are); ``x`` itself where those already agree, or with ``Auto`` axes
    (``shard_map`` moves what it needs)."""
    types = axis_types(mesh)

    def explicit(entry):
        return spec_entry(n for n in axis_names(entry) if types[n] == AxisType.Explicit)

    want = tuple(explicit(entry) for entry in spec) + (None,) * (jnp.ndim(x) - len(spec))
    if want == spec_of(x):
        return x
    return jax.sharding.reshard(x, PartitionSpec(*want))


def rows_sharding(model, batch: int, *, cached: bool):
    """Where the token ids and mask go: on a sharded model's mesh, rows over ``data`` as its
    decode caches split them (``Explicit`` axes refuse to mix the two layouts); else ``None``
    (the default device)."""
    mesh = parameters_mesh(model)
    if mesh is None:
        return None
    data = mesh_axis_size(mesh, DATA)
    if batch % data == 0:
        return NamedSharding(mesh, PartitionSpec(DATA) if data > 1 else PartitionSpec())
    if cached:
        raise ValueError(
            f"idx batch ({batch}) must be divisible by the mesh's data axis ({data}): the model "
            "is sharded, and its decode caches split the batch over data"
        )
    return NamedSharding(mesh, PartitionSpec())
