"""The book's Qwen3 and Llama 3 (``flax_attention.models.qwen3``, ``.llama3``) against the book's
own package (``llms_from_scratch`` 1.0.19: ``qwen3.Qwen3Model``, ``llama3.Llama3Model`` and the
cached loops of ``kv_cache``) and against transformers (``Qwen3ForCausalLM``,
``LlamaForCausalLM`` from saved directories).

The mixture of experts (6 experts, 2 a token) runs both of its paths: a decode step's few tokens
gather their experts' weights, longer calls run every expert. The small configs keep what small
configs hide: Qwen3's ``head_dim`` (16) is not ``emb_dim /
n_heads`` (8); Llama 3's ``original_context_length`` (1024) puts its 8 frequencies in all three
bands of the scaling (kept, smoothed, divided by ``factor``); the norms' scales are drawn away
from 1 so a norm read wrongly shows; the checkpoints' ``rms_norm_eps`` differ from the book's.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from llms_from_scratch import appendix_e
from llms_from_scratch import llama3 as book_llama3
from llms_from_scratch import qwen3 as book_qwen3
from llms_from_scratch.kv_cache import generate as book_cached
from llms_from_scratch.kv_cache import llama3 as book_llama3_cached
from llms_from_scratch.kv_cache import qwen3 as book_qwen3_cached

import flax_attention as fa
from flax_attention.models import Llama3Model, Qwen3Model, generate, lora, quantize
from flax_attention.models.decoder import rope_frequencies
from flax_attention.models.llama3 import LLAMA32_CONFIG_1B
from flax_attention.models.qwen3 import QWEN_CONFIG_06_B

QWEN = {"vocab_size": 97, "context_length": 64, "emb_dim": 32, "n_heads": 4, "n_layers": 2,
        "hidden_dim": 48, "head_dim": 16, "qk_norm": True, "n_kv_groups": 2,
        "rope_base": 10_000.0}  # fmt: skip
LLAMA = {"vocab_size": 97, "context_length": 64, "emb_dim": 64, "n_heads": 4, "n_layers": 2,
         "hidden_dim": 48, "n_kv_groups": 2, "rope_base": 500_000.0,
         "rope_freq": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_context_length": 1024}}  # fmt: skip
QWEN_MOE = {**{k: v for k, v in QWEN.items() if k != "hidden_dim"}, "num_experts": 6,
            "num_experts_per_tok": 2, "moe_intermediate_size": 24}  # fmt: skip
MODELS = {
    "qwen3": (Qwen3Model, book_qwen3.Qwen3Model, book_qwen3_cached.Qwen3Model, QWEN),
    "qwen3_moe": (Qwen3Model, book_qwen3.Qwen3Model, book_qwen3_cached.Qwen3Model, QWEN_MOE),
    "llama3": (Llama3Model, book_llama3.Llama3Model, book_llama3_cached.Llama3Model, LLAMA),
}


def _pair(name, book_class_index=1):
    """The Flax model (norm scales drawn away from 1) and the book's torch model holding the
    same weights, loaded through the book's state dict names."""
    flax_class, cfg = MODELS[name][0], MODELS[name][3]
    model = flax_class({**cfg, "dtype": jnp.float32}, rngs=nnx.Rngs(0))
    state = fa.state_dict(model)
    rng = np.random.default_rng(1)
    for key in state:
        if "norm" in key:
            state[key] = (1 + 0.3 * rng.standard_normal(state[key].shape)).astype(np.float32)
    fa.load_state_dict(model, state)
    book = MODELS[name][book_class_index]({**cfg, "dtype": torch.float32})
    tensors = {key: torch.from_numpy(value) for key, value in state.items()}
    book.load_state_dict(tensors, assign=True)  # assign: the book's experts are on "meta"
    return model, book.eval(), state


def _loss(logits, targets):
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


@nnx.jit
def _logits_and_grads(model, inputs, targets):
    """The logits and every parameter's gradient of the mean cross-entropy, in one compile (an
    eager forward and gradient take several times as long on these small models)."""

    def loss(model):
        logits = model(inputs)
        return _loss(logits, targets), logits

    (_, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return logits, grads


@pytest.mark.quick
@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "llama3"])
def test_logits_gradients_and_state_dict_equal_the_books(name):
    model, book, state = _pair(name)
    idx = np.random.default_rng(2).integers(0, 97, (2, 33))
    inputs, targets = idx[:, :-1], idx[:, 1:]
    logits = book(torch.from_numpy(inputs))
    torch_loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), torch.from_numpy(targets).flatten()
    )
    torch_loss.backward()
    ours, grads = _logits_and_grads(model, jnp.asarray(inputs), jnp.asarray(targets))
    assert np.abs(np.asarray(ours) - logits.detach().numpy()).max() < 2e-6
    holder = nnx.clone(model)
    nnx.update(holder, grads)
    ours_grads = fa.state_dict(holder)
    assert set(ours_grads) == {key for key, _ in book.named_parameters()}
    for key, parameter in book.named_parameters():
        expected = parameter.grad.numpy()
        assert np.abs(ours_grads[key] - expected).max() <= 2e-6 * np.abs(expected).max(), key
    back = fa.state_dict(model)  # the book's state dict goes back out bit for bit
    assert back.keys() == state.keys()
    assert all(np.array_equal(back[key], state[key]) for key in state)


