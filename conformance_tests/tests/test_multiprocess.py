"""Past one process: the layers and the book's ``GPTModel`` on a mesh that spans 2 JAX
processes of 2 CPU devices each (gloo collectives on localhost), equal to one process.

One launch (``flax_attention.launch``, through the ``launch_processes`` fixture) runs
``multiprocess_checks.py`` in 2 processes: ``examples/multiprocess.py run``, then that file's
checks of what only a mesh over processes exercises (``place`` of an array already spread,
``global_batch`` without ``batch_size``, ``GPTModel`` called outside ``jit``), each process
writing what it saw. Meanwhile this pytest computes the one-process reference (``reference``:
one device), then compares (``compare``), so every figure is the example's own table
(``docs/sharding.md`` shows it). The rest of the file checks the pieces without a launch:
``place``, ``global_batch``'s refusals, and the launcher's own behaviour (a failing or hanging
process, process 0 included, ends the run and fails it, the group is killed).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import runpy
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_attention as fa
from conformance_tests.tests.conftest import QUICK_CODEGEN
from conformance_tests.tests.helpers import error_templates
from flax_attention import launch as launcher
from flax_attention.mesh import place
from flax_attention.sharding import check_data_over_processes, global_batch

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = runpy.run_path(str(ROOT / "examples" / "multiprocess.py"))
CHECKS = "conformance_tests/tests/multiprocess_checks.py"  # run, then checks, in each process

#: The example's table: case -> exact (bit for bit) or within 1e-5 * max(1, scale).
CASES = {}
for _kernel in EXAMPLE["KERNELS"]:
    for _axes in EXAMPLE["AXES"]:
        _label = f"layer[{_kernel},{_axes}]"
        CASES.update({f"{_label} forward": False, f"{_label} gradients": False})
        CASES[f"{_label} keep-mask"] = True
CASES.update(
    {
        "decode[explicit] fa.decode_loop": False,
        "gpt adamw losses": False,
        "gpt parameters after adamw": False,
        "gpt state_dict after adamw": False,
        "gpt greedy tokens": True,
        "gpt reloaded by load_file": True,
        "gpt reloaded by load_state_dict": True,
    }
)
CASES.update({f"load[{way}] on model-across-processes": True for way in EXAMPLE["LOAD_WAYS"]})
CASES.update({"orbax 1 process -> 2": True, "orbax 2 processes -> 1": True})


@pytest.fixture(scope="module")
def two_processes(once_per_run, launch_processes):
    """The example's three steps: the files and the reference here (one device), ``run`` and
    then ``multiprocess_checks.py``'s checks as 2 processes x 2 CPU devices with XLA's quick
    code generation (``QUICK_CODEGEN``; launched once the files exist, while the reference is
    computed), the comparison here (written as ``table.json``). Once per test run
    (``once_per_run``: under ``-n 2`` the other worker reads the same files). Returns the table,
    what process 0 wrote and what each process's checks saw (``[process 0's, process 1's]``)."""

    def three_steps(out):
        EXAMPLE["prepare"](out)
        command = [sys.executable, CHECKS, str(out)]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(
                launch_processes, command, out, 2, 2, 300, xla_flags=QUICK_CODEGEN
            )
            EXAMPLE["reference"](out)
            running.result()  # the launch's failure (every process's log), if it failed
        (out / "table.json").write_text(json.dumps(EXAMPLE["compare"](out)))

    out = once_per_run("multiprocess", three_steps)
    checks = [json.loads((out / f"checks_{i}.json").read_text()) for i in range(2)]
    return json.loads((out / "table.json").read_text()), dict(np.load(out / "run.npz")), checks


