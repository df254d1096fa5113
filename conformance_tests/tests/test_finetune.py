"""The book's fine-tuning in Flax (``flax_attention.models.classify``, ``instruct`` and appendix D's
``training.train_model``) against the book's own functions in torch
(``conformance_tests/book_finetune.py``, written from the book's package).

One small model (vocabulary 97, 16 positions, d 32, 4 heads, 2 layers, dropout 0, no query, key
and value biases: the key's bias has no true gradient, and Adam turns the rounding noise both
sides give it into steps of full size, see ``test_models.py``) is drawn by torch and loaded into
Flax; each fine-tuning runs 12 steps on both sides from the same weights
and batches made here, with AdamW as the book sets it, and the losses, accuracies, learning
rates, gradient norms and every parameter are compared. Each run happens once per module
(fixtures), and every test reads it: the steps compile once.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

import flax_attention as fa
from conformance_tests import book_finetune, book_gpt
from conformance_tests.tolerances import TOLERANCES
from flax_attention import models
from flax_attention.models import classify, instruct, training
from flax_attention.models.checkpoints import new_model

CFG = {
    "vocab_size": 97,
    "context_length": 16,
    "emb_dim": 32,
    "n_heads": 4,
    "n_layers": 2,
    "drop_rate": 0.0,
    "qkv_bias": False,
}
#: Logits, gradient norms: the spec's float32 forward entry.
TOL = TOLERANCES[("float32", "forward")]
#: Losses and parameters after the steps: the spec's float32 ``train`` entry.
TRAIN_TOL = TOLERANCES[("float32", "train")]
#: Every batch is ``(BATCH, TOKENS)``: one compiled step per fine-tuning, one evaluation.
BATCH, TOKENS = 4, 12
#: 3 training batches, 4 epochs: 12 steps.
EPOCHS = 4
#: The end-of-text token of the small vocabulary (GPT-2's is 50256).
PAD = 96
NUM_CLASSES = 2
#: The book's AdamW of chapters 6 and 7 (``lr=5e-5`` and ``lr=0.00005``, ``weight_decay=0.1``),
#: one object: it is part of the optimiser's static structure, so every ``nnx.Optimizer`` made
#: with it shares its compiled steps.
ADAMW = optax.adamw(5e-5, weight_decay=0.1)


class CharTokenizer:
    """A reader's tokenizer at the small vocabulary's size: one id per character."""

    def encode(self, text):
        return [ord(c) % PAD for c in text]

    def decode(self, ids):
        return "".join(chr(32 + i % 90) for i in ids)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """torch on one thread for this module: its models are tiny, and its second OpenMP thread
    only spins while another process holds the core (12 steps took 8 s instead of 0.2 s on a
    loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _twin(seed=0):
    torch.manual_seed(seed)
    return book_gpt.GPTModel(CFG)


def _numpy(state_dict) -> dict[str, np.ndarray]:
    return {key: value.detach().numpy().copy() for key, value in state_dict.items()}


def _torch(state_dict) -> dict[str, torch.Tensor]:
    return {key: torch.from_numpy(np.array(value)) for key, value in state_dict.items()}


def _params(model) -> dict[str, np.ndarray]:
    return {k: v for k, v in fa.state_dict(model).items() if not k.endswith(".mask")}


def _torch_params(twin) -> dict[str, np.ndarray]:
    return {name: p.detach().numpy().copy() for name, p in twin.named_parameters()}


def _error(got, reference) -> float:
    """``max_abs_err / max(1, max|reference|)``: what a tolerance is compared with."""
    got, reference = np.asarray(got, np.float64), np.asarray(reference, np.float64)
    return float(np.abs(got - reference).max() / max(1.0, np.abs(reference).max()))


def _worst(flax_params, torch_params) -> tuple[str, float]:
    assert set(flax_params) == set(torch_params)
    errors = {name: _error(flax_params[name], value) for name, value in torch_params.items()}
    worst = max(errors, key=errors.get)
    return worst, errors[worst]


def _as_torch(batches):
    return [tuple(torch.from_numpy(np.asarray(part)) for part in batch) for batch in batches]


def _token_batches(rng, count):
    """Language-model batches: ``(inputs, targets)``, the targets the inputs shifted by one."""
    data = rng.integers(0, PAD, (count, BATCH, TOKENS + 1))
    return [(row[:, :-1], row[:, 1:]) for row in data]


# ---- chapter 6: classification -----------------------------------------------------------------


def _classifier_twin():
    """The book's chapter 6 model: every parameter frozen, a new head of 2 classes, the last
    block and the final norm unfrozen."""
    twin = _twin()
    for param in twin.parameters():
        param.requires_grad = False
    torch.manual_seed(1)
    twin.out_head = torch.nn.Linear(in_features=CFG["emb_dim"], out_features=NUM_CLASSES)
    for param in twin.trf_blocks[-1].parameters():
        param.requires_grad = True
    for param in twin.final_norm.parameters():
        param.requires_grad = True
    return twin


def _classifier(state_dict):
    model = new_model(models.GPTModel, CFG)
    model.out_head = classify.classification_head(CFG["emb_dim"], NUM_CLASSES, rngs=nnx.Rngs(0))
    fa.load_state_dict(model, state_dict)  # the (2, d) head and its bias in the book's names
    return model


@pytest.fixture(scope="module")
def classified():
    """Chapter 6 on both sides: ``(initial state dict, twin, model, book's result, ours)``."""
    twin = _classifier_twin()
    initial = _numpy(twin.state_dict())
    rng = np.random.default_rng(6)
    texts = rng.integers(0, PAD, (5, BATCH, TOKENS))
    lengths = rng.integers(TOKENS - 4, TOKENS + 1, (5, BATCH))
    texts[np.arange(TOKENS) >= lengths[..., None]] = PAD  # padded to one length, as SpamDataset
    labels = rng.integers(0, NUM_CLASSES, (5, BATCH))
    batches = list(zip(texts, labels))
    train, val = batches[:3], batches[3:]
    optimizer = torch.optim.AdamW(twin.parameters(), lr=5e-5, weight_decay=0.1)
    book = book_finetune.train_classifier_simple(
        twin, _as_torch(train), _as_torch(val), optimizer, "cpu",
        num_epochs=EPOCHS, eval_freq=2, eval_iter=2,
    )  # fmt: skip
    model = _classifier(initial)
    flax_optimizer = nnx.Optimizer(model, ADAMW, wrt=classify.trainable_filter(model))
    ours = classify.train_classifier_simple(
        model, train, val, flax_optimizer, num_epochs=EPOCHS, eval_freq=2, eval_iter=2
    )
    return initial, twin, model, book, ours, (train, val)


def test_classifier_training_equals_the_books(classified):
    initial, twin, model, book, ours, _ = classified
    train_losses, val_losses, train_accs, val_accs, examples_seen = ours
    assert len(train_losses) == len(book[0]) == 6  # steps 0, 2, ..., 10
    assert examples_seen == book[4] == 3 * EPOCHS * BATCH
    loss_error = max(_error(g, e) for g, e in zip(train_losses + val_losses, book[0] + book[1]))
    accuracy_error = max(abs(g - e) for g, e in zip(train_accs + val_accs, book[2] + book[3]))
    worst, param_error = _worst(_params(model), _torch_params(twin))
    print(
        f"ch06, {3 * EPOCHS} steps: worst loss {loss_error:.2e}, worst accuracy "
        f"{accuracy_error:.2e}, worst parameter {worst} {param_error:.2e}"
    )
    assert loss_error <= TRAIN_TOL, f"losses: {loss_error:.2e} > {TRAIN_TOL}"
    assert (train_accs, val_accs) == (book[2], book[3])
    assert len(train_accs) == EPOCHS and len(set(train_accs + val_accs)) > 1, "a weak check"
    assert param_error <= TRAIN_TOL, f"{worst}: {param_error:.2e} > {TRAIN_TOL}"


def test_classifier_trains_the_books_parts_only(classified):
    initial, twin, model, *_ = classified
    trained = ("trf_blocks.1.", "final_norm.", "out_head.")
    for name, value in _params(model).items():
        moved = _error(value, initial[name])
        if name.startswith(trained):
            assert moved > 10 * TRAIN_TOL, f"{name} moved by only {moved:.2e}"
        else:  # frozen: exactly as loaded, as torch's requires_grad=False keeps it
            np.testing.assert_array_equal(value, initial[name], err_msg=name)
            np.testing.assert_array_equal(twin.state_dict()[name].numpy(), initial[name])
    names = {
        ".".join(map(str, path))
        for path, _ in nnx.to_flat_state(nnx.state(model, classify.trainable_filter(model)))
    }
    assert names == {
        n.replace(".weight", ".kernel") if "norm" not in n and "emb" not in n else n
        for n in _params(model)
        if n.startswith(trained)
    }
    assert classify.trainable_filter(model) == classify.trainable_filter(_classifier(initial))


def test_classifier_head_crosses_to_torch_and_back(classified):
    """The trained (2, d) head and its bias, exported in the book's names, load strictly into
    the book's classifier, which then gives the same losses and predictions."""
    _, twin, model, _, _, (train, val) = classified
    exported = fa.state_dict(model)
    assert exported["out_head.weight"].shape == (NUM_CLASSES, CFG["emb_dim"])
    assert exported["out_head.bias"].shape == (NUM_CLASSES,)
    other = _classifier_twin()
    other.load_state_dict(_torch(exported), strict=True)
    for name, value in other.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), exported[name], err_msg=name)
    model.eval()
    got = classify.calc_loss_loader(train + val, model)
    model.train()
    with torch.no_grad():
        expected = book_finetune.calc_loss_loader(_as_torch(train + val), other.eval(), "cpu")
    assert _error(got, expected) <= TOL, f"{got} != {expected}"


