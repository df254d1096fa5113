"""The shared spec under pytest: one test per case, check and dtype (ids are the case names),
and proof that every check can fail."""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import math
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import flax_attention as fa
import flax_attention.core as core
import torch_reference as tr
from conformance_tests import cli, harness, spec
from conformance_tests.layers import LAYER_SPECS
from conformance_tests.tests.conftest import OPTIMIZATION_LEVEL, ROOT
from conformance_tests.tolerances import TOLERANCES

CPU = harness.backends(["cpu"])[0]
PLAN = list(harness.planned(spec.CASES))


def _describe(rows) -> str:
    return "\n".join(
        f"{r.case} {r.check} {r.dtype}: max_abs_err {r.max_abs_err:.3e} (tol {r.tol:.1e}, "
        f"worst tensor {r.worst!r}) {'PASS' if r.passed else 'FAIL'}"
        for r in rows
    )


@pytest.mark.parametrize(
    ("case", "check", "dtype"),
    [
        pytest.param(*p, id=f"{p[0].name}-{p[1]}-{p[2]}", marks=_marks)
        for p in PLAN
        for _marks in [[pytest.mark.slow] if "large" in p[0].tags else []]
    ],
)
def test_spec_case(case, check, dtype, tmp_path):
    rows = harness.run_case(case, check, CPU, dtype, str(tmp_path))
    assert rows, f"{case.name} {check} {dtype} produced no row"
    assert all(r.passed for r in rows), _describe(rows)


@pytest.mark.quick
def test_every_case_name_is_unique_and_every_layer_covered():
    names = [c.name for c in spec.ALL_CASES]
    assert len(names) == len(set(names))
    assert spec.ALL_CASES == spec.CASES + spec.MODEL_CASES
    assert all(c.name.startswith("model_") for c in spec.MODEL_CASES)
    assert not [c.name for c in spec.CASES if c.name.startswith("model_")]
    models = {c.model for c in spec.MODEL_CASES}
    assert models == {"GPTModel", "annotated", "Qwen3Model", "Llama3Model"}
    assert {c.layer for c in spec.CASES} == set(spec.LAYERS) | set(spec.FUNCTIONS)
    assert set(spec.LAYERS) | set(spec.FUNCTIONS) == set(LAYER_SPECS)


def test_every_layer_spec_matches_both_packages():
    """The layer table says what the packages do: every name exists in both, the dropout rate
    sits where ``dropout_arg`` says (named ``dropout``), the constructor takes as many
    positional arguments as ``params`` names, and the outputs a call returns are counted."""
    for name, layer in LAYER_SPECS.items():
        for package in (tr, fa):
            target = getattr(package, name)
            if layer.is_function:
                continue
            params = list(inspect.signature(target.__init__).parameters)[1:]
            if layer.dropout_arg is not None:
                assert params[layer.dropout_arg] == "dropout", (name, package.__name__, params)
            assert len(layer.params) <= len(params), (name, params)
    first = {}  # one small case per layer: the call convention does not depend on sizes
    for case in spec.CASES:
        if "large" not in case.tags:
            first.setdefault(case.layer, case)
    assert set(first) == set(LAYER_SPECS)
    for case in first.values():
        tm, fm = harness.build_pair(case, None)
        inputs = harness.make_inputs(case)
        mask = harness.make_mask(case, inputs)
        with torch.no_grad():
            t_out = harness.call_torch(
                case,
                tm,
                [torch.from_numpy(x) for x in inputs],
                None if mask is None else torch.from_numpy(mask),
            )
        f_out = harness.call_flax(case, fm, [jnp.asarray(x) for x in inputs], mask)
        names = case.layer_spec.output_names
        assert len(t_out) == len(f_out) == len(names), (case.name, names)


