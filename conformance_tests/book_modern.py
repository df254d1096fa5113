"""The book's chapter 4 bonus GPT variants in torch: ``ch04/04_gqa/gpt_with_kv_gqa.py``,
``ch04/05_mla/gpt_with_kv_mla.py`` and ``ch04/06_swa/gpt_with_kv_swa.py`` (rasbt/LLMs-from-scratch),
the reference ``flax_attention.models.GPTModel`` is held to when its config names a variant.

Each file is chapter 4's ``GPTModel`` with a KV cache (``ch04/03_kv-cache``): its blocks call
their attention with ``use_cache``, the model keeps ``current_pos`` for the position embeddings of
cached calls and ``reset_kv_cache()``, and ``generate_text_simple_cached`` prefills with the
prompt's last ``context_size`` tokens then feeds one token per step. The three files differ in
the attention only, so this module is one model that builds the file's attention from the same
config keys (``n_kv_groups``; ``latent_dim``; ``sliding_window_size`` with
``sliding_window_stride``, the K:1 schedule), with the book's names (its ``state_dict`` is the
file's).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from conformance_tests.book_gpt import FeedForward, LayerNorm
from torch_reference import (
    GroupedQueryAttention,
    MultiHeadAttentionWithSWA,
    MultiHeadLatentAttention,
)

__all__ = ["GPTModel", "TransformerBlock", "generate_text_simple_cached"]


def _attention(cfg):
    args = dict(
        d_in=cfg["emb_dim"],
        d_out=cfg["emb_dim"],
        dropout=cfg["drop_rate"],
        num_heads=cfg["n_heads"],
        qkv_bias=cfg["qkv_bias"],
    )
    if "n_kv_groups" in cfg:
        return GroupedQueryAttention(num_kv_groups=cfg["n_kv_groups"], **args)
    if "latent_dim" in cfg:
        return MultiHeadLatentAttention(latent_dim=cfg["latent_dim"], **args)
    return MultiHeadAttentionWithSWA(sliding_window_size=cfg["sliding_window_size"], **args)


class TransformerBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.att = _attention(cfg)
        self.ff = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg["emb_dim"])
        self.norm2 = LayerNorm(cfg["emb_dim"])
        self.drop_shortcut = nn.Dropout(cfg["drop_rate"])

    def forward(self, x, use_cache=False):
        shortcut = x
        x = self.norm1(x)
        x = self.att(x, use_cache=use_cache)
        x = self.drop_shortcut(x)
        x = x + shortcut

        shortcut = x
        x = self.norm2(x)
        x = self.ff(x)
        x = self.drop_shortcut(x)
        return x + shortcut


class GPTModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
        self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"])
        self.drop_emb = nn.Dropout(cfg["drop_rate"])
        blocks = []
        for i in range(cfg["n_layers"]):
            block = TransformerBlock(cfg)
            if "sliding_window_size" in cfg:  # K:1: K window layers, then one regular layer
                stride = int(cfg["sliding_window_stride"])
                use_swa = stride < 0 if stride <= 0 else (i % (stride + 1)) < stride
                block.att.sliding_window_size = cfg["sliding_window_size"] if use_swa else None
            blocks.append(block)
        self.trf_blocks = nn.ModuleList(blocks)
        self.current_pos = 0
        self.final_norm = LayerNorm(cfg["emb_dim"])
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)

    def forward(self, in_idx, use_cache=False):
        _, seq_len = in_idx.shape
        tok_embeds = self.tok_emb(in_idx)
        if use_cache:
            pos_ids = torch.arange(self.current_pos, self.current_pos + seq_len, dtype=torch.long)
            self.current_pos += seq_len
        else:
            pos_ids = torch.arange(0, seq_len, dtype=torch.long)
        x = self.drop_emb(tok_embeds + self.pos_emb(pos_ids).unsqueeze(0))
        for block in self.trf_blocks:
            x = block(x, use_cache=use_cache)
        return self.out_head(self.final_norm(x))

    def reset_kv_cache(self):
        for block in self.trf_blocks:
            block.att.reset_cache()
        self.current_pos = 0


def generate_text_simple_cached(model, idx, max_new_tokens, context_size=None, use_cache=True):
    model.eval()
    ctx_len = context_size or model.pos_emb.num_embeddings
    with torch.no_grad():
        if use_cache:
            model.reset_kv_cache()
            logits = model(idx[:, -ctx_len:], use_cache=True)
            for _ in range(max_new_tokens):
                next_idx = logits[:, -1].argmax(dim=-1, keepdim=True)
                idx = torch.cat([idx, next_idx], dim=1)
                logits = model(next_idx, use_cache=True)
        else:
            for _ in range(max_new_tokens):
                logits = model(idx[:, -ctx_len:], use_cache=False)
                next_idx = logits[:, -1].argmax(dim=-1, keepdim=True)
                idx = torch.cat([idx, next_idx], dim=1)
    return idx
