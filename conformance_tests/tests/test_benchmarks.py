"""``python -m benchmarks --quick`` runs end to end and writes sound rows (no timing assertions).

One subprocess runs every section on tiny shapes; the test checks the JSON's structure, that
every measured time and quantity is finite and positive, and that the Flax outputs (and gradients,
generated tokens, the whole model's logits and training losses) recorded next to each timing
equal torch's: the values, not just the shapes.
The same run draws the charts (``--charts``, where matplotlib is installed); their data is checked
against the rows' ratios, and a redraw from the JSON against the run's own PNGs.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys
import types

import pytest

from benchmarks import ROW_FIELDS, charts
from benchmarks.targets import DECODE_SPEEDUP_TARGET, MODEL_TARGETS, SPEED_TARGETS, target_rows
from benchmarks.rows import make_row

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: Largest relative difference (max|flax - torch| / max(1, max|torch|)) a row may record; the
#: benchmarks refuse to time anything above 1e-4, float32 parity is ~1e-6 on these shapes.
MAX_REL_DIFF = 1e-5


HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One ``--quick`` run of every section: its JSON, stdout, stderr and chart folder (``None``
    without matplotlib, whose absence the run would refuse)."""
    folder = tmp_path_factory.mktemp("bench")
    path, chart_dir = folder / "quick.json", folder / "charts"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "benchmarks", "--quick", "--no-progress", "--json", str(path)]
    if HAVE_MATPLOTLIB:
        command += ["--charts", str(chart_dir)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"python -m benchmarks --quick failed:\n{done.stderr[-3000:]}"
    return types.SimpleNamespace(
        json_path=path,
        data=json.loads(path.read_text()),
        stdout=done.stdout,
        stderr=done.stderr,
        chart_dir=chart_dir if HAVE_MATPLOTLIB else None,
    )


@pytest.fixture(scope="module")
def report(quick_run):
    return quick_run.data, quick_run.stdout


def _measured(rows, section):
    return [r for r in rows if r["section"] == section and not r["skipped"]]


def test_rows_have_every_field_and_every_section(report):
    data, _ = report
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
        "targets",
    }, sections


def test_times_and_quantities_are_finite_and_positive(report):
    rows = report[0]["rows"]
    timed = [r for r in rows if r["section"] != "targets" and not r["skipped"]]
    assert timed, "no measured rows"
    for row in timed:
        name = f"{row['section']}/{row['case']}/{row['mode']}/{row['implementation']}"
        assert row["repeats"] >= 1, name
        assert math.isfinite(row["median_ms"]) and row["median_ms"] > 0, name
        if row["value"] is not None:
            assert math.isfinite(row["value"]) and row["value"] > 0, (name, row["value"])
    for section in ("memory", "decode", "compile", "generate", "prefill", "train"):
        assert _measured(rows, section), f"section {section} measured nothing"


def test_speed_covers_every_implementation_against_both_torch_modules(report):
    rows = _measured(report[0]["rows"], "speed")
    for mode in ("forward", "forward+backward"):
        names = {r["implementation"] for r in rows if r["mode"] == mode}
        assert {"eager", "sdpa", "reference", "xla", "blocked", "default"} <= names, (mode, names)
    for row in rows:
        assert math.isfinite(row["ratio_vs_eager"]) and row["ratio_vs_eager"] > 0
        assert math.isfinite(row["ratio_vs_sdpa"]) and row["ratio_vs_sdpa"] > 0
    eager = [r for r in rows if r["implementation"] == "eager"]
    assert all(r["ratio_vs_eager"] == 1.0 for r in eager)


