"""``flax_attention.models.lora`` (the book's appendix E) against the book's own LoRA code,
``conformance_tests/book_lora.py``, on the book's model twin (``conformance_tests/book_gpt.py``).

One small model (vocabulary 97, 16 positions, d 32, 2 heads, 2 layers, biased projections) is
drawn by torch, frozen and wrapped by the book's ``replace_linear_with_lora``; the Flax model gets
the same weights through the weight bridge. Compared: the initial draw of ``A`` and the update's
scale, which layers are wrapped (every key of the book's state dict), logits, state dicts both
ways, 12 steps of AdamW as appendix E sets it (lr 8e-4, weight decay 0.1, LoRA matrices only)
with chapter 5's loop, the trained models, the book's LoRA checkpoint read from a ``.pth``,
``merge_lora`` against the unmerged model and the book's plain model, and the errors bad
arguments and bad state dicts raise.
"""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import optax
import pytest
import torch
from flax import nnx

import flax_attention as fa
from conformance_tests import book_gpt, book_lora
from conformance_tests.tests.helpers import assert_untouched, error_templates, snapshot
from conformance_tests.tolerances import TOLERANCES
from flax_attention import models
from flax_attention.models import lora

CFG = {
    "vocab_size": 97,
    "context_length": 16,
    "emb_dim": 32,
    "n_heads": 2,
    "n_layers": 2,
    "drop_rate": 0.0,
    "qkv_bias": True,  # every wrapped layer has a bias under ``linear``
}
#: ``alpha != rank``: an update scaled by ``alpha`` alone (the printed chapter) is 2x off.
RANK, ALPHA = 4, 8
#: Forward float32 parity (``max_abs_err <= tol * max(1, max|reference|)``).
TOL = TOLERANCES[("float32", "forward")]
#: Training parity, parameters and per-step losses: the spec's float32 ``train`` entry (1e-5).
TRAIN_TOL = TOLERANCES[("float32", "train")]
STEPS, EPOCH, BATCH, TOKENS = 12, 3, 2, 16
#: Appendix E's optimiser: ``torch.optim.AdamW(model.parameters(), lr=8e-4, weight_decay=0.1)``
#: on a model whose only parameters with ``requires_grad`` are the LoRA matrices.
ADAMW = optax.adamw(8e-4, weight_decay=0.1)
#: The layers the book's recursion wraps in this model: per block W_query, W_key, W_value,
#: out_proj and ff.layers 0 and 2, then out_head.
WRAPPED = 6 * CFG["n_layers"] + 1


def _numpy(state_dict) -> dict[str, np.ndarray]:
    return {key: value.detach().numpy().copy() for key, value in state_dict.items()}


def _torch(state_dict) -> dict[str, torch.Tensor]:
    return {key: torch.from_numpy(np.array(value)) for key, value in state_dict.items()}


def _error(got, reference) -> float:
    """``max_abs_err / max(1, max|reference|)``: what a tolerance is compared with."""
    got, reference = np.asarray(got, np.float64), np.asarray(reference, np.float64)
    return float(np.abs(got - reference).max() / max(1.0, np.abs(reference).max()))


def _params(model) -> dict[str, np.ndarray]:
    return {k: v for k, v in fa.state_dict(model).items() if not k.endswith(".mask")}


def _book_lora_twin(base: dict, head: int | None = None, seed: int = 123):
    """Appendix E's steps on the book's twin: the base weights, (a new ``out_head`` of ``head``
    classes,) ``requires_grad = False`` everywhere, then ``replace_linear_with_lora``."""
    twin = book_gpt.GPTModel(CFG)
    twin.load_state_dict(_torch(base), strict=True)
    torch.manual_seed(seed)
    if head is not None:
        twin.out_head = torch.nn.Linear(CFG["emb_dim"], head)
    book_lora.freeze(twin)
    book_lora.replace_linear_with_lora(twin, rank=RANK, alpha=ALPHA)
    return twin


