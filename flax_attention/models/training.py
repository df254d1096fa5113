"""Training ``GPTModel`` as the book's chapter 5 does (with chapter 7's ``ignore_index``), and
appendix D's loop, with optax and ``nnx.Optimizer``.

============================================  ===============================================
book (torch)                                  here
============================================  ===============================================
``calc_loss_batch(input_batch, target_batch,  ``calc_loss_batch(input_batch, target_batch,
model, device)``: cross-entropy of the        model)``: the same mean over every kept target
flattened logits (targets ``-100`` left out,  (``ignore_index=-100`` as torch's, chapter 7's
torch's ``ignore_index``)                     padding)
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
``train_model_simple(model, train_loader,     ``train_model_simple(model, train_loader,
val_loader, optimizer, device, num_epochs,    val_loader, optimizer, num_epochs, eval_freq,
eval_freq, eval_iter, start_context,          eval_iter, start_context=None,
tokenizer)``                                  tokenizer=None)``: the same loop and lists
``generate_and_print_sample(model,            ``generate_and_print_sample(model, tokenizer,
tokenizer, device, start_context)``           start_context)``
appendix D's ``train_model(model, ...,        ``train_model(model, train_loader, val_loader,
optimizer, device, n_epochs, ...,             n_epochs, eval_freq, eval_iter, warmup_steps,
warmup_steps, initial_lr, min_lr)``           initial_lr, min_lr, *, peak_lr, weight_decay)``
============================================  ===============================================

``input_batch`` and ``target_batch`` are ``(b, t)`` token ids (targets: the inputs shifted by one
token, as the book's ``GPTDatasetV1`` makes them, or chapter 7's ``custom_collate_fn`` with
``-100`` where a target is padding); ``batches`` is any iterable of such pairs, NumPy, JAX or
CPU torch tensors. Dropout draws from the model's own ``nnx.Rngs`` streams in train mode. A step
trains what the optimiser was built for (its ``wrt``: ``nnx.Param`` for the whole model, a
narrower filter for a part of it) and compiles once per batch shape.

The book writes its loop three times (chapter 5's ``train_model_simple``, chapter 6's
``train_classifier_simple``, appendix D's ``train_model``); here it is one, ``train_loop``, and
each of the three gives it what differs: its step, what it counts (tokens, or examples), its
progress line's word (``Step``, appendix D's ``Iter``) and its end of an epoch (a sample, or the
accuracies). Likewise both chapters' ``calc_loss_loader`` are ``loader_mean`` of their own batch
loss (token ids here, labels in ``classify``) and both ``evaluate_model`` are
``evaluate_losses`` of their own ``calc_loss_loader``.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from flax_attention._checks import check_instance, check_int, check_real
from flax_attention.mesh import fetch
from flax_attention.models._modes import in_eval_mode

__all__ = [
    "IGNORE_INDEX",
    "calc_loss_batch",
    "calc_loss_loader",
    "cross_entropy",
    "evaluate_model",
    "generate_and_print_sample",
    "train_model",
    "train_model_simple",
    "train_step",
]

#: torch's ``cross_entropy`` default ``ignore_index``, which chapter 7's collate writes.
IGNORE_INDEX = -100


# ---- checks --------------------------------------------------------------------------------------


def check_ignore_index(ignore_index, vocab_size: int) -> None:
    """``ignore_index`` is an int no token id takes: a real id would drop that token's loss."""
    check_int("ignore_index", ignore_index, why="torch's default -100")
    if 0 <= ignore_index < vocab_size:
        raise ValueError(
            f"ignore_index ({ignore_index}) must not be a token id (0..{vocab_size - 1}, "
            "vocab_size): targets equal to it are left out of the loss (torch's default -100)"
        )


def as_array(x):
    """A batch as jit takes it: JAX and NumPy arrays as they are, anything else (a CPU torch
    tensor, nested lists) through ``np.asarray``."""
    return x if isinstance(x, (jax.Array, np.ndarray)) else np.asarray(x)


