"""``flax_attention.models`` (the book's chapter 4 ``GPTModel``, chapter 5's generation and
training) against its torch twin, ``conformance_tests/book_gpt.py``, written from the book.

One small model (vocabulary 97, 16 positions, d 32, 2 heads, 2 layers) is drawn by torch and
loaded into Flax through the weight bridge; everything below compares numbers: logits and every
parameter's gradient by torch name, state dicts both ways and through ``.pth`` files, greedy and
filtered generation token for token (the cropped window included), 20 AdamW steps of chapter 5's
loop, the evaluation helpers, an orbax checkpoint taken mid-run, dropout in train mode, and the
errors bad inputs raise.
"""

from __future__ import annotations

import itertools
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import torch
from flax import nnx

import flax_attention as fa
from conformance_tests import book_gpt
from conformance_tests.tolerances import TOLERANCES
from flax_attention import models
from flax_attention.models.checkpoints import new_model

#: The book's cfg keys at a size that runs in milliseconds; ``drop_rate`` 0 unless a test sets it.
CFG = {
    "vocab_size": 97,
    "context_length": 16,
    "emb_dim": 32,
    "n_heads": 2,
    "n_layers": 2,
    "drop_rate": 0.0,
    "qkv_bias": False,
}

#: Logits and gradients, float32 at highest matmul precision: the spec's forward/grad entries
#: (``max_abs_err <= tol * max(1, max|reference|)``).
TOL = TOLERANCES[("float32", "forward")]

#: Training parity after ``STEPS`` AdamW steps, parameters and per-step losses: the spec's
#: float32 ``train`` entry (1e-5). Measured: parameters 1.2e-6 (``trf_blocks.0.norm1.scale``;
#: median 1.5e-7), losses 4.4e-7 of their size (1.9e-6 at about 4.6). optax.adamw, as a user
#: writes it, computes the bias correction ``1 - 0.999**t`` in float32, 1.3e-5 off relative to
#: torch's (``conformance_tests/optimisers.py``); at lr 4e-4 that moves a parameter by at most
#: STEPS * 4e-4 * 1.3e-5 ~ 1e-7. With torch's correction instead the worst parameter is the same
#: 1.2e-6 (losses 1.1e-7): what remains is float32 rounding of the gradients, which Adam's
#: normalisation turns into steps of nearly full size where the second moment is small.
TRAIN_TOL = TOLERANCES[("float32", "train")]
STEPS = 20
BATCH, TOKENS = 2, 16
#: Chapter 5's optimiser, one object for every ``nnx.Optimizer`` here: it is part of the
#: optimiser's static structure, so a new ``optax.adamw(...)`` would compile ``train_step`` again.
ADAMW = optax.adamw(4e-4, weight_decay=0.1)
#: Distinct batches of the training run, cycled as the book's epochs (5 of them in ``STEPS``).
EPOCH = 4


def _twin(cfg=CFG, seed=0):
    torch.manual_seed(seed)
    return book_gpt.GPTModel(cfg)


def _numpy(state_dict) -> dict[str, np.ndarray]:
    return {key: value.detach().numpy().copy() for key, value in state_dict.items()}


def _torch(state_dict) -> dict[str, torch.Tensor]:
    return {key: torch.from_numpy(np.array(value)) for key, value in state_dict.items()}


def _flax(state_dict, cfg=CFG):
    """A Flax ``GPTModel`` holding ``state_dict``: built without drawing its parameters
    (``new_model``, what a checkpoint is loaded into), then filled by one strict load."""
    model = new_model(models.GPTModel, cfg)
    fa.load_state_dict(model, state_dict)
    return model


def _params(model) -> dict[str, np.ndarray]:
    """Every parameter by torch name (the causal-mask buffers left out)."""
    return {k: v for k, v in fa.state_dict(model).items() if not k.endswith(".mask")}


def _error(got, reference) -> float:
    """``max_abs_err / max(1, max|reference|)``: what a tolerance is compared with."""
    got, reference = np.asarray(got, np.float64), np.asarray(reference, np.float64)
    return float(np.abs(got - reference).max() / max(1.0, np.abs(reference).max()))


def _dropouts_deterministic(model) -> list[bool]:
    return [
        node.deterministic for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Dropout)
    ]


@pytest.fixture(scope="module")
def weights():
    """The twin's initial state dict (causal masks included), as NumPy."""
    return _numpy(_twin().state_dict())


