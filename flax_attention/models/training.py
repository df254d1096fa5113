"""Training ``GPTModel`` as the book's chapter 5 does, with optax and ``nnx.Optimizer``.

============================================  ===============================================
book (torch)                                  here
============================================  ===============================================
``calc_loss_batch(input_batch, target_batch,  ``calc_loss_batch(input_batch, target_batch,
model, device)``: cross-entropy of the        model)``: the same mean over every token
flattened logits                              (``optax``'s integer-label cross-entropy)
``optimizer = torch.optim.AdamW(              ``optimizer = nnx.Optimizer(model,
model.parameters(), lr=4e-4,                  optax.adamw(4e-4, weight_decay=0.1),
weight_decay=0.1)``                           wrt=nnx.Param)``
``optimizer.zero_grad(); loss.backward();     ``train_step(model, optimizer, input_batch,
optimizer.step()``                            target_batch)``: one jitted step, returns the loss
``calc_loss_loader(loader, model, device,     ``calc_loss_loader(batches, model, num_batches)``
num_batches)``
``evaluate_model(model, train_loader,         ``evaluate_model(model, train_batches,
val_loader, device, eval_iter)``: eval mode,  val_batches, eval_iter)``: the same
then back to train mode
============================================  ===============================================

``input_batch`` and ``target_batch`` are ``(b, t)`` token ids (targets: the inputs shifted by one
token, as the book's ``GPTDatasetV1`` makes them); ``batches`` is any iterable of such pairs.
Dropout draws from the model's own ``nnx.Rngs`` streams in train mode.
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers

import jax.numpy as jnp
import optax
from flax import nnx

__all__ = ["calc_loss_batch", "calc_loss_loader", "evaluate_model", "train_step"]


def calc_loss_batch(input_batch, target_batch, model):
    """Mean cross-entropy of ``model(input_batch)`` ``(b, t, V)`` against ``target_batch``
    ``(b, t)``, over the flattened ``(b * t, V)`` logits as the book computes it."""
    logits = model(input_batch)  # (b, t, V)
    logits = logits.reshape(-1, logits.shape[-1]).astype(jnp.float32)  # (b * t, V)
    labels = jnp.asarray(target_batch).reshape(-1)  # (b * t,)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@functools.partial(nnx.jit, donate_argnums=(0, 1))
def train_step(model, optimizer: nnx.Optimizer, input_batch, target_batch):
    """One optimiser step on one batch (``zero_grad``, ``backward``, ``step`` of the book's
    loop), compiled once per batch shape; returns the batch's loss before the step.

    The step updates in place, as torch's ``optimizer.step()`` does: the model's and the
    optimiser's arrays are donated to it, so XLA writes the new ones over the old (no second
    copy of the weights and both Adam moments, 1.5 GB for GPT-2 small). Arrays taken from
    ``nnx.state(model)`` before a step are deleted by it; copy them (``jnp.copy(x)``) to keep
    them. An array that NumPy still views (``np.asarray(x)`` on the CPU) is not donated: the
    step leaves it and writes a new one."""

    def loss_fn(model):
        return calc_loss_batch(input_batch, target_batch, model)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def _eval_loss(model, input_batch, target_batch):
    return calc_loss_batch(input_batch, target_batch, model)


def calc_loss_loader(batches, model, num_batches: int | None = None) -> float:
    """The mean of the first ``num_batches`` batches' losses (all if ``None``), as the book's
    ``calc_loss_loader``; ``nan`` for no batches. ``batches`` is read lazily, only as far as
    ``num_batches`` (an endless iterator is fine with it). Runs in the model's current mode."""
    if num_batches is not None:
        if isinstance(num_batches, bool) or not isinstance(num_batches, numbers.Integral):
            raise TypeError(f"num_batches ({num_batches!r}) must be an int or None")
        if num_batches < 1:
            raise ValueError(f"num_batches ({num_batches}) must be >= 1 (None: every batch)")
    total, count = 0.0, 0
    for input_batch, target_batch in itertools.islice(batches, num_batches):
        total += float(_eval_loss(model, input_batch, target_batch))
        count += 1
    return total / count if count else math.nan


def evaluate_model(model, train_batches, val_batches, eval_iter: int) -> tuple[float, float]:
    """``(train_loss, val_loss)`` over ``eval_iter`` batches each, in eval mode (dropout off);
    the model is back in train mode afterwards, as the book's ``evaluate_model`` leaves it."""
    model.eval()
    try:
        train_loss = calc_loss_loader(train_batches, model, num_batches=eval_iter)
        val_loss = calc_loss_loader(val_batches, model, num_batches=eval_iter)
    finally:
        model.train()
    return train_loss, val_loss
