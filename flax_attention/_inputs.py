"""Input checks on arrays, in the words of ``_checks`` (the messages of ``torch_reference``)."""

from __future__ import annotations

import jax.numpy as jnp

from flax_attention._checks import check_features, check_floating, check_min_rank

__all__ = ["check_input"]


def check_input(name, x, d_in, legend="..., num_tokens, d_in"):
    """``x`` ``(..., num_tokens, d_in)``: at least 2-D, ``d_in`` features, floating dtype."""
    shape = jnp.shape(x)
    check_min_rank(name, shape, 2, legend)
    check_features(name, shape, d_in, "d_in" if legend.endswith("d_in") else "d_model")
    dtype = jnp.result_type(x)
    check_floating(name, str(dtype), jnp.issubdtype(dtype, jnp.floating))
