"""The torch-only benchmark modules (no JAX import: the memory subprocesses load only torch).

Shape legend: ``b`` batch, ``t`` tokens, ``h`` heads, ``d`` head_dim, ``s`` cached tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import torch_reference as tr

__all__ = ["SDPAGroupedQueryAttention", "SDPAMultiHeadAttention", "TorchKVCache"]


class SDPAMultiHeadAttention(tr.MultiHeadAttention):
    """``torch_reference.MultiHeadAttention`` (same parameters, same ``state_dict``) with its
    core replaced by torch's fused ``scaled_dot_product_attention(..., is_causal=True)``."""

    def forward(self, x):
        b, num_tokens, _ = x.shape
        # (b, t, d_out) -> (b, t, h, d) -> (b, h, t, d)
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        keys = self.W_key(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        context_vec = F.scaled_dot_product_attention(
            queries, keys, values, dropout_p=0.0, is_causal=True
        )  # (b, h, t, d)
        context_vec = context_vec.transpose(1, 2).reshape(b, num_tokens, self.d_out)
        return self.out_proj(context_vec)  # (b, t, d_out)


class SDPAGroupedQueryAttention(tr.GroupedQueryAttention):
    """``torch_reference.GroupedQueryAttention`` (same parameters, same ``state_dict``) with its
    core replaced by torch's fused ``scaled_dot_product_attention(..., is_causal=True,
    enable_gqa=True)``: the key and value heads as the layer projects them, not repeated."""

    def forward(self, x):
        b, num_tokens, _ = x.shape

        def heads(y, n):  # (b, t, n * d) -> (b, n, t, d)
            return y.view(b, num_tokens, n, self.head_dim).transpose(1, 2)

        queries = heads(self.W_query(x), self.num_heads)
        keys = heads(self.W_key(x), self.num_kv_groups)
        values = heads(self.W_value(x), self.num_kv_groups)
        context_vec = F.scaled_dot_product_attention(
            queries, keys, values, dropout_p=0.0, is_causal=True, enable_gqa=True
        )  # (b, h, t, d)
        context_vec = context_vec.transpose(1, 2).reshape(b, num_tokens, self.d_out)
        return self.out_proj(context_vec)  # (b, t, d_out)


class TorchKVCache:
    """Decode state for a torch ``MultiHeadAttention``: keys and values ``(b, h, max_length, d)``
    preallocated, filled ``n`` tokens per call; queries attend to every cached token at or before
    their own position (the documents' math: scores, ``-inf`` future, scaled softmax, sum)."""

    def __init__(self, mha: tr.MultiHeadAttention, batch_size: int, max_length: int):
        self.mha = mha
        shape = (batch_size, mha.num_heads, max_length, mha.head_dim)  # (b, h, s, d)
        where = mha.W_query.weight.device
        self.keys = torch.zeros(shape, device=where)
        self.values = torch.zeros(shape, device=where)
        self.index = 0

    @torch.no_grad()
    def __call__(self, x):
        """``x`` ``(b, n, d_in)`` -> ``(b, n, d_out)``, appending its ``n`` tokens."""
        mha, (b, n, _), start = self.mha, x.shape, self.index
        if start + n > self.keys.shape[2]:
            raise ValueError(
                f"cache index + num_tokens ({start} + {n}) must not exceed max_length "
                f"({self.keys.shape[2]})"
            )

        def heads(y):  # (b, n, d_out) -> (b, h, n, d)
            return y.view(b, n, mha.num_heads, mha.head_dim).transpose(1, 2)

        queries = heads(mha.W_query(x))
        self.keys[:, :, start : start + n] = heads(mha.W_key(x))
        self.values[:, :, start : start + n] = heads(mha.W_value(x))
        self.index = end = start + n
        keys, values = self.keys[:, :, :end], self.values[:, :, :end]  # (b, h, s, d)
        attn_scores = queries @ keys.transpose(2, 3)  # (b, h, n, s)
        if n > 1:  # query i (absolute start + i) must not see keys after it
            future = torch.ones(n, end, dtype=torch.bool, device=x.device)
            future = torch.triu(future, diagonal=start + 1)
            attn_scores.masked_fill_(future, -torch.inf)
        attn_weights = torch.softmax(attn_scores / mha.head_dim**0.5, dim=-1)
        context_vec = (attn_weights @ values).transpose(1, 2).reshape(b, n, mha.d_out)
        return mha.out_proj(context_vec)  # (b, n, d_out)