def _flax_lora(head: int | None = None, seed: int = 1):
    """The same steps in Flax, with parameters of its own draw (a load replaces them)."""
    model = models.GPTModel(CFG, rngs=nnx.Rngs(seed))
    if head is not None:
        model.out_head = nnx.Linear(CFG["emb_dim"], head, rngs=nnx.Rngs(seed))
    lora.replace_linear_with_lora(model, rank=RANK, alpha=ALPHA, rngs=nnx.Rngs(seed))
    return model


def _randomise_B(twin, seed=0):
    """Nonzero ``B`` everywhere, so that every update shows in the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in twin.named_parameters():
            if name.endswith("lora.B"):
                parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))


def _wrapped(model) -> list[str]:
    return [
        ".".join(map(str, path))
        for path, node in nnx.iter_graph(model)
        if isinstance(node, lora.LinearWithLoRA)
    ]


@pytest.fixture(scope="module")
def base():
    """The twin's plain weights (the "pretrained" model of appendix E), as NumPy."""
    torch.manual_seed(0)
    return _numpy(book_gpt.GPTModel(CFG).state_dict())


@pytest.fixture(scope="module")
def batches():
    """``STEPS`` batches (inputs, next-token targets), ``EPOCH`` distinct ones cycled."""
    data = np.random.default_rng(0).integers(0, CFG["vocab_size"], (EPOCH, BATCH, TOKENS + 1))
    return [(row[:, :-1], row[:, 1:]) for row in data] * (STEPS // EPOCH)


# ---- the layers ---------------------------------------------------------------------------------


def test_A_is_drawn_as_torchs_kaiming_uniform_and_B_starts_at_zero():
    """torch's fan-in of the ``(in_dim, rank)`` tensor ``A`` is ``rank``: both sides draw in
    ``+-1/sqrt(rank)`` (a Linear's rule, ``+-1/sqrt(in_dim)``, would be 4x narrower here)."""
    in_dim, out_dim, rank = 256, 24, 16
    bound = 1 / math.sqrt(rank)
    layer = lora.LoRALayer(in_dim, out_dim, rank, 16, rngs=nnx.Rngs(0))
    torch.manual_seed(0)
    book = book_lora.LoRALayer(in_dim, out_dim, rank, 16)
    assert isinstance(layer.A, nnx.LoRAParam) and isinstance(layer.B, nnx.LoRAParam)
    for name, A in (("flax", np.asarray(layer.A[...])), ("book", book.A.detach().numpy())):
        assert A.shape == (in_dim, rank), name
        assert 0.98 * bound < np.abs(A).max() <= bound, f"{name}: max |A| {np.abs(A).max()}"
        assert abs(np.abs(A).mean() - bound / 2) < 0.03 * bound, f"{name}: not uniform"
    np.testing.assert_array_equal(layer.B[...], np.zeros((rank, out_dim), np.float32))


def test_the_update_is_scaled_by_alpha_over_rank_and_starts_at_nothing():
    torch.manual_seed(0)
    book = book_lora.LinearWithLoRA(torch.nn.Linear(16, 8), RANK, ALPHA)
    layer = lora.LinearWithLoRA(nnx.Linear(16, 8, rngs=nnx.Rngs(0)), RANK, ALPHA, rngs=nnx.Rngs(0))
    x = np.random.default_rng(0).standard_normal((3, 5, 16)).astype(np.float32)
    np.testing.assert_array_equal(layer(x), layer.linear(x))  # B = 0: nothing added
    assert (layer.in_features, layer.out_features) == (16, 8)
    with torch.no_grad():
        book.lora.B.copy_(torch.randn(RANK, 8))
    fa.load_state_dict(layer, _numpy(book.state_dict()))
    with torch.no_grad():
        expected = book(torch.from_numpy(x)).numpy()
        update = book.lora(torch.from_numpy(x)).numpy()
    assert _error(layer.lora(x), update) <= TOL
    assert _error(layer(x), expected) <= TOL
    assert np.abs(update).max() > 0.5, "a weak check: the update is too small to see its scale"


# ---- the model: which layers, which names -------------------------------------------------------


@pytest.mark.quick
def test_every_linear_is_wrapped_and_the_state_dict_has_the_books_keys(base):
    """Appendix E's model: a new 2-class ``out_head`` (biased), then LoRA everywhere; the same
    keys as the book's ``state_dict()``, in both directions, and the same trainable count."""
    twin = _book_lora_twin(base, head=2)
    model = _flax_lora(head=2)
    assert len(_wrapped(model)) == WRAPPED, _wrapped(model)
    exported = fa.state_dict(model)
    assert set(exported) == set(twin.state_dict())
    for key in ("trf_blocks.1.att.W_query.lora.A", "out_head.linear.bias", "out_head.lora.B"):
        assert key in exported, key
    trainable = sum(p.numel() for p in twin.parameters() if p.requires_grad)
    lora_state = nnx.state(model, nnx.LoRAParam)
    assert sum(v[...].size for _, v in nnx.to_flat_state(lora_state)) == trainable


def test_the_books_lora_state_dict_loads_and_saves_both_ways(base):
    twin = _book_lora_twin(base, head=2)
    _randomise_B(twin)
    model = _flax_lora(head=2)
    fa.load_state_dict(model, _numpy(twin.state_dict()))
    inputs = np.random.default_rng(1).integers(0, CFG["vocab_size"], (BATCH, TOKENS))
    with torch.no_grad():
        expected = twin(torch.from_numpy(inputs)).numpy()  # (b, t, 2)
    error = _error(model(inputs), expected)
    assert error <= TOL, f"logits: {error:.2e} > {TOL}"

    other = _book_lora_twin(base, head=2, seed=7)
    other.load_state_dict(_torch(fa.state_dict(model)), strict=True)
    for key, value in twin.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), f"{key} changed in the round trip"


