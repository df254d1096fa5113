"""A native CPU flash-attention kernel (``attention.cc``) called through ``jax.ffi``.

Shape legend as in ``flax_attention.core``: ``b`` batch (leading axes, flattened here), ``t``
query tokens, ``s`` key tokens, ``h`` heads, ``d`` features per head.

``native_attention`` takes and returns the layout of ``blocked_attention``: ``(..., t, h, d_k),
(..., s, h_kv, d_k), (..., s, h_kv, d_v) -> (..., t, h, d_v)`` (``h_kv`` dividing ``h``:
grouped-query attention, the key heads read in place), with the same ``AttentionMask`` and
semantics (causal and sliding-window tile skipping, the caller's keep-mask, its fill, the query
offset), plus dropout inside the tiles (``dropout_hash``). Forward and backward are two FFI
targets under one ``jax.custom_vjp``; the backward recomputes the tiles from the saved row max
``m`` and denominator ``l``. Tiles are ``block_q`` queries (64, or 128 from 2048 queries, unless
given) by ``block_k`` keys (512 unless given); the forward runs an online softmax across a row's
key tiles. The tiles' products run on the kernel's own micro-kernel (one source, compiled for
AVX-512, AVX2 and baseline vectors) where the CPU has AVX-512 and the head dims are multiples of
16 (GPT-2's 64), on scipy-openblas32's ``sgemm`` (single-threaded per call) elsewhere
(``products()`` says which; ``native_attention(..., products="blas")`` or ``"micro"`` asks for
one). The parallelism is XLA's intra-op thread pool, one task per (batch, head, query block)
forward and per (batch, key head) backward (the query heads that share a key head accumulate its
gradients in one task). Inputs of float32 or bfloat16 are computed in float32 and the result
cast back; ``precision`` is accepted for the common signature: the kernel always multiplies in
full float32 (``HIGHEST``).

The library is built by the package's install (``setup.py``). Where it was not built, cannot be
loaded, or ``FLAX_ATTENTION_NATIVE=0`` is set in the environment when the kernel is first asked
for (the library is loaded then, once, and the variable read then only), ``available()`` is
``False`` and ``why_unavailable()`` says why.

Under ``vmap`` the kernel runs once per mapped element (``vmap_method="sequential"``).

On a mesh (``jax.set_mesh``) each device runs the kernel on its own batch rows and heads (calls
with a batch axis; an unbatched ``(t, h, d)`` call runs whole on every device): XLA cannot split
a custom call and would gather its operands onto every device, so ``native_attention`` calls it
inside ``jax.shard_map`` over the leading (batch) axes and the heads
(``flax_attention.mesh.kernel_shard_specs``). Where they go: on ``Explicit`` mesh axes, where
the queries' type puts them; on ``Auto`` axes (also inside ``jax.sharding.auto_axes``, where the
attention core runs its kernels on an explicit mesh) the package's layout,
``flax_attention.mesh.HEADS`` (the first leading axis over ``data``, the heads over ``model``);
an axis that does not divide its dimension stays whole. Query tokens, keys and features are
never split (a head needs all its keys); keys, values and the mask follow the queries. The
dropout hash reads the global batch and head numbers from two operands (``batch_index``,
``head_index``, sliced with the rest), so every device drops exactly the weights one device
would. Inside the caller's own ``shard_map`` (manual axes) the kernel runs as it is, on what
each shard holds (its dropout then numbers the shard's batch rows and heads from 0).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.metadata
import math
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from flax_attention.kernels import dropout_hash
from flax_attention.masking import AttentionMask, flatten_mask
from flax_attention.mesh import kernel_shard_specs, reshard_for_kernel

__all__ = [
    "available",
    "can_run",
    "check_dtypes",
    "products",
    "why_not_here",
    "why_unavailable",
    "native_attention",
]

_FORWARD, _BACKWARD = "flax_attention_native_forward", "flax_attention_native_backward"
#: ``native_attention``'s ``products`` -> the kernel's ``products`` attribute.
_PRODUCTS = {None: 0, "blas": 1, "micro": 2}
_HERE = pathlib.Path(__file__).parent
_LIBRARY: list = []  # the loaded library, once ``_load`` has loaded it


@functools.cache
def _load() -> str | None:
    """Load and register the kernel once; the reason it is off, or ``None``."""
    if os.environ.get("FLAX_ATTENTION_NATIVE", "1").strip().lower() in ("0", "false", "off"):
        return "switched off by the environment (FLAX_ATTENTION_NATIVE=0)"
    built = sorted(_HERE.glob("_attention*.so"))
    if not built:
        return (
            f"the native kernel was not built (no _attention*.so in {_HERE}): reinstall the "
            "package with a C++ compiler present, or run `python setup.py build_ext --inplace`"
        )
    try:
        import scipy_openblas32
    except ImportError as error:
        return f"the BLAS package scipy-openblas32 is not installed ({error})"
    blas = pathlib.Path(scipy_openblas32.get_lib_dir()) / f"lib{scipy_openblas32.get_library()}.so"
    try:
        openblas = ctypes.CDLL(str(blas), mode=ctypes.RTLD_GLOBAL)  # the kernel links it by name
        openblas.scipy_openblas_set_num_threads(1)  # the kernel's tasks are the parallelism
        library = ctypes.CDLL(str(built[-1]))
        built_with = _built_with(library)
        running = importlib.metadata.version("jaxlib")
        if built_with != running:  # another FFI API version would break the CPU backend
            return (
                f"the native kernel was built against jaxlib {built_with}, this is jaxlib "
                f"{running}: reinstall the package (or `python setup.py build_ext --inplace`)"
            )
        for name, symbol in (
            (_FORWARD, "FlaxAttentionForward"),
            (_BACKWARD, "FlaxAttentionBackward"),
        ):
            capsule = jax.ffi.pycapsule(getattr(library, symbol))
            jax.ffi.register_ffi_target(name, capsule, platform="cpu")
        _LIBRARY.append(library)
    except (OSError, AttributeError) as error:
        return f"the native kernel {built[-1].name} could not be loaded: {error}"
    return None


def _built_with(library) -> str:
    """The jaxlib version the library's FFI headers came from (``unknown`` if it has no record)."""
    try:
        function = library.FlaxAttentionJaxlibVersion
    except AttributeError:
        return "unknown"
    function.restype = ctypes.c_char_p
    return function().decode()


