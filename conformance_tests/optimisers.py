"""Optimisers with matched hyperparameters on both sides, for the ``train`` check.

optax's Adam differs from torch's in one place, its bias correction (``scale_by_adam_as_torch``);
everything else (AdamW's decoupled decay, SGD's momentum buffer) already matches.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
import torch

__all__ = ["LEARNING_RATE", "OPTIMIZERS", "scale_by_adam_as_torch"]

LEARNING_RATE = 1e-2


def scale_by_adam_as_torch(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """``optax.scale_by_adam`` with torch's bias corrections.

    optax computes ``1 - b2**t`` in float32, where ``0.999`` is ``0.99900001``: the correction
    (and so every Adam step) is off by 1.3e-5 relative, which 50 steps turn into a 2e-5 drift of
    the trained outputs (torch, which corrects in float64, drifts 8e-7 from a float64 run).
    ``-expm1(t * log(b))`` is the same number to float32 accuracy.
    """

    def init_fn(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return jnp.zeros([], jnp.int32), zeros, zeros

    def update_fn(updates, state, params=None):
        del params
        count, mu, nu = state
        count = count + 1
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, mu, updates)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, nu, updates)
        correction1 = -jnp.expm1(count * math.log(b1))
        correction2 = -jnp.expm1(count * math.log(b2))
        updates = jax.tree.map(
            lambda m, v: (m / correction1) / (jnp.sqrt(v / correction2) + eps), mu, nu
        )
        return updates, (count, mu, nu)

    return optax.GradientTransformation(init_fn, update_fn)


#: (torch optimiser, optax transformation) with matched hyperparameters. torch's Adam divides by
#: ``sqrt(v_hat) + eps`` as optax does (bias corrections as torch's, above); AdamW's decay is
#: decoupled (``p -= lr * wd * p``) in both; SGD's momentum buffer starts at the first gradient
#: with no dampening in both.
OPTIMIZERS = {
    "adam": (
        lambda p: torch.optim.Adam(p, lr=LEARNING_RATE, betas=(0.9, 0.999), eps=1e-8),
        lambda: optax.chain(scale_by_adam_as_torch(0.9, 0.999, 1e-8), optax.scale(-LEARNING_RATE)),
    ),
    "adamw": (
        lambda p: torch.optim.AdamW(
            p, lr=LEARNING_RATE, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1
        ),
        lambda: optax.chain(
            scale_by_adam_as_torch(0.9, 0.999, 1e-8),
            optax.add_decayed_weights(0.1),
            optax.scale(-LEARNING_RATE),
        ),
    ),
    "sgd_momentum": (
        lambda p: torch.optim.SGD(p, lr=LEARNING_RATE, momentum=0.9),
        lambda: optax.sgd(LEARNING_RATE, momentum=0.9),
    ),
}
