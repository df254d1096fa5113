"""``python -m conformance_tests``: the parity report on every backend present.

One row per case, check and dtype (the layers' and functions' cases, then the whole models'):
case, backend, dtype, check, max abs error, max rel error, tolerance, the bound the worst tensor
was held against (``tol * max(1, max|reference|)``) and its error over that bound, pass/fail.
Exits 1 if any row fails. ``--mesh 2x4`` runs the Flax side sharded over a device mesh (the
backend column says ``cpu[mesh 2x4]``; the whole models are skipped there).

The report needs torch (and matplotlib for ``--plots``): the ``report`` extra; the Qwen3 and
Llama 3 whole-model cases need the book's own package too (``llms_from_scratch``, installed
without its pins). Without them it prints what to install and exits 2, before importing any.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from conformance_tests.progress import progress_bar
from conformance_tests.spec import CHECKS, MODEL_CASES, select

if TYPE_CHECKING:
    from conformance_tests import harness

__all__ = ["main", "missing_requirements"]

#: How to install what the report needs, as the README says it (torch's CPU build first).
INSTALL = (
    "  pip install torch==2.13.0  # first: the CPU build (else pip may pull a multi-GB CUDA one)\n"
    "  pip install 'flax-attention[report]'  # or, in a clone: pip install -e '.[report]'"
)


#: The book's package (the torch side of the Qwen3 and Llama 3 cases), as the README installs
#: it: without its pins, which pull tensorflow (what it imports, torch and tiktoken, the
#: ``report`` extra has).
BOOK_INSTALL = "  pip install --no-deps llms-from-scratch==1.0.19"
BOOK_PACKAGE = "llms_from_scratch"
#: The whole models whose torch side is the book's package (``spec.ModelCase.model``).
BOOK_PACKAGE_MODELS = ("Qwen3Model", "Llama3Model")


def missing_requirements(plots: bool = False, book: bool = False) -> str | None:
    """``None`` when the report can run, else the message naming what is missing and how to
    install it (torch always; matplotlib for ``--plots``; ``book``, cases of
    ``BOOK_PACKAGE_MODELS`` selected: the book's package and tiktoken, which it imports)."""
    needed = ["torch"] + (["matplotlib"] if plots else [])
    needed += ["tiktoken", BOOK_PACKAGE] if book else []
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    what = " and ".join(missing)
    extras = [name for name in missing if name != BOOK_PACKAGE]
    why = "the 'report' extra" if extras else ""
    lines = [INSTALL] if extras else []
    if BOOK_PACKAGE in missing:
        why += (", " if why else "") + (
            "the book's package for the Qwen3 and Llama 3 cases (--cases may leave them out)"
        )
        lines.append(BOOK_INSTALL)
    return (
        f"python -m conformance_tests needs {what}, which {'is' if len(missing) == 1 else 'are'} "
        f"not installed ({why}). Install {'it' if len(missing) == 1 else 'them'} with:\n"
        + "\n".join(lines)
    )


def _needs_book(pattern: str | None) -> bool:
    """Whether the cases ``pattern`` selects include one whose torch side is the book's
    package."""
    return any(getattr(c, "model", None) in BOOK_PACKAGE_MODELS for c in select(pattern))


DTYPE_CHOICES = ("float32", "bfloat16", "float16")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m conformance_tests",
        description="Run the shared spec on torch_reference and flax_attention and compare.",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the rows as a JSON list")
    parser.add_argument(
        "--backend",
        action="append",
        choices=("cpu", "gpu", "tpu"),
        help="run only this backend (repeatable); default: every backend present",
    )
    parser.add_argument(
        "--dtype",
        action="append",
        choices=DTYPE_CHOICES,
        help="run only this dtype (repeatable); float32 runs every check, bfloat16/float16 run "
        "the Flax forward pass in that dtype against float32 torch; default: all three",
    )
    parser.add_argument(
        "--cases",
        metavar="PATTERN",
        help="glob over case names, e.g. 'doc_*'; 'model_*' runs the whole models "
        f"({', '.join(c.name for c in MODEL_CASES)}: forward, grad, train and bfloat16 "
        "rows)",
    )
    parser.add_argument(
        "--checks", metavar="LIST", help=f"comma-separated subset of {','.join(CHECKS)}"
    )
    parser.add_argument(
        "--precision",
        choices=("highest", "default"),
        default="highest",
        help="highest: float32 matmuls in full precision, TF32 off (default); default: the "
        "backend's own default (TF32 on NVIDIA GPUs, bf16 passes on TPU)",
    )
    parser.add_argument(
        "--mesh",
        metavar="DATAxMODEL",
        help="run the Flax side sharded over a (data, model) device mesh, e.g. 2x4: "
        "flax_attention.shard places each layer, inputs are split over data; rows say "
        "'cpu[mesh 2x4]'. On CPU, get N devices with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=N",
    )
    parser.add_argument(
        "--plots", metavar="DIR", help="write PNG heatmaps of the attention weights per layer"
    )
    parser.add_argument("--quiet", action="store_true", help="print only failures and summary")
    return parser.parse_args(argv)


def _format(row: harness.Row, backend_label: str) -> str:
    status = "PASS" if row.passed else "FAIL"
    return (
        f"{row.case:<30} {backend_label:<12} {row.dtype:<9} {row.check:<20} "
        f"{row.max_abs_err:>10.2e} {row.max_rel_err:>10.2e} {row.tol:>9.1e} "
        f"{row.bound:>9.2e} {row.err_over_bound:>9.2e}  {status}"
    )


#: ``bound``: the worst tensor's ``tol * max(1, max|reference|)``; ``err/bound``: its max abs
#: error over that bound (the row passes at most 1).
HEADER = (
    f"{'case':<30} {'backend':<12} {'dtype':<9} {'check':<20} "
    f"{'max_abs_err':>10} {'max_rel_err':>10} {'tol':>9} {'bound':>9} {'err/bound':>9}  result"
)


def _backends_to_run(args):
    """The backends ``args`` ask for, or the message of why not (bad ``--mesh``, none found)."""
    from conformance_tests import harness  # imported once torch is known to be present

    try:
        mesh = None if args.mesh is None else harness.parse_mesh(args.mesh)
        return harness.backends(args.backend, strict=args.precision == "highest", mesh=mesh), None
    except ValueError as error:
        return None, str(error)


def _plan(args):
    """``(case, check, dtype)`` triples to run, or the message of why the selection is empty or
    names an unknown check."""
    from conformance_tests import harness  # imported once torch is known to be present

    cases = select(args.cases)
    if not cases:
        return None, f"--cases ({args.cases!r}) matched no case"
    wanted = set(args.checks.split(",")) if args.checks else set(CHECKS)
    unknown = wanted - set(CHECKS)
    if unknown:
        return None, f"--checks ({','.join(sorted(unknown))}) must be in {CHECKS}"
    dtypes = tuple(args.dtype or DTYPE_CHOICES)
    plan = [(c, check, d) for c, check, d in harness.planned(cases, dtypes) if check in wanted]
    return plan, None


def _run_backend(backend, plan, workdir, quiet, skipped) -> list[harness.Row]:
    """The rows of ``plan`` on ``backend``, each printed as it comes (only failures if
    ``quiet``). A case that cannot run on the backend's mesh is printed once as SKIP and
    recorded in ``skipped`` (``(backend, case) -> reason``)."""
    from conformance_tests import harness  # imported once torch is known to be present

    label, rows = backend.label, []
    with progress_bar(len(plan), label) as bar:
        for case, check, dtype in plan:
            bar.update()  # one step per planned check, run or skipped
            if (label, case.name) not in skipped:
                with backend.scope():
                    reason = harness.mesh_skip_reason(case, backend)
                if reason is not None:
                    skipped[(label, case.name)] = reason
                    print(f"{case.name:<30} {label:<12} SKIP: {reason}", flush=True)
            if skipped.get((label, case.name)):
                continue
            bar.status(f"{case.name} {check} {dtype}")
            try:
                new = list(harness.run_case(case, check, backend, dtype, workdir))
            except Exception as error:  # noqa: BLE001 - one row says it; the other cases still run
                row = _error_row(case.name, label, check, dtype, error)
                rows.append(row)
                print(f"{case.name:<30} {label:<12} {dtype:<9} {check:<20} ERROR {row.worst}",
                      flush=True)  # fmt: skip
                continue
            for row in new:
                row.backend = label
                rows.append(row)
                if not quiet or not row.passed:
                    print(_format(row, label), flush=True)
    return rows


def _error_row(case: str, label: str, check: str, dtype: str, error: Exception) -> harness.Row:
    """A failed row for a check that raised (a compiler's refusal, say): no error measured
    (NaN), ``worst`` the exception's type and first line."""
    from conformance_tests import harness  # imported once torch is known to be present

    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    nan = float("nan")
    return harness.Row(case, label, dtype, check, nan, nan, nan, nan, nan, False,
                       worst=f"{type(error).__name__}: {first}"[:300])  # fmt: skip


def _write_outputs(args, rows) -> None:
    """``--json``: the rows; ``--plots``: the heatmaps."""
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump([r.as_dict() for r in rows], f, indent=1)
    if args.plots:
        from conformance_tests.plots import write_heatmaps

        with tempfile.TemporaryDirectory() as workdir:
            for path in write_heatmaps(args.plots, workdir):
                print(f"wrote {path}")


def main(argv=None) -> int:
    """The report: 0 if every row passes, 1 if one fails, 2 if nothing could run (what is
    missing, a bad option, or every case skipped on the mesh). ``diverge ...`` runs
    ``conformance_tests.divergence.main`` instead (a user's pair: where does it depart?)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["diverge"]:
        missing = missing_requirements()
        if missing:
            print(missing, file=sys.stderr)
            return 2
        from conformance_tests.divergence import main as diverge

        return diverge(argv[1:])
    args = parse_args(argv)
    missing = missing_requirements(plots=bool(args.plots), book=_needs_book(args.cases))
    if missing:
        print(missing, file=sys.stderr)
        return 2
    import jax

    jax.config.update("jax_numpy_rank_promotion", "raise")  # as in the tests
    plan, error = _plan(args)
    found, error = (None, error) if error else _backends_to_run(args)
    if error:
        print(error, file=sys.stderr)
        return 2
    rows = []
    skipped: dict[tuple[str, str], str] = {}  # (backend, case) -> why it cannot run sharded
    start = time.perf_counter()
    print(HEADER)
    with tempfile.TemporaryDirectory() as workdir:
        for backend in found:
            rows += _run_backend(backend, plan, workdir, args.quiet, skipped)
    failed = [r for r in rows if not r.passed]
    summary = f"{len(rows) - len(failed)} passed, {len(failed)} failed"
    if args.mesh:
        n_skipped = sum(1 for reason in skipped.values() if reason)
        summary += (
            f", {n_skipped} case(s) skipped (sizes that do not divide over the mesh, or whole "
            "models: one device only)"
        )
    print(f"\n{summary} ({time.perf_counter() - start:.1f} s)")
    _write_outputs(args, rows)
    if not rows:
        print("no case ran: every selected case was skipped on the mesh", file=sys.stderr)
        return 2
    return 1 if failed else 0