# ---- training as appendix E ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(base, batches):
    """``STEPS`` AdamW steps of chapter 5's loop on each side, from the same LoRA model:
    ``(torch twin, torch losses, flax model, flax losses, the LoRA model's initial weights)``."""
    twin = _book_lora_twin(base)
    initial = _numpy(twin.state_dict())
    optimizer = torch.optim.AdamW(twin.parameters(), lr=8e-4, weight_decay=0.1)
    torch_losses = book_gpt.train_steps(
        twin, optimizer, [tuple(map(torch.from_numpy, b)) for b in batches]
    )
    model = _flax_lora()
    fa.load_state_dict(model, initial)
    model.train()
    flax_optimizer = nnx.Optimizer(model, ADAMW, wrt=nnx.LoRAParam)
    flax_losses = [float(models.train_step(model, flax_optimizer, x, y)) for x, y in batches]
    model.eval()  # nnx's eval() returns None
    return twin.eval(), torch_losses, model, flax_losses, initial


def test_adamw_training_of_the_lora_matrices_equals_the_books(trained):
    twin, torch_losses, model, flax_losses, initial = trained
    torch_params = {name: p.detach().numpy() for name, p in twin.named_parameters()}
    flax_params = _params(model)
    assert set(flax_params) == set(torch_params) and len(flax_losses) == STEPS
    loss_error = max(_error(f, t) for f, t in zip(flax_losses, torch_losses, strict=True))
    errors = {name: _error(flax_params[name], value) for name, value in torch_params.items()}
    worst = max(errors, key=errors.get)
    print(
        f"\n{STEPS} LoRA steps: worst loss {loss_error:.2e}, worst parameter {worst} "
        f"{errors[worst]:.2e}"
    )
    assert loss_error <= TRAIN_TOL, f"losses: {loss_error:.2e} > {TRAIN_TOL}"
    assert errors[worst] <= TRAIN_TOL, f"{worst}: {errors[worst]:.2e} > {TRAIN_TOL}"
    for name, value in flax_params.items():  # the base is frozen on both sides, bit for bit
        moved = ".lora." in name
        assert moved != np.array_equal(value, initial[name]), f"{name}: moved={not moved}"
        assert moved != np.array_equal(torch_params[name], initial[name]), f"book {name}"
    assert np.mean(torch_losses[-EPOCH:]) < np.mean(torch_losses[:EPOCH]) - 0.02, torch_losses


