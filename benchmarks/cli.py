"""``python -m benchmarks``: the tables on stdout, progress on stderr, rows as JSON on request."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
import time

from benchmarks.config import FULL, QUICK, SECTIONS, parse_shape
from benchmarks.rows import make_row
from conformance_tests.cli import progress_bar

__all__ = [
    "DECODE_SPEEDUP_TARGET",
    "MODEL_TARGETS",
    "SPEED_TARGETS",
    "main",
    "parse_args",
    "targets",
]

#: The issue's goals for the default implementation, time / torch SDPA time per pass (the
#: ``targets`` rows and the speed chart's target lines both read them).
SPEED_TARGETS = {"forward": 0.9, "forward+backward": 1.0}
#: Decoding with the cache: at least this many times the tokens/s of recomputing the full pass.
DECODE_SPEEDUP_TARGET = 5.0
#: The whole model's goals, set by the project when flax_attention.models was benchmarked
#: (sections generate, prefill, train): generate's tokens/s over transformers' (the faster of
#: its eager and sdpa) at batch 1 and 8, batch 1's tokens/s as a fraction of the
#: weight-streaming bound, and prefill's and a training step's time over transformers' (sdpa).
MODEL_TARGETS = {
    "generate b1 / transformers": 1.5,
    "generate b1 / bound": 0.85,
    "generate b8 / transformers": 2.5,
    "prefill / transformers": 1.0,
    "train step / transformers": 1.0,
}
#: How the targets rows name where each goal comes from.
MODEL_TARGET_SOURCE = "project goal for the model"


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Time flax_attention.MultiHeadAttention (GPT-2 small) against torch.",
    )
    parser.add_argument("--json", metavar="PATH", help="also write machine, config and rows")
    parser.add_argument(
        "--charts",
        metavar="DIR",
        help="also draw DIR/<section>.png: each section's ratios (needs matplotlib)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 1-2 repeats (smoke)")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)",
    )
    parser.add_argument(
        "--shapes", metavar="LIST", help="speed shapes, e.g. b8t256,b1t4096 (default: the issue's)"
    )
    parser.add_argument(
        "--repeats", type=int, metavar="N", help="timed calls per measurement (all sections)"
    )
    parser.add_argument("--memory-tokens", metavar="LIST", help="e.g. 4096,8192,32768")
    parser.add_argument(
        "--memory-reference-max-tokens",
        type=int,
        metavar="T",
        help="largest t at which the materialising reference/eager forwards are measured",
    )
    parser.add_argument("--decode-batches", metavar="LIST", help="e.g. 1,8")
    parser.add_argument("--decode-steps", type=int, metavar="N", help="tokens generated")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="torch.set_num_threads (default: os.cpu_count())",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = parser.parse_args(argv)
    sections = tuple(s for s in args.sections.split(",") if s)
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections ({','.join(unknown)}) must be among {','.join(SECTIONS)}")
    args.sections = sections
    return args


def build_config(args):
    config = QUICK if args.quick else FULL
    changes = {}
    if args.shapes:
        changes["speed_shapes"] = tuple(parse_shape(s) for s in args.shapes.split(",") if s)
    if args.repeats:
        changes.update(
            speed_repeats={},
            default_repeats=args.repeats,
            decode_repeats=args.repeats,
            compile_repeats=args.repeats,
            generate_repeats=args.repeats,
            prefill_repeats=args.repeats,
            train_repeats=args.repeats,
        )
    if args.memory_tokens:
        changes["memory_tokens"] = _int_list(args.memory_tokens)
    if args.memory_reference_max_tokens is not None:
        changes["memory_reference_max_tokens"] = args.memory_reference_max_tokens
    if args.decode_batches:
        changes["decode_batches"] = _int_list(args.decode_batches)
    if args.decode_steps:
        changes["decode_steps"] = args.decode_steps
        positions = config.decode_flat_positions
        limit = config.decode_prompt + args.decode_steps - config.decode_flat_steps
        changes["decode_flat_positions"] = (
            positions[0],
            max(positions[0], min(positions[1], limit)),
        )
    return dataclasses.replace(config, **changes)


# ---- tables -------------------------------------------------------------------------------------


def _num(value, spec=".1f", missing="-"):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value, spec)


def _table(headers, lines) -> str:
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *lines)]
    out = ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths)).rstrip()]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(out)


def _impl(row):
    name = row["implementation"]
    resolved = row.get("resolved")
    return f"{name} ({resolved})" if resolved and resolved != name else name


def format_section(section: str, rows: list[dict]) -> str:
    rows = [r for r in rows if r["section"] == section]
    if section in ("generate", "prefill", "train"):
        return _section_module(section).format_rows(rows, _table)
    if section == "speed":
        headers = ["case", "mode", "framework", "implementation", "median ms", "min ms", "n",
                   "/eager", "/SDPA", "max diff (rel)", "note"]  # fmt: skip
        lines = [
            [r["case"], r["mode"], r["framework"], _impl(r), _num(r["median_ms"]),
             _num(r["min_ms"]), r["repeats"], _num(r["ratio_vs_eager"], ".2f"),
             _num(r["ratio_vs_sdpa"], ".2f"), _num(r["max_rel_diff"], ".1e"), r["note"]]
            for r in rows
        ]  # fmt: skip
        title = "Speed: median ms; /eager and /SDPA = time / torch time, same run (< 1 = faster)"
    elif section == "memory":
        headers = ["case", "mode", "framework", "implementation", "peak growth MB", "/SDPA",
                   "call s", "note"]  # fmt: skip
        lines = [
            [r["case"], r["mode"], r["framework"], r["implementation"], _num(r["value"], ".0f"),
             _num(r["ratio_vs_sdpa"], ".2f"),
             _num(None if r["median_ms"] is None else r["median_ms"] / 1e3, ".1f"), r["note"]]
            for r in rows
        ]  # fmt: skip
        title = (
            "Memory: peak RSS growth of one forward or training step (compile included), "
            "fresh process each"
        )
    elif section == "decode":
        headers = ["case", "mode", "framework", "implementation", "median ms", "n", "value",
                   "unit", "ratio", "ratio of", "max diff (rel)", "note"]  # fmt: skip
        lines = [
            [r["case"], r["mode"], r["framework"], r["implementation"], _num(r["median_ms"]),
             r["repeats"], _num(r["value"], ".2f"), r["unit"], _num(r["ratio"], ".2f"),
             r["ratio_of"] or "", _num(r["max_rel_diff"], ".1e"), r["note"]]
            for r in rows
        ]  # fmt: skip
        title = "Decode: generation with a cache vs torch KV-cache loop vs recomputing the pass"
    elif section == "compile":
        headers = ["case", "implementation", "compile s (median)", "n", "note"]
        lines = [
            [r["case"], r["implementation"], _num(r["value"], ".2f"), r["repeats"], r["note"]]
            for r in rows
        ]
        title = "Compile: jax.jit(f).lower(state, x).compile() wall time"
    else:
        headers = ["target", "measured", "met"]
        lines = [
            [r["target"], f"{_num(r['value'], '.2f')} {r['unit'] or ''}".strip(),
             {True: "yes", False: "NO", None: "-"}[r["met"]]]
            for r in rows
        ]  # fmt: skip
        title = "Targets (ratios from this run; not asserted by any test)"
    if not lines:
        return ""
    return f"{title}\n{_table(headers, lines)}\n"


# ---- targets ------------------------------------------------------------------------------------


def _find(rows, **match):
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def targets(rows: list[dict]) -> list[dict]:
    """Rows of section ``targets``: each issue target with the measured value and whether met."""
    out = []

    def add(target, value, unit, met, case=None):
        out.append(
            make_row("targets", case, None, "flax", "default", value=value, unit=unit,
                     target=target, met=met, skipped=value is None)
        )  # fmt: skip

    for mode in ("forward", "forward+backward"):
        for row in _find(rows, section="speed", implementation="default", mode=mode):
            if row["skipped"]:
                continue
            speedup = 1.0 / row["ratio_vs_eager"]
            if row["tokens"] >= 1024:
                add(f"{row['case']} {mode}: >= 1.5x faster than torch eager (milestone)",
                    speedup, "x", speedup >= 1.5, row["case"])  # fmt: skip
            goal = SPEED_TARGETS[mode]
            add(f"{row['case']} {mode}: time / torch SDPA <= {goal} (goal)",
                row["ratio_vs_sdpa"], "", row["ratio_vs_sdpa"] <= goal, row["case"])  # fmt: skip
    for row in _find(rows, section="memory", implementation="default"):
        if row["mode"] != "forward":
            value = row["value"]
            if row["tokens"] == 8192:
                add(f"b1 t8192 {row['mode']}: peak growth < 1.5 GB", value, "MB",
                    None if value is None else value < 1500.0, row["case"])  # fmt: skip
            continue
        if row["tokens"] == 8192:
            value = row["value"]
            add("b1 t8192 forward: peak growth < 1.5 GB", value, "MB",
                None if value is None else value < 1500.0, row["case"])  # fmt: skip
        if row["tokens"] == 32768:
            add("b1 t32768 forward runs on this machine", row["value"], "MB",
                not row["skipped"], row["case"])  # fmt: skip
    for row in _find(rows, section="decode", implementation="generate", mode="generate"):
        if not row["skipped"]:
            add(f"{row['case']} decode: >= {DECODE_SPEEDUP_TARGET:g}x tokens/s of recomputing",
                row["ratio"], "x", row["ratio"] >= DECODE_SPEEDUP_TARGET, row["case"])  # fmt: skip
    for row in _find(rows, section="compile", implementation="default"):
        add(f"{row['case']} default forward: compile < 1 s", row["value"], "s",
            row["value"] < 1.0, row["case"])  # fmt: skip
    _model_targets(rows, add)
    return out


def _model_targets(rows, add) -> None:
    """The ``MODEL_TARGETS`` rows, through ``targets``' ``add``."""
    source = MODEL_TARGET_SOURCE
    for row in _find(rows, section="generate", implementation="generate", mode="generate"):
        batch = row["batch"]
        if batch not in (1, 8):
            continue
        goal = MODEL_TARGETS[f"generate b{batch} / transformers"]
        speedup = min(row["ratio_vs_eager"], row["ratio_vs_sdpa"])
        add(f"{row['case']} generate: >= {goal:g}x the tokens/s of transformers' faster "
            f"attention ({source})", speedup, "x", speedup >= goal, row["case"])  # fmt: skip
    for row in _find(rows, section="generate", implementation="bound", batch=1):
        goal = MODEL_TARGETS["generate b1 / bound"]
        add(f"{row['case']} generate: >= {goal:g} of the weight-streaming bound ({source})",
            row["ratio"], "", row["ratio"] >= goal, row["case"])  # fmt: skip
    for section in ("prefill", "train"):
        goal = MODEL_TARGETS["prefill / transformers" if section == "prefill"
                             else "train step / transformers"]  # fmt: skip
        for row in _find(rows, section=section, framework="flax"):
            add(f"{row['case']} {row['mode']}: time / transformers' <= {goal:g} ({source})",
                row["ratio_vs_sdpa"], "", row["ratio_vs_sdpa"] <= goal, row["case"])  # fmt: skip