def check_labels(target_batch, classes: int, ignore_index: int | None, what: str) -> None:
    """Concrete targets are integers in ``0..classes - 1`` (or ``ignore_index``); torch raises
    for any other, which a gather in JAX would read silently out of range."""
    if isinstance(target_batch, jax.core.Tracer):
        return
    (labels,) = fetch([target_batch])
    if not np.issubdtype(labels.dtype, np.integer):
        raise TypeError(f"target_batch (dtype {labels.dtype}) must hold integer {what}")
    kept = labels if ignore_index is None else labels[labels != ignore_index]
    if kept.size and (kept.min() < 0 or kept.max() >= classes):
        also = "" if ignore_index is None else f" or be ignore_index ({ignore_index})"
        raise ValueError(
            f"target_batch ({what} {kept.min()}..{kept.max()}) must lie in 0..{classes - 1} "
            f"({'vocab_size' if what == 'token ids' else 'num_classes'}){also}"
        )


def check_reiterable(name: str, loader) -> None:
    """A loader read more than once (every epoch, every evaluation) must start anew each time."""
    if iter(loader) is loader:
        raise TypeError(
            f"{name} ({type(loader).__name__}) must be re-iterable, read from its start at "
            "every epoch and evaluation (a list of batches or a DataLoader), not a one-pass "
            "iterator or generator"
        )


def check_optimizer(name: str, optimizer) -> None:
    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(
            f"{name} ({type(optimizer).__name__}) must be an nnx.Optimizer "
            "(nnx.Optimizer(model, optax.adamw(...), wrt=nnx.Param)), where the book passes "
            "a torch optimizer"
        )


def loaders_and_optimizer(train_loader, val_loader, optimizer):
    """The book's order ``(train_loader, val_loader, optimizer)``, also given as
    ``(optimizer, train_loader, val_loader)``: checked and in the book's order."""
    if isinstance(train_loader, nnx.Optimizer) and not isinstance(optimizer, nnx.Optimizer):
        train_loader, val_loader, optimizer = val_loader, optimizer, train_loader
    check_optimizer("optimizer", optimizer)
    check_reiterable("train_loader", train_loader)
    check_reiterable("val_loader", val_loader)
    return train_loader, val_loader, optimizer


# ---- the loss ------------------------------------------------------------------------------------


def cross_entropy(logits, labels, ignore_index: int | None = IGNORE_INDEX):
    """torch's ``F.cross_entropy(logits, labels)``: ``logits`` ``(n, C)``, ``labels`` ``(n,)``;
    the mean over the labels that are not ``ignore_index`` (``nan`` if none is kept), computed
    in at least float32."""
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    labels = jnp.asarray(labels)
    if ignore_index is None:
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    keep = labels != ignore_index  # (n,)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(keep, labels, 0))
    return jnp.where(keep, losses, 0).sum() / keep.sum()


def calc_loss_batch(input_batch, target_batch, model, *, ignore_index: int = IGNORE_INDEX):
    """Mean cross-entropy of ``model(input_batch)`` ``(b, t, V)`` against ``target_batch``
    ``(b, t)``, over the flattened ``(b * t, V)`` logits as the book computes it; targets equal
    to ``ignore_index`` (-100, torch's default: chapter 7's padding) are left out of the mean."""
    check_ignore_index(ignore_index, model.cfg["vocab_size"])
    check_labels(target_batch, model.cfg["vocab_size"], ignore_index, "token ids")
    logits = model(as_array(input_batch))  # (b, t, V)
    logits = logits.reshape(-1, logits.shape[-1])  # (b * t, V)
    return cross_entropy(logits, jnp.asarray(as_array(target_batch)).reshape(-1), ignore_index)


def loss_and_grads(loss_fn, model, optimizer: nnx.Optimizer):
    """``loss_fn(model)`` and its gradient with respect to what ``optimizer`` trains (its
    ``wrt``), for ``optimizer.update``."""
    return nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, optimizer.wrt))(model)


@functools.partial(nnx.jit, donate_argnums=(0, 1))
def _train_step(model, optimizer: nnx.Optimizer, input_batch, target_batch):
    def loss_fn(model):
        return calc_loss_batch(input_batch, target_batch, model)

    loss, grads = loss_and_grads(loss_fn, model, optimizer)
    optimizer.update(model, grads)
    return loss


