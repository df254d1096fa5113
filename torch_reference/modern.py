"""The book's modern attention: grouped-query, multi-head latent and sliding-window attention.

The chapter 4 bonus material of "Build a Large Language Model (From Scratch)"
(``ch04/04_gqa/gpt_with_kv_gqa.py``, ``ch04/05_mla/gpt_with_kv_mla.py``,
``ch04/06_swa/gpt_with_kv_swa.py``) rewrites chapter 3's ``MultiHeadAttention`` as the attention
of today's models, each with the KV cache of ``ch04/03_kv-cache``: ``forward(x, use_cache=False)``
(with ``use_cache=True`` the tokens continue the sequence held in the cache, chunks of any
length), ``reset_cache()``. The layers here keep the book's names, arguments, caches and
arithmetic; the deviations (``docs/deviations.md``) are clear errors where the book asserts or
would fail obscurely.

Shape legend: ``b`` batch, ``num_tokens`` tokens, ``d_in`` input features, ``d_out`` output
features, ``num_heads`` heads of ``head_dim = d_out // num_heads`` features.
"""

import torch
import torch.nn as nn

from torch_reference._checks import (
    check_dropout,
    check_features,
    check_floating,
    check_int,
    check_positive_int,
    check_rank,
    check_splits_over_heads,
)

__all__ = ["GroupedQueryAttention", "MultiHeadAttentionWithSWA", "MultiHeadLatentAttention"]


def _check_args(d_in, d_out, dropout, num_heads):
    check_positive_int("d_in", d_in)
    check_positive_int("d_out", d_out)
    check_dropout(dropout)
    check_positive_int("num_heads", num_heads)
    check_splits_over_heads("d_out", d_out, num_heads)


def _check_input(x, d_in):
    check_rank("x", x.shape, (3,), "b, num_tokens, d_in")
    check_features("x", x.shape, d_in, "d_in")
    check_floating("x", str(x.dtype).removeprefix("torch."), x.is_floating_point())


def _causal_attention(layer, queries, keys, values, q_positions, k_positions, window=None):
    """The book's scores, mask, softmax, dropout and weighted sum, for ``(b, h, t, d)`` heads:
    key ``k`` is hidden from query ``q`` where ``q < k`` or, with a window ``W``, ``q - k >= W``."""
    b, _, num_tokens, _ = queries.shape
    attn_scores = queries @ keys.transpose(2, 3)  # Dot product for each head
    diff = q_positions.unsqueeze(-1) - k_positions.unsqueeze(0)
    mask_bool = diff < 0 if window is None else (diff < 0) | (diff >= window)
    attn_scores = attn_scores.masked_fill(mask_bool, -torch.inf)
    attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
    attn_weights = layer.dropout(attn_weights)
    # Shape: (b, num_tokens, num_heads, head_dim)
    context_vec = (attn_weights @ values).transpose(1, 2)
    # Combine heads, where self.d_out = self.num_heads * self.head_dim
    context_vec = context_vec.contiguous().view(b, num_tokens, layer.d_out)
    return layer.out_proj(context_vec)


def _positions(layer, num_tokens_q, num_tokens_k, use_cache, device):
    """The book's query and key positions: the cache's running position with ``use_cache``
    (advanced by the queries), else from 0 (and the position reset)."""
    if use_cache:
        start = layer.ptr_current_pos
        layer.ptr_current_pos += num_tokens_q
    else:
        start = 0
        layer.ptr_current_pos = 0
    q_positions = torch.arange(start, start + num_tokens_q, device=device, dtype=torch.long)
    k_positions = torch.arange(num_tokens_k, device=device, dtype=torch.long)
    return q_positions, k_positions


