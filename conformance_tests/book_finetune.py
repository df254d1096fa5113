"""The book's fine-tuning code in torch (chapters 6 and 7, appendix D, and chapter 5's loop they
build on): the reference ``flax_attention.models.classify``, ``instruct`` and ``training`` are
held to (``tests/test_finetune.py``).

"Build a Large Language Model (From Scratch)" (Sebastian Raschka) fine-tunes chapter 4's
``GPTModel`` (here ``conformance_tests.book_gpt.GPTModel``, the same model and state dict) as a
spam classifier in chapter 6 and as an instruction follower in chapter 7, and trains it with a
learning-rate schedule and gradient clipping in appendix D. The functions below follow the
book's published package loop for loop, line for line where it matters
(https://github.com/rasbt/LLMs-from-scratch, ``pkg/llms_from_scratch/ch05.py``, ``ch06.py``,
``ch07.py``, ``appendix_d.py``; Apache License 2.0), with their names and arguments, ``device``
included. The book's module of each is named in its docstring; chapter 5's ``calc_loss_batch``,
``calc_loss_loader`` and ``evaluate_model`` are ``book_gpt``'s, and chapter 6's functions of the
same names are the ones here.

What differs from the book, and why:

- ``train_model_simple`` and ``train_model`` print a generated sample after each epoch only
  when ``start_context`` is given (the book always does; the tests compare the training);
- ``custom_collate_fn`` is the book's final one (not its two drafts); the downloads, data sets,
  plots and the Ollama scoring of the book's modules are left out (they are not what is
  compared).
"""

from __future__ import annotations

import math

import torch

from conformance_tests.book_gpt import calc_loss_batch as ch05_calc_loss_batch
from conformance_tests.book_gpt import evaluate_model as ch05_evaluate_model
from conformance_tests.book_gpt import generate_text_simple

__all__ = [
    "calc_accuracy_loader",
    "calc_loss_batch",
    "calc_loss_loader",
    "classify_review",
    "custom_collate_fn",
    "evaluate_model",
    "format_input",
    "generate_and_print_sample",
    "train_classifier_simple",
    "train_model",
    "train_model_simple",
]


# ---- chapter 5 ----------------------------------------------------------------------------------


def text_to_token_ids(text, tokenizer):
    """``ch05.text_to_token_ids`` (``allowed_special`` is tiktoken's; a plain tokenizer's
    ``encode`` is called without it)."""
    try:
        encoded = tokenizer.encode(text, allowed_special={"<|endoftext|>"})
    except TypeError:
        encoded = tokenizer.encode(text)
    return torch.tensor(encoded).unsqueeze(0)  # add batch dimension


def token_ids_to_text(token_ids, tokenizer):
    """``ch05.token_ids_to_text``."""
    flat = token_ids.squeeze(0)  # remove batch dimension
    return tokenizer.decode(flat.tolist())


def generate_and_print_sample(model, tokenizer, device, start_context):
    """``ch05.generate_and_print_sample``."""
    model.eval()
    context_size = model.pos_emb.weight.shape[0]
    encoded = text_to_token_ids(start_context, tokenizer).to(device)
    with torch.no_grad():
        token_ids = generate_text_simple(
            model=model, idx=encoded, max_new_tokens=50, context_size=context_size
        )
        decoded_text = token_ids_to_text(token_ids, tokenizer)
        print(decoded_text.replace("\n", " "))  # Compact print format
    model.train()


def train_model_simple(model, train_loader, val_loader, optimizer, device, num_epochs,
                       eval_freq, eval_iter, start_context, tokenizer):  # fmt: skip
    """``ch05.train_model_simple`` (chapter 7 trains with it as well)."""
    train_losses, val_losses, track_tokens_seen = [], [], []
    tokens_seen, global_step = 0, -1

    for epoch in range(num_epochs):
        model.train()
        for input_batch, target_batch in train_loader:
            optimizer.zero_grad()
            loss = ch05_calc_loss_batch(input_batch, target_batch, model, device)
            loss.backward()
            optimizer.step()
            tokens_seen += input_batch.numel()
            global_step += 1

            if global_step % eval_freq == 0:
                train_loss, val_loss = ch05_evaluate_model(
                    model, train_loader, val_loader, device, eval_iter
                )
                train_losses.append(train_loss)
                val_losses.append(val_loss)
                track_tokens_seen.append(tokens_seen)
                print(f"Ep {epoch+1} (Step {global_step:06d}): "
                      f"Train loss {train_loss:.3f}, Val loss {val_loss:.3f}")  # fmt: skip

        if start_context is not None:
            generate_and_print_sample(model, tokenizer, device, start_context)

    return train_losses, val_losses, track_tokens_seen


