"""Which BLAS the native kernel links: sgemm on the kernel's shapes, then the kernel with each.

``python -m benchmarks.blas`` compares single-threaded ``sgemm`` from each BLAS it is given, on
the calls ``flax_attention/kernels/native/attention.cc`` makes for GPT-2 small (12 heads, head
dim 64, rows ``12 * 64 = 768`` floats apart), then builds the kernel against each BLAS and times
it alone, forward and forward+backward at b8 t256, b8 t1024 and b1 t4096 (causal), beside torch's
``scaled_dot_product_attention`` in the same run. Times are medians of calls taken round-robin;
ratios are of medians from this one run, the rounds' orders from a balanced Latin square.

BLAS (each one a package made for building against, except ``blis``):

- ``openblas32``: scipy-openblas32, the one ``setup.py`` builds with (always measured).
- ``openblas64``: scipy-openblas64 (``--openblas64 DIR``: the folder holding its package, e.g.
  ``pip install --target DIR scipy-openblas64``; found on ``sys.path`` otherwise).
- ``mkl``: Intel oneMKL, sequential layer (``--mkl PREFIX``: a prefix with ``include/mkl_cblas.h``
  and ``lib/libmkl_*.so*``, e.g. ``pip install --prefix PREFIX mkl mkl-include mkl-devel``).
- ``blis``: the BLIS inside explosion's cython-blis (``--blis DIR``, the folder holding its
  ``blis`` package). That wheel is a Python extension with no C headers: its ``bli_sgemm`` is
  measured for reference only, through a declaration written here, and does not qualify.

The kernel's source is not touched: each build compiles it with an include folder whose
``cblas.h`` includes the BLAS's own header and maps the kernel's ``scipy_cblas_sgemm`` to the
BLAS's name. Each build's FFI targets are registered under their own names and the package's
``native_attention`` is traced with those names, so every build runs the same Python path.
The result records the CPU, the load average before and after, and each BLAS's version and
code path (OpenBLAS's core; the CPU-specific MKL libraries it loaded). Every sgemm call kind is
checked against numpy's float64 product and every build's output and gradients against SDPA's.
Options: ``--repeats`` (rounds; 4 makes one whole Latin square of 4 timed things), ``--shapes
8x256,1x4096`` (kernel shapes), ``--no-kernel``, ``--json PATH``, ``--build-cache DIR`` (reuse
the builds of an earlier run kept there: ``build``), and ``--quick``: two small sgemm shapes and
the kernel at b1 t128, one timed call each (the smoke check the tests run).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import glob
import hashlib
import importlib
import importlib.metadata
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from benchmarks.timing import median_ms, rotations
from flax_attention.kernels.native.flags import compile_flags

HEADS, HEAD_DIM = 12, 64
ROW = HEADS * HEAD_DIM  # the rows of q, k, v, out and their gradients: (b, t, h, d)
LANES = 16  # attention.cc pads a row of scores to a multiple of this

#: (query rows bq, keys n) per call: bq is the kernel's default (64 rows, 128 from 2048
#: queries), n the keys of one tile (at most 512; fewer on the causal diagonal and at t256).
SGEMM_SHAPES = ((64, 128), (64, 256), (64, 512), (128, 256), (128, 512))
QUICK_SGEMM_SHAPES = ((32, 128), (128, 256))
KERNEL_SHAPES = ((8, 256), (8, 1024), (1, 4096))
QUICK_KERNEL_SHAPES = ((1, 128),)

#: The three kinds of call (the kernel's seven sgemm call sites are these): name -> (transa,
#: transb).
#: ``QK^T``: S = Q K^T (forward and backward) and dP = dO V^T; ``PV``: O = P V and dQ = dS K;
#: ``P^T dO``: dV += P^T dO and dK += dS^T Q (accumulating, beta = 1).
OPS = {"QK^T": (False, True), "PV": (False, False), "P^T dO": (True, False)}

ROOT = pathlib.Path(__file__).resolve().parent.parent
KERNEL_SOURCE = ROOT / "flax_attention" / "kernels" / "native" / "attention.cc"

# A timing loop in C: no Python call between two sgemm calls. Built once per BLAS, against the
# same shim header as the kernel.
_BENCH_SOURCE = r"""
#include <cstdint>
#include <ctime>
#include "cblas.h"
extern "C" double flax_blas_sgemm(int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha,
                                  const float* a, int64_t lda, const float* b, int64_t ldb,
                                  float beta, float* c, int64_t ldc, int64_t calls) {
  timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int64_t i = 0; i < calls; ++i)
    scipy_cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans,
                      tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, beta, c,
                      ldc);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  return double(t1.tv_sec - t0.tv_sec) + 1e-9 * double(t1.tv_nsec - t0.tv_nsec);
}
"""

# cython-blis ships no blis.h: the typed API's declaration (dim_t and inc_t are int64_t, trans_t
# 0 or 8, as its cy.pxd says) and a row-major CBLAS call in its terms. Reference only.
_BLIS_SHIM = r"""
#pragma once
#include <cstdint>
enum CBLAS_ORDER { CblasRowMajor = 101, CblasColMajor = 102 };
enum CBLAS_TRANSPOSE { CblasNoTrans = 111, CblasTrans = 112 };
extern "C" void bli_sgemm(int transa, int transb, int64_t m, int64_t n, int64_t k,
                          const float* alpha, const float* a, int64_t rsa, int64_t csa,
                          const float* b, int64_t rsb, int64_t csb, const float* beta, float* c,
                          int64_t rsc, int64_t csc);
