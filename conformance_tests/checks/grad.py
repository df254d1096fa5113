"""The ``grad`` check, and the gradients every other check takes: ``torch_grads`` and the one
``flax_grads`` (compiled with XLA's fusion off, as the grad check runs it, or compiled once per
shape)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from conformance_tests.compare import Row, make_row, to_numpy
from conformance_tests.pairs import (
    Subject,
    call_flax,
    call_torch,
    export_of,
    prepare,
    rng,
    torch_on,
)

__all__ = ["check_grad", "flax_grads", "torch_grads"]


def _cotangents(described, outputs) -> list[np.ndarray]:
    generator = rng(described, "cotangent")
    return [generator.standard_normal(tuple(o.shape)).astype(np.float32) for o in outputs]


def torch_grads(described, tm, inputs, mask, cotangents=None):
    """Outputs and gradients of ``sum(outputs * cotangents)`` w.r.t. inputs and parameters.

    ``cotangents`` default to standard normal ones seeded by ``described`` (a case or subject).
    Integer inputs (token ids) get no gradient (no ``input.<i>`` entry).
    """
    device = inputs[0].device
    inputs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    outputs = call_torch(described, tm, inputs, mask)
    cotangents = _cotangents(described, outputs) if cotangents is None else cotangents
    loss = sum((o * torch.from_numpy(c).to(device)).sum() for o, c in zip(outputs, cotangents))
    params = dict(tm.named_parameters()) if isinstance(tm, torch.nn.Module) else {}
    wrt = {f"input.{i}": x for i, x in enumerate(inputs) if x.is_floating_point()}
    wrt.update(params)
    grads = torch.autograd.grad(loss, list(wrt.values()), allow_unused=True)
    grads = {n: (torch.zeros_like(p) if g is None else g) for (n, p), g in zip(wrt.items(), grads)}
    return outputs, grads, cotangents


def _loss_of(outputs, cotangents):
    return sum((o.astype(jnp.float32) * c).sum() for o, c in zip(outputs, cotangents))


def _param_grads(described, graphdef, params, rest, inputs, mask, cotangents):
    """Gradients w.r.t. the parameters and ``{i: gradient}`` of the float inputs (integer ones,
    token ids, are constants)."""
    floats = [i for i, x in enumerate(inputs) if jnp.issubdtype(x.dtype, jnp.floating)]

    def loss(params, diff):
        xs = list(inputs)
        for i, x in zip(floats, diff):
            xs[i] = x
        outputs = call_flax(described, nnx.merge(graphdef, params, rest), xs, mask)
        return _loss_of(outputs, cotangents)

    g_params, g_inputs = jax.grad(loss, argnums=(0, 1))(params, [inputs[i] for i in floats])
    return g_params, dict(zip(floats, g_inputs))


#: The grad check's compilation: XLA's fusion passes off (the CPU's ``fusion``; the GPU's
#: ``priority-fusion`` and ``multi_output_fusion`` too, names a backend lacks being ignored), so
#: each operation is a kernel of its own and rounds its result to the dtype, as op-by-op (eager)
#: execution does, in one compilation instead of one per operation. Checked on the CPU (the
#: compiled HLO holds one operation per fusion); a GPU's other fusions (GEMM epilogues) are not.
UNFUSED = {"xla_disable_hlo_passes": "fusion,priority-fusion,multi_output_fusion"}


def _unfused_param_grads(described, graphdef, params, rest, inputs, mask, cotangents):
    run = jax.jit(functools.partial(_param_grads, described, graphdef))
    compiled = run.lower(params, rest, inputs, mask, cotangents).compile(UNFUSED)
    return compiled(params, rest, inputs, mask, cotangents)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _jit_param_grads(layer, call_args, graphdef, params, rest, inputs, mask, cotangents):
    described = Subject("jit", layer, None, [], call_args=call_args)
    return _param_grads(described, graphdef, params, rest, inputs, mask, cotangents)


def flax_grads(described, fm, inputs, mask, cotangents, *, jit=False) -> dict:
    """The same as ``torch_grads`` for the Flax side, parameters by torch name and layout.

    ``jit=True`` compiles the gradient once per layer, configuration and shape (the tests, which
    reuse shapes, and the train and dropout checks). Without it, as the ``grad`` check runs, it
    is compiled for this call with XLA's fusion off (``UNFUSED``): each operation rounds on its
    own, as op by op. Fused, the rounding of ``v1_wide``'s saturated-softmax gradient (a
    cancellation) moves its row from 0.08 to 0.85 of its bound (docs/conformance.md). A
    function's gradient runs op by op.
    """
    cotangents = [jnp.asarray(c) for c in cotangents]
    if described.layer_spec.is_function:
        g_inputs = jax.grad(lambda xs: _loss_of(call_flax(described, fm, xs, mask), cotangents))(
            list(inputs)
        )
        return {f"input.{i}": g for i, g in enumerate(g_inputs)}
    graphdef, params, rest = nnx.split(fm, nnx.Param, ...)
    if jit:
        layer, call_args = described.layer_spec, tuple(described.call_args)
        g_params, g_inputs = _jit_param_grads(
            layer, call_args, graphdef, params, rest, list(inputs), mask, cotangents
        )
    else:
        g_params, g_inputs = _unfused_param_grads(
            described, graphdef, params, rest, list(inputs), mask, cotangents
        )
    grads = {f"input.{i}": g for i, g in g_inputs.items()}
    by_name = export_of(described)(nnx.merge(graphdef, g_params, rest))
    grads.update({n: v for n, v in by_name.items() if not n.endswith("mask")})  # no buffers
    return grads


def check_grad(subject: Subject, backend, dtype="float32") -> list[Row]:
    """Gradients of a fixed random cotangent w.r.t. every input and parameter, by torch name."""
    tm, fm = subject.make_pair(mesh=backend.mesh)
    tm = torch_on(tm, backend.torch_device)
    t_inputs, t_mask, f_inputs, f_mask = prepare(backend, subject.inputs, subject.mask)
    _, reference, cotangents = torch_grads(subject, tm, t_inputs, t_mask)
    actual = flax_grads(subject, fm, f_inputs, f_mask, cotangents)
    finite = all(bool(np.isfinite(to_numpy(g)).all()) for g in actual.values())
    return [make_row(subject.name, backend, dtype, "grad", reference, actual, ok=finite)]