# ---- main ---------------------------------------------------------------------------------------


def _section_module(section):
    import importlib

    name = {"compile": "compile_time"}.get(section, section)
    return importlib.import_module(f"benchmarks.{name}")


def main(argv=None) -> int:
    args = parse_args(argv)
    config = build_config(args)
    if args.charts:  # before the run, not after it
        from benchmarks.charts import missing_matplotlib

        message = missing_matplotlib()
        if message:
            print(f"python -m benchmarks --charts: {message}", file=sys.stderr)
            return 2
    import torch

    from benchmarks.machine import describe, load_average

    torch.set_num_threads(args.torch_threads)
    started = time.perf_counter()
    machine = describe(args.torch_threads)
    arguments = sys.argv[1:] if argv is None else argv
    machine["command"] = "python -m benchmarks " + shlex.join(arguments)
    header = "\n".join(f"{key:<30} {value}" for key, value in machine.items())
    print(f"Machine\n{header}\n", flush=True)
    rows = []
    for section in args.sections:
        module = _section_module(section)
        total = module.plan_calls(config)
        with progress_bar(total, section, enabled=not args.no_progress) as bar:
            if section == "memory":
                new = module.run(config, bar, torch_threads=args.torch_threads)
            else:
                new = module.run(config, bar)
        rows += new
        print(format_section(section, new), flush=True)
    rows += targets(rows)
    print(format_section("targets", rows), flush=True)
    machine["load_average_end"] = load_average()
    machine["wall_s"] = round(time.perf_counter() - started, 1)
    print(f"load average at end: {machine['load_average_end']}; total {machine['wall_s']} s")
    if args.json:
        config_dict = dataclasses.asdict(config)
        config_dict["speed_repeats"] = {
            f"b{b}t{t}": n for (b, t), n in config.speed_repeats.items()
        }
        config_dict["speed_skip"] = {" ".join(map(str, k)): v for k, v in config.speed_skip.items()}
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "config": config_dict, "rows": rows}, f, indent=1)
    if args.charts:
        from benchmarks.charts import write_charts

        for path in write_charts(rows, args.charts, machine):
            print(f"chart: {path}", file=sys.stderr)
    return 0
