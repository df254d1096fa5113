"""Section ``annotated``: the Annotated Transformer's encoder-decoder
(``flax_attention.models.annotated``) against its torch twin written from the post's code
(``conformance_tests/annotated_model.py``), at the post's copy-task size by default
(``annotated_model``: V = 11, N = 2, d_model 512, d_ff 2048, 8 heads), float32, the twin's
weights (``torch.manual_seed(0)``, the post's init) loaded into Flax (``load_state_dict``).

A training step of the copy task (``annotated_train_rows`` rows of 10 ids, the post's
``data_gen``; label smoothing 0; the post's Adam (0.9, 0.98, 1e-9) on ``rate``'s schedule, base
lr 0.5, warmup 400; every dropout 0.1, as the post's ``make_model`` builds it), one fixed batch:

- ``flax`` ``train_step``: ``annotated.train_step(model, optimizer, criterion, batch)``,
  ``optimizer = nnx.Optimizer(model, annotated.adam(d_model), wrt=nnx.Param)``, train mode.
- ``torch`` ``post``: the twin's ``train_steps`` of that one batch, the post's ``run_epoch``
  step: forward, ``SimpleLossCompute``, ``backward``, ``optimizer.step``, ``zero_grad``,
  ``scheduler.step`` (``LambdaLR``), the loss read back with ``item()``.

Before timing, two steps of each with dropout off (Flax ``eval()``, the twin's dropout rates set
to 0) are compared (``max_*_diff``: the first loss checks the forward, the second the first
update; above ``TOLERANCE`` nothing is timed); then both go back to dropout 0.1, Flax's step is
compiled once (its seconds in the note) and the steps are timed round-robin, training on.
``ratio_vs_eager``: Flax time / the twin's (< 1: Flax faster; the twin's attention is the
post's own matmul-softmax).

Greedy decoding of ``annotated_decode_shape`` sources (8 x 64 ids; lengths 64, 60, ..., 36, the
rest padded with 0), ``annotated_max_len`` ids out per row (the start symbol 1, then
``max_len - 1`` new tokens), with the twin's weights sharpened (every weight matrix but the
embeddings times 3, as ``conformance_tests/tests/test_annotated_model.py`` does: at the post's
init a random model repeats one token, which would make the token check below weak; the
shapes, hence the work, are the same):

- ``flax`` ``greedy_decode``: ``annotated.greedy_decode(model, src, src_mask, max_len, 1)``, one
  jit (the encoder once, a cache for each decoder self-attention); its first call compiles
  (``compile`` row, apart; a timed call that compiled would be an error of the benchmark).
- ``torch`` ``post_per_row``: the post's ``greedy_decode`` run over the rows one by one, each
  source alone without its padding (the post's ``src_mask``, ones), ``torch.no_grad()``.
- ``torch`` ``post_batched``: the post's loop taking every row at once (``batched_greedy_decode``
  here: the padded sources, ``src_mask = src != 0``, ``next_word`` per row; no cache, the whole
  decoder again per token, as the post).

Timed round-robin; ``value`` new tokens per second over the batch (``rows * (max_len - 1)``),
``ratio`` that over the post's loop per row, and the Flax row's ``ratio_vs_eager`` its tokens/s
over the batched torch loop's. Before timing, each row's tokens are compared with the post's
loop per row (counts in the Flax row's note, with how many distinct ids were decoded).
"""

from __future__ import annotations

import jax
import numpy as np
import torch
from flax import nnx

from benchmarks.gpt_models import count_compiles
from benchmarks.models import loaded
from benchmarks.rows import make_row, max_diffs
from benchmarks.timing import Timing, interleaved
from conformance_tests import annotated_model as post
from flax_attention.models import annotated

__all__ = ["TOLERANCE", "batched_greedy_decode", "format_rows", "plan_calls", "run"]

