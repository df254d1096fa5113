"""A native CPU flash-attention kernel (``attention.cc``) called through ``jax.ffi``.

Shape legend as in ``flax_attention.core``: ``b`` batch (leading axes, flattened here), ``t``
query tokens, ``s`` key tokens, ``h`` heads, ``d`` features per head.

``native_attention`` takes and returns the layout of ``blocked_attention``:
``(..., t, h, d_k), (..., s, h, d_k), (..., s, h, d_v) -> (..., t, h, d_v)``, with the same
``AttentionMask`` and semantics (causal tile skipping, the caller's keep-mask, its fill,
the query offset),
plus dropout inside the tiles (``dropout_hash``). Forward and backward are two FFI targets under
one ``jax.custom_vjp``; the backward recomputes the tiles from the saved row max ``m`` and
denominator ``l``. The BLAS is scipy-openblas32 (single-threaded per call), the parallelism
XLA's intra-op thread pool, one task per (batch, head, query block) forward and per
(batch, head) backward. Inputs of float32 or bfloat16 are computed in float32 and the result
cast back; ``precision`` is accepted for the common signature: the kernel always multiplies in
full float32 (``HIGHEST``).

The library is built by the package's install (``setup.py``). Where it was not built, cannot be
loaded, or ``FLAX_ATTENTION_NATIVE=0`` is set in the environment at import, ``available()`` is
``False`` and ``why_unavailable()`` says why.

Under ``vmap`` the kernel runs once per mapped element (``vmap_method="sequential"``). Under
``jit`` with inputs sharded over heads, XLA gathers the operands of a custom call onto every
device: run the kernel inside ``shard_map`` over the heads axis instead (each shard's call then
sees only its heads).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.metadata
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from flax_attention.kernels import dropout_hash
from flax_attention.masking import AttentionMask, flatten_mask

__all__ = ["available", "why_unavailable", "native_attention"]

_FORWARD, _BACKWARD = "flax_attention_native_forward", "flax_attention_native_backward"
_HERE = pathlib.Path(__file__).parent


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
):
    """Flash-style attention in C++: ``(..., t, h, d_k), (..., s, h, d_k), (..., s, h, d_v)``
    -> ``(..., t, h, d_v)``, with what ``attention_mask`` hides (``None``: nothing); equal to
    ``reference`` without its ``(t, s)`` scores in memory.

    Args:
      queries, keys, values: float32 or bfloat16, layout as above.
      attention_mask: the core's one description of what is hidden
        (``flax_attention.masking.AttentionMask``): the caller's keep-mask, its fill (``-inf``:
        a fully masked row is NaN, as softmax; document 001's ``-1e10``: uniform over the keys
        causality leaves), causality (hidden keys are ``-inf`` and their key tiles are never
        computed) and the query offset (an int or a traced int32 scalar).
      precision: accepted for the common signature; the kernel computes in float32.
      dropout_rate: dropout on the weights inside the tiles, kept weights scaled by
        ``1 / (1 - rate)``; the keep-mask is ``dropout_hash.keep_mask(dropout_seed, ...)``.
      dropout_seed: uint32 (int or traced scalar), required when ``dropout_rate > 0``.
      block_q: query rows per tile, ``0`` = about 512 KiB of scores per tile (32 to 128 rows).
    """
    del precision  # always float32 products and sums
    if not available():
        raise RuntimeError(f"the native attention kernel is unavailable: {why_unavailable()}")
    for name, x in (("queries", queries), ("keys", keys), ("values", values)):
        if x.dtype not in (jnp.float32, jnp.bfloat16):
            raise TypeError(f"{name}.dtype ({x.dtype}) must be float32 or bfloat16")
    if dropout_rate and dropout_seed is None:
        raise ValueError(
            f"dropout_seed (None) must be given when dropout_rate ({dropout_rate}) > 0"
        )
    if attention_mask is None:
        attention_mask = AttentionMask()
    lead, (t, h, _), s = queries.shape[:-3], queries.shape[-3:], keys.shape[-3]
    dtype = queries.dtype
    q, k, v = (x.reshape(-1, *x.shape[-3:]).astype(jnp.float32) for x in (queries, keys, values))
    keep = attention_mask.keep
    if keep is not None:
        keep = flatten_mask(keep, lead, h, t, s)  # (B|1, h|1, t|1, s|1)
    config = _Config(
        is_causal=bool(attention_mask.is_causal),
        has_mask=keep is not None,
        fill_value=float(attention_mask.fill_value),
        drop_threshold=dropout_hash.threshold(dropout_rate),
        drop_scale=1.0 / (1.0 - dropout_rate),
        block_q=int(block_q),
        block_k=int(block_k),
    )
    if keep is None:
        keep = jnp.ones((1, 1, 1, 1), bool)  # not read by the kernel
    offset = jnp.asarray(attention_mask.query_offset, jnp.int32)
    seed = jnp.asarray(0 if dropout_seed is None else dropout_seed, jnp.uint32)
    out = _native(config, q, k, v, keep, offset, seed)  # (B, t, h, d_v) float32
    return out.astype(dtype).reshape(*lead, *out.shape[1:])


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

    def attributes(self) -> dict:
        return dict(
            is_causal=self.is_causal,
            has_mask=self.has_mask,
            fill_value=np.float32(self.fill_value),
            drop_threshold=np.uint32(self.drop_threshold),
            drop_scale=np.float32(self.drop_scale),
            block_q=np.int64(self.block_q),
            block_k=np.int64(self.block_k),
        )


def _forward(config, q, k, v, mask, offset, seed):
    """``(out, m, l)``: ``(B, t, h, d_v)`` and the rows' max and denominator ``(B, h, t)``."""
    batch, t, h, _ = q.shape
    f32 = jnp.float32
    shapes = (
        jax.ShapeDtypeStruct((batch, t, h, v.shape[-1]), f32),
        jax.ShapeDtypeStruct((batch, h, t), f32),
        jax.ShapeDtypeStruct((batch, h, t), f32),
    )
    call = jax.ffi.ffi_call(_FORWARD, shapes, vmap_method="sequential")
    return call(q, k, v, mask, offset, seed, **config.attributes())


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _native(config, q, k, v, mask, offset, seed):
    return _forward(config, q, k, v, mask, offset, seed)[0]


def _native_fwd(config, q, k, v, mask, offset, seed):
    out, m, denom = _forward(config, q, k, v, mask, offset, seed)
    return out, (q, k, v, mask, offset, seed, out, m, denom)


def _native_bwd(config, residuals, d_out):
    q, k, v, mask, offset, seed, out, m, denom = residuals
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
    call = jax.ffi.ffi_call(_BACKWARD, shapes, vmap_method="sequential")
    d_q, d_k, d_v = call(
        q, k, v, mask, offset, seed, out, m, denom, d_out.astype(jnp.float32), **config.attributes()
    )
    return d_q, d_k, d_v, None, None, None


_native.defvjp(_native_fwd, _native_bwd)