def test_flax_equals_torch_in_every_compared_row(report):
    rows = report[0]["rows"]
    compared = [r for r in rows if r["max_rel_diff"] is not None and not r["skipped"]]
    flax_rows = [r for r in compared if r["framework"] == "flax"]
    # every flax speed row (outputs; gradients w.r.t. input and every parameter), generation,
    # the whole model's logits and its training losses
    assert {r["section"] for r in flax_rows} == {"speed", "decode", "prefill", "train"}
    assert any(r["mode"] == "forward+backward" for r in flax_rows)
    for row in compared:
        name = f"{row['section']}/{row['case']}/{row['mode']}/{row['implementation']}"
        assert 0.0 <= row["max_rel_diff"] <= MAX_REL_DIFF, f"{name}: {row['max_rel_diff']:.2e}"
        assert row["max_abs_diff"] <= MAX_REL_DIFF * 1e4, f"{name}: {row['max_abs_diff']:.2e}"


def test_memory_decode_and_compile_rows_measure_what_they_say(report):
    rows = report[0]["rows"]
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


def test_generate_rows_hold_tokens_bound_and_step_parts(report):
    rows = _measured(report[0]["rows"], "generate")
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


def test_prefill_and_train_rows_compare_flax_with_transformers(report):
    rows = report[0]["rows"]
    for section, modes in (("prefill", {"last-position logits", "all logits"}),
                           ("train", {"train step"})):  # fmt: skip
        measured = _measured(rows, section)
        assert {r["mode"] for r in measured} == modes
        for mode in modes:
            pair = {r["framework"]: r for r in measured if r["mode"] == mode}
            assert set(pair) == {"flax", "torch"}
            ratio = pair["flax"]["median_ms"] / pair["torch"]["median_ms"]
            assert pair["flax"]["ratio_vs_sdpa"] == pytest.approx(ratio)
            assert pair["flax"]["max_rel_diff"] is not None  # compared before timing
        goals = [r for r in _measured(rows, "targets") if r["case"] == measured[0]["case"]]
        assert len(goals) == len(modes)
        for goal in goals:
            assert goal["met"] == (goal["value"] <= 1.0)


def test_model_targets_of_hand_made_rows():
    def generate_row(batch, eager, sdpa):
        return make_row("generate", f"b{batch}", "generate", "flax", "generate", batch=batch,
                        ratio_vs_eager=eager, ratio_vs_sdpa=sdpa)  # fmt: skip

    rows = [
        generate_row(1, 1.6, 1.4),  # the faster transformers attention counts: 1.4 < 1.5
        generate_row(2, 9.0, 9.0),  # no goal at batch 2
        generate_row(8, 2.6, 2.7),
        make_row("generate", "b1", "weight-streaming bound", "flax", "bound", batch=1, ratio=0.9),
        make_row("prefill", "b1_t1024", "all logits", "flax", "GPTModel", ratio_vs_sdpa=1.0),
        make_row("train", "b8_t256", "train step", "flax", "train_step", ratio_vs_sdpa=1.01),
    ]
    got = [(r["case"], r["value"], r["met"]) for r in target_rows(rows)]
    assert got == [
        ("b1", 1.4, False), ("b8", 2.6, True), ("b1", 0.9, True), ("b1_t1024", 1.0, True),
        ("b8_t256", 1.01, False),
    ]  # fmt: skip
    text = [r["target"] for r in target_rows(rows)]
    assert all("project goal for the model" in t and "issue" not in t for t in text), text
    assert f">= {MODEL_TARGETS['generate b8 / transformers']:g}x" in text[1]


def test_table_on_stdout(report):
    _, stdout = report
    for title in ("Machine", "Speed:", "Memory:", "Decode:", "Compile:", "Generate:", "Prefill:",
                  "Train:", "Targets"):  # fmt: skip
        assert title in stdout, f"{title!r} missing from the printed table"


# ---- charts -------------------------------------------------------------------------------------


def _bars(chart):
    return sum(v is not None for p in chart.panels for s in p.series for v in s.values)


