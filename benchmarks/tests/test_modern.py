"""Section ``modern`` (``benchmarks.modern``): in the quick run (``quick_run`` of
``conftest.py``, every section once per test session) each Flax call is paired with its baseline,
compared before timing, and the ratios, targets and chart are those rows'; hand-made rows and the
memory worker's sliding-window layer check the rest without a run (no timing assertions)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
from flax import nnx

import flax_attention as fa
from benchmarks import charts, memory, modern
from benchmarks.config import QUICK
from benchmarks.rows import make_row
from benchmarks.targets import MODERN_TARGETS, target_rows

#: As ``test_cli.MAX_REL_DIFF``: float32 parity on these shapes is ~1e-6.
MAX_REL_DIFF = 1e-5
#: ``(mode, Flax implementation, baseline (framework, implementation))`` of each pair.
PAIRS = {
    "forward": ("GroupedQueryAttention", ("torch", "sdpa enable_gqa")),
    "forward+backward": ("GroupedQueryAttention", ("torch", "sdpa enable_gqa")),
    "layer forward": ("window", ("flax", "full causal")),
    "core forward": ("window", ("flax", "full causal")),
    "generate": ("generate", ("torch", "generate_text_simple_cached")),
}


def _measured(rows):
    return [r for r in rows if r["section"] == "modern" and not r["skipped"]]


def _pairs(rows):
    """``{(case, mode): {(framework, implementation): row}}``."""
    pairs = {}
    for row in _measured(rows):
        key = (row["framework"], row["implementation"])
        pairs.setdefault((row["case"], row["mode"]), {})[key] = row
    return pairs


def test_the_modern_rows_pair_each_flax_call_with_its_compared_baseline(quick_run):
    pairs = _pairs(quick_run.data["rows"])
    (batch, tokens), (_, heads, groups) = QUICK.modern_gqa_shapes[0], QUICK.modern_gqa_layer
    window = f"b1_t{QUICK.modern_swa_tokens}_w{QUICK.modern_swa_window}"
    prompt, new = QUICK.modern_decode_prompt, QUICK.modern_decode_tokens
    assert set(pairs) == {
        (f"b{batch}_t{tokens}_h{heads}_kv{groups}", "forward"),
        (f"b{batch}_t{tokens}_h{heads}_kv{groups}", "forward+backward"),
        (window, "layer forward"),
        (window, "core forward"),
        *((f"{name}_b1_p{prompt}_n{new}", "generate") for name in QUICK.modern_variants),
    }  # no peak memory in the quick run: QUICK.modern_memory_tokens is empty
    for (case, mode), pair in pairs.items():
        flax_impl, base_key = PAIRS[mode]
        ours, base = pair[("flax", flax_impl)], pair[base_key]
        assert set(pair) == {("flax", flax_impl), base_key}, (case, mode)
        if mode == "generate":  # tokens/s, over the book's loop's
            assert ours["value"] == pytest.approx(new / (ours["median_ms"] / 1e3))
            assert ours["ratio"] == pytest.approx(ours["value"] / base["value"])
            assert f"tokens equal to the book's loop: {prompt + new}/{prompt + new}" in ours["note"]
        else:
            assert ours["ratio"] == pytest.approx(ours["median_ms"] / base["median_ms"])
        assert base["ratio"] == 1.0 and base["ratio_of"] == ours["ratio_of"]
        # compared before timing: Flax against torch SDPA (outputs; gradients of x and every
        # parameter), the window against full causal where both see the same keys
        assert 0.0 <= ours["max_rel_diff"] <= MAX_REL_DIFF, (case, mode, ours["max_rel_diff"])
        assert ours["repeats"] == base["repeats"] == QUICK.modern_repeats
    assert "Modern: the book's modern attention" in quick_run.stdout


def test_the_modern_chart_and_targets_hold_the_rows_ratios(quick_run):
    rows = quick_run.data["rows"]
    pairs = _pairs(rows)
    chart = charts.chart_data(rows, "modern")
    gqa, window = chart.panels  # QUICK decodes nothing and measures no memory: no such panels
    assert gqa.target == MODERN_TARGETS["gqa / torch SDPA enable_gqa"]
    assert window.target == MODERN_TARGETS["sliding window / full causal"]
    for (case, mode), pair in pairs.items():
        if mode in ("forward", "forward+backward"):
            assert gqa.value(mode, case) == pair[("flax", "GroupedQueryAttention")]["ratio"]
        if mode in ("layer forward", "core forward"):
            assert window.value(mode.split()[0], case) == pair[("flax", "window")]["ratio"]
    goals = [r for r in rows if r["section"] == "targets" and "modern attention" in r["target"]]
    expected = [pair[("flax", PAIRS[mode][0])] for (_, mode), pair in pairs.items()]
    assert sorted((g["case"], g["value"]) for g in goals) == sorted(
        (r["case"], r["ratio"]) for r in expected
    )


@pytest.mark.quick
def test_modern_targets_of_hand_made_rows():
    def row(case, mode, framework, implementation, ratio, skipped=False):
        return make_row("modern", case, mode, framework, implementation, ratio=ratio,
                        skipped=skipped)  # fmt: skip

    rows = [
        row("b8", "forward", "flax", "GroupedQueryAttention", 0.9),  # at the goal: met
        row("b8", "forward", "torch", "sdpa enable_gqa", 1.0),  # the baseline: no target
        row("b8", "forward+backward", "flax", "GroupedQueryAttention", 0.91),
        row("b1", "forward", "flax", "GroupedQueryAttention", 0.5, skipped=True),  # not timed
        row("w", "layer forward", "flax", "window", 0.49),
        row("w", "layer forward", "flax", "full causal", 1.0),  # the baseline: no target
        row("w", "core forward", "flax", "window", 0.25),
        row("w", "peak memory", "flax", "window", 0.1),  # no goal
        row("gqa", "generate", "flax", "generate", 1.0),
        row("mla", "generate", "flax", "generate", 0.99),
    ]
    got = [(r["target"], r["value"], r["met"]) for r in target_rows(rows)]
    source = "(goal for the book's modern attention)"
    assert got == [
        (f"b8 forward: time / torch SDPA enable_gqa's <= 0.9 {source}", 0.9, True),
        (f"b8 forward+backward: time / torch SDPA enable_gqa's <= 0.9 {source}", 0.91, False),
        (f"w layer forward: time / full causal's <= 0.25 {source}", 0.49, False),
        (f"w core forward: time / full causal's <= 0.25 {source}", 0.25, True),
        (f"gqa generate: >= 1x the tokens/s of the book's cached loop {source}", 1.0, True),
        (f"mla generate: >= 1x the tokens/s of the book's cached loop {source}", 0.99, False),
    ]


@pytest.mark.quick
def test_peak_memory_measures_the_window_layer_and_rows_its_growth(monkeypatch):
    """The memory worker's ``layer="swa"`` builds the window layer, with and without its window
    (abstract here: nothing drawn or compiled); the rows hold each growth and the window's over
    none's, or why not."""
    spec = dict(framework="flax", layer="swa", heads=4, d_model=8, batch=1, tokens=16,
                implementation="default", mode="forward")  # fmt: skip
    for window in (4, None):
        layer = nnx.eval_shape(lambda w=window: memory._flax_module({**spec, "window": w}))
        assert type(layer) is fa.MultiHeadAttentionWithSWA
        assert (layer.sliding_window_size, layer.num_heads, layer.d_out) == (window, 4, 8)

    def measure(spec):
        assert spec["layer"] == "swa" and spec["tokens"] == 4096
        if spec["window"] is None:
            return {"growth_bytes": 400e6, "seconds": 2.0, "peak_reset": True}
        return {"growth_bytes": 100e6, "seconds": 0.5, "peak_reset": False}

    monkeypatch.setattr(memory, "measure", measure)
    config = QUICK.__class__(modern_memory_tokens=(4096,), modern_swa_window=512)
    window, full_row = modern._peak_memory(config, None)
    assert [r["implementation"] for r in (window, full_row)] == ["window", "full causal"]
    assert (window["value"], window["ratio"], window["median_ms"]) == (100.0, 0.25, 500.0)
    assert (full_row["value"], full_row["ratio"]) == (400.0, 1.0)
    assert window["case"] == "b1_t4096_w512" and window["unit"] == "MB"
    assert "scores alone: 0.8 GB" in window["note"] and "lower bound" in window["note"]
    assert "lower bound" not in full_row["note"]

    monkeypatch.setattr(memory, "measure", lambda spec: {"error": "exit 1: boom"})
    rows = modern._peak_memory(config, None)
    assert [(r["skipped"], r["note"]) for r in rows] == [(True, "exit 1: boom")] * 2


