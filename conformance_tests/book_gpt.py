"""The book's chapter 4 ``GPTModel`` and chapter 5 ``generate`` in torch: the reference that
``flax_attention.models`` is held to (``tests/test_models.py``).

"Build a Large Language Model (From Scratch)" (Sebastian Raschka) builds GPT-2 in chapter 4 from
chapter 3's ``MultiHeadAttention`` (here ``torch_reference.MultiHeadAttention``, the same class
and ``state_dict``) and generates text with it in chapters 4 and 5. This module follows the
book's published structure, attribute names and semantics (its code:
https://github.com/rasbt/LLMs-from-scratch, ``pkg/llms_from_scratch/ch04.py`` and ``ch05.py``),
so its ``state_dict()`` has the book's keys:

- ``LayerNorm``: ``scale``, ``shift``, eps 1e-5, biased variance (``unbiased=False``);
- ``GELU``: the tanh approximation as the book writes it;
- ``FeedForward``: ``layers`` = ``Sequential(Linear(d, 4d), GELU(), Linear(4d, d))``;
- ``TransformerBlock``: ``att``, ``ff``, ``norm1``, ``norm2``, ``drop_resid`` (pre-norm, a
  shortcut around each half; the book's code also names the dropout ``drop_shortcut``, which
  holds no weights, so the state dict is the same either way);
- ``GPTModel``: ``tok_emb``, ``pos_emb``, ``drop_emb``, ``trf_blocks`` (``Sequential``),
  ``final_norm``, ``out_head`` (``Linear(emb_dim, vocab_size, bias=False)``);
- ``generate_text_simple`` (chapter 4) and ``generate`` (chapter 5), loop for loop;
- chapter 5's ``calc_loss_batch``, ``calc_loss_loader``, ``evaluate_model`` and the inner loop of
  ``train_model_simple`` (``train_steps``).

Two things the book's code does that the tests rely on being reproduced as written: the window
``idx[:, -context_size:]`` is re-run from position 0 once the sequence outgrows
``context_size``, and ``generate`` stops *before* appending a token equal to ``eos_id``
(``if idx_next == eos_id: break``, a test that needs one row). Its top-k line compares
``logits`` ``(b, V)`` with ``top_logits[:, -1]`` ``(b,)``, which broadcasts as meant only for one
row; the tests call it with top-k on one row.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from torch_reference import MultiHeadAttention

__all__ = [
    "GELU",
    "FeedForward",
    "GPTModel",
    "LayerNorm",
    "TransformerBlock",
    "calc_loss_batch",
    "calc_loss_loader",
    "evaluate_model",
    "generate",
    "generate_text_simple",
    "train_steps",
]


class LayerNorm(nn.Module):
    """``scale * (x - mean) / sqrt(var + eps) + shift`` over the last axis, biased variance."""

    def __init__(self, emb_dim):
        super().__init__()
        self.eps = 1e-5
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)  # (..., 1)
        var = x.var(dim=-1, keepdim=True, unbiased=False)  # (..., 1)
        norm_x = (x - mean) / torch.sqrt(var + self.eps)
        return self.scale * norm_x + self.shift


class GELU(nn.Module):
    """``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""

    def forward(self, x):
        return (
            0.5
            * x
            * (1 + torch.tanh(torch.sqrt(torch.tensor(2.0 / torch.pi)) * (x + 0.044715 * x**3)))
        )


class FeedForward(nn.Module):
    """``layers`` = Linear(d, 4d), GELU, Linear(4d, d)."""

    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(cfg["emb_dim"], 4 * cfg["emb_dim"]),
            GELU(),
            nn.Linear(4 * cfg["emb_dim"], cfg["emb_dim"]),
        )

    def forward(self, x):
        return self.layers(x)


class TransformerBlock(nn.Module):
    """``x + drop_resid(att(norm1(x)))``, then ``x + drop_resid(ff(norm2(x)))``."""

    def __init__(self, cfg):
        super().__init__()
        self.att = MultiHeadAttention(
            d_in=cfg["emb_dim"],
            d_out=cfg["emb_dim"],
            context_length=cfg["context_length"],
            dropout=cfg["drop_rate"],
            num_heads=cfg["n_heads"],
            qkv_bias=cfg["qkv_bias"],
        )
        self.ff = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg["emb_dim"])
        self.norm2 = LayerNorm(cfg["emb_dim"])
        self.drop_resid = nn.Dropout(cfg["drop_rate"])

    def forward(self, x):
        shortcut = x
        x = self.norm1(x)
        x = self.att(x)  # (b, num_tokens, emb_dim)
        x = self.drop_resid(x)
        x = x + shortcut

        shortcut = x
        x = self.norm2(x)
        x = self.ff(x)  # (b, num_tokens, emb_dim)
        x = self.drop_resid(x)
        return x + shortcut


