"""The ``train`` check: 50 optimiser steps on both sides, parameters compared every 10 steps."""

from __future__ import annotations

import contextlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx

from conformance_tests.checks.grad import flax_grads, torch_grads
from conformance_tests.compare import Row, make_row, to_numpy
from conformance_tests.optimisers import OPTIMIZERS
from conformance_tests.pairs import (
    Subject,
    call_flax,
    call_torch,
    flax_forward,
    prepare,
    rng,
    to_torch,
    torch_on,
)
from conformance_tests.spec import is_shift_invariant

__all__ = ["COMPARE_EVERY", "TRAIN_STEPS", "check_train"]

TRAIN_STEPS = 50
COMPARE_EVERY = 10


def check_train(subject: Subject, backend, dtype="float32") -> list[Row]:
    """50 optimiser steps on both sides (``subject.train_steps``); parameters compared every 10
    steps and after the last, outputs at the end.

    The objective regresses the layer's output onto a fixed random target (mean squared error).
    The torch side trains in float64 from the same float32 weights and inputs: the reference is
    the trajectory itself, not one float32 rounding of it. Two float32 runs each drift from it by
    their own rounding, which Adam's normalised steps carry forward; comparing them adds the two
    drifts (``gqa_6heads_2groups`` on an AVX2 CPU: torch's 7.0e-6 and Flax's 4.3e-6 made
    1.13e-5, past the bound). Shift-invariant parameters (the key bias) are compared by their
    gradient (zero on both sides) and their effect (none), in a row of their own.
    """
    inputs, mask, steps = subject.inputs, subject.mask, subject.train_steps
    runs = []  # per optimiser: its torch run and what its Flax run starts from
    for opt_name, (make_torch_opt, make_optax) in OPTIMIZERS.items():
        tm, fm = subject.make_pair(mesh=backend.mesh)
        tm = torch_on(tm, backend.torch_device).double()
        t_inputs, t_mask, f_inputs, f_mask = prepare(backend, inputs, mask)
        t_inputs, t_mask = [_float64(x) for x in t_inputs], _float64(t_mask)
        with _float64_default(), torch.no_grad():
            out_shape = call_torch(subject, tm, t_inputs, t_mask)[0].shape
        target = rng(subject, "target").standard_normal(tuple(out_shape)).astype(np.float32)
        t_target = _float64(to_torch(target, backend.torch_device))

        optimizer = make_torch_opt(tm.parameters())
        t_snapshots = []
        with _float64_default():
            for step in range(1, steps + 1):
                optimizer.zero_grad()
                out = call_torch(subject, tm, t_inputs, t_mask)[0]
                ((out - t_target) ** 2).mean().backward()
                optimizer.step()
                if step % COMPARE_EVERY == 0 or step == steps:
                    t_snapshots.append({n: p.detach().clone() for n, p in tm.named_parameters()})
        graphdef, params, rest = nnx.split(fm, nnx.Param, ...)
        tx = make_optax()
        runs.append(
            types.SimpleNamespace(
                name=opt_name, tm=tm, t_inputs=t_inputs, t_mask=t_mask, f_inputs=f_inputs,
                f_mask=f_mask, t_snapshots=t_snapshots, graphdef=graphdef, rest=rest, tx=tx,
                f_target=jnp.asarray(target), params=params, opt_state=tx.init(params),
            )
        )  # fmt: skip

    def loss_fn(params, run):
        module = nnx.merge(run.graphdef, params, run.rest)
        out = call_flax(subject, module, run.f_inputs, run.f_mask)[0]
        return ((out - run.f_target) ** 2).mean()

    # Every optimiser's step in one program: one compilation per case instead of one per
    # optimiser (each step's operations are its own; the three share nothing but the program).
    @jax.jit
    def step_all(states):
        new = []
        for (params, opt_state), run in zip(states, runs):
            grads = jax.grad(loss_fn)(params, run)
            updates, opt_state = run.tx.update(grads, opt_state, params)
            new.append((optax.apply_updates(params, updates), opt_state))
        return new

    states = [(run.params, run.opt_state) for run in runs]
    f_snapshots = [[] for _ in runs]
    for step in range(1, steps + 1):
        states = step_all(states)
        if step % COMPARE_EVERY == 0 or step == steps:
            for snapshots, (params, _), run in zip(f_snapshots, states, runs):
                snapshots.append(subject.export(nnx.merge(run.graphdef, params, run.rest)))

    rows = []
    for run, snapshots, (params, _) in zip(runs, f_snapshots, states):
        reference, actual = {}, {}
        for t_snap, f_snap, at in zip(run.t_snapshots, snapshots, _snapshot_steps(steps)):
            for name, value in t_snap.items():
                if not is_shift_invariant(name):
                    reference[f"{name}@{at}"] = _variant_part(subject, name, value)
                    actual[f"{name}@{at}"] = _variant_part(subject, name, f_snap[name])
        with _float64_default(), torch.no_grad():
            reference["output"] = call_torch(subject, run.tm, run.t_inputs, run.t_mask)[0]
        trained = nnx.merge(run.graphdef, params, run.rest)
        actual["output"] = flax_forward(subject, trained, run.f_inputs, run.f_mask)[0]
        rows.append(
            make_row(subject.name, backend, dtype, f"train/{run.name}", reference, actual, "train")
        )
    return rows + _check_shift_invariant(subject, backend, dtype)