@pytest.mark.quick
def test_each_tensor_is_held_to_its_own_bound_and_the_row_names_the_worst():
    """Worked by hand, tol 1e-5 (errors powers of two, exact in float32): ``big`` (max|ref| 100,
    bound 1e-3) errs 2^-11 = 4.9e-4, 0.49 of its bound; ``small`` (max|ref| 0.5, bound 1e-5: the
    scale is at least 1) errs 2^-17 = 7.6e-6, 0.76 of its bound. The row passes and its worst
    tensor is ``small``, although ``big`` has the larger error."""
    reference = {"big": np.array([100.0, -3.0]), "small": np.array([0.5, 0.0])}
    actual = {"big": np.array([100.0 + 2**-11, -3.0]), "small": np.array([0.5, 2**-17])}
    result = harness.compare(reference, actual, 1e-5)
    assert result.passed and result.worst == "small"
    assert result.max_abs_err == 2**-11
    assert result.max_rel_err == 2**-17 / 0.5  # small's; big's is 2^-11 / 100
    assert result.bound == pytest.approx(1e-5, rel=1e-12)
    assert result.err_over_bound == pytest.approx(2**-17 / 1e-5, rel=1e-12)
    actual["big"] = np.array([100.0 + 2**-9, -3.0])  # 2^-9 = 2.0e-3: past its own bound
    result = harness.compare(reference, actual, 1e-5)
    assert not result.passed and result.worst == "big"
    assert result.bound == pytest.approx(1e-3, rel=1e-12)
    assert result.err_over_bound == pytest.approx(2**-9 / 1e-3, rel=1e-12)


@pytest.mark.quick
def test_the_grad_check_rounds_each_operation_on_its_own(tmp_path):
    """The grad check compiles with XLA's fusion off (``grad.UNFUSED``): ``v1_wide``'s ``W_key``
    gradient, a float32 cancellation in a saturated softmax, keeps the row at 0.08 of its bound as
    op by op; fused, XLA rounds the chain together and it reaches 0.85 (docs/conformance.md)."""
    case = next(c for c in spec.CASES if c.name == "v1_wide")
    (row,) = harness.run_case(case, "grad", CPU, "float32", str(tmp_path))
    assert row.passed and row.err_over_bound < 0.3, _describe([row])


