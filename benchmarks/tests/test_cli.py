"""``python -m benchmarks --quick`` runs end to end and writes sound rows (no timing assertions).

One subprocess runs every section on tiny shapes (the ``quick_run`` of ``conftest.py``, once per
test session); the tests check the JSON's structure, that every measured time and quantity is
finite and positive, and that the Flax outputs (and gradients, generated tokens, the whole
model's logits and training losses) recorded next to each timing equal torch's: the values, not
just the shapes. The targets rows are checked on hand-made rows against ``benchmarks.targets``.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from benchmarks import ROW_FIELDS, speed
from benchmarks.cli import build_config, parse_args
from benchmarks.config import QUICK
from benchmarks.parts import MODES, PARTS
from benchmarks.rows import make_row
from benchmarks.targets import MODEL_TARGETS, target_rows

#: Largest relative difference (max|flax - torch| / max(1, max|torch|)) a row may record; the
#: benchmarks refuse to time anything above 1e-4, float32 parity is ~1e-6 on these shapes.
MAX_REL_DIFF = 1e-5


def _measured(rows, section):
    return [r for r in rows if r["section"] == section and not r["skipped"]]


def test_rows_have_every_field_and_every_section(quick_run):
    data = quick_run.data
    assert set(data) == {"machine", "config", "rows"}
    for key in ("cpu", "cores", "jax", "jaxlib", "flax", "torch", "backend", "date"):
        assert data["machine"][key], f"machine.{key} is empty"
    rows = data["rows"]
    for row in rows:
        assert tuple(row) == ROW_FIELDS, f"row fields {tuple(row)} must be {ROW_FIELDS}"
    sections = {r["section"] for r in rows}
    assert sections == {
        "speed",
        "memory",
        "decode",
        "compile",
        "generate",
        "prefill",
        "train",
        "parts",
        "annotated",
        "modern",
        "products",
        "targets",
    }, sections


def test_times_and_quantities_are_finite_and_positive(quick_run):
    rows = quick_run.data["rows"]
    timed = [r for r in rows if r["section"] != "targets" and not r["skipped"]]
    assert timed, "no measured rows"
    for row in timed:
        name = f"{row['section']}/{row['case']}/{row['mode']}/{row['implementation']}"
        assert row["repeats"] >= 1, name
        assert math.isfinite(row["median_ms"]) and row["median_ms"] > 0, name
        if row["value"] is not None:
            assert math.isfinite(row["value"]) and row["value"] > 0, (name, row["value"])
    for section in ("memory", "decode", "compile", "generate", "prefill", "train", "parts",
                    "annotated", "modern", "products"):  # fmt: skip
        assert _measured(rows, section), f"section {section} measured nothing"


def test_speed_covers_every_implementation_against_both_torch_modules(quick_run):
    rows = _measured(quick_run.data["rows"], "speed")
    for mode in ("forward", "forward+backward"):
        names = {r["implementation"] for r in rows if r["mode"] == mode}
        assert {"eager", "sdpa", "reference", "xla", "blocked", "default"} <= names, (mode, names)
    for row in rows:
        assert math.isfinite(row["ratio_vs_eager"]) and row["ratio_vs_eager"] > 0
        assert math.isfinite(row["ratio_vs_sdpa"]) and row["ratio_vs_sdpa"] > 0
    eager = [r for r in rows if r["implementation"] == "eager"]
    assert all(r["ratio_vs_eager"] == 1.0 for r in eager)


def test_flax_equals_torch_in_every_compared_row(quick_run):
    rows = quick_run.data["rows"]
    compared = [r for r in rows if r["max_rel_diff"] is not None and not r["skipped"]]
    # narrower weights are compared with their own kind (test_dtype_rows_...), not to 1e-5
    compared = [r for r in compared if not _narrower(r)]
    flax_rows = [r for r in compared if r["framework"] == "flax"]
    # every flax speed row (outputs; gradients w.r.t. input and every parameter), generation,
    # the whole model's logits and its training losses, its parts' outputs and input gradients,
    # the Annotated Transformer's training losses, the book's modern layers (and generated tokens)
    assert {r["section"] for r in flax_rows} == {
        "speed", "decode", "prefill", "train", "parts", "annotated", "modern", "products"
    }  # fmt: skip
    assert any(r["mode"] == "forward+backward" for r in flax_rows)
    for row in compared:
        name = f"{row['section']}/{row['case']}/{row['mode']}/{row['implementation']}"
        assert 0.0 <= row["max_rel_diff"] <= MAX_REL_DIFF, f"{name}: {row['max_rel_diff']:.2e}"
        assert row["max_abs_diff"] <= MAX_REL_DIFF * 1e4, f"{name}: {row['max_abs_diff']:.2e}"


def _narrower(row) -> bool:
    """A row of bfloat16 or int8 weights (``products``' and ``dtype prefill``'s)."""
    if row["section"] == "products":
        return row["mode"] != "float32"
    return row["mode"] == "dtype prefill" and row["implementation"] != "float32"


def test_dtype_rows_hold_each_dtype_and_way_against_its_reference(quick_run):
    """``products``: every weight dtype and way at each shape, each against XLA's product of
    the same dtype (bfloat16 differs by its rounding: XLA's result is bfloat16, the kernels'
    float32), the ratio over XLA's float32 time; ``dtype prefill``: each dtype's last logits
    against transformers' in the same dtype (int8: float32, so its quantization error)."""
    rows = quick_run.data["rows"]
    products = _measured(rows, "products")
    cases = {r["case"] for r in products}
    assert cases == {"tiny_head_32x101_m1"}, cases
    ways = {(r["mode"], r["implementation"]) for r in products}
    for dtype in ("float32", "bfloat16", "int8"):
        assert {(dtype, "xla"), (dtype, "xla+ynn")} <= ways, (dtype, ways)
    assert ("float32", "torch") in ways and ("bfloat16", "torch") in ways
    base = [r for r in products if (r["mode"], r["implementation"]) == ("float32", "xla")]
    assert base[0]["ratio"] == 1.0 and base[0]["max_rel_diff"] == 0.0
    for row in products:
        bound = {"float32": MAX_REL_DIFF, "bfloat16": 2**-7, "int8": MAX_REL_DIFF}[row["mode"]]
        assert 0.0 <= row["max_rel_diff"] <= bound, row
        assert row["ratio"] > 0 and row["unit"] == "weight GB/s"
    prefill = [r for r in _measured(rows, "prefill") if r["mode"] == "dtype prefill"]
    held = {(r["framework"], r["implementation"]): r for r in prefill}
    assert set(held) == {("flax", d) for d in ("float32", "bfloat16", "int8")} | {
        ("torch", "float32"), ("torch", "bfloat16")}  # fmt: skip
    assert held["flax", "float32"]["ratio"] == 1.0
    assert held["torch", "float32"]["max_rel_diff"] == 0.0  # every row against it
    assert held["flax", "float32"]["max_rel_diff"] <= MAX_REL_DIFF
    # bfloat16 within the report's bound: 1.5x torch's own bfloat16 model's error
    assert held["flax", "bfloat16"]["max_rel_diff"] <= 1.5 * held["torch", "bfloat16"][
        "max_rel_diff"]  # fmt: skip
    assert 0 < held["flax", "int8"]["max_rel_diff"] <= 2**-5  # int8's rounding, not a bug's
    goals = {r["target"].split(": ")[0]: r for r in _measured(rows, "targets")
             if "prefill: time / float32's" in r["target"]}  # fmt: skip
    case = held["flax", "int8"]["case"]
    assert set(goals) == {f"{case} bfloat16 prefill", f"{case} int8 prefill"}, goals
    for dtype in ("bfloat16", "int8"):
        assert goals[f"{case} {dtype} prefill"]["value"] == held["flax", dtype]["ratio"]