#: Parity bound of the two losses before timing, relative to ``max(1, |torch loss|)``.
TOLERANCE = 1e-4
#: The copy task's padding id and start symbol (the post's ``data_gen`` and its decode example).
PAD, START = 0, 1
#: The post's ``example_simple_model``: Adam on ``rate(step, d_model, factor, warmup)`` times a
#: base learning rate.
FACTOR, WARMUP, BASE_LR = 1.0, 400, 0.5
#: Every weight matrix but the embeddings times this before decoding (see the docstring).
SHARPEN = 3.0


def plan_calls(config) -> int:
    return 2 * 2 + 1 + 2 * config.annotated_repeats + 3 + 3 * config.annotated_repeats


def _tick(progress, n=1):
    if progress is not None:
        progress.update(n)


def _sizes(config) -> dict:
    m = config.annotated_model
    return {"N": m["N"], "d_model": m["d_model"], "d_ff": m["d_ff"], "h": m["h"]}


def _models(config, scale: float = 1.0):
    """``(twin, flax model)``: the post's model (seed 0, its init, every dropout 0.1; weight
    matrices but the embeddings times ``scale``) and a Flax model holding its weights."""
    vocab, sizes = config.annotated_model["V"], _sizes(config)
    torch.manual_seed(0)
    twin = post.make_model(vocab, vocab, **sizes, dropout=0.1)
    if scale != 1.0:
        with torch.no_grad():
            for name, parameter in twin.named_parameters():
                if parameter.ndim == 2 and "lut" not in name:
                    parameter.mul_(scale)
    model = loaded(
        lambda: annotated.make_model(
            vocab, vocab, **sizes, dropout=0.1, attention_dropout=0.1, rngs=nnx.Rngs(0)
        ),
        {k: v.detach().numpy().copy() for k, v in twin.state_dict().items()},
    )
    return twin, model


def run(config, progress=None) -> list[dict]:
    return _train(config, progress) + _decode(config, progress)


# ---- a training step -----------------------------------------------------------------------------


def _set_dropout(twin, rate: float) -> None:
    for module in twin.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = rate


def _train(config, progress):
    vocab, d_model = config.annotated_model["V"], config.annotated_model["d_model"]
    rows_n = config.annotated_train_rows
    twin, model = _models(config)
    (batch,) = annotated.data_gen(vocab, rows_n, 1, rng=np.random.default_rng(0))
    data = torch.from_numpy(batch.src)  # the copy task: src == tgt, (b, 10)
    torch_batch = post.Batch(data, data.clone(), PAD)
    optimizer = nnx.Optimizer(model, annotated.adam(d_model, FACTOR, WARMUP, BASE_LR),
                              wrt=nnx.Param)  # fmt: skip
    criterion = annotated.LabelSmoothing(vocab, PAD, 0.0)
    torch_optimizer, scheduler = post.make_optimizer(twin, d_model, FACTOR, WARMUP, BASE_LR)
    torch_criterion = post.LabelSmoothing(size=vocab, padding_idx=PAD, smoothing=0.0)

    def flax_step():
        return annotated.train_step(model, optimizer, criterion, batch)

    def torch_step():
        return post.train_steps(twin, torch_optimizer, scheduler, [torch_batch], torch_criterion)

    # Parity with dropout off: the post's loss is the criterion's sum, Flax's that over ntokens.
    model.eval()
    _set_dropout(twin, 0.0)
    losses = {"flax": [], "torch": []}
    for _ in range(2):
        losses["flax"].append(float(jax.block_until_ready(flax_step())) * batch.ntokens)
        losses["torch"] += torch_step()
        _tick(progress, 2)
    diffs = max_diffs(
        {f"loss {i + 1}": np.float64(x) for i, x in enumerate(losses["flax"])},
        {f"loss {i + 1}": np.float64(x) for i, x in enumerate(losses["torch"])},
    )
    if diffs[1] > TOLERANCE:
        raise RuntimeError(
            f"annotated train: Flax losses {losses['flax']} differ from the twin's "
            f"{losses['torch']} by {diffs[1]:.1e} (relative) > {TOLERANCE:g}; not timing a "
            "wrong result"
        )
    model.train()
    _set_dropout(twin, 0.1)
    with count_compiles() as first:
        jax.block_until_ready(flax_step())
    torch_step()
    _tick(progress)
    calls = {"flax": flax_step, "torch": torch_step}
    with count_compiles() as timed:
        timings = interleaved(calls, config.annotated_repeats, progress)
    if timed.count:
        raise RuntimeError(f"annotated train_step compiled {timed.count} times during timing")
    ratio = timings["flax"]["median_ms"] / timings["torch"]["median_ms"]
    case = f"b{rows_n}_t{batch.src.shape[1]}"
    losses_text = {k: ", ".join(f"{x / batch.ntokens:.5f}" for x in v) for k, v in losses.items()}
    notes = {
        "flax": "annotated.train_step, nnx.Optimizer(annotated.adam), dropout 0.1; compile "
        f"{first.seconds:.2f} s apart",
        "torch": "the twin's train_steps of one batch (forward, SimpleLossCompute, backward, "
        "Adam step, zero_grad, LambdaLR step), dropout 0.1",
    }
    return [
        make_row(
            "annotated", case, "train step", framework,
            "train_step" if framework == "flax" else "post", batch=rows_n,
            tokens=batch.src.shape[1], timing=timings[framework],
            value=batch.ntokens / (timings[framework]["median_ms"] / 1e3), unit="tokens/s",
            ratio_vs_eager=ratio if framework == "flax" else 1.0,
            diffs=diffs if framework == "flax" else None,
            note=f"{notes[framework]}; per-token losses of the two dropout-off steps "
            f"{losses_text[framework]}",
        )
        for framework in ("flax", "torch")
    ]  # fmt: skip


