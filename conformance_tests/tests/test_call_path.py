"""What one eager ``GPTModel`` forward runs of the package, traced with ``sys.setprofile``:
arguments are checked at the door (the model's inputs), not again by every layer inside; no
function of the mesh modules runs while no mesh is set; and the few functions it enters stay few
(``docs/performance.md``, "One forward's path", has the before and after).
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_attention
from flax_attention import models
from flax_attention._layers import narrow_product_ok

PACKAGE = os.path.dirname(flax_attention.__file__)
CFG = {
    "vocab_size": 97,
    "context_length": 16,
    "emb_dim": 32,
    "n_heads": 4,
    "n_layers": 2,
    "drop_rate": 0.0,
    "qkv_bias": True,
}
#: The package's mesh module: with no mesh set, a forward enters none of it.
MESH_MODULES = {"mesh.py"}


def _trace(call) -> dict[tuple[str, str], int]:
    """``call()`` traced: ``{(file, function): package frames}`` for each of the package's
    functions it entered, the most package frames on the stack (its own included) when it ran."""
    entered = {}

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(PACKAGE):
            return
        key = (os.path.relpath(frame.f_code.co_filename, PACKAGE), frame.f_code.co_name)
        depth, outer = 0, frame
        while outer is not None:
            depth += outer.f_code.co_filename.startswith(PACKAGE)
            outer = outer.f_back
        entered[key] = max(entered.get(key, 0), depth)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entered


#: The frames a product on the narrow kernel adds to a forward: the routing's answer, the
#: product with its derivative rule and its batching rule, and the kernel's entry.
KERNEL_FRAMES = {
    ("_layers.py", "narrow_product_ok"),
    ("_layers.py", "_narrow"),
    ("_layers.py", "product"),
    ("kernels/native/narrow.py", "matmul"),
}


@pytest.fixture(scope="module")
def model():
    model = models.GPTModel(CFG, rngs=nnx.Rngs(0))
    model.eval()
    model(jnp.zeros((1, 8), jnp.int32))  # the warm-up: every program compiled
    return model


@pytest.mark.quick
def test_one_forward_checks_at_the_door_and_runs_no_mesh_code(model):
    ids = jnp.asarray(np.arange(8).reshape(1, 8) % CFG["vocab_size"])
    entered = _trace(lambda: model(ids))
    files = {file for file, _ in entered}
    assert not files & MESH_MODULES, sorted(k for k in entered if k[0] in MESH_MODULES)
    # The routing's question is asked on every CPU; where it sends the 8 rows' float32 products
    # to the narrow kernel (AVX-512), the model's path gains the kernel's other three frames
    # and its file, and nothing else.
    kernel = {k for k in entered if k in KERNEL_FRAMES}
    weight = jnp.zeros((CFG["emb_dim"], CFG["emb_dim"]), jnp.float32)  # (k, n), as the Linears'
    asked = {("_layers.py", "narrow_product_ok")}
    assert kernel == (KERNEL_FRAMES if narrow_product_ok(8, weight) else asked), sorted(kernel)
    own, own_files = len(entered) - len(kernel), files - {f for f, _ in kernel}
    assert own <= 24 and len(own_files) <= 8, (len(entered), sorted(entered))
    # the layers inside take the hidden states as given: no input check past the model's own
    inner_checks = {k for k in entered if k[1].startswith("check_") and k[0] != "_inputs.py"}
    assert inner_checks <= {("_checks.py", "check_at_most"), ("_checks.py", "check_bool")}
    assert ("_inputs.py", "check_model_inputs") in entered
    assert ("multihead.py", "__call__") not in entered  # the blocks call its checked-once body
    # GPTModel.__call__, hidden_states, TransformerBlock.__call__, MultiHeadAttention._forward,
    # causal_attention, attend, _run_reference, _reference: the reference kernel
    assert entered[("core.py", "_reference")] <= 8, entered[("core.py", "_reference")]


def test_under_a_mesh_the_same_forward_runs_the_mesh_code(model):
    """The tracer sees the mesh modules where they have work: the first test's absence of them
    is their absence, not the tracer's blindness."""
    mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    ids = jnp.asarray(np.arange(8).reshape(1, 8) % CFG["vocab_size"])
    with jax.set_mesh(mesh):
        entered = _trace(lambda: model(ids))
    assert ("mesh.py", "constrain") in entered, sorted(entered)


@pytest.mark.quick
def test_the_model_refuses_more_tokens_than_its_context_at_its_door(model):
    """The check the attention layers made on every call (they no longer do inside a model)."""
    too_long = jnp.zeros((1, CFG["context_length"] + 1), jnp.int32)
    with pytest.raises(
        ValueError, match=r"^num_tokens \(17\) must not exceed context_length \(16\)$"
    ):
        model(too_long)
    with pytest.raises(ValueError, match=r"^num_tokens \(17\) must not exceed context_length"):
        nnx.jit(lambda m, x: m(x))(model, too_long)