def _assert_refused_and_unchanged(model, state_dict, *named):
    before = _params(model)
    with pytest.raises(ValueError) as caught:
        fa.load_state_dict(model, state_dict)
    for text in named:
        assert text in str(caught.value), f"{text!r} not in: {caught.value}"
    for key, value in _params(model).items():
        np.testing.assert_array_equal(value, before[key], err_msg=f"{key} changed")


def test_a_head_of_the_wrong_size_names_both_shapes_and_loads_nothing(classified):
    initial, _, model, *_ = classified
    vocabulary = _numpy(_twin(seed=2).state_dict())  # the book's model, its (97, 32) head
    _assert_refused_and_unchanged(
        _classifier(initial),
        vocabulary,
        "out_head.weight: shape (97, 32) must be (2, 32)",
        "missing key out_head.bias",
        "nothing was loaded",
    )
    plain = new_model(models.GPTModel, CFG)
    fa.load_state_dict(plain, vocabulary)
    _assert_refused_and_unchanged(
        plain,
        fa.state_dict(model),
        "out_head.weight: shape (2, 32) must be (97, 32)",
        "unexpected key out_head.bias",
    )


def _deterministic(model) -> list[bool]:
    return [d.deterministic for _, d in nnx.iter_graph(model) if isinstance(d, nnx.Dropout)]


