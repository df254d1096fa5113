"""``python -m benchmarks --quick`` runs end to end and writes sound rows (no timing assertions).

One subprocess runs every section on tiny shapes; the test checks the JSON's structure, that
every measured time and quantity is finite and positive, and that the Flax outputs (and gradients,
and generated tokens) recorded next to each timing equal torch's: the values, not just the shapes.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from benchmarks import ROW_FIELDS

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: Largest relative difference (max|flax - torch| / max(1, max|torch|)) a row may record; the
#: benchmarks refuse to time anything above 1e-4, float32 parity is ~1e-6 on these shapes.
MAX_REL_DIFF = 1e-5


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "quick.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--no-progress", "--json", str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"python -m benchmarks --quick failed:\n{done.stderr[-3000:]}"
    return json.loads(path.read_text()), done.stdout


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
    assert sections == {"speed", "memory", "decode", "compile", "generate", "targets"}, sections


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
    for section in ("memory", "decode", "compile"):
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
    # every flax speed row (outputs; gradients w.r.t. input and every parameter) and generation
    assert {r["section"] for r in flax_rows} == {"speed", "decode"}
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


def test_table_on_stdout(report):
    _, stdout = report
    for title in ("Machine", "Speed:", "Memory:", "Decode:", "Compile:", "Targets"):
        assert title in stdout, f"{title!r} missing from the printed table"
