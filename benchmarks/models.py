"""The benchmarked modules: GPT-2 small ``MultiHeadAttention`` in both frameworks, one set of
weights.

- ``torch_reference.MultiHeadAttention``: the documents' eager module (scores materialised).
- ``SDPAMultiHeadAttention``: the same module and ``state_dict``, its core replaced by
  ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)``.
- ``TorchKVCache``: a decode loop for the torch module (projected keys/values appended per step,
  each new query attends to the cache), the torch counterpart of ``flax_attention.decode_loop``.
- ``make_modules``: the torch modules and the Flax module holding the torch weights.
- ``loaded``: a Flax module holding given weights, built without drawing the ones it replaces.

Shape legend: ``b`` batch, ``t`` tokens, ``h`` heads, ``d`` head_dim, ``s`` cached tokens.
"""

from __future__ import annotations

import jax
import numpy as np
import torch
from flax import nnx

import flax_attention as fa
import torch_reference as tr
from benchmarks.torch_device import device, to_numpy
from benchmarks.torch_modules import SDPAMultiHeadAttention, TorchKVCache

__all__ = [
    "GPT2",
    "SDPAMultiHeadAttention",
    "TorchKVCache",
    "loaded",
    "make_modules",
    "torch_generate",
]

#: GPT-2 small attention: d_in = d_out = 768, 12 heads of 64, context 1024, biased projections.
#: ``context_length`` is raised per call where a shape needs more tokens (t = 4096 ... 32768);
#: it only sizes the torch ``mask`` buffer and the Flax length check.
GPT2 = dict(d_in=768, d_out=768, context_length=1024, dropout=0.0, num_heads=12, qkv_bias=True)


@torch.no_grad()
def torch_generate(mha, prompt, num_steps: int, max_length: int):
    """Prefill ``prompt`` ``(b, t, d_in)`` then ``num_steps`` steps feeding each output back, as
    ``flax_attention.decode_loop``: returns ``(b, num_steps + 1, d_out)``."""
    cache = TorchKVCache(mha, prompt.shape[0], max_length)
    y = cache(prompt)[:, -1:]  # (b, 1, d_out)
    outputs = [y]
    for _ in range(num_steps):
        y = cache(y)
        outputs.append(y)
    return torch.cat(outputs, dim=1)


def make_modules(context_length: int = GPT2["context_length"], seed: int = 0):
    """``(torch_eager, torch_sdpa, flax_module)`` in eval mode, all with one set of weights
    (torch's initialisation under ``seed``, loaded into the others); torch's two on
    ``torch_device.device()``."""
    config = {**GPT2, "context_length": context_length}
    args = [config[k] for k in ("d_in", "d_out", "context_length", "dropout", "num_heads")]
    torch.manual_seed(seed)
    eager = tr.MultiHeadAttention(*args, qkv_bias=config["qkv_bias"]).eval()
    sdpa = SDPAMultiHeadAttention(*args, qkv_bias=config["qkv_bias"]).eval()
    weights = eager.state_dict()
    sdpa.load_state_dict(weights)
    eager.to(device()), sdpa.to(device())
    module = loaded(
        lambda: fa.MultiHeadAttention(*args, qkv_bias=config["qkv_bias"], rngs=nnx.Rngs(seed)),
        {k: to_numpy(v) for k, v in weights.items()},
    )
    module.eval()
    return eager, sdpa, module


def loaded(make, state_dict):
    """``make()``'s module holding ``state_dict`` (``flax_attention.load_state_dict``, strict),
    the same as ``make()`` followed by the load, but its parameters are never drawn: the module
    is built abstract (``nnx.eval_shape``) and only its other state (RNG streams, buffers) is
    computed, as ``flax_attention.models.checkpoints.new_model`` does for a checkpoint. Drawing
    weights that the load replaces would compile an initialiser per parameter shape."""
    module = nnx.eval_shape(make)
    # Only the rest of the state comes out of this jit, so XLA drops every parameter's initialiser.
    nnx.update(module, jax.jit(lambda: nnx.state(make(), nnx.Not(nnx.Param)))())
    fa.load_state_dict(module, state_dict)
    return module


def random_input(batch: int, tokens: int, d_in: int = GPT2["d_in"], seed: int = 0):
    """Standard-normal float32 ``(batch, tokens, d_in)`` (NumPy)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, tokens, d_in), dtype=np.float32)
