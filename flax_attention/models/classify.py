"""Chapter 6 of the book: ``GPTModel`` fine-tuned as a classifier (the book's spam filter).

The book (``pkg/llms_from_scratch/ch06.py`` of https://github.com/rasbt/LLMs-from-scratch) puts
a head of ``num_classes`` outputs in place of the vocabulary's, trains the last transformer
block, the final norm and the new head, and reads the class from the last token's logits.
Here the same functions, with the book's names and semantics, no ``device`` argument, and an
``nnx.Optimizer`` where the book passes a torch optimizer:

==================================================  ===============================================
book (torch)                                        here
==================================================  ===============================================
``model.out_head = torch.nn.Linear(emb_dim,         ``model.out_head = classification_head(emb_dim,
num_classes)``                                      num_classes, rngs=nnx.Rngs(123))`` (or any
                                                    ``nnx.Linear(emb_dim, num_classes, ...)``)
``requires_grad = False`` everywhere, then ``True``  ``nnx.Optimizer(model, optax.adamw(5e-5,
for ``trf_blocks[-1]``, ``final_norm``,             weight_decay=0.1),
``out_head``; ``torch.optim.AdamW(                  wrt=trainable_filter(model))``
model.parameters(), lr=5e-5, weight_decay=0.1)``
``calc_loss_batch(input_batch, target_batch,        ``calc_loss_batch(input_batch, target_batch,
model, device)``: cross-entropy of the last         model)``
token's logits
``calc_loss_loader``, ``calc_accuracy_loader``,     the same, without ``device``
``evaluate_model``
``train_classifier_simple(model, train_loader,      ``train_classifier_simple(model, train_loader,
val_loader, optimizer, device, num_epochs,          val_loader, optimizer, num_epochs, eval_freq,
eval_freq, eval_iter)``                             eval_iter)`` (the optimizer may also come
                                                    second): chapter 5's loop
                                                    (``training.train_loop``), examples counted,
                                                    the accuracies after each epoch
``classify_review(text, model, tokenizer, device,   ``classify_review(text, model, tokenizer,
max_length=None, pad_token_id=50256)``              max_length=None, pad_token_id=50256)``
==================================================  ===============================================

A batch is ``(input_batch, target_batch)``: ``(b, t)`` token ids (each text padded to one
length with ``pad_token_id``, as the book's ``SpamDataset`` does) and ``(b,)`` class labels in
``0..num_classes - 1``; NumPy, JAX or CPU torch tensors. The training step and the evaluation
are each one ``nnx.jit``, compiled once per batch shape and mode. The model with its new head
exports and loads its state dict in the book's names (``out_head.weight`` of shape
``(num_classes, emb_dim)``, ``out_head.bias``) through ``flax_attention.state_dict`` and
``load_state_dict``; ``generate`` refuses it (its logits score classes, not tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_attention._checks import check_instance, check_int
from flax_attention._layers import linear_factory
from flax_attention.models._modes import in_eval_mode
from flax_attention.models.gpt import _REPLICATED, GPTModel, describe_head, head_outputs
from flax_attention.models.training import (
    as_array,
    check_labels,
    check_loop,
    cross_entropy,
    evaluate_losses,
    loader_mean,
    loaders_and_optimizer,
    loss_and_grads,
    train_loop,
)

__all__ = [
    "TrainableFilter",
    "calc_accuracy_loader",
    "calc_loss_batch",
    "calc_loss_loader",
    "classification_head",
    "classify_review",
    "evaluate_model",
    "train_classifier_simple",
    "trainable_filter",
]


# ---- the head and what trains --------------------------------------------------------------------


def _check_num_classes(num_classes, where: str = "") -> None:
    why = "a classifier scores at least two classes; the book's spam filter: 2"
    check_int(f"num_classes{where}", num_classes, 2, why=why)


def classification_head(
    emb_dim: int,
    num_classes: int,
    *,
    rngs: nnx.Rngs,
    dtype=None,
    param_dtype=jnp.float32,
    precision=None,
) -> nnx.Linear:
    """The book's new head, ``torch.nn.Linear(in_features=emb_dim, out_features=num_classes)``:
    an ``nnx.Linear`` with bias whose weights are drawn as torch's (uniform in
    ``+-1/sqrt(emb_dim)``), replicated on a mesh as the vocabulary's head. Put it in place:
    ``model.out_head = classification_head(cfg["emb_dim"], 2, rngs=nnx.Rngs(123))``."""
    check_int("emb_dim", emb_dim, 1)
    _check_num_classes(num_classes)
    linear = linear_factory(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
    return linear(emb_dim, num_classes, axes=_REPLICATED)


def num_classes_of(model) -> int:
    """The classes ``model``'s head scores (its outputs per token), at least 2."""
    if not isinstance(model, GPTModel):
        raise TypeError(f"model ({type(model).__name__}) must be a GPTModel")
    classes = head_outputs(model)
    _check_num_classes(classes, where=f" (model.out_head: {describe_head(model.out_head)})")
    return classes