def test_a_tied_model_takes_a_classification_head_as_its_own(classified):
    """GPT-2's checkpoints tie the head to ``tok_emb`` (no ``out_head``); chapter 6's head put
    on such a model is its own: exported and loaded under ``out_head.``, not as the embedding."""
    classifier = classified[2]
    tied = new_model(models.GPTModel, {**CFG, "tie_word_embeddings": True})
    tied.out_head = classify.classification_head(CFG["emb_dim"], NUM_CLASSES, rngs=nnx.Rngs(1))
    weights = fa.state_dict(classifier)
    fa.load_state_dict(tied, weights)
    exported = fa.state_dict(tied)
    assert set(exported) == set(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)


def test_classify_review_and_accuracy_equal_the_books(classified, monkeypatch):
    """The same labels and accuracy as the book's, computed in eval mode (every dropout off,
    seen from inside each evaluation), the model's train mode given back."""
    _, twin, model, _, _, (train, val) = classified
    tokenizer = CharTokenizer()
    texts = ["win a prize now", "see you at lunch", "", "call 0800 to claim", "ok", "x" * 30]
    modes, evaluate = [], classify._evaluate

    def evaluate_and_record(model, *args):
        modes.append(all(_deterministic(model)))
        return evaluate(model, *args)

    monkeypatch.setattr(classify, "_evaluate", evaluate_and_record)
    model.train()
    got = [classify.classify_review(t, model, tokenizer, max_length=TOKENS, pad_token_id=PAD)
           for t in texts]  # fmt: skip
    expected = [
        book_finetune.classify_review(t, twin, tokenizer, "cpu", TOKENS, pad_token_id=PAD)
        for t in texts
    ]
    assert got == expected
    assert set(got) <= {"spam", "not spam"}
    accuracy = classify.calc_accuracy_loader(train + val, model)
    assert accuracy == book_finetune.calc_accuracy_loader(_as_torch(train + val), twin, "cpu")
    assert modes == [True] * (len(texts) + len(train + val)), modes
    assert _deterministic(model) == [False] * 5  # drop_emb, 2 per block: train mode again


def test_the_optimizer_may_come_second(classified):
    initial, *_, (train, val) = classified
    results = []
    for book_order in (True, False):
        model = _classifier(initial)
        optimizer = nnx.Optimizer(model, ADAMW, wrt=classify.trainable_filter(model))
        loaders = (train[:1], val, optimizer) if book_order else (optimizer, train[:1], val)
        results.append(classify.train_classifier_simple(model, *loaders, 1, 1, 1))
    assert results[0] == results[1]