def test_the_run_spanned_two_processes_of_two_devices(two_processes):
    table, run, _ = two_processes
    assert run["devices"].tolist() == [2, 4]
    assert str(run["collectives"]) == "gloo"  # jax 0.10's CPU collectives between processes
    assert list(table) == list(CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_each_case_equals_one_process(two_processes, case):
    """Forward and gradients within 1e-5 * max(1, max|reference|), tensor by tensor; keep-masks,
    tokens, loaded weights and checkpoints bit for bit."""
    row = two_processes[0][case]
    assert row["passed"], f"{case}: {row}"
    if CASES[case]:
        assert row["exact"], f"{case}: {row}"
        assert row["max_abs_err"] == 0.0, f"{case}: {row}"


def test_a_model_placed_across_processes_holds_half_its_split_weights_per_process(two_processes):
    """On the mesh whose ``model`` axis spans the processes, each process holds half the bytes
    of every model-parallel weight, whichever way the checkpoint came in, and reads half of a
    weight it places split over ``model``."""
    table, run, _ = two_processes
    for way in EXAMPLE["LOAD_WAYS"]:
        assert table[f"load[{way}] on model-across-processes"]["held_fraction"] == 0.5, way
    assert float(run["read fraction"]) == 0.5  # place reads only this process's slices


def test_what_a_process_gets_wrong_is_refused_naming_the_numbers(two_processes):
    _, run, _ = two_processes
    assert str(run["refused[local batch]"]) == (
        "local.shape[0] (3) must be this process's share of the batch (2): batch_size 4 over "
        "the data axis (2), 1 slice(s) here"
    )
    own = "mesh (2 devices, {'model': 2}) must span every device of the 2 processes (4 devices)"
    assert str(run["refused[shard on own devices]"]) == own
    assert str(run["refused[global_batch on own devices]"]) == own
    listed = error_templates("Meshes and processes")
    for name in ("local batch", "shard on own devices"):
        message = str(run[f"refused[{name}]"])
        assert any(t.match(message) for t in listed), f"{message!r} is not in docs/errors.md"


def _checks_saw(two_processes, check: str) -> list[dict]:
    """What ``multiprocess_checks.py``'s ``check`` saw, in process 0 and in process 1; fails
    with the error a check raised."""
    seen = [checks[check] for checks in two_processes[2]]
    for process, got in enumerate(seen):
        assert "raised" not in got, f"process {process}: {got['raised']}"
    return seen


def test_place_moves_an_array_spread_over_processes_to_another_layout(two_processes):
    """``place`` of a ``jax.Array`` split over ``data`` across the processes, asked for
    columns over ``model`` and for replicated: the new layout each time, the same values."""
    for got in _checks_saw(two_processes, "place moves a spread array"):
        assert got == {
            "spread": True,
            "columns": {"as asked": True, "equal": True},
            "replicated": {"as asked": True, "equal": True},
        }, got


def test_global_batch_without_batch_size_assembles_each_process_s_rows(two_processes):
    """``global_batch(local, mesh)``: each process's rows (of its ``data`` slices) make the
    global ``(8, 3)`` batch, split over ``data``: one slice per process (``data`` 2 across the
    processes), two per process (``data`` 4), the same two in both (``data`` inside each)."""
    rows = {"data 2 x model 2": 4, "data 4": 4, "model 2 x data 2": 8}
    for got in _checks_saw(two_processes, "global_batch without batch_size"):
        want = {
            mesh: {"local rows": n, "shape": [8, 3], "over data": True, "equal": True}
            for mesh, n in rows.items()
        }
        assert got == want, got


def test_gpt_called_outside_jit_on_a_batch_over_processes_equals_one_device(two_processes):
    """Eagerly (no ``jit``) on token ids and a padding mask spread over both processes, the
    sharded model's logits equal one device's within ``1e-5 * max(1, scale)``; an id out of
    range, or a mask value of 2, in process 0's rows only is refused in both processes with
    the one-process message (the check reads the whole batch in each)."""
    for got in _checks_saw(two_processes, "gpt outside jit on a spread batch"):
        assert got["ids spread"] and got["logits spread"], got
        for name in ("logits", "masked"):
            row = got[name]
            assert row["shape"] == [4, 8, EXAMPLE["CFG"]["vocab_size"]], (name, row)
            assert row["max_abs_err"] <= 1e-5 * max(1.0, row["scale"]), (name, row)
        assert got["refused ids"] == "in_idx (ids 2..64) must lie in 0..63 (vocab_size)"
        assert got["refused mask"] == "attention_mask (values [0, 1, 2]) must hold only 0 and 1"


# ---- without a launch -------------------------------------------------------------------------


@pytest.mark.quick
def test_global_batch_checks_the_share_and_the_batch_size():
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    batch = global_batch(x, mesh, batch_size=4)
    np.testing.assert_array_equal(np.asarray(batch), x)
    assert batch.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)
    with pytest.raises(ValueError) as error:
        global_batch(x, mesh, batch_size=6)
    assert str(error.value) == (
        "local.shape[0] (4) must be this process's share of the batch (6): batch_size 6 over the "
        "data axis (1), 1 slice(s) here"
    )
    with pytest.raises(ValueError, match=r"^local \(shape \(\)\) must have a batch axis first$"):
        global_batch(np.float32(1.0), mesh)
    with pytest.raises(TypeError, match="must be a jax.sharding.Mesh"):
        global_batch(x, (1, 1))