def available() -> bool:
    """Whether ``native_attention`` can run here (``why_unavailable`` says why not)."""
    return _load() is None


def why_unavailable() -> str | None:
    """Why the native kernel is off (not built, not loadable, switched off), or ``None``."""
    return _load()


@functools.cache
def _register_target(target: str, symbol: str) -> bool:
    """The library's FFI handler ``symbol`` registered once as the CPU's ``target``: whether it
    is there (the library built and loaded, and not built before ``symbol`` existed)."""
    if _load() is not None or not hasattr(_LIBRARY[0], symbol):
        return False
    capsule = jax.ffi.pycapsule(getattr(_LIBRARY[0], symbol))
    jax.ffi.register_ffi_target(target, capsule, platform="cpu")
    return True


def _one_cpu_device() -> bool:
    """Whether a custom call on whole arrays runs here as on one device: the CPU backend, one
    device (on several, XLA would gather a sharded operand onto each), no ``Explicit`` mesh (its
    result would lose the operands' sharding type)."""
    from flax_attention.mesh import explicit_mesh

    return explicit_mesh() is None and jax.default_backend() == "cpu" and jax.device_count() == 1


def products() -> str | None:
    """What the kernel multiplies its tiles with where ``d_k`` and ``d_v`` are multiples of 16:
    ``"micro"``, its own register-blocked micro-kernel, or ``"blas"``, scipy-openblas32's
    ``sgemm`` (also the only one for other head dims). ``None`` where the kernel is unavailable.

    By default the micro-kernel runs where the library's copy for this CPU has 16-float vectors
    (x86-64 CPUs with AVX-512), the BLAS elsewhere (with AVX2 the micro-kernel's blocks spill
    registers and it is slower). ``native_attention(..., products=)`` chooses for one call
    instead: ``"blas"``, or ``"micro"`` (on every CPU where the micro-kernel is built: how the
    tests run it on CPUs without AVX-512)."""
    if _load() is not None:
        return None
    return "micro" if _LIBRARY[0].FlaxAttentionMicroKernel() == 1 else "blas"


