"""Every ``flax_attention`` layer inside a Linen model, through ``flax.nnx.bridge.to_linen``.

``to_linen(Layer, *args)`` is a Linen module: ``init`` creates the NNX layer and returns its
parameters as Linen variables (boxed with the layer's partition metadata, so
``nn.get_partition_spec(variables)`` gives the same ``(None, "model")``/``("model", None)``
specs as ``flax_attention.shard``), and ``apply`` runs it. This script checks, for each layer,
that Linen's ``init``/``apply`` equal the NNX layer holding the same weights, both ways round:
Linen-initialised weights loaded into NNX, and NNX weights passed to Linen's ``apply``.

Run: ``python examples/linen_bridge.py`` (``conformance_tests/tests/test_examples.py`` runs it).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import linen as nn
from flax import nnx
from flax.nnx import bridge

import flax_attention as fa

rng = np.random.default_rng(0)
x = rng.standard_normal((2, 6, 8)).astype(np.float32)  # (b, num_tokens, d_in)
memory = rng.standard_normal((2, 5, 8)).astype(np.float32)  # (b, k_len, d_model)

#: name -> (layer class, positional constructor arguments (dropout 0: Linen has no .eval()),
#: call arguments).
LAYERS = {
    "SelfAttention_v1": (fa.SelfAttention_v1, (8, 4), (x,)),
    "SelfAttention_v2": (fa.SelfAttention_v2, (8, 4, True), (x,)),
    "CausalAttention": (fa.CausalAttention, (8, 4, 6, 0.0), (x,)),
    "MultiHeadAttentionWrapper": (fa.MultiHeadAttentionWrapper, (8, 4, 6, 0.0, 2), (x,)),
    "MultiHeadAttention": (fa.MultiHeadAttention, (8, 8, 6, 0.0, 2), (x,)),
    "MultiHeadedAttention": (fa.MultiHeadedAttention, (2, 8, 0.0), (x, memory, memory)),
    "GroupedQueryAttention": (fa.GroupedQueryAttention, (8, 8, 0.0, 2, 1), (x,)),
    "MultiHeadLatentAttention": (fa.MultiHeadLatentAttention, (8, 8, 0.0, 2), (x,)),
    "MultiHeadAttentionWithSWA": (fa.MultiHeadAttentionWithSWA, (8, 8, 0.0, 2), (x,)),
}


def _max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def compare(name: str) -> dict:
    """Linen against NNX for one layer, both ways round, and the Linen partition specs."""
    layer_class, args, inputs = LAYERS[name]
    linen_layer = bridge.to_linen(layer_class, *args)
    keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    variables = linen_layer.init(keys, *inputs)
    y_linen = linen_layer.apply(variables, *inputs)

    # Linen -> NNX: an NNX layer (other weights at first) takes the weights Linen's init drew.
    nnx_layer = layer_class(*args, rngs=nnx.Rngs(1))
    before = _max_diff(y_linen, nnx_layer(*inputs))
    nnx.update(nnx_layer, nn.unbox(variables["params"]))
    after = _max_diff(y_linen, nnx_layer(*inputs))

    # NNX -> Linen: another NNX layer's weights, as a plain nested dict, run by Linen.
    other = layer_class(*args, rngs=nnx.Rngs(2))
    params = nnx.to_pure_dict(nnx.state(other, nnx.Param))
    y_other = linen_layer.apply({"params": params}, *inputs)
    return {
        "before": before,  # different weights: must differ, or the checks below prove nothing
        "linen init -> nnx": after,
        "nnx -> linen apply": _max_diff(y_other, other(*inputs)),
        "linen apply moved": _max_diff(y_other, y_linen),  # Linen really used the new weights
        "specs": nn.get_partition_spec(variables)["params"],
    }


if __name__ == "__main__":
    for name in LAYERS:
        result = compare(name)
        print(
            f"{name:<27} linen init -> nnx {result['linen init -> nnx']:.1e}   "
            f"nnx -> linen apply {result['nnx -> linen apply']:.1e}"
        )
