"""Chapter 7 of the book: instruction fine-tuning, its prompt and its batches.

The book (``pkg/llms_from_scratch/ch07.py`` of https://github.com/rasbt/LLMs-from-scratch)
formats each entry of an instruction data set (``{"instruction", "input", "output"}``) as an
Alpaca prompt, tokenizes prompt and response, and batches the token lists with
``custom_collate_fn``: each sequence gets an end-of-text token and is padded to the batch's
longest, the targets are the inputs shifted by one, and every padding target after the first
becomes ``ignore_index`` (-100), which the loss leaves out. Training is chapter 5's
``train_model_simple`` (``flax_attention.models.training``), whose loss honours -100 as torch's
``cross_entropy`` does.

===============================================  ============================================
book (torch)                                     here
===============================================  ============================================
``format_input(entry)``                          ``format_input(entry)``: the same text
``custom_collate_fn(batch, pad_token_id=50256,   ``custom_collate_fn(batch, pad_token_id=50256,
ignore_index=-100, allowed_max_length=None,      ignore_index=-100, allowed_max_length=None)``:
device="cpu")``: two int64 tensors               two int64 NumPy arrays, the same values
===============================================  ============================================

A jitted step compiles once per batch shape: the collate pads each batch to its own longest
sequence, so batches of many widths compile many times (``allowed_max_length`` bounds them).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from flax_attention._checks import check_int
from flax_attention.models.training import IGNORE_INDEX

__all__ = ["format_input", "custom_collate_fn"]


def format_input(entry) -> str:
    """The book's Alpaca-style prompt of ``entry`` (a dict with ``"instruction"`` and
    ``"input"``): the preamble, ``### Instruction:``, and ``### Input:`` only when the input is
    not empty. The response (``"\\n\\n### Response:\\n" + entry["output"]``) is appended by the
    caller, as the book's ``InstructionDataset`` does."""
    if not isinstance(entry, Mapping):
        raise TypeError(
            f"entry ({type(entry).__name__}) must be a dict with keys 'instruction' and 'input'"
        )
    missing = [key for key in ("instruction", "input") if key not in entry]
    if missing:
        raise ValueError(
            f"entry (keys {sorted(entry)}) must have keys 'instruction' and 'input' "
            f"(missing: {missing})"
        )
    instruction_text = (
        "Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request."
        f"\n\n### Instruction:\n{entry['instruction']}"
    )
    input_text = f"\n\n### Input:\n{entry['input']}" if entry["input"] else ""
    return instruction_text + input_text


def _token_ids(name: str, item) -> list[int]:
    ids = np.asarray(item)
    if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
        raise TypeError(
            f"{name} (shape {ids.shape}, dtype {ids.dtype}) must be a sequence of int token ids"
        )
    if ids.size == 0:
        raise ValueError(f"{name} (an empty sequence) must hold at least one token id")
    return ids.tolist()


def custom_collate_fn(
    batch,
    pad_token_id: int = 50256,
    ignore_index: int = IGNORE_INDEX,
    allowed_max_length: int | None = None,
):
    """The book's ``custom_collate_fn``: token-id sequences -> ``(inputs, targets)``, two int64
    arrays ``(b, t)``.

    Each sequence gets one ``pad_token_id`` (the end-of-text token) and is padded with it to
    the batch's longest sequence plus one; ``inputs`` drop the last token, ``targets`` the first
    (shifted by one). In each row's targets, every ``pad_token_id`` after the first becomes
    ``ignore_index`` (so the first, end of text, is learnt; the book compares the values, so a
    ``pad_token_id`` inside the text counts as the first). Then both are cut to
    ``allowed_max_length`` tokens when given. ``t`` is ``min(longest, allowed_max_length)``.
    """
    check_int("pad_token_id", pad_token_id, 0)
    check_int("ignore_index", ignore_index, why="torch's default -100")
    if ignore_index >= 0:
        raise ValueError(
            f"ignore_index ({ignore_index}) must be negative, no token id (0 and up are token "
            "ids; torch's default -100 is what the loss leaves out)"
        )
    check_int("allowed_max_length", allowed_max_length, 2, optional="no cut")
    if isinstance(batch, (str, bytes)) or not hasattr(batch, "__len__"):
        raise TypeError(f"batch ({type(batch).__name__}) must be a list of token-id sequences")
    if len(batch) == 0:
        raise ValueError("batch (0 sequences) must hold at least one token-id sequence")
    items = [_token_ids(f"batch[{i}]", item) for i, item in enumerate(batch)]

    batch_max_length = max(len(item) + 1 for item in items)
    inputs = np.full((len(items), batch_max_length - 1), pad_token_id, np.int64)
    targets = np.full((len(items), batch_max_length - 1), pad_token_id, np.int64)
    for row, item in enumerate(items):
        padded = item + [pad_token_id] * (batch_max_length - len(item))
        inputs[row] = padded[:-1]
        targets[row] = padded[1:]
        pads = np.flatnonzero(targets[row] == pad_token_id)
        targets[row, pads[1:]] = ignore_index
    if allowed_max_length is not None:
        inputs = np.ascontiguousarray(inputs[:, :allowed_max_length])
        targets = np.ascontiguousarray(targets[:, :allowed_max_length])
    return inputs, targets
