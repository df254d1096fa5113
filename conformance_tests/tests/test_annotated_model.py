"""``flax_attention.models.annotated`` (the Annotated Transformer's encoder-decoder) against its
torch twin, ``conformance_tests/annotated_model.py``, written from the post's published code.

One small model (vocabularies 11, N 2, d_model 32, d_ff 64, 4 heads) is drawn by torch's
``make_model`` and loaded into Flax through the weight bridge; everything below compares
numbers: the state dict both ways (bit for bit), the forward pass, encode/decode and the
generator's log-probabilities on a padded batch, every parameter's gradient of the post's
label-smoothed loss, 20 Adam steps on the copy task with the post's schedule, batched greedy
decoding against the post's one-row loop, and the errors bad inputs raise.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import flax_attention as fa
from conformance_tests import annotated_model as post
from conformance_tests.tolerances import TOLERANCES
from flax_attention import models
from flax_attention.models import annotated

V, N, D_MODEL, D_FF, H = 11, 2, 32, 64, 4
TOL = TOLERANCES[("float32", "forward")]
TRAIN_TOL = TOLERANCES[("float32", "train")]
STEPS = 20
PAD = 0


def _twin(seed=0, dropout=0.0):
    """The post's model, every dropout (the attentions' fixed 0.1 too) at ``dropout``."""
    torch.manual_seed(seed)
    twin = post.make_model(V, V, N=N, d_model=D_MODEL, d_ff=D_FF, h=H, dropout=dropout)
    for module in twin.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = dropout
    return twin


def _numpy(state_dict) -> dict[str, np.ndarray]:
    return {key: value.detach().numpy().copy() for key, value in state_dict.items()}


def _flax(weights, **options):
    model = annotated.make_model(
        V,
        V,
        N=N,
        d_model=D_MODEL,
        d_ff=D_FF,
        h=H,
        dropout=0.0,
        attention_dropout=0.0,
        rngs=nnx.Rngs(0),
        **options,
    )
    fa.load_state_dict(model, weights)
    return model


def _error(got, reference) -> float:
    got, reference = np.asarray(got, np.float64), np.asarray(reference, np.float64)
    return float(np.abs(got - reference).max() / max(1.0, np.abs(reference).max()))


def _params(model) -> dict[str, np.ndarray]:
    return {k: v for k, v in fa.state_dict(model).items() if not k.endswith(".pe")}


@pytest.fixture(scope="module")
def weights():
    return _numpy(_twin().state_dict())


@pytest.fixture(scope="module")
def batch():
    """Two rows, the second padded (``PAD``) at its end, as the post's ``Batch`` takes them."""
    rng = np.random.default_rng(0)
    src = rng.integers(1, V, (2, 9))
    src[1, 6:] = PAD
    tgt = rng.integers(1, V, (2, 8))
    tgt[:, 0] = 1
    tgt[1, 5:] = PAD
    return src, tgt