# ---- greedy decoding -----------------------------------------------------------------------------


def batched_greedy_decode(model, src, src_mask, max_len, start_symbol):
    """The post's ``greedy_decode`` taking every row at once: ``src`` ``(b, s)`` (padded),
    ``src_mask`` ``(b, 1, s)`` -> ``ys`` ``(b, max_len)``; the whole decoder again per token,
    no cache, as the post; ``next_word`` per row."""
    memory = model.encode(src, src_mask)  # (b, s, d)
    ys = torch.zeros(src.size(0), 1).fill_(start_symbol).type_as(src.data)  # (b, 1)
    for _ in range(max_len - 1):
        out = model.decode(
            memory, src_mask, ys, post.subsequent_mask(ys.size(1)).type_as(src.data)
        )  # (b, t, d)
        prob = model.generator(out[:, -1])  # (b, V)
        _, next_word = torch.max(prob, dim=1)  # (b,)
        ys = torch.cat([ys, next_word[:, None].type_as(src.data)], dim=1)
    return ys


def _sources(config):
    """``(src (b, s) int64 padded with PAD, lengths)``: lengths s, s - 4, ... (at least 1)."""
    vocab = config.annotated_model["V"]
    batch, tokens = config.annotated_decode_shape
    lengths = [max(1, tokens - 4 * row) for row in range(batch)]
    rng = np.random.default_rng(1)
    src = np.full((batch, tokens), PAD, np.int64)
    for row, length in enumerate(lengths):
        src[row, :length] = rng.integers(1, vocab, length)
    return src, lengths


