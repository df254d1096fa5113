"""The Annotated Transformer's torch twin (``conformance_tests/annotated_model.py``) against known
facts of the post: its state dict's names and shapes, masks, layer norm, positional encoding,
the learning-rate schedule and label smoothing worked by hand, and a short copy task that learns.

These hold the twin to the post before anything is held to the twin. The copy task is the post's
``example_simple_model`` (V = 11, N = 2, batch 80, Adam with ``rate``) made small enough for a
test: d_model 64, d_ff 128, 4 heads (the post: 512, 2048, 8), warmup 50 (the post: 400) and 100
steps (the post: 20 epochs of 20 batches).
"""

from __future__ import annotations

import math

import pytest
import torch

from conformance_tests import annotated_model as am

V = 11
#: The post's ``inference_test``/``example_simple_model`` model with N = 2, at a test's size.
SMALL = {"N": 2, "d_model": 32, "d_ff": 64, "h": 4}


def _expected_state_dict_shapes(N, d_model, d_ff, vocab, max_len=5000):
    """The post's keys and their shapes, written out from its classes."""

    def linear(prefix, d_in, d_out):
        return {f"{prefix}.weight": (d_out, d_in), f"{prefix}.bias": (d_out,)}

    def norm(prefix):
        return {f"{prefix}.a_2": (d_model,), f"{prefix}.b_2": (d_model,)}

    def attn(prefix):
        shapes = {}
        for i in range(4):
            shapes |= linear(f"{prefix}.linears.{i}", d_model, d_model)
        return shapes

    def ff(prefix):
        return {**linear(f"{prefix}.w_1", d_model, d_ff), **linear(f"{prefix}.w_2", d_ff, d_model)}

    shapes = {}
    for i in range(N):
        layer = f"encoder.layers.{i}"
        shapes |= attn(f"{layer}.self_attn") | ff(f"{layer}.feed_forward")
        for j in range(2):
            shapes |= norm(f"{layer}.sublayer.{j}.norm")
    shapes |= norm("encoder.norm")
    for i in range(N):
        layer = f"decoder.layers.{i}"
        shapes |= (
            attn(f"{layer}.self_attn") | attn(f"{layer}.src_attn") | ff(f"{layer}.feed_forward")
        )
        for j in range(3):
            shapes |= norm(f"{layer}.sublayer.{j}.norm")
    shapes |= norm("decoder.norm")
    for side in ("src_embed", "tgt_embed"):
        shapes[f"{side}.0.lut.weight"] = (vocab, d_model)
        shapes[f"{side}.1.pe"] = (1, max_len, d_model)
    shapes |= linear("generator.proj", d_model, vocab)
    return shapes


@pytest.mark.quick
def test_make_model_has_the_posts_state_dict_names_and_shapes():
    model = am.make_model(V, V, **SMALL)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = _expected_state_dict_shapes(2, 32, 64, V)
    assert got == expected
    # A few written out in full, as the post names them.
    for key, shape in [
        ("encoder.layers.0.self_attn.linears.0.weight", (32, 32)),
        ("encoder.layers.0.sublayer.0.norm.a_2", (32,)),
        ("encoder.layers.0.feed_forward.w_1.weight", (64, 32)),
        ("encoder.norm.a_2", (32,)),
        ("decoder.layers.0.src_attn.linears.3.bias", (32,)),
        ("decoder.layers.1.sublayer.2.norm.b_2", (32,)),
        ("src_embed.0.lut.weight", (11, 32)),
        ("src_embed.1.pe", (1, 5000, 32)),
        ("tgt_embed.0.lut.weight", (11, 32)),
        ("tgt_embed.1.pe", (1, 5000, 32)),
        ("generator.proj.weight", (11, 32)),
    ]:
        assert got[key] == shape, key
    assert len(got) == 2 * (8 + 4 + 4) + 2 + 2 * (16 + 4 + 6) + 2 + 4 + 2  # 94


@pytest.mark.quick
def test_make_model_keeps_attention_dropout_at_0_1_and_xavier_initialises_matrices():
    """``make_model`` builds attention as ``MultiHeadedAttention(h, d_model)``: its dropout stays
    0.1 whatever ``dropout`` is; every other dropout takes ``dropout``."""
    torch.manual_seed(0)
    model = am.make_model(V, V, **SMALL, dropout=0.0)
    rates = {name: m.p for name, m in model.named_modules() if isinstance(m, torch.nn.Dropout)}
    attention = {name for name in rates if name.endswith("attn.dropout")}
    assert len(attention) == 2 + 2 * 2  # one per encoder layer, two per decoder layer
    assert {name: rates[name] for name in attention} == dict.fromkeys(attention, 0.1)
    others = {name: p for name, p in rates.items() if name not in attention}
    assert others == dict.fromkeys(others, 0.0)
    assert len(rates) == 6 + 2 * 2 + 2 * 3 + 2 * 2 + 2  # attn, ff, sublayers, embeddings
    # xavier_uniform_ on the (11, 32) table: |w| <= sqrt(6 / (11 + 32)) = 0.37354; torch's own
    # N(0, 1) init of an embedding would exceed that in almost every entry.
    lut = model.src_embed[0].lut.weight
    assert lut.abs().max().item() <= 0.3735437
    assert lut.abs().max().item() > 0.9 * 0.3735437
    assert torch.equal(model.encoder.norm.a_2, torch.ones(32))  # 1-D: left alone