def test_generation_and_hugging_face_names_refuse_a_classification_head(classified):
    model = classified[2]
    with pytest.raises(ValueError) as caught:
        models.generate(model, [[1, 2, 3]], 4, 8)
    assert str(caught.value) == (
        "model.out_head (Linear(32 -> 2, with bias)) must give vocab_size (97) logits per token "
        "to generate, not 2: a classification head (chapter 6) scores classes, not next tokens"
    )
    with pytest.raises(ValueError) as caught:
        fa.state_dict(model, layout="gpt2")
    assert str(caught.value).startswith(
        "model.out_head (Linear(32 -> 2, with bias)) must be the vocabulary's head "
        "(Linear(32 -> 97, no bias)) for layout ('gpt2')"
    ), str(caught.value)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda m, b: classify.classification_head(32, 1, rngs=nnx.Rngs(0)),
            ValueError,
            "num_classes (1) must be >= 2 (a classifier scores at least two classes",
        ),
        (
            lambda m, b: (
                setattr(m, "out_head", nnx.Linear(32, 1, rngs=nnx.Rngs(0)))
                or classify.calc_loss_batch(*b, m)
            ),
            ValueError,
            "num_classes (model.out_head: Linear(32 -> 1, with bias)) (1) must be >= 2",
        ),
        (
            lambda m, b: classify.calc_loss_batch(b[0], b[1] + 2, m),
            ValueError,
            "target_batch (labels 2..3) must lie in 0..1 (num_classes)",
        ),
        (
            lambda m, b: classify.train_classifier_simple(m, iter([b]), [b], None, 1, 1, 1),
            TypeError,
            "optimizer (NoneType) must be an nnx.Optimizer",
        ),
        (
            lambda m, b: classify.classify_review("hi", m, CharTokenizer(), max_length=17),
            ValueError,
            "max_length (17) must not exceed the model's context_length (16)",
        ),
    ],
    ids=["head_of_one", "model_head_of_one", "label_range", "no_optimizer", "max_length"],
)
def test_bad_classifier_input_is_refused_by_name(classified, call, error, message):
    model = nnx.clone(classified[2])
    with pytest.raises(error) as caught:
        call(model, classified[5][0][0])
    assert str(caught.value).startswith(message), str(caught.value)


# ---- chapter 7: instruction fine-tuning ----------------------------------------------------------


ENTRIES = [
    {"instruction": "Rewrite the sentence.", "input": "The cake was baked.", "output": "x"},
    {"instruction": "Name a primary colour.", "input": "", "output": "Red."},
]

#: Token lists as the book's ``InstructionDataset`` makes them: unequal lengths, one holding the
#: end-of-text token inside its text (the book's collate keeps only the first as a target).
SEQUENCES = [[5, 6, 7, 8, 9], [1, 2], [3, PAD, 4, 11, 12, 13, 14], [42]]


@pytest.mark.quick
def test_format_input_is_the_books_prompt():
    for entry in ENTRIES:
        assert instruct.format_input(entry) == book_finetune.format_input(entry)
    assert instruct.format_input(ENTRIES[1]).endswith("### Instruction:\nName a primary colour.")


@pytest.mark.quick
@pytest.mark.parametrize("allowed_max_length", [None, 2, 4, 7, 20])
def test_custom_collate_fn_equals_the_books(allowed_max_length):
    for batch in (SEQUENCES, SEQUENCES[:2], [SEQUENCES[3]]):
        expected = book_finetune.custom_collate_fn(
            [list(s) for s in batch], pad_token_id=PAD, allowed_max_length=allowed_max_length
        )
        got = instruct.custom_collate_fn(
            batch, pad_token_id=PAD, allowed_max_length=allowed_max_length
        )
        for g, e in zip(got, expected):
            assert g.dtype == np.int64 and isinstance(g, np.ndarray)
            np.testing.assert_array_equal(g, e.numpy(), err_msg=f"{batch}, {allowed_max_length}")
    inputs, targets = instruct.custom_collate_fn(SEQUENCES, pad_token_id=PAD)
    np.testing.assert_array_equal(targets[1], [2, PAD, -100, -100, -100, -100, -100])
    np.testing.assert_array_equal(targets[2], [PAD, 4, 11, 12, 13, 14, -100])  # the text's PAD


