"""The book's mixture-of-experts feed-forward (Qwen3-30B-A3B's), without a loop over experts.

The book's ``MoEFeedForward`` (``llms_from_scratch.qwen3``) scores the experts with ``gate``,
keeps each token's ``num_experts_per_tok`` best, softmaxes their scores, and sums the chosen
experts' SwiGLU outputs (``fc3[e](silu(fc1[e](x)) * fc2[e](x))``) weighted by them; it runs every
expert on every token in a Python loop over its ``nn.ModuleList`` of experts. Here the
experts' weights are three stacked parameters, ``fc1`` and ``fc2`` ``(E, d, hidden)`` and
``fc3`` ``(E, hidden, d)``, which the weight bridge names as the book's ``fc1.{e}.weight``, ...
(``Names.stacked``, each the transpose of a slice, as an ``nn.Linear``'s weight) and Hugging
Face's ``mlp.experts.{e}.gate_proj.weight``, ...; the forward is batched products, jittable:

- few token slots (``tokens * num_experts_per_tok <= num_experts``: a decode step), the chosen
  experts' weights are gathered, so only they are read;
- otherwise every expert runs on every token and the weighted sum keeps the chosen ones, as the
  book computes it.

On a mesh the experts split over ``model`` (the stacked parameters' first axis), each device
holding ``E / model`` experts whole and running them on every token; the weighted sum over the
experts is then the one all-reduce (a gather of experts from other devices would move weights,
so a mesh always takes the second path).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flax_attention._checks import check_positive_int
from flax_attention._init import partitioned
from flax_attention._layers import LayerOptions
from flax_attention.layouts import Names, register
from flax_attention.mesh import MODEL, LinearAxes

__all__ = ["MoEFeedForward"]

#: The router is small and every token reads all of it: replicated.
_REPLICATED = LinearAxes(kernel=(None, None), bias=(None,))
#: torch's ``nn.Linear`` kernel distribution, per expert (the first axis is not a fan).
_EXPERT_INIT = jax.nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform", batch_axis=(0,))


class MoEFeedForward(nnx.Module):
    """The book's ``MoEFeedForward(cfg)``: ``gate`` ``Linear(emb_dim, num_experts)``, and the
    experts' ``fc1``, ``fc2`` ``(num_experts, emb_dim, moe_intermediate_size)`` and ``fc3``
    ``(num_experts, moe_intermediate_size, emb_dim)`` (module docstring)."""

    def __init__(self, cfg, *, options: LayerOptions, rngs: nnx.Rngs):
        experts, hidden, d = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["emb_dim"]
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            check_positive_int(f"cfg[{key!r}]", cfg[key])
        self.num_experts, self.num_experts_per_tok = experts, cfg["num_experts_per_tok"]
        self.dtype, self.precision = options.dtype, options.precision
        self.gate = options.linear(rngs)(d, experts, use_bias=False, axes=_REPLICATED)
        init = partitioned(_EXPERT_INIT, (MODEL, None, None))

        def stacked(shape):
            return nnx.Param(init(rngs.params(), shape, options.param_dtype))

        self.fc1 = stacked((experts, d, hidden))
        self.fc2 = stacked((experts, d, hidden))
        self.fc3 = stacked((experts, hidden, d))

    def model_axis_sizes(self) -> dict[str, int]:
        """What ``flax_attention.shard`` splits over ``model``: the experts."""
        return {"num_experts": self.num_experts}

    def hf_names(self) -> list[tuple[str, str]]:
        """``(own, Hugging Face)`` names under the block's ``ff.``/``mlp.``."""
        names = [("gate.weight", "gate.weight")]
        for e in range(self.num_experts):
            for own, hf in (("fc1", "gate_proj"), ("fc2", "up_proj"), ("fc3", "down_proj")):
                names.append((f"{own}.{e}.weight", f"experts.{e}.{hf}.weight"))
        return names

    def __call__(self, x):
        scores = self.gate(x)  # (..., E)
        top_scores, top_index = jax.lax.top_k(scores, self.num_experts_per_tok)  # (..., k)
        top_probs = jax.nn.softmax(top_scores, axis=-1)  # the chosen experts' weights
        dtype = self.dtype or jnp.result_type(x, self.fc1[...])
        w1, w2, w3 = (w[...].astype(dtype) for w in (self.fc1, self.fc2, self.fc3))
        rows = x.reshape(-1, x.shape[-1]).astype(dtype)  # (n, d)
        index = top_index.reshape(rows.shape[0], -1)  # (n, k)
        probs = top_probs.reshape(index.shape).astype(dtype)  # (n, k)
        product = jnp.einsum
        few = index.size <= self.num_experts
        if few and jax.sharding.get_abstract_mesh().empty:  # read the chosen experts only
            g1, g2, g3 = w1[index], w2[index], w3[index]  # (n, k, d, h), (n, k, h, d)
            hidden = nnx.silu(product("nd,nkdh->nkh", rows, g1, precision=self.precision))
            hidden = hidden * product("nd,nkdh->nkh", rows, g2, precision=self.precision)
            out = product("nkh,nkhd->nkd", hidden, g3, precision=self.precision)
            y = product("nk,nkd->nd", probs, out, precision=self.precision)
        else:  # every expert on every token, the chosen ones kept (the book's computation)
            hidden = nnx.silu(product("nd,edh->neh", rows, w1, precision=self.precision))
            hidden = hidden * product("nd,edh->neh", rows, w2, precision=self.precision)
            out = product("neh,ehd->ned", hidden, w3, precision=self.precision)  # (n, E, d)
            # the book's scatter of the chosen probabilities, as a sum of one-hots (no scatter:
            # its layout on an explicit mesh would be ambiguous)
            chosen = jax.nn.one_hot(index, self.num_experts, dtype=dtype)  # (n, k, E)
            gating = product("nk,nke->ne", probs, chosen, precision=self.precision)
            y = product("ne,ned->nd", gating, out, precision=self.precision)
        return y.reshape(x.shape[:-1] + (y.shape[-1],))


register(
    MoEFeedForward,
    Names(stacked=(("fc1", "fc1.{}.weight", True), ("fc2", "fc2.{}.weight", True),
                   ("fc3", "fc3.{}.weight", True))),
)  # fmt: skip