def test_memory_decode_and_compile_rows_measure_what_they_say(quick_run):
    rows = quick_run.data["rows"]
    memory = _measured(rows, "memory")
    assert {r["implementation"] for r in memory} >= {"default", "sdpa"}
    assert all(r["unit"] == "MB" for r in memory)
    decode = _measured(rows, "decode")
    modes = {(r["mode"], r["implementation"]) for r in decode}
    assert {("generate", "generate"), ("generate", "kv_cache"), ("recompute", "recompute")} <= modes
    speedups = [r["ratio"] for r in decode if r["ratio_of"] == "speedup over recompute"]
    assert speedups and all(math.isfinite(s) and s > 0 for s in speedups)
    flat = [r for r in decode if r["unit"] == "ms/token"]
    assert len(flat) == 2 and math.isfinite(flat[-1]["ratio"])
    compile_rows = _measured(rows, "compile")
    assert any(r["implementation"] == "default" and r["unit"] == "s" for r in compile_rows)


def test_generate_rows_hold_tokens_bound_and_step_parts(quick_run):
    rows = _measured(quick_run.data["rows"], "generate")
    readers = {r["framework"]: r for r in rows if r["mode"] == "read bandwidth"}
    assert set(readers) == {"numpy", "jax", "torch"}
    assert all(r["unit"] == "GB/s" for r in readers.values())
    for flax in [r for r in rows if r["mode"] == "generate" and r["framework"] == "flax"]:
        case, batch, steps = flax["case"], flax["batch"], flax["tokens"]
        mine = [r for r in rows if r["case"] == case]
        torch_rows = {r["implementation"]: r for r in mine if r["mode"] == "generate"
                      and r["framework"] == "torch"}  # fmt: skip
        assert set(torch_rows) == {"eager", "sdpa"}
        for name, row in torch_rows.items():
            assert flax[f"ratio_vs_{name}"] == pytest.approx(flax["value"] / row["value"])
        # greedy tokens equal transformers' (both attentions), no compile in the timed calls
        count = batch * steps
        assert f"equal to eager {count}/{count}, sdpa {count}/{count}" in flax["note"]
        assert "none in the timed ones" in flax["note"]
        (bound,) = [r for r in mine if r["implementation"] == "bound"]
        assert bound["unit"] == "tokens/s" and bound["value"] > 0
        assert bound["ratio"] == pytest.approx(flax["value"] / bound["value"])
        parts = {r["implementation"] for r in mine if r["mode"].startswith("step part: ")}
        assert parts == {"generate", "decode loop", "layers", "head", "argmax", "embeddings"}
        (compiled,) = [r for r in mine if r["mode"] == "compile"]
        assert compiled["unit"] == "s" and compiled["value"] > 0


