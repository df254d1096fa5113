"""``examples/gpt2.py``: a whole GPT-2 on our layers equals Hugging Face transformers.

A small random ``GPT2LMHeadModel`` (3 layers, 4 heads, d 64, vocabulary 97) is saved with
``save_pretrained`` (safetensors) and loaded by the example. Its weights are drawn with
``initializer_range`` 0.2 (transformers' default 0.02 makes a random model repeat one token,
which would make token equality a weak check): greedy decoding then wanders over the vocabulary
and logits reach about 6. At that scale float32 itself differs by a few 1e-6: transformers'
eager and sdpa attention differ by about 5e-6 from each other and 9e-6 from a float64 run.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("gpt2_example", ROOT / "examples" / "gpt2.py")
gpt2 = importlib.util.module_from_spec(SPEC)
sys.modules["gpt2_example"] = gpt2
SPEC.loader.exec_module(gpt2)

VOCAB = 97
PROMPT_LEN = 12
NEW_TOKENS = 32
#: Logits tolerance, float32 at highest matmul precision (the issue's bound).
LOGITS_TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=3, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=128,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.2,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).eval()
    directory = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(directory, safe_serialization=True)
    return directory, model


@pytest.fixture(scope="module")
def prompts():
    return np.random.default_rng(1).integers(0, VOCAB, (2, PROMPT_LEN))  # two different rows


@pytest.fixture(scope="module")
def hf_tokens(checkpoint, prompts):
    _, model = checkpoint
    ids = torch.from_numpy(prompts)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, use_cache=True,
            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0,
        )  # fmt: skip
    return out[:, PROMPT_LEN:].numpy()


def test_logits_equal_transformers(checkpoint, prompts):
    directory, hf = checkpoint
    model = gpt2.load_checkpoint(directory)
    with torch.no_grad():
        expected = hf(torch.from_numpy(prompts)).logits.numpy()  # (2, t, V)
    with jax.default_matmul_precision("highest"):
        got = np.asarray(model(prompts))
    error = float(np.abs(got - expected).max())
    print(f"logits max abs error {error:.2e} (max |logit| {np.abs(expected).max():.1f})")
    assert got.shape == expected.shape == (2, PROMPT_LEN, VOCAB)
    assert error <= LOGITS_TOL, f"logits: max abs diff {error:.2e} > {LOGITS_TOL}"


def test_greedy_tokens_equal_transformers_generate(checkpoint, prompts, hf_tokens):
    directory, _ = checkpoint
    model = gpt2.load_checkpoint(directory)
    with jax.default_matmul_precision("highest"):
        got = np.asarray(gpt2.generate(model, prompts, NEW_TOKENS))
    assert got.shape == (2, NEW_TOKENS)
    assert len(np.unique(hf_tokens)) > 10, "the reference repeats itself: a weak check"
    mismatch = np.argwhere(got != hf_tokens)
    assert mismatch.size == 0, f"first differing (row, step): {mismatch[0]}; got {got}"


def test_top_k_one_samples_the_greedy_tokens(checkpoint, prompts, hf_tokens):
    model = gpt2.load_checkpoint(checkpoint[0])
    key = jax.random.key(3)
    with jax.default_matmul_precision("highest"):
        got = gpt2.generate(model, prompts, NEW_TOKENS, key=key, temperature=0.7, top_k=1)
    np.testing.assert_array_equal(np.asarray(got), hf_tokens)


def test_sampling_is_a_function_of_the_key(checkpoint, prompts):
    model = gpt2.load_checkpoint(checkpoint[0])
    run = gpt2.compile_generate(model, 2, PROMPT_LEN, 8, greedy=False, top_k=5)
    first = np.asarray(run(prompts, jax.random.key(0), 1.5))
    again = np.asarray(run(prompts, jax.random.key(0), 1.5))
    other = np.asarray(run(prompts, jax.random.key(1), 1.5))
    np.testing.assert_array_equal(first, again)
    assert (first != other).any(), "a different key drew the same 16 tokens"
    assert first.min() >= 0 and first.max() < VOCAB


def test_command_line_json_equals_transformers(checkpoint, prompts, hf_tokens, tmp_path):
    directory, _ = checkpoint
    out = tmp_path / "result.json"
    command = [
        sys.executable, str(ROOT / "examples" / "gpt2.py"), "--checkpoint", str(directory),
        "--prompt-ids", ",".join(map(str, prompts[1])), "--max-new-tokens", str(NEW_TOKENS),
        "--batch", "2", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert set(result) == {"tokens", "prefill_ms", "tokens_per_s", "compile_s"}
    assert result["tokens"] == [hf_tokens[1].tolist()] * 2  # --batch 2: the prompt twice
    for name in ("prefill_ms", "tokens_per_s", "compile_s"):
        assert result[name] > 0, f"{name}: {result[name]}"


def test_command_line_prompt_uses_the_checkpoint_tokenizer(checkpoint, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    directory, hf = checkpoint
    words = [f"w{i}" for i in range(VOCAB)]
    tokenizer = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0")
    )
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    with_tokenizer = tmp_path / "ckpt"
    with_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (with_tokenizer / name).write_bytes((directory / name).read_bytes())
    tokenizer.save(str(with_tokenizer / "tokenizer.json"))
    text = "w5 w17 w42 w8"
    ids = torch.tensor([[5, 17, 42, 8]])
    with torch.no_grad():
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=6, min_new_tokens=6, pad_token_id=0)  # fmt: skip
    out = tmp_path / "result.json"
    command = [
        sys.executable, str(ROOT / "examples" / "gpt2.py"), "--checkpoint", str(with_tokenizer),
        "--prompt", text, "--max-new-tokens", "6", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["tokens"] == [expected[0, 4:].tolist()]
    decoded = " ".join(words[i] for i in expected[0].tolist())
    assert done.stdout.strip() == decoded  # prompt and continuation, through the tokenizer


def test_prompt_without_tokenizer_files_is_rejected(checkpoint):
    with pytest.raises(ValueError, match="tokenizer.json"):
        gpt2.main(["--checkpoint", str(checkpoint[0]), "--prompt", "hi", "--max-new-tokens", "2"])


def _tensors(directory) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(directory / "model.safetensors"))


def test_hub_names_and_buffers_load_the_same(checkpoint):
    """The hub's gpt2 files: no ``transformer.`` prefix, the old ``attn.bias`` mask buffers,
    sometimes an explicit (tied) ``lm_head.weight``."""
    directory, _ = checkpoint
    tensors = _tensors(directory)
    hub = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    for i in range(3):
        hub[f"h.{i}.attn.bias"] = np.tril(np.ones((128, 128), bool))[None, None]
    hub["lm_head.weight"] = hub["wte.weight"]
    reference = gpt2.load_checkpoint(directory)
    model = gpt2.GPT2(reference.config, rngs=gpt2.nnx.Rngs(5))
    gpt2.load_weights(model, hub)
    got = jax.tree.map(np.asarray, gpt2.nnx.state(model, gpt2.nnx.Param))
    expected = jax.tree.map(np.asarray, gpt2.nnx.state(reference, gpt2.nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, got, expected)


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"), "transformer.h.1.mlp.c_fc.bias"),
        (lambda t: t.pop("transformer.h.2.attn.c_attn.weight"),
         "transformer.h.2.attn.c_attn.weight"),
        (lambda t: t.__setitem__("transformer.wpe.weight", np.zeros((64, 64), np.float32)),
         "transformer.wpe.weight"),
        (lambda t: t.__setitem__("transformer.h.0.attn.c_proj.weight",
                                 np.zeros((64, 65), np.float32)),
         "transformer.h.0.attn.c_proj.weight"),
        (lambda t: t.__setitem__("transformer.h.0.mlp.c_proj.weight",
                                 np.zeros((64, 256), np.float32)),
         "transformer.h.0.mlp.c_proj.weight"),
        (lambda t: t.__setitem__("transformer.h.9.ln_1.weight", np.zeros(64, np.float32)),
         "transformer.h.9.ln_1.weight"),
    ],
    ids=["missing_mlp_bias", "missing_c_attn", "short_wpe", "wide_c_proj", "transposed_mlp",
         "extra_layer"],
)  # fmt: skip
def test_bad_checkpoint_rejected_by_name_and_model_unchanged(checkpoint, tmp_path, change, named):
    from safetensors.numpy import save_file

    directory, _ = checkpoint
    model = gpt2.load_checkpoint(directory)
    before = jax.tree.map(np.asarray, gpt2.nnx.state(model, gpt2.nnx.Param))
    tensors = _tensors(directory)
    change(tensors)
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        gpt2.load_weights(model, tensors)
    after = jax.tree.map(np.asarray, gpt2.nnx.state(model, gpt2.nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, after, before)  # nothing was written
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes((directory / "config.json").read_bytes())
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        gpt2.load_checkpoint(bad)


def test_unequal_prompts_and_bad_options_rejected(checkpoint):
    model = gpt2.load_checkpoint(checkpoint[0])
    with pytest.raises(ValueError, match=r"lengths \[2, 3\].*equal length"):
        gpt2.generate(model, [[1, 2], [3, 4, 5]], 4)
    with pytest.raises(ValueError, match=r"prompt_ids \(range 0\.\.97\)"):
        gpt2.generate(model, [[0, 97]], 4)
    with pytest.raises(ValueError, match=r"must not exceed n_positions \(128\)"):
        gpt2.generate(model, [[1] * 100], 30)
    with pytest.raises(ValueError, match="key"):
        gpt2.generate(model, [[1, 2]], 4, temperature=1.0)
    with pytest.raises(ValueError, match="activation_function"):
        gpt2.GPT2Config.from_dict({"activation_function": "relu"})


# ---- the whole model through the parity API ------------------------------------------------------

#: The train check's optimiser steps for the whole model (a few, as issue 13 asks; the report's
#: 50 are for single layers).
PARITY_TRAIN_STEPS = 5


@pytest.fixture(scope="module")
def parity_pair():
    """A 2-layer ``GPT2LMHeadModel`` (eager attention, dropout 0, default initialisation) and
    the example's model built from its config (weights: the parity API moves them)."""
    torch.manual_seed(2)
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        attn_implementation="eager",
    )  # fmt: skip
    hf = transformers.GPT2LMHeadModel(config).eval()
    assert hf.config._attn_implementation == "eager"
    ours = gpt2.GPT2(gpt2.GPT2Config.from_dict(config.to_dict()), rngs=gpt2.nnx.Rngs(0))
    ids = np.random.default_rng(4).integers(0, VOCAB, (2, PROMPT_LEN))
    return hf, ours, ids


