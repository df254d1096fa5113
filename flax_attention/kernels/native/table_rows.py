"""The rows of a bfloat16 table at integer ids (``cache.cc``'s ``FlaxTableRows``): the models'
bfloat16 embedding lookups (``flax_attention._layers.Embed``).

Why: XLA's CPU compiler widens a bfloat16 gather's (or dynamic slice's) whole operand to
float32 and, where the lookup is inside a loop, hoists that widening out of it, so
``models.generate`` on a bfloat16 GPT-2 wrote a 154 MB float32 copy of the 50257 x 768 token
table at every call (a jitted loop of 16 lookups took 96-101 ms a call on a 2-core Zen 3, 50 ms
with the table's bits gathered instead, which XLA copies whole the same way; 0.34 ms here). A
custom call reads only the rows it returns.

Used where it can run (``usable``: the native library built and loaded, the CPU backend, one
device, no ``Explicit`` mesh, a bfloat16 table, integer ids), elsewhere ``nnx.Embed``'s
``jnp.take`` (XLA gathers float16 rows without widening the table). An id out of range gives
NaN, a negative one counts from the end, as ``jnp.take``'s. Its derivative is ``jnp.take``'s
of the table's tangent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_attention.kernels import native

__all__ = ["DTYPES", "take", "usable"]

_TARGET = "flax_attention_table_rows"

#: The table dtypes the lookup takes.
DTYPES = (jnp.dtype(jnp.bfloat16),)


def _register() -> bool:
    return native._register_target(_TARGET, "FlaxTableRows")


def usable(table, ids) -> bool:
    """Whether ``take`` runs here for ``table`` ``(V, F)`` and ``ids``."""
    return (
        table.dtype in DTYPES
        and table.ndim == 2
        and jnp.issubdtype(ids.dtype, jnp.integer)
        and native._one_cpu_device()
        and _register()
    )


@jax.custom_jvp
def take(table, ids):
    """``table[ids]``: ``ids`` any shape -> ``ids.shape + (F,)``, ``table``'s dtype."""
    if not _register():
        raise RuntimeError("the native lookup is unavailable (see native.why_unavailable())")
    call = jax.ffi.ffi_call(
        _TARGET,
        jax.ShapeDtypeStruct((ids.size, table.shape[1]), table.dtype),
        vmap_method="sequential",
    )
    rows = call(table, jnp.ravel(ids).astype(jnp.int32))
    return rows.reshape(*ids.shape, table.shape[1])


@take.defjvp
def _take_jvp(primals, tangents):
    table, ids = primals
    return take(table, ids), jnp.take(tangents[0], ids, axis=0)
