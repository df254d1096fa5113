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

from benchmarks.charts import missing_matplotlib, write_charts
from benchmarks.config import FULL, QUICK, SECTIONS, SPEED_DTYPES, parse_shape
from benchmarks.targets import target_rows
from conformance_tests.progress import progress_bar

__all__ = ["build_config", "format_section", "main", "parse_args"]


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
    default_shapes = ",".join(f"b{b}t{t}" for b, t in FULL.speed_shapes)
    parser.add_argument(
        "--shapes", metavar="LIST", help=f"speed shapes (default: {default_shapes})"
    )
    parser.add_argument(
        "--repeats", type=int, metavar="N", help="timed calls per measurement (all sections)"
    )
    parser.add_argument(
        "--dtype",
        choices=SPEED_DTYPES,
        help="the speed section's layer, input and torch modules (default: float32)",
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
            parts_repeats=args.repeats,
            annotated_repeats=args.repeats,
            modern_repeats=args.repeats,
            products_repeats=args.repeats,
        )
    if args.dtype:
        changes["speed_dtype"] = args.dtype
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
    if section in ("generate", "prefill", "train", "parts", "annotated", "modern", "products"):
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


# ---- main ---------------------------------------------------------------------------------------


def _section_module(section):
    import importlib

    name = {"compile": "compile_time"}.get(section, section)
    return importlib.import_module(f"benchmarks.{name}")


def main(argv=None) -> int:
    args = parse_args(argv)
    config = build_config(args)
    if args.charts:  # before the run, not after it
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
    rows += target_rows(rows)
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
        for path in write_charts(rows, args.charts, machine):
            print(f"chart: {path}", file=sys.stderr)
    return 0