# ---- chapter 6 ----------------------------------------------------------------------------------


def calc_accuracy_loader(data_loader, model, device, num_batches=None):
    """``ch06.calc_accuracy_loader``: eval mode (left on), the last token's logits."""
    model.eval()
    correct_predictions, num_examples = 0, 0

    if num_batches is None:
        num_batches = len(data_loader)
    else:
        num_batches = min(num_batches, len(data_loader))
    for i, (input_batch, target_batch) in enumerate(data_loader):
        if i < num_batches:
            input_batch, target_batch = input_batch.to(device), target_batch.to(device)

            with torch.no_grad():
                logits = model(input_batch)[:, -1, :]  # Logits of last output token
            predicted_labels = torch.argmax(logits, dim=-1)

            num_examples += predicted_labels.shape[0]
            correct_predictions += (predicted_labels == target_batch).sum().item()
        else:
            break
    return correct_predictions / num_examples


def calc_loss_batch(input_batch, target_batch, model, device):
    """``ch06.calc_loss_batch``: cross-entropy of the last token's logits."""
    input_batch, target_batch = input_batch.to(device), target_batch.to(device)
    logits = model(input_batch)[:, -1, :]  # Logits of last output token
    loss = torch.nn.functional.cross_entropy(logits, target_batch)
    return loss


def calc_loss_loader(data_loader, model, device, num_batches=None):
    """``ch06.calc_loss_loader``."""
    total_loss = 0.0
    if len(data_loader) == 0:
        return float("nan")
    elif num_batches is None:
        num_batches = len(data_loader)
    else:
        num_batches = min(num_batches, len(data_loader))
    for i, (input_batch, target_batch) in enumerate(data_loader):
        if i < num_batches:
            loss = calc_loss_batch(input_batch, target_batch, model, device)
            total_loss += loss.item()
        else:
            break
    return total_loss / num_batches


def evaluate_model(model, train_loader, val_loader, device, eval_iter):
    """``ch06.evaluate_model``."""
    model.eval()
    with torch.no_grad():
        train_loss = calc_loss_loader(train_loader, model, device, num_batches=eval_iter)
        val_loss = calc_loss_loader(val_loader, model, device, num_batches=eval_iter)
    model.train()
    return train_loss, val_loss


def train_classifier_simple(model, train_loader, val_loader, optimizer, device, num_epochs,
                            eval_freq, eval_iter):  # fmt: skip
    """``ch06.train_classifier_simple``."""
    train_losses, val_losses, train_accs, val_accs = [], [], [], []
    examples_seen, global_step = 0, -1

    for epoch in range(num_epochs):
        model.train()

        for input_batch, target_batch in train_loader:
            optimizer.zero_grad()
            loss = calc_loss_batch(input_batch, target_batch, model, device)
            loss.backward()
            optimizer.step()
            examples_seen += input_batch.shape[0]  # New: track examples instead of tokens
            global_step += 1

            if global_step % eval_freq == 0:
                train_loss, val_loss = evaluate_model(
                    model, train_loader, val_loader, device, eval_iter
                )
                train_losses.append(train_loss)
                val_losses.append(val_loss)
                print(f"Ep {epoch+1} (Step {global_step:06d}): "
                      f"Train loss {train_loss:.3f}, Val loss {val_loss:.3f}")  # fmt: skip

        train_accuracy = calc_accuracy_loader(train_loader, model, device, num_batches=eval_iter)
        val_accuracy = calc_accuracy_loader(val_loader, model, device, num_batches=eval_iter)
        print(f"Training accuracy: {train_accuracy * 100:.2f}% | ", end="")
        print(f"Validation accuracy: {val_accuracy * 100:.2f}%")
        train_accs.append(train_accuracy)
        val_accs.append(val_accuracy)

    return train_losses, val_losses, train_accs, val_accs, examples_seen


