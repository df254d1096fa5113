"""The examples run and show what they claim."""

from __future__ import annotations

import pathlib
import runpy

import pytest
from jax.sharding import PartitionSpec as P

ROOT = pathlib.Path(__file__).resolve().parents[2]
LINEN = runpy.run_path(str(ROOT / "examples" / "linen_bridge.py"))


@pytest.mark.quick
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


def test_the_annotated_copy_example_learns_and_decodes(capsys):
    """The post's copy task, small (d_model 64, 10 epochs of 10 batches of 40, dropout 0): the
    loss per token falls by half and greedy decoding of 0..9 gives 10 ids
    starting with the start symbol."""
    copy = runpy.run_path(str(ROOT / "examples" / "annotated_copy.py"))
    # dropout 0: the step compiles in a third of the time (the RNG ops of 22 dropouts)
    small = "--epochs 10 --batches 10 --batch-size 40 --d-model 64 --d-ff 128 --heads 4 --dropout 0"
    decoded = copy["main"]([*small.split(), "--warmup", "40"])
    output = capsys.readouterr().out.splitlines()
    losses = [float(line.split()[5]) for line in output if line.startswith("epoch")]
    assert len(losses) == 10 and losses[-1] < 0.5 * losses[0], losses
    assert len(decoded) == 10 and decoded[0] == 0 and all(0 <= i < 11 for i in decoded)
    assert output[-1] == "decoded: " + " ".join(map(str, decoded))