def test_speed_chart_holds_each_rows_time_over_sdpa(report):
    rows = report[0]["rows"]
    chart = charts.chart_data(rows, "speed")
    assert [p.title for p in chart.panels] == ["forward", "forward+backward"]
    charted = [r for r in _measured(rows, "speed") if r["implementation"] != "sdpa"]
    for row in charted:
        panel = chart.panels[["forward", "forward+backward"].index(row["mode"])]
        got = panel.value(row["implementation"], row["case"])
        assert got == row["ratio_vs_sdpa"], (row["mode"], row["implementation"], got)
    assert _bars(chart) == len(charted)  # one bar per row, torch SDPA being the line at 1.0
    for panel in chart.panels:
        assert panel.target == SPEED_TARGETS[panel.title]
        assert "sdpa" not in {s.key for s in panel.series}
        assert panel.series[0].key == "default", "the default leads"
        resolved = {r["resolved"] for r in charted if r["implementation"] == "default"}
        assert panel.series[0].label == f"default ({resolved.pop()})"


def test_memory_decode_and_generate_charts_hold_the_rows_ratios(report):
    rows = report[0]["rows"]
    memory = charts.chart_data(rows, "memory")
    ratios = [r for r in _measured(rows, "memory") if r["ratio_vs_sdpa"] is not None]
    assert [p.title for p in memory.panels] == ["forward"]  # training steps have no ratio
    for row in ratios:
        if row["implementation"] != "sdpa":
            assert (
                memory.panels[0].value(row["implementation"], row["case"]) == row["ratio_vs_sdpa"]
            )
    assert _bars(memory) == len(ratios) - 1

    decode = charts.chart_data(rows, "decode")
    speedup, flat = decode.panels
    assert (speedup.ylabel, speedup.target) == ("speedup over recompute", DECODE_SPEEDUP_TARGET)
    for row in _measured(rows, "decode"):
        if row["mode"] == "generate":
            assert speedup.value(row["implementation"], row["case"]) == row["ratio"]
    last = [r for r in _measured(rows, "decode") if r["unit"] == "ms/token"][-1]
    assert flat.ylabel == last["ratio_of"]
    assert flat.value("generate", last["case"]) == last["ratio"]
    assert _bars(decode) == 3  # generate and kv_cache over recompute; generate's flatness

    generate = charts.chart_data(rows, "generate")
    tokens, bound, flatness = generate.panels
    (flax,) = [r for r in _measured(rows, "generate") if r["framework"] == "flax"
               and r["mode"] == "generate"]  # fmt: skip
    assert tokens.value("eager", flax["case"]) == flax["ratio_vs_eager"]
    assert tokens.value("sdpa", flax["case"]) == flax["ratio_vs_sdpa"]
    assert bound.target == MODEL_TARGETS["generate b1 / bound"]
    for row in _measured(rows, "generate"):
        if row["implementation"] == "bound":
            assert bound.value("bound", row["case"]) == row["ratio"]
        elif row["ratio"] is not None:
            assert flatness.value(row["implementation"], row["case"]) == row["ratio"]
    assert _bars(generate) == 6  # two over transformers, the bound, three flatness

    for section in ("prefill", "train"):
        chart = charts.chart_data(rows, section)
        flax = [r for r in _measured(rows, section) if r["framework"] == "flax"]
        assert [p.title for p in chart.panels] == [r["mode"] for r in flax]
        for panel, row in zip(chart.panels, flax):
            assert panel.value(row["implementation"], row["case"]) == row["ratio_vs_sdpa"]
            assert panel.target == 1.0
        assert _bars(chart) == len(flax)


