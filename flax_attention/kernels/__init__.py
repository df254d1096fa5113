"""The attention core's faster implementations, each a function of ``(queries, keys, values,
attention_mask)`` in the core's layout (``flax_attention.core``) with an ``AttentionMask``
(``flax_attention.masking``) saying what to hide:

- ``blocked``: flash-style tiles in JAX with a custom VJP (``BlockSizes`` sets the tiles);
- ``native``: the same tiles as a C++ kernel through ``jax.ffi`` (CPU; ``kernels.native``,
  imported on its own: its loading says why it is off where it cannot run);
- ``jax_nn``: ``jax.nn.dot_product_attention`` (``xla``, ``cudnn``) behind the core's conventions.

``flax_attention.core.attend`` (behind ``dot_product_attention`` and every layer) runs them by
``implementation`` name, through its ``_KERNELS`` table.
"""

from flax_attention.kernels.blocked import BlockSizes, blocked_attention
from flax_attention.kernels.jax_nn import jax_nn_attention

__all__ = ["BlockSizes", "blocked_attention", "jax_nn_attention"]
