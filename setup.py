"""Builds the native CPU kernels: attention (``flax_attention/kernels/native/attention.cc``) and
the narrow-weight products (``narrow.cc``), and the in-place cache write and bfloat16
embedding lookup (``cache.cc``) of decode steps, one library.

Everything else about the package is in ``pyproject.toml``. The kernel is an optional extension:
where there is no C++ compiler, or jax / scipy-openblas32 headers are missing, the install goes
on without it and ``flax_attention.kernels.native.why_unavailable()`` says so. The library is not
a Python module: the package loads it with ``ctypes`` and registers it with ``jax.ffi``.
"""

import os
import runpy

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

        flags_file = os.path.join("flax_attention", "kernels", "native", "flags.py")
        flags = runpy.run_path(flags_file)["compile_flags"](version("jaxlib"))
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
                "flax_attention/kernels/native/cache.cc",
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