@pytest.fixture(scope="module")
def batches():
    """``STEPS`` batches ``(inputs, targets)``, each ``(BATCH, TOKENS)``: ``EPOCH`` fixed random
    ones, repeated as the book's loop repeats its loader every epoch; the targets are the inputs
    shifted by one token, as the book's dataset makes them."""
    data = np.random.default_rng(0).integers(0, CFG["vocab_size"], (EPOCH, BATCH, TOKENS + 1))
    return [(row[:, :-1], row[:, 1:]) for row in data] * (STEPS // EPOCH)


# ---- the same weights, the same numbers --------------------------------------------------------


def test_logits_and_gradients_equal_the_torch_twin(batches):
    cfg = {**CFG, "qkv_bias": True}  # every key of the attention layers (GPT-2's checkpoints)
    twin = _twin(cfg)
    model = _flax(_numpy(twin.state_dict()), cfg)
    inputs, targets = batches[0]

    loss = book_gpt.calc_loss_batch(torch.from_numpy(inputs), torch.from_numpy(targets), twin)
    loss.backward()
    with torch.no_grad():
        expected = twin(torch.from_numpy(inputs)).numpy()  # (b, t, V)
    got = np.asarray(model(inputs))
    logits_error = _error(got, expected)
    assert got.shape == (BATCH, TOKENS, CFG["vocab_size"])
    assert logits_error <= TOL, f"logits: {logits_error:.2e} > {TOL}"

    loss_and_grads = nnx.jit(nnx.value_and_grad(lambda m, x, y: models.calc_loss_batch(x, y, m)))
    flax_loss, grads = loss_and_grads(model, inputs, targets)
    np.testing.assert_allclose(float(flax_loss), loss.item(), rtol=0, atol=TOL * loss.item())
    holder = nnx.clone(model)
    nnx.update(holder, grads)  # the gradients in the parameters' places: torch names for both
    flax_grads = _params(holder)
    torch_grads = {name: p.grad.numpy() for name, p in twin.named_parameters()}
    assert set(flax_grads) == set(torch_grads)
    errors = {name: _error(flax_grads[name], g) for name, g in torch_grads.items()}
    worst = max(errors, key=errors.get)
    print(f"logits {logits_error:.2e}, worst gradient {worst} {errors[worst]:.2e}")
    assert errors[worst] <= TOL, f"gradient of {worst}: {errors[worst]:.2e} > {TOL}"
    # W_key.bias has no true gradient (softmax ignores a shift shared by all keys): both sides
    # give rounding noise there, within TOL; every other gradient is a real one
    assert all(np.abs(g).max() > 1e-3 for n, g in torch_grads.items() if "W_key.bias" not in n)


def test_kernel_and_tied_table_gradients_are_computed_without_transposed_copies():
    """The Linear layers and the tied head multiply rows (``_init.rows_dot_general``), so XLA's
    CPU compiler computes each kernel's gradient, and the token table's through the head, as one
    product of the rows: the compiled gradient has no array of an incoming gradient laid out
    features first, ``(features, b, t)`` or ``(features, b * t)``. With ``(b, t, d)`` products
    77 of its instructions made or read one here (every layer's kernels, and the head's
    ``(V, b * t)``); in GPT-2 small such copies recomputed the residual stream's chain of
    gradient sums and took a fifth of a training step (docs/performance.md, "Where a training
    step's time goes")."""
    cfg = {**CFG, "tie_word_embeddings": True, "n_layers": 3}
    model = models.GPTModel(cfg, rngs=nnx.Rngs(0))
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    b, t = 3, 10  # b * t matches no feature size
    data = np.random.default_rng(0).integers(0, cfg["vocab_size"], (b, t + 1))
    inputs, targets = data[:, :-1], data[:, 1:]

    def loss(params):
        return models.calc_loss_batch(inputs, targets, nnx.merge(graph, params, rest))

    with jax.default_device(jax.devices("cpu")[0]):
        hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
    features = {cfg["emb_dim"], 3 * cfg["emb_dim"], 4 * cfg["emb_dim"], cfg["vocab_size"]}
    tokens = rf"({b},{t}|{b * t})"
    laid_out = re.compile(rf"= f32\[({'|'.join(map(str, features))}),{tokens}\]")
    copies = [line.strip()[:120] for line in hlo.splitlines() if laid_out.search(line)]
    assert not copies, f"{len(copies)} transposed gradient copies, e.g. {copies[:3]}"
    assert "dot(" in hlo or "ynn_fusion" in hlo  # the program was read: its products are there


def test_torch_to_flax_to_torch_is_bit_identical(weights):
    model = _flax(weights)
    exported = fa.state_dict(model)
    assert set(exported) == set(weights)  # the book's keys, masks included (in Flax's order)
    twin = _twin(seed=7)
    twin.load_state_dict(_torch(exported), strict=True)
    for key, value in twin.state_dict().items():
        original = torch.from_numpy(weights[key])
        assert value.dtype == original.dtype, f"{key}: {value.dtype} != {original.dtype}"
        assert torch.equal(value, original), f"{key} changed in the round trip"


def test_read_pth_reads_the_books_two_checkpoint_files(tmp_path, weights, batches):
    twin = _twin()
    optimizer = torch.optim.AdamW(twin.parameters(), lr=4e-4, weight_decay=0.1)
    book_gpt.train_steps(twin, optimizer, [tuple(map(torch.from_numpy, batches[0]))])
    trained = _numpy(twin.state_dict())
    torch.save(twin.state_dict(), tmp_path / "model.pth")  # chapter 5's first form
    torch.save(
        {"model_state_dict": twin.state_dict(), "optimizer_state_dict": optimizer.state_dict()},
        tmp_path / "model_and_optimizer.pth",
    )
    for name in ("model.pth", "model_and_optimizer.pth"):
        read = models.read_pth(tmp_path / name)
        assert set(read) == set(trained), name
        for key, value in trained.items():
            np.testing.assert_array_equal(read[key], value, err_msg=f"{name}: {key}")
        model = _flax(weights)
        fa.load_state_dict(model, read)
        loaded = _params(model)
        for key, value in loaded.items():
            np.testing.assert_array_equal(value, trained[key], err_msg=f"{name}: {key}")
        assert not np.array_equal(loaded["tok_emb.weight"], weights["tok_emb.weight"])


@pytest.mark.quick
def test_tied_head_exports_the_embedding_and_refuses_a_different_head(weights):
    cfg = {**CFG, "tie_word_embeddings": True}
    tied_weights = {**weights, "out_head.weight": weights["tok_emb.weight"].copy()}
    model = _flax(tied_weights, cfg)
    exported = fa.state_dict(model)
    np.testing.assert_array_equal(exported["out_head.weight"], exported["tok_emb.weight"])
    twin = _twin(seed=3)
    twin.load_state_dict(_torch(exported), strict=True)
    inputs = np.random.default_rng(1).integers(0, CFG["vocab_size"], (BATCH, TOKENS))
    with torch.no_grad():
        expected = twin(torch.from_numpy(inputs)).numpy()
    error = _error(model(inputs), expected)
    assert error <= TOL, f"tied logits: {error:.2e} > {TOL}"

    before = _params(model)
    other = _numpy(_twin(seed=4).state_dict())  # out_head.weight is not tok_emb.weight
    with pytest.raises(ValueError) as caught:
        fa.load_state_dict(model, other)
    message = str(caught.value)
    assert "out_head.weight" in message and "tok_emb.weight" in message, message
    for key, value in _params(model).items():
        np.testing.assert_array_equal(value, before[key], err_msg=f"{key} changed")


# ---- generation ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    """The twin (eval mode) and the Flax model with its weights, every Linear weight tripled: at
    the book's initialisation a random model soon repeats two or three tokens (a weak check of
    token equality); tripled, its logits reach about 7 and greedy decoding wanders over the
    vocabulary (as ``test_gpt2.py`` draws its model with a larger ``initializer_range``)."""
    twin = _twin().eval()
    with torch.no_grad():
        for name, parameter in twin.named_parameters():
            if parameter.ndim == 2 and "_emb." not in name:
                parameter.mul_(3.0)
    return twin, _flax(_numpy(twin.state_dict()))


def _book(fn, twin, prompt, *args, **kwargs) -> np.ndarray:
    return fn(twin, torch.from_numpy(np.asarray(prompt, np.int64)), *args, **kwargs).numpy()


PROMPTS = np.random.default_rng(2).integers(0, CFG["vocab_size"], (BATCH, 12))


def test_greedy_generation_equals_the_book_as_the_window_is_cropped(pair):
    """Prompt 5, window 8, 12 new tokens: 4 steps while the window is the whole sequence (the
    decode cache), then 8 on the cropped window, two rows."""
    twin, model = pair
    prompt = PROMPTS[:, :5]
    expected = _book(book_gpt.generate_text_simple, twin, prompt, 12, 8)
    assert expected.shape == (BATCH, 5 + 12)
    assert len(np.unique(expected[:, 5:])) > 5, "the twin repeats itself: a weak check"
    np.testing.assert_array_equal(_book(book_gpt.generate, twin, prompt, 12, 8), expected)
    np.testing.assert_array_equal(models.generate_text_simple(model, prompt, 12, 8), expected)
    np.testing.assert_array_equal(models.generate(model, prompt, 12, 8, temperature=0.0), expected)


def test_top_k_and_eos_id_equal_the_book_from_a_prompt_longer_than_the_window(pair):
    twin, model = pair
    prompt = PROMPTS[:1]  # 12 tokens, window 8; the book's top-k and eos_id lines take one row
    full = _book(book_gpt.generate, twin, prompt, 8, 8, top_k=5)
    assert len(set(full[0, 12:].tolist())) > 3, "the twin repeats itself: a weak check"
    new = full[0, 12:].tolist()
    # the last token that is new when drawn: generation must end just before it
    stop = max(i for i, token in enumerate(new) if token not in new[:i])
    assert stop >= 3, f"eos would stop at step {stop}: a weak check"
    eos_id = new[stop]
    expected = _book(book_gpt.generate, twin, prompt, 8, 8, top_k=5, eos_id=eos_id)
    np.testing.assert_array_equal(expected, full[:, : 12 + stop])  # eos_id is not appended
    got = np.asarray(models.generate(model, prompt, 8, 8, top_k=5, eos_id=eos_id))
    np.testing.assert_array_equal(got, expected)


def test_sampling_is_a_function_of_the_key_and_top_k_one_is_greedy(pair):
    twin, model = pair
    prompt = PROMPTS[:1, :5]
    window = CFG["context_length"]  # the whole sequence fits: the cached loop only

    def sample(seed, **options):
        out = models.generate(model, prompt, 10, window, temperature=1.0, key=jax.random.key(seed),
                              **options)  # fmt: skip
        return np.asarray(out)

    first, again, other = sample(0), sample(0), sample(1)
    np.testing.assert_array_equal(first, again)
    assert (first[0, 5:] != other[0, 5:]).any(), "another key drew the same 10 tokens"
    assert first.shape == (1, 15) and 0 <= first.min() and first.max() < CFG["vocab_size"]
    np.testing.assert_array_equal(first[:, :5], prompt)
    greedy = _book(book_gpt.generate, twin, prompt, 10, window)
    np.testing.assert_array_equal(sample(2, top_k=1), greedy)


def test_greedy_generation_draws_no_random_numbers(pair, monkeypatch):
    """Greedy, the program holds no random-number code (Threefry's ``fold_in`` per step, to
    compile for nothing); sampling draws through ``fold_in``."""
    twin, model = pair
    prompt = PROMPTS[:1, :3]

    def fold_in(*args):
        raise AssertionError("fold_in called")

    monkeypatch.setattr(jax.random, "fold_in", fold_in)
    models.generation._generate.clear_cache()  # traced anew, under the patch
    greedy = models.generate(model, prompt, 9, 4)
    np.testing.assert_array_equal(greedy, _book(book_gpt.generate, twin, prompt, 9, 4))
    with pytest.raises(AssertionError, match="fold_in called"):
        models.generate(model, prompt, 9, 4, temperature=1.0, key=jax.random.key(0))


#: (prompt tokens, context_size, new tokens): windows that crop after 0, 1 or several cached
#: steps, a prompt longer than its window, and ``context_size == context_length`` run past it.
GREEDY_CASES = [(1, 16, 20), (5, 8, 12), (7, 7, 6), (12, 8, 5), (3, 4, 9), (6, 16, 8)]


@pytest.mark.parametrize("prompt_bucket", [1, 4], ids=["unpadded", "bucket4"])
def test_greedy_tokens_equal_the_books_loop_for_many_prompts_and_windows(pair, prompt_bucket):
    """Token for token against the book's loop (cropping included), with the prompt run as it
    is and left-padded to a multiple of 4 (bucket4 pads 3, 3, 1, 0, 1 and 2 tokens)."""
    twin, model = pair
    for tokens, window, new in GREEDY_CASES:
        prompt = PROMPTS[:, :tokens]
        expected = _book(book_gpt.generate_text_simple, twin, prompt, new, window)
        got = models.generate(model, prompt, new, window, prompt_bucket=prompt_bucket)
        np.testing.assert_array_equal(
            got, expected, err_msg=f"prompt {tokens}, context_size {window}, {new} new tokens"
        )


def test_a_left_padded_row_equals_itself_alone_once_the_window_crops(pair):
    """Row 0 (5 tokens, 3 of padding) and row 1 (8 tokens) with window 8: after the first step
    every window is cropped, and the padding must stay hidden in the cropped windows too."""
    twin, model = pair
    short = PROMPTS[:1, :5]
    ids = np.concatenate([np.pad(short, ((0, 0), (3, 0))), PROMPTS[1:, :8]])  # (2, 8)
    mask = np.array([[0] * 3 + [1] * 5, [1] * 8])
    got = np.asarray(models.generate(model, ids, 10, 8, attention_mask=mask))
    for row, prompt in ((0, short), (1, PROMPTS[1:, :8])):
        expected = _book(book_gpt.generate_text_simple, twin, prompt, 10, 8)
        np.testing.assert_array_equal(got[row, -10:], expected[0, -10:], err_msg=f"row {row}")


def test_generate_runs_a_train_mode_model_in_eval_mode_and_leaves_it_in_train_mode(pair):
    """Dropout 0.5 in train mode: generation turns it off (the book calls ``model.eval()``)
    and gives the mode back."""
    twin, model = pair
    dropping = _flax(fa.state_dict(model), cfg={**CFG, "drop_rate": 0.5})
    dropping.train()
    expected = _book(book_gpt.generate_text_simple, twin, PROMPTS[:, :5], 8, 16)
    compiled = models.generation._generate._cache_size()
    np.testing.assert_array_equal(models.generate(dropping, PROMPTS[:, :5], 8, 16), expected)
    np.testing.assert_array_equal(models.generate(dropping, PROMPTS[:, :5], 8, 6), _book(
        book_gpt.generate_text_simple, twin, PROMPTS[:, :5], 8, 6))  # fmt: skip
    assert _dropouts_deterministic(dropping) == [False] * 5
    # a model jit cannot take whole (nnx.split's path) also runs as an eval-mode copy
    np.testing.assert_array_equal(models.generate(_GraphOnly(dropping), PROMPTS[:, :5], 8, 16),
                                  expected)  # fmt: skip
    assert _dropouts_deterministic(dropping) == [False] * 5
    # one program for either mode: the same call in eval mode compiles nothing new
    programs = models.generation._generate._cache_size() - compiled
    dropping.eval()
    np.testing.assert_array_equal(models.generate(dropping, PROMPTS[:, :5], 8, 16), expected)
    assert models.generation._generate._cache_size() - compiled == programs


class _Wrapped(nnx.Module):
    """Another model: not a GPTModel, only what ``generation.CausalLM`` asks for."""

    def __init__(self, inner):
        self.inner, self.cfg = inner, inner.cfg

    def hidden_states(self, in_idx, *, decode=False, attention_mask=None):
        return self.inner.hidden_states(in_idx, decode=decode, attention_mask=attention_mask)

    def logits(self, x):
        return self.inner.logits(x)

    def init_cache(self, batch_size, max_length=None, dtype=None):
        self.inner.init_cache(batch_size, max_length, dtype)

    def clear_cache(self):
        self.inner.clear_cache()


def test_generate_takes_any_model_meeting_its_protocol(pair):
    """``generate`` reads a model through ``CausalLM`` only: a model of another class gives the
    book's tokens (cached steps and a cropped window, a left-padded batch); an object without
    the protocol is refused naming it."""
    twin, model = pair
    other = _Wrapped(model)
    assert isinstance(other, models.generation.CausalLM) and not isinstance(other, models.GPTModel)
    expected = _book(book_gpt.generate_text_simple, twin, PROMPTS[:, :5], 14, 16)
    np.testing.assert_array_equal(models.generate(other, PROMPTS[:, :5], 14, 16), expected)
    padded = np.asarray([[0, 0, *PROMPTS[0, :3]], list(PROMPTS[1, :5])])
    mask = (np.arange(5) >= [[2], [0]]).astype(np.int32)
    np.testing.assert_array_equal(
        models.generate(other, padded, 4, 16, attention_mask=mask),
        models.generate(model, padded, 4, 16, attention_mask=mask),
    )
    with pytest.raises(
        TypeError, match=r"^model \(Linear\) must be a GPTModel or another .*CausalLM"
    ):
        models.generate(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), PROMPTS[:, :5], 2, 16)


class _GraphOnly(_Wrapped, pytree=False):
    """``_Wrapped`` declared ``pytree=False``: JAX cannot flatten it, nnx's graph can."""