def train_step(model, optimizer: nnx.Optimizer, input_batch, target_batch):
    """One optimiser step on one batch (``zero_grad``, ``backward``, ``step`` of the book's
    loop), compiled once per batch shape; returns the batch's loss before the step. It trains
    what ``optimizer`` was built for (``wrt``), as torch's steps the parameters given to it.

    The step updates in place, as torch's ``optimizer.step()`` does: the model's and the
    optimiser's arrays are donated to it, so XLA writes the new ones over the old (no second
    copy of the weights and both Adam moments: docs/performance.md). Arrays taken from
    ``nnx.state(model)`` before a step are deleted by it; copy them (``jnp.copy(x)``) to keep
    them. An array that NumPy still views (``np.asarray(x)`` on the CPU) is not donated: the
    step leaves it and writes a new one."""
    check_optimizer("optimizer", optimizer)
    check_labels(target_batch, model.cfg["vocab_size"], IGNORE_INDEX, "token ids")
    return _train_step(model, optimizer, as_array(input_batch), as_array(target_batch))


@nnx.jit
def _eval_loss(model, input_batch, target_batch):
    return calc_loss_batch(input_batch, target_batch, model)


def loader_mean(batches, num_batches, per_batch) -> float:
    """The mean of ``per_batch(input_batch, target_batch)`` over the first ``num_batches``
    batches (all if ``None``), read lazily; ``nan`` for none: both chapters'
    ``calc_loss_loader``, each with its own ``per_batch`` (token ids here, labels in
    ``classify``)."""
    check_int("num_batches", num_batches, 1, optional="every batch")
    total, count = 0.0, 0
    for input_batch, target_batch in itertools.islice(batches, num_batches):
        total += per_batch(input_batch, target_batch)
        count += 1
    return total / count if count else math.nan


def calc_loss_loader(batches, model, num_batches: int | None = None) -> float:
    """The mean of the first ``num_batches`` batches' losses (all if ``None``), as the book's
    ``calc_loss_loader``; ``nan`` for no batches. ``batches`` is read lazily, only as far as
    ``num_batches`` (an endless iterator is fine with it). Runs in the model's current mode."""

    def loss(input_batch, target_batch):
        check_labels(target_batch, model.cfg["vocab_size"], IGNORE_INDEX, "token ids")
        return float(_eval_loss(model, as_array(input_batch), as_array(target_batch)))

    return loader_mean(batches, num_batches, loss)


def evaluate_losses(calc_loss_loader, model, train_loader, val_loader, eval_iter):
    """Both chapters' ``evaluate_model``, each with its own ``calc_loss_loader``: ``(train_loss,
    val_loss)`` over ``eval_iter`` batches each (``None``: every batch), in eval mode (dropout
    off); the model is back in train mode afterwards, as the book's ``evaluate_model`` leaves
    it."""
    check_int("eval_iter", eval_iter, 1, optional="every batch")
    model.eval()
    try:
        train_loss = calc_loss_loader(train_loader, model, num_batches=eval_iter)
        val_loss = calc_loss_loader(val_loader, model, num_batches=eval_iter)
    finally:
        model.train()
    return train_loss, val_loss


def evaluate_model(model, train_batches, val_batches, eval_iter: int) -> tuple[float, float]:
    """``(train_loss, val_loss)`` over ``eval_iter`` batches each (``None``: every batch, as
    the book's ``calc_loss_loader`` reads it), in eval mode (dropout off); the model is back in
    train mode afterwards, as the book's ``evaluate_model`` leaves it."""
    return evaluate_losses(calc_loss_loader, model, train_batches, val_batches, eval_iter)


# ---- chapter 5's loop ----------------------------------------------------------------------------


def _encode(tokenizer, text: str) -> list[int]:
    """The book's ``text_to_token_ids``: ``tokenizer.encode(text)``, with
    ``allowed_special={"<|endoftext|>"}`` where ``encode`` takes it (tiktoken's)."""
    try:
        takes = "allowed_special" in inspect.signature(tokenizer.encode).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        takes = False
    if takes:
        return list(tokenizer.encode(text, allowed_special={"<|endoftext|>"}))
    return list(tokenizer.encode(text))


