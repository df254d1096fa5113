"""The decoder contract the next models fit: a toy Llama-style decoder built from public pieces.

RMSNorm (``nnx.RMSNorm``), rotary positions (``MultiHeadAttention(rotary=...)`` with the tokens'
``positions``), 4 query heads over 2 key heads (``num_kv_heads``), SwiGLU, no biases; it meets
``models.generation.CausalLM``, so the book's ``generate`` decodes it with the decode cache. The
Flax model is the block between the two ``# ---`` lines (under 80 lines); the torch twin below it
is written from the book's Llama listing (``repeat_interleave`` of the key heads,
``compute_rope_params``/``apply_rope``), and the test holds the two equal: logits of a left-padded
batch, and the tokens ``generate`` makes with the cache against the twin's full recomputation.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import flax_attention as fa
from flax_attention.cache import padded_positions
from flax_attention.models import Config, generate

CFG = {"vocab_size": 61, "context_length": 32, "emb_dim": 32, "n_heads": 4, "n_kv_heads": 2,
       "hidden_dim": 48, "n_layers": 2, "rope_base": 10_000.0}  # fmt: skip


# --- the toy Llama in Flax, from the package's public pieces --------------------------------
def rope(x, positions, base=CFG["rope_base"]):
    """Rotary embedding of ``x`` ``(..., t, h, d)`` at ``positions`` ``(..., t)``."""
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half) / half)  # (d/2,)
    angles = positions[..., None, None] * freqs.reshape((1,) * positions.ndim + (1, half))
    cos, sin = (jnp.broadcast_to(f(angles), x[..., :half].shape) for f in (jnp.cos, jnp.sin))
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class SwiGLU(nnx.Module):
    def __init__(self, cfg, rngs):
        d, hidden = cfg["emb_dim"], cfg["hidden_dim"]
        self.fc1 = nnx.Linear(d, hidden, use_bias=False, rngs=rngs)
        self.fc2 = nnx.Linear(d, hidden, use_bias=False, rngs=rngs)
        self.fc3 = nnx.Linear(hidden, d, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.fc3(nnx.silu(self.fc1(x)) * self.fc2(x))


class Block(nnx.Module):
    def __init__(self, cfg, rngs):
        d = cfg["emb_dim"]
        self.att = fa.MultiHeadAttention(
            d, d, cfg["context_length"], 0.0, cfg["n_heads"], num_kv_heads=cfg["n_kv_heads"],
            rotary=rope, out_bias=False, rngs=rngs,
        )  # fmt: skip
        self.norm1 = nnx.RMSNorm(d, epsilon=1e-5, rngs=rngs)
        self.norm2 = nnx.RMSNorm(d, epsilon=1e-5, rngs=rngs)
        self.ff = SwiGLU(cfg, rngs)

    def __call__(self, x, decode, mask, positions):
        x = x + self.att(self.norm1(x), decode=decode, mask=mask, positions=positions)
        return x + self.ff(self.norm2(x))


class ToyLlama(nnx.Module):
    def __init__(self, cfg, rngs):
        self.cfg = Config(cfg)  # hashable: jit keys on the model's static structure
        self.tok_emb = nnx.Embed(cfg["vocab_size"], cfg["emb_dim"], rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg["n_layers"])])
        self.final_norm = nnx.RMSNorm(cfg["emb_dim"], epsilon=1e-5, rngs=rngs)
        self.out_head = nnx.Linear(cfg["emb_dim"], cfg["vocab_size"], use_bias=False, rngs=rngs)

    def init_cache(self, batch_size, max_length=None):
        for block in self.blocks:
            block.att.init_cache(batch_size, max_length)

    def clear_cache(self):
        for block in self.blocks:
            block.att.clear_cache()

    def hidden_states(self, in_idx, *, decode=False, attention_mask=None):
        offset = self.blocks[0].att.cached_length() if decode else 0
        positions, mask = offset + jnp.arange(in_idx.shape[-1]), None
        if attention_mask is not None:  # left padding: positions from each row's first token
            positions, mask = padded_positions(attention_mask, offset, in_idx.shape[-1])
        x = self.tok_emb(in_idx)
        for block in self.blocks:
            x = block(x, decode, mask, positions)
        return self.final_norm(x)

    def logits(self, x):
        return self.out_head(x)

    def __call__(self, in_idx, attention_mask=None):
        return self.logits(self.hidden_states(in_idx, attention_mask=attention_mask))


# --- the torch twin, from the book's Llama listing --------------------------------------------
def compute_rope_params(head_dim, base, context_length):
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(context_length)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=1)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x, cos, sin, positions):  # x (b, h, t, d), positions (b, t)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos, sin = cos[positions][:, None], sin[positions][:, None]  # (b, 1, t, d)
    return x * cos + rotated * sin


class TorchGroupedQueryAttention(torch.nn.Module):
    def __init__(self, d_in, num_heads, num_kv_groups):
        super().__init__()
        self.num_heads, self.num_kv_groups = num_heads, num_kv_groups
        self.head_dim = d_in // num_heads
        self.W_query = torch.nn.Linear(d_in, d_in, bias=False)
        self.W_key = torch.nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False)
        self.W_value = torch.nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False)
        self.out_proj = torch.nn.Linear(d_in, d_in, bias=False)

    def forward(self, x, mask, cos, sin, positions):
        b, t, _ = x.shape
        queries = self.W_query(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        keys = self.W_key(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        queries, keys = (
            apply_rope(queries, cos, sin, positions),
            apply_rope(keys, cos, sin, positions),
        )
        group_size = self.num_heads // self.num_kv_groups
        keys = keys.repeat_interleave(group_size, dim=1)
        values = values.repeat_interleave(group_size, dim=1)
        attn_scores = (queries @ keys.transpose(2, 3)).masked_fill(mask, -1e10)
        attn_weights = torch.softmax(attn_scores / self.head_dim**0.5, dim=-1)
        context = (attn_weights @ values).transpose(1, 2).reshape(b, t, -1)
        return self.out_proj(context)


class TorchFeedForward(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc1 = torch.nn.Linear(cfg["emb_dim"], cfg["hidden_dim"], bias=False)
        self.fc2 = torch.nn.Linear(cfg["emb_dim"], cfg["hidden_dim"], bias=False)
        self.fc3 = torch.nn.Linear(cfg["hidden_dim"], cfg["emb_dim"], bias=False)

    def forward(self, x):
        return self.fc3(torch.nn.functional.silu(self.fc1(x)) * self.fc2(x))


class TorchBlock(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.att = TorchGroupedQueryAttention(cfg["emb_dim"], cfg["n_heads"], cfg["n_kv_heads"])
        self.ff = TorchFeedForward(cfg)
        self.norm1 = torch.nn.RMSNorm(cfg["emb_dim"], eps=1e-5)
        self.norm2 = torch.nn.RMSNorm(cfg["emb_dim"], eps=1e-5)

    def forward(self, x, mask, cos, sin, positions):
        x = x + self.att(self.norm1(x), mask, cos, sin, positions)
        return x + self.ff(self.norm2(x))


class TorchLlama(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok_emb = torch.nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
        self.trf_blocks = torch.nn.ModuleList([TorchBlock(cfg) for _ in range(cfg["n_layers"])])
        self.final_norm = torch.nn.RMSNorm(cfg["emb_dim"], eps=1e-5)
        self.out_head = torch.nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)
        head_dim = cfg["emb_dim"] // cfg["n_heads"]
        self.cos, self.sin = compute_rope_params(head_dim, cfg["rope_base"], cfg["context_length"])

    def forward(self, in_idx, attention_mask=None):
        b, t = in_idx.shape
        if attention_mask is None:
            attention_mask = torch.ones(b, t, dtype=torch.long)
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # from each row's first token
        future = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        mask = future | (attention_mask == 0)[:, None, None, :]  # True: hidden
        x = self.tok_emb(in_idx)
        for block in self.trf_blocks:
            x = block(x, mask, self.cos, self.sin, positions)
        return self.out_head(self.final_norm(x))


# --- the tests --------------------------------------------------------------------------------
def _twins():
    """The toy (norm scales drawn away from 1, so a norm read wrongly shows) and its torch twin
    holding the same weights."""
    model, twin = ToyLlama(CFG, nnx.Rngs(0)), TorchLlama(CFG)
    rng = np.random.default_rng(1)

    def copy(torch_weight, flax_weight, transpose=False):
        value = np.asarray(flax_weight[...])
        torch_weight.data = torch.tensor(value.T if transpose else value)

    with torch.no_grad():
        for _, node in nnx.iter_graph(model):
            if isinstance(node, nnx.RMSNorm):
                node.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, node.scale.shape), jnp.float32)
        copy(twin.tok_emb.weight, model.tok_emb.embedding)
        for block, torch_block in zip(model.blocks, twin.trf_blocks):
            for name in ("W_query", "W_key", "W_value", "out_proj"):
                copy(getattr(torch_block.att, name).weight, getattr(block.att, name).kernel, True)
            for name in ("fc1", "fc2", "fc3"):
                copy(getattr(torch_block.ff, name).weight, getattr(block.ff, name).kernel, True)
            copy(torch_block.norm1.weight, block.norm1.scale)
            copy(torch_block.norm2.weight, block.norm2.scale)
        copy(twin.final_norm.weight, model.final_norm.scale)
        copy(twin.out_head.weight, model.out_head.kernel, True)
    return model, twin


@pytest.mark.quick
def test_toy_llama_logits_equal_its_torch_twin_with_left_padding():
    """A left-padded batch: the Flax toy's logits equal the twin's on every real token (rotary
    positions from each row's first token, grouped heads, padding hidden)."""
    model, twin = _twins()
    assert model.blocks[0].att.W_key.kernel.shape == (32, 16)  # 2 key heads of 8: not repeated
    ids = np.random.default_rng(2).integers(0, CFG["vocab_size"], (2, 9))
    attention_mask = np.ones((2, 9), np.int64)
    attention_mask[1, :3] = 0  # the second row left-padded by 3
    out = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(attention_mask)))
    with torch.no_grad():
        expected = twin(torch.tensor(ids), torch.tensor(attention_mask)).numpy()
        alone = twin(torch.tensor(ids[1:, 3:])).numpy()  # the padded row without its padding
    real = attention_mask.astype(bool)
    np.testing.assert_allclose(out[real], expected[real], rtol=0, atol=2e-5)
    np.testing.assert_allclose(out[1, 3:], alone[0], rtol=0, atol=2e-5)
    assert np.abs(expected).max() > 0.1


