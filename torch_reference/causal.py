"""Causal attention: masking two ways, ``CausalAttention`` and ``MultiHeadAttentionWrapper``.

The chapter 3 notebook and article and the ``CausalAttention`` listing. Shape legend: ``b`` batch,
``num_tokens`` tokens, ``d_in`` input features, ``d_out`` features per head.
"""

import torch
import torch.nn as nn

from torch_reference._checks import (
    check_dropout,
    check_features,
    check_floating,
    check_num_tokens,
    check_positive_int,
    check_rank,
)

__all__ = [
    "causal_attn_weights_renormalized",
    "causal_attn_weights_masked_fill",
    "CausalAttention",
    "MultiHeadAttentionWrapper",
]


def causal_attn_weights_renormalized(attn_scores, d_key):
    """The chapter 3 notebook, causal masking, first way: softmax, zero the future, renormalise the
    rows.

    ``attn_scores`` ``(..., num_tokens, num_tokens)`` unscaled; returns the masked weights.
    """
    attn_weights = torch.softmax(attn_scores / d_key**0.5, dim=-1)
    sequence_length = attn_scores.shape[-1]
    # made on the scores' device (the documents make it on the CPU, which a CUDA input rejects)
    mask = torch.tril(torch.ones(sequence_length, sequence_length, device=attn_scores.device))
    masked_attn_scores = attn_weights * mask
    row_sums = masked_attn_scores.sum(dim=-1, keepdim=True)
    masked_attn_weights = masked_attn_scores / row_sums
    return masked_attn_weights


def causal_attn_weights_masked_fill(attn_scores, d_key):
    """The chapter 3 notebook, causal masking, second way: fill the future with ``-inf``, then
    softmax.

    ``attn_scores`` ``(..., num_tokens, num_tokens)`` unscaled; returns the masked weights.
    """
    sequence_length = attn_scores.shape[-1]
    # on the scores' device, as above
    ones = torch.ones(sequence_length, sequence_length, device=attn_scores.device)
    mask = torch.triu(ones, diagonal=1)
    masked_attn_scores = attn_scores.masked_fill(mask.bool(), -torch.inf)
    masked_attn_weights = torch.softmax(masked_attn_scores / d_key**0.5, dim=-1)
    return masked_attn_weights


def check_causal_input(x, d_in, context_length):
    """The causal family's input ``x`` ``(b, num_tokens, d_in)``, as the documents unpack it."""
    check_rank("x", x.shape, (3,), "b, num_tokens, d_in")
    check_features("x", x.shape, d_in, "d_in")
    check_floating("x", str(x.dtype).removeprefix("torch."), x.is_floating_point())
    check_num_tokens(x.shape[1], context_length)


def check_causal_args(d_in, d_out, context_length, dropout):
    check_positive_int("d_in", d_in)
    check_positive_int("d_out", d_out)
    check_positive_int("context_length", context_length)
    check_dropout(dropout)


class CausalAttention(nn.Module):
    """The chapter 3 notebook and article and the ``CausalAttention`` listing:
    ``CausalAttention``: one head, ``-inf`` above the diagonal.

    ``x`` ``(b, num_tokens, d_in)`` -> ``(b, num_tokens, d_out)``; the ``mask`` buffer is
    ``triu(ones(context_length, context_length), diagonal=1)``.
    """

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        check_causal_args(d_in, d_out, context_length, dropout)
        self.d_in = d_in  # the input check's size, whatever wraps W_query (appendix E's LoRA)
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)  # New
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )  # New

    def forward(self, x):
        check_causal_input(x, self.d_in, self.mask.shape[0])
        b, num_tokens, d_in = x.shape  # New batch dimension b
        keys = self.W_key(x)  # Shape: (b, num_tokens, d_out)
        queries = self.W_query(x)  # Shape: (b, num_tokens, d_out)
        values = self.W_value(x)  # Shape: (b, num_tokens, d_out)

        attn_scores = queries @ keys.transpose(1, 2)  # Shape: (b, num_tokens, num_tokens)
        attn_scores.masked_fill_(  # New, _ ops are in-place
            self.mask.bool()[:num_tokens, :num_tokens], -torch.inf
        )  # `:num_tokens` for batches shorter than context_length
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)  # New

        context_vec = attn_weights @ values  # Shape: (b, num_tokens, d_out)
        return context_vec


class MultiHeadAttentionWrapper(nn.Module):
    """The chapter 3 notebook, ``MultiHeadAttentionWrapper``: ``num_heads`` stacked
    ``CausalAttention``.

    ``x`` ``(b, num_tokens, d_in)`` -> ``(b, num_tokens, num_heads * d_out)``. The document names
    the third argument ``sequence_length``; API.md and the other layers call it
    ``context_length``.
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        check_positive_int("num_heads", num_heads)
        check_causal_args(d_in, d_out, context_length, dropout)
        self.heads = nn.ModuleList(
            [
                CausalAttention(d_in, d_out, context_length, dropout, qkv_bias)
                for _ in range(num_heads)
            ]
        )

    def forward(self, x):
        return torch.cat([head(x) for head in self.heads], dim=-1)
