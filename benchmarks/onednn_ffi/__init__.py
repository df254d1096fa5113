"""oneDNN's matmul called through ``jax.ffi``: a measurement candidate against XLA's own dot.

Not part of the installed package. ``matmul(x, w, scale=None, *, nk=False)`` returns float32
``x @ w`` (``x @ w.T`` with ``nk=True``, ``w`` then ``(n, k)`` read in place), with ``x`` float32
or bfloat16 ``(m, k)`` and ``w`` float32, bfloat16 or int8; ``scale`` (float32 ``(n,)``) multiplies
the output columns (for int8 weights it is oneDNN's per-N weights scale).

Build first (``onednn_ffi.cc`` -> ``_onednn_ffi.so`` beside it)::

    pip download --no-deps -d wheels onednn-cpu-gomp==2023.2.0 onednn-devel-cpu-gomp==2023.2.0
    mkdir -p onednn && for w in wheels/*.whl; do unzip -qo "$w" -d onednn; done
    ONEDNN_ROOT=<onednn/'s folder of include/ and lib/> bash benchmarks/onednn_ffi/build.sh

``ONEDNN_ROOT`` is a private prefix with ``include/oneapi/dnnl/dnnl.hpp`` and ``lib/libdnnl.so.3``
(the library's rpath points there). The prefix used so far is PyPI's ``onednn-cpu-gomp`` 2023.2.0
and ``onednn-devel-cpu-gomp`` 2023.2.0 (oneDNN 3.2, GNU OpenMP: the system's libgomp), unzipped.
PyPI's current ``onednn`` 2026.1.0 is a SYCL build (its CPU engine needs a SYCL CPU device, i.e.
an OpenCL CPU runtime and the Unified Runtime OpenCL adapter) and could not create a CPU engine
here. oneDNN 3.2 has no "weights decompression" (``fpmath_mode`` ``apply_to_int`` arrived in 3.4),
so int8 weights report Unimplemented with that library.

Known wrong: the plain (unpacked) product of a tied head ``(101, 32)`` with ``nk=True`` differs
from XLA's by about 40% (2026-11-29; GPT-2's and Qwen3's shapes agree to 1e-6): the ``products``
section compares every way before timing it and refuses such a one.
"""

from __future__ import annotations

import ctypes
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["available", "why_unavailable", "info", "matmul", "build"]

_HERE = pathlib.Path(__file__).parent
_SO = _HERE / "_onednn_ffi.so"
_TARGET = "onednn_ffi_matmul"
_STATE: dict = {}


def build(onednn_root: str | None = None) -> None:
    """Runs ``build.sh`` (g++ against ``jax.ffi.include_dir()`` and ``onednn_root``)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHON=sys.executable)
    if onednn_root:
        env["ONEDNN_ROOT"] = onednn_root
    subprocess.run(["bash", str(_HERE / "build.sh")], check=True, env=env)


def _load() -> None:
    if _STATE:
        return
    try:
        lib = ctypes.cdll.LoadLibrary(str(_SO))
    except OSError as e:
        _STATE["why"] = f"cannot load {_SO} (build it with build.sh): {e}"
        return
    lib.OnednnFfiInfo.restype = ctypes.c_char_p
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.OnednnMatmul), platform="cpu")
    _STATE["lib"] = lib
    _STATE["why"] = None


def available() -> bool:
    _load()
    return _STATE["why"] is None


def why_unavailable() -> str | None:
    _load()
    return _STATE["why"]


def info() -> str:
    """oneDNN version, commit and CPU threading runtime of the loaded library."""
    _load()
    if _STATE["why"]:
        return _STATE["why"]
    return _STATE["lib"].OnednnFfiInfo().decode()


def matmul(x, w, scale=None, *, nk: bool = False, packed: bool = False):
    """float32 ``x @ w`` (``x @ w.T`` if ``nk``) through oneDNN, times ``scale`` per column.

    ``packed=True`` (measurement only): the weights are reordered once per weights *address* into
    oneDNN's preferred layout and that copy reused; new weights at an address already seen give
    stale results, and the copies are never freed.
    """
    if not available():
        raise RuntimeError(why_unavailable())
    x, w = jnp.asarray(x), jnp.asarray(w)
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError("x and w must be 2-D")
    m, k = x.shape
    n, kw = w.shape if nk else w.shape[::-1]
    if kw != k:
        raise ValueError(f"contracting dims differ: x {x.shape}, w {w.shape}, nk={nk}")
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"x must be float32 or bfloat16, not {x.dtype}")
    if w.dtype not in (jnp.float32, jnp.bfloat16, jnp.int8):
        raise TypeError(f"w must be float32, bfloat16 or int8, not {w.dtype}")
    scale = jnp.zeros((0,), jnp.float32) if scale is None else jnp.asarray(scale, jnp.float32)
    if scale.shape not in ((0,), (n,)):
        raise ValueError(f"scale must be ({n},), not {scale.shape}")
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))
    return call(x, w, scale, nk=np.bool_(nk), packed=np.bool_(packed))