@in_eval_mode
def generate_and_print_sample(model, tokenizer, start_context: str) -> None:
    """The book's ``generate_and_print_sample``: 50 greedy tokens after ``start_context``
    (``generate_text_simple`` over the model's whole context), printed on one line; the
    model's mode is put back."""
    from flax_attention.models.generation import generate_text_simple

    check_instance("start_context", start_context, str, "a str (the prompt's text)")
    if not start_context:
        raise ValueError("start_context ('') must be a non-empty str (the prompt's text)")

    encoded = np.asarray([_encode(tokenizer, start_context)])
    context_size = model.cfg["context_length"]
    token_ids = generate_text_simple(model, encoded, 50, context_size)
    decoded_text = tokenizer.decode(np.asarray(token_ids)[0].tolist())
    print(decoded_text.replace("\n", " "))


def _tokens(input_batch) -> int:
    return math.prod(np.shape(input_batch))


def check_loop(epochs_name: str, num_epochs, eval_freq, eval_iter) -> None:
    """The counts every loop of the book takes (``num_epochs``, appendix D's ``n_epochs``)."""
    check_int(epochs_name, num_epochs, 1)
    check_int("eval_freq", eval_freq, 1)
    check_int("eval_iter", eval_iter, 1, optional="every batch")


class Progress(NamedTuple):
    """What ``train_loop`` tracks: each evaluation's losses, what was seen by then (tokens or
    examples), and what was seen in all."""

    train_losses: list[float]
    val_losses: list[float]
    track_seen: list[int]
    seen: int


def train_loop(
    model,
    train_loader,
    val_loader,
    num_epochs: int,
    eval_freq: int,
    eval_iter: int | None,
    *,
    step,
    evaluate,
    count,
    step_name: str = "Step",
    end_of_epoch=None,
) -> Progress:
    """The loop of the book's chapter 5 (``train_model_simple``), chapter 6
    (``classify.train_classifier_simple``) and appendix D (``train_model``), each giving what
    differs: ``num_epochs`` passes over ``train_loader``, the model put in train mode at each;
    ``step(global_step, input_batch, target_batch)`` on every batch (``global_step`` from 0) and
    ``count(input_batch)`` (tokens, or examples) added to what is seen; every ``eval_freq`` steps
    from step 0 ``evaluate(model, train_loader, val_loader, eval_iter)`` and the book's line
    ``Ep 1 (Step 000000): Train loss 4.689, Val loss 4.919`` (``step_name``: appendix D's
    ``"Iter"``); after each epoch ``end_of_epoch()`` (a sample, the accuracies) when given.
    The arguments come checked."""
    train_losses, val_losses, track_seen = [], [], []
    seen, global_step = 0, -1
    for epoch in range(num_epochs):
        model.train()
        for input_batch, target_batch in train_loader:
            global_step += 1
            step(global_step, input_batch, target_batch)
            seen += count(input_batch)
            if global_step % eval_freq == 0:
                train_loss, val_loss = evaluate(model, train_loader, val_loader, eval_iter)
                train_losses.append(train_loss)
                val_losses.append(val_loss)
                track_seen.append(seen)
                print(
                    f"Ep {epoch + 1} ({step_name} {global_step:06d}): "
                    f"Train loss {train_loss:.3f}, Val loss {val_loss:.3f}"
                )
        if end_of_epoch is not None:
            end_of_epoch()
    return Progress(train_losses, val_losses, track_seen, seen)


def _sample_after_epoch(model, tokenizer, start_context):
    """Chapter 5's end of an epoch: a sample from ``start_context``, when it and ``tokenizer``
    are given."""
    if start_context is None or tokenizer is None:
        return None
    return functools.partial(generate_and_print_sample, model, tokenizer, start_context)


