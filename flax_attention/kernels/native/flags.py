"""The native kernels' compiler flags, in one place: ``setup.py`` builds the library with them
(reading this file by path, before the package is importable) and ``benchmarks.blas`` rebuilds
the kernel with them against other BLAS libraries.

Portable by default: on x86-64 the hot functions are compiled for AVX-512, AVX2 and baseline
x86-64, and the widest the CPU runs is picked when the library loads.
``FLAX_ATTENTION_MARCH=native`` (or ``x86-64-v3``, ...) builds one copy for that ``-march`` only.
The library records the jaxlib whose FFI headers it was built against: the package loads it only
under that jaxlib (the FFI's API version follows jaxlib).
"""

import os
import platform

__all__ = ["compile_flags"]


def compile_flags(jaxlib: str, march: str | None = None) -> list[str]:
    """The flags for a build against ``jaxlib`` (its version): portable, or one copy for
    ``march`` (``None``: ``FLAX_ATTENTION_MARCH`` from the environment, empty = portable)."""
    if march is None:
        march = os.environ.get("FLAX_ATTENTION_MARCH", "")
    # -fno-trapping-math: the row loops (exp, max, the masks' selects) vectorise without AVX-512's
    # masked moves too. GCC will not if-convert a float comparison that may trap, so on AVX2 and
    # baseline x86-64 the softmax's exp ran one float at a time: the forward took 1.6x longer.
    # Nothing here reads the floating-point exception flags.
    flags = ["-std=c++17", "-O3", "-fopenmp-simd", "-fno-trapping-math"]
    flags.append(f'-DFLAX_ATTENTION_JAXLIB="{jaxlib}"')
    if march and platform.machine() in ("x86_64", "AMD64"):
        flags += [f"-march={march}", "-DFLAX_ATTENTION_ONE_ARCH"]
    return flags
