"""Section ``train``: one training step of the whole model, chapter 5's loop in both
frameworks.

At ``train_shape`` (b8 t256), GPT-2 small's shape, random weights, float32, every dropout rate
0, the same weights in both (``benchmarks.gpt_models``), one batch of random token ids, the
targets the inputs shifted by one:

- ``flax`` ``train_step``: ``flax_attention.models.train_step(model, optimizer, inputs,
  targets)`` with ``optimizer = nnx.Optimizer(model, optax.adamw(4e-4, weight_decay=0.1),
  wrt=nnx.Param)`` (the loss: mean cross-entropy over the flattened ``(b * t, V)`` logits), the
  model in train mode, default attention (``native`` on CPU where built).
- ``torch`` ``sdpa``: ``GPT2LMHeadModel`` (``attn_implementation="sdpa"``, train mode,
  ``use_cache=False``) with the book's ``torch.optim.AdamW(model.parameters(), lr=4e-4,
  weight_decay=0.1)``: ``zero_grad``, ``cross_entropy(logits.flatten(0, 1),
  targets.flatten())``, ``backward``, ``step``.

Two steps of each are run before timing and their losses compared (``max_*_diff``: the first
step's loss checks the forward, the second's the first update); then the steps are timed
round-robin, training on. ``ratio_vs_sdpa``: Flax time / torch time (< 1: Flax faster).
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import torch
from flax import nnx

from benchmarks.gpt_models import count_compiles, flax_model, torch_models
from benchmarks.prefill import format_model_rows
from benchmarks.rows import make_row, max_diffs
from benchmarks.timing import interleaved
from benchmarks.torch_device import device, to_torch
from flax_attention.models import train_step

__all__ = ["LEARNING_RATE", "TOLERANCE", "WEIGHT_DECAY", "plan_calls", "run"]

#: The book's chapter 5 optimiser settings.
LEARNING_RATE, WEIGHT_DECAY = 4e-4, 0.1
#: Parity bound of the two losses before timing, relative to ``max(1, |torch loss|)``.
TOLERANCE = 1e-4


def plan_calls(config) -> int:
    return 2 * 2 + 2 * config.train_repeats


def run(config, progress=None) -> list[dict]:
    batch, tokens = config.train_shape
    hf = torch_models(config, ("sdpa",), dropout=0.0)["sdpa"]
    model, _ = flax_model(hf)
    hf.to(device()).train()
    model.train()
    ids = np.random.default_rng(0).integers(0, model.cfg["vocab_size"], (batch, tokens + 1))
    inputs, targets = (
        jax.numpy.asarray(ids[:, :-1], jax.numpy.int32),
        jax.numpy.asarray(ids[:, 1:], jax.numpy.int32),
    )
    inputs_torch, targets_torch = to_torch(ids[:, :-1]), to_torch(ids[:, 1:])
    optimizer = nnx.Optimizer(
        model, optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY), wrt=nnx.Param
    )
    torch_optimizer = torch.optim.AdamW(hf.parameters(), lr=LEARNING_RATE,
                                        weight_decay=WEIGHT_DECAY)  # fmt: skip

    def flax_step():
        return train_step(model, optimizer, inputs, targets)

    def torch_step():
        torch_optimizer.zero_grad()
        logits = hf(inputs_torch, use_cache=False).logits  # (b, t, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets_torch.flatten())
        loss.backward()
        torch_optimizer.step()
        return loss.detach()

    losses = {"flax": [], "torch": []}
    for _ in range(2):
        losses["flax"].append(float(jax.block_until_ready(flax_step())))
        losses["torch"].append(float(torch_step()))
        if progress is not None:
            progress.update(2)
    diffs = max_diffs(
        {f"loss {i + 1}": np.float64(x) for i, x in enumerate(losses["flax"])},
        {f"loss {i + 1}": np.float64(x) for i, x in enumerate(losses["torch"])},
    )
    if diffs[1] > TOLERANCE:
        raise RuntimeError(
            f"train: Flax losses {losses['flax']} differ from torch's {losses['torch']} by "
            f"{diffs[1]:.1e} (relative) > {TOLERANCE:g}; not timing a wrong result"
        )
    calls = {"flax": flax_step, "torch": torch_step}
    with count_compiles() as timed:
        timings = interleaved(calls, config.train_repeats, progress)
    if timed.count:
        raise RuntimeError(f"train_step compiled {timed.count} times during timing")
    ratio = timings["flax"]["median_ms"] / timings["torch"]["median_ms"]
    case = f"b{batch}_t{tokens}"
    losses_text = {k: ", ".join(f"{x:.5f}" for x in v) for k, v in losses.items()}
    return [
        make_row(
            "train", case, "train step", framework, "train_step" if framework == "flax" else "sdpa",
            batch=batch, tokens=tokens, timing=timings[framework],
            value=batch * tokens / (timings[framework]["median_ms"] / 1e3), unit="tokens/s",
            ratio_vs_sdpa=ratio if framework == "flax" else 1.0,
            diffs=diffs if framework == "flax" else None,
            note=(
                "flax_attention.models.train_step, nnx.Optimizer(optax.adamw), dropout 0"
                if framework == "flax"
                else "GPT2LMHeadModel (sdpa) + torch.optim.AdamW, dropout 0"
            ) + f"; losses of the first two steps {losses_text[framework]}",
        )
        for framework in ("flax", "torch")
    ]  # fmt: skip


def format_rows(rows: list[dict], table) -> str:
    """The section's table (``table(headers, lines)`` from ``benchmarks.cli``)."""
    title = (
        "Train: one optimiser step of the whole model, median ms; /transformers = Flax time / "
        "transformers sdpa + AdamW time, same run (< 1: Flax faster)"
    )
    return format_model_rows(rows, table, title)
