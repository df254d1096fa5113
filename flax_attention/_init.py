"""Initialisers that draw from torch's default distributions, and the shared Linear factory.

- ``nn.Linear(fan_in, fan_out)``: weight and bias uniform in ``[-1/sqrt(fan_in), 1/sqrt(fan_in))``
  (torch's ``kaiming_uniform_(a=sqrt(5))`` and its bias rule).
- ``torch.rand``: uniform in ``[0, 1)``, for ``SelfAttention_v1``'s raw matrices.

The draws follow the same distributions, not the same numbers: JAX and torch have different
random generators. Weights that must match exactly cross over with ``load_state_dict``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["linear_factory", "torch_linear_bias_init", "torch_linear_kernel_init", "torch_rand"]

#: Kernel ``(fan_in, fan_out)`` uniform in +-sqrt(3 * (1/3) / fan_in) = +-1/sqrt(fan_in).
torch_linear_kernel_init = jax.nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def torch_linear_bias_init(fan_in: int):
    """Bias uniform in ``[-1/sqrt(fan_in), 1/sqrt(fan_in))``, as ``nn.Linear.reset_parameters``."""
    bound = 1.0 / fan_in**0.5

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def torch_rand(key, shape, dtype=jnp.float32):
    """``torch.rand(*shape)``: uniform in ``[0, 1)``."""
    return jax.random.uniform(key, shape, dtype)


def linear_factory(*, dtype, param_dtype, precision, rngs: nnx.Rngs):
    """``linear(d_in, d_out, use_bias=...)``: an ``nnx.Linear`` with torch's initialisers and the
    layer's Flax options, so every sublayer gets ``dtype``, ``param_dtype`` and ``precision``."""

    def linear(in_features: int, out_features: int, *, use_bias: bool = True) -> nnx.Linear:
        return nnx.Linear(
            in_features,
            out_features,
            use_bias=use_bias,
            kernel_init=torch_linear_kernel_init,
            bias_init=torch_linear_bias_init(in_features),
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            rngs=rngs,
        )

    return linear
