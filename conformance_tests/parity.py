"""Parity checks for your own pair: a torch module and a Flax module that should compute the same.

The built-in report runs these same checks on the spec's cases; here they run on any pair::

    rows = check_parity(torch_attn, flax_attn, [x], checks=("forward", "grad", "train"))
    assert_parity(torch_attn, flax_attn, [x])          # raises AssertionError naming the rows

The torch module's weights are moved into the Flax module first
(``flax_attention.load_state_dict(flax_module, state_dict, layout=...)``); ``key_map`` renames
torch's keys to the layout's (``{"c_attn.weight": "qkv.weight", ...}``) where they differ. A
whole model brings its own transfer instead, ``weights=(load, export)`` in torch's names::

    rows = assert_parity(hf_gpt2, flax_gpt2, [token_ids], weights=(load_weights, export_weights),
                         torch_output=lambda out: out.logits, train_steps=5)

Each check is then the report's: ``forward`` (every output, eval mode), ``grad`` (a fixed random
cotangent's gradients w.r.t. every float input and every parameter, by torch name; integer
inputs, token ids, stay integers and get none), ``train`` (50 steps, or ``train_steps``, of Adam,
AdamW and SGD with momentum, the torch module training in float64; parameters compared every 10
steps and after the last, and the trained output), ``mask`` (for a causal pair or a given
``mask_kind``: masked positions have no influence). Rows are ``harness.Row``s, in the report's
format (each with the bound its worst tensor was held against); tolerances are the report's.
The keywords are gathered and checked once as a ``ParityOptions``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flax import nnx

import flax_attention as fa
from conformance_tests.backends import Backend, backends
from conformance_tests.checks import CHECK_FUNCTIONS
from conformance_tests.compare import Row
from conformance_tests.layers import LayerSpec
from conformance_tests.pairs import Subject, is_integer
from flax_attention._checks import check_positive_int

__all__ = ["PARITY_CHECKS", "ParityOptions", "assert_parity", "check_parity"]

#: The checks a user's pair can run (``dropout`` and ``dtype`` rebuild the layer with another
#: rate or dtype, which only the spec's own layers can).
PARITY_CHECKS = ("forward", "grad", "train", "mask")


@dataclass(frozen=True)
class ParityOptions:
    """What ``check_parity`` runs (its keywords are these fields), checked when made: a bad
    one is a ``ValueError`` or ``TypeError`` naming it, its value and what was expected.

    Attributes:
      mask: the caller's mask (``1`` = attend), passed after the inputs, or ``None``.
      layout: the weight layout of the torch module's state dict (``"documents"``: the
        documents' names).
      key_map: torch key -> the layout's key, for keys named otherwise (both directions are
        derived from it: gradients and trajectories are compared under torch's names).
      weights: ``(load, export)``, the transfer of a whole model, replacing ``layout`` and
        ``key_map``: ``load(flax_module, {torch name: np.ndarray})`` loads the torch module's
        ``state_dict`` (and, for a shift-invariant key bias, some of its keys);
        ``export(flax_module) -> {torch name: np.ndarray}`` names every parameter as torch's
        ``named_parameters()`` does (a tied weight once, under the name torch keeps).
      torch_output: the torch module's return value -> its output or tuple of outputs (a
        ``transformers`` model: ``lambda out: out.logits``); ``None``: as returned.
      checks: from ``PARITY_CHECKS``.
      name: the rows' ``case`` column (default: the torch module's class name).
      causal: the pair masks the future itself (for the ``mask`` check).
      mask_kind: ``"causal"`` or ``"padding"``: what ``mask`` is (for the ``mask`` check).
      seed: seeds the cotangents, targets and perturbations.
      backend: where to run (default: the CPU, strict float32).
      train_steps: the ``train`` check's optimiser steps (a positive int; default the
        report's 50).
      reference_dtype: ``"float32"`` (the report's reference) or ``"float64"``: the torch side
        computes in float64 in the ``forward`` and ``grad`` checks too (``train`` always
        trains it in float64), so the rows measure the Flax side's float32 error against the
        exact result. float64 takes integer inputs only (token ids).
      shift_invariant: torch name -> the slice of its last axis that cannot change the output
        (the key third of a fused QKV bias); the ``train`` check leaves it out (its gradient is
        rounding noise, which Adam scales up); a separate key bias is recognised by name.
    """

    mask: Any = None
    layout: str = "documents"
    key_map: dict[str, str] | None = None
    weights: tuple | None = None
    torch_output: Callable | None = None
    checks: Sequence[str] = ("forward", "grad", "train")
    name: str | None = None
    causal: bool = False
    mask_kind: str | None = None
    seed: int = 0
    backend: Backend | None = None
    train_steps: int = 50
    reference_dtype: str = "float32"
    shift_invariant: dict | None = None

    def __post_init__(self):
        unknown = [c for c in self.checks if c not in PARITY_CHECKS]
        if unknown:
            raise ValueError(f"checks ({unknown}) must be some of {PARITY_CHECKS}")
        weights, key_map, layout = self.weights, self.key_map, self.layout
        if weights is not None and (key_map or layout != "documents"):
            raise ValueError(
                f"weights (load, export) replaces layout ({layout!r}) and key_map ({key_map!r}): "
                "pass one or the other"
            )
        if weights is not None and (len(weights) != 2 or not all(map(callable, weights))):
            raise TypeError(f"weights ({weights!r}) must be a pair of callables (load, export)")
        steps = self.train_steps
        check_positive_int("train_steps", steps)
        if self.reference_dtype not in ("float32", "float64"):
            raise ValueError(
                f"reference_dtype ({self.reference_dtype!r}) must be 'float32' or 'float64'"
            )

    def check_inputs(self, inputs) -> list[np.ndarray]:
        """The inputs as the checks take them (integer ones, token ids, stay integers; the
        others float32), refused where these options cannot use them."""
        inputs = [np.asarray(x) if is_integer(x) else np.asarray(x, np.float32) for x in inputs]
        if self.reference_dtype == "float64" and not all(is_integer(x) for x in inputs):
            raise ValueError("reference_dtype 'float64' takes integer inputs (token ids) only")
        if "mask" in self.checks and any(is_integer(x) for x in inputs):
            raise ValueError("the mask check perturbs float inputs: integer inputs cannot take it")
        return inputs


def _layout_keywords(layout: str) -> dict:
    return {} if layout == "documents" else {"layout": layout}


def _layout_transfer(flax_module, state, layout, key_map):
    """Load ``state`` (torch's names) into ``flax_module`` through ``layout`` and ``key_map``
    (strictly); returns the ``(load, export)`` pair the checks use."""
    key_map = dict(key_map or {})
    back = {ours: theirs for theirs, ours in key_map.items()}
    keywords = _layout_keywords(layout)

    def to_ours(state):
        return {key_map.get(k, k): v for k, v in state.items()}

    def export(module):
        return {back.get(k, k): v for k, v in fa.state_dict(module, **keywords).items()}

    def load(module, state):
        fa.load_state_dict(module, to_ours(state), strict=False, **keywords)

    ours = to_ours(state)
    # a buffer that follows from the configuration (the causal ``mask``) and that the torch
    # module does not carry: the Flax module's own
    own = fa.state_dict(flax_module, **keywords)
    ours.update({k: v for k, v in own.items() if k.endswith("mask") and k not in ours})
    fa.load_state_dict(flax_module, ours, strict=True, **keywords)
    return load, export


def check_parity(
    torch_module: torch.nn.Module,
    flax_module: nnx.Module,
    inputs,
    options: ParityOptions | None = None,
    **keywords,
) -> list[Row]:
    """Rows of the pair's checks (``harness.Row``, as the report prints them).

    Args:
      torch_module, flax_module: the pair. The Flax module gets the torch module's weights
        (the torch module and the Flax module you pass are not changed: each check works on
        copies).
      inputs: the positional inputs (array-likes), the same for both; the mask, if any,
        follows them in the call. Integer ones (token ids) stay integers and get no gradient;
        the others are cast to float32.
      options: a ``ParityOptions``; or its fields as keywords (``mask=..., checks=(...)``),
        not both.
    """
    if options is None:
        options = ParityOptions(**keywords)
    elif not isinstance(options, ParityOptions):
        raise TypeError(f"options ({type(options).__name__}) must be a ParityOptions or None")
    elif keywords:
        raise TypeError(
            f"options (a ParityOptions) and keywords ({', '.join(sorted(keywords))}) must not "
            "both be given: put them in the ParityOptions"
        )
    subject = _subject(torch_module, flax_module, options.check_inputs(inputs), options)
    backend = options.backend or backends(["cpu"])[0]
    rows = []
    with backend.scope():
        for check in options.checks:
            rows.extend(CHECK_FUNCTIONS[check](subject, backend, "float32"))
    return rows


def _subject(torch_module, flax_module, inputs, options: ParityOptions) -> Subject:
    """The pair as the checks see it: copies of both modules (the ones passed in are not
    changed), the Flax copy holding the torch module's weights, in eval mode."""
    mask = None if options.mask is None else np.asarray(options.mask)
    torch_module = copy.deepcopy(torch_module).eval()
    state = {k: v.detach().cpu().numpy() for k, v in torch_module.state_dict().items()}
    flax_module = nnx.clone(flax_module)
    if options.weights is not None:
        load, export = options.weights
        load(flax_module, state)
    else:
        load, export = _layout_transfer(flax_module, state, options.layout, options.key_map)
    flax_module.eval()
    layer = _layer_spec(torch_module, inputs, mask, options)
    return Subject(
        name=layer.name,
        layer_spec=layer,
        make_pair=_pair_maker(torch_module, flax_module, options.reference_dtype),
        inputs=inputs,
        mask=mask,
        mask_kind=options.mask_kind,
        seed=options.seed,
        export=export,
        load=load,
        torch_output=options.torch_output,
        train_steps=options.train_steps,
        shift_invariant=dict(options.shift_invariant or {}),
    )


def _layer_spec(torch_module, inputs, mask, options: ParityOptions) -> LayerSpec:
    """How to call the pair: the inputs in order (the last two give keys and values), the mask
    after them, and as many outputs as one call of the torch module returns."""
    with torch.no_grad():
        out = torch_module(
            *(torch.from_numpy(x) for x in inputs),
            *([] if mask is None else [torch.from_numpy(mask)]),
        )
    out = out if options.torch_output is None else options.torch_output(out)
    count = len(out) if isinstance(out, tuple) else 1
    return LayerSpec(
        options.name or type(torch_module).__name__,
        inputs=tuple(f"input.{i}" for i in range(len(inputs))),
        key_inputs=tuple(range(len(inputs)))[-2:] if len(inputs) > 1 else (0,),
        takes_mask=mask is not None,
        outputs=("out",) + tuple(f"output.{i}" for i in range(1, count)),
        causal=options.causal,
    )


def _pair_maker(torch_module, flax_module, reference_dtype: str):
    """``Subject.make_pair`` for a user's pair: fresh copies, the torch one in float64 when the
    reference is; the Flax one sharded over ``mesh`` when given (``draws`` changes nothing: a
    user's module is whole, its dropout can always draw)."""

    def make_pair(*, dtype="float32", dropout=None, dropout_seed=None, mesh=None, draws=False):
        if dtype != "float32" or dropout is not None or dropout_seed is not None:
            raise ValueError("a user's pair runs in float32 at its own dropout rate")
        reference = copy.deepcopy(torch_module).eval()
        if reference_dtype == "float64":
            reference = reference.double()
        pair = reference, nnx.clone(flax_module)
        if mesh is not None:
            fa.shard(pair[1], mesh)
        return pair

    return make_pair


def assert_parity(
    torch_module, flax_module, inputs, options: ParityOptions | None = None, **keywords
) -> list[Row]:
    """``check_parity``, raising ``AssertionError`` that names every failing row (its check, the
    worst tensor, its error over its bound, the bound and the tolerance); returns the rows when
    all pass."""
    rows = check_parity(torch_module, flax_module, inputs, options, **keywords)
    failed = [r for r in rows if not r.passed]
    if failed:
        lines = [
            f"{r.case} {r.check}: worst tensor {r.worst!r} at {r.err_over_bound:.2f} x its bound "
            f"{r.bound:.1e} (tol {r.tol:.1e} * max(1, max|reference|)); max_abs_err "
            f"{r.max_abs_err:.3e}"
            for r in failed
        ]
        raise AssertionError(
            f"{len(failed)} of {len(rows)} parity rows failed:\n" + "\n".join(lines)
        )
    return rows