class _HeldTwice(_Wrapped):
    """``_Wrapped`` holding its model twice: flattened as a pytree it would come back as two."""

    def __init__(self, inner):
        super().__init__(inner)
        self.again = inner


def _graph_walks(call) -> int:
    """How many of nnx's graph traversals (``nnx.split``'s flatten, ``nnx.iter_graph``) ``call()``
    starts."""
    started = 0

    def profile(frame, event, arg):
        nonlocal started
        code = frame.f_code
        if event == "call" and code.co_name in ("flatten", "iter_graph"):
            started += code.co_filename.endswith(os.path.join("nnx", "graphlib.py"))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return started


def test_generate_hands_jit_a_plain_model_whole_and_splits_any_other_with_nnx(pair):
    """A model JAX flattens (every ``nnx.Module`` unless declared ``pytree=False``) goes into
    ``generate``'s jit as it is: once compiled, a call walks no nnx graph (``nnx.split`` took 16
    of a call's 50 ms of Python on GPT-2 small, ``docs/performance.md``). One JAX cannot flatten,
    or that holds a module twice (two copies as a pytree), goes through ``nnx.split``. The
    tokens are the book's either way."""
    from flax_attention._graph import walk

    twin, model = pair
    expected = _book(book_gpt.generate_text_simple, twin, PROMPTS[:, :5], 6, 16)
    run = {}
    for name, other in [("plain", _Wrapped(model)), ("pytree=False", _GraphOnly(model)),
                        ("held twice", _HeldTwice(model))]:  # fmt: skip

        def call(other=other):
            run["tokens"] = np.asarray(models.generate(other, PROMPTS[:, :5], 6, 16))

        call()  # compiles
        np.testing.assert_array_equal(run["tokens"], expected, err_msg=name)
        walks = _graph_walks(call)
        np.testing.assert_array_equal(run["tokens"], expected, err_msg=name)
        assert (walks == 0) == (name == "plain"), f"{name}: {walks} nnx graph walks a call"
        assert walk(other).tree == (name == "plain"), name
    # the walk finds nnx's variables, each once, past a node held twice or declared opaque
    variables = {id(x) for _, x in nnx.iter_graph(model) if isinstance(x, nnx.Variable)}
    for other in (model, _GraphOnly(model), _HeldTwice(model), _HeldTwice(_GraphOnly(model))):
        found = walk(other).variables
        assert len(found) == len(variables) and {id(x) for x in found} == variables