@pytest.mark.quick
def test_subsequent_mask_is_the_lower_triangle_as_bool():
    mask = am.subsequent_mask(3)
    expected = torch.tensor([[[True, False, False], [True, True, False], [True, True, True]]])
    assert mask.dtype == torch.bool
    assert torch.equal(mask, expected)


@pytest.mark.quick
def test_batch_masks_shapes_dtypes_and_token_count():
    src = torch.tensor([[1, 4, 0]])
    tgt = torch.tensor([[1, 5, 0, 0]])
    batch = am.Batch(src, tgt, pad=0)
    assert torch.equal(batch.src_mask, torch.tensor([[[True, True, False]]]))  # (b, 1, s)
    assert torch.equal(batch.tgt, torch.tensor([[1, 5, 0]]))
    assert torch.equal(batch.tgt_y, torch.tensor([[5, 0, 0]]))
    # Row j sees column k when k <= j and tgt[k] is not padding.
    expected = torch.tensor([[[True, False, False], [True, True, False], [True, True, False]]])
    assert batch.tgt_mask.dtype == torch.bool
    assert torch.equal(batch.tgt_mask, expected)  # (b, t - 1, t - 1)
    assert batch.ntokens.dtype == torch.int64 and batch.ntokens.item() == 1


@pytest.mark.quick
def test_layer_norm_adds_eps_to_the_unbiased_std():
    norm = am.LayerNorm(4)
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    # mean 2.5, unbiased std sqrt(5 / 3) = 1.2909944 (the biased one would be 1.1180340).
    expected = torch.tensor([[-1.5, -0.5, 0.5, 1.5]]) / (1.2909944 + 1e-6)
    torch.testing.assert_close(norm(x), expected, rtol=1e-6, atol=1e-7)
    # A std as small as eps: mean 5e-7, unbiased std sqrt((3 * 0.25 + 2.25) / 3) * 1e-6 = 1e-6,
    # so x - mean is divided by 1e-6 + 1e-6 (eps inside a square root would give about 1e-3).
    x = torch.tensor([[0.0, 0.0, 0.0, 2e-6]])
    expected = torch.tensor([[-0.25, -0.25, -0.25, 0.75]])
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.quick
def test_embeddings_scale_and_positional_encoding_values():
    emb = am.Embeddings(4, V)
    tokens = torch.tensor([[3]])
    torch.testing.assert_close(emb(tokens), emb.lut.weight[3].view(1, 1, 4) * 2.0)  # sqrt(4)
    pe = am.PositionalEncoding(4, 0.0).pe
    assert pe.shape == (1, 5000, 4)
    # PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...): d = 4, pos 0 and 2.
    torch.testing.assert_close(pe[0, 0], torch.tensor([0.0, 1.0, 0.0, 1.0]))
    expected = [math.sin(2), math.cos(2), math.sin(2 / 100), math.cos(2 / 100)]
    torch.testing.assert_close(pe[0, 2], torch.tensor(expected), rtol=1e-6, atol=1e-6)


@pytest.mark.quick
@pytest.mark.parametrize(
    ("step", "model_size", "factor", "warmup", "expected"),
    [
        (0, 512, 1.0, 4000, 1.7469281e-07),  # step 0 is step 1: 1 / (sqrt(512) * 4000**1.5)
        (1, 512, 1.0, 4000, 1.7469281e-07),
        (4000, 512, 1.0, 4000, 6.9877124e-04),  # the peak, 1 / sqrt(512 * 4000)
        (16000, 512, 1.0, 4000, 3.4938562e-04),  # 4x past the peak: half of it
        (200, 32, 1.0, 400, 4.4194174e-03),  # in warmup: 200 / (sqrt(32) * 400**1.5)
        (200, 32, 3.0, 400, 1.3258252e-02),  # factor scales it
    ],
)
def test_rate_is_the_papers_schedule_with_step_0_as_1(step, model_size, factor, warmup, expected):
    assert am.rate(step, model_size, factor, warmup) == pytest.approx(expected, rel=1e-7)


