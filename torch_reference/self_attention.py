"""Self-attention without and with trainable weights (the chapter 3 notebook and article, the
self-attention notebook).

Shape legend: ``num_tokens`` tokens of ``d_in`` features in, ``d_out`` features out. The layers of
this file take one unbatched sequence ``x`` of shape ``(num_tokens, d_in)``, as the documents do
(``keys.T`` transposes a 2-D matrix).
"""

import torch
import torch.nn as nn

from torch_reference._checks import check_features, check_floating, check_positive_int, check_rank

__all__ = [
    "softmax_naive",
    "simplified_self_attention",
    "SelfAttention_v1",
    "SelfAttention_v2",
    "SelfAttention",
]


def softmax_naive(x):
    """The self-attention notebook, step 1: ``exp(x) / sum(exp(x))`` over the first axis (no max
    subtraction)."""
    return torch.exp(x) / torch.exp(x).sum(dim=0)


def simplified_self_attention(inputs):
    """The chapter 3 notebook ("compute all context vectors") and the self-attention notebook:
    attention without weights.

    ``inputs`` ``(num_tokens, d_in)``; returns ``(attn_scores, attn_weights, context_vecs)`` with
    shapes ``(num_tokens, num_tokens)``, ``(num_tokens, num_tokens)``, ``(num_tokens, d_in)``.
    """
    attn_scores = inputs @ inputs.T  # Shape: (num_tokens, num_tokens)
    attn_weights = torch.softmax(attn_scores, dim=-1)  # Shape: (num_tokens, num_tokens)
    context_vecs = attn_weights @ inputs  # Shape: (num_tokens, d_in)
    return attn_scores, attn_weights, context_vecs


def _check_input(x, d_in):
    check_rank("x", x.shape, (2,), "num_tokens, d_in")
    check_features("x", x.shape, d_in, "d_in")
    check_floating("x", str(x.dtype).removeprefix("torch."), x.is_floating_point())


class SelfAttention_v1(nn.Module):
    """The self-attention notebook, ``SelfAttention_v1``: raw ``nn.Parameter(torch.rand(d_in,
    d_out))`` weights.

    ``x`` ``(num_tokens, d_in)`` -> ``(num_tokens, d_out)``.
    """

    def __init__(self, d_in, d_out):
        super().__init__()
        check_positive_int("d_in", d_in)
        check_positive_int("d_out", d_out)
        self.d_out = d_out
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x):
        _check_input(x, self.W_query.shape[0])
        keys = x @ self.W_key  # Shape: (num_tokens, d_out)
        queries = x @ self.W_query  # Shape: (num_tokens, d_out)
        values = x @ self.W_value  # Shape: (num_tokens, d_out)

        attn_scores = queries @ keys.T  # omega, Shape: (num_tokens, num_tokens)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)

        context_vec = attn_weights @ values  # Shape: (num_tokens, d_out)
        return context_vec


class SelfAttention_v2(nn.Module):
    """The self-attention notebook, ``SelfAttention_v2`` (the chapter 3 notebook and article call it
    ``SelfAttention``).

    ``nn.Linear`` projections, optional bias; softmax over ``dim=1`` of the 2-D score matrix.
    ``x`` ``(num_tokens, d_in)`` -> ``(num_tokens, d_out)``.
    """

    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        check_positive_int("d_in", d_in)
        check_positive_int("d_out", d_out)
        self.d_in = d_in  # the input check's size, whatever wraps W_query (appendix E's LoRA)
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        _check_input(x, self.d_in)
        keys = self.W_key(x)  # Shape: (num_tokens, d_out)
        queries = self.W_query(x)  # Shape: (num_tokens, d_out)
        values = self.W_value(x)  # Shape: (num_tokens, d_out)

        attn_scores = queries @ keys.T  # Shape: (num_tokens, num_tokens)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=1)

        context_vec = attn_weights @ values  # Shape: (num_tokens, d_out)
        return context_vec


#: The chapter 3 notebook and article name the same layer ``SelfAttention``.
SelfAttention = SelfAttention_v2