def classify_review(text, model, tokenizer, device, max_length=None, pad_token_id=50256):
    """``ch06.classify_review``: ``"spam"`` for class 1, else ``"not spam"``."""
    model.eval()

    input_ids = tokenizer.encode(text)
    supported_context_length = model.pos_emb.weight.shape[0]

    input_ids = input_ids[: min(max_length, supported_context_length)]

    input_ids += [pad_token_id] * (max_length - len(input_ids))
    input_tensor = torch.tensor(input_ids, device=device).unsqueeze(0)  # add batch dimension

    with torch.no_grad():
        logits = model(input_tensor)[:, -1, :]  # Logits of the last output token
    predicted_label = torch.argmax(logits, dim=-1).item()

    return "spam" if predicted_label == 1 else "not spam"


# ---- chapter 7 ----------------------------------------------------------------------------------


def format_input(entry):
    """``ch07.format_input``: the Alpaca-style prompt."""
    instruction_text = (
        f"Below is an instruction that describes a task. "
        f"Write a response that appropriately completes the request."
        f"\n\n### Instruction:\n{entry['instruction']}"
    )

    input_text = f"\n\n### Input:\n{entry['input']}" if entry["input"] else ""

    return instruction_text + input_text


def custom_collate_fn(batch, pad_token_id=50256, ignore_index=-100, allowed_max_length=None,
                      device="cpu"):  # fmt: skip
    """``ch07.custom_collate_fn``: pad with ``pad_token_id`` (one of them kept as end of text
    in the targets, the rest ``ignore_index``), shift, then truncate."""
    batch_max_length = max(len(item) + 1 for item in batch)

    inputs_lst, targets_lst = [], []

    for item in batch:
        new_item = item.copy()
        new_item += [pad_token_id]
        padded = new_item + [pad_token_id] * (batch_max_length - len(new_item))
        inputs = torch.tensor(padded[:-1])  # Truncate the last token for inputs
        targets = torch.tensor(padded[1:])  # Shift +1 to the right for targets

        mask = targets == pad_token_id
        indices = torch.nonzero(mask).squeeze()
        if indices.numel() > 1:
            targets[indices[1:]] = ignore_index

        if allowed_max_length is not None:
            inputs = inputs[:allowed_max_length]
            targets = targets[:allowed_max_length]

        inputs_lst.append(inputs)
        targets_lst.append(targets)

    inputs_tensor = torch.stack(inputs_lst).to(device)
    targets_tensor = torch.stack(targets_lst).to(device)

    return inputs_tensor, targets_tensor


# ---- appendix D ---------------------------------------------------------------------------------


def train_model(model, train_loader, val_loader, optimizer, device, n_epochs, eval_freq,
                eval_iter, start_context, tokenizer, warmup_steps, initial_lr=3e-05,
                min_lr=1e-6, orig_book_version=False):  # fmt: skip
    """``appendix_d.train_model``: linear warmup, cosine decay, clipping to norm 1.0 from
    ``global_step >= warmup_steps`` (``> warmup_steps`` with ``orig_book_version``)."""
    train_losses, val_losses, track_tokens_seen, track_lrs = [], [], [], []
    tokens_seen, global_step = 0, -1

    peak_lr = optimizer.param_groups[0]["lr"]
    total_training_steps = len(train_loader) * n_epochs
    lr_increment = (peak_lr - initial_lr) / warmup_steps

    for epoch in range(n_epochs):
        model.train()
        for input_batch, target_batch in train_loader:
            optimizer.zero_grad()
            global_step += 1

            if global_step < warmup_steps:
                lr = initial_lr + global_step * lr_increment
            else:
                progress = (global_step - warmup_steps) / (total_training_steps - warmup_steps)
                lr = min_lr + (peak_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))

            for param_group in optimizer.param_groups:
                param_group["lr"] = lr
            track_lrs.append(lr)

            loss = ch05_calc_loss_batch(input_batch, target_batch, model, device)
            loss.backward()

            if orig_book_version:
                if global_step > warmup_steps:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            else:
                if global_step >= warmup_steps:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)

            optimizer.step()
            tokens_seen += input_batch.numel()

            if global_step % eval_freq == 0:
                train_loss, val_loss = ch05_evaluate_model(
                    model, train_loader, val_loader, device, eval_iter
                )
                train_losses.append(train_loss)
                val_losses.append(val_loss)
                track_tokens_seen.append(tokens_seen)
                print(f"Ep {epoch+1} (Iter {global_step:06d}): "
                      f"Train loss {train_loss:.3f}, "
                      f"Val loss {val_loss:.3f}")  # fmt: skip

        if start_context is not None:
            generate_and_print_sample(model, tokenizer, device, start_context)

    return train_losses, val_losses, track_tokens_seen, track_lrs