def _instruction_batches(rng, count):
    """Collated batches of ``BATCH`` sequences, the longest ``TOKENS`` tokens in each (one
    compiled shape), the rest shorter: targets hold the end of text and ``-100``."""
    batches = []
    for _ in range(count):
        lengths = [TOKENS, *rng.integers(2, TOKENS - 2, BATCH - 1)]
        items = [rng.integers(0, PAD, n).tolist() for n in lengths]
        batches.append(instruct.custom_collate_fn(items, pad_token_id=PAD))
    return batches


@pytest.fixture(scope="module")
def instructed():
    """Chapter 7 on both sides (chapter 5's loop on collated batches)."""
    rng = np.random.default_rng(7)
    batches = _instruction_batches(rng, 5)
    train, val = batches[:3], batches[3:]
    twin = _twin(seed=3)
    initial = _numpy(twin.state_dict())
    optimizer = torch.optim.AdamW(twin.parameters(), lr=0.00005, weight_decay=0.1)
    book = book_finetune.train_model_simple(
        twin, _as_torch(train), _as_torch(val), optimizer, "cpu",
        num_epochs=EPOCHS, eval_freq=2, eval_iter=2, start_context=None, tokenizer=None,
    )  # fmt: skip
    model = new_model(models.GPTModel, CFG)
    fa.load_state_dict(model, initial)
    flax_optimizer = nnx.Optimizer(model, ADAMW, wrt=nnx.Param)
    ours = models.train_model_simple(
        model, train, val, flax_optimizer, num_epochs=EPOCHS, eval_freq=2, eval_iter=2
    )
    return initial, twin, model, book, ours, batches


def test_instruction_training_equals_the_books(instructed):
    initial, twin, model, book, ours, batches = instructed
    ignored = sum(int((targets == -100).sum()) for _, targets in batches)
    assert ignored > 10, f"only {ignored} targets of -100: a weak check"
    assert ours[2] == book[2] and len(ours[0]) == 6
    loss_error = max(_error(g, e) for g, e in zip(ours[0] + ours[1], book[0] + book[1]))
    worst, param_error = _worst(_params(model), _torch_params(twin))
    print(f"ch07, {3 * EPOCHS} steps: worst loss {loss_error:.2e}, worst parameter {worst} "
          f"{param_error:.2e}")  # fmt: skip
    assert loss_error <= TRAIN_TOL, f"losses: {loss_error:.2e} > {TRAIN_TOL}"
    assert param_error <= TRAIN_TOL, f"{worst}: {param_error:.2e} > {TRAIN_TOL}"
    moved = _error(_params(model)["out_head.weight"], initial["out_head.weight"])
    assert moved > 10 * TRAIN_TOL, f"training moved the head by only {moved:.2e}"


def test_the_loss_leaves_ignore_index_out_as_torch(instructed):
    _, twin, model, _, _, batches = instructed
    inputs, targets = batches[0]
    model.eval()
    got = models.calc_loss_loader(batches[:1], model)
    all_ignored = models.calc_loss_loader([(inputs, np.full_like(targets, -100))], model)
    model.train()
    with torch.no_grad():
        expected = book_gpt.calc_loss_batch(*_as_torch([batches[0]])[0], twin.eval()).item()
        all_kept = torch.nn.functional.cross_entropy(
            twin(torch.from_numpy(inputs)).flatten(0, 1),
            torch.from_numpy(np.where(targets < 0, PAD, targets)).flatten(),
        ).item()
    assert _error(got, expected) <= TOL and abs(expected - all_kept) > 1e-2
    assert np.isnan(all_ignored)  # torch's mean over no target


