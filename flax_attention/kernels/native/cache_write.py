"""A decode cache's write in place (``cache.cc``): ``rows`` ``(..., n, F)`` into ``cache``
``(..., S, F)`` at ``index``, every leading slice, the cache aliased to the result; the cache as
it was where the rows do not fit (``index + n > S``), as the XLA update it replaces.

Why: a decode step's attention reads the cache it just wrote, through XLA dots whose operand
fusions take the update in again, out of place, so XLA's CPU compiler copied every layer's whole
cache several times a step (a bfloat16 update it also widens to float32 over the whole cache):
GPT-2's decode step grew by 6-20 microseconds per cache slot. A custom call is never fused: the
cache is written once where it lies (``docs/performance.md``, "Where the decode step's time
goes").

Used by ``flax_attention.cache`` where it can run (``usable``: the native library built and
loaded, the CPU backend, one device, no ``Explicit`` mesh, a float cache of 16 or 32 bits);
elsewhere the caller's ``dynamic_update_slice`` does it. Not differentiable itself:
``flax_attention.cache`` writes its tangents with XLA's update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_attention.kernels import native

__all__ = ["DTYPES", "usable", "write"]

_TARGET = "flax_attention_cache_write"


def _register() -> bool:
    return native._register_target(_TARGET, "FlaxCacheWrite")


#: The cache dtypes the write takes (the package's caches: float32, bfloat16, float16).
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def usable(cache) -> bool:
    """Whether ``write`` takes ``cache`` here: one of ``DTYPES``, no ``Explicit`` mesh (the custom
    call's result would lose the cache's sharding type), the CPU backend, one device (on several,
    XLA would gather a sharded cache onto each for the custom call), the library with the
    write."""
    return cache.dtype in DTYPES and native._one_cpu_device() and _register()


def write(cache, rows, index):
    """``cache`` with ``rows`` written at ``index`` along axis -2 (unchanged where they do not
    fit); ``rows`` of ``cache``'s dtype and leading shape."""
    if not _register():
        raise RuntimeError("the native cache write is unavailable (see native.why_unavailable())")
    call = jax.ffi.ffi_call(
        _TARGET,
        jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        input_output_aliases={0: 0},
        vmap_method="sequential",
    )
    return call(cache, rows, jnp.asarray(index, jnp.int32))