@pytest.mark.quick
def test_processes_that_do_not_divide_the_data_axis_are_refused():
    """Two processes of three devices on a ``(3, 2)`` mesh share data slice 1; two of two on
    ``(2, 2)`` (slices apart) or ``(1, 4)`` (both feed the one slice) are fine."""
    check_data_over_processes(2, {0: (0,), 1: (1,)})
    check_data_over_processes(1, {0: (0,), 1: (0,)})
    check_data_over_processes(4, {0: (0, 2), 1: (1, 3)})
    with pytest.raises(ValueError) as error:
        check_data_over_processes(3, {0: (0, 1), 1: (1, 2)})
    assert str(error.value) == (
        "the mesh's data axis (3) must be divisible by the processes along it (2): process 0 "
        "holds data slices [0, 1], process 1 [1, 2]"
    )
    with pytest.raises(ValueError, match=r"data axis \(3\) must be divisible .* \(2\)"):
        check_data_over_processes(3, {0: (0, 1), 1: (2,)})


@pytest.mark.quick
def test_place_reads_each_slice_once_and_carries_typed_keys():
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    source = EXAMPLE["CountingSource"](np.arange(6, dtype=np.float64).reshape(2, 3))
    placed = place(source, NamedSharding(mesh, P("data")))
    assert placed.dtype == np.float32  # float64 is float32 without x64, as device_put makes it
    np.testing.assert_array_equal(np.asarray(placed), source.value)
    assert source.read == 6  # once, whole: one device holds it all
    key = jax.random.key(7)
    placed_key = place(key, NamedSharding(mesh, P()))
    assert jax.random.key_impl(placed_key) == jax.random.key_impl(key)
    np.testing.assert_array_equal(jax.random.key_data(placed_key), jax.random.key_data(key))
    again = place(placed, placed.sharding)  # a jax.Array on this process's devices
    assert again.sharding == placed.sharding
    np.testing.assert_array_equal(np.asarray(again), source.value)


@pytest.mark.quick
def test_shard_places_an_abstract_model_where_a_load_then_puts_each_tensor():
    """``fa.shard`` of an abstract (``nnx.eval_shape``) layer gives every parameter its
    sharding without drawing a value; ``load_state_dict`` then places each tensor there."""
    from flax import nnx

    mesh = jax.make_mesh((1, 1), ("data", "model"))
    made = fa.MultiHeadAttention(4, 4, 3, 0.0, num_heads=2, rngs=nnx.Rngs(0))
    abstract = fa.shard(
        nnx.eval_shape(lambda: fa.MultiHeadAttention(4, 4, 3, 0.0, num_heads=2, rngs=nnx.Rngs(1))),
        mesh,
    )
    kernel = abstract.W_query.kernel.get_value()
    assert isinstance(kernel, jax.ShapeDtypeStruct)
    assert kernel.sharding == NamedSharding(mesh, P(None, "model"))
    fa.load_state_dict(abstract, fa.state_dict(made))
    loaded = abstract.W_query.kernel[...]
    assert loaded.sharding == NamedSharding(mesh, P(None, "model"))
    np.testing.assert_array_equal(np.asarray(loaded), np.asarray(made.W_query.kernel[...]))


@pytest.mark.quick
def test_the_launcher_refuses_bad_counts_and_an_empty_command():
    with pytest.raises(ValueError, match=r"^processes \(0\) must be positive \(an integer >= 1\)$"):
        launcher.launch(["true"], 0)
    message = r"^devices_per_process \(True\) must be an int \(a positive integer\)$"
    with pytest.raises(TypeError, match=message):
        launcher.launch(["true"], 2, True)
    with pytest.raises(TypeError, match=r"^processes \(1.5\) must be an int \(a positive"):
        launcher.launch(["true"], 1.5)
    with pytest.raises(ValueError, match=r"^command \(\[\]\) must name a program to run$"):
        launcher.launch([], 2)


@pytest.mark.quick
def test_the_launcher_sets_each_process_its_variables(tmp_path):
    code = (
        "import os; e = os.environ; print(e['FLAX_ATTENTION_COORDINATOR'], "
        "e['FLAX_ATTENTION_NUM_PROCESSES'], e['FLAX_ATTENTION_PROCESS_ID'], "
        "e['JAX_NUM_CPU_DEVICES'], e['JAX_PLATFORMS'])"
    )
    result = launcher.launch([sys.executable, "-c", code], 2, 3, log_dir=tmp_path, timeout=60)
    assert result.ok, result
    lines = [(tmp_path / f"process_{i}.log").read_text().split() for i in range(2)]
    assert lines[0][0] == lines[1][0] and lines[0][0].startswith("localhost:")
    assert [line[1:] for line in lines] == [["2", "0", "3", "cpu"], ["2", "1", "3", "cpu"]]