def _torch_greedy(twin, ids, steps):
    """The book's loop on the twin: the whole sequence through the model for every token."""
    ids = torch.tensor(ids)
    with torch.no_grad():
        for _ in range(steps):
            next_id = twin(ids)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
    return ids.numpy()


def test_toy_llama_generates_the_twins_tokens_with_the_cache():
    """``generate`` decodes the toy through its decode caches (grouped heads: 2 cached, rotary
    positions from the caches' length) and makes the twin's greedy tokens for each row of a
    batch, one of them left-padded; a ``cfg`` jit cannot key on is refused."""
    model, twin = _twins()
    rng = np.random.default_rng(3)
    prompt, short = (
        rng.integers(0, CFG["vocab_size"], (1, 5)),
        rng.integers(0, CFG["vocab_size"], (1, 3)),
    )
    batch = np.concatenate([prompt, np.concatenate([np.zeros((1, 2), int), short], 1)])
    attention_mask = np.concatenate([np.ones((1, 5)), [[0, 0, 1, 1, 1]]]).astype(np.int32)
    out = np.asarray(
        generate(model, jnp.asarray(batch), 12, CFG["context_length"],
                 attention_mask=jnp.asarray(attention_mask))
    )  # fmt: skip
    np.testing.assert_array_equal(out[0], _torch_greedy(twin, prompt, 12)[0])
    np.testing.assert_array_equal(out[1, 2:], _torch_greedy(twin, short, 12)[0])
    assert model.blocks[0].att.cached_key is None  # generate dropped its caches
    model.cfg = dict(CFG)  # a dict is not hashable: refused by name, not deep inside jit
    with pytest.raises(TypeError, match=r"^model.cfg \(a dict\) must be hashable"):
        generate(model, jnp.asarray(prompt), 2, CFG["context_length"])