def test_a_decode_step_reads_its_key_cache_where_it_lies(pair):
    """``generate``'s decode loop holds no key cache laid out ``(d, s)``: a decode step's
    scores are ``keys @ query``, so XLA's CPU compiler has no reason to copy the whole cache
    transposed at every step, as it did for ``query @ keys.T`` (docs/performance.md, "The
    decode step's key cache, read where it lies")."""
    from flax_attention.models import generation

    _, model = pair
    ids = np.asarray(PROMPTS[:1, :5], np.int32)  # one row: a batch of 2 compiled otherwise
    plan = generation._Plan(6, 16, True, None, None, cached_steps=6)
    heads, head_dim = CFG["n_heads"], CFG["emb_dim"] // CFG["n_heads"]
    slots = ids.shape[1] + plan.cached_steps - 1
    model.init_cache(1, slots)
    try:
        program = generation._generate.lower(
            generation._argument(model), ids, None, jax.random.key(0), np.float32(1), plan=plan
        ).compile().as_text()  # fmt: skip
    finally:
        model.clear_cache()
    cache = f"f32[1,{heads},{slots},{head_dim}]"  # as it lies: (b, h, s, d)
    turned = f"f32[1,{heads},{head_dim},{slots}]"
    assert cache in program, "the test's cache shape is not the program's"
    # (the prompt's step, before the loop, may lay its keys out so: once a call, not a step)
    in_loop = [line for line in program.splitlines() if turned in line and "while/body" in line]
    assert not in_loop, in_loop[:3]