def test_layer_norm_adds_eps_to_the_unbiased_std_as_the_post():
    """``a_2 * (x - mean) / (std + eps) + b_2``: rows whose spread is near ``eps`` (where eps
    added to the variance instead, or a biased std, would move every output) and unit rows."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, D_MODEL)).astype(np.float32)
    x[0] *= 1e-6  # std about eps
    twin = post.LayerNorm(D_MODEL)
    with torch.no_grad():
        twin.a_2.copy_(torch.from_numpy(rng.standard_normal(D_MODEL).astype(np.float32)))
        twin.b_2.copy_(torch.from_numpy(rng.standard_normal(D_MODEL).astype(np.float32)))
        expected = twin(torch.from_numpy(x)).numpy()
    norm = annotated.LayerNorm(D_MODEL)
    norm.a_2.set_value(jnp.asarray(twin.a_2.detach().numpy()))
    norm.b_2.set_value(jnp.asarray(twin.b_2.detach().numpy()))
    assert _error(norm(jnp.asarray(x)), expected) <= TOL


def test_make_model_sets_each_dropout_as_the_posts_and_draws_glorot_uniform():
    """Every dropout rate at the twin's module path: the attentions at ``attention_dropout``
    (the post's layers keep their default 0.1), the rest at ``dropout``; and every parameter
    of rank > 1 drawn from the post's Glorot/Xavier uniform law, +-sqrt(6 / (fan_in +
    fan_out)) (torch's defaults, or JAX's normal draws, reach other bounds)."""
    torch.manual_seed(0)
    twin = post.make_model(V, V, N=1, d_model=D_MODEL, d_ff=D_FF, h=H, dropout=0.3)
    expected = {n: m.p for n, m in twin.named_modules() if isinstance(m, torch.nn.Dropout)}
    for attention_dropout in (0.1, 0.05):
        model = annotated.make_model(
            V, V, N=1, d_model=D_MODEL, d_ff=D_FF, h=H, dropout=0.3,
            attention_dropout=attention_dropout, rngs=nnx.Rngs(1),
        )  # fmt: skip
        rates = {
            ".".join(map(str, path)): node.rate
            for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Dropout)
        }
        attention = {n: attention_dropout if "attn" in n else p for n, p in expected.items()}
        assert rates == attention, attention_dropout
    for side, params in (("flax", _params(model)), ("torch", _numpy(twin.state_dict()))):
        for name, w in params.items():
            if w.ndim < 2 or name.endswith(".pe"):
                continue
            limit = np.sqrt(6 / sum(w.shape))  # torch's layout (out, in); an embedding (V, d)
            high, std = np.abs(w).max(), w.std()
            assert 0.9 * limit < high <= limit, (side, name, high, limit)
            assert abs(std * np.sqrt(3) / limit - 1) < 0.15, (side, name, std, limit)


@pytest.mark.quick
def test_state_dict_has_the_posts_names_and_goes_both_ways_bit_for_bit(weights, tmp_path):
    torch.save(_twin().state_dict(), tmp_path / "post.pt")  # the post's model saved by torch
    model = _flax(models.read_pth(tmp_path / "post.pt"))
    exported = fa.state_dict(model)
    assert list(exported) == list(weights) or set(exported) == set(weights)
    for key, value in weights.items():
        assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key
    twin = _twin(seed=3)
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in exported.items()}, strict=True)
    for key, value in twin.state_dict().items():
        assert np.array_equal(value.numpy(), weights[key]), key
    assert "encoder.layers.1.self_attn.linears.3.weight" in exported
    assert exported["src_embed.1.pe"].shape == (1, 5000, D_MODEL)


def test_forward_encode_decode_and_log_probs_equal_the_twin(weights, batch):
    src, tgt = batch
    model, twin = _flax(weights), _twin().eval()
    model.eval()
    ours, theirs = (
        annotated.Batch(src, tgt, PAD),
        post.Batch(torch.from_numpy(src), torch.from_numpy(tgt), PAD),
    )
    np.testing.assert_array_equal(ours.src_mask, theirs.src_mask.numpy())
    np.testing.assert_array_equal(ours.tgt_mask, theirs.tgt_mask.numpy())
    assert ours.ntokens == int(theirs.ntokens)
    with torch.no_grad():
        memory = twin.encode(theirs.src, theirs.src_mask)
        out = twin.decode(memory, theirs.src_mask, theirs.tgt, theirs.tgt_mask)
        expected = {
            "memory": memory,
            "out": out,
            "log_probs": twin.generator(out),
            "forward": twin(theirs.src, theirs.tgt, theirs.src_mask, theirs.tgt_mask),
        }
    got_memory = model.encode(ours.src, ours.src_mask)
    got_out = model.decode(got_memory, ours.src_mask, ours.tgt, ours.tgt_mask)
    got = {
        "memory": got_memory,
        "out": got_out,
        "log_probs": model.generator(got_out),
        "forward": model(ours.src, ours.tgt, ours.src_mask, ours.tgt_mask),
    }
    for name, value in expected.items():
        assert got[name].shape == tuple(value.shape), name
        error = _error(got[name], value.numpy())
        assert error <= TOL, f"{name}: {error:.2e} > {TOL}"


def test_every_gradient_of_the_label_smoothed_loss_equals_the_twin(weights, batch):
    src, tgt = batch
    model, twin = _flax(weights), _twin()
    model.train()
    twin.train()
    theirs = post.Batch(torch.from_numpy(src), torch.from_numpy(tgt), PAD)
    criterion = post.LabelSmoothing(size=V, padding_idx=PAD, smoothing=0.1)
    loss_compute = post.SimpleLossCompute(twin.generator, criterion)
    out = twin(theirs.src, theirs.tgt, theirs.src_mask, theirs.tgt_mask)
    _, loss = loss_compute(out, theirs.tgt_y, theirs.ntokens)
    loss.backward()

    ours = annotated.Batch(src, tgt, PAD)
    arrays = (ours.src, ours.tgt, ours.src_mask, ours.tgt_mask, ours.tgt_y, float(ours.ntokens))
    smoothing = annotated.LabelSmoothing(V, PAD, 0.1)
    loss_and_grads = nnx.jit(nnx.value_and_grad(annotated.loss_compute), static_argnums=1)
    flax_loss, grads = loss_and_grads(model, smoothing, arrays)
    assert abs(float(flax_loss) - loss.item()) <= TOL * max(1.0, loss.item())
    holder = nnx.clone(model)
    nnx.update(holder, grads)
    flax_grads = _params(holder)
    torch_grads = {name: p.grad.numpy() for name, p in twin.named_parameters()}
    assert set(flax_grads) == set(torch_grads)
    errors = {name: _error(flax_grads[name], g) for name, g in torch_grads.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, f"gradient of {worst}: {errors[worst]:.2e} > {TOL}"
    real = [n for n, g in torch_grads.items() if np.abs(g).max() > 1e-4]
    assert len(real) > 0.8 * len(torch_grads), "most gradients are zero: a weak check"


def test_label_smoothing_and_the_schedule_equal_the_posts():
    x = torch.log_softmax(torch.randn(6, V, generator=torch.Generator().manual_seed(0)), -1)
    target = torch.tensor([1, 0, 3, 10, 0, 2])  # two padding rows
    for smoothing in (0.0, 0.1, 0.4):
        expected = post.LabelSmoothing(V, PAD, smoothing)(x, target).item()
        got = float(
            annotated.LabelSmoothing(V, PAD, smoothing)(
                jnp.asarray(x.numpy()), jnp.asarray(target.numpy())
            )
        )
        assert abs(got - expected) <= 1e-6 * max(1.0, abs(expected)), (smoothing, got, expected)
    layer = torch.nn.Linear(2, 2)
    optimizer, scheduler = post.make_optimizer(layer, D_MODEL, factor=1.0, warmup=40, base_lr=0.5)
    schedule = annotated.rate_schedule(D_MODEL, 1.0, 40, base_lr=0.5)
    for step in range(100):
        expected = optimizer.param_groups[0]["lr"]  # what update ``step`` uses
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-6), step
        optimizer.step()
        scheduler.step()


def test_twenty_adam_steps_on_the_copy_task_equal_the_posts_loop(weights):
    """The post's ``example_simple_model`` loop from the same weights and batches: Adam (0.9,
    0.98, 1e-9) on ``rate``'s schedule (warmup 400, base lr 0.5), label smoothing 0, dropout 0."""
    batches = list(annotated.data_gen(V, 4, STEPS, rng=np.random.default_rng(1)))
    twin = _twin()
    twin.train()
    optimizer, scheduler = post.make_optimizer(twin, D_MODEL, factor=1.0, warmup=400, base_lr=0.5)
    torch_batches = [
        post.Batch(
            torch.from_numpy(b.src),
            torch.from_numpy(np.concatenate([b.tgt, b.tgt_y[:, -1:]], 1)),
            PAD,
        )
        for b in batches
    ]
    criterion = post.LabelSmoothing(size=V, padding_idx=PAD, smoothing=0.0)
    torch_losses = post.train_steps(twin, optimizer, scheduler, torch_batches, criterion)

    model = _flax(weights)
    model.train()
    tx = annotated.adam(D_MODEL, factor=1.0, warmup=400, base_lr=0.5)
    flax_optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    smoothing = annotated.LabelSmoothing(V, PAD, 0.0)
    # the post's loss of a step is the criterion's sum: sloss * ntokens
    flax_losses = [
        float(annotated.train_step(model, flax_optimizer, smoothing, b)) * b.ntokens
        for b in batches
    ]
    assert torch_losses[-1] < 0.95 * torch_losses[0], "the twin did not learn: a weak check"
    loss_error = max(_error(f, t) for f, t in zip(flax_losses, torch_losses))
    assert loss_error <= TRAIN_TOL, f"losses: {loss_error:.2e}"
    # The key projections' biases (linears.1.bias) have no true gradient: softmax ignores a
    # shift shared by all keys. Both sides' gradients there are rounding noise (below 1e-6),
    # which Adam's normalisation turns into steps of nearly the learning rate, so those
    # parameters wander apart (1e-3 in 20 steps) with no effect on any output; they are held
    # by the outputs below instead. Every other parameter is compared.
    torch_params = {n: p.detach().numpy() for n, p in twin.named_parameters()}
    flax_params = _params(model)
    errors = {
        n: _error(flax_params[n], p)
        for n, p in torch_params.items()
        if not n.endswith("linears.1.bias")
    }
    assert len(errors) == len(torch_params) - 3 * N
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TRAIN_TOL, f"parameter {worst}: {errors[worst]:.2e}"
    b = batches[0]
    twin.eval()
    model.eval()
    with torch.no_grad():
        expected = twin.generator(
            twin(*(torch.from_numpy(np.asarray(a)) for a in (b.src, b.tgt, b.src_mask, b.tgt_mask)))
        ).numpy()
    got = model.generator(model(b.src, b.tgt, b.src_mask, b.tgt_mask))
    assert _error(got, expected) <= TRAIN_TOL, f"trained log-probs: {_error(got, expected):.2e}"