def _decode(config, progress):
    twin, model = _models(config, SHARPEN)
    twin.eval()
    model.eval()
    src, lengths = _sources(config)
    batch, tokens = src.shape
    max_len = config.annotated_max_len
    src_mask = src[:, None, :] != PAD  # (b, 1, s)
    src_torch = torch.from_numpy(src)
    src_mask_torch = src_torch.unsqueeze(-2) != PAD  # (b, 1, s), as the post's Batch

    def flax_decode():
        return annotated.greedy_decode(model, src, src_mask, max_len, START)

    def per_row():
        with torch.no_grad():
            return [
                post.greedy_decode(twin, src_torch[row : row + 1, :length],
                                   torch.ones(1, 1, length), max_len, START)[0]
                for row, length in enumerate(lengths)
            ]  # fmt: skip

    def batched():
        with torch.no_grad():
            return batched_greedy_decode(twin, src_torch, src_mask_torch, max_len, START)

    with count_compiles() as first:
        got = np.asarray(jax.block_until_ready(flax_decode()))
    expected = np.stack([ids.numpy() for ids in per_row()])  # (b, max_len)
    torch_batched = batched().numpy()
    _tick(progress, 3)
    count = batch * max_len
    equal = {
        "flax": int((got == expected).sum()),
        "batched": int((torch_batched == expected).sum()),
    }
    distinct = len(np.unique(expected[:, 1:]))
    calls = {"greedy_decode": flax_decode, "post_per_row": per_row, "post_batched": batched}
    with count_compiles() as timed:
        timings = interleaved(calls, config.annotated_repeats, progress)
    if timed.count:
        raise RuntimeError(
            f"greedy_decode compiled {timed.count} times during its timed calls: a second call "
            "with the same shapes must reuse the first call's executable"
        )
    new = batch * (max_len - 1)
    per_s = {name: 1e3 * new / timings[name]["median_ms"] for name in calls}
    case = f"b{batch}_s{tokens}_n{max_len}"
    notes = {
        "greedy_decode": f"annotated.greedy_decode, one jit, a cache per decoder self-attention; "
        f"{per_s['greedy_decode'] / per_s['post_batched']:.2f}x the batched torch loop; compile "
        f"{first.seconds:.2f} s apart ({first.count} compilations in the first call, none in "
        f"the timed ones); tokens equal to the post's loop per row {equal['flax']}/{count} "
        f"(the batched torch loop: {equal['batched']}/{count}), {distinct} distinct ids decoded",
        "post_per_row": "the post's greedy_decode over the rows one by one, each source "
        "unpadded, no_grad",
        "post_batched": "the post's loop over every row at once (padded sources, src_mask), "
        "no cache, no_grad",
    }
    rows = [
        make_row(
            "annotated", case, "greedy decode", "flax" if name == "greedy_decode" else "torch",
            name, batch=batch, tokens=max_len, timing=timings[name], value=per_s[name],
            unit="tokens/s", ratio=per_s[name] / per_s["post_per_row"],
            ratio_of="tokens/s / the post's loop per row",
            ratio_vs_eager=per_s[name] / per_s["post_batched"] if name == "greedy_decode" else None,
            note=notes[name],
        )
        for name in calls
    ]  # fmt: skip
    rows.append(
        make_row(
            "annotated", case, "compile", "flax", "greedy_decode", batch=batch, tokens=max_len,
            timing=Timing.of([first.seconds]), value=first.seconds, unit="s",
            note="the first greedy_decode call: trace, lower and compile (jax.monitoring), once",
        )
    )  # fmt: skip
    return rows


# ---- table ---------------------------------------------------------------------------------------


def format_rows(rows: list[dict], table) -> str:
    """The section's table (``table(headers, lines)`` from ``benchmarks.cli``)."""

    def num(value, spec):
        return "-" if value is None else format(value, spec)

    headers = ["case", "mode", "framework", "implementation", "median ms", "n", "value", "unit",
               "flax/torch", "/post per row", "max diff (rel)", "note"]  # fmt: skip
    lines = [
        [r["case"], r["mode"], r["framework"], r["implementation"], num(r["median_ms"], ".1f"),
         r["repeats"], num(r["value"], ".2f"), r["unit"], num(r["ratio_vs_eager"], ".2f"),
         num(r["ratio"], ".2f"), num(r["max_rel_diff"], ".1e"), r["note"]]
        for r in rows
    ]  # fmt: skip
    if not lines:
        return ""
    title = (
        "Annotated: the Annotated Transformer's model against its torch twin; train step "
        "flax/torch = time / the twin's (< 1: Flax faster); greedy decode flax/torch = Flax "
        "tokens/s / the batched torch loop's, /post per row = tokens/s / the post's loop per row"
    )
    return f"{title}\n{table(headers, lines)}\n"