def test_generate_and_print_sample_prints_the_books_sample(instructed, capsys):
    """50 greedy tokens over the whole context, printed on one line, as the book's."""
    _, twin, model, *_ = instructed
    models.generate_and_print_sample(model, CharTokenizer(), "Hi there")
    ours = capsys.readouterr().out
    twin.train()
    book_finetune.generate_and_print_sample(twin, CharTokenizer(), "cpu", "Hi there")
    assert ours == capsys.readouterr().out
    assert len(ours) == len("Hi there") + 50 + 1 and len(set(ours[8:])) > 5, ours
    assert _deterministic(model) == [False] * 5  # train mode again, as the book leaves it


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda m: instruct.custom_collate_fn(SEQUENCES, allowed_max_length=1),
            ValueError,
            "allowed_max_length (1) must be >= 2 (None: no cut)",
        ),
        (
            lambda m: instruct.custom_collate_fn([[1, 2], []]),
            ValueError,
            "batch[1] (an empty sequence) must hold at least one token id",
        ),
        (
            lambda m: instruct.custom_collate_fn([]),
            ValueError,
            "batch (0 sequences) must hold at least one token-id sequence",
        ),
        (
            lambda m: instruct.custom_collate_fn(SEQUENCES, ignore_index=5),
            ValueError,
            "ignore_index (5) must be negative, no token id",
        ),
        (
            lambda m: models.calc_loss_batch([[1, 2]], [[2, 3]], m, ignore_index=3),
            ValueError,
            "ignore_index (3) must not be a token id (0..96, vocab_size)",
        ),
        (
            lambda m: models.calc_loss_batch([[1, 2]], [[2, -1]], m),
            ValueError,
            "target_batch (token ids -1..2) must lie in 0..96 (vocab_size) or be ignore_index "
            "(-100)",
        ),
        (
            lambda m: instruct.format_input({"instruction": "x"}),
            ValueError,
            "entry (keys ['instruction']) must have keys 'instruction' and 'input'",
        ),
    ],
    ids=[
        "max_length_1",
        "empty_sequence",
        "empty_batch",
        "collate_ignore",
        "loss_ignore",
        "target_range",
        "entry_keys",
    ],
)
def test_bad_instruction_input_is_refused_by_name(instructed, call, error, message):
    with pytest.raises(error) as caught:
        call(instructed[2])
    assert str(caught.value).startswith(message), str(caught.value)


# ---- appendix D: warmup, cosine decay, clipping --------------------------------------------------

#: Appendix D's run, small: peak 1e-3 as the book's notebook; warmup 3 of the 12 steps.
PEAK_LR, WARMUP = 1e-3, 3


def _appendix_d(seed, scale, n_epochs, eval_iter, weight_decay):
    """Appendix D on both sides from the book's model drawn with ``seed``, its matrices times
    ``scale``: ``(twin, model, book's result, ours, torch_norms, flax_steps)``, each side's
    clipping recorded per step (torch: the norms ``clip_grad_norm_`` returns, ``None`` where it
    is not called; Flax: the learning rate, the clipping flag and the norm each step ran
    with)."""
    rng = np.random.default_rng(seed)
    batches = _token_batches(rng, 4)
    train, val = batches[:3], batches[3:]
    twin = _twin(seed=seed)
    with torch.no_grad():  # larger logits, larger gradients (or smaller)
        for name, parameter in twin.named_parameters():
            if parameter.ndim == 2 and "_emb." not in name:
                parameter.mul_(scale)
    initial = _numpy(twin.state_dict())
    optimizer = torch.optim.AdamW(twin.parameters(), lr=PEAK_LR, weight_decay=weight_decay)
    torch_norms = []  # one entry per step: the book's zero_grad opens each
    clip, zero_grad = torch.nn.utils.clip_grad_norm_, optimizer.zero_grad

    def clip_and_record(*args, **kwargs):
        torch_norms[-1] = float(clip(*args, **kwargs))
        return torch_norms[-1]

    def zero_grad_and_record(*args, **kwargs):
        torch_norms.append(None)
        return zero_grad(*args, **kwargs)

    optimizer.zero_grad = zero_grad_and_record
    flax_steps = []
    original = training._scheduled_step

    def record(model, optimizer, x, y, lr, clipping):
        loss, norm = original(model, optimizer, x, y, lr, clipping)
        flax_steps.append((float(lr), bool(clipping), float(norm)))
        return loss, norm

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.utils, "clip_grad_norm_", clip_and_record)
        book = book_finetune.train_model(
            twin, _as_torch(train), _as_torch(val), optimizer, "cpu", n_epochs=n_epochs,
            eval_freq=1, eval_iter=eval_iter, start_context=None, tokenizer=None,
            warmup_steps=WARMUP,
        )  # fmt: skip
        model = new_model(models.GPTModel, CFG)
        fa.load_state_dict(model, initial)
        patch.setattr(training, "_scheduled_step", record)
        ours = models.train_model(
            model, train, val, n_epochs, 1, eval_iter, WARMUP, peak_lr=PEAK_LR,
            weight_decay=weight_decay,
        )  # fmt: skip
    return twin, model, book, ours, torch_norms, flax_steps


@pytest.fixture(scope="module")
def scheduled():
    """Appendix D, every step evaluated on one batch, weights scaled up: every gradient norm
    from the warmup on is above 1, so clipping scales each down."""
    return _appendix_d(seed=4, scale=3.0, n_epochs=EPOCHS, eval_iter=1, weight_decay=0.1)


