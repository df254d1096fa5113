"""``MultiHeadedAttention``, ``attention`` and ``clones``: the annotated-transformer post.

Shape legend: ``b`` batch, ``num_heads`` heads, ``q_len`` query tokens, ``k_len`` key/value
tokens, ``d_model`` model features, ``k_dim = d_model // num_heads`` features per head.
"""

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from torch_reference._checks import (
    check_dropout,
    check_features,
    check_floating,
    check_mask,
    check_positive_int,
    check_rank,
    check_same,
    check_splits_over_heads,
)

__all__ = ["MultiHeadedAttention", "attention", "clones"]


class MultiHeadedAttention(nn.Module):
    """The annotated-transformer post, ``MultiHeadedAttention(num_heads, d_model, dropout=0.1)``.

    ``query`` ``(b, q_len, d_model)``, ``key`` and ``value`` ``(b, k_len, d_model)``, ``mask``
    ``(b, q_len, k_len)`` or any shape that broadcasts to it such as ``(1, q_len, k_len)`` or a
    padding mask ``(b, 1, k_len)``; positions where ``mask == 0`` are filled with ``-1e10``.
    Returns ``(b, q_len, d_model)`` and keeps the last weights ``(b, num_heads, q_len, k_len)``
    in ``self.attention_score``.
    """

    def __init__(self, num_heads: int, d_model: int, dropout: float = 0.1):
        super(MultiHeadedAttention, self).__init__()
        check_positive_int("num_heads", num_heads)
        check_positive_int("d_model", d_model)
        check_dropout(dropout)
        check_splits_over_heads("d_model", d_model, num_heads)
        # Assume v_dim always equals k_dim
        self.k_dim = d_model // num_heads
        self.num_heads = num_heads
        self.proj_weights = clones(nn.Linear(d_model, d_model), 4)  # W^Q, W^K, W^V, W^O
        self.attention_score = None
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None):
        _check_inputs(query, key, value, mask, self.num_heads * self.k_dim)
        if mask is not None:
            mask = mask.unsqueeze(1)  # Shape: (b or 1, 1, q_len or 1, k_len)
        batch_size = query.size(0)

        # 1) Apply W^Q, W^K, W^V to generate new query, key, value
        # Shape: (b, num_heads, seq_len, k_dim)
        query, key, value = [
            proj_weight(x).view(batch_size, -1, self.num_heads, self.k_dim).transpose(1, 2)
            for proj_weight, x in zip(self.proj_weights, [query, key, value])
        ]  # -1 equals to seq_len

        # 2) Calculate attention score and the out
        out, self.attention_score = attention(query, key, value, mask=mask, dropout=self.dropout)

        # 3) "Concat" output, Shape: (b, q_len, d_model)
        out = out.transpose(1, 2).contiguous().view(batch_size, -1, self.num_heads * self.k_dim)

        # 4) Apply W^O to get the final output
        out = self.proj_weights[-1](out)

        return out


def clones(module, N):
    "Produce N identical layers."
    return nn.ModuleList([copy.deepcopy(module) for _ in range(N)])


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None = None,
    dropout: nn.Module | None = None,
):
    """The annotated-transformer post, ``attention``: scaled dot product, ``mask == 0`` filled.

    Args:
        query: shape (..., q_len, k_dim), e.g. (b, num_heads, q_len, k_dim)
        key: shape (..., k_len, k_dim)
        value: shape (..., k_len, v_dim)
        mask: broadcastable to (..., q_len, k_len); positions where ``mask == 0`` get ``-1e10``
        dropout: an ``nn.Dropout`` applied to the weights, or ``None``
    Return:
        out: shape (..., q_len, v_dim), and attention_score: shape (..., q_len, k_len).
        (The document's docstring gives other shapes: an erratum of the document.)
    """
    k_dim = query.size(-1)

    # Shape: (..., q_len, k_len), row: token, col: that token's attention score
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(k_dim)

    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e10)

    attention_score = F.softmax(scores, dim=-1)

    if dropout is not None:
        attention_score = dropout(attention_score)

    out = torch.matmul(attention_score, value)

    return out, attention_score  # Shape: (..., q_len, v_dim), (..., q_len, k_len)


def _check_inputs(query, key, value, mask, d_model):
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_rank(name, x.shape, (3,), "b, seq_len, d_model")
        check_features(name, x.shape, d_model, "d_model")
        check_floating(name, str(x.dtype).removeprefix("torch."), x.is_floating_point())
    check_same("key.shape[0]", key.shape[0], "query.shape[0]", query.shape[0])
    check_same("value.shape[0]", value.shape[0], "query.shape[0]", query.shape[0])
    check_same("value.shape[1]", value.shape[1], "key.shape[1]", key.shape[1])
    if mask is not None:
        valid = not mask.is_complex()
        check_mask(
            mask.shape,
            (query.shape[0], query.shape[1], key.shape[1]),
            valid,
            str(mask.dtype).removeprefix("torch."),
        )