def test_a_tiny_temperature_is_greedy_and_a_huge_one_draws_anew_each_step(pair):
    """``logits / temperature``: at 1e-4 sampling is argmax (a multiplied temperature would draw
    nearly uniformly); at 1e6 nearly uniform, and each step its own key (one key for every
    step would draw the same token each time, its Gumbel noise being the same)."""
    twin, model = pair
    prompt = PROMPTS[:1, :5]
    for window in (16, 6):  # the cached loop, then the cropped window
        greedy = _book(book_gpt.generate, twin, prompt, 10, window)
        cold = models.generate(model, prompt, 10, window, temperature=1e-4, key=jax.random.key(3))
        np.testing.assert_array_equal(cold, greedy, err_msg=f"context_size {window}")
        hot = np.asarray(models.generate(model, prompt, 10, window, temperature=1e6,
                                         key=jax.random.key(3)))  # fmt: skip
        distinct = len(set(hot[0, 5:].tolist()))
        assert distinct >= 7, f"context_size {window}: {distinct} distinct tokens of 10 at 1e6"


def test_greedy_choice_is_argmax_with_its_ties_nan_and_infinities():
    """generate's greedy pick (two plain reductions, faster on CPU than XLA's argmax) gives
    ``jnp.argmax``'s index: the first maximum, the first NaN of a row holding one."""
    from flax_attention.models.generation import _argmax

    rows = np.random.default_rng(0).standard_normal((6, 50257)).astype(np.float32)
    rows[1, [7, 300, 50000]] = 9.0  # a tie: the first
    rows[2, [11, 40000]] = np.nan  # NaN wins, the first of them
    rows[2, 5] = np.inf
    rows[3] = -np.inf  # all -inf: index 0
    rows[4, 50256] = np.inf  # the last column
    rows[5, :] = 0.0  # all equal: index 0
    for logits in (rows, rows[:1], rows.reshape(2, 3, -1)):
        expected = np.asarray(jax.numpy.argmax(logits, axis=-1))
        got = np.asarray(jax.jit(_argmax)(logits))
        np.testing.assert_array_equal(got, expected)
        assert got.dtype == np.int32


# ---- training as chapter 5 ----------------------------------------------------------------------


def _flax_trainer(weights):
    model = _flax(weights)
    model.train()
    return model, nnx.Optimizer(model, ADAMW, wrt=nnx.Param)


@pytest.fixture(scope="module")
def trained(weights, batches):
    """``STEPS`` steps on each side from the same weights: ``(torch losses, torch parameters,
    flax losses, flax parameters)``."""
    twin = _twin(seed=5)
    twin.load_state_dict(_torch(weights), strict=True)
    optimizer = torch.optim.AdamW(twin.parameters(), lr=4e-4, weight_decay=0.1)
    torch_batches = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches]
    torch_losses = book_gpt.train_steps(twin, optimizer, torch_batches)
    model, flax_optimizer = _flax_trainer(weights)
    flax_losses = [float(models.train_step(model, flax_optimizer, x, y)) for x, y in batches]
    torch_params = {name: p.detach().numpy().copy() for name, p in twin.named_parameters()}
    return torch_losses, torch_params, flax_losses, _params(model)


def test_adamw_training_equals_the_books_loop(trained, weights):
    torch_losses, torch_params, flax_losses, flax_params = trained
    assert len(flax_losses) == len(torch_losses) == STEPS
    loss_error = max(_error(f, t) for f, t in zip(flax_losses, torch_losses))
    errors = {name: _error(flax_params[name], value) for name, value in torch_params.items()}
    worst = max(errors, key=errors.get)
    print(
        f"{STEPS} steps: worst loss {loss_error:.2e}, worst parameter {worst} {errors[worst]:.2e}"
    )
    assert set(flax_params) == set(torch_params)
    assert loss_error <= TRAIN_TOL, f"losses: {loss_error:.2e} > {TRAIN_TOL}"
    assert errors[worst] <= TRAIN_TOL, f"{worst}: {errors[worst]:.2e} > {TRAIN_TOL}"
    first, last = np.mean(torch_losses[:EPOCH]), np.mean(torch_losses[-EPOCH:])
    assert last < first - 0.1, f"the loss did not fall ({first:.3f} -> {last:.3f}): a weak check"
    moved = _error(torch_params["out_head.weight"], weights["out_head.weight"])
    assert moved > 100 * TRAIN_TOL, f"training moved the head by only {moved:.2e}"


@pytest.mark.quick
def test_train_step_updates_in_place(weights, batches):
    """The step donates the model's and the optimiser's arrays (torch's in-place
    ``optimizer.step()``): the old ones are deleted, the new ones hold the step's result, and a
    copy taken before the step survives it."""
    model, optimizer = _flax_trainer(weights)
    old_table = model.tok_emb.embedding[...]
    old_moment = jax.tree.leaves(nnx.state(optimizer, nnx.OptState))[-1]
    kept = np.array(jnp.copy(old_table))
    x, y = batches[0]
    loss = float(models.train_step(model, optimizer, x, y))
    assert old_table.is_deleted() and old_moment.is_deleted()
    new_table = np.asarray(model.tok_emb.embedding[...])
    assert np.isfinite(loss) and np.array_equal(kept, weights["tok_emb.weight"])
    assert 0 < np.abs(new_table - kept).max() < 1e-2  # one AdamW step of lr 4e-4 moved it