def test_the_report_passes_with_xlas_default_code_generation(tmp_path):
    """The suite compiles with LLVM's optimisation passes off (``conftest.TEST_CODEGEN``); the
    report a user runs compiles with XLA's defaults. The CLI's ``main`` in a process of its own
    with no level named in ``XLA_FLAGS``: ``v1_wide`` (the rounding-sensitive gradient above)
    and ``doc_mha_2heads`` (every check: forward, grad, dropout, train, mask; each dtype) pass,
    with ``v1_wide``'s gradient row as far inside its bound as op by op. (About 11 s.)"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    flags = env.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if not f.startswith(OPTIMIZATION_LEVEL))
    script = (
        "import os, sys\n"
        "assert 'xla_backend_optimization_level' not in os.environ['XLA_FLAGS']\n"
        "from conformance_tests import cli\n"
        "codes = [cli.main(['--quiet', '--cases', name, '--json', f'{sys.argv[1]}/{name}.json'])"
        "         for name in ('v1_wide', 'doc_mha_2heads')]\n"
        "sys.exit(max(codes))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    v1 = json.loads((tmp_path / "v1_wide.json").read_text())
    mha = json.loads((tmp_path / "doc_mha_2heads.json").read_text())
    assert all(r["passed"] for r in v1 + mha), [r for r in v1 + mha if not r["passed"]]
    checks = {r["check"].split("/")[0] for r in mha}
    assert checks == {"forward", "grad", "dropout", "train", "mask"}, checks
    assert {r["dtype"] for r in mha} == {"float32", "bfloat16", "float16"}
    (grad,) = [r for r in v1 if r["check"] == "grad"]
    assert grad["err_over_bound"] < 0.3, grad


# ---- every check can fail ---------------------------------------------------------------------


def _report(tmp_path, *argv):
    path = tmp_path / "report.json"
    code = cli.main(["--quiet", "--json", str(path), *argv])
    return code, json.loads(path.read_text())


@pytest.fixture
def corrupt_one_weight(monkeypatch):
    """Every Flax load adds 1e-2 to one entry of the first weight: a one-number porting bug."""
    original = fa.load_file

    def corrupted(module, path, strict=True):
        result = original(module, path, strict)
        first = next(iter(fa.state_dict(module)))
        value = fa.state_dict(module)[first]
        value.flat[0] += 1e-2
        fa.load_state_dict(module, {first: value}, strict=False)
        return result

    monkeypatch.setattr(fa, "load_file", corrupted)


@pytest.mark.parametrize("check", ["forward", "grad", "train", "dropout"])
def test_a_corrupted_weight_fails_the_report(corrupt_one_weight, tmp_path, check):
    pattern = "doc_mha_2heads" if check != "forward" else "doc_*"
    code, rows = _report(tmp_path, "--cases", pattern, "--checks", check, "--dtype", "float32")
    assert code == 1
    failed = [r for r in rows if not r["passed"]]
    assert failed, rows
    assert all(r["max_abs_err"] > r["tol"] for r in failed), failed
    assert all(r["err_over_bound"] > 1 for r in failed), failed  # the row says why it failed
    if check == "train":  # the parameter trajectory fails, not only the trained output
        optimisers = [r for r in rows if r["check"] != "train/key_bias"]
        assert optimisers and all(not r["passed"] for r in optimisers), optimisers
        assert all("@" in r["worst"] for r in optimisers), [r["worst"] for r in optimisers]


@pytest.mark.usefixtures("fresh_traces")
def test_a_wrong_scale_fails_the_report(monkeypatch, tmp_path):
    original = core._masked_softmax  # the softmax of every layer's reference path

    def wrong_scale(attn_scores, d_key, mask):  # sqrt(d_key + 1) instead of sqrt(d_key)
        return original(attn_scores, d_key + 1, mask)

    monkeypatch.setattr(core, "_masked_softmax", wrong_scale)
    code, rows = _report(tmp_path, "--cases", "doc_*", "--checks", "forward", "--dtype", "float32")
    assert code == 1
    assert {r["case"] for r in rows if not r["passed"]} >= {"doc_v1_seed123", "doc_mha_2heads"}


@pytest.mark.quick
@pytest.mark.usefixtures("fresh_traces")
def test_a_leaky_causal_mask_fails_the_mask_check(monkeypatch, tmp_path):
    from flax_attention.masking import AttentionMask

    def leaky(self, query_pos, key_pos):  # every key visible from every query
        return jnp.ones(jnp.broadcast_shapes(jnp.shape(query_pos), jnp.shape(key_pos)), bool)

    monkeypatch.setattr(AttentionMask, "visible", leaky)
    code, rows = _report(tmp_path, "--cases", "mha_odd_heads", "--checks", "mask")
    assert code == 1
    assert [r["passed"] for r in rows] == [False]


@pytest.mark.usefixtures("fresh_traces")
def test_a_bad_dropout_scale_fails_the_dropout_check(monkeypatch, tmp_path):
    from flax_attention._layers import Dropout  # the layers' nnx.Dropout

    original = Dropout.__call__

    def unscaled(self, x, *args, **kwargs):  # drops but forgets the 1 / (1 - p)
        out = original(self, x, *args, **kwargs)
        deterministic = kwargs.get("deterministic")
        deterministic = self.deterministic if deterministic is None else deterministic
        return out if deterministic else out * (1 - self.rate)

    monkeypatch.setattr(Dropout, "__call__", unscaled)
    code, rows = _report(tmp_path, "--cases", "doc_causal_batch", "--checks", "dropout")
    assert code == 1
    assert [r["check"] for r in rows if not r["passed"]] == ["dropout/stats"]


@pytest.mark.quick
def test_report_rows_have_the_api_fields(tmp_path):
    code, rows = _report(tmp_path, "--cases", "doc_v1_seed123", "--checks", "forward")
    assert code == 0
    expected = {"case", "backend", "dtype", "check", "max_abs_err", "max_rel_err", "tol", "passed"}
    assert rows and all(expected <= set(r) for r in rows)
    for r in rows:  # each row shows what tol was held against, and that it held
        assert r["bound"] >= r["tol"] and r["err_over_bound"] <= 1 and r["passed"], r
    assert {r["dtype"] for r in rows} == {"float32"}
    assert np.isfinite([r["max_abs_err"] for r in rows]).all()


# ---- the whole models -------------------------------------------------------------------------

#: The rows the whole-model cases give, in the report's order: ``(case, dtype, check)``.
MODEL_ROWS = [
    ("model_gpt_book", "float32", "forward"),
    ("model_gpt_book", "float32", "forward/int8"),
    ("model_gpt_book", "float32", "grad"),
    ("model_gpt_book", "float32", "train/adamw"),
    ("model_gpt_book", "float32", "train/key_bias"),
    ("model_gpt_book", "bfloat16", "forward"),
    ("model_gpt_book", "bfloat16", "forward/decode"),
    ("model_annotated_post", "float32", "forward"),
    ("model_annotated_post", "float32", "grad"),
    ("model_annotated_post", "float32", "train/adam"),
    ("model_annotated_post", "float32", "train/key_bias"),
    *(
        (name, dtype, check)
        for name in ("model_qwen3_book", "model_qwen3_moe_book", "model_llama3_book")
        for dtype, check in (
            ("float32", "forward"),
            ("float32", "grad"),
            ("float32", "train/adamw"),
            ("bfloat16", "forward"),
            ("bfloat16", "forward/decode"),
        )
    ),
]


def _twin_of(case):
    """The case's torch twin (weights as drawn: only its names are read)."""
    from conformance_tests import annotated_model, book_gpt, whole_models

    cfg = dict(case.config)
    if case.model == "GPTModel":
        return book_gpt.GPTModel(cfg)
    if case.model in ("Qwen3Model", "Llama3Model"):  # the book's package's (experts on meta)
        return whole_models._runner(case)._book(torch.float32)
    sizes = {k: cfg[k] for k in ("N", "d_model", "d_ff", "h")}
    return annotated_model.make_model(cfg["V"], cfg["V"], **sizes)


