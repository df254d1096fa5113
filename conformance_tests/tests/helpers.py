"""What the test files share: small cases of every layer from the spec's layer table, the pair
and gradients from the harness, and the assertions the robustness tests repeat.

Nothing here knows a layer by name: ``small_case(name)`` reads the layer's ``LayerSpec``
(``conformance_tests/layers.py``, the only layer table) and fills in ``SMALL``.
"""

from __future__ import annotations

import pathlib
import re

import numpy as np
import torch

import flax_attention as fa
from conformance_tests import harness, spec
from conformance_tests.layers import LAYER_SPECS

ROOT = pathlib.Path(__file__).resolve().parents[2]

__all__ = [
    "ROOT",
    "error_templates",
    "LAYERS",
    "SMALL",
    "assert_finite",
    "assert_untouched",
    "forward_and_grads",
    "max_diff",
    "small_case",
    "small_pair",
    "snapshot",
    "to_numpy",
]

#: Every layer with weights, in the documents' order.
LAYERS = spec.LAYERS

#: Small sizes shared by every layer, so eager ops and jitted calls compile once per layer: 5
#: tokens of 4 features (document 001: 6, its ``d_model``), 2 heads of 3, bias on.
SMALL = {
    "batch": 2,
    "d_in": 4,
    "d_out": 6,
    "d_model": 6,
    "head_dim": 3,
    "num_heads": 2,
    "context_length": 5,
    "dropout": 0.0,
    "qkv_bias": True,
    "num_kv_groups": 1,  # the grouped-query layer's: one key head for the 2 (multi-query)
}


def small_case(
    layer: str, *, dropout: float = 0.0, mask=None, name: str = "small", **sizes
) -> spec.Case:
    """A spec ``Case`` of ``layer`` at ``SMALL`` sizes (overridden by ``sizes``), ``num_tokens``
    5 (its ``context_length``), seed 0, named ``{name}_{layer}`` (the name seeds its inputs)."""
    layer_spec = LAYER_SPECS[layer]
    sizes = {**SMALL, "dropout": dropout, **sizes}
    args = layer_spec.args_for(sizes)
    inputs = layer_spec.input_shapes(sizes, num_tokens=sizes["context_length"])
    return spec.Case(f"{name}_{layer}", layer, args, inputs, mask=mask, checks=("forward",))


def small_pair(case: spec.Case, torch_dtype=torch.float32, flax_dtype="float32"):
    """torch's layer (weights from the case's seed, document 001's cloned projections made
    distinct) and the Flax layer computing in ``flax_dtype`` with the same weights, in eval
    mode: ``harness.build_pair`` in memory."""
    tm, fm = harness.build_pair(case, None, dtype=flax_dtype, distinct_clones=True)
    return tm.to(torch_dtype), fm


def to_numpy(x) -> np.ndarray:
    """float64 NumPy of a torch tensor (bfloat16 included) or a jax array (exact)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy().astype(np.float64)
    return np.asarray(x).astype(np.float64)


def assert_finite(what: str, tensors: dict):
    for name, value in tensors.items():
        value = to_numpy(value)
        bad = int((~np.isfinite(value)).sum())
        assert bad == 0, f"{what}: {name} holds {bad} NaN/inf of {value.size}"


def forward_and_grads(case, tm, fm, inputs, mask=None):
    """Outputs (by name) and gradients (inputs and parameters, by torch name) of both sides in
    float32; the Flax side compiled once per shape."""
    t_inputs = [torch.from_numpy(x) for x in inputs]
    t_mask = None if mask is None else torch.from_numpy(mask)
    t_out, t_grads, cotangents = harness.torch_grads(case, tm, t_inputs, t_mask)
    f_inputs = [np.asarray(x) for x in inputs]
    f_out = harness.flax_forward(case, fm, f_inputs, mask)
    f_grads = harness.flax_grads(case, fm, f_inputs, mask, cotangents, jit=True)
    names = harness.output_names(case)
    return dict(zip(names, t_out)), t_grads, dict(zip(names, f_out)), f_grads


def snapshot(module) -> dict[str, np.ndarray]:
    """Every array of a Flax layer, by torch name, copied."""
    return {k: np.array(v, copy=True) for k, v in fa.state_dict(module).items()}


def max_diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max()) if a.shape == b.shape and a.size else float("inf")


def assert_untouched(module, before, what):
    """``module`` holds exactly ``before`` (a ``snapshot``), array by array and dtype by dtype."""
    after = snapshot(module)
    assert set(after) == set(before), f"{what}: keys changed {sorted(set(after) ^ set(before))}"
    for key, value in before.items():
        assert after[key].dtype == value.dtype and np.array_equal(after[key], value), (
            f"{what}: {key} changed (max abs diff {max_diff(after[key], value):.3e})"
        )


def error_templates(heading: str) -> list[re.Pattern]:
    """The backticked messages of the table under ``## heading`` in docs/errors.md as regexes
    (``<...>`` stands for any value)."""
    match = re.search(
        rf"^## {heading}\n(.*?)(?=^## |\Z)",
        (ROOT / "docs" / "errors.md").read_text(),
        flags=re.S | re.M,
    )
    assert match, f"docs/errors.md has no '## {heading}' section"
    rows = [line for line in match.group(1).splitlines() if line.startswith("|")][2:]
    messages = [row.split("|")[-2].strip().strip("`") for row in rows]
    assert messages, f"docs/errors.md '{heading}': no table"
    return [re.compile(re.sub(r"<[^<>]+>", ".+", re.escape(m)) + "$") for m in messages]