def train_model_simple(
    model,
    train_loader,
    val_loader,
    optimizer: nnx.Optimizer,
    num_epochs: int,
    eval_freq: int,
    eval_iter: int,
    start_context: str | None = None,
    tokenizer=None,
):
    """The book's chapter 5 ``train_model_simple`` (used again by chapter 7): ``num_epochs``
    passes over ``train_loader``, one ``train_step`` per batch; every ``eval_freq`` steps
    (from step 0) ``evaluate_model`` over ``eval_iter`` batches of each loader; after each epoch
    a sample from ``start_context`` (when it and ``tokenizer`` are given). Returns the book's
    ``(train_losses, val_losses, track_tokens_seen)``; prints the book's progress lines.

    ``optimizer`` is an ``nnx.Optimizer`` over ``model`` (the book's torch optimizer); it may
    also come second, ``(model, optimizer, train_loader, val_loader, ...)``. Targets of -100
    (chapter 7's ``custom_collate_fn``) are left out of the loss."""
    train_loader, val_loader, optimizer = loaders_and_optimizer(train_loader, val_loader, optimizer)
    check_loop("num_epochs", num_epochs, eval_freq, eval_iter)

    def step(global_step, input_batch, target_batch):
        train_step(model, optimizer, input_batch, target_batch)

    progress = train_loop(
        model,
        train_loader,
        val_loader,
        num_epochs,
        eval_freq,
        eval_iter,
        step=step,
        evaluate=evaluate_model,
        count=_tokens,
        end_of_epoch=_sample_after_epoch(model, tokenizer, start_context),
    )
    return progress.train_losses, progress.val_losses, progress.track_seen


# ---- appendix D ----------------------------------------------------------------------------------


def clip_grad_norm(grads, max_norm: float = 1.0):
    """torch's ``clip_grad_norm_(parameters, max_norm)``: every gradient times
    ``min(1, max_norm / (total_norm + 1e-6))``, ``total_norm`` the 2-norm of the gradients'
    2-norms. Returns ``(clipped grads, total_norm)``."""
    leaves = jax.tree.leaves(grads)
    norms = jnp.stack([jnp.linalg.norm(g.astype(jnp.float32).reshape(-1)) for g in leaves])
    total_norm = jnp.linalg.norm(norms)
    coef = jnp.minimum(max_norm / (total_norm + 1e-6), 1.0)
    return jax.tree.map(lambda g: (g * coef).astype(g.dtype), grads), total_norm


@functools.partial(nnx.jit, donate_argnums=(0, 1))
def _scheduled_step(model, optimizer: nnx.Optimizer, input_batch, target_batch, lr, clip):
    """Appendix D's step: the loss's gradient, clipped to norm 1.0 where ``clip``, then AdamW at
    learning rate ``lr`` (set in the optimiser's injected hyperparameters). ``lr`` and ``clip``
    are traced: one compile for every step. Returns the loss and the gradients' norm before
    clipping."""

    def loss_fn(model):
        return calc_loss_batch(input_batch, target_batch, model)

    loss, grads = loss_and_grads(loss_fn, model, optimizer)
    clipped, total_norm = clip_grad_norm(grads, 1.0)
    grads = jax.tree.map(lambda c, g: jnp.where(clip, c, g), clipped, grads)
    optimizer.opt_state.hyperparams["learning_rate"][...] = lr
    optimizer.update(model, grads)
    return loss, total_norm


@functools.cache
def _adamw(weight_decay: float) -> optax.GradientTransformation:
    """Appendix D's AdamW (torch's betas and eps), its learning rate set at every step; one
    object per ``weight_decay``, so every ``train_model`` run shares the compiled step."""
    return optax.inject_hyperparams(optax.adamw)(
        learning_rate=0.0, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay
    )