def test_greedy_decode_of_a_padded_batch_equals_the_posts_loop_per_row(weights):
    """Three sources of 9, 6 and 4 tokens, padded to 9: each row of one batched, jitted decode
    equals the post's ``greedy_decode`` of that source alone (no padding)."""
    twin = _twin().eval()
    with torch.no_grad():  # sharper logits: a random model at the post's init repeats itself
        for name, parameter in twin.named_parameters():
            if parameter.ndim == 2 and "lut" not in name:
                parameter.mul_(3.0)
    model = _flax(_numpy(twin.state_dict()))
    rng = np.random.default_rng(4)
    lengths, max_len = (9, 6, 4), 12
    src = np.full((3, 9), PAD)
    for row, length in enumerate(lengths):
        src[row, :length] = rng.integers(1, V, length)
    got = np.asarray(annotated.greedy_decode(model, src, src[:, None, :] != PAD, max_len, 1))
    assert got.shape == (3, max_len) and (got[:, 0] == 1).all()
    for row, length in enumerate(lengths):
        alone = torch.from_numpy(src[row : row + 1, :length])
        with torch.no_grad():
            expected = post.greedy_decode(twin, alone, torch.ones(1, 1, length), max_len, 1)
        np.testing.assert_array_equal(got[row], expected[0].numpy(), err_msg=f"row {row}")
    assert len(np.unique(got[:, 1:])) > 4, "the decoded tokens repeat: a weak check"
    # inside the caller's own jit, a fixed max_len
    decode = nnx.jit(lambda m, s, mask: annotated.greedy_decode(m, s, mask, max_len, 1))
    np.testing.assert_array_equal(decode(model, src, src[:, None, :] != PAD), got)


