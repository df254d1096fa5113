"""Section ``speed``: forward and forward+backward at GPT-2 small sizes, in float32 or, with
``--dtype bfloat16`` (``Config.speed_dtype``), everything in bfloat16: the Flax layer's parameters
and input, and torch's two modules (the same rounded weights); each row's note then names it.

Every Flax implementation is ``jax.jit`` over the state of ``nnx.split`` (the module rebuilt with
``nnx.merge`` inside the traced function); forward+backward is ``jax.grad`` of the sum of the
outputs w.r.t. the parameters and the input. torch runs eager with
``torch.set_num_threads(os.cpu_count())``, under ``torch.no_grad()`` for the forward, and
``torch.autograd.grad`` of the same sum for forward+backward. Before timing, every output (and
every gradient) is compared with the documents' torch module; the callables of one shape and mode
are then timed round-robin (``timing.interleaved``) after one warm-up call each (the compile).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import flax_attention as fa
from benchmarks.models import make_modules, random_input
from benchmarks.rows import make_row, max_diffs
from benchmarks.timing import interleaved
from benchmarks.torch_device import to_numpy, to_torch
from conformance_tests.tolerances import tolerance
from flax_attention.kernels import native

__all__ = [
    "as_named",
    "flax_forward",
    "flax_forward_backward",
    "flax_grads_by_torch_name",
    "flax_implementations",
    "plan_calls",
    "run",
    "torch_forward",
    "torch_forward_backward",
]

#: Parity bound before timing, by the section's dtype: max |flax - torch| / max(1, max |torch|)
#: per tensor. bfloat16's is the spec's bfloat16 forward tolerance, for the gradients too (both
#: sides round every activation, the documents' torch module included).
TOLERANCE = {"float32": 1e-4, "bfloat16": tolerance("bfloat16", "forward")}


def flax_implementations() -> list[str | None]:
    """Every implementation that runs on the default backend (``None`` = the default)."""
    impls: list[str | None] = ["reference", "xla", "blocked"]
    if jax.default_backend() == "cpu" and native.available():
        impls.append("native")
    if jax.default_backend() == "gpu":
        impls.append("cudnn")
    return [*impls, None]


def _label(implementation):
    return "default" if implementation is None else implementation


def torch_forward(module, x):
    """``module(x)`` under ``torch.no_grad()``, as a callable (also ``benchmarks.modern``'s)."""

    def call():
        with torch.no_grad():
            return module(x)

    return call


def torch_forward_backward(module, x):
    """A callable: the gradients of ``sum(module(x))`` w.r.t. ``x`` and every parameter, by
    name (``{"x": ..., torch name: ...}``)."""
    x = x.clone().requires_grad_(True)
    names = [name for name, _ in module.named_parameters()]
    params = [p for _, p in module.named_parameters()]

    def call():
        out = module(x)
        grads = torch.autograd.grad(out.sum(), [x, *params])
        return {"x": grads[0], **dict(zip(names, grads[1:]))}

    return call


def flax_forward(module, implementation, x):
    """A callable: ``module(x)`` with ``implementation``, jitted over ``nnx.split``."""
    module.implementation = implementation
    graphdef, state = nnx.split(module)
    forward = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    return lambda: forward(state, x)


def flax_forward_backward(module, implementation, x):
    """A callable: ``(param_grads, dx)`` of ``sum(module(x))``, jitted
    (``flax_grads_by_torch_name`` names them as torch does)."""
    module.implementation = implementation
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def loss(params, x):
        return nnx.merge(graphdef, params, rest)(x).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return lambda: grad(params, x)


def flax_grads_by_torch_name(module, grads):
    """``(param_grads, dx)`` -> ``{"x": dx, torch name: grad in torch layout}``."""
    param_grads, dx = grads
    holder = nnx.clone(module)
    nnx.update(holder, param_grads)
    named = {k: v for k, v in fa.state_dict(holder).items() if k != "mask"}
    return {"x": np.asarray(dx), **named}


def as_named(result):
    """A call's result on the host as ``{name: array}`` (a lone output: ``{"out": ...}``)."""

    def host(v):
        if isinstance(v, torch.Tensor):  # NumPy has no bfloat16 of torch's
            return to_numpy(v.float() if v.dtype == torch.bfloat16 else v)
        return np.asarray(v)

    if isinstance(result, dict):
        return {k: host(v) for k, v in result.items()}
    return {"out": host(result)}


def plan_calls(config) -> int:
    """Calls the progress bar counts: per shape and mode, each callable once per repeat + 1."""
    n = len(flax_implementations()) + 2
    return sum(
        n * (config.repeats_for(shape) + 1)
        for shape in config.speed_shapes
        for _ in config.speed_modes
    )


@dataclasses.dataclass(frozen=True)
class _Shape:
    """One shape's three modules (the same weights) and its input in both frameworks."""

    batch: int
    tokens: int
    dtype: str  # of the parameters and the input, in both frameworks (SPEED_DTYPES)
    eager: torch.nn.Module  # the documents' module: every output is checked against it
    sdpa: torch.nn.Module
    module: fa.MultiHeadAttention
    x_torch: torch.Tensor  # (b, t, d_in)
    x_jax: jax.Array  # the same values

    @property
    def case(self) -> str:
        return f"b{self.batch}_t{self.tokens}"

    def note(self, text: str = "") -> str:
        """A row's note, the dtype first where it is not float32."""
        if self.dtype == "float32":
            return text
        return f"{self.dtype}; {text}" if text else self.dtype


def _tick(progress, n=1):
    if progress is not None:
        progress.update(n)


def run(config, progress=None) -> list[dict]:
    """Rows of every shape and mode; torch's thread count is the caller's (``cli`` sets it)."""
    rows, dtype = [], config.speed_dtype
    for batch, tokens in config.speed_shapes:
        eager, sdpa, module = make_modules(context_length=max(1024, tokens))
        x_np = random_input(batch, tokens)
        x_torch, x_jax = to_torch(x_np), jnp.asarray(x_np)
        if dtype != "float32":
            _cast(dtype, eager, sdpa, module)
            x_torch, x_jax = x_torch.to(getattr(torch, dtype)), x_jax.astype(dtype)
        shape = _Shape(batch, tokens, dtype, eager, sdpa, module, x_torch, x_jax)
        for mode in config.speed_modes:
            rows += _run_shape_mode(config, shape, mode, progress)
    return rows


def _cast(dtype, eager, sdpa, module) -> None:
    """Every parameter of the three modules in ``dtype``, in place: torch's two through
    ``.to``, the Flax layer's the same float32 values rounded the same way (to nearest even)."""
    eager.to(getattr(torch, dtype)), sdpa.to(getattr(torch, dtype))
    params = nnx.state(module, nnx.Param)
    nnx.update(module, jax.tree.map(lambda p: p.astype(dtype), params))


def _run_shape_mode(config, shape, mode, progress):
    """Check every callable against the documents' module, then time those that agree."""
    repeats = config.repeats_for((shape.batch, shape.tokens))
    torch_call = torch_forward if mode == "forward" else torch_forward_backward
    calls = {"eager": torch_call(shape.eager, shape.x_torch),
             "sdpa": torch_call(shape.sdpa, shape.x_torch)}  # fmt: skip
    resolved = {"eager": "eager", "sdpa": "sdpa"}
    skipped, diffs = {}, {}

    reference_out = as_named(calls["eager"]())  # the documents' module: what all are checked on
    _tick(progress)
    diffs["eager"] = (0.0, 0.0)
    diffs["sdpa"] = max_diffs(as_named(calls["sdpa"]()), reference_out)
    _tick(progress)
    for implementation in flax_implementations():
        name = _label(implementation)
        reason = config.speed_skip.get((name, mode, shape.batch, shape.tokens))
        if not reason:
            try:
                call, result = _flax_call(shape, implementation, mode)
            except Exception as error:  # noqa: BLE001 - e.g. cudnn refusing float32: a row says so
                reason = f"{type(error).__name__}: {error}"[:200]
        if reason:
            skipped[name] = reason
            _tick(progress, repeats + 1)
            continue
        _tick(progress)
        diffs[name] = max_diffs(result, reference_out)
        if diffs[name][1] > TOLERANCE[shape.dtype]:
            skipped[name] = f"outputs differ from torch (max rel {diffs[name][1]:.1e}): not timed"
            continue
        calls[name] = call
        q = shape.x_jax[..., None, :64]  # (b, t, 1, 64): the layer's heads' dtype and size
        causal = fa.AttentionMask(is_causal=True)
        resolved[name] = implementation or fa.select_implementation(q, q, mask=causal)

    timings = interleaved(calls, repeats, progress)
    return _rows(shape, mode, timings, resolved, diffs, skipped)


def _flax_call(shape, implementation, mode):
    """``(call, its first result by torch name)``: the first call compiles."""
    if mode == "forward":
        call = flax_forward(shape.module, implementation, shape.x_jax)
        return call, as_named(call())
    call = flax_forward_backward(shape.module, implementation, shape.x_jax)
    return call, flax_grads_by_torch_name(shape.module, call())


def _rows(shape, mode, timings, resolved, diffs, skipped):
    """One row per callable, torch's two first; ratios over torch's medians of the same run."""
    eager_ms, sdpa_ms = timings["eager"]["median_ms"], timings["sdpa"]["median_ms"]
    row = functools.partial(make_row, "speed", shape.case, mode, batch=shape.batch,
                            tokens=shape.tokens)  # fmt: skip
    rows = []
    for name in ["eager", "sdpa", *(_label(i) for i in flax_implementations())]:
        framework = "torch" if name in ("eager", "sdpa") else "flax"
        if name in skipped:
            rows.append(row(framework, name, skipped=True, note=shape.note(skipped[name]),
                            diffs=diffs.get(name)))  # fmt: skip
            continue
        timing = timings[name]
        rows.append(
            row(framework, name, resolved=resolved[name], timing=timing,
                ratio_vs_eager=timing["median_ms"] / eager_ms,
                ratio_vs_sdpa=timing["median_ms"] / sdpa_ms, diffs=diffs[name],
                note=shape.note())
        )  # fmt: skip
    return rows