static inline void scipy_cblas_sgemm(CBLAS_ORDER, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb,
                                     int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                                     int64_t lda, const float* b, int64_t ldb, float beta,
                                     float* c, int64_t ldc) {
  bli_sgemm(ta == CblasTrans ? 8 : 0, tb == CblasTrans ? 8 : 0, m, n, k, &alpha, a, lda, 1, b,
            ldb, 1, &beta, c, ldc, 1);
}
"""


@dataclasses.dataclass
class Blas:
    """One BLAS: the ``cblas.h`` the builds see, how to link it, how to make it single-threaded."""

    name: str
    shim: str  # the text of the build's cblas.h
    link: list[str]  # linker arguments (with an rpath, so the builds load without help)
    library: str  # the shared library that holds sgemm (recorded)
    qualifies: bool = True  # a package made for building against
    info: dict = dataclasses.field(default_factory=dict)

    def single_threaded(self, lib: ctypes.CDLL):
        """Set the BLAS to one thread and record its version and code path; ``lib`` is a build
        linked against it (MKL's libraries load only together, as a build's dependencies)."""
        if self.name.startswith("openblas"):
            suffix = "64_" if self.name == "openblas64" else ""
            getattr(lib, f"scipy_openblas_set_num_threads{suffix}")(1)
            for field in ("config", "corename"):
                function = getattr(lib, f"scipy_openblas_get_{field}{suffix}")
                function.restype = ctypes.c_char_p
                self.info[field] = function().decode()
        elif self.name == "mkl":  # the sequential layer: one thread by construction
            buffer = ctypes.create_string_buffer(256)
            lib.MKL_Get_Version_String(buffer, 256)
            self.info["version"] = buffer.value.decode().strip()
            self.info["MKL_ENABLE_INSTRUCTIONS"] = os.environ.get("MKL_ENABLE_INSTRUCTIONS")
        elif self.name == "blis":
            lib.bli_thread_set_num_threads(ctypes.c_int64(1))
            lib.bli_info_get_version_str.restype = ctypes.c_char_p
            lib.bli_arch_string.restype = ctypes.c_char_p
            self.info["version"] = lib.bli_info_get_version_str().decode()
            self.info["arch"] = lib.bli_arch_string(lib.bli_arch_query_id()).decode()
        self.info["library"] = self.library


def _rpath(folder) -> str:
    return f"-Wl,-rpath,{folder}"


def openblas32() -> Blas:
    import scipy_openblas32 as sob

    lib_dir = sob.get_lib_dir()
    return Blas(
        name="openblas32",
        shim=f'#pragma once\n#include "{sob.get_include_dir()}/cblas.h"\n',
        link=[f"-L{lib_dir}", f"-l{sob.get_library()}", _rpath(lib_dir)],
        library=os.path.join(lib_dir, f"lib{sob.get_library()}.so"),
    )


def openblas64(folder: str | None) -> Blas:
    if folder:
        sys.path.insert(0, folder)
    # A comparison target the caller installs (``--openblas64``), not a dependency of the
    # benchmarks: looked up by name at run time, ImportError where it is absent.
    sob = importlib.import_module("scipy_openblas64")

    lib_dir = sob.get_lib_dir()
    return Blas(
        name="openblas64",
        shim=(
            f'#pragma once\n#include "{sob.get_include_dir()}/cblas.h"\n'
            "#define scipy_cblas_sgemm scipy_cblas_sgemm64_\n"
        ),
        link=[f"-L{lib_dir}", f"-l{sob.get_library()}", _rpath(lib_dir)],
        library=os.path.join(lib_dir, f"lib{sob.get_library()}.so"),
    )


def _one(pattern: str) -> str:
    found = sorted(glob.glob(pattern))
    if not found:
        raise FileNotFoundError(f"no file matches {pattern}")
    return found[0]


def mkl(prefix: str) -> Blas:
    include, lib_dir = os.path.join(prefix, "include"), os.path.join(prefix, "lib")
    # LP64 interface, sequential threading layer, core: pkg-config's mkl-dynamic-lp64-seq.
    parts = [_one(os.path.join(lib_dir, f"libmkl_{p}.so*")) for p in ("intel_lp64", "sequential")]
    core = _one(os.path.join(lib_dir, "libmkl_core.so*"))
    return Blas(
        name="mkl",
        shim=(
            f'#pragma once\n#include "{include}/mkl_cblas.h"\n'
            "#define scipy_cblas_sgemm cblas_sgemm\n"
        ),
        link=[*parts, core, "-lpthread", "-lm", "-ldl", _rpath(lib_dir)],
        library=parts[0],
    )


def blis(folder: str) -> Blas:
    extension = _one(os.path.join(folder, "blis", "cy.*.so"))
    return Blas(
        name="blis",
        shim=_BLIS_SHIM,
        link=[extension, _rpath(os.path.dirname(extension))],
        library=extension,
        qualifies=False,
    )


# ---- building ------------------------------------------------------------------------------


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise RuntimeError("no C++ compiler (set CXX, or install g++)")
    return compiler


def _flags(march: str) -> list[str]:
    """setup.py's flags for the kernel (``flags.compile_flags``: portable where ``march`` is
    empty, or one copy for ``march``), and what setuptools adds to them."""
    jaxlib = importlib.metadata.version("jaxlib")
    return [*compile_flags(jaxlib, march), "-DNDEBUG", "-fwrapv", "-fPIC", "-shared"]


def build(
    blas: Blas,
    source: str | pathlib.Path,
    workdir: pathlib.Path,
    stem: str,
    march=None,
    cache: pathlib.Path | None = None,
) -> str:
    """Compile ``source`` (a path, or C++ text) against ``blas``'s shim into ``stem.so``;
    ``march`` as ``FLAX_ATTENTION_MARCH`` says to ``setup.py`` (``None``: read from there).

    ``cache``: a folder of builds kept across runs of one checkout and environment (the tests
    keep one per test run). A build there of the same source, headers beside it, shim and
    command (compiler, flags, include folders, link arguments; the paths of this run's files
    aside) is returned instead of compiling again, and a new build is copied there
    (``python -m benchmarks.blas`` and ``benchmarks.march`` build the same kernel)."""
    if march is None:
        march = os.environ.get("FLAX_ATTENTION_MARCH", "")
    shim = workdir / f"shim_{blas.name}"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "cblas.h").write_text(blas.shim)
    if not isinstance(source, pathlib.Path):
        path = workdir / f"{stem}.cc"
        path.write_text(source)
        source = path
    out = workdir / f"{stem}.so"
    command = [_compiler(), *_flags(march), f"-I{shim}"]
    if source == KERNEL_SOURCE:
        import jax.ffi

        command += [f"-I{jax.ffi.include_dir()}"]
    command += [str(source), "-o", str(out), *blas.link]
    cached = None
    if cache is not None:
        own = {str(source): "<source>", str(out): "<out>", f"-I{shim}": "-I<shim>"}
        texts = [p.read_text() for p in (source, *sorted(source.parent.glob("*.h")))]
        key = json.dumps([[own.get(a, a) for a in command], blas.shim, texts])
        cached = pathlib.Path(cache) / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.so"
        if cached.exists():
            return str(cached)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"building {stem} failed:\n{' '.join(command)}\n{done.stderr[-4000:]}")
    if cached is not None:  # whole or absent: written beside it, then renamed
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f"{cached.stem}.{os.getpid()}.partial")
        shutil.copyfile(out, partial)
        os.replace(partial, cached)
    return str(out)


# ---- sgemm ---------------------------------------------------------------------------------


@dataclasses.dataclass
class SgemmCase:
    """One call as the kernel makes it, on buffers laid out as the kernel's."""

    op: str
    bq: int
    kend: int

    def arguments(self, rng):
        """``(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)`` with fresh inputs."""
        bq, kend, d = self.bq, self.kend, HEAD_DIM
        ld = (kend + LANES - 1) // LANES * LANES  # a row of scores

        def rows(count, stride):  # float32 in [-1, 1), ``count`` rows ``stride`` apart
            return rng.uniform(-1, 1, (count, stride)).astype(np.float32)

        if self.op == "QK^T":  # S (bq x kend, ld) = scale Q (bq x d, 768) K^T (kend x d, 768)
            return bq, kend, d, d**-0.5, rows(bq, ROW), ROW, rows(kend, ROW), ROW, 0.0, ld
        if self.op == "PV":  # O (bq x d, 768) = P (bq x kend, ld) V (kend x d, 768)
            return bq, d, kend, 1.0, rows(bq, ld), ld, rows(kend, ROW), ROW, 0.0, ROW
        # dV (kend x d, 768) += P^T (P: bq x kend, ld) dO (bq x d, 768)
        return kend, d, bq, 1.0, rows(bq, ld), ld, rows(bq, ROW), ROW, 1.0, ROW

    def flops(self) -> float:
        return 2.0 * self.bq * self.kend * HEAD_DIM