@pytest.fixture(scope="module")
def model_report(once_per_run):
    """``python -m conformance_tests --cases 'model_*'`` in this process, once per test run:
    ``(exit status, JSON rows, printed lines)``."""

    def run(out):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = cli.main(["--cases", "model_*", "--json", str(out / "report.json")])
        (out / "run.json").write_text(json.dumps([code, printed.getvalue()]))

    out = once_per_run("model_report", run)
    code, printed = json.loads((out / "run.json").read_text())
    return code, json.loads((out / "report.json").read_text()), printed.splitlines()


def test_the_whole_models_rows_pass_in_the_json_and_are_printed(model_report):
    code, rows, printed = model_report
    assert code == 0, "\n".join(printed)
    assert [(r["case"], r["dtype"], r["check"]) for r in rows] == MODEL_ROWS
    fields = set(inspect.signature(harness.Row).parameters)
    for r in rows:  # the layers' fields, each row within its own entry of the table
        assert set(r) == fields, r
        assert r["backend"] == "cpu", r
        if r["dtype"] == "bfloat16":  # 1.5 x torch's own bfloat16 error, a fraction of 6e-2
            assert 1e-3 < r["tol"] < TOLERANCES[("bfloat16", "forward")], r
        else:
            assert r["tol"] == TOLERANCES[("float32", r["check"].split("/")[0])], r
        assert r["passed"] and 0 < r["err_over_bound"] <= 1 and r["bound"] >= r["tol"], r
    parameters = {  # the twins' parameter names: the rows name tensors as torch does
        case.name: {n for n, _ in _twin_of(case).named_parameters()} for case in spec.MODEL_CASES
    }
    for r in rows:
        worst, names = r["worst"], parameters[r["case"]]
        if r["check"] == "grad":
            assert worst in names, r
        elif r["check"] == "train/key_bias":
            assert worst.startswith(("grad ", "output after new key biases")), r
        elif r["check"].startswith("train/"):
            tensor, _, step = worst.rpartition("@")
            assert worst.endswith("(trained)") or tensor in names | {"loss"}, r
            assert worst.endswith("(trained)") or 1 <= int(step) <= 20, r
    for row in rows:
        line = cli._format(harness.Row(**row), "cpu")
        assert line in printed, f"{line!r} not printed"
    assert f"{len(rows)} passed, 0 failed" in printed[-1]


@pytest.mark.quick
def test_the_model_train_rows_leave_out_only_the_key_biases():
    """The trajectories compare every parameter but the key projections' biases at each
    snapshot, and every step's loss; those biases are held by the ``train/key_bias`` row."""
    from conformance_tests import whole_models

    names = ["att.W_key.bias", "att.W_query.bias", "self_attn.linears.1.bias", "linears.0.bias"]
    snaps = [{n: np.zeros(2) for n in names}] * 2
    reference, actual = whole_models._trajectory(
        names, [3.0, 2.0], [3.0, 2.0], snaps, snaps, [1, 2]
    )
    expected = {"loss@1", "loss@2"} | {
        f"{n}@{at}" for n in ("att.W_query.bias", "linears.0.bias") for at in (1, 2)
    }
    assert set(reference) == set(actual) == expected