@dataclasses.dataclass(frozen=True)
class TrainableFilter:
    """An NNX filter (``(path, variable) -> bool``) for the parameters chapter 6 trains: those of
    ``trf_blocks[last_block]``, ``final_norm`` and ``out_head``. Equal filters hash alike, so
    optimisers built with them share the compiled step."""

    last_block: int

    def __call__(self, path, value) -> bool:
        if not isinstance(value, nnx.Param) or not path:
            return False
        if path[0] in ("final_norm", "out_head"):
            return True
        return path[0] == "trf_blocks" and len(path) > 1 and path[1] == self.last_block


def trainable_filter(model) -> TrainableFilter:
    """The ``wrt`` filter for ``nnx.Optimizer`` that trains what the book unfreezes: the last
    transformer block, ``final_norm`` and ``out_head`` (every other parameter stays as it is,
    as torch's ``requires_grad = False`` keeps it)::

        optimizer = nnx.Optimizer(model, optax.adamw(5e-5, weight_decay=0.1),
                                  wrt=trainable_filter(model))
    """
    if not isinstance(model, GPTModel):
        raise TypeError(f"model ({type(model).__name__}) must be a GPTModel")
    return TrainableFilter(last_block=len(model.trf_blocks) - 1)


# ---- loss and accuracy ---------------------------------------------------------------------------


def calc_loss_batch(input_batch, target_batch, model):
    """Cross-entropy of the last token's logits ``model(input_batch)[:, -1, :]`` ``(b, C)``
    against the labels ``target_batch`` ``(b,)``, the mean over the batch."""
    classes = num_classes_of(model)
    check_labels(target_batch, classes, None, "labels")
    logits = model(as_array(input_batch))[:, -1, :]  # (b, num_classes)
    return cross_entropy(logits, jnp.asarray(as_array(target_batch)), ignore_index=None)


@functools.partial(nnx.jit, donate_argnums=(0, 1))
def _train_step(model, optimizer: nnx.Optimizer, input_batch, target_batch):
    def loss_fn(model):
        return calc_loss_batch(input_batch, target_batch, model)

    loss, grads = loss_and_grads(loss_fn, model, optimizer)
    optimizer.update(model, grads)
    return loss


def train_step(model, optimizer: nnx.Optimizer, input_batch, target_batch):
    """One step of ``train_classifier_simple`` (``zero_grad``, ``backward``, ``step``) on what
    ``optimizer`` trains; returns the batch's loss before it. In place, as
    ``flax_attention.models.train_step`` (the model's and optimiser's arrays are donated)."""
    check_labels(target_batch, num_classes_of(model), None, "labels")
    return _train_step(model, optimizer, as_array(input_batch), as_array(target_batch))


@nnx.jit
def _evaluate(model, input_batch, target_batch):
    """The batch's loss and its predicted labels ``(b,)`` (``argmax`` of the last logits)."""
    logits = model(input_batch)[:, -1, :]  # (b, num_classes)
    loss = cross_entropy(logits, target_batch, ignore_index=None)
    return loss, jnp.argmax(logits, axis=-1)


def _checked(model, input_batch, target_batch):
    check_labels(target_batch, num_classes_of(model), None, "labels")
    return _evaluate(model, as_array(input_batch), as_array(target_batch))


def calc_loss_loader(data_loader, model, num_batches: int | None = None) -> float:
    """The mean of the first ``num_batches`` batches' losses (all if ``None``; ``nan`` for an
    empty loader), as the book's; runs in the model's current mode. Chapter 5's
    ``calc_loss_loader`` with the last token's loss against labels in place of every token's."""

    def loss(input_batch, target_batch):  # labels, not token ids
        return float(_checked(model, input_batch, target_batch)[0])

    return loader_mean(data_loader, num_batches, loss)


def calc_accuracy_loader(data_loader, model, num_batches: int | None = None) -> float:
    """The share of the first ``num_batches`` batches' examples (all if ``None``) whose
    last-token ``argmax`` is their label, in eval mode (the book's ``model.eval()``; the
    model's mode is put back afterwards); ``nan`` for an empty loader."""
    check_int("num_batches", num_batches, 1, optional="every batch")
    return _accuracy(model, data_loader, num_batches)


@in_eval_mode
def _accuracy(model, data_loader, num_batches):
    correct, examples = 0, 0
    for input_batch, target_batch in itertools.islice(data_loader, num_batches):
        predicted = np.asarray(_checked(model, input_batch, target_batch)[1])  # (b,)
        correct += int((predicted == np.asarray(target_batch)).sum())
        examples += predicted.shape[0]
    return correct / examples if examples else math.nan