@pytest.mark.parametrize("name", ["qwen3_moe", "llama3"])
def test_cached_generation_equals_the_books_cached_loop(name):
    model, book, _ = _pair(name, book_class_index=2)  # the book's kv_cache model, same names
    prompt = np.random.default_rng(3).integers(0, 97, (1, 9))
    expected = book_cached.generate_text_simple(book, torch.from_numpy(prompt), 20).numpy()
    ours = generate(model, jnp.asarray(prompt), 20, MODELS[name][3]["context_length"])
    np.testing.assert_array_equal(np.asarray(ours), expected)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])  # Llama 3's bfloat16: the report's rows
def test_int8_bfloat16_and_lora_as_the_books(name):
    """int8: the book's model holding the dequantized weights gives the quantized model's
    logits; bfloat16: the error against float32 within 1.5x of the book's own bfloat16 model's;
    LoRA (appendix E's ``replace_linear_with_lora`` on both, ``B`` drawn; the dense models, as
    the experts of a mixture are no Linears here): the same logits. The
    package's appendix E scales the update by ``alpha``, the book's repository since 2025 (and
    ``models.lora``) by ``alpha / rank``: rank 1 makes the two agree."""
    model, book, state = _pair(name)
    flax_class, book_class, cfg = MODELS[name][0], MODELS[name][1], MODELS[name][3]
    idx = np.random.default_rng(5).integers(0, 97, (2, 16))
    with torch.no_grad():
        reference = book(torch.from_numpy(idx)).numpy()

    def book_model(dtype, weights):
        twin = book_class({**cfg, "dtype": dtype})
        twin.load_state_dict({k: torch.from_numpy(v).to(dtype) for k, v in weights.items()},
                             assign=True)  # fmt: skip
        with torch.no_grad():
            return twin(torch.from_numpy(idx)).float().numpy()

    quantized = quantize(model)
    expected = book_model(torch.float32, fa.state_dict(quantized))  # the dequantized weights
    assert np.abs(np.asarray(quantized(jnp.asarray(idx))) - expected).max() < 2e-6
    assert np.abs(expected - reference).max() > 1e-3  # int8 moved the logits: a real check
    half = flax_class({**cfg, "dtype": jnp.bfloat16}, rngs=nnx.Rngs(0))
    fa.load_state_dict(half, state)
    ours = np.abs(np.asarray(half(jnp.asarray(idx)), np.float32) - reference).max()
    books = np.abs(book_model(torch.bfloat16, state) - reference).max()
    assert 0 < ours <= 1.5 * books, (ours, books)
    if name == "qwen3_moe":  # its experts are stacked parameters, not Linears: no adapters
        return
    lora.replace_linear_with_lora(model, 1, 4.0, rngs=nnx.Rngs(1))
    appendix_e.replace_linear_with_lora(book, 1, 4.0)
    adapted = fa.state_dict(model)
    rng = np.random.default_rng(6)
    for key in adapted:
        if key.endswith("lora.B"):
            adapted[key] = (0.1 * rng.standard_normal(adapted[key].shape)).astype(np.float32)
    fa.load_state_dict(model, adapted)
    book.load_state_dict({k: torch.from_numpy(v) for k, v in adapted.items()})
    with torch.no_grad():
        expected = book(torch.from_numpy(idx)).numpy()
    assert np.abs(expected - reference).max() > 0.1  # the adapters moved the logits
    assert np.abs(np.asarray(model(jnp.asarray(idx))) - expected).max() < 2e-5


def test_rope_scaling_has_three_bands_as_the_books():
    freq = LLAMA["rope_freq"]
    plain = rope_frequencies(16, LLAMA["rope_base"])
    scaled = rope_frequencies(16, LLAMA["rope_base"], freq)
    kept, divided = scaled == plain, np.isclose(scaled, plain / freq["factor"], rtol=1e-6)
    assert kept.any() and divided.any() and (~kept & ~divided).any()  # the smoothed band too
    cos, _ = book_llama3.compute_rope_params(16, LLAMA["rope_base"], 4, freq)
    np.testing.assert_allclose(np.cos(scaled * 3.0), cos[3, :8].numpy(), rtol=1e-6)


def _peer(name, tied):
    """A random transformers model with our small config, its norms away from 1, and
    ``rms_norm_eps`` other than the book's."""
    torch.manual_seed(0)
    if name == "llama3":
        config = transformers.LlamaConfig(
            vocab_size=97, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            rms_norm_eps=1e-6, tie_word_embeddings=tied,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 1024},
        )  # fmt: skip
        peer = transformers.LlamaForCausalLM(config)
    elif name == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            vocab_size=97, hidden_size=32, moe_intermediate_size=24, num_experts=6,
            num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5,
            norm_topk_prob=True, tie_word_embeddings=tied,
        )  # fmt: skip
        peer = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.Qwen3Config(
            vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        )  # fmt: skip
        peer = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for key, parameter in peer.named_parameters():
            if "norm" in key:
                parameter.copy_(1 + 0.3 * torch.randn_like(parameter))
            if "mlp.gate" in key:  # transformers initialises the router at zeros: no choice
                parameter.normal_()
    return peer.eval()