def _pointer(x):
    return x.ctypes.data_as(ctypes.c_void_p)


class SgemmTimer:
    """One BLAS's timing loop, loaded from its build."""

    def __init__(self, path: str):
        self.library = ctypes.CDLL(path)
        self.function = self.library.flax_blas_sgemm
        self.function.restype = ctypes.c_double
        i64, f32 = ctypes.c_int64, ctypes.c_float
        ptr = ctypes.c_void_p
        self.function.argtypes = [ctypes.c_int, ctypes.c_int, i64, i64, i64, f32, ptr, i64,
                                  ptr, i64, f32, ptr, i64, i64]  # fmt: skip

    def __call__(self, case: SgemmCase, arguments, c, calls: int) -> float:
        m, n, k, alpha, a, lda, b, ldb, beta, _ = arguments
        ta, tb = OPS[case.op]
        return self.function(int(ta), int(tb), m, n, k, alpha, _pointer(a), lda, _pointer(b),
                             ldb, beta, _pointer(c), c.shape[1], calls)  # fmt: skip


def _output(case: SgemmCase, arguments):
    m, n, _, _, _, _, _, _, _, ldc = arguments
    return np.zeros((m, ldc), np.float32)


def check_sgemm(timer: SgemmTimer, case: SgemmCase, rng) -> float:
    """One call against numpy's float64 product: the largest error over the standard bound
    ``k * 2**-24 * (|op(A)| |op(B)|)`` of a float32 sum of ``k`` products (<= 1 passes)."""
    arguments = case.arguments(rng)
    m, n, k, alpha, a, _, b, _, beta, _ = arguments
    c = _output(case, arguments)
    c[:] = rng.uniform(-1, 1, c.shape).astype(np.float32)
    c0 = c[:, :n].astype(np.float64)
    timer(case, arguments, c, 1)
    ta, tb = OPS[case.op]
    op_a = (a[:k, :m].T if ta else a[:m, :k]).astype(np.float64)
    op_b = (b[:n, :k].T if tb else b[:k, :n]).astype(np.float64)
    expected = alpha * op_a @ op_b + beta * c0
    bound = k * 2.0**-24 * (abs(alpha) * np.abs(op_a) @ np.abs(op_b) + beta * np.abs(c0))
    return float(np.max(np.abs(c[:, :n] - expected) / (bound + 1e-30)))