@contextlib.contextmanager
def _float64_default():
    """torch's default dtype float64 inside (tensors a module makes as it runs, a causal mask's
    ``torch.ones``, follow its float64 weights); the one before it put back on exit."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def _float64(x):
    """A floating torch tensor in float64; token ids and ``None`` as they are."""
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _variant_part(subject: Subject, name: str, value):
    """``value`` without the slice ``subject.shift_invariant`` names for it (if any)."""
    part = getattr(subject, "shift_invariant", {}).get(name)
    if part is None:
        return value
    value = to_numpy(value)
    keep = np.ones(value.shape[-1], bool)
    keep[part] = False
    return value[..., keep]


def _snapshot_steps(steps: int) -> list[int]:
    """The steps the parameters are compared after: every ``COMPARE_EVERY``, and the last."""
    return sorted({*range(COMPARE_EVERY, steps + 1, COMPARE_EVERY), steps})


def _check_shift_invariant(subject: Subject, backend, dtype) -> list[Row]:
    """The key bias: zero gradient on both sides, and no effect on the output when changed."""
    tm, fm = subject.make_pair(mesh=backend.mesh)
    names = [n for n, _ in tm.named_parameters() if is_shift_invariant(n)]
    if not names:
        return []
    tm = torch_on(tm, backend.torch_device)
    t_inputs, t_mask, f_inputs, f_mask = prepare(backend, subject.inputs, subject.mask)
    _, t_grads, cotangents = torch_grads(subject, tm, t_inputs, t_mask)
    f_grads = flax_grads(subject, fm, f_inputs, f_mask, cotangents, jit=True)
    reference, actual = {}, {}
    for n in names:
        zero = np.zeros(tuple(t_grads[n].shape), np.float32)
        reference[f"grad {n} (torch)"], actual[f"grad {n} (torch)"] = zero, t_grads[n]
        reference[f"grad {n} (flax)"], actual[f"grad {n} (flax)"] = zero, f_grads[n]

    with torch.no_grad():
        before_t = call_torch(subject, tm, t_inputs, t_mask)[0]
    before_f = flax_forward(subject, fm, f_inputs, f_mask)[0]
    shifted = {
        n: rng(subject, f"shift/{n}").standard_normal(tuple(t_grads[n].shape)) for n in names
    }
    with torch.no_grad():
        params = dict(tm.named_parameters())
        for n, v in shifted.items():
            params[n].copy_(torch.from_numpy(v.astype(np.float32)))
        after_t = call_torch(subject, tm, t_inputs, t_mask)[0]
    subject.load(fm, {n: v.astype(np.float32) for n, v in shifted.items()})
    after_f = flax_forward(subject, fm, f_inputs, f_mask)[0]
    reference.update({"output after a new key bias (torch)": before_t})
    actual.update({"output after a new key bias (torch)": after_t})
    reference.update({"output after a new key bias (flax)": before_f})
    actual.update({"output after a new key bias (flax)": after_f})
    return [make_row(subject.name, backend, dtype, "train/key_bias", reference, actual, "train")]
