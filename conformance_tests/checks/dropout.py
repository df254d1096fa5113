"""The ``dropout`` check: identical injected keep-masks give identical outputs and gradients; the
layer's own dropout keeps ``1 - p``, scales by ``1 / (1 - p)``, keeps the mean output, and
reproduces its draw from the same ``nnx.Rngs`` seed (and not from another).

Every dropout module of both sides is found by its path (``torch.nn.Dropout``,
``nnx.Dropout``), so the check needs no knowledge of where a layer keeps its dropout.
"""

from __future__ import annotations

import zlib

import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from conformance_tests.checks.grad import flax_grads, torch_grads
from conformance_tests.compare import Row, make_row
from conformance_tests.pairs import Subject, call_flax, flax_forward, named, prepare, torch_on
from conformance_tests.tolerances import tolerance

__all__ = [
    "DROPOUT_DRAWS",
    "FlaxInjectedDropout",
    "TorchInjectedDropout",
    "check_dropout",
    "inject_dropout",
]


def _injected_keep(name: str, seed: int, rate: float, shape) -> np.ndarray:
    """The keep-mask for dropout module ``name``: the same numbers on both sides.

    Drawn flat and reshaped, so torch's ``(b, t, s)`` and the core's ``(b, 1, t, s)`` (one head)
    get the same elements in the same order.
    """
    generator = np.random.default_rng([seed, zlib.crc32(name.encode())])
    size = int(np.prod(shape))
    return (generator.random(size) >= rate).reshape(shape).astype(np.float32)


class TorchInjectedDropout(torch.nn.Module):
    """``nn.Dropout`` with a fixed keep-mask: ``x * keep / (1 - rate)``."""

    def __init__(self, name, seed, rate):
        super().__init__()
        self.name, self.seed, self.rate = name, seed, rate

    def forward(self, x):
        keep = _injected_keep(self.name, self.seed, self.rate, tuple(x.shape))
        return x * torch.from_numpy(keep).to(x.device) / (1.0 - self.rate)


class FlaxInjectedDropout(nnx.Module):
    """``nnx.Dropout`` with the same fixed keep-mask as ``TorchInjectedDropout``."""

    def __init__(self, name, seed, rate):
        self.name, self.seed, self.rate = name, seed, rate

    def __call__(self, x):
        keep = _injected_keep(self.name, self.seed, self.rate, tuple(x.shape))
        return x * jnp.asarray(keep, x.dtype) / (1.0 - self.rate)


def _flax_dropouts(fm):
    """``(torch-style name, parent, attribute)`` of every ``nnx.Dropout`` in ``fm``."""
    found = []
    for path, node in nnx.iter_graph(fm):
        if isinstance(node, nnx.Dropout):
            parent = fm
            for part in path[:-1]:
                parent = parent[part] if isinstance(part, int) else getattr(parent, part)
            found.append((".".join(map(str, path)), parent, path[-1]))
    return found


def inject_dropout(tm, fm, seed, rate):
    """Replace every dropout of both modules by the same fixed keep-masks, named by path."""
    for name, module in list(tm.named_modules()):
        if isinstance(module, torch.nn.Dropout):
            parent_name, _, attr = name.rpartition(".")
            parent = tm.get_submodule(parent_name) if parent_name else tm
            setattr(parent, attr, TorchInjectedDropout(name, seed, rate))
    for name, parent, attr in _flax_dropouts(fm):
        setattr(parent, attr, FlaxInjectedDropout(name, seed, rate))