def learning_rate(
    global_step: int,
    *,
    warmup_steps: int,
    total_training_steps: int,
    initial_lr: float,
    peak_lr: float,
    min_lr: float,
) -> float:
    """Appendix D's learning rate at ``global_step`` (0-based), in Python floats as the book
    computes it: linear from ``initial_lr`` over ``warmup_steps`` steps, then a cosine from
    ``peak_lr`` down to ``min_lr`` at ``total_training_steps``."""
    if global_step < warmup_steps:
        lr_increment = (peak_lr - initial_lr) / warmup_steps
        return initial_lr + global_step * lr_increment
    progress = (global_step - warmup_steps) / (total_training_steps - warmup_steps)
    return min_lr + (peak_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def _schedule(train_loader, n_epochs, warmup_steps, initial_lr, peak_lr, min_lr):
    """``learning_rate`` over ``len(train_loader) * n_epochs`` steps, a function of the step;
    its arguments checked (``train_loader`` must have a ``len()``)."""
    check_int("warmup_steps", warmup_steps, 1)
    for name, value in (("peak_lr", peak_lr), ("initial_lr", initial_lr), ("min_lr", min_lr)):
        check_real(name, value, 0)
    if not hasattr(train_loader, "__len__"):
        raise TypeError(
            f"train_loader ({type(train_loader).__name__}) must have a len(): the schedule "
            "spans len(train_loader) * n_epochs steps (a list of batches or a DataLoader)"
        )
    return functools.partial(
        learning_rate,
        warmup_steps=warmup_steps,
        total_training_steps=len(train_loader) * n_epochs,
        initial_lr=initial_lr,
        peak_lr=peak_lr,
        min_lr=min_lr,
    )


def train_model(
    model,
    train_loader,
    val_loader,
    n_epochs: int,
    eval_freq: int,
    eval_iter: int,
    warmup_steps: int,
    initial_lr: float = 3e-05,
    min_lr: float = 1e-6,
    *,
    peak_lr: float,
    weight_decay: float = 0.1,
    start_context: str | None = None,
    tokenizer=None,
):
    """Appendix D's ``train_model``: chapter 5's loop with a learning-rate schedule and
    gradient clipping. Returns the book's ``(train_losses, val_losses, track_tokens_seen,
    track_lrs)``.

    The learning rate of step ``global_step`` (0-based, ``len(train_loader) * n_epochs`` steps
    in all) rises linearly from ``initial_lr`` by ``(peak_lr - initial_lr) / warmup_steps`` a
    step while ``global_step < warmup_steps``, then falls along a cosine from ``peak_lr`` to
    ``min_lr`` (``learning_rate``); ``track_lrs`` holds each step's, Python floats as the book
    computes them. AdamW (``weight_decay``, torch's betas and eps; the book's optimiser is
    ``torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.1)``) over every
    parameter, built here: the book reads ``peak_lr`` from the optimiser it is given. Gradients
    are clipped to norm 1.0 (torch's ``clip_grad_norm_``) from step ``warmup_steps`` on, where
    the book's current code starts (``global_step >= warmup_steps``; its first printing started
    one step later). Every ``eval_freq`` steps ``evaluate_model`` over ``eval_iter`` batches;
    after each epoch a sample from ``start_context`` when it and ``tokenizer`` are given.
    """
    check_reiterable("train_loader", train_loader)
    check_reiterable("val_loader", val_loader)
    check_loop("n_epochs", n_epochs, eval_freq, eval_iter)
    schedule = _schedule(train_loader, n_epochs, warmup_steps, initial_lr, peak_lr, min_lr)
    check_real("weight_decay", weight_decay, 0)
    optimizer = nnx.Optimizer(model, _adamw(float(weight_decay)), wrt=nnx.Param)
    track_lrs = []

    def step(global_step, input_batch, target_batch):
        lr = schedule(global_step)
        track_lrs.append(lr)
        check_labels(target_batch, model.cfg["vocab_size"], IGNORE_INDEX, "token ids")
        _scheduled_step(
            model,
            optimizer,
            as_array(input_batch),
            as_array(target_batch),
            jnp.float32(lr),
            jnp.bool_(global_step >= warmup_steps),
        )

    progress = train_loop(
        model,
        train_loader,
        val_loader,
        n_epochs,
        eval_freq,
        eval_iter,
        step=step,
        evaluate=evaluate_model,
        count=_tokens,
        step_name="Iter",
        end_of_epoch=_sample_after_epoch(model, tokenizer, start_context),
    )
    return progress.train_losses, progress.val_losses, progress.track_seen, track_lrs