class GroupedQueryAttention(nn.Module):
    """``ch04/04_gqa``: ``num_kv_groups`` key and value heads shared by ``num_heads`` query heads
    (``repeat_interleave``), causal, with a KV cache of the groups only; ``out_proj`` without a
    bias, as the book's. The book's two ``assert`` are ``ValueError`` here."""

    def __init__(self, d_in, d_out, dropout, num_heads, num_kv_groups, dtype=None, qkv_bias=False):
        super().__init__()
        _check_args(d_in, d_out, dropout, num_heads)
        check_positive_int("num_kv_groups", num_kv_groups)
        if num_heads % num_kv_groups:
            raise ValueError(
                f"num_heads ({num_heads}) must be divisible by num_kv_groups ({num_kv_groups})"
            )

        self.d_in = d_in
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads

        self.W_key = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=qkv_bias, dtype=dtype)
        self.W_value = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=qkv_bias, dtype=dtype)
        self.num_kv_groups = num_kv_groups
        self.group_size = num_heads // num_kv_groups

        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias, dtype=dtype)
        self.out_proj = nn.Linear(d_out, d_out, bias=False, dtype=dtype)
        self.dropout = nn.Dropout(dropout)

        self.register_buffer("cache_k", None, persistent=False)
        self.register_buffer("cache_v", None, persistent=False)
        self.ptr_current_pos = 0

    def forward(self, x, use_cache=False):
        _check_input(x, self.d_in)
        b, num_tokens, _ = x.shape

        queries = self.W_query(x)  # (b, num_tokens, num_heads * head_dim)
        keys = self.W_key(x)  # (b, num_tokens, num_kv_groups * head_dim)
        values = self.W_value(x)  # (b, num_tokens, num_kv_groups * head_dim)

        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        keys_new = keys.view(b, num_tokens, self.num_kv_groups, self.head_dim).transpose(1, 2)
        values_new = values.view(b, num_tokens, self.num_kv_groups, self.head_dim).transpose(1, 2)

        if use_cache:
            if self.cache_k is None:
                self.cache_k, self.cache_v = keys_new, values_new
            else:
                self.cache_k = torch.cat([self.cache_k, keys_new], dim=2)
                self.cache_v = torch.cat([self.cache_v, values_new], dim=2)
            keys_base, values_base = self.cache_k, self.cache_v
        else:
            keys_base, values_base = keys_new, values_new
            if self.cache_k is not None or self.cache_v is not None:
                self.cache_k, self.cache_v = None, None
                self.ptr_current_pos = 0

        # Expand keys and values to match the number of heads: [K1, K2] -> [K1, K1, K2, K2]
        keys = keys_base.repeat_interleave(self.group_size, dim=1)
        values = values_base.repeat_interleave(self.group_size, dim=1)

        q_positions, k_positions = _positions(
            self, num_tokens, keys.shape[-2], use_cache, queries.device
        )
        return _causal_attention(self, queries, keys, values, q_positions, k_positions)

    def reset_cache(self):
        self.cache_k, self.cache_v = None, None
        self.ptr_current_pos = 0


class MultiHeadLatentAttention(nn.Module):
    """``ch04/05_mla``: keys and values up-projected (``W_UK``, ``W_UV``) from a latent
    ``W_DKV(x)`` of ``latent_dim`` features (the book's default ``max(16, d_out // 8)``), causal;
    the cache holds the latent ``(b, T, latent_dim)`` only."""

    def __init__(self, d_in, d_out, dropout, num_heads, qkv_bias=False, latent_dim=None):
        super().__init__()
        _check_args(d_in, d_out, dropout, num_heads)
        if latent_dim is not None:
            check_int("latent_dim", latent_dim, 1, optional="max(16, d_out // 8)")

        self.d_in = d_in
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.latent_dim = latent_dim if latent_dim is not None else max(16, d_out // 8)

        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)  # per-head Q
        self.W_DKV = nn.Linear(d_in, self.latent_dim, bias=qkv_bias)  # down to latent C
        self.W_UK = nn.Linear(self.latent_dim, d_out, bias=qkv_bias)  # latent -> per-head K
        self.W_UV = nn.Linear(self.latent_dim, d_out, bias=qkv_bias)  # latent -> per-head V

        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)

        self.register_buffer("cache_c_kv", None, persistent=False)
        self.ptr_current_pos = 0

    def reset_cache(self):
        self.cache_c_kv = None
        self.ptr_current_pos = 0

    @staticmethod
    def _reshape_to_heads(x, num_heads, head_dim):
        # (b, T, d_out) -> (b, num_heads, T, head_dim)
        bsz, num_tokens, _ = x.shape
        return x.view(bsz, num_tokens, num_heads, head_dim).transpose(1, 2).contiguous()

    def forward(self, x, use_cache=False):
        _check_input(x, self.d_in)
        queries_all = self.W_query(x)  # (b, T, d_out)
        latent_new = self.W_DKV(x)  # (b, T, latent_dim)

        if use_cache:
            if self.cache_c_kv is None:
                latent_total = latent_new
            else:
                latent_total = torch.cat([self.cache_c_kv, latent_new], dim=1)
            self.cache_c_kv = latent_total
        else:
            latent_total = latent_new

        keys_all = self.W_UK(latent_total)  # (b, T_k_total, d_out)
        values_all = self.W_UV(latent_total)  # (b, T_k_total, d_out)

        queries = self._reshape_to_heads(queries_all, self.num_heads, self.head_dim)
        keys = self._reshape_to_heads(keys_all, self.num_heads, self.head_dim)
        values = self._reshape_to_heads(values_all, self.num_heads, self.head_dim)

        q_positions, k_positions = _positions(
            self, queries.shape[-2], keys.shape[-2], use_cache, queries.device
        )
        return _causal_attention(self, queries, keys, values, q_positions, k_positions)


