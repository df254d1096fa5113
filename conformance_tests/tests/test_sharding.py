"""Sharding over a device mesh, checked on 8 virtual CPU devices in a subprocess.

``sharding_script.py`` runs with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (so this
pytest process keeps its single-device JAX) and writes one record per check; each test here reads
the records of one kind and fails with their details. Meshes ``(data, model)``: (8, 1), (1, 8),
(2, 4), (4, 2).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MESHES = ("8x1", "1x8", "2x4", "4x2")


def run_with_devices(args, n_devices=8, timeout=300, **kwargs):
    """``python args...`` from the repository root with ``n_devices`` host devices."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n_devices}"
    env["PYTHONPATH"] = str(ROOT)
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharding") / "records.json"
    done = run_with_devices(["-m", "conformance_tests.tests.sharding_script", str(path)])
    assert done.returncode == 0, f"sharding_script failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    return json.loads(path.read_text())["records"]


def _of(records, check):
    found = [r for r in records if r["check"] == check]
    assert found, f"no {check} record: the script skipped the check"
    return found


def _failures(found):
    return "\n".join(
        f"{r['layer']} mesh {r['mesh']}: max diff {r['max_diff']:.3e} {r['detail']}"
        for r in found
        if not r["passed"]
    )


def test_forward_and_gradients_equal_single_device(records):
    found = _of(records, "forward+grad")
    covered = {(r["layer"], r["mesh"]) for r in found}
    for layer in (
        "MultiHeadAttention",
        "MultiHeadedAttention",
        "CausalAttention",
        "MultiHeadAttentionWrapper",
    ):
        assert {(layer, m) for m in MESHES} <= covered, layer
    assert {("SelfAttention_v1", "2x4"), ("SelfAttention_v2", "2x4")} <= covered
    assert all(r["passed"] for r in found), _failures(found)


def test_parameter_shardings_are_what_the_metadata_says(records):
    found = _of(records, "param_specs")
    assert len(found) == len(_of(records, "forward+grad"))
    assert all(r["passed"] for r in found), _failures(found)


def test_heads_stay_on_their_device(records):
    """Forward and backward of the multi-head layers compile without any all-gather."""
    found = _of(records, "no_all_gather")
    assert {(r["layer"], r["mesh"]) for r in found} == {
        (layer, mesh)
        for layer in ("MultiHeadAttention", "MultiHeadedAttention")
        for mesh in ("1x8", "2x4", "4x2")
    }
    assert all(r["passed"] for r in found), _failures(found)


def test_a_missing_mesh_axis_counts_as_size_one(records):
    found = _of(records, "missing_axis")
    assert len(found) == 2
    assert all(r["passed"] for r in found), _failures(found)


def test_load_state_dict_keeps_shardings(records):
    found = _of(records, "load_keeps_sharding")
    assert all(r["passed"] for r in found), _failures(found)


def test_orbax_restores_onto_another_mesh(records):
    found = _of(records, "orbax_round_trip")
    assert len(found) == 2
    assert all(r["passed"] for r in found), _failures(found)


def test_shard_refuses_what_it_cannot_place(records):
    found = _of(records, "error")
    assert len(found) == 7
    assert all(r["passed"] for r in found), _failures(found)