def test_export_weights_inverts_load_weights(checkpoint):
    """The HF names of ``named_parameters()`` (the tied head once, as ``transformer.wte``), the
    checkpoint's values, and ``load_weights`` reads them back unchanged."""
    directory, hf = checkpoint
    model = gpt2.load_checkpoint(directory)
    exported = gpt2.export_weights(model)
    assert list(exported) == [n for n, _ in hf.named_parameters()]
    for name, value in hf.state_dict().items():
        key = "transformer.wte.weight" if name == "lm_head.weight" else name
        np.testing.assert_array_equal(exported[key], value.numpy(), err_msg=name)
    again = gpt2.GPT2(model.config, rngs=gpt2.nnx.Rngs(7))
    gpt2.load_weights(again, exported)
    for name, value in gpt2.export_weights(again).items():
        np.testing.assert_array_equal(value, exported[name], err_msg=name)


def test_whole_model_parity_with_transformers(parity_pair):
    """Forward, gradients (token ids get none; the tied embedding's gradient sums the lookup
    and the head on both sides, compared once as ``transformer.wte.weight``) and a few steps
    of Adam, AdamW and SGD with momentum, at the report's float32 tolerances.

    Two things a whole model brings that one layer does not, both from Adam dividing by
    ``sqrt(v) + 1e-8``: an entry whose gradient is near 1e-8 turns its rounding into a step of
    up to ``lr``. (1) torch's own float32 is off by 4.3e-5 from float64 after one Adam step
    here (``h.0.attn.c_attn.weight``) while ours is 2.2e-6 from it, so the reference is
    transformers in float64 (``reference_dtype``): the rows measure our float32 against the
    exact result. (2) The key third of the fused ``c_attn.bias`` cannot change the output (its
    gradient is rounding noise on either side), so the trajectories leave it out
    (``shift_invariant``), as the report leaves a separate key bias out.
    """
    from conformance_tests.parity import assert_parity

    hf, ours, ids = parity_pair
    rows = assert_parity(
        hf, ours, [ids], weights=(gpt2.load_weights, gpt2.export_weights),
        torch_output=lambda out: out.logits, checks=("forward", "grad", "train"),
        train_steps=PARITY_TRAIN_STEPS, name="GPT2LMHeadModel", reference_dtype="float64",
        shift_invariant={f"transformer.h.{i}.attn.c_attn.bias": slice(32, 64) for i in range(2)},
        # the key third: d .. 2 d of [query | key | value]
    )  # fmt: skip
    for row in rows:
        print(f"{row.check}: max abs error {row.max_abs_err:.2e} (tol {row.tol:.0e}, {row.worst})")
    assert [r.check for r in rows] == [
        "forward", "grad", "train/adam", "train/adamw", "train/sgd_momentum",
    ]  # fmt: skip
    assert all(r.passed and r.case == "GPT2LMHeadModel" for r in rows), rows
    assert all(0 < r.max_abs_err for r in rows), rows  # two computations, not one compared twice