class MultiHeadAttentionWithSWA(nn.Module):
    """``ch04/06_swa``: chapter 3's ``MultiHeadAttention`` with a sliding window of
    ``sliding_window_size`` keys (``None``: none): query ``q`` sees keys ``q - W < k <= q``. The
    cache keeps the last ``sliding_window_size`` keys and values; a chunk of ``n`` tokens attends
    to the ``W - 1`` cached ones before it and itself, so every query keeps its whole window."""

    def __init__(self, d_in, d_out, dropout, num_heads, qkv_bias=False, sliding_window_size=None):
        super().__init__()
        _check_args(d_in, d_out, dropout, num_heads)
        if sliding_window_size is not None:
            check_int("sliding_window_size", sliding_window_size, 1, optional="no window")

        self.d_in = d_in
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads

        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)  # Linear layer to combine head outputs
        self.dropout = nn.Dropout(dropout)
        self.sliding_window_size = sliding_window_size

        self.register_buffer("cache_k", None, persistent=False)
        self.register_buffer("cache_v", None, persistent=False)
        self.ptr_current_pos = 0

    def forward(self, x, use_cache=False):
        _check_input(x, self.d_in)
        b, num_tokens, d_in = x.shape

        keys_new = self.W_key(x).view(b, num_tokens, self.num_heads, self.head_dim)
        values_new = self.W_value(x).view(b, num_tokens, self.num_heads, self.head_dim)
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim)

        if use_cache:
            old_cache_k, old_cache_v = self.cache_k, self.cache_v
            old_len = 0 if old_cache_k is None else old_cache_k.size(1)
            if old_cache_k is None:
                combined_k, combined_v = keys_new, values_new
            else:
                combined_k = torch.cat([old_cache_k, keys_new], dim=1)
                combined_v = torch.cat([old_cache_v, values_new], dim=1)

            keys, values = combined_k, combined_v
            if self.sliding_window_size is not None:
                # W - 1 older keys and the whole chunk: every query keeps its whole window
                attn_keep = min(keys.size(1), self.sliding_window_size + num_tokens - 1)
                keys = keys[:, -attn_keep:, :, :]
                values = values[:, -attn_keep:, :, :]

                cache_keep = min(combined_k.size(1), self.sliding_window_size)
                self.cache_k = combined_k[:, -cache_keep:, :, :]
                self.cache_v = combined_v[:, -cache_keep:, :, :]
            else:
                self.cache_k, self.cache_v = combined_k, combined_v

            dropped = combined_k.size(1) - keys.size(1)
            k_start = (self.ptr_current_pos - old_len) + dropped
            q_start = self.ptr_current_pos
            self.ptr_current_pos += num_tokens
        else:
            keys, values = keys_new, values_new
            k_start = q_start = 0
            self.ptr_current_pos = 0

        # (b, num_tokens, num_heads, head_dim) -> (b, num_heads, num_tokens, head_dim)
        keys, queries, values = (
            keys.transpose(1, 2),
            queries.transpose(1, 2),
            values.transpose(1, 2),
        )
        device = queries.device
        q_positions = torch.arange(q_start, q_start + num_tokens, device=device, dtype=torch.long)
        k_positions = torch.arange(
            k_start, k_start + keys.shape[-2], device=device, dtype=torch.long
        )
        return _causal_attention(
            self, queries, keys, values, q_positions, k_positions, self.sliding_window_size
        )

    def reset_cache(self):
        self.cache_k, self.cache_v = None, None
        self.ptr_current_pos = 0