def test_the_trained_model_and_the_books_lora_checkpoint_equal_the_book(trained, tmp_path):
    twin, _, model, _, _ = trained
    inputs = np.random.default_rng(3).integers(0, CFG["vocab_size"], (BATCH, TOKENS))
    with torch.no_grad():
        expected = twin(torch.from_numpy(inputs)).numpy()
    error = _error(model(inputs), expected)
    assert error <= TRAIN_TOL, f"trained logits: {error:.2e} > {TRAIN_TOL}"

    torch.save(twin.state_dict(), tmp_path / "lora.pth")  # the book's checkpoint
    read = models.read_pth(tmp_path / "lora.pth")
    loaded = _flax_lora(seed=2)
    fa.load_state_dict(loaded, read)
    for key, value in twin.state_dict().items():
        np.testing.assert_array_equal(fa.state_dict(loaded)[key], value.numpy(), err_msg=key)
    error = _error(loaded(inputs), expected)
    lora_keys = sorted(k for k in read if ".lora." in k)
    print(f"\nread_pth: {len(read)} keys, {len(lora_keys)} LoRA ({lora_keys[0]}, ...)")
    print(f"the loaded checkpoint's logits against the book's: {error:.2e}")
    assert error <= TOL, f"logits of the loaded checkpoint: {error:.2e} > {TOL}"


@pytest.mark.quick
def test_merge_lora_equals_the_unmerged_model_and_the_books_plain_model(trained):
    twin, _, model, _, _ = trained
    merged = nnx.clone(model)
    lora.merge_lora(merged)
    assert _wrapped(merged) == [] and not nnx.to_flat_state(nnx.state(merged, nnx.LoRAParam))
    inputs = np.random.default_rng(4).integers(0, CFG["vocab_size"], (BATCH, TOKENS))
    error = _error(merged(inputs), model(inputs))
    assert error <= TOL, f"merged against unmerged: {error:.2e} > {TOL}"

    plain = book_gpt.GPTModel(CFG)  # the book's model without LoRA takes the merged weights
    plain.load_state_dict(_torch(fa.state_dict(merged)), strict=True)
    with torch.no_grad():
        error = _error(plain(torch.from_numpy(inputs)), twin(torch.from_numpy(inputs)))
    assert error <= TOL, f"the book's plain model with the merged weights: {error:.2e} > {TOL}"
    # W + (alpha / rank) A B, in torch's layout, for one layer
    sd, lora_sd = fa.state_dict(merged), _numpy(twin.state_dict())
    key = "trf_blocks.0.att.W_value."
    delta = ALPHA / RANK * (lora_sd[key + "lora.A"] @ lora_sd[key + "lora.B"]).T
    np.testing.assert_allclose(
        sd[key + "weight"], lora_sd[key + "linear.weight"] + delta, atol=1e-6
    )
    assert np.abs(delta).max() > 1e-4, "training left W_value's update at nothing"
    assert "transformer.h.0.attn.c_attn.weight" in fa.state_dict(merged, layout="gpt2")


def test_replace_twice_wraps_the_wrapped_layers_as_the_books_and_merges_from_the_inside():
    model = _flax_lora()
    before = model(np.arange(8)[None])
    lora.replace_linear_with_lora(model, rank=2, alpha=1, rngs=nnx.Rngs(3))
    assert "out_head.linear.lora.A" in fa.state_dict(model)
    lora.merge_lora(model)
    np.testing.assert_allclose(model(np.arange(8)[None]), before, atol=1e-6)  # every B was 0


# ---- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rank, alpha, error, message",
    [
        (0, 8, ValueError, "rank (0) must be positive (an integer >= 1)"),
        (2.0, 8, TypeError, "rank (2.0) must be an int (a positive integer)"),
        (True, 8, TypeError, "rank (True) must be an int (a positive integer)"),
        (
            4,
            "8",
            TypeError,
            "alpha ('8') must be a real number (the update's scale is alpha / rank)",
        ),
        (4, None, TypeError, "alpha (None) must be a real number"),
        (
            4,
            math.nan,
            ValueError,
            "alpha (nan) must be finite (the update's scale is alpha / rank)",
        ),
    ],
    ids=["rank_0", "rank_float", "rank_bool", "alpha_str", "alpha_none", "alpha_nan"],
)
def test_bad_rank_or_alpha_is_refused_by_name_and_replaces_nothing(rank, alpha, error, message):
    model = models.GPTModel(CFG, rngs=nnx.Rngs(0))
    keys = set(fa.state_dict(model))
    with pytest.raises(error) as caught:
        lora.replace_linear_with_lora(model, rank, alpha, rngs=nnx.Rngs(0))
    assert str(caught.value).startswith(message), str(caught.value)
    assert set(fa.state_dict(model)) == keys and not _wrapped(model)
    with pytest.raises(error) as caught:
        lora.LoRALayer(16, 16, rank, alpha, rngs=nnx.Rngs(0))
    assert str(caught.value).startswith(message), str(caught.value)