def test_orbax_checkpoint_mid_run_resumes_bit_for_bit(tmp_path, trained, weights, batches):
    half = STEPS // 2
    model, optimizer = _flax_trainer(weights)
    for x, y in batches[:half]:
        models.train_step(model, optimizer, x, y)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "model", nnx.state(model))
        checkpointer.save(tmp_path / "optimizer", nnx.state(optimizer))
        checkpointer.wait_until_finished()

        fresh = _flax(_numpy(_twin(seed=1).state_dict()))  # other weights until restored
        fresh.train()
        fresh_optimizer = nnx.Optimizer(fresh, ADAMW, wrt=nnx.Param)
        assert not np.array_equal(_params(fresh)["tok_emb.weight"], weights["tok_emb.weight"])
        for target, name in ((fresh, "model"), (fresh_optimizer, "optimizer")):
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(target))
            nnx.update(target, checkpointer.restore(tmp_path / name, abstract))
    for x, y in batches[half:]:
        models.train_step(fresh, fresh_optimizer, x, y)
    resumed, uninterrupted = _params(fresh), trained[3]
    assert set(resumed) == set(uninterrupted)
    for key, value in uninterrupted.items():
        assert np.array_equal(resumed[key], value), f"{key} differs after resuming"


def test_evaluation_equals_the_books_and_leaves_train_mode(weights, batches):
    cfg = {**CFG, "drop_rate": 0.1}  # eval mode matters: dropout must be off while evaluating
    twin = _twin(cfg, seed=5)
    twin.load_state_dict(_torch(weights), strict=True)
    model = _flax(weights, cfg)
    model.train()
    train_part, val_part = batches[:3], batches[3:5]
    torch_train = [tuple(map(torch.from_numpy, b)) for b in train_part]
    torch_val = [tuple(map(torch.from_numpy, b)) for b in val_part]
    expected = book_gpt.evaluate_model(twin, torch_train, torch_val, eval_iter=2)
    got = models.evaluate_model(model, train_part, val_part, eval_iter=2)
    for name, g, e in zip(("train", "val"), got, expected):
        assert abs(g - e) <= TOL * max(1.0, abs(e)), f"{name} loss {g} != {e}"
    assert twin.training and _dropouts_deterministic(model) == [False] * 5  # drop_emb, 2 per block

    model.eval()
    twin.eval()
    with torch.no_grad():
        whole = book_gpt.calc_loss_loader(torch_train, twin)
    assert abs(models.calc_loss_loader(train_part, model) - whole) <= TOL * max(1.0, whole)
    assert np.isnan(models.calc_loss_loader([], model)) and np.isnan(
        book_gpt.calc_loss_loader([], twin)
    )


def test_calc_loss_loader_averages_the_batches_it_has_and_reads_only_those(weights, batches):
    """``num_batches`` above the loader's length averages what there is, as the book's
    ``min(num_batches, len(data_loader))``; an endless loader gives ``num_batches`` of it."""
    model, twin = _flax(weights), _twin().eval()
    part = batches[:3]
    with torch.no_grad():
        expected = book_gpt.calc_loss_loader([tuple(map(torch.from_numpy, b)) for b in part],
                                             twin, num_batches=5)  # fmt: skip
    got = models.calc_loss_loader(part, model, num_batches=5)
    assert abs(got - expected) <= TOL * max(1.0, expected), f"{got} != {expected}"
    read = []

    def endless():  # refuses to be drained: a list() of it raises instead of never returning
        for batch in itertools.cycle(part):
            if len(read) == 10:
                raise AssertionError("calc_loss_loader drains the loader")
            read.append(batch)
            yield batch

    got = models.calc_loss_loader(endless(), model, num_batches=2)
    assert len(read) == 2, f"calc_loss_loader read {len(read)} batches for num_batches=2"
    assert got == pytest.approx(models.calc_loss_loader(part[:2], model), rel=1e-6)
    with pytest.raises(ValueError, match=r"num_batches \(0\) must be >= 1"):
        models.calc_loss_loader(part, model, num_batches=0)
    with pytest.raises(TypeError, match=r"num_batches \(2.0\) must be an int"):
        models.calc_loss_loader(part, model, num_batches=2.0)


def test_a_block_in_train_mode_with_its_branches_zeroed_is_the_identity(weights):
    """Dropout 0.5 in train mode on each branch, before its shortcut is added: with the
    attention's and the MLP's output projections zeroed, each block passes ``x`` through
    unchanged, as in eval mode (a dropout after the add would zero and scale ``x``)."""
    model = _flax(weights, {**CFG, "drop_rate": 0.5})
    block = model.trf_blocks[0]
    for linear in (block.att.out_proj, block.ff.layers[2]):
        linear.kernel[...] = jnp.zeros_like(linear.kernel[...])
        linear.bias[...] = jnp.zeros_like(linear.bias[...])
    x = jax.random.normal(jax.random.key(0), (BATCH, TOKENS, CFG["emb_dim"]))
    block.train()
    np.testing.assert_array_equal(block(x), x)
    block.eval()
    np.testing.assert_array_equal(block(x), x)


def test_the_model_asks_its_blocks_for_their_caches_through_the_blocks_methods(
    weights, monkeypatch
):
    """``GPTModel`` reaches its decode caches through each ``TransformerBlock``'s own methods
    (``init_cache``, ``clear_cache``, ``cached_length``, ``cache_capacity``), never through the
    block's attention: each is called on the block, and the block answers for its attention's
    cache. A cached decode of a left-padded batch still equals the full pass."""
    model = _flax(weights)
    calls = []
    for name in ("init_cache", "clear_cache", "cached_length", "cache_capacity"):
        method = getattr(models.TransformerBlock, name)

        def spy(block, *args, _method=method, _name=name):
            calls.append(_name)
            return _method(block, *args)

        monkeypatch.setattr(models.TransformerBlock, name, spy)
    ids = jnp.asarray(np.random.default_rng(5).integers(0, CFG["vocab_size"], (BATCH, 6)))
    mask = jnp.ones((BATCH, 6), jnp.int32).at[1, :2].set(0)  # row 1: two tokens of padding
    full = model(ids, attention_mask=mask)  # (b, 6, V)
    model.init_cache(BATCH, 6)
    assert [block.cache_capacity() for block in model.trf_blocks] == [6, 6]
    prefill = model(ids[:, :4], decode=True, attention_mask=mask)
    last = model(ids[:, 4:], decode=True, attention_mask=mask)
    assert [int(block.cached_length()) for block in model.trf_blocks] == [6, 6]
    error = _error(jnp.concatenate([prefill, last], axis=1)[:, 2:], full[:, 2:])  # the tokens
    assert error <= TOL, f"cached decode vs the full pass: {error:.2e}"
    model.clear_cache()
    assert all(block.att.cached_key is None for block in model.trf_blocks)
    assert {"init_cache", "clear_cache", "cached_length", "cache_capacity"} <= set(calls)
    assert calls.count("init_cache") == calls.count("clear_cache") == CFG["n_layers"]


