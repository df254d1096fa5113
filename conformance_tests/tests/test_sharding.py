"""Sharding over a device mesh, checked on virtual CPU devices in subprocesses.

``sharding_script.py`` runs with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (so this
pytest process keeps its single-device JAX) and writes one record per check; each test runs one
part of it and fails with the details of every failed record. Meshes ``(data, model)``: (8, 1),
(1, 8), (2, 4), (4, 2). The CLI's ``--mesh`` runs the same way.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from conformance_tests import cli, harness

ROOT = pathlib.Path(__file__).resolve().parents[2]
MESHES = ("8x1", "1x8", "2x4", "4x2")
MULTI_HEAD = ("MultiHeadAttention", "MultiHeadedAttention")


def run_with_devices(args, n_devices=8, timeout=300):
    """``python args...`` from the repository root with ``n_devices`` host CPU devices."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n_devices}"
    env["PYTHONPATH"] = str(ROOT)
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def run_part(part, tmp_path) -> list[dict]:
    path = tmp_path / f"{part}.json"
    done = run_with_devices(["-m", "conformance_tests.tests.sharding_script", part, str(path)])
    assert done.returncode == 0, f"sharding_script {part} failed:\n{done.stderr[-4000:]}"
    return json.loads(path.read_text())["records"]


def assert_all_passed(records, expected_counts: dict[str, int]):
    """Every kind of check ran as often as expected, and every record passed (else name them)."""
    counts = {kind: sum(r["check"] == kind for r in records) for kind in expected_counts}
    assert counts == expected_counts, "checks that did not run as often as expected"
    failed = [
        f"{r['check']} {r['layer']} mesh {r['mesh']}: max diff {r['max_diff']:.3e} {r['detail']}"
        for r in records
        if not r["passed"]
    ]
    assert not failed, "\n".join(failed)


def test_sharded_layers_equal_single_device(tmp_path):
    """Forward and gradients (every parameter, every input) within 1e-5 (times max(1, scale))
    of single-device (also with the blocked and XLA attention kernels); every parameter placed as
    its metadata says; the multi-head layers' compiled forward and backward have no all-gather
    (q/k/v stay split by heads)."""
    records = run_part("layers", tmp_path)
    covered = {(r["layer"], r["mesh"]) for r in records if r["check"] == "forward+grad"}
    four = ("MultiHeadAttention", "MultiHeadedAttention", "CausalAttention")
    four += ("MultiHeadAttentionWrapper",)
    assert {(layer, mesh) for layer in four for mesh in MESHES} <= covered
    others = ("SelfAttention_v1", "SelfAttention_v2")
    others += ("MultiHeadAttention[blocked]", "MultiHeadAttention[xla]")
    assert {(layer, "2x4") for layer in others} <= covered
    gathers = {(r["layer"], r["mesh"]) for r in records if r["check"] == "no_all_gather"}
    assert gathers == {(layer, mesh) for layer in MULTI_HEAD for mesh in ("1x8", "2x4", "4x2")} | {
        ("MultiHeadAttention[blocked]", "2x4"),
        ("MultiHeadAttention[xla]", "2x4"),
    }
    assert_all_passed(records, {"forward+grad": 20, "param_specs": 20, "no_all_gather": 8})


def test_sharded_decode_equals_single_device(tmp_path):
    """Token-by-token decode of the causal layers on every mesh: outputs and caches within 1e-5
    of single-device (which equals the full causal pass), caches placed by heads."""
    records = run_part("decode", tmp_path)
    layers = ("MultiHeadAttention", "CausalAttention", "MultiHeadAttentionWrapper")
    assert {(r["layer"], r["mesh"]) for r in records} == {(a, m) for a in layers for m in MESHES}
    assert_all_passed(records, {"decode": 12})


def test_placement_checkpoints_and_errors(tmp_path):
    """A mesh without ``model``/``data`` replicates; ``load_state_dict`` keeps shardings; orbax
    restores a checkpoint saved on one mesh onto another bit for bit; non-dividing heads,
    explicit mesh axes and non-meshes are refused, leaving the module untouched; ``shard`` under
    ``nnx.jit`` creates a placed layer; ``constrain`` places heads; the README's example runs."""
    records = run_part("placement", tmp_path)
    assert_all_passed(
        records,
        {
            "missing_axis": 2,
            "load_keeps_sharding": 1,
            "orbax_round_trip": 2,
            "error": 8,
            "created_under_jit": 1,
            "constrain": 1,
            "readme_example": 1,
        },
    )


def test_cli_runs_the_spec_on_a_mesh(tmp_path):
    """``--mesh 2x2``: rows say so and pass; a case whose heads do not divide is skipped, named.
    (Forward only: the sharded gradients are checked above, without the CLI's start-up.)"""
    path = tmp_path / "report.json"
    done = run_with_devices(
        ["-m", "conformance_tests", "--quiet", "--mesh", "2x2", "--cases", "*mha_[2o][hd]*"]
        + ["--dtype", "float32", "--checks", "forward", "--json", str(path)],
        n_devices=4,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = json.loads(path.read_text())
    assert [(r["case"], r["check"]) for r in rows] == [("doc_mha_2heads", "forward")]
    assert {r["backend"] for r in rows} == {"cpu[mesh 2x2]"}
    assert all(r["passed"] for r in rows), rows
    skip = "mha_odd_heads                  cpu[mesh 2x2] SKIP: num_heads (3) must be divisible by "
    assert skip + "the mesh's model axis (2)" in done.stdout
    assert "1 passed, 0 failed, 1 case(s) skipped" in done.stdout


def test_cli_mesh_errors_say_what_to_do(capsys):
    """In this process (one CPU device unless XLA_FLAGS says otherwise): a mesh larger than the
    devices present, and a malformed ``--mesh``, exit 2 with a message saying what to do."""
    n = len(jax.devices("cpu")) + 1
    with pytest.raises(ValueError, match=f"device_count={n} in the environment"):
        harness.make_mesh("cpu", (n, 1))
    assert cli.main(["--mesh", f"{n}x1", "--cases", "doc_mha_2heads"]) == 2
    err = capsys.readouterr().err
    assert f"mesh ({n}x1) must fit the cpu devices present ({n - 1}, {n} needed)" in err
    assert f"XLA_FLAGS=--xla_force_host_platform_device_count={n}" in err
    for text in ("2by4", "0x4", "2x"):
        assert cli.main(["--mesh", text]) == 2
        assert f"mesh ({text!r}) must be DATAxMODEL with positive sizes" in capsys.readouterr().err