@pytest.mark.quick
def test_decode_rows_time_equal_tokens_only(monkeypatch):
    """The decode rows' code on stand-ins of the two loops (a real generate compiles for seconds,
    so QUICK decodes nothing): equal tokens are timed, tokens/s and their ratio from the
    medians; a differing token leaves both rows skipped, saying how many were equal."""
    import numpy as np
    import torch

    from conformance_tests import book_modern
    from flax_attention import models

    prompt, new = QUICK.modern_decode_prompt, QUICK.modern_decode_tokens
    config = dataclasses.replace(QUICK, modern_variants={"gqa_kv2": {"n_kv_groups": 2}})
    seen = []

    def flax_generate(model, ids, max_new_tokens, context_size):
        seen.append((type(model).__name__, model.cfg["n_kv_groups"], context_size))
        return np.concatenate([ids, np.full((1, max_new_tokens), 5)], axis=1)

    def book_loop(twin, ids, max_new_tokens, last=5):
        return torch.cat([ids, torch.full((1, max_new_tokens), 5)], dim=1).index_fill_(
            1, torch.tensor([ids.shape[1] + max_new_tokens - 1]), last
        )

    monkeypatch.setattr(models, "generate", flax_generate)
    monkeypatch.setattr(book_modern, "generate_text_simple_cached", book_loop)
    flax_row, book_row = modern._decode(config, None)
    assert seen[0] == ("GPTModel", 2, QUICK.modern_model["context_length"])
    assert flax_row["case"] == f"gqa_kv2_b1_p{prompt}_n{new}" and not flax_row["skipped"]
    assert (flax_row["framework"], book_row["implementation"]) == (
        "flax", "generate_text_simple_cached"
    )  # fmt: skip
    for row in (flax_row, book_row):
        assert row["value"] == pytest.approx(new / (row["median_ms"] / 1e3))
    assert flax_row["ratio"] == pytest.approx(flax_row["value"] / book_row["value"])
    assert f"tokens equal to the book's loop: {prompt + new}/{prompt + new}" in flax_row["note"]

    monkeypatch.setattr(book_modern, "generate_text_simple_cached",
                        functools.partial(book_loop, last=6))  # fmt: skip
    rows = modern._decode(config, None)
    note = f"tokens equal to the book's loop: {prompt + new - 1}/{prompt + new}: not timed"
    assert [(r["skipped"], r["note"], r["median_ms"]) for r in rows] == [(True, note, None)] * 2