def test_greedy_decode_runs_a_train_mode_model_in_eval_mode_and_leaves_it_in_train_mode(
    weights, batch
):
    """Dropout 0.5 everywhere, the model in train mode: greedy_decode gives the eval-mode
    model's tokens, and the model's dropouts are in train mode again after."""
    src, _ = batch
    mask = src[:, None, :] != PAD
    model = annotated.make_model(
        V, V, N=N, d_model=D_MODEL, d_ff=D_FF, h=H, dropout=0.5, attention_dropout=0.5,
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    fa.load_state_dict(model, weights)
    model.train()
    got = np.asarray(annotated.greedy_decode(model, src, mask, 8, 1))
    dropouts = [node for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Dropout)]
    assert dropouts and not any(d.deterministic for d in dropouts)
    model.eval()
    np.testing.assert_array_equal(got, annotated.greedy_decode(model, src, mask, 8, 1))


def test_bad_inputs_are_refused_by_name_and_a_bad_load_changes_nothing(weights, batch):
    src, tgt = batch
    model = _flax(weights)
    b = annotated.Batch(src, tgt, PAD)
    cases = [
        (
            lambda: model(b.src, b.tgt, b.src_mask[:, :, :5], b.tgt_mask),
            ValueError,
            r"src_mask.shape \(\(2, 1, 5\)\) must broadcast to \(2 or 1, 9 or 1, 9\)",
        ),
        (
            lambda: model(b.src, b.tgt, b.src_mask, b.tgt_mask[:1, :3]),
            ValueError,
            r"tgt_mask.shape \(\(1, 3, 7\)\) must broadcast to \(2 or 1, 7 or 1, 7\)",
        ),
        (
            lambda: model.encode(np.ones((1, 5001), int), np.ones((1, 1, 5001))),
            ValueError,
            r"src tokens \(5001\) must not exceed the positional table's max_len \(5000\)",
        ),
        (
            lambda: model(b.src + V, b.tgt, b.src_mask, b.tgt_mask),
            ValueError,
            r"src \(ids 11\.\.21\) must lie in 0\.\.10",
        ),
        (
            lambda: model(b.src, b.tgt.astype(np.float32), b.src_mask, b.tgt_mask),
            TypeError,
            r"tgt \(dtype float32\) must hold integer token ids",
        ),
        (
            lambda: annotated.greedy_decode(model, b.src, b.src_mask, 0, 1),
            ValueError,
            r"max_len \(0\) must be >= 1",
        ),
        (
            lambda: annotated.greedy_decode(model, b.src, b.src_mask, 5001, 1),
            ValueError,
            r"max_len \(5001\) must not exceed the positional table's max_len \(5000\)",
        ),
        (
            lambda: annotated.greedy_decode(model, b.src, b.src_mask, 5, 11),
            ValueError,
            r"start_symbol \(11\) must lie in 0\.\.10",
        ),
        (lambda: annotated.LabelSmoothing(2, 0), ValueError, r"size \(2\) must be >= 3"),
        (lambda: annotated.make_model(V, V, N=0, rngs=nnx.Rngs(0)), ValueError, r"N \(0\)"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()

    before = fa.state_dict(model)
    bigger = _numpy(post.make_model(V, V, N=N, d_model=D_MODEL, d_ff=2 * D_FF, h=H).state_dict())
    missing = {k: v for k, v in weights.items() if k != "decoder.layers.1.src_attn.linears.2.bias"}
    shifted = {**weights, "src_embed.1.pe": weights["src_embed.1.pe"] + 0.1}
    for wrong, named in (
        (bigger, "encoder.layers.0.feed_forward.w_1.weight: shape (128, 32) must be (64, 32)"),
        (missing, "missing key decoder.layers.1.src_attn.linears.2.bias"),
        (shifted, "src_embed.1.pe: differs from the sinusoidal positional encoding at position 0"),
    ):
        with pytest.raises(ValueError, match="nothing was loaded") as raised:
            fa.load_state_dict(model, wrong)
        assert named in str(raised.value), str(raised.value)
        after = fa.state_dict(model)
        assert all(np.array_equal(after[k], v) for k, v in before.items()), "a failed load wrote"
