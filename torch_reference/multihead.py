"""``MultiHeadAttention``: causal heads split from one projection (the chapter 3 notebook and
article).

Shape legend: ``b`` batch, ``num_tokens`` tokens, ``d_in`` input features, ``d_out`` output
features, ``num_heads`` heads of ``head_dim = d_out // num_heads`` features.
"""

import torch
import torch.nn as nn

from torch_reference._checks import check_positive_int, check_splits_over_heads
from torch_reference.causal import check_causal_args, check_causal_input

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    """The chapter 3 notebook and article, ``MultiHeadAttention``: view/transpose heads, then
    ``out_proj``.

    ``x`` ``(b, num_tokens, d_in)`` -> ``(b, num_tokens, d_out)``. The documents'
    ``assert d_out % num_heads == 0`` is a ``ValueError`` here.
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        check_positive_int("num_heads", num_heads)
        check_causal_args(d_in, d_out, context_length, dropout)
        check_splits_over_heads("d_out", d_out, num_heads)

        self.d_in = d_in  # the input check's size, whatever wraps W_query (appendix E's LoRA)
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads  # Reduce the projection dim to match desired output dim

        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)  # Linear layer to combine head outputs
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        check_causal_input(x, self.d_in, self.mask.shape[0])
        b, num_tokens, d_in = x.shape

        keys = self.W_key(x)  # Shape: (b, num_tokens, d_out)
        queries = self.W_query(x)
        values = self.W_value(x)

        # Split the matrix by adding a `num_heads` dimension; unroll last dim:
        # (b, num_tokens, d_out) -> (b, num_tokens, num_heads, head_dim)
        keys = keys.view(b, num_tokens, self.num_heads, self.head_dim)
        values = values.view(b, num_tokens, self.num_heads, self.head_dim)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim)

        # Transpose: (b, num_tokens, num_heads, head_dim) -> (b, num_heads, num_tokens, head_dim)
        keys = keys.transpose(1, 2)
        queries = queries.transpose(1, 2)
        values = values.transpose(1, 2)

        # Dot product for each head, Shape: (b, num_heads, num_tokens, num_tokens)
        attn_scores = queries @ keys.transpose(2, 3)

        # Original mask truncated to the number of tokens and converted to boolean
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]

        # Use the mask to fill attention scores
        attn_scores.masked_fill_(mask_bool, -torch.inf)

        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)

        # Shape: (b, num_tokens, num_heads, head_dim)
        context_vec = (attn_weights @ values).transpose(1, 2)

        # Combine heads, where self.d_out = self.num_heads * self.head_dim
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)
        context_vec = self.out_proj(context_vec)  # optional projection

        return context_vec
