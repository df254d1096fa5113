"""Initialisers that draw from torch's default distributions, with their partition metadata.

- ``nn.Linear(fan_in, fan_out)``: weight and bias uniform in ``[-1/sqrt(fan_in), 1/sqrt(fan_in))``
  (torch's ``kaiming_uniform_(a=sqrt(5))`` and its bias rule).
- ``torch.rand``: uniform in ``[0, 1)``, for ``SelfAttention_v1``'s raw matrices.

Every parameter also carries its mesh axes as NNX partition metadata (``out_sharding``, with
``eager_sharding=False``: created unplaced, put on a mesh by ``flax_attention.shard``).

The draws follow the same distributions, not the same numbers: JAX and torch have different
random generators. Weights that must match exactly cross over with ``load_state_dict``.

What the layers are built of (the Linear factory, ``Embed``, ``Dropout``, the row-parallel
product) is ``flax_attention._layers``; this module runs at construction only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flax_attention.mesh import LinearAxes

__all__ = [
    "partitioned",
    "set_linear_axes",
    "torch_linear_bias_init",
    "torch_linear_kernel_init",
    "torch_rand",
]

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


def partitioned(init, axes):
    """``init`` with partition metadata ``axes`` (one mesh axis name or ``None`` per dimension),
    created unplaced: ``flax_attention.shard`` places it on a mesh."""
    return nnx.with_partitioning(init, tuple(axes), eager_sharding=False)


def set_linear_axes(linear: nnx.Linear, axes: LinearAxes) -> nnx.Linear:
    """Replace the partition metadata of an existing ``nnx.Linear`` (a clone that plays another
    role, such as the annotated-transformer post's fourth projection); returns it."""
    linear.kernel.set_metadata(out_sharding=tuple(axes.kernel), eager_sharding=False)
    if linear.bias is not None:
        linear.bias.set_metadata(out_sharding=tuple(axes.bias), eager_sharding=False)
    return linear
