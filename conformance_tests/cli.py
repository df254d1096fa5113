"""``python -m conformance_tests``: the parity report on every backend present.

One row per case, check and dtype: case, backend, dtype, check, max abs error, max rel error,
tolerance, pass/fail. Exits 1 if any row fails. ``--mesh 2x4`` runs the Flax side sharded over a
device mesh (the backend column says ``cpu[mesh 2x4]``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from tqdm import tqdm

from conformance_tests import harness
from conformance_tests.spec import CHECKS, select

__all__ = ["main"]

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
    parser.add_argument("--cases", metavar="PATTERN", help="glob over case names, e.g. 'doc_*'")
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
        f"{row.max_abs_err:>10.2e} {row.max_rel_err:>10.2e} {row.tol:>9.1e}  {status}"
    )


HEADER = (
    f"{'case':<30} {'backend':<12} {'dtype':<9} {'check':<20} "
    f"{'max_abs_err':>10} {'max_rel_err':>10} {'tol':>9}  result"
)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    jax.config.update("jax_numpy_rank_promotion", "raise")  # as in the tests
    cases = select(args.cases)
    if not cases:
        print(f"--cases ({args.cases!r}) matched no case", file=sys.stderr)
        return 2
    if args.checks:
        wanted = set(args.checks.split(","))
        unknown = wanted - set(CHECKS)
        if unknown:
            print(f"--checks ({','.join(sorted(unknown))}) must be in {CHECKS}", file=sys.stderr)
            return 2
    try:
        mesh = None if args.mesh is None else harness.parse_mesh(args.mesh)
        found = harness.backends(args.backend, strict=args.precision == "highest", mesh=mesh)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    dtypes = tuple(args.dtype or DTYPE_CHOICES)
    plan = [
        (case, check, dtype)
        for case, check, dtype in harness.planned(cases, dtypes)
        if not args.checks or check in wanted
    ]
    rows: list[harness.Row] = []
    skipped: dict[tuple[str, str], str] = {}  # (backend, case) -> why it cannot run sharded
    start = time.perf_counter()
    print(HEADER)
    with tempfile.TemporaryDirectory() as workdir:
        for backend in found:
            label = backend.label
            progress = tqdm(plan, desc=f"{label}", unit="check", file=sys.stderr, leave=False)
            for case, check, dtype in progress:
                if (label, case.name) not in skipped:
                    with backend.scope():
                        reason = harness.mesh_skip_reason(case, backend)
                    if reason is not None:
                        skipped[(label, case.name)] = reason
                        tqdm.write(f"{case.name:<30} {label:<12} SKIP: {reason}")
                if skipped.get((label, case.name)):
                    continue
                progress.set_postfix_str(f"{case.name} {check} {dtype}")
                for row in harness.run_case(case, check, backend, dtype, workdir):
                    row.backend = label
                    rows.append(row)
                    if not args.quiet or not row.passed:
                        tqdm.write(_format(row, label))
            progress.close()
    failed = [r for r in rows if not r.passed]
    elapsed = time.perf_counter() - start
    n_skipped = sum(1 for reason in skipped.values() if reason)
    summary = f"{len(rows) - len(failed)} passed, {len(failed)} failed"
    if args.mesh:
        summary += f", {n_skipped} case(s) skipped (sizes that do not divide over the mesh)"
    print(f"\n{summary} ({elapsed:.1f} s)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump([r.as_dict() for r in rows], f, indent=1)
    if args.plots:
        from conformance_tests.plots import write_heatmaps

        with tempfile.TemporaryDirectory() as workdir:
            for path in write_heatmaps(args.plots, workdir):
                print(f"wrote {path}")
    if not rows:
        print("no case ran: every selected case was skipped on the mesh", file=sys.stderr)
        return 2
    return 1 if failed else 0