def _mkl_code_path() -> list[str]:
    """MKL's CPU-specific libraries in this process (libmkl_avx512, libmkl_avx2, libmkl_def...)."""
    kinds = ("def", "mc3", "avx", "avx2", "avx512", "avx10")
    with open("/proc/self/maps") as f:
        names = {os.path.basename(line.split()[-1]) for line in f if "libmkl_" in line}
    return sorted(n for n in names if n.split(".so")[0].removeprefix("libmkl_") in kinds)


def time_sgemm(blases, workdir, shapes, repeats, rng, cache=None) -> list[dict]:
    """Median seconds per call of each (op, shape), the BLAS taken round-robin (``cache``:
    ``build``'s)."""
    timers = {
        blas.name: SgemmTimer(
            build(blas, _BENCH_SOURCE, workdir, f"sgemm_{blas.name}", cache=cache)
        )
        for blas in blases
    }
    for blas in blases:
        blas.single_threaded(timers[blas.name].library)
        if blas.name == "mkl":  # MKL loads the kernels it chose for this CPU at its first call
            check_sgemm(timers[blas.name], SgemmCase("PV", 32, 128), rng)
            blas.info["code_path"] = _mkl_code_path()
    rows = []
    for bq, kend in shapes:
        for op in OPS:
            case = SgemmCase(op, bq, kend)
            arguments = case.arguments(rng)
            c = _output(case, arguments)
            calls = max(1, int(0.01 / (case.flops() / 50e9)))  # about 10 ms per sample
            errors = {name: check_sgemm(timer, case, rng) for name, timer in timers.items()}
            samples = {name: [] for name in timers}
            for timer in timers.values():
                timer(case, arguments, c, calls)  # warm-up
            for order in rotations(list(timers), repeats):
                for name in order:
                    samples[name].append(timers[name](case, arguments, c, calls) / calls)
            for name in timers:
                seconds = float(np.median(samples[name]))
                rows.append(
                    dict(
                        blas=name,
                        op=op,
                        bq=bq,
                        kend=kend,
                        calls=calls,
                        median_us=1e6 * seconds,
                        gflops=case.flops() / seconds / 1e9,
                        error_over_bound=errors[name],
                    )
                )
    base = {
        (r["op"], r["bq"], r["kend"]): r["median_us"] for r in rows if r["blas"] == "openblas32"
    }
    for row in rows:
        row["ratio_vs_openblas32"] = row["median_us"] / base[(row["op"], row["bq"], row["kend"])]
    return rows