def test_bad_arguments_name_the_argument():
    linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    cases = [
        (
            lambda: lora.LinearWithLoRA("W", 2, 2, rngs=nnx.Rngs(0)),
            "linear (str) must be an nnx.Linear",
        ),
        (lambda: lora.LinearWithLoRA(linear, 2, 2, rngs=0), "rngs (int) must be an nnx.Rngs"),
        (
            lambda: lora.replace_linear_with_lora({}, 2, 2, rngs=nnx.Rngs(0)),
            "model (dict) must be an nnx.Module",
        ),
        (
            lambda: lora.merge_lora(lora.LinearWithLoRA(linear, 2, 2, rngs=nnx.Rngs(0))),
            "model (LinearWithLoRA) must hold its LoRA layers",
        ),
    ]
    for call, message in cases:
        with pytest.raises(TypeError) as caught:
            call()
        assert str(caught.value).startswith(message), str(caught.value)


@pytest.mark.quick
def test_a_lora_state_dict_of_another_rank_names_both_shapes_and_loads_nothing(base):
    twin = _book_lora_twin(base)
    other = book_gpt.GPTModel(CFG)
    book_lora.replace_linear_with_lora(other, rank=2 * RANK, alpha=ALPHA)
    model = _flax_lora()
    fa.load_state_dict(model, _numpy(twin.state_dict()))
    before = snapshot(model)
    with pytest.raises(ValueError) as caught:
        fa.load_state_dict(model, _numpy(other.state_dict()))
    lines = [line.strip() for line in str(caught.value).splitlines()]
    assert lines[0] == (
        f"load_state_dict into GPTModel (strict=True) found {2 * WRAPPED} problem(s); "
        "nothing was loaded:"
    ), lines[0]
    assert "trf_blocks.0.att.W_query.lora.A: shape (32, 8) must be (32, 4)" in lines, lines
    assert "out_head.lora.B: shape (8, 97) must be (4, 97)" in lines, lines
    assert_untouched(model, before, "a refused LoRA load")


@pytest.mark.quick
def test_lora_and_plain_state_dicts_meeting_the_other_model_say_so_and_load_nothing(base):
    plain = models.GPTModel(CFG, rngs=nnx.Rngs(0))
    lora_sd = _numpy(_book_lora_twin(base).state_dict())
    before = snapshot(plain)
    with pytest.raises(ValueError) as caught:
        fa.load_state_dict(plain, lora_sd)
    hint = str(caught.value).splitlines()[1].strip()
    assert hint.startswith(
        f"state_dict (a LoRA model's: {WRAPPED} keys such as trf_blocks.0.att.W_query.lora.A, "
        f"rank {RANK}) must be loaded into a model with LoRA layers (call "
        f"flax_attention.models.lora.replace_linear_with_lora(model, rank={RANK}, alpha=..."
    ), hint
    assert_untouched(plain, before, "a LoRA state dict into a plain model")

    model = _flax_lora()
    before = snapshot(model)
    with pytest.raises(ValueError) as caught:
        fa.load_state_dict(model, base)
    hint = str(caught.value).splitlines()[1].strip()
    assert hint.startswith("state_dict (a model's without LoRA: ") and hint.endswith(
        "must be loaded before replace_linear_with_lora (load the base weights, then add the "
        "LoRA layers)"
    ), hint
    assert_untouched(model, before, "a plain state dict into a LoRA model")

    with pytest.raises(ValueError) as caught:
        fa.state_dict(model, layout="gpt2")
    assert str(caught.value).startswith(
        f"layout ('gpt2') must be 'documents' for a module with LoRA layers ({2 * WRAPPED} LoRA "
        "matrices, such as "
    ), str(caught.value)


