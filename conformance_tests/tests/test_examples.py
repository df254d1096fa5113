"""The examples run and show what they claim."""

from __future__ import annotations

import pathlib
import runpy

import pytest
from jax.sharding import PartitionSpec as P

ROOT = pathlib.Path(__file__).resolve().parents[2]
LINEN = runpy.run_path(str(ROOT / "examples" / "linen_bridge.py"))


def test_linen_bridge_covers_every_layer():
    import flax_attention as fa
    from conformance_tests.spec import LAYERS

    wrapped = set(LINEN["LAYERS"])
    assert wrapped == set(LAYERS) - {"SelfAttention"}  # SelfAttention is SelfAttention_v2
    assert fa.SelfAttention is fa.SelfAttention_v2


@pytest.mark.parametrize("name", list(LINEN["LAYERS"]))
def test_linen_init_and_apply_equal_nnx(name):
    result = LINEN["compare"](name)
    assert result["before"] > 1e-3, f"{name}: the two weight sets give the same output"
    assert result["linen apply moved"] > 1e-3, f"{name}: Linen's apply ignored the new weights"
    assert result["linen init -> nnx"] <= 1e-6, f"{name}: {result}"
    assert result["nnx -> linen apply"] <= 1e-6, f"{name}: {result}"
    specs = result["specs"]
    if name == "SelfAttention_v1":
        assert specs["W_query"] == P(None, "model")
    elif name == "MultiHeadAttentionWrapper":
        assert specs["heads"][0]["W_query"]["kernel"] == P(None, "model")
    elif name == "MultiHeadedAttention":
        assert specs["proj_weights"][0]["kernel"] == P(None, "model")
        assert specs["proj_weights"][3]["kernel"] == P("model", None)
    else:
        assert specs["W_query"]["kernel"] == P(None, "model")
    if name == "MultiHeadAttention":
        assert specs["out_proj"]["kernel"] == P("model", None)
