"""``benchmarks.charts``: the data of each chart equals the rows' ratios, the PNGs of a run and of
a redraw from its JSON are the same, and without matplotlib both commands name the extra to
install.

The rows are the ``quick_run`` of ``conftest.py`` (``python -m benchmarks --quick --charts``,
once per test session), and hand-made rows where a case needs exact values.
"""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import charts, cli
from benchmarks.rows import make_row
from benchmarks.targets import (
    ANNOTATED_TARGETS,
    DECODE_SPEEDUP_TARGET,
    DTYPE_TARGETS,
    MODEL_TARGETS,
    SPEED_TARGETS,
)
from benchmarks.tests.helpers import HAVE_MATPLOTLIB

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _measured(rows, section):
    return [r for r in rows if r["section"] == section and not r["skipped"]]


def _bars(chart):
    return sum(v is not None for p in chart.panels for s in p.series for v in s.values)


def test_speed_chart_holds_each_rows_time_over_sdpa(quick_run):
    rows = quick_run.data["rows"]
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


def test_memory_decode_and_generate_charts_hold_the_rows_ratios(quick_run):
    rows = quick_run.data["rows"]
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
    tokens, bound, flatness, dtypes = generate.panels
    (flax,) = [r for r in _measured(rows, "generate") if r["framework"] == "flax"
               and r["mode"] == "generate"]  # fmt: skip
    assert tokens.value("eager", flax["case"]) == flax["ratio_vs_eager"]
    assert tokens.value("sdpa", flax["case"]) == flax["ratio_vs_sdpa"]
    assert bound.target == MODEL_TARGETS["generate b1 / bound"]
    for row in _measured(rows, "generate"):
        if row["implementation"] == "bound":
            assert bound.value("bound", row["case"]) == row["ratio"]
        elif row["mode"] == "dtype generate":
            name = f"{row['framework']} {row['implementation']}"
            if name == "flax float32":
                assert row["ratio"] == 1.0
            else:
                assert dtypes.value(name, row["case"]) == row["ratio"]
        elif row["ratio"] is not None:
            assert flatness.value(row["implementation"], row["case"]) == row["ratio"]
    float32 = {r["case"]: r["value"] for r in _measured(rows, "generate")
               if r["mode"] == "dtype generate" and r["framework"] == "flax"
               and r["implementation"] == "float32"}  # fmt: skip
    assert dtypes.value("flax int8", flax["case"]) == pytest.approx(
        [r for r in _measured(rows, "generate") if r["mode"] == "dtype generate"
         and r["implementation"] == "int8"][0]["value"] / float32[flax["case"]]
    )  # fmt: skip
    assert dtypes.target == DTYPE_TARGETS["bfloat16 b1 / float32"]
    assert [s.label for s in dtypes.series] == [
        "Flax bfloat16",
        "Flax int8",
        "transformers float32",
        "transformers bfloat16",
    ]
    # two over transformers, the bound, three flatness, four narrower weights
    assert _bars(generate) == 10

    for section, key in (("prefill", "prefill / transformers"),
                         ("train", "train step / transformers")):  # fmt: skip
        chart = charts.chart_data(rows, section)
        flax = [
            r
            for r in _measured(rows, section)
            if r["framework"] == "flax" and r["mode"] != "dtype prefill"
        ]  # against Flax float32: the targets' rows
        assert [p.title for p in chart.panels] == [r["mode"] for r in flax]
        for panel, row in zip(chart.panels, flax):
            assert panel.value(row["implementation"], row["case"]) == row["ratio_vs_sdpa"]
            assert panel.target == MODEL_TARGETS[key]
        assert _bars(chart) == len(flax)


def test_annotated_chart_holds_the_train_and_decode_ratios(quick_run):
    rows = quick_run.data["rows"]
    chart = charts.chart_data(rows, "annotated")
    train, decode = chart.panels
    (flax,) = [r for r in _measured(rows, "annotated") if r["mode"] == "train step"
               and r["framework"] == "flax"]  # fmt: skip
    assert train.value("train_step", flax["case"]) == flax["ratio_vs_eager"]
    assert train.target == ANNOTATED_TARGETS["train step / torch twin"]
    decoded = {r["implementation"]: r for r in _measured(rows, "annotated")
               if r["mode"] == "greedy decode"}  # fmt: skip
    for key in ("greedy_decode", "post_batched"):
        assert decode.value(key, decoded[key]["case"]) == decoded[key]["ratio"], key
    assert "post_per_row" not in {s.key for s in decode.series}  # the line at 1.0
    assert decode.target == ANNOTATED_TARGETS["greedy_decode / the post's loop per row"]
    assert _bars(chart) == 3


@pytest.mark.quick
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
    assert (panel.target, panel.baseline_label) == (SPEED_TARGETS["forward"], "torch SDPA")


def test_bad_chart_inputs_name_the_value(quick_run, tmp_path):
    rows = quick_run.data["rows"]
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


def test_caption_names_the_machine_and_the_command(quick_run):
    machine = quick_run.data["machine"]
    text = charts.caption(machine)
    for part in (machine["date"], machine["cpu"], f"jax {machine['jax']}", "--quick"):
        assert part in text, (part, text)
    assert charts.caption(None) == ""


def test_redraw_from_json_gives_the_same_data(quick_run):
    loaded = charts.load_results(quick_run.json_path)
    sections = charts.charted_sections(loaded["rows"])
    assert sections == [
        "speed", "memory", "decode", "generate", "prefill", "train", "annotated", "modern"
    ]  # fmt: skip
    for section in sections:
        again = charts.chart_data(loaded["rows"], section)
        assert again == charts.chart_data(quick_run.data["rows"], section), section


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib (the report extra) is not installed")
def test_charts_flag_writes_one_png_per_section_and_a_redraw_the_same(quick_run, tmp_path, capsys):
    written = sorted(p.name for p in quick_run.chart_dir.iterdir())
    assert written == [
        "annotated.png", "decode.png", "generate.png", "memory.png", "modern.png", "prefill.png",
        "speed.png", "train.png",
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


def test_charts_without_matplotlib_name_the_report_extra(monkeypatch, capsys, tmp_path, quick_run):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    results = tmp_path / "results.json"
    results.write_text(json.dumps(quick_run.data))
    assert charts.main([str(results), str(tmp_path / "out")]) == 2
    message = capsys.readouterr().err
    assert "need matplotlib, which is not installed (the 'report' extra)" in message
    assert not (tmp_path / "out").exists()
    # refused before running anything
    assert cli.main(["--quick", "--sections", "speed", "--charts", str(tmp_path / "out")]) == 2
    assert "the 'report' extra" in capsys.readouterr().err
    with pytest.raises(ModuleNotFoundError, match="'report' extra"):
        charts.draw(charts.chart_data(quick_run.data["rows"], "speed"), tmp_path / "x.png")
