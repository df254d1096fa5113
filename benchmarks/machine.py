"""The machine header: CPU, cores, memory, library versions, backend, load, date."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform

import jax

__all__ = ["describe", "load_average"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    wanted = ("avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")
                    return " ".join(flag for flag in wanted if flag in flags)
    except OSError:
        pass
    return ""


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


#: What limits the instruction sets of the libraries a run times, where set: XLA's CPU
#: compiler, torch's kernels, oneDNN, MKL, OpenBLAS. All of them set on an AVX-512 CPU make it an
#: AVX2 stand-in (docs/performance.md, "The book's modern attention on CPU").
ISA_VARIABLES = (
    "XLA_FLAGS",
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "OPENBLAS_CORETYPE",
)


def _isa_limits() -> str:
    """The ``ISA_VARIABLES`` set, and what torch's kernels and the native kernel's loaded copy
    run (the kernel's build, ``FLAX_ATTENTION_MARCH``, shows only in its vector width)."""
    import torch

    from flax_attention.kernels import native

    parts = [f"{name}={os.environ[name]}" for name in ISA_VARIABLES if os.environ.get(name)]
    parts.append(f"torch {torch.backends.cpu.get_cpu_capability()}")
    if native.available():
        parts.append(f"native kernel {native._micro_width()}-float vectors, "
                     f"{native.products()} products")  # fmt: skip
    return "; ".join(parts)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _torch_device() -> str:
    """Where torch runs (``benchmarks.torch_device``), with the GPU's name on CUDA."""
    import torch

    from benchmarks.torch_device import device

    where = device()
    return f"cuda ({torch.cuda.get_device_name(where)})" if where.type == "cuda" else "cpu"


def describe(torch_threads: int) -> dict:
    """Everything the table's header prints (also the JSON's ``machine``)."""
    memory = _mem_total_gib()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "isa": _isa_limits(),
        "cores": os.cpu_count(),
        "memory_gib": None if memory is None else round(memory, 1),
        "python": platform.python_version(),
        "jax": _version("jax"),
        "jaxlib": _version("jaxlib"),
        "flax": _version("flax"),
        "torch": _version("torch"),
        "numpy": _version("numpy"),
        "backend": jax.default_backend(),
        "devices": ", ".join(str(d) for d in jax.devices()),
        "jax_default_matmul_precision": str(jax.config.jax_default_matmul_precision),
        "torch_device": _torch_device(),
        "torch_threads": torch_threads,
        "load_average_start": load_average(),
    }