def test_prefill_and_train_rows_compare_flax_with_transformers(quick_run):
    rows = quick_run.data["rows"]
    for section, modes in (("prefill", {"last-position logits", "all logits"}),
                           ("train", {"train step"})):  # fmt: skip
        measured = [r for r in _measured(rows, section) if r["mode"] != "dtype prefill"]
        assert {r["mode"] for r in measured} == modes  # dtype prefill: test_dtype_rows_...
        for mode in modes:
            pair = {r["framework"]: r for r in measured if r["mode"] == mode}
            assert set(pair) == {"flax", "torch"}
            ratio = pair["flax"]["median_ms"] / pair["torch"]["median_ms"]
            assert pair["flax"]["ratio_vs_sdpa"] == pytest.approx(ratio)
            assert pair["flax"]["max_rel_diff"] is not None  # compared before timing
        goals = [
            r
            for r in _measured(rows, "targets")
            if r["case"] == measured[0]["case"] and "time / transformers'" in r["target"]
        ]  # not the dtype prefill goals
        assert len(goals) == len(modes)
        key = "prefill / transformers" if section == "prefill" else "train step / transformers"
        for goal in goals:
            assert goal["met"] == (goal["value"] <= MODEL_TARGETS[key])


def test_parts_rows_pair_every_piece_and_mode_with_transformers(quick_run):
    rows = _measured(quick_run.data["rows"], "parts")
    pairs = {}
    for row in rows:
        pairs.setdefault((row["implementation"], row["mode"]), {})[row["framework"]] = row
    assert set(pairs) == {(part, mode) for part in PARTS for mode in MODES}
    for (part, mode), pair in pairs.items():
        assert set(pair) == {"flax", "torch"}, (part, mode)
        ratio = pair["flax"]["median_ms"] / pair["torch"]["median_ms"]
        assert pair["flax"]["ratio_vs_sdpa"] == pytest.approx(ratio), (part, mode)
        assert pair["torch"]["ratio_vs_sdpa"] == 1.0
        assert pair["flax"]["max_rel_diff"] is not None, (part, mode)  # compared before timing
    assert "Parts: the model's pieces" in quick_run.stdout