def test_appendix_d_equals_the_books_at_every_step(scheduled):
    twin, model, book, ours, torch_norms, flax_steps = scheduled
    steps = 3 * EPOCHS
    train_losses, val_losses, tokens_seen, lrs = ours
    assert lrs == book[3] and len(lrs) == steps  # Python floats, computed as the book does
    assert lrs[0] == 3e-05 and lrs[WARMUP] == PEAK_LR and lrs[-1] > 1e-6
    assert [lr for lr, _, _ in flax_steps] == [float(np.float32(lr)) for lr in book[3]]
    assert tokens_seen == book[2] == [BATCH * TOKENS * (i + 1) for i in range(steps)]
    clipped = [norm is not None for norm in torch_norms]
    assert clipped == [i >= WARMUP for i in range(steps)]  # the book's current code
    assert [c for _, c, _ in flax_steps] == clipped
    norm_error = max(
        _error(norm, expected)
        for (_, _, norm), expected in zip(flax_steps, torch_norms)
        if expected is not None
    )
    assert min(n for n in torch_norms if n is not None) > 1.0, "clipping scaled nothing"
    loss_error = max(_error(g, e) for g, e in zip(train_losses + val_losses, book[0] + book[1]))
    worst, param_error = _worst(_params(model), _torch_params(twin))
    print(
        f"appendix D, {steps} steps: worst loss {loss_error:.2e}, worst gradient norm "
        f"{norm_error:.2e}, worst parameter {worst} {param_error:.2e}"
    )
    assert norm_error <= TOL, f"gradient norms: {norm_error:.2e} > {TOL}"
    assert loss_error <= TRAIN_TOL, f"losses: {loss_error:.2e} > {TRAIN_TOL}"
    assert param_error <= TRAIN_TOL, f"{worst}: {param_error:.2e} > {TRAIN_TOL}"
    assert train_losses[-1] < train_losses[0] - 0.1, "the loss did not fall: a weak check"


def test_appendix_d_below_the_clipping_norm_another_decay_and_every_batch(capsys):
    """The rest of appendix D's options: gradient norms below 1 after the warmup (torch's
    ``clip_grad_norm_`` leaves them as they are), a ``weight_decay`` other than the book's 0.1,
    and ``eval_iter=None`` (every batch, as the book's ``calc_loss_loader`` reads it); the
    progress lines as the book prints them."""
    twin, model, book, ours, torch_norms, flax_steps = _appendix_d(
        seed=5, scale=0.5, n_epochs=2, eval_iter=None, weight_decay=0.5
    )
    lines = capsys.readouterr().out.splitlines()  # the book's 6, then ours
    assert len(lines) == 12 and lines[:6] == lines[6:], lines
    # torch's rule on its own, a norm below and above ``max_norm``: left, and scaled down
    rng = np.random.default_rng(5)
    for size in (0.2, 4.0):
        grads = [size * rng.standard_normal(shape).astype(np.float32) for shape in ((3, 4), (5,))]
        parameters = [torch.zeros(g.shape, requires_grad=True) for g in grads]
        for parameter, g in zip(parameters, grads):
            parameter.grad = torch.from_numpy(g.copy())
        expected = float(torch.nn.utils.clip_grad_norm_(parameters, 1.0))
        got, norm = training.clip_grad_norm([jnp.asarray(g) for g in grads], 1.0)
        assert _error(norm, expected) <= TOL, (size, float(norm), expected)
        for g, parameter in zip(got, parameters):
            assert _error(g, parameter.grad.numpy()) <= TOL, (size, g, parameter.grad)
    clipped = [norm for norm in torch_norms if norm is not None]
    assert len(clipped) == 3 and max(clipped) < 1.0, f"norms {clipped}: clipping scaled some"
    assert [c for _, c, _ in flax_steps] == [norm is not None for norm in torch_norms]
    norms = [norm for _, clipping, norm in flax_steps if clipping]
    norm_error = max(_error(norm, expected) for norm, expected in zip(norms, clipped))
    assert norm_error <= TOL, f"gradient norms: {norm_error:.2e} > {TOL}"
    assert len(ours[0]) == len(book[0]) == 6 and ours[3] == book[3]
    loss_error = max(_error(g, e) for g, e in zip(ours[0] + ours[1], book[0] + book[1]))
    worst, param_error = _worst(_params(model), _torch_params(twin))
    assert loss_error <= TRAIN_TOL, f"losses: {loss_error:.2e} > {TRAIN_TOL}"
    assert param_error <= TRAIN_TOL, f"{worst}: {param_error:.2e} > {TRAIN_TOL}"


