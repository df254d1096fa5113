"""Where torch runs beside JAX in the benchmarks: on CUDA when JAX's default backend is a GPU
and torch sees one (the pairing of ``conformance_tests.backends``), else on the CPU. Every
section that times torch against Flax places torch's modules and inputs with these, so both
frameworks run on the same kind of device.

- ``device()``: that ``torch.device``.
- ``to_torch(array)``: a NumPy array as a tensor there (the same dtype).
- ``to_numpy(tensor)``: back on the host, detached.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import torch

__all__ = ["device", "to_numpy", "to_torch"]


@functools.cache
def device() -> torch.device:
    if jax.default_backend() == "gpu" and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def to_torch(array) -> torch.Tensor:
    return torch.from_numpy(np.asarray(array)).to(device())


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy()
