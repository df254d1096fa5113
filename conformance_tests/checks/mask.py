"""The ``mask`` check: masked positions have no influence, on both sides; fully masked rows are
uniform. Which inputs carry the keys, and whether the layer masks itself causally, come from its
``LayerSpec``."""

from __future__ import annotations

import numpy as np
import torch

from conformance_tests.checks.grad import flax_grads, torch_grads
from conformance_tests.compare import Row, make_row, to_numpy
from conformance_tests.pairs import Subject, call_torch, flax_forward, prepare, rng, torch_on

__all__ = ["check_mask"]


def check_mask(subject: Subject, backend, dtype="float32") -> list[Row]:
    """Masked positions have no influence, on both sides; fully masked rows are uniform.

    - causal (every causal layer, and a caller's causal mask): changing the key inputs from
      position ``k`` on leaves the outputs before ``k`` exactly as they were;
    - padding: changing masked keys and values leaves every output as it was;
    - fully masked row (the annotated-transformer post): that row's weights are ``1 / k_len``
      everywhere and every output and gradient is finite.
    Each side is compared with itself (before/after), so the expected error is 0.
    """
    kind = subject.mask_kind
    tm, fm = subject.make_pair(mesh=backend.mesh)
    tm = torch_on(tm, backend.torch_device)
    inputs, mask = subject.inputs, subject.mask
    perturbed, rows_kept = _perturb_masked(subject)

    def outputs_of(xs):
        t_in, t_mask, f_in, f_mask = prepare(backend, xs, mask)
        with torch.no_grad():
            t_out = call_torch(subject, tm, t_in, t_mask)[0]
        f_out = flax_forward(subject, fm, f_in, f_mask)[0]
        return to_numpy(t_out)[..., rows_kept, :], to_numpy(f_out)[..., rows_kept, :]

    (t_before, f_before), (t_after, f_after) = outputs_of(inputs), outputs_of(perturbed)
    if kind == "fully_masked_row":  # that row attends to every key, future ones included
        for out in (t_before, f_before, t_after, f_after):
            out[0, 0] = 0.0
    reference = {"torch, masked positions changed": t_before, "flax, ...": f_before}
    actual = {"torch, masked positions changed": t_after, "flax, ...": f_after}
    ok = True
    if kind == "fully_masked_row":
        ok = _fully_masked_row(subject, backend, tm, fm, reference, actual)
    check = f"mask/{kind or 'causal'}"
    return [make_row(subject.name, backend, dtype, check, reference, actual, "mask", ok=ok)]


def _perturb_masked(subject: Subject):
    """``(perturbed inputs, the output rows the change must not reach)``: padding changes the
    masked keys and values (every row kept); causal changes the key inputs from position
    ``k = t // 2`` on (rows before ``k`` kept)."""
    layer, kind, inputs, mask = subject.layer_spec, subject.mask_kind, subject.inputs, subject.mask
    causal = kind in ("causal", "fully_masked_row") or layer.causal
    perturbed = [x.copy() for x in inputs]
    generator = rng(subject, "perturb")
    t_len = inputs[0].shape[-2]
    if kind != "padding" and t_len < 2:
        raise ValueError(f"case {subject.name}: a causal mask check needs >= 2 tokens ({t_len})")
    k = max(1, t_len // 2)
    if kind == "padding":
        keep = mask.reshape(mask.shape[0], -1)  # (b, s): 1 = attended key
        for i in layer.key_inputs:
            x = perturbed[i]
            x += generator.standard_normal(x.shape).astype(np.float32) * (1 - keep)[..., None]
        return perturbed, slice(None)
    if causal:
        for i in layer.key_inputs:
            x = perturbed[i]
            x[..., k:, :] += generator.standard_normal(x[..., k:, :].shape).astype(np.float32)
        return perturbed, slice(0, k)
    raise ValueError(f"case {subject.name}: the mask check needs a mask or a causal layer")


def _fully_masked_row(subject: Subject, backend, tm, fm, reference, actual) -> bool:
    """Adds the masked row's weights on both sides against uniform ``1 / k_len`` to
    ``reference``/``actual``; returns whether every gradient on both sides is finite."""
    layer = subject.layer_spec
    weights_at = layer.output_names.index(layer.weights_output)
    t_in, t_mask, f_in, f_mask = prepare(backend, subject.inputs, subject.mask)
    with torch.no_grad():
        t_weights = call_torch(subject, tm, t_in, t_mask)[weights_at]
    f_weights = flax_forward(subject, fm, f_in, f_mask)[weights_at]
    uniform = np.full(f_weights.shape[1:2] + f_weights.shape[-1:], 1.0 / f_weights.shape[-1])
    reference.update({"torch weights, masked row": uniform, "flax weights, masked row": uniform})
    actual["torch weights, masked row"] = to_numpy(t_weights)[0, :, 0, :]
    actual["flax weights, masked row"] = to_numpy(f_weights)[0, :, 0, :]
    _, t_grads, cot = torch_grads(subject, tm, t_in, t_mask)
    f_grads = flax_grads(subject, fm, f_in, f_mask, cot, jit=True)
    return all(np.isfinite(to_numpy(g)).all() for g in (*t_grads.values(), *f_grads.values()))