def test_the_classifier_prints_the_books_progress_lines(capsys):
    """Chapter 6's loop, one epoch: every line it prints (losses every step, accuracies after
    the epoch) as the book's."""
    twin = _classifier_twin()
    initial = _numpy(twin.state_dict())
    rng = np.random.default_rng(10)
    batches = list(zip(rng.integers(0, PAD, (5, BATCH, TOKENS)), rng.integers(0, 2, (5, BATCH))))
    train, val = batches[:3], batches[3:]
    optimizer = torch.optim.AdamW(twin.parameters(), lr=5e-5, weight_decay=0.1)
    book_finetune.train_classifier_simple(
        twin, _as_torch(train), _as_torch(val), optimizer, "cpu",
        num_epochs=1, eval_freq=1, eval_iter=2,
    )  # fmt: skip
    printed = capsys.readouterr().out
    model = _classifier(initial)
    flax_optimizer = nnx.Optimizer(model, ADAMW, wrt=classify.trainable_filter(model))
    classify.train_classifier_simple(
        model, train, val, flax_optimizer, num_epochs=1, eval_freq=1, eval_iter=2
    )
    assert capsys.readouterr().out == printed and printed.count("\n") == 4, printed


def test_each_evaluate_model_puts_the_model_back_in_train_mode(classified, instructed):
    """Chapters 5 and 6 leave the model in train mode after an evaluation, whatever mode it
    came in (the tests' models have no dropout, so no loss would show it)."""
    for module, (_, _, model, *_, batches) in ((classify, classified), (training, instructed)):
        train, val = (batches[:3], batches[3:]) if module is training else batches
        model.eval()
        module.evaluate_model(model, train, val, 1)
        assert _deterministic(model) == [False] * 5, module.__name__
        module.evaluate_model(model, train, val, None)
        assert _deterministic(model) == [False] * 5, module.__name__


def test_train_model_simple_evaluates_every_batch_for_eval_iter_none(capsys):
    """The book's ``train_model_simple(..., eval_iter=None)``: the losses over every batch of
    each loader, equal to the book's (it was refused at the first evaluation, after one step had
    already changed the model), and its progress lines as the book prints them."""
    batches = _token_batches(np.random.default_rng(9), 5)
    train, val = batches[:3], batches[3:]
    twin = _twin(seed=9)
    initial = _numpy(twin.state_dict())
    optimizer = torch.optim.AdamW(twin.parameters(), lr=0.00005, weight_decay=0.1)
    book = book_finetune.train_model_simple(
        twin, _as_torch(train), _as_torch(val), optimizer, "cpu",
        num_epochs=1, eval_freq=1, eval_iter=None, start_context=None, tokenizer=None,
    )  # fmt: skip
    printed = capsys.readouterr().out
    model = new_model(models.GPTModel, CFG)
    fa.load_state_dict(model, initial)
    ours = models.train_model_simple(
        model, train, val, nnx.Optimizer(model, ADAMW, wrt=nnx.Param), 1, 1, None
    )
    assert capsys.readouterr().out == printed and printed.count("\n") == 3, printed
    assert ours[2] == book[2] and len(ours[0]) == 3
    loss_error = max(_error(g, e) for g, e in zip(ours[0] + ours[1], book[0] + book[1]))
    assert loss_error <= TRAIN_TOL, f"losses: {loss_error:.2e} > {TRAIN_TOL}"
    one_batch = models.calc_loss_loader(val, model, num_batches=1)
    assert abs(one_batch - ours[1][-1]) > 1e-3, "one batch's loss: eval_iter read as 1"


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"warmup_steps": 0}, ValueError, "warmup_steps (0) must be >= 1"),
        ({"peak_lr": -1.0}, ValueError, "peak_lr (-1.0) must be >= 0"),
        ({"train_loader": iter([])}, TypeError, "train_loader (list_iterator) must be re-iterable"),
    ],
    ids=["warmup_0", "negative_lr", "one_pass_loader"],
)
def test_bad_train_model_arguments_are_refused_by_name(scheduled, kwargs, error, message):
    model = scheduled[1]
    arguments = {
        "train_loader": [], "val_loader": [], "n_epochs": 1, "eval_freq": 1, "eval_iter": 1,
        "warmup_steps": 1, "peak_lr": 1e-3, **kwargs,
    }  # fmt: skip
    with pytest.raises(error) as caught:
        models.train_model(model, **arguments)
    assert str(caught.value).startswith(message), str(caught.value)