def _micro_width() -> int:
    """Floats per vector of the micro-kernel's copy for this CPU (16 AVX-512, 8 AVX2, 4), 0
    where the library has no micro-kernel; the kernel must be available."""
    return _LIBRARY[0].FlaxAttentionMicroWidth()


def _per_cpu_copies() -> bool:
    """Whether the library holds one copy of its hot functions per x86-64 level, the widest this
    CPU runs picked when it loads (the portable build); the kernel must be available."""
    return _LIBRARY[0].FlaxAttentionClones() == 1


def why_not_here() -> str | None:
    """Why the kernel cannot run in this process (``why_unavailable``, or a default backend other
    than the CPU), or ``None``."""
    if jax.default_backend() != "cpu":
        return f"the backend is {jax.default_backend()!r}, the kernel runs on the CPU"
    return _load()


_DTYPES = (jnp.float32, jnp.bfloat16)


def check_dtypes(**arrays) -> None:
    """Each named array (``queries=...``) float32 or bfloat16, else ``TypeError`` naming it."""
    for name, x in arrays.items():
        if x.dtype not in _DTYPES:
            raise TypeError(f"{name}.dtype ({x.dtype}) must be float32 or bfloat16")


def can_run(*arrays) -> bool:
    """Whether ``native_attention`` runs these inputs here: the kernel on, the CPU, and each of
    ``arrays`` float32 or bfloat16 (what ``implementation=None`` asks before choosing it)."""
    return why_not_here() is None and all(x.dtype in _DTYPES for x in arrays)


def native_attention(
    queries,
    keys,
    values,
    attention_mask: AttentionMask | None = None,
    *,
    precision=None,
    dropout_rate: float = 0.0,
    dropout_seed=None,
    block_q: int = 0,
    block_k: int = 0,
    products: str | None = None,
    targets: tuple[str, str] | None = None,
):
    """Flash-style attention in C++: ``(..., t, h, d_k), (..., s, h, d_k), (..., s, h, d_v)``
    -> ``(..., t, h, d_v)``, with what ``attention_mask`` hides (``None``: nothing); equal to
    ``reference`` without its ``(t, s)`` scores in memory.

    Args:
      queries, keys, values: float32 or bfloat16, layout as above; keys and values may have
        fewer heads ``h_kv`` dividing ``h`` (grouped-query attention).
      attention_mask: the core's one description of what is hidden
        (``flax_attention.masking.AttentionMask``): the caller's keep-mask, its fill (``-inf``:
        a fully masked row is NaN, as softmax; the annotated-transformer post's ``-1e10``:
        uniform over the keys causality leaves), causality (hidden keys are ``-inf`` and their
        key tiles are never computed) and the query offset (an int or a traced int32 scalar).
      precision: accepted for the common signature; the kernel computes in float32.
      dropout_rate: dropout on the weights inside the tiles, kept weights scaled by
        ``1 / (1 - rate)``; the keep-mask is ``dropout_hash.keep_mask(dropout_seed, ...)``.
      dropout_seed: uint32 (int or traced scalar), required when ``dropout_rate > 0``.
      block_q: query rows per tile, 1 to 1024; ``0`` = 64 (128 from 2048 queries).
      block_k: keys per tile, ``0`` = 512; rows longer than one tile go through an online
        softmax over their key tiles.
      products: what multiplies the tiles where ``d_k`` and ``d_v`` are multiples of 16:
        ``None`` the default for this CPU (``products()``), ``"blas"`` or ``"micro"``.
      targets: the FFI target names ``(forward, backward)`` of another build of this kernel,
        registered with ``jax.ffi.register_ffi_target`` (how ``benchmarks.blas`` and
        ``benchmarks.march`` time builds against each other); ``None``: the package's own.
    """
    del precision  # always float32 products and sums
    _check_call(queries, keys, values, dropout_rate, dropout_seed, block_q, block_k, products)
    if targets is not None and (
        not isinstance(targets, tuple)
        or len(targets) != 2
        or not all(isinstance(name, str) for name in targets)
    ):
        raise TypeError(f"targets ({targets!r}) must be None or a (forward, backward) pair of str")
    if attention_mask is None:
        attention_mask = AttentionMask()
    return _attend(
        queries, keys, values, attention_mask, dropout_rate, dropout_seed, block_q, block_k,
        products, targets,
    )  # fmt: skip


