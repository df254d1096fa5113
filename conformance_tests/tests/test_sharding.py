"""Sharding over a device mesh, on 8 virtual CPU devices.

The tests themselves are ordinary pytest tests in ``sharded_tests.py``; JAX fixes its device
count when its backend starts, so they run in a pytest of their own, started here with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (this pytest keeps its single device). One
inner pytest runs the whole file, once per test run (``once_per_run``: one start-up, and the
one-device references and compilations its groups share are made once), with XLA's quick CPU
code generation (``QUICK_CODEGEN``); three tests here read its report, one per group of the
file's tests, and each fails with the inner report unless every test of its group ran and
passed. The CLI's ``--mesh`` runs the same way, with XLA's default code generation.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import jax
import pytest

from conformance_tests import cli, harness
from conformance_tests.tests.conftest import QUICK_CODEGEN

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHARDED_TESTS = "conformance_tests/tests/sharded_tests.py"

#: Group -> how many tests of ``sharded_tests.py`` it holds (so none is lost); ``group_of`` says
#: which group a test is in.
GROUPS = {
    # 4 layers x 4 meshes x 2 axis types + 5 others on 2x4, + GPTModel on 2x4 (3), + Qwen3 MoE
    "forward_grad": 46,
    "decode": 26,  # 3 decoders x 4 meshes x 2 axis types, + GPTModel's generate x 2
    "placement": 42,  # the rest: dropout, native (grouped too), placement, the annotated model x 2
}


def group_of(test_name: str) -> str:
    """``test_forward_and_gradients...`` -> forward_grad, ``test_decode...`` -> decode, the
    others -> placement."""
    if test_name.startswith("test_forward_and_gradients"):
        return "forward_grad"
    return "decode" if test_name.startswith("test_decode") else "placement"


def run_with_devices(args, n_devices=8, timeout=600, xla_flags=""):
    """``python args...`` from the repository root with ``n_devices`` host CPU devices (and
    ``xla_flags``)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n_devices} {xla_flags}".strip()
    env["PYTHONPATH"] = str(ROOT)
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def sharded_run(once_per_run):
    """The inner pytest of all of ``sharded_tests.py`` on 8 devices, once per test run:
    ``(returncode, report, summary, outcomes)``: its exit status, the end of its output, its
    last line (``109 passed in ...``) and each test's name -> ``passed``, ``failure``,
    ``error`` or ``skipped`` (from its JUnit XML report)."""

    def run(out):
        done = run_with_devices(
            ["-m", "pytest", SHARDED_TESTS, "-q", "-n", "0", "-p", "no:randomly", "-p"]
            + ["no:cacheprovider", "--junit-xml", str(out / "junit.xml")],
            xla_flags=QUICK_CODEGEN,  # both sides of each comparison are built in there
        )
        report = done.stdout[-8000:] + done.stderr[-2000:]
        summary = (done.stdout.strip().splitlines() or [""])[-1]
        (out / "run.json").write_text(json.dumps([done.returncode, report, summary]))

    out = once_per_run("sharded_tests", run)
    returncode, report, summary = json.loads((out / "run.json").read_text())
    outcomes = {}
    if (out / "junit.xml").exists():
        for case in ElementTree.parse(out / "junit.xml").iter("testcase"):
            kinds = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
            outcomes[case.get("name")] = kinds[0] if kinds else "passed"
    return returncode, report, summary, outcomes


@pytest.mark.parametrize("group", list(GROUPS))
def test_sharded_tests_pass_on_8_devices(sharded_run, group):
    """Forward, gradients and decode on meshes 8x1, 1x8, 2x4, 4x2 with Auto and Explicit axes
    equal one device within 1e-5; placement, checkpoints, refusals and the docs' example (see
    ``sharded_tests.py``): every test of the group ran and passed, and the inner run reported
    no skip, error or warning (a failure in another group fails that group's test only)."""
    returncode, report, summary, outcomes = sharded_run
    assert returncode in (0, 1), report  # 1: a test failed; anything else: the run did not
    ours = {name: outcome for name, outcome in outcomes.items() if group_of(name) == group}
    assert all(outcome == "passed" for outcome in ours.values()), f"{ours}\n{report}"
    assert len(ours) == GROUPS[group], f"{len(ours)} tests in {group}: {sorted(ours)}"
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (\w+)", summary)}
    assert set(counts) <= {"passed", "failed"}, summary
    assert sum(counts.values()) == sum(GROUPS.values()) == len(outcomes), summary


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


@pytest.mark.quick
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
