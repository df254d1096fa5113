"""Where both sides run: backends (a jax device or mesh and the matching torch device), and the
numerics each one sets for the duration of a check, restored on exit."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import jax
import numpy as np
import torch
from jax.sharding import AxisType

__all__ = [
    "DEFAULT_PRECISION",
    "Backend",
    "backends",
    "make_mesh",
    "parse_mesh",
    "torch_tf32",
]

#: What ``--precision default`` means on each backend, for the tolerance table: the backend's
#: default float32 matmul (``None``: full float32, as strict).
DEFAULT_PRECISION = {"cpu": None, "gpu": "tf32", "tpu": "bf16"}


@contextlib.contextmanager
def torch_tf32(allow: bool):
    """Set torch's two TF32 switches (matmul and cuDNN) to ``allow``; put back what they were
    on exit, whatever happens inside."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (matmul.allow_tf32, cudnn.allow_tf32)
    matmul.allow_tf32 = cudnn.allow_tf32 = allow
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved


@dataclass(frozen=True)
class Backend:
    """Where both sides run: a jax device (or a mesh of them) and the matching torch device."""

    name: str  # "cpu", "gpu" or "tpu"
    jax_device: object
    torch_device: str
    strict: bool = True  # highest matmul precision in jax, TF32 off in torch
    mesh: object = None  # a jax.sharding.Mesh ("data", "model"): the Flax side runs sharded

    @property
    def label(self) -> str:
        """The report's backend column: ``cpu``, ``gpu/default``, ``cpu[mesh 2x4]``, ..."""
        label = self.name if self.strict else f"{self.name}/default"
        if self.mesh is not None:
            label += f"[mesh {'x'.join(str(n) for n in self.mesh.devices.shape)}]"
        return label

    @property
    def precision(self) -> str | None:
        """The float32 matmul precision in effect: ``None`` (full float32), ``"tf32"`` or
        ``"bf16"``; it picks the tolerance entries."""
        return None if self.strict else DEFAULT_PRECISION[self.name]

    @contextlib.contextmanager
    def scope(self):
        """This backend's device, matmul precision (jax) and TF32 switches (torch), and its mesh;
        every one of them is restored on exit (jax's through its own context managers)."""
        precision = "highest" if self.strict else "default"
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch_tf32(not self.strict))
            stack.enter_context(jax.default_device(self.jax_device))
            stack.enter_context(jax.default_matmul_precision(precision))
            if self.mesh is not None:
                stack.enter_context(jax.set_mesh(self.mesh))
            yield


def parse_mesh(text: str) -> tuple[int, int]:
    """``"2x4"`` -> ``(2, 4)``: the sizes of the mesh's ``data`` and ``model`` axes."""
    parts = str(text).lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"mesh ({text!r}) must be DATAxMODEL with positive sizes (e.g. 2x4)")
    return int(parts[0]), int(parts[1])


def make_mesh(platform: str, shape: tuple[int, int]) -> jax.sharding.Mesh:
    """A ``("data", "model")`` mesh of ``shape`` over the first devices of ``platform``.

    Raises ``ValueError`` when fewer devices exist than the mesh needs (on CPU, saying how to get
    more: ``XLA_FLAGS=--xla_force_host_platform_device_count=N``)."""
    needed = int(np.prod(shape))
    devices = jax.devices(platform)
    if len(devices) < needed:
        hint = (
            f"; on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={needed} "
            "in the environment before Python starts"
            if platform == "cpu"
            else ""
        )
        raise ValueError(
            f"mesh ({shape[0]}x{shape[1]}) must fit the {platform} devices present "
            f"({len(devices)}, {needed} needed){hint}"
        )
    grid = np.array(devices[:needed]).reshape(shape)
    return jax.sharding.Mesh(grid, ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def backends(names=None, strict=True, mesh=None) -> list[Backend]:
    """Every backend both frameworks see: CPU always, then GPU (CUDA) and TPU when present.

    ``mesh`` (``(data, model)``, e.g. ``(2, 4)``) runs the Flax side of every check sharded over
    a mesh of that backend's devices (``flax_attention.shard``, inputs over ``data``)."""
    found = [Backend("cpu", jax.devices("cpu")[0], "cpu", strict)]
    with contextlib.suppress(RuntimeError):
        gpus = jax.devices("gpu")
        if gpus and torch.cuda.is_available():
            found.append(Backend("gpu", gpus[0], "cuda", strict))
    with contextlib.suppress(RuntimeError):
        tpus = jax.devices("tpu")
        if tpus:  # torch has no TPU here: the reference runs on the CPU
            found.append(Backend("tpu", tpus[0], "cpu", strict))
    if names:
        unknown = set(names) - {b.name for b in found}
        if unknown:
            raise ValueError(
                f"backend ({', '.join(sorted(unknown))}) must be one of those present "
                f"({', '.join(b.name for b in found)})"
            )
        found = [b for b in found if b.name in names]
    if mesh is not None:
        found = [dataclasses.replace(b, mesh=make_mesh(b.name, tuple(mesh))) for b in found]
    return found