def evaluate_model(model, train_loader, val_loader, eval_iter: int) -> tuple[float, float]:
    """``(train_loss, val_loss)`` over ``eval_iter`` batches each, in eval mode; the model is
    back in train mode afterwards, as the book's ``evaluate_model`` leaves it."""
    return evaluate_losses(calc_loss_loader, model, train_loader, val_loader, eval_iter)


# ---- the loop ------------------------------------------------------------------------------------


def _examples(input_batch) -> int:
    return np.shape(input_batch)[0]


def train_classifier_simple(
    model,
    train_loader,
    val_loader,
    optimizer: nnx.Optimizer,
    num_epochs: int,
    eval_freq: int,
    eval_iter: int,
):
    """The book's ``train_classifier_simple``: ``num_epochs`` passes over ``train_loader``,
    one step per batch on what ``optimizer`` trains (``trainable_filter(model)`` for the
    book's parts); every ``eval_freq`` steps, from step 0, ``evaluate_model`` over
    ``eval_iter`` batches of each loader; after each epoch ``calc_accuracy_loader`` over
    ``eval_iter`` batches of each. Prints the book's progress lines and returns its
    ``(train_losses, val_losses, train_accs, val_accs, examples_seen)``, ``examples_seen``
    the number of training examples stepped on.

    ``optimizer`` (an ``nnx.Optimizer`` over ``model``) stands where the book passes its torch
    optimizer; it may also come second, ``(model, optimizer, train_loader, val_loader, ...)``.
    The loaders are read anew at every epoch and evaluation (lists of batches, DataLoaders)."""
    train_loader, val_loader, optimizer = loaders_and_optimizer(train_loader, val_loader, optimizer)
    num_classes_of(model)
    check_loop("num_epochs", num_epochs, eval_freq, eval_iter)
    train_accs, val_accs = [], []

    def step(global_step, input_batch, target_batch):
        train_step(model, optimizer, input_batch, target_batch)

    def accuracies():  # the book's end of an epoch
        train_accuracy = calc_accuracy_loader(train_loader, model, num_batches=eval_iter)
        val_accuracy = calc_accuracy_loader(val_loader, model, num_batches=eval_iter)
        print(f"Training accuracy: {train_accuracy * 100:.2f}% | ", end="")
        print(f"Validation accuracy: {val_accuracy * 100:.2f}%")
        train_accs.append(train_accuracy)
        val_accs.append(val_accuracy)

    progress = train_loop(
        model,
        train_loader,
        val_loader,
        num_epochs,
        eval_freq,
        eval_iter,
        step=step,
        evaluate=evaluate_model,
        count=_examples,
        end_of_epoch=accuracies,
    )
    return progress.train_losses, progress.val_losses, train_accs, val_accs, progress.seen


# ---- one text ------------------------------------------------------------------------------------


@in_eval_mode
def _predict(model, input_ids: np.ndarray) -> int:
    _, predicted = _evaluate(model, input_ids, np.zeros((1,), np.int32))
    return int(predicted[0])


def classify_review(text, model, tokenizer, max_length=None, pad_token_id=50256) -> str:
    """The book's ``classify_review``: ``text`` encoded (``tokenizer.encode``), cut to
    ``max_length`` tokens (and the model's ``context_length``), padded to ``max_length`` with
    ``pad_token_id``, classified by the last token's logits in eval mode (the model's mode is
    put back). Returns ``"spam"`` for class 1, else ``"not spam"``, as the book.

    ``max_length``: the length the training texts were padded to (the book passes its
    ``SpamDataset``'s ``max_length``); ``None`` keeps the text's own length (cut to
    ``context_length``), where the book's code fails (``min(None, ...)``)."""
    check_instance("text", text, str, "a str")
    num_classes_of(model)
    context_length = model.cfg["context_length"]
    check_int("max_length", max_length, 1, optional="the text's own length")
    if max_length is not None and max_length > context_length:
        raise ValueError(
            f"max_length ({max_length}) must not exceed the model's context_length "
            f"({context_length})"
        )
    check_int("pad_token_id", pad_token_id, 0)
    input_ids = list(tokenizer.encode(text))
    input_ids = input_ids[: context_length if max_length is None else max_length]
    if max_length is not None:
        input_ids += [pad_token_id] * (max_length - len(input_ids))
    if not input_ids:
        raise ValueError(
            f"text ({text!r}) must encode to at least one token (or give max_length to pad it)"
        )
    label = _predict(model, np.asarray([input_ids]))
    return "spam" if label == 1 else "not spam"