def check_dropout(subject: Subject, backend, dtype="float32") -> list[Row]:
    """Identical injected masks give identical outputs and gradients; the layer's own dropout
    keeps ``1 - p`` of the weights, scales them by ``1 / (1 - p)``, preserves the mean output,
    and reproduces its mask from the same ``nnx.Rngs`` seed (and not from another)."""
    rate = subject.dropout
    tm, fm = subject.make_pair(dropout=rate, mesh=backend.mesh)
    tm = torch_on(tm, backend.torch_device).train()
    fm.train()
    inject_dropout(tm, fm, subject.seed, rate)
    t_inputs, t_mask, f_inputs, f_mask = prepare(backend, subject.inputs, subject.mask)
    t_out, reference, cotangents = torch_grads(subject, tm, t_inputs, t_mask)
    actual = flax_grads(subject, fm, f_inputs, f_mask, cotangents, jit=True)
    reference = {f"grad {k}": v for k, v in reference.items()}
    actual = {f"grad {k}": v for k, v in actual.items()}
    reference.update({f"output {k}": v for k, v in named(subject, t_out).items()})
    f_out = flax_forward(subject, fm, f_inputs, f_mask)
    actual.update({f"output {k}": v for k, v in named(subject, f_out).items()})
    check = "dropout/injected"
    rows = [make_row(subject.name, backend, dtype, check, reference, actual, "dropout")]
    rows.append(_dropout_statistics(subject, backend, f_inputs, f_mask, rate, dtype))
    return rows


class _Recorder(nnx.Module):
    """Wraps the layer's own ``nnx.Dropout`` and keeps what went in and came out."""

    def __init__(self, dropout: nnx.Dropout):
        self.dropout = dropout
        self.seen = nnx.data([])

    def __call__(self, x):
        y = self.dropout(x)
        self.seen.append((x, y))
        return y


DROPOUT_DRAWS = 64


def _dropout_statistics(subject: Subject, backend, f_inputs, f_mask, rate, dtype) -> Row:
    _, fm = subject.make_pair(dropout=rate, mesh=backend.mesh, draws=True)
    fm.eval()
    eval_out = np.asarray(call_flax(subject, fm, f_inputs, f_mask)[0], np.float64)
    fm.train()
    recorders = []
    for _, parent, attr in _flax_dropouts(fm):
        recorder = _Recorder(getattr(parent, attr))
        setattr(parent, attr, recorder)
        recorders.append(recorder)
    outs, kept, total, scale_err = [], 0, 0, 0.0
    for _ in range(DROPOUT_DRAWS):
        outs.append(np.asarray(call_flax(subject, fm, f_inputs, f_mask)[0], np.float64))
        for recorder in recorders:
            for x, y in recorder.seen:
                x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
                live = x != 0
                kept += int((y[live] != 0).sum())
                total += int(live.sum())
                on = live & (y != 0)
                scale_err = max(scale_err, float(np.abs(y[on] / x[on] * (1 - rate) - 1).max()))
            recorder.seen.clear()
    # kept fraction, in standard errors of a binomial proportion
    frac = kept / total
    z_kept = abs(frac - (1 - rate)) / np.sqrt(rate * (1 - rate) / total)
    # mean output over draws against the eval output, in standard errors per element
    outs = np.stack(outs)
    se = outs.std(axis=0, ddof=1) / np.sqrt(DROPOUT_DRAWS)
    z_mean = float(np.max(np.abs(outs.mean(axis=0) - eval_out) / np.maximum(se, 1e-12)))

    # the same nnx.Rngs seed reproduces the draw; another seed does not
    def draw(seed):
        _, module = subject.make_pair(
            dropout=rate, dropout_seed=seed, mesh=backend.mesh, draws=True
        )
        module.train()
        return np.asarray(call_flax(subject, module, f_inputs, f_mask)[0])

    same = np.array_equal(draw(11), draw(11))
    other = not np.array_equal(draw(11), draw(12))
    tol = tolerance("float32", "dropout:stats")
    worst = max(z_kept, z_mean)
    passed = bool(z_kept <= tol and z_mean <= tol and scale_err <= 1e-5 and same and other)
    label = f"z_kept={z_kept:.2f} z_mean={z_mean:.2f} scale_err={scale_err:.1e} seed={same}/{other}"
    # in standard errors: the bound is the entry itself (no scale)
    return Row(
        subject.name, backend.label, dtype, "dropout/stats", max_abs_err=worst,
        max_rel_err=scale_err, tol=tol, bound=tol, err_over_bound=worst / tol, passed=passed,
        worst=label,
    )  # fmt: skip