def _attend(
    queries,
    keys,
    values,
    attention_mask: AttentionMask,
    dropout_rate: float = 0.0,
    dropout_seed=None,
    block_q: int = 0,
    block_k: int = 0,
    products: str | None = None,
    targets: tuple[str, str] | None = None,
):
    """``native_attention`` on arguments already checked: the attention core's one entry into
    the kernel (the core asked ``can_run`` or ``why_not_here`` before choosing it)."""
    lead, h = queries.shape[:-3], queries.shape[-2]
    keep = attention_mask.keep
    config = _Config(
        is_causal=bool(attention_mask.is_causal),
        has_mask=keep is not None,
        fill_value=float(attention_mask.fill_value),
        drop_threshold=dropout_hash.threshold(dropout_rate),
        drop_scale=1.0 / (1.0 - dropout_rate),
        block_q=int(block_q),
        block_k=int(block_k),
        products=_PRODUCTS[products],
        targets=(_FORWARD, _BACKWARD) if targets is None else targets,
        window=attention_mask.window or 0,
    )
    if keep is None:
        keep = jnp.ones((1,) * (len(lead) + 3), bool)  # not read by the kernel
    keep = keep.reshape((1,) * (len(lead) + 3 - keep.ndim) + keep.shape)  # (...|1, h|1, t|1, s|1)
    offset = jnp.asarray(attention_mask.query_offset, jnp.int32)
    seed = jnp.asarray(0 if dropout_seed is None else dropout_seed, jnp.uint32)
    # The dropout hash's batch and head numbers: global ones, also where a shard sees a slice.
    batch_index = jnp.arange(math.prod(lead), dtype=jnp.uint32).reshape(lead)
    head_index = jnp.arange(h, dtype=jnp.uint32)
    operands = (queries, keys, values, keep, offset, seed, batch_index, head_index)
    call = functools.partial(_call, config)
    specs = (
        None
        if jax.sharding.get_abstract_mesh().empty
        else kernel_shard_specs(queries, keep, keys.shape[-2])
    )
    if specs is not None:
        mesh, in_specs, out_spec = specs
        # check_vma=False: an FFI call's results carry no varying-axes type, so the custom VJP's
        # cotangents would not match its (varying) inputs' types; the specs say it all.
        call = jax.shard_map(
            call, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False
        )
        operands = tuple(reshard_for_kernel(x, spec, mesh) for x, spec in zip(operands, in_specs))
    return call(*operands)