def test_dropout_trains_with_a_finite_loss_other_than_eval_mode(weights, batches):
    model = _flax(weights, {**CFG, "drop_rate": 0.1})
    optimizer = nnx.Optimizer(model, ADAMW, wrt=nnx.Param)
    inputs, targets = batches[0]
    model.eval()
    eval_loss = models.calc_loss_loader([(inputs, targets)], model)  # as evaluate_model runs it
    model.train()
    train_loss = float(models.train_step(model, optimizer, inputs, targets))
    assert np.isfinite(train_loss) and np.isfinite(eval_loss)
    assert abs(train_loss - eval_loss) > 1e-3, f"dropout changed nothing: {train_loss}"
    assert _dropouts_deterministic(model) == [False] * 5
    moved = _params(model)["out_head.weight"]
    assert not np.array_equal(moved, weights["out_head.weight"]), "the step changed nothing"


@pytest.mark.quick
def test_a_load_keeps_each_parameters_placement(weights):
    """Parameters drawn eagerly are not committed to a device; a load that committed them
    (while a fresh optimiser's moments are not) gave ``train_step`` other argument placements
    on its first call than on the next ones, all committed, and so a second compilation."""
    layer = fa.MultiHeadAttention(32, 32, 16, 0.0, 2, rngs=nnx.Rngs(0))  # block 0's attention
    device = jax.devices()[0]
    layer.out_proj.bias[...] = jax.device_put(layer.out_proj.bias[...], device)  # committed

    def placements():
        return {k: v[...].committed for k, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}

    before = placements()
    assert sorted(before.values()) == [False, False, False, False, True]
    fa.load_state_dict(layer, weights, prefix="trf_blocks.0.att.")
    assert placements() == before
    np.testing.assert_array_equal(
        layer.W_query.kernel[...], weights["trf_blocks.0.att.W_query.weight"].T
    )


# ---- bad inputs ---------------------------------------------------------------------------------


@pytest.mark.quick
def test_bad_config_is_refused_by_name():
    with pytest.raises(ValueError, match="cfg key 'dropout'"):
        models.GPTModel({**CFG, "dropout": 0.1}, rngs=nnx.Rngs(0))
    missing = {k: v for k, v in CFG.items() if k != "n_layers"}
    with pytest.raises(ValueError, match="cfg must have key 'n_layers'"):
        models.GPTModel(missing, rngs=nnx.Rngs(0))
    # a wrong type is a TypeError, a wrong value a ValueError, as for every argument
    for key, value, error, text in [
        ("emb_dim", 1.5, TypeError, r"cfg\['emb_dim'\] \(1.5\) must be an int \(a positive"),
        ("n_layers", True, TypeError, r"cfg\['n_layers'\] \(True\) must be an int"),
        ("n_heads", 0, ValueError, r"cfg\['n_heads'\] \(0\) must be positive \(an integer >= 1"),
        (
            "drop_rate",
            "0.1",
            TypeError,
            r"cfg\['drop_rate'\] \('0.1'\) must be a float \(a rate in \[0, 1\)\)",
        ),
        (
            "drop_rate",
            1.0,
            ValueError,
            r"cfg\['drop_rate'\] \(1.0\) must be in \[0, 1\) \(the probability of zeroing\)",
        ),
    ]:
        with pytest.raises(error, match=text):
            models.GPTModel({**CFG, key: value}, rngs=nnx.Rngs(0))


@pytest.mark.quick
@pytest.mark.parametrize(
    "options, named",
    [
        ({"param_dtype": jnp.int32}, "param_dtype (int32) must be a floating dtype (jnp.float32"),
        ({"param_dtype": "bogus"}, "param_dtype ('bogus') must be a floating dtype (jnp.float32"),
        ({"dtype": jnp.int32}, "dtype (int32) must be None or a floating dtype (jnp.float32"),
    ],
    ids=["int_param_dtype", "not_a_dtype", "int_dtype"],
)
def test_a_dtype_that_is_not_floating_is_refused_by_name(options, named):
    """Before any parameter is drawn (JAX's initialisers would name neither argument; an
    integer ``dtype`` would fail only at the first call, inside the attention)."""
    with pytest.raises(TypeError) as caught:
        models.GPTModel(CFG, rngs=nnx.Rngs(0), **options)
    assert str(caught.value).startswith(named), str(caught.value)


def test_the_books_names_loaded_as_gpt2_name_the_layout_and_load_nothing(weights):
    """The converse of ``test_gpt2``'s Hugging Face names offered to the default layout."""
    model = _flax(weights)
    other = _numpy(_twin(seed=1).state_dict())
    with pytest.raises(ValueError) as caught:
        fa.load_state_dict(model, other, layout="gpt2")
    lines = [line.strip() for line in str(caught.value).splitlines()]
    n = len(other)  # every key, the causal masks included
    assert lines[1] == (
        f"layout ('gpt2') must be 'documents' for these keys: {n} of the {n} are that layout's "
        "names (the documents (torch_reference)), 0 are 'gpt2' names; pass layout='documents'"
    ), lines[1]
    assert "unexpected key tok_emb.weight" in lines and "missing key wte.weight" in lines, lines
    assert lines[0].endswith(f"found {len(lines) - 2} problem(s); nothing was loaded:"), lines[0]
    for key, value in _params(model).items():
        np.testing.assert_array_equal(value, weights[key], err_msg=f"{key} changed")