# ---- the kernel ----------------------------------------------------------------------------


def _register(build_name: str, path: str) -> tuple[str, str]:
    """The FFI target names of the library at ``path``, registered as ``build_name``'s."""
    import jax

    library = ctypes.CDLL(path)
    names = (
        f"flax_attention_blas_{build_name}_forward",
        f"flax_attention_blas_{build_name}_backward",
    )
    for name, symbol in zip(names, ("FlaxAttentionForward", "FlaxAttentionBackward")):
        capsule = jax.ffi.pycapsule(getattr(library, symbol))
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    return names


def _compile(fn, args, names, backward: bool) -> object:
    """``fn(*args, targets=names)`` jitted and compiled: ``native_attention`` inside it calls the
    build ``names`` (its FFI targets) instead of the package's."""
    import functools

    import jax

    lowered = jax.jit(functools.partial(fn, targets=names)).lower(*args)
    text = lowered.as_text()
    if not all(name in text for name in names[: 2 if backward else 1]):
        raise RuntimeError(f"the trace does not call {names}: cannot time this build")
    return lowered.compile()


def time_kernel(blases, workdir, shapes, repeats, cache=None) -> list[dict]:
    """Each build's forward and forward+backward, with torch SDPA in the same round-robin. The
    kernel's products go through each build's BLAS (``native_attention(..., products="blas")``):
    on AVX-512 CPUs it would otherwise run its own micro-kernel in every build. ``cache``:
    ``build``'s."""
    import jax
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as F

    from flax_attention.kernels.native import (
        available,
        native_attention,
        why_unavailable,
    )
    from flax_attention.masking import AttentionMask

    if not available():
        raise RuntimeError(f"the package's native kernel is unavailable: {why_unavailable()}")
    causal = AttentionMask(is_causal=True)
    names = {}
    for blas in blases:
        names[blas.name] = _register(
            blas.name, build(blas, KERNEL_SOURCE, workdir, f"kernel_{blas.name}", cache=cache)
        )

    def forward(q, k, v, *, targets):
        return native_attention(q, k, v, causal, products="blas", targets=targets)

    def forward_backward(q, k, v, *, targets):  # the gradient of sum(out): d_out = 1
        def loss(q, k, v):
            return forward(q, k, v, targets=targets).sum()

        return jax.grad(loss, (0, 1, 2))(q, k, v)

    rows = []
    for batch, tokens in shapes:
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((batch, tokens, HEADS, HEAD_DIM), np.float32) for _ in "qkv")
        jq, jk, jv = (jnp.asarray(x) for x in (q, k, v))
        tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in (q, k, v))
        tg = [x.clone().requires_grad_() for x in (tq, tk, tv)]
        with torch.no_grad():
            expected = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
        expected = expected.transpose(1, 2).numpy()
        F.scaled_dot_product_attention(*tg, is_causal=True).sum().backward()
        expected_grads = [x.grad.transpose(1, 2).numpy() for x in tg]

        def sdpa(tq=tq, tk=tk, tv=tv):
            with torch.no_grad():
                F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)

        def sdpa_backward(tg=tg):
            F.scaled_dot_product_attention(*tg, is_causal=True).sum().backward()

        for mode, reference, fn in (
            ("fwd", sdpa, forward),
            ("fwd+bwd", sdpa_backward, forward_backward),
        ):
            calls, diffs = {"sdpa": reference}, {}
            for blas in blases:
                compiled = _compile(fn, (jq, jk, jv), names[blas.name], mode != "fwd")
                result = jax.block_until_ready(compiled(jq, jk, jv))
                got = [result] if mode == "fwd" else list(result)
                want = [expected] if mode == "fwd" else expected_grads
                diffs[blas.name] = max(
                    float(np.max(np.abs(np.asarray(g) - w))) for g, w in zip(got, want)
                )
                calls[blas.name] = lambda c=compiled, a=(jq, jk, jv): jax.block_until_ready(c(*a))
            ms = median_ms(calls, repeats)
            for blas in blases:
                rows.append(
                    dict(
                        blas=blas.name,
                        shape=f"b{batch} t{tokens}",
                        mode=mode,
                        median_ms=ms[blas.name],
                        sdpa_ms=ms["sdpa"],
                        ratio_vs_sdpa=ms[blas.name] / ms["sdpa"],
                        ratio_vs_openblas32=ms[blas.name] / ms["openblas32"],
                        max_abs_diff_vs_sdpa=diffs[blas.name],
                        products="blas",  # as the calls ask
                    )
                )
    return rows