def test_chart_data_of_hand_made_rows():
    def speed(mode, implementation, ratio, resolved=None, skipped=False, case="b8_t256"):
        framework = "torch" if implementation in ("eager", "sdpa") else "flax"
        return make_row("speed", case, mode, framework, implementation, resolved=resolved,
                        ratio_vs_sdpa=None if skipped else ratio, skipped=skipped)  # fmt: skip

    rows = [
        speed("forward", "eager", 1.5),
        speed("forward", "sdpa", 1.0),
        speed("forward", "blocked", 1.25),
        speed("forward", "default", 0.75, resolved="native"),
        speed("forward", "blocked", None, skipped=True, case="b1_t4096"),
        speed("forward", "default", 0.5, resolved="native", case="b1_t4096"),
    ]
    (panel,) = charts.chart_data(rows, "speed").panels
    assert panel.groups == ("b8_t256", "b1_t4096")
    assert [(s.label, s.values) for s in panel.series] == [
        ("default (native)", (0.75, 0.5)),
        ("blocked", (1.25, None)),  # skipped: no bar
        ("torch eager", (1.5, None)),
    ]
    assert (panel.target, panel.baseline_label) == (0.9, "torch SDPA")


def test_bad_chart_inputs_name_the_value(report, tmp_path):
    rows = report[0]["rows"]
    for section in ("compile", "targets", "sped"):
        with pytest.raises(ValueError, match=f"section \\('{section}'\\) must be one with ratios"):
            charts.chart_data(rows, section)
    with pytest.raises(ValueError, match="no measured ratio of section \\('speed'\\)"):
        charts.chart_data([r for r in rows if r["section"] != "speed"], "speed")
    no_rows = tmp_path / "no_rows.json"
    no_rows.write_text(json.dumps({"machine": {}, "config": {}}))
    with pytest.raises(
        ValueError, match=r"no_rows.json \(\['config', 'machine'\]\) must hold a 'rows'"
    ):
        charts.load_results(no_rows)


def test_caption_names_the_machine_and_the_command(report):
    machine = report[0]["machine"]
    text = charts.caption(machine)
    for part in (machine["date"], machine["cpu"], f"jax {machine['jax']}", "--quick"):
        assert part in text, (part, text)
    assert charts.caption(None) == ""


def test_redraw_from_json_gives_the_same_data(quick_run):
    loaded = charts.load_results(quick_run.json_path)
    sections = charts.charted_sections(loaded["rows"])
    assert sections == ["speed", "memory", "decode", "generate", "prefill", "train"]
    for section in sections:
        again = charts.chart_data(loaded["rows"], section)
        assert again == charts.chart_data(quick_run.data["rows"], section), section


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib (the report extra) is not installed")
def test_charts_flag_writes_one_png_per_section_and_a_redraw_the_same(quick_run, tmp_path, capsys):
    written = sorted(p.name for p in quick_run.chart_dir.iterdir())
    assert written == [
        "decode.png", "generate.png", "memory.png", "prefill.png", "speed.png", "train.png"
    ]  # fmt: skip
    for name in written:
        data = (quick_run.chart_dir / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000, (name, len(data))
        assert f"chart: {quick_run.chart_dir / name}" in quick_run.stderr
    assert charts.main([str(quick_run.json_path), str(tmp_path)]) == 0
    assert capsys.readouterr().out.split() == [
        str(tmp_path / f"{s}.png") for s in charts.CHART_SECTIONS
    ]
    for name in written:  # the same data and caption draw the same pixels
        assert (tmp_path / name).read_bytes() == (quick_run.chart_dir / name).read_bytes(), name


def test_charts_without_matplotlib_name_the_report_extra(monkeypatch, capsys, tmp_path, report):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    results = tmp_path / "results.json"
    results.write_text(json.dumps(report[0]))
    assert charts.main([str(results), str(tmp_path / "out")]) == 2
    message = capsys.readouterr().err
    assert "need matplotlib, which is not installed (the 'report' extra)" in message
    assert not (tmp_path / "out").exists()
    from benchmarks import cli

    # refused before running anything
    assert cli.main(["--quick", "--sections", "speed", "--charts", str(tmp_path / "out")]) == 2
    assert "the 'report' extra" in capsys.readouterr().err
    with pytest.raises(ModuleNotFoundError, match="'report' extra"):
        charts.draw(charts.chart_data(report[0]["rows"], "speed"), tmp_path / "x.png")