def _check_call(queries, keys, values, dropout_rate, dropout_seed, block_q, block_k, products):
    """``native_attention``'s arguments: the kernel here, the dtypes, the dropout's seed, the
    tiles and the products."""
    reason = why_not_here()
    if reason is not None:
        raise RuntimeError(f"the native attention kernel is unavailable: {reason}")
    check_dtypes(queries=queries, keys=keys, values=values)
    if dropout_rate and dropout_seed is None:
        raise ValueError(
            f"dropout_seed (None) must be given when dropout_rate ({dropout_rate}) > 0"
        )
    for name, value, most in (("block_q", block_q, 1024), ("block_k", block_k, None)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise TypeError(f"{name} ({value!r}) must be an int")
        if value < 0 or (most is not None and value > most):
            limit = f"from 0 to {most}" if most else "0 or more"
            raise ValueError(f"{name} ({value}) must be {limit} (0: the default tile)")
    if products not in _PRODUCTS:
        raise ValueError(f"products ({products!r}) must be one of {tuple(_PRODUCTS)}")


def _call(config, queries, keys, values, keep, offset, seed, batch_index, head_index):
    """One kernel call (on one shard, or on everything): flatten the leading axes, compute in
    float32, cast back."""
    lead, (t, h, _), s = queries.shape[:-3], queries.shape[-3:], keys.shape[-3]
    q, k, v = (x.reshape(-1, *x.shape[-3:]).astype(jnp.float32) for x in (queries, keys, values))
    keep = flatten_mask(keep, lead, h, t, s)  # (B|1, h|1, t|1, s|1)
    ids = batch_index.reshape(-1), head_index
    out = _native(config, q, k, v, keep, offset, seed, *ids)  # (B, t, h, d_v) float32
    return out.astype(queries.dtype).reshape(*lead, *out.shape[1:])


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static settings of one call (hashable, for ``nondiff_argnums``): the kernels' attributes."""

    is_causal: bool
    has_mask: bool
    fill_value: float
    drop_threshold: int
    drop_scale: float
    block_q: int
    block_k: int
    products: int = 0  # the kernel's code: 0 its default, 1 the BLAS, 2 the micro-kernel
    targets: tuple[str, str] = (_FORWARD, _BACKWARD)  # the FFI targets called
    window: int = 0  # the sliding window, 0: none

    def attributes(self) -> dict:
        return dict(
            is_causal=self.is_causal,
            has_mask=self.has_mask,
            fill_value=np.float32(self.fill_value),
            drop_threshold=np.uint32(self.drop_threshold),
            drop_scale=np.float32(self.drop_scale),
            block_q=np.int64(self.block_q),
            block_k=np.int64(self.block_k),
            products=np.int32(self.products),
            window=np.int64(self.window),
        )  # not the targets: they name the call


def _forward(config, q, k, v, mask, offset, seed, batch_index, head_index):
    """``(out, m, l)``: ``(B, t, h, d_v)`` and the rows' max and denominator ``(B, h, t)``."""
    batch, t, h, _ = q.shape
    f32 = jnp.float32
    shapes = (
        jax.ShapeDtypeStruct((batch, t, h, v.shape[-1]), f32),
        jax.ShapeDtypeStruct((batch, h, t), f32),
        jax.ShapeDtypeStruct((batch, h, t), f32),
    )
    call = jax.ffi.ffi_call(config.targets[0], shapes, vmap_method="sequential")
    return call(q, k, v, mask, offset, seed, batch_index, head_index, **config.attributes())


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _native(config, q, k, v, mask, offset, seed, batch_index, head_index):
    return _forward(config, q, k, v, mask, offset, seed, batch_index, head_index)[0]


def _native_fwd(config, q, k, v, mask, offset, seed, batch_index, head_index):
    ids = batch_index, head_index
    out, m, denom = _forward(config, q, k, v, mask, offset, seed, *ids)
    return out, (q, k, v, mask, offset, seed, ids, out, m, denom)


def _native_bwd(config, residuals, d_out):
    q, k, v, mask, offset, seed, ids, out, m, denom = residuals
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
    call = jax.ffi.ffi_call(config.targets[1], shapes, vmap_method="sequential")
    d_q, d_k, d_v = call(
        q,
        k,
        v,
        mask,
        offset,
        seed,
        *ids,
        out,
        m,
        denom,
        d_out.astype(jnp.float32),
        **config.attributes(),
    )
    return d_q, d_k, d_v, None, None, None, None, None


_native.defvjp(_native_fwd, _native_bwd)