def test_grouped_rotary_layer_decodes_as_its_full_pass():
    """``MultiHeadAttention`` with grouped heads, rotary positions and a window: prefill and
    token-by-token decoding give the full pass's outputs, the cache keeps the key heads only,
    and what it refuses it names."""
    layer = fa.MultiHeadAttention(
        16, 16, 12, 0.0, 4, num_kv_heads=1, window=3, rotary=rope, rngs=nnx.Rngs(0)
    )
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 10, 16)), jnp.float32)
    full = layer(x)
    layer.init_cache(2)
    assert layer.cached_key.shape == (2, 1, 12, 4)  # (b, h_kv, max_length, d)
    decode = nnx.jit(lambda layer, chunk: layer(chunk, decode=True))  # one compile a shape
    steps = [decode(layer, x[:, :4])] + [decode(layer, x[:, i : i + 1]) for i in range(4, 10)]
    np.testing.assert_allclose(np.concatenate(steps, 1), full, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) must divide num_heads \(4\)"):
        fa.MultiHeadAttention(16, 16, 12, 0.0, 4, num_kv_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"window \(0\) must be positive"):
        fa.MultiHeadAttention(16, 16, 12, 0.0, 4, window=0, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"rotary \(1\) must be None or a function"):
        fa.MultiHeadAttention(16, 16, 12, 0.0, 4, rotary=1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"^layout \('torch_nn'\) must be 'documents' for a Mu"):
        fa.state_dict(layer, layout="torch_nn")  # nn.MultiheadAttention has a key head a head
    plain = fa.MultiHeadAttention(16, 16, 12, 0.0, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"positions \(given\) needs a layer with rotary"):
        plain(x, positions=jnp.arange(10))
    with pytest.raises(ValueError, match=r"positions.shape \(\(9,\)\) must end in x's tokens"):
        layer(x, positions=jnp.arange(9))