_ONLY_THE_PACKAGES = """
import numpy as np
from flax import nnx

import flax_attention as fa
from flax_attention import models  # noqa: F401 - as a user who builds a model has

layer = fa.MultiHeadAttention(8, 8, 4, 0.0, 2, rngs=nnx.Rngs(0))
offered = dict(fa.state_dict(layer))
offered["W_query.linear.weight"] = offered.pop("W_query.weight")
offered["W_query.lora.A"] = np.zeros((8, 2), np.float32)
offered["W_query.lora.B"] = np.zeros((2, 8), np.float32)
try:
    fa.load_state_dict(layer, offered)
except ValueError as error:
    print(str(error).splitlines()[1].strip())
"""


def test_the_lora_hint_needs_only_flax_attention_models_imported():
    """The weight bridge knows nothing of LoRA: appendix E's rules are ``LoRALayer``'s
    registered hooks (``layouts.Names.load_hint``), which ``import flax_attention.models``
    registers; a fresh interpreter that imports no more gives the hint."""
    result = subprocess.run(
        [sys.executable, "-c", _ONLY_THE_PACKAGES], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "state_dict (a LoRA model's: 1 keys such as W_query.lora.A, rank 2) must be loaded into "
        "a model with LoRA layers (call flax_attention.models.lora.replace_linear_with_lora(model, "
        "rank=2, alpha=..., rngs=...) first)"
    ), result.stdout


def test_every_lora_message_is_listed_in_docs_errors():
    """Each mistake on a small layer: its message (a refused load: each line) is a form of
    docs/errors.md's LoRA table (or of its table for loading weights), and every form there is
    raised here."""
    listed = error_templates("LoRA")
    loading = error_templates("Loading weights")
    linear = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    wrapped = lora.LinearWithLoRA(linear, 2, 2, rngs=nnx.Rngs(0))
    plain_layer = fa.MultiHeadAttention(8, 8, 4, 0.0, 2, rngs=nnx.Rngs(0))
    lora_layer = fa.MultiHeadAttention(8, 8, 4, 0.0, 2, rngs=nnx.Rngs(0))
    lora.replace_linear_with_lora(lora_layer, 2, 2, rngs=nnx.Rngs(0))
    rank_4 = lora.LinearWithLoRA(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), 4, 2, rngs=nnx.Rngs(0))
    calls = [
        lambda: lora.LoRALayer(8, 8, 1.5, 2, rngs=nnx.Rngs(0)),
        lambda: lora.LoRALayer(8, 8, 0, 2, rngs=nnx.Rngs(0)),
        lambda: lora.LoRALayer(8, 8, 2, "2", rngs=nnx.Rngs(0)),
        lambda: lora.LoRALayer(8, 8, 2, math.inf, rngs=nnx.Rngs(0)),
        lambda: lora.LinearWithLoRA(plain_layer, 2, 2, rngs=nnx.Rngs(0)),
        lambda: lora.LinearWithLoRA(linear, 2, 2, rngs=None),
        lambda: lora.replace_linear_with_lora([linear], 2, 2, rngs=nnx.Rngs(0)),
        lambda: lora.merge_lora(wrapped),
        lambda: fa.load_state_dict(wrapped, fa.state_dict(rank_4)),
        lambda: fa.load_state_dict(plain_layer, fa.state_dict(lora_layer)),
        lambda: fa.load_state_dict(lora_layer, fa.state_dict(plain_layer)),
        lambda: fa.state_dict(lora_layer, layout="gpt2"),
    ]
    used, unlisted = set(), []
    for call in calls:
        with pytest.raises((TypeError, ValueError)) as caught:
            call()
        lines = [line.strip() for line in str(caught.value).splitlines()]
        for line in lines if len(lines) == 1 else lines[1:]:
            found = [t for t in listed if t.match(line)]
            used.update(t.pattern for t in found)
            if not found and not any(t.match(line) for t in loading):
                unlisted.append(line)
    assert not unlisted, f"messages docs/errors.md does not list: {unlisted}"
    assert used == {t.pattern for t in listed}, {t.pattern for t in listed} - used