def test_annotated_rows_compare_flax_with_the_posts_code(quick_run):
    rows = _measured(quick_run.data["rows"], "annotated")
    train = {r["framework"]: r for r in rows if r["mode"] == "train step"}
    assert set(train) == {"flax", "torch"}
    flax, twin = train["flax"], train["torch"]
    rows_n = QUICK.annotated_train_rows
    assert (flax["case"], flax["batch"], flax["tokens"]) == (f"b{rows_n}_t10", rows_n, 10)
    assert flax["ratio_vs_eager"] == pytest.approx(flax["median_ms"] / twin["median_ms"])
    assert twin["ratio_vs_eager"] == 1.0
    assert flax["max_rel_diff"] is not None  # the two dropout-off losses, compared before timing
    for row in train.values():  # tokens/s of the batch's target tokens (9 per row)
        assert row["value"] == pytest.approx(rows_n * 9 / (row["median_ms"] / 1e3))
        assert "dropout 0.1" in row["note"] and row["repeats"] == QUICK.annotated_repeats

    decode = {r["implementation"]: r for r in rows if r["mode"] == "greedy decode"}
    assert set(decode) == {"greedy_decode", "post_per_row", "post_batched"}
    (batch, _), max_len = QUICK.annotated_decode_shape, QUICK.annotated_max_len
    for row in decode.values():
        assert row["value"] == pytest.approx(batch * (max_len - 1) / (row["median_ms"] / 1e3))
        assert row["ratio"] == pytest.approx(row["value"] / decode["post_per_row"]["value"])
    flax = decode["greedy_decode"]
    assert flax["framework"] == "flax" and decode["post_batched"]["framework"] == "torch"
    assert flax["ratio_vs_eager"] == pytest.approx(flax["value"] / decode["post_batched"]["value"])
    # greedy tokens equal the post's loop per row, Flax's and the batched loop's
    count = batch * max_len
    assert f"per row {count}/{count} (the batched torch loop: {count}/{count})" in flax["note"]
    assert "none in the timed ones" in flax["note"]
    (compiled,) = [r for r in rows if r["mode"] == "compile"]
    assert compiled["unit"] == "s" and compiled["value"] > 0

    goals = [r for r in _measured(quick_run.data["rows"], "targets") if "annotated" in r["target"]]
    assert [(g["case"], g["value"]) for g in goals] == [
        (train["flax"]["case"], train["flax"]["ratio_vs_eager"]),
        (flax["case"], flax["ratio"]),
    ]
    assert "Annotated: the Annotated Transformer's model" in quick_run.stdout


@pytest.mark.quick
def test_annotated_targets_of_hand_made_rows():
    rows = [
        make_row("annotated", "b80_t10", "train step", "flax", "train_step", ratio_vs_eager=1.0),
        make_row("annotated", "b80_t10", "train step", "torch", "post", ratio_vs_eager=1.0),
        make_row("annotated", "b8_s64_n64", "greedy decode", "flax", "greedy_decode", ratio=4.99),
        make_row("annotated", "b8_s64_n64", "greedy decode", "torch", "post_batched", ratio=9.0),
        make_row("annotated", "b80_t10", "train step", "flax", "train_step", ratio_vs_eager=1.01),
        make_row("annotated", "b8_s64_n64", "greedy decode", "flax", "greedy_decode", ratio=5.0),
    ]
    got = [(r["target"], r["value"], r["met"]) for r in target_rows(rows)]
    # the goals at their bounds: the train step at or under 1.0x the twin, decode at least 5x
    train_text = ("b80_t10 annotated train step: time / the torch twin's <= 1 (project goal for "
                  "the model)")  # fmt: skip
    decode_text = ("b8_s64_n64 annotated greedy_decode: >= 5x the tokens/s of the post's loop per "
                   "row (project goal for the model)")  # fmt: skip
    assert got == [
        (train_text, 1.0, True), (train_text, 1.01, False),
        (decode_text, 4.99, False), (decode_text, 5.0, True),
    ]  # fmt: skip


