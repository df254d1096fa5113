"""Parity checks for your own pair: a torch module and a Flax module that should compute the same.

The built-in report runs these same checks on the spec's cases; here they run on any pair::

    rows = check_parity(torch_attn, flax_attn, [x], checks=("forward", "grad", "train"))
    assert_parity(torch_attn, flax_attn, [x])          # raises AssertionError naming the rows

The torch module's weights are moved into the Flax module first
(``flax_attention.load_state_dict(flax_module, state_dict, layout=...)``); ``key_map`` renames
torch's keys to the layout's (``{"c_attn.weight": "qkv.weight", ...}``) where they differ. Each
check is then the report's: ``forward`` (every output, eval mode), ``grad`` (a fixed random
cotangent's gradients w.r.t. every input and every parameter, by torch name), ``train`` (50
steps of Adam, AdamW and SGD with momentum; parameters compared every 10 steps, and the trained
output), ``mask`` (for a causal pair or a given ``mask_kind``: masked positions have no
influence). Rows are ``harness.Row``s, in the report's format; tolerances are the report's.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from flax import nnx

import flax_attention as fa
from conformance_tests.backends import Backend, backends
from conformance_tests.checks import CHECK_FUNCTIONS
from conformance_tests.compare import Row
from conformance_tests.layers import LayerSpec
from conformance_tests.pairs import Subject

__all__ = ["PARITY_CHECKS", "assert_parity", "check_parity"]

#: The checks a user's pair can run (``dropout`` and ``dtype`` rebuild the layer with another
#: rate or dtype, which only the spec's own layers can).
PARITY_CHECKS = ("forward", "grad", "train", "mask")


def _layout_keywords(layout: str) -> dict:
    return {} if layout == "documents" else {"layout": layout}


def check_parity(
    torch_module: torch.nn.Module,
    flax_module: nnx.Module,
    inputs,
    *,
    mask=None,
    layout: str = "documents",
    key_map: dict[str, str] | None = None,
    checks=("forward", "grad", "train"),
    name: str | None = None,
    causal: bool = False,
    mask_kind: str | None = None,
    seed: int = 0,
    backend: Backend | None = None,
) -> list[Row]:
    """Rows of ``checks`` for the pair (``harness.Row``, as the report prints them).

    Args:
      torch_module, flax_module: the pair. The Flax module gets the torch module's weights
        (the torch module and the Flax module you pass are not changed: each check works on
        copies).
      inputs: the positional inputs (array-likes, float32), the same for both; the mask, if
        any, follows them in the call.
      mask: the caller's mask (``1`` = attend), passed after the inputs, or ``None``.
      layout: the weight layout of the torch module's state dict (``"documents"``: the
        documents' names).
      key_map: torch key -> the layout's key, for keys named otherwise (both directions are
        derived from it: gradients and trajectories are compared under torch's names).
      checks: from ``PARITY_CHECKS``.
      name: the rows' ``case`` column (default: the torch module's class name).
      causal: the pair masks the future itself (for the ``mask`` check).
      mask_kind: ``"causal"`` or ``"padding"``: what ``mask`` is (for the ``mask`` check).
      seed: seeds the cotangents, targets and perturbations.
      backend: where to run (default: the CPU, strict float32).
    """
    unknown = [c for c in checks if c not in PARITY_CHECKS]
    if unknown:
        raise ValueError(f"checks ({unknown}) must be some of {PARITY_CHECKS}")
    inputs = [np.asarray(x, np.float32) for x in inputs]
    mask = None if mask is None else np.asarray(mask)
    key_map = dict(key_map or {})
    back = {ours: theirs for theirs, ours in key_map.items()}
    keywords = _layout_keywords(layout)

    def to_ours(state):
        return {key_map.get(k, k): v for k, v in state.items()}

    def export(module):
        return {back.get(k, k): v for k, v in fa.state_dict(module, **keywords).items()}

    def load(module, state):
        fa.load_state_dict(module, to_ours(state), strict=False, **keywords)

    torch_module = copy.deepcopy(torch_module).eval()
    state = {k: v.detach().cpu().numpy() for k, v in torch_module.state_dict().items()}
    flax_module = nnx.clone(flax_module)
    ours = to_ours(state)
    # a buffer that follows from the configuration (the causal ``mask``) and that the torch
    # module does not carry: the Flax module's own
    own = fa.state_dict(flax_module, **keywords)
    ours.update({k: v for k, v in own.items() if k.endswith("mask") and k not in ours})
    fa.load_state_dict(flax_module, ours, strict=True, **keywords)
    flax_module.eval()
    with torch.no_grad():
        out = torch_module(
            *(torch.from_numpy(x) for x in inputs),
            *([] if mask is None else [torch.from_numpy(mask)]),
        )
    count = len(out) if isinstance(out, tuple) else 1
    layer = LayerSpec(
        name or type(torch_module).__name__,
        inputs=tuple(f"input.{i}" for i in range(len(inputs))),
        key_inputs=tuple(range(len(inputs)))[-2:] if len(inputs) > 1 else (0,),
        takes_mask=mask is not None,
        outputs=("out",) + tuple(f"output.{i}" for i in range(1, count)),
        causal=causal,
    )

    def make_pair(*, dtype="float32", dropout=None, dropout_seed=None, mesh=None):
        if dtype != "float32" or dropout is not None or dropout_seed is not None:
            raise ValueError("a user's pair runs in float32 at its own dropout rate")
        pair = copy.deepcopy(torch_module).eval(), nnx.clone(flax_module)
        if mesh is not None:
            fa.shard(pair[1], mesh)
        return pair

    subject = Subject(
        name=layer.name,
        layer_spec=layer,
        make_pair=make_pair,
        inputs=inputs,
        mask=mask,
        mask_kind=mask_kind,
        seed=seed,
        export=export,
        load=load,
    )
    backend = backend or backends(["cpu"])[0]
    rows = []
    with backend.scope():
        for check in checks:
            rows.extend(CHECK_FUNCTIONS[check](subject, backend, "float32"))
    return rows


def assert_parity(torch_module, flax_module, inputs, **options) -> list[Row]:
    """``check_parity``, raising ``AssertionError`` that names every failing row (its check, the
    worst tensor, its error and tolerance); returns the rows when all pass."""
    rows = check_parity(torch_module, flax_module, inputs, **options)
    failed = [r for r in rows if not r.passed]
    if failed:
        lines = [
            f"{r.case} {r.check}: worst tensor {r.worst!r} max_abs_err {r.max_abs_err:.3e} "
            f"(tol {r.tol:.1e})"
            for r in failed
        ]
        raise AssertionError(
            f"{len(failed)} of {len(rows)} parity rows failed:\n" + "\n".join(lines)
        )
    return rows
