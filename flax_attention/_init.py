"""Initialisers that draw from torch's default distributions, and the shared Linear factory.

- ``nn.Linear(fan_in, fan_out)``: weight and bias uniform in ``[-1/sqrt(fan_in), 1/sqrt(fan_in))``
  (torch's ``kaiming_uniform_(a=sqrt(5))`` and its bias rule).
- ``torch.rand``: uniform in ``[0, 1)``, for ``SelfAttention_v1``'s raw matrices.

Every parameter also carries its mesh axes as NNX partition metadata (``out_sharding``, with
``eager_sharding=False``: created unplaced, put on a mesh by ``flax_attention.shard``).

The draws follow the same distributions, not the same numbers: JAX and torch have different
random generators. Weights that must match exactly cross over with ``load_state_dict``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flax_attention.axes import LinearAxes, spec_of

__all__ = [
    "linear_factory",
    "partitioned",
    "rows_dot_general",
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


def rows_dot_general(lhs, rhs, dimension_numbers, precision=None, **options):
    """``jax.lax.dot_general`` for ``nnx.Linear`` and the tied head: ``x (..., d_in) @ kernel
    (d_in, d_out)`` (or ``@ table.T`` for a ``(d_out, d_in)`` table) as one ``(rows, d_in)``
    product on ``x`` flattened to rows, then reshaped back; the same numbers, and the same call
    as ``dot_general`` where the leading axes carry sharding in their type (an ``Explicit``
    mesh), ``out_sharding`` is given, or the contraction is another one.

    Why: the kernel's gradient of the ``(b, t, d_in)`` product is a contraction over two axes,
    and XLA's CPU compiler transposes the incoming gradient for it; in a deep model that
    transpose fuses the residual stream's whole chain of gradient additions, recomputed per
    layer (quadratic in depth), and for the tied head it copies the ``(b * t, V)`` gradient of
    the logits. On rows the same gradient is one plain product, no transpose (the measurements:
    docs/performance.md, "Where a training step's time goes")."""
    (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = dimension_numbers
    flat = (
        lhs.ndim > 2
        and rhs.ndim == 2
        and not lhs_batch
        and not rhs_batch
        and tuple(lhs_contracting) == (lhs.ndim - 1,)
        and options.get("out_sharding") is None
        and not any(spec_of(lhs))
    )
    if not flat:
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision, **options)
    options.pop("out_sharding", None)
    rows = lhs.reshape(-1, lhs.shape[-1])  # (rows, d_in)
    out = jax.lax.dot_general(
        rows, rhs, (((1,), rhs_contracting), ((), ())), precision=precision, **options
    )  # (rows, d_out)
    return out.reshape(*lhs.shape[:-1], out.shape[-1])  # (..., d_out)


def linear_factory(*, dtype, param_dtype, precision, rngs: nnx.Rngs):
    """``linear(d_in, d_out, use_bias=..., axes=...)``: an ``nnx.Linear`` with torch's
    initialisers and the layer's Flax options, so every sublayer gets ``dtype``, ``param_dtype``
    and ``precision``. ``axes`` (an ``axes.LinearAxes``, e.g. ``TO_HEADS`` or ``FROM_HEADS``)
    becomes the kernel's and bias's partition metadata. Its product is ``rows_dot_general``."""

    def linear(
        in_features: int, out_features: int, *, use_bias: bool = True, axes: LinearAxes
    ) -> nnx.Linear:
        return nnx.Linear(
            in_features,
            out_features,
            use_bias=use_bias,
            kernel_init=partitioned(torch_linear_kernel_init, axes.kernel),
            bias_init=partitioned(torch_linear_bias_init(in_features), axes.bias),
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            dot_general=rows_dot_general,
            rngs=rngs,
        )

    return linear