@pytest.mark.parametrize(
    ("name", "tied"), [("qwen3", False), ("qwen3_moe", False), ("llama3", True)]
)
def test_checkpoints_and_left_padded_generation_equal_transformers(name, tied, tmp_path):
    peer = _peer(name, tied)
    peer.save_pretrained(tmp_path / "peer", max_shard_size="20KB")  # sharded, with an index
    assert (tmp_path / "peer" / "model.safetensors.index.json").is_file()
    model = MODELS[name][0].from_pretrained(tmp_path / "peer")
    assert model.cfg["rms_norm_eps"] == peer.config.rms_norm_eps
    assert (model.out_head is None) == tied
    idx = np.random.default_rng(4).integers(0, 97, (2, 24))
    with torch.no_grad():
        expected = peer(torch.from_numpy(idx)).logits.numpy()
    assert np.abs(np.asarray(model(jnp.asarray(idx))) - expected).max() < 2e-6
    model.save_pretrained(tmp_path / "ours")
    again = type(peer).from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert np.array_equal(again(torch.from_numpy(idx)).logits.numpy(), expected)
    mask = np.ones_like(idx)
    mask[1, :7] = 0  # row 1 left-padded: its positions count from its first token
    tokens = peer.generate(
        input_ids=torch.from_numpy(idx), attention_mask=torch.from_numpy(mask),
        max_new_tokens=10, do_sample=False, pad_token_id=0,
    )  # fmt: skip
    ours = generate(model, jnp.asarray(idx), 10, 64, attention_mask=jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(ours), tokens.numpy())


def test_book_configs_build_abstractly_with_their_head_dims():
    qwen = nnx.eval_shape(lambda: Qwen3Model(QWEN_CONFIG_06_B, rngs=nnx.Rngs(0)))
    att = qwen.trf_blocks[0].att
    assert (att.head_dim, att.W_query.kernel.shape, att.out_proj.kernel.shape) == (
        128,
        (1024, 2048),
        (2048, 1024),
    )
    assert att.W_query.kernel.dtype == jnp.bfloat16 and att.q_norm.scale.dtype == jnp.float32
    llama = nnx.eval_shape(lambda: Llama3Model(LLAMA32_CONFIG_1B, rngs=nnx.Rngs(0)))
    assert llama.trf_blocks[0].att.W_key.kernel.shape == (2048, 512)


@pytest.mark.quick
def test_bad_configs_and_checkpoints_name_what_is_wrong(tmp_path):
    cfg = {**QWEN, "dtype": jnp.float32}
    cases = [
        ("cfg must have key 'head_dim' for Qwen3Model",
         lambda: Qwen3Model({k: v for k, v in cfg.items() if k != "head_dim"}, rngs=nnx.Rngs(0))),
        ("cfg key 'drop_rate' must be one of",
         lambda: Qwen3Model({**cfg, "drop_rate": 0.1}, rngs=nnx.Rngs(0))),
        ("cfg['n_heads'] (4) must be divisible by cfg['n_kv_groups'] (3)",
         lambda: Qwen3Model({**cfg, "n_kv_groups": 3}, rngs=nnx.Rngs(0))),
        ("cfg['rope_freq'] ({'factor': 8.0}) must have exactly the fields",
         lambda: Llama3Model({**LLAMA, "dtype": jnp.float32, "rope_freq": {"factor": 8.0}},
                             rngs=nnx.Rngs(0))),
        ("cfg['dtype'] (<class 'jax.numpy.int32'>) must be a floating dtype",
         lambda: Llama3Model({**LLAMA, "dtype": jnp.int32}, rngs=nnx.Rngs(0))),
    ]  # fmt: skip
    for message, call in cases:
        with pytest.raises((ValueError, TypeError)) as raised:
            call()
        assert message in str(raised.value), str(raised.value)
    peer = _peer("qwen3", False)
    peer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model_type \('qwen3'\) must be one of \('llama',\)"):
        Llama3Model.from_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match=r"config hidden_act \('gelu'\) must be one of"):
        Qwen3Model.from_pretrained(tmp_path)
    model = Qwen3Model(cfg, rngs=nnx.Rngs(0))
    before = fa.state_dict(model)
    state = fa.state_dict(model, layout="llama")  # Hugging Face's names, model. prefixed
    state.pop("model.layers.1.self_attn.k_norm.weight")
    state["model.norm.weight"] = np.ones(5, np.float32)
    with pytest.raises(ValueError) as raised:
        fa.load_state_dict(model, state, layout="llama")
    assert "layers.1.self_attn.k_norm.weight" in str(raised.value)
    assert "model.norm.weight" in str(raised.value)
    after = fa.state_dict(model)  # a failed load changes nothing
    assert all(np.array_equal(before[key], after[key]) for key in before)