@pytest.mark.quick
def test_make_optimizer_is_adam_with_lambda_lr_and_the_first_two_steps_share_a_rate():
    model = am.make_model(V, V, **SMALL)
    optimizer, scheduler = am.make_optimizer(model, 32, warmup=400)
    group = optimizer.param_groups[0]
    assert isinstance(optimizer, torch.optim.Adam)
    assert (group["betas"], group["eps"], group["initial_lr"]) == ((0.9, 0.98), 1e-9, 0.5)
    lrs = []
    for _ in range(3):
        lrs.append(group["lr"])
        optimizer.step()  # no gradients: changes nothing, but in the post's order
        scheduler.step()
    r1 = 1 / (math.sqrt(32) * 400**1.5)  # rate(1, 32, 1, 400)
    assert lrs == pytest.approx([0.5 * r1, 0.5 * r1, 0.5 * 2 * r1], rel=1e-12)


@pytest.mark.quick
def test_label_smoothing_true_dist_and_loss_worked_by_hand():
    """The post's ``example_label_smoothing``: size 5, padding 0, smoothing 0.4, targets
    ``[2, 1, 0, 3, 3]``: 0.6 on the target, 0.4 / 3 elsewhere, padding column and the padding
    row zero."""
    crit = am.LabelSmoothing(5, 0, 0.4)
    predict = torch.full((5, 5), 0.2)  # uniform, so that every log is finite
    loss = crit(predict.log(), torch.tensor([2, 1, 0, 3, 3]))
    s, c = 0.4 / 3, 0.6
    expected = torch.tensor(
        [[0, s, c, s, s], [0, c, s, s, s], [0, 0, 0, 0, 0], [0, s, s, c, s], [0, s, s, c, s]]
    )
    torch.testing.assert_close(crit.true_dist, expected)
    # Four rows of sum t * log(t / 0.2) = 0.6 log 3 + 3 * (0.4 / 3) log(2 / 3).
    assert loss.item() == pytest.approx(4 * (0.6 * math.log(3) + 0.4 * math.log(2 / 3)), rel=1e-6)
    assert loss.item() == pytest.approx(1.9879253, rel=1e-6)


@pytest.mark.quick
def test_data_gen_is_the_posts_copy_batches():
    gen = torch.Generator().manual_seed(0)
    batches = list(am.data_gen(V, 3, 2, generator=gen))
    assert len(batches) == 2
    again = next(am.data_gen(V, 3, 1, generator=torch.Generator().manual_seed(0)))
    for batch in batches:
        assert batch.src.shape == (3, 10) and torch.equal(batch.src[:, 0], torch.ones(3).long())
        assert ((batch.src >= 1) & (batch.src < V)).all()
        assert torch.equal(batch.tgt, batch.src[:, :-1]) and torch.equal(
            batch.tgt_y, batch.src[:, 1:]
        )
        assert batch.ntokens.item() == 3 * 9  # pad is 0, which the tokens never are
    assert torch.equal(again.src, batches[0].src)


def test_the_copy_task_learns_to_copy():
    """The post's ``example_simple_model``, small and short (see the module docstring). The
    post's ``[0..9]`` with start symbol 0 asks for tokens the copy data never holds (0 is the
    padding, every training row starts with 1): 100 steps do not get it right (it decodes
    ``[0, 2, 3, 4, 3, 5, 6, 7, 8, 9]``), so the check is an in-distribution row and the loss."""
    threads = torch.get_num_threads()
    # One thread: on 2 loaded cores, two spinning OpenMP threads made these 100 steps take 65 to
    # 140 s instead of 7.
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = am.make_model(V, V, N=2, d_model=64, d_ff=128, h=4)
            criterion = am.LabelSmoothing(size=V, padding_idx=0, smoothing=0.0)
            optimizer, scheduler = am.make_optimizer(model, 64, warmup=50)
            batches = list(am.data_gen(V, 80, 100, generator=torch.Generator().manual_seed(1)))
            losses = am.train_steps(model, optimizer, scheduler, batches, criterion)
            model.eval()
            src = torch.arange(1, 11).unsqueeze(0)  # (1, 10): [1, 2, ..., 10]
            with torch.no_grad():
                ys = am.greedy_decode(model, src, torch.ones(1, 1, 10), max_len=10, start_symbol=1)
    finally:
        torch.set_num_threads(threads)
    per_token = [loss / batch.ntokens.item() for loss, batch in zip(losses, batches)]
    first, last = per_token[0], sum(per_token[-10:]) / 10
    assert first > math.log(10), first  # xavier-sized logits: worse than a uniform guess
    assert last < first / 3, (first, last)  # measured 3.13 -> 0.65 (the last 10 steps' mean)
    assert ys.dtype == torch.int64
    assert ys.tolist() == [list(range(1, 11))]