@pytest.mark.quick
def test_read_pth_names_a_missing_file_and_a_pickled_module(tmp_path):
    """``torch.save(model)`` (the module, not its ``state_dict()``) and a missing file: each
    message names ``path``, what ``read_pth`` reads, and what the file held."""
    expected = (
        "a state dict saved with torch.save(model.state_dict(), path), or the book's "
        'checkpoint dict {"model_state_dict": ..., ...}'
    )
    missing = tmp_path / "missing.pth"
    with pytest.raises(FileNotFoundError) as caught:
        models.read_pth(missing)
    assert str(caught.value) == f"path ({str(missing)!r}) must be a file (no such file): {expected}"
    whole = tmp_path / "whole.pth"
    torch.save(_twin(), whole)
    with pytest.raises(ValueError) as caught:
        models.read_pth(whole)
    assert str(caught.value).startswith(
        f"path ({str(whole)!r}) must hold {expected}, not a pickled GPTModel object "
        "(conformance_tests.book_gpt.GPTModel): torch.save(model) pickles the module itself"
    ), str(caught.value)
    assert 'Save its state dict instead: torch.save(model.state_dict(), "model.pth")' in str(
        caught.value
    )
    mixed = tmp_path / "mixed.pth"
    torch.save({"tok_emb.weight": torch.zeros(2), "epoch": 3}, mixed)
    with pytest.raises(ValueError, match=r"holds non-tensors \{'epoch': 'int'\}"):
        models.read_pth(mixed)


def _assert_refused_and_unchanged(model, state_dict, *named):
    before = _params(model)
    with pytest.raises(ValueError) as caught:
        fa.load_state_dict(model, state_dict)
    message = str(caught.value)
    for text in named:
        assert text in message, f"{text!r} not in: {message}"
    after = _params(model)
    assert set(after) == set(before)
    for key, value in before.items():
        np.testing.assert_array_equal(after[key], value, err_msg=f"{key} changed")


def test_state_dict_of_another_size_changes_nothing(weights):
    model = _flax(weights)
    bigger = _numpy(_twin({**CFG, "emb_dim": 48}).state_dict())
    _assert_refused_and_unchanged(
        model, bigger, "tok_emb.weight: shape (97, 48) must be (97, 32)", "nothing was loaded"
    )
    # one wrong tensor among valid, different ones: none of them is written
    mixed = {**_numpy(_twin(seed=1).state_dict())}
    mixed["trf_blocks.1.ff.layers.0.weight"] = bigger["trf_blocks.1.ff.layers.0.weight"]
    _assert_refused_and_unchanged(
        model, mixed, "trf_blocks.1.ff.layers.0.weight: shape (192, 48) must be (128, 32)"
    )


@pytest.mark.quick
def test_wrong_causal_mask_buffer_changes_nothing(weights):
    model = _flax(weights)
    other = _numpy(_twin(seed=1).state_dict())
    other["trf_blocks.1.att.mask"] = np.tril(np.ones((16, 16), np.float32))  # not triu(1)
    _assert_refused_and_unchanged(
        model, other, "trf_blocks.1.att.mask: differs from triu(ones(16, 16), diagonal=1)"
    )


@pytest.mark.quick
@pytest.mark.parametrize(
    "idx, kwargs, error, named",
    [
        ([[1, 97, 3]], {}, ValueError, r"idx \(ids 1\.\.97\) must lie in 0\.\.96"),
        ([[-1, 2, 3]], {}, ValueError, r"idx \(ids -1\.\.3\)"),
        ([[1, 2, 3]], {"top_k": 0}, ValueError, r"top_k \(0\) must be >= 1"),
        ([[1, 2, 3]], {"top_k": 98}, ValueError, r"top_k \(98\) must be in 1\.\.vocab_size"),
        ([[1, 2, 3]], {"context_size": 17}, ValueError, r"context_size \(17\) must not exceed"),
        ([[1, 2, 3]], {"temperature": 0.7}, ValueError, r"key \(None\) must be a jax\.random"),
        ([[1, 2], [3, 4]], {"eos_id": 5}, ValueError, r"eos_id \(5\) needs a batch of one row"),
        ([[1, 2, 3]], {"top_k": 2.0}, TypeError, r"top_k \(2\.0\) must be an int"),
        (
            [[1, 2, 3]],
            {"temperature": 0.7, "key": 0},
            TypeError,
            r"key \(0: int\) must be a jax\.random\.key: pass key=jax\.random\.key\(seed\)",
        ),
        ([[1, 2, 3]], {"prompt_bucket": 0}, ValueError, r"prompt_bucket \(0\) must be >= 1"),
    ],
    ids=[
        "id_above_vocab",
        "negative_id",
        "top_k_0",
        "top_k_above_vocab",
        "context_size",
        "no_key",
        "eos_batch",
        "top_k_float",
        "int_key",
        "prompt_bucket_0",
    ],
)
def test_bad_generate_arguments_are_refused_by_name(pair, idx, kwargs, error, named):
    _, model = pair
    kwargs = {"context_size": 8, **kwargs}
    with pytest.raises(error, match=named):
        models.generate(model, idx, 4, **kwargs)


@pytest.mark.quick
def test_gelu_keeps_its_negative_tail_in_float32():
    """The book's tanh GELU, in float32, within a few ulp of the same formula in float64 where
    ``1 + tanh`` cancels (x in (-4, -1)) and from -1 up: the tanh form on XLA's CPU ``tanh`` was
    63000 ulp off in that tail (torch's 8100), which Adam carried into a parity run's steps.
    Below -4 the values are under 1e-4 and within 1e-10 of exact."""
    x = np.linspace(-10, 10, 40001, dtype=np.float32)
    x64 = x.astype(np.float64)
    exact = 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64**3)))
    ours = np.asarray(jax.jit(models.GELU())(jnp.asarray(x)), np.float64)
    theirs = torch.nn.functional.gelu(torch.from_numpy(x), approximate="tanh").double().numpy()
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    error = np.abs(ours - exact)
    tail, rest = (x > -4) & (x < -1), x >= -1
    assert np.max(error[tail] / ulp[tail]) <= 32
    assert np.max(error[rest] / ulp[rest]) <= 4
    assert np.max(error[x <= -4]) <= 1e-10
    assert np.max(np.abs(theirs - exact)[tail] / ulp[tail]) > 1000  # torch's own cancels there
