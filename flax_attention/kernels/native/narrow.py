"""Products of a few rows with float32, bfloat16 or int8 weights (``narrow.cc``), for decode
steps: ``x (..., k) @ w`` with ``w`` ``(k, n)`` (an ``nnx.Linear`` kernel) or, ``nk=True``,
``x @ w.T`` with ``w`` ``(n, k)`` (a tied head's embedding, an ``Int8Linear``'s ``weight``),
int8 weights times ``scale``
``(n,)`` per output feature. Each weight is widened to float32 in a register as it is read and
every product accumulates in float32; the result is float32.

Why: a decode step reads every weight once for a handful of rows, so its time is the time to
read them. XLA's CPU compiler widens a bfloat16 matrix to float32 in memory before a product
(a bfloat16 model decodes slower than float32), and has no int8-weight product. Here the
weights are read once, at their own width, for up to 8 rows a pass (``docs/performance.md``,
"Generation in bfloat16 and int8"). From 16 rows (a prompt) each block of weights is widened
once into a float32 panel that every block of rows multiplies, at the rate of XLA's float32
product, where XLA's int8 product first writes the whole dequantized matrix (1.2-1.3x).

The library holds one copy of the product per x86-64 level (AVX-512, AVX2 + FMA, baseline
SSE2); every copy this CPU runs is registered and ``matmul`` uses the widest (``levels()``,
``level=`` picks another: the tests run each). ``why_unavailable()`` says why the products are
off (the native library not built or loadable, ``FLAX_ATTENTION_NATIVE=0``); callers then use
XLA's ``dot_general``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from flax_attention.kernels import native

__all__ = [
    "WEIGHT_DTYPES",
    "available",
    "cpu_width",
    "levels",
    "matmul",
    "slow_bfloat16_dot",
    "tile_bfloat16",
    "why_unavailable",
]

#: The weight dtypes the products take.
WEIGHT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8)

#: level -> (FFI target, the library's symbol); level 0 is in every build.
_TARGETS = {
    0: ("flax_attention_narrow_base", "FlaxNarrowProductBase"),
    1: ("flax_attention_narrow_v3", "FlaxNarrowProductV3"),
    2: ("flax_attention_narrow_v4", "FlaxNarrowProductV4"),
}
_NAMES = {
    0: "baseline x86-64 (or this machine's one build)",
    1: "x86-64-v3 (AVX2, FMA)",
    2: "x86-64-v4 (AVX-512)",
}


@functools.cache
def _register() -> tuple[str | None, dict[int, int]]:
    """(why the products are off, or None; level -> floats per vector) for the levels this CPU
    runs, each registered once."""
    reason = native.why_unavailable()
    if reason is not None:
        return reason, {}
    library = native._LIBRARY[0]
    if not hasattr(library, "FlaxNarrowLevels"):
        return (
            "the native library predates the narrow products: reinstall the package (or "
            "`python setup.py build_ext --inplace`)",
            {},
        )
    mask = library.FlaxNarrowLevels()
    widths = {}
    for level, (target, symbol) in _TARGETS.items():
        if mask >> level & 1:
            capsule = jax.ffi.pycapsule(getattr(library, symbol))
            jax.ffi.register_ffi_target(target, capsule, platform="cpu")
            widths[level] = library.FlaxNarrowWidth(level)
    return None, widths


def why_unavailable() -> str | None:
    """Why ``matmul`` cannot run here, or ``None``."""
    return _register()[0]


@functools.cache
def available() -> bool:
    """Whether ``matmul`` can run here."""
    return _register()[0] is None


def levels() -> dict[int, str]:
    """The copies this CPU runs, level -> what it is compiled for (``{}`` where unavailable);
    ``matmul`` uses the highest."""
    return {level: _NAMES[level] for level in _register()[1]}


def _ask(symbol: str) -> int:
    """The library's answer ``symbol()`` about this CPU; 0 where the products are unavailable or
    the library predates the question."""
    if _register()[0] is not None:
        return 0
    return int(getattr(native._LIBRARY[0], symbol, lambda: 0)())


@functools.cache
def slow_bfloat16_dot() -> bool:
    """Whether XLA's product of bfloat16 operands is slow on this CPU: an x86-64 one without
    bfloat16 pair products (AVX512_BF16, AMX-BF16), where it runs at about 0.7 of float32's
    rate and the kernel's panels run faster at any number of rows; ``False`` where the library
    cannot tell or is unavailable."""
    return bool(_ask("FlaxNarrowSlowBf16Dot"))


@functools.cache
def tile_bfloat16() -> bool:
    """Whether this CPU has AMX's bfloat16 tile products (AMX-BF16), where XLA's bfloat16 product
    of up to 8 rows runs slower than the kernel's (on an Intel Xeon: 0.33-0.97 of float32's time
    at 8 rows against the kernel's 0.25-0.54); ``False`` where the library cannot tell or is
    unavailable."""
    return bool(_ask("FlaxNarrowTileBf16"))


@functools.cache
def cpu_width() -> int:
    """Floats per vector of the widest vectors this CPU runs (16: AVX-512, 8: AVX2 and FMA, 4:
    SSE2), whatever copies the library holds; 0 where the library cannot tell (not x86-64) or
    is unavailable. ``width() == cpu_width()``: the kernel runs the vectors XLA's code does."""
    return _ask("FlaxNarrowCpuWidth")


@functools.cache
def width(level: int | None = None) -> int:
    """Floats per vector of the copy at ``level`` (the widest by default)."""
    widths = _register()[1]
    return widths[max(widths) if level is None else level]


def matmul(x, w, scale=None, *, nk: bool = False, level: int | None = None):
    """``x (..., k) @ w`` (``w`` ``(k, n)``) or, ``nk``, ``x @ w.T`` (``w`` ``(n, k)``), times
    ``scale`` ``(n,)`` if given; float32 ``(..., n)``. ``w`` float32, bfloat16 or int8; ``x`` is
    computed in float32. Not differentiable (callers wrap it: ``flax_attention._layers``)."""
    reason, widths = _register()
    if reason is not None:
        raise RuntimeError(f"the narrow products are unavailable: {reason}")
    level = max(widths) if level is None else level
    if level not in widths:
        raise ValueError(f"level ({level}) must be one this CPU runs ({sorted(widths)})")
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0] if nk else w.shape[1]
    rows = x.reshape(math.prod(lead), k).astype(jnp.float32)  # (m, k)
    scale = jnp.zeros((0,), jnp.float32) if scale is None else scale.astype(jnp.float32)
    call = jax.ffi.ffi_call(
        _TARGETS[level][0],
        jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32),
        vmap_method="sequential",
    )
    return call(rows, w, scale, nk=nk).reshape(*lead, n)  # (..., n)