# ---- the run -------------------------------------------------------------------------------


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run(
    *,
    mkl_prefix=None,
    openblas64_dir=None,
    blis_dir=None,
    repeats=4,
    quick=False,
    kernel=True,
    kernel_shapes=None,
    workdir=None,
    build_cache=None,
) -> dict:
    """Measure; the result as a dict (``machine``, ``blas``, ``sgemm`` and ``kernel`` rows).
    ``build_cache``: a folder of builds to reuse and add to (``build``'s ``cache``)."""
    blases = [openblas32()]
    if openblas64_dir or not quick:  # the quick check needs only the one that is installed
        with contextlib.suppress(ImportError):
            blases.append(openblas64(openblas64_dir))
    if mkl_prefix:
        blases.append(mkl(mkl_prefix))
    if blis_dir:
        blases.append(blis(blis_dir))
    result = {
        "machine": {
            "cpu": _cpu_model(),
            "cores": os.cpu_count(),
            "load_before": _load(),
            "march": os.environ.get("FLAX_ATTENTION_MARCH", "") or "portable",
        },
    }
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="flax_attention_blas_") as scratch:
        folder = pathlib.Path(workdir or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        sgemm_shapes = QUICK_SGEMM_SHAPES if quick else SGEMM_SHAPES
        result["sgemm"] = time_sgemm(blases, folder, sgemm_shapes, 1 if quick else repeats, rng,
                                     build_cache)  # fmt: skip
        result["blas"] = {b.name: {"qualifies": b.qualifies, **b.info} for b in blases}
        if kernel:
            built = [b for b in blases if b.name != "blis"]  # reference sgemm only
            shapes = kernel_shapes or (QUICK_KERNEL_SHAPES if quick else KERNEL_SHAPES)
            result["kernel"] = time_kernel(built, folder, shapes, 1 if quick else repeats,
                                           build_cache)  # fmt: skip
    result["machine"]["load_after"] = _load()
    return result


def _print(result: dict):
    machine = result["machine"]
    print(f"CPU {machine['cpu']} ({machine['cores']} cores), load before {machine['load_before']}")
    for name, info in result["blas"].items():
        print(f"  {name}: {json.dumps(info)}")
    print("\nsgemm, one thread: median us per call (GFLOP/s, ratio to openblas32)")
    for row in result["sgemm"]:
        print(
            f"  {row['op']:>7} bq {row['bq']:4} kend {row['kend']:5} {row['blas']:>11}: "
            f"{row['median_us']:8.2f} us ({row['gflops']:6.1f} GFLOP/s, "
            f"{row['ratio_vs_openblas32']:.2f}x) err/bound {row['error_over_bound']:.3f}"
        )
    if "kernel" in result:
        print("\nkernel alone: median ms (ratio to SDPA, ratio to openblas32)")
        for row in result["kernel"]:
            print(
                f"  {row['shape']:>10} {row['mode']:>7} {row['blas']:>11}: "
                f"{row['median_ms']:8.2f} ms (sdpa {row['sdpa_ms']:8.2f}: "
                f"{row['ratio_vs_sdpa']:.2f}x; {row['ratio_vs_openblas32']:.2f}x) "
                f"max|diff| {row['max_abs_diff_vs_sdpa']:.1e}"
            )
    print(f"\nload after {machine['load_after']}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mkl", metavar="PREFIX", help="prefix of mkl, mkl-include, mkl-devel")
    parser.add_argument("--openblas64", metavar="DIR", help="folder holding scipy_openblas64")
    parser.add_argument("--blis", metavar="DIR", help="folder holding cython-blis (reference)")
    parser.add_argument(
        "--repeats", type=int, default=4, help="rounds (a multiple of 4: whole Latin squares)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke check: small shapes, 1 call")
    parser.add_argument("--no-kernel", action="store_true", help="sgemm only")
    parser.add_argument("--shapes", help="kernel shapes as BxT,BxT (default 8x256,8x1024,1x4096)")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    parser.add_argument(
        "--build-cache", metavar="DIR", help="reuse the builds kept in DIR, and keep new ones"
    )
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    result = run(
        mkl_prefix=args.mkl,
        openblas64_dir=args.openblas64,
        blis_dir=args.blis,
        repeats=args.repeats,
        quick=args.quick,
        kernel=not args.no_kernel,
        kernel_shapes=args.shapes
        and [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")],
        build_cache=args.build_cache,
    )
    _print(result)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