@pytest.mark.quick
def test_model_targets_of_hand_made_rows():
    def generate_row(batch, eager, sdpa):
        return make_row("generate", f"b{batch}", "generate", "flax", "generate", batch=batch,
                        ratio_vs_eager=eager, ratio_vs_sdpa=sdpa)  # fmt: skip

    rows = [
        generate_row(1, 1.6, 1.4),  # the faster transformers attention counts: 1.4 < 1.5
        generate_row(2, 9.0, 9.0),  # no goal at batch 2
        generate_row(8, 2.6, 2.7),
        make_row("generate", "b1", "weight-streaming bound", "flax", "bound", batch=1, ratio=0.9),
        make_row("prefill", "b1_t1024", "all logits", "flax", "GPTModel", ratio_vs_sdpa=0.9),
        make_row("train", "b8_t256", "train step", "flax", "train_step", ratio_vs_sdpa=0.91),
    ]
    got = [(r["case"], r["value"], r["met"]) for r in target_rows(rows)]
    assert got == [
        ("b1", 1.4, False), ("b8", 2.6, True), ("b1", 0.9, True), ("b1_t1024", 0.9, True),
        ("b8_t256", 0.91, False),
    ]  # fmt: skip
    text = [r["target"] for r in target_rows(rows)]
    assert all("project goal for the model" in t and "issue" not in t for t in text), text
    assert f">= {MODEL_TARGETS['generate b8 / transformers']:g}x" in text[1]


@pytest.mark.quick
def test_narrower_weight_targets_of_hand_made_rows():
    """bfloat16 and int8 at batch 1 over float32 (the rows' ratio), and each at batch 8 over
    itself at batch 1 (their tokens/s); transformers' rows and other batches set none."""

    def dtype_row(batch, framework, dtype, value, ratio):
        return make_row("generate", f"b{batch}", "dtype generate", framework, dtype,
                        batch=batch, value=value, ratio=ratio)  # fmt: skip

    rows = [
        dtype_row(1, "flax", "float32", 40.0, 1.0),
        dtype_row(1, "flax", "bfloat16", 68.0, 1.7),  # meets 1.7
        dtype_row(1, "flax", "int8", 110.0, 2.75),  # under 2.8
        dtype_row(1, "torch", "bfloat16", 500.0, 12.5),  # transformers: no goal
        dtype_row(2, "flax", "bfloat16", 100.0, 1.9),  # batch 2: no goal
        dtype_row(8, "flax", "bfloat16", 272.0, 1.0),  # exactly 4x b1: not more than 4x
        dtype_row(8, "flax", "int8", 451.0, 1.5),  # 4.1x b1
    ]
    got = [(r["target"], r["value"], r["met"]) for r in target_rows(rows)]
    source = "(goal for narrower weights)"
    assert got == [
        (f"b1 bfloat16 generate: >= 1.7x float32's tokens/s {source}", 1.7, True),
        (f"bfloat16 generate: batch 8 > 4x batch 1's tokens/s {source}", 4.0, False),
        (f"b1 int8 generate: >= 2.8x float32's tokens/s {source}", 2.75, False),
        (f"int8 generate: batch 8 > 4x batch 1's tokens/s {source}", 451.0 / 110.0, True),
    ]  # fmt: skip


@pytest.mark.quick
def test_layer_targets_of_hand_made_rows():
    def speed(case, tokens, mode, over_eager, over_sdpa, skipped=False):
        return make_row("speed", case, mode, "flax", "default", tokens=tokens, skipped=skipped,
                        ratio_vs_eager=over_eager, ratio_vs_sdpa=over_sdpa)  # fmt: skip

    rows = [
        speed("b8_t256", 256, "forward", 0.5, 0.85),  # below t1024: no milestone row; 0.85 meets
        speed("b8_t1024", 1024, "forward", 0.8, 0.86),  # 1.25x eager < 1.5x; 0.86 > 0.85
        speed("b8_t1024", 1024, "forward+backward", 0.5, 0.85),  # 2x eager; 0.85 meets its goal
        speed("b1_t4096", 4096, "forward", None, None, skipped=True),  # not measured: no rows
        make_row("memory", "b1_t8192", "forward", "flax", "default", tokens=8192, value=1499.0),
        make_row(
            "memory",
            "b1_t8192",
            "train step, dropout 0.1",
            "flax",
            "default",
            tokens=8192,
            value=1500.0,
        ),  # fmt: skip
        make_row("memory", "b1_t32768", "forward", "flax", "default", tokens=32768, skipped=True),
        make_row("decode", "b1_p16_n256", "generate", "flax", "generate", ratio=4.9),
        make_row("compile", "b1_t1024", "compile", "flax", "default", value=0.99),
    ]
    got = [(r["target"], r["value"], r["met"]) for r in target_rows(rows)]
    assert got == [
        ("b8_t256 forward: time / torch SDPA <= 0.85 (goal)", 0.85, True),
        ("b8_t1024 forward: >= 1.5x faster than torch eager (milestone)", 1.25, False),
        ("b8_t1024 forward: time / torch SDPA <= 0.85 (goal)", 0.86, False),
        ("b8_t1024 forward+backward: >= 1.5x faster than torch eager (milestone)", 2.0, True),
        ("b8_t1024 forward+backward: time / torch SDPA <= 0.85 (goal)", 0.85, True),
        ("b1 t8192 forward: peak growth < 1.5 GB", 1499.0, True),
        ("b1 t8192 train step, dropout 0.1: peak growth < 1.5 GB", 1500.0, False),
        ("b1 t32768 forward runs on this machine", None, False),
        ("b1_p16_n256 decode: >= 5x tokens/s of recomputing", 4.9, False),
        ("b1_t1024 default forward: compile < 1 s", 0.99, True),
    ]