@pytest.mark.quick
def test_a_failing_process_ends_the_run_and_its_group_is_killed(tmp_path):
    """Process 1 fails at once; process 0 (which would sleep 60 s, and has a child of its own
    doing the same) is killed with its child: the run ends in seconds, not a minute."""
    marker = tmp_path / "grandchild.pid"
    code = (
        "import os, subprocess, sys, time\n"
        "if os.environ['FLAX_ATTENTION_PROCESS_ID'] == '1': sys.exit(3)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(marker)!r}, 'w').write(str(child.pid)); time.sleep(60)\n"
    )
    start = time.monotonic()
    result = launcher.launch([sys.executable, "-c", code], 2, log_dir=tmp_path, timeout=120)
    assert time.monotonic() - start < 30
    assert not result.ok and not result.timed_out
    assert result.returncodes[1] == 3 and result.returncodes[0] < 0 and result.failed == 1, result
    if marker.exists():  # process 0 got as far as starting its child: killed with it
        pid = int(marker.read_text())
        for _ in range(100):
            if not _alive(pid):
                break
            time.sleep(0.05)
        assert not _alive(pid), "the failing run left a grandchild running"


#: Process 0 exits 3 at once; process 1 would sleep 60 s (killed).
FIRST_FAILS = (
    "import os, sys, time\n"
    "if os.environ['FLAX_ATTENTION_PROCESS_ID'] == '0': sys.exit(3)\n"
    "time.sleep(60)\n"
)


@pytest.mark.quick
def test_a_failure_of_process_0_fails_the_run(tmp_path):
    """Process 0 is a process like the others: its failure ends the run in seconds (process 1
    killed) and is reported as ``failed == 0``, not ``ok``."""
    start = time.monotonic()
    result = launcher.launch([sys.executable, "-c", FIRST_FAILS], 2, log_dir=tmp_path, timeout=20)
    assert time.monotonic() - start < 15, result
    assert not result.ok and not result.timed_out, result
    assert result.failed == 0 and result.returncodes[0] == 3 and result.returncodes[1] < 0, result


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = pathlib.Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split()[2] == "Z")  # a zombie is dead


def test_a_hanging_run_times_out_and_is_killed(tmp_path):
    start = time.monotonic()
    result = launcher.launch(
        [sys.executable, "-c", "import time; time.sleep(60)"], 2, log_dir=tmp_path, timeout=1
    )
    assert time.monotonic() - start < 20
    assert result.timed_out and not result.ok
    assert all(code < 0 for code in result.returncodes), result


def test_the_command_line_exits_with_the_failing_process_s_status(capsys):
    """``python -m flax_attention.launch``: the failing process's own status (the others are
    killed), process 0's as any other's, 124 on a timeout, 0 when every process succeeds."""
    fail = "import os, sys, time; sys.exit(5) if os.environ['FLAX_ATTENTION_PROCESS_ID'] == '1' "
    fail += "else time.sleep(60)"
    assert launcher.main(["--processes", "2", "--", sys.executable, "-c", fail]) == 5
    assert "process 1 exited with 5; the others were killed" in capsys.readouterr().err
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    assert launcher.main(["--processes", "2", "--timeout", "1", "--", *sleep]) == 124
    assert "timed out after 1 s; every process was killed" in capsys.readouterr().err
    assert launcher.main(["--processes", "2", "--", sys.executable, "-c", "pass"]) == 0
    first = ["--processes", "2", "--timeout", "20", "--", sys.executable, "-c", FIRST_FAILS]
    assert launcher.main(first) == 3
    assert "process 0 exited with 3; the others were killed" in capsys.readouterr().err


@pytest.mark.quick
def test_initialize_names_a_variable_that_is_not_a_number(monkeypatch):
    monkeypatch.setenv(launcher.COORDINATOR, "localhost:1")
    monkeypatch.setenv(launcher.NUM_PROCESSES, "two")
    monkeypatch.setenv(launcher.PROCESS_ID, "0")
    with pytest.raises(ValueError) as error:
        launcher.initialize()
    assert str(error.value) == (
        "FLAX_ATTENTION_NUM_PROCESSES ('two') must be a non-negative integer when "
        "FLAX_ATTENTION_COORDINATOR is set"
    )