class GPTModel(nn.Module):
    """Token ids ``in_idx`` ``(b, t)`` -> logits ``(b, t, vocab_size)``; ``cfg`` is the book's
    dict (``vocab_size``, ``context_length``, ``emb_dim``, ``n_heads``, ``n_layers``,
    ``drop_rate``, ``qkv_bias``). The book's model has its own, untied ``out_head``."""

    def __init__(self, cfg):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
        self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"])
        self.drop_emb = nn.Dropout(cfg["drop_rate"])
        self.trf_blocks = nn.Sequential(*[TransformerBlock(cfg) for _ in range(cfg["n_layers"])])
        self.final_norm = LayerNorm(cfg["emb_dim"])
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)

    def forward(self, in_idx):
        batch_size, seq_len = in_idx.shape
        tok_embeds = self.tok_emb(in_idx)  # (b, t, emb_dim)
        pos_embeds = self.pos_emb(torch.arange(seq_len, device=in_idx.device))  # (t, emb_dim)
        x = tok_embeds + pos_embeds
        x = self.drop_emb(x)
        x = self.trf_blocks(x)
        x = self.final_norm(x)
        return self.out_head(x)  # (b, t, vocab_size)


def generate_text_simple(model, idx, max_new_tokens, context_size):
    """Chapter 4: ``max_new_tokens`` greedy tokens appended to ``idx`` ``(b, t)``."""
    for _ in range(max_new_tokens):
        idx_cond = idx[:, -context_size:]  # (b, <= context_size)
        with torch.no_grad():
            logits = model(idx_cond)
        logits = logits[:, -1, :]  # (b, vocab_size)
        probas = torch.softmax(logits, dim=-1)
        idx_next = torch.argmax(probas, dim=-1, keepdim=True)  # (b, 1)
        idx = torch.cat((idx, idx_next), dim=1)  # (b, t + 1)
    return idx


def generate(model, idx, max_new_tokens, context_size, temperature=0.0, top_k=None, eos_id=None):
    """Chapter 5: top-k filtering, then temperature sampling (``temperature > 0``, from torch's
    global generator) or greedy; stops before appending ``eos_id``."""
    for _ in range(max_new_tokens):
        idx_cond = idx[:, -context_size:]  # (b, <= context_size)
        with torch.no_grad():
            logits = model(idx_cond)
        logits = logits[:, -1, :]  # (b, vocab_size)

        if top_k is not None:
            top_logits, _ = torch.topk(logits, top_k)
            min_val = top_logits[:, -1]
            logits = torch.where(
                logits < min_val, torch.tensor(float("-inf")).to(logits.device), logits
            )

        if temperature > 0.0:
            logits = logits / temperature
            probs = torch.softmax(logits, dim=-1)  # (b, vocab_size)
            idx_next = torch.multinomial(probs, num_samples=1)  # (b, 1)
        else:
            idx_next = torch.argmax(logits, dim=-1, keepdim=True)  # (b, 1)

        if idx_next == eos_id:
            break

        idx = torch.cat((idx, idx_next), dim=1)  # (b, t + 1)
    return idx


def calc_loss_batch(input_batch, target_batch, model, device="cpu"):
    """Chapter 5: cross-entropy of the flattened logits ``(b * t, V)`` against the flattened
    targets ``(b * t,)``."""
    input_batch, target_batch = input_batch.to(device), target_batch.to(device)
    logits = model(input_batch)  # (b, t, vocab_size)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target_batch.flatten())


def calc_loss_loader(data_loader, model, device="cpu", num_batches=None):
    """Chapter 5: the mean loss of the first ``num_batches`` batches (all if ``None``); ``nan``
    for an empty loader."""
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


def evaluate_model(model, train_loader, val_loader, device="cpu", eval_iter=None):
    """Chapter 5: ``(train_loss, val_loss)`` in eval mode without gradients, then train mode."""
    model.eval()
    with torch.no_grad():
        train_loss = calc_loss_loader(train_loader, model, device, num_batches=eval_iter)
        val_loss = calc_loss_loader(val_loader, model, device, num_batches=eval_iter)
    model.train()
    return train_loss, val_loss


def train_steps(model, optimizer, batches, device="cpu"):
    """The inner loop of chapter 5's ``train_model_simple``, one step per batch: ``zero_grad``,
    the batch's loss, ``backward``, ``step``. Returns each step's loss (before its step)."""
    losses = []
    model.train()
    for input_batch, target_batch in batches:
        optimizer.zero_grad()
        loss = calc_loss_batch(input_batch, target_batch, model, device)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
