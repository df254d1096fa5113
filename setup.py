"""Builds the native CPU kernels: attention (``flax_attention/kernels/native/attention.cc``) and
the narrow-weight products of decode steps (``narrow.cc``), one library.

Everything else about the package is in ``pyproject.toml``. The kernel is an optional extension:
where there is no C++ compiler, or jax / scipy-openblas32 headers are missing, the install goes
on without it and ``flax_attention.kernels.native.why_unavailable()`` says so. The library is not
a Python module: the package loads it with ``ctypes`` and registers it with ``jax.ffi``.
"""

import os
import platform

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildNative(build_ext):
    """Headers from ``jax.ffi.include_dir()`` and scipy-openblas32, found at build time."""

    def build_extensions(self):
        try:
            import jax.ffi
            import scipy_openblas32
        except ImportError as error:
            print(f"flax_attention: not building the native kernel ({error})")
            self.extensions = []
            return
        from importlib.metadata import version

        # The FFI's API version follows jaxlib: the library records which one it was built
        # against, and the package loads it only under that jaxlib.
        flags = [
            "-std=c++17",
            "-O3",
            "-fopenmp-simd",
            f'-DFLAX_ATTENTION_JAXLIB="{version("jaxlib")}"',
        ]
        # Portable: on x86-64 attention.cc's hot functions are compiled for AVX-512, AVX2 and
        # baseline x86-64, and the widest the CPU runs is picked when the library loads.
        # FLAX_ATTENTION_MARCH=native (or x86-64-v3, ...) builds one copy for that -march only.
        march = os.environ.get("FLAX_ATTENTION_MARCH", "")
        if march and platform.machine() in ("x86_64", "AMD64"):
            flags += [f"-march={march}", "-DFLAX_ATTENTION_ONE_ARCH"]
        for ext in self.extensions:
            ext.include_dirs += [jax.ffi.include_dir(), scipy_openblas32.get_include_dir()]
            ext.library_dirs += [scipy_openblas32.get_lib_dir()]
            ext.libraries += [scipy_openblas32.get_library()]
            ext.extra_compile_args += flags
        super().build_extensions()

    def get_export_symbols(self, ext):
        return []  # a plain shared library, no PyInit_ function

    def get_ext_filename(self, fullname):
        return os.path.join(*fullname.split(".")) + ".so"  # found by the package with a glob


setup(
    ext_modules=[
        Extension(
            "flax_attention.kernels.native._attention",
            sources=[
                "flax_attention/kernels/native/attention.cc",
                "flax_attention/kernels/native/narrow.cc",
            ],
            depends=[
                "flax_attention/kernels/native/parallel.h",
                "flax_attention/kernels/native/narrow_body.h",
            ],
            language="c++",
            optional=True,  # a failed build leaves the package without the kernel
        )
    ],
    cmdclass={"build_ext": BuildNative},
)