@pytest.mark.quick
def test_help_names_the_whole_model_cases(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "'model_*' runs the whole models" in text
    for case in spec.MODEL_CASES:
        assert case.name in text


@pytest.mark.usefixtures("fresh_traces")
def test_a_corrupted_model_weight_fails_the_model_rows(monkeypatch, tmp_path):
    """One entry of each model's first weight (past the token embedding, whose entry 0 only
    an input holding id 0 reads) off by 1e-2 when the Flax model is loaded: the float32 forward
    and grad rows of every case fail, and the report exits 1. The int8 row passes: the book's
    model there holds the int8 model's own (corrupted) weights."""
    from conformance_tests import whole_models

    original = fa.load_state_dict

    def corrupted(module, state, strict=True, **kwargs):
        state = dict(state)
        if strict:  # the whole model's load (the key-bias row loads a few biases, non-strict)
            first = next(k for k in state if state[k].ndim == 2 and "tok_emb" not in k)
            state[first] = state[first].copy()
            state[first].flat[0] += 1e-2
        return original(module, state, strict=strict, **kwargs)

    monkeypatch.setattr(whole_models.fa, "load_state_dict", corrupted)
    code, rows = _report(tmp_path, "--cases", "model_*", "--checks", "forward,grad")
    assert code == 1
    int8 = ("model_gpt_book", "float32", "forward/int8")
    forward_and_grad = {("float32", c) for c in ("forward", "forward/int8", "grad")}
    assert [(r["case"], r["dtype"], r["check"], r["passed"]) for r in rows] == [
        (*row, row == int8) for row in MODEL_ROWS if row[1:] in forward_and_grad
    ]
    assert all(r["err_over_bound"] > 1 for r in rows if r["check"] != "forward/int8"), rows


@pytest.mark.usefixtures("fresh_traces")
def test_an_int8_product_off_by_a_tenth_of_a_percent_fails_the_int8_row(monkeypatch, tmp_path):
    """The int8 row holds the quantized model's execution (the book's model holds its
    dequantized weights, so a corrupted load passes it): int8 products 0.1% off fail it alone."""
    from flax_attention.models.quantized import Int8Linear

    original = Int8Linear.__call__
    monkeypatch.setattr(Int8Linear, "__call__", lambda self, x, **kw: original(self, x) * 1.001)
    code, rows = _report(tmp_path, "--cases", "model_gpt*", "--checks", "forward")
    assert code == 1
    assert [(r["check"], r["passed"]) for r in rows] == [("forward", True), ("forward/int8", False)]


@pytest.mark.quick
def test_the_docs_list_every_whole_model_case_and_its_rows():
    """docs/conformance.md's table of the whole models names every case, and its printed rows
    are the rows the report gives, in its order."""
    import pathlib
    import re

    docs = pathlib.Path(__file__).resolve().parents[2] / "docs" / "conformance.md"
    section = docs.read_text().split("## The whole models\n", 1)[1].split("\n## ", 1)[0]
    table = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert table == [c.name for c in spec.MODEL_CASES], table
    printed = re.findall(r"^(model_\w+) +cpu +(float32|bfloat16) +(\S+) ", section, re.M)
    assert printed == MODEL_ROWS, printed


@pytest.mark.quick
def test_a_check_that_raises_fails_its_row_and_the_report_goes_on(monkeypatch, tmp_path, capsys):
    """A check that cannot run (on an H100, XLA refused to compile one float16 case) is one
    failed row naming the exception, not a traceback that ends the report."""
    original = harness.run_case

    def refusing(case, check, backend, dtype, workdir):
        if case.name == "doc_v1_seed123":
            raise ValueError("INVALID_ARGUMENT: Unsupported dot precision algorithm: 4\nmore")
        return original(case, check, backend, dtype, workdir)

    monkeypatch.setattr(harness, "run_case", refusing)
    code, rows = _report(tmp_path, "--cases", "doc_v[12]_*", "--checks", "forward",
                         "--dtype", "float32")  # fmt: skip
    assert code == 1
    [error] = [r for r in rows if not r["passed"]]
    assert error["case"] == "doc_v1_seed123" and error["check"] == "forward"
    assert error["worst"] == (
        "ValueError: INVALID_ARGUMENT: Unsupported dot precision algorithm: 4"
    )
    assert math.isnan(error["max_abs_err"])
    assert [r["passed"] for r in rows if r["case"] == "doc_v2_seed789"] == [True]
    out = capsys.readouterr().out
    assert "doc_v1_seed123" in out and "ERROR ValueError: INVALID_ARGUMENT" in out
    assert "1 passed, 1 failed" in out