def test_table_on_stdout(quick_run):
    stdout = quick_run.stdout
    for title in ("Machine", "Speed:", "Memory:", "Decode:", "Compile:", "Generate:", "Prefill:",
                  "Train:", "Annotated:", "Modern:", "Targets"):  # fmt: skip
        assert title in stdout, f"{title!r} missing from the printed table"


@pytest.mark.quick
def test_dtype_option_sets_the_speed_sections_dtype(capsys):
    assert build_config(parse_args(["--quick", "--dtype", "bfloat16"])).speed_dtype == "bfloat16"
    assert build_config(parse_args(["--quick"])).speed_dtype == "float32"
    with pytest.raises(SystemExit):
        parse_args(["--dtype", "float16"])
    assert "--dtype: invalid choice: 'float16'" in capsys.readouterr().err


def test_speed_rows_in_bfloat16_compare_with_torch_in_bfloat16_and_say_so():
    """One tiny forward in bfloat16: every callable, torch's two included, runs and matches the
    documents' module (also in bfloat16) within the bfloat16 bound, and every row's note names
    the dtype."""
    config = dataclasses.replace(QUICK, speed_dtype="bfloat16", speed_modes=("forward",))
    rows = speed.run(config)
    names = {r["implementation"] for r in rows if not r["skipped"]}
    assert {"eager", "sdpa", "reference", "xla", "blocked", "default"} <= names, rows
    for row in rows:
        assert row["note"].startswith("bfloat16"), row
        if not row["skipped"]:
            assert 0.0 <= row["max_rel_diff"] <= speed.TOLERANCE["bfloat16"], row
            assert math.isfinite(row["median_ms"]) and row["median_ms"] > 0, row


@pytest.mark.quick
def test_the_gpu_script_runs_its_steps_in_order_with_options_the_cli_takes():
    """``benchmarks/gpu.sh`` (no GPU here: its ``python -m benchmarks`` lines are read, not run):
    executable, generate first, the speed section in bfloat16 then float32, the train step
    last, each step's arguments accepted by ``parse_args`` and its limit within the 10 minutes."""
    import os
    import shlex

    from benchmarks.tests.helpers import ROOT

    script = ROOT / "benchmarks" / "gpu.sh"
    assert os.access(script, os.X_OK), f"{script} is not executable"
    text = script.read_text().replace("\\\n", " ")  # continued lines joined
    steps = [shlex.split(line)[1:] for line in text.splitlines() if line.startswith("step ")]
    assert [name for name, *_ in steps] == ["generate", "speed-bfloat16", "speed-float32", "train"]
    assert sum(int(limit) for _, limit, *_ in steps) <= 570  # 9.5 minutes, the checks first
    # float32 at highest matmul precision (torch's TF32 is off), bfloat16 at the default
    assert [precision for _, _, precision, *_ in steps] == ["highest", "default", "highest",
                                                            "highest"]  # fmt: skip
    parsed = [parse_args(["--no-progress", "--json", "x.json", *args]) for *_, args in
              [(step[:3], step[3:]) for step in steps]]  # fmt: skip
    assert [args.sections for args in parsed] == [("generate",), ("speed",), ("speed",), ("train",)]
    assert [args.dtype for args in parsed[1:3]] == ["bfloat16", "float32"]
    assert "nvidia-smi -L" in script.read_text()
