"""Bar charts of the benchmark ratios, one PNG per section, for the docs' performance page.

``python -m benchmarks --charts DIR`` draws them after a run; ``python -m benchmarks.charts
RESULTS.json DIR`` redraws them from the JSON that ``--json`` wrote, without running anything.

The numbers and the pixels are apart: ``chart_data(rows, section)`` picks a section's ratios out
of the rows (the dicts of ``benchmarks.ROW_FIELDS``) into a ``Chart``, a pure function the tests
check value by value; ``draw(chart, path)`` turns a ``Chart`` into a PNG, and only it imports
matplotlib (the ``report`` extra), with the headless Agg backend.

What each chart shows (x: the run's cases; one bar per implementation; a line at 1.0, the
baseline; dashed, the target of ``benchmarks.targets`` where there is one):

- ``speed``: time / torch SDPA time (``ratio_vs_sdpa``), one panel per pass (forward,
  forward+backward); target lines from ``benchmarks.targets.SPEED_TARGETS``.
- ``memory``: a forward's peak RSS growth / torch SDPA's at the same t (``ratio_vs_sdpa``; the
  training-step rows have no torch counterpart and no ratio).
- ``decode``: tokens/s / recomputing the full pass per token (``ratio``, ``ratio_of`` "speedup
  over recompute"; target ``benchmarks.targets.DECODE_SPEEDUP_TARGET``), and ms/token late in the
  cache / early (the row's ``ratio_of``).
- ``generate``: ``flax_attention.models.generate``'s tokens/s / transformers'
  (``ratio_vs_eager``, ``ratio_vs_sdpa``), its tokens/s / the weight-streaming bound (target
  ``benchmarks.targets.MODEL_TARGETS["generate b1 / bound"]``), ms/token late / early for
  each of the three, and the ``dtype generate`` rows' tokens/s over Flax float32's (Flax
  bfloat16 and int8, transformers float32 and bfloat16; target
  ``benchmarks.targets.DTYPE_TARGETS``).
- ``prefill``, ``train``: Flax time / transformers' (``ratio_vs_sdpa``), one panel per mode;
  target ``benchmarks.targets.MODEL_TARGETS``.

- ``annotated``: the Annotated Transformer's training step, Flax time / the torch twin's
  (``ratio_vs_eager``; target ``benchmarks.targets.ANNOTATED_TARGETS``), and greedy decoding's
  tokens/s / the post's loop run row by row (``ratio``) for Flax ``greedy_decode`` and the
  post's loop batched in torch (target ``ANNOTATED_TARGETS``).

- ``modern``: the book's modern attention (``ratio``): ``GroupedQueryAttention``'s time / torch
  SDPA ``enable_gqa``'s, forward and forward+backward; the sliding window's prefill time / full
  causal's, the layer and its core; ``generate``'s tokens/s / the book's cached loop's on each
  GPT variant (targets ``benchmarks.targets.MODERN_TARGETS``); and the window's peak RSS
  growth / full causal's, where the run measured it.

``compile`` (seconds, no ratio) and ``targets`` have no chart.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from benchmarks import INSTALL
from benchmarks.targets import (
    ANNOTATED_TARGETS,
    DECODE_SPEEDUP_TARGET,
    DTYPE_TARGETS,
    MODEL_TARGETS,
    MODERN_TARGETS,
    SPEED_TARGETS,
)

__all__ = [
    "CHART_SECTIONS",
    "Chart",
    "Panel",
    "Series",
    "caption",
    "chart_data",
    "charted_sections",
    "draw",
    "load_results",
    "main",
    "missing_matplotlib",
    "write_charts",
]

#: The sections whose rows hold ratios, in the order the CLI runs them.
CHART_SECTIONS = (
    "speed", "memory", "decode", "generate", "prefill", "train", "annotated", "modern"
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Series:
    """One implementation's bars: ``values[i]`` over ``Panel.groups[i]`` (``None``: no bar)."""

    label: str  # the legend, e.g. "default (native)" or "torch eager"
    key: str  # the rows' ``implementation``
    values: tuple[float | None, ...]


@dataclasses.dataclass(frozen=True)
class Panel:
    title: str  # e.g. "forward"
    ylabel: str  # what the ratio is of
    groups: tuple[str, ...]  # the x axis: the rows' cases, in run order
    series: tuple[Series, ...]
    baseline_label: str  # what the line at 1.0 stands for
    target: float | None = None
    target_label: str = ""

    def value(self, key: str, group: str) -> float | None:
        """The bar of implementation ``key`` at case ``group``."""
        for series in self.series:
            if series.key == key:
                return series.values[self.groups.index(group)]
        raise KeyError(f"no series {key!r} in panel {self.title!r}")


@dataclasses.dataclass(frozen=True)
class Chart:
    section: str
    title: str
    panels: tuple[Panel, ...]


# ---- data ---------------------------------------------------------------------------------------


def _unique(items):
    return tuple(dict.fromkeys(items))


def _label(framework, implementation, resolved):
    if framework == "torch":
        return f"torch {implementation}"
    if resolved and len(resolved) == 1 and next(iter(resolved)) != implementation:
        return f"{implementation} ({next(iter(resolved))})"
    return implementation


def _panel(rows, field, title, ylabel, baseline_label, target=None, target_label="", label=None):
    """A panel of ``row[field]`` by case and implementation (Flax first, default leading)."""
    groups = _unique(r["case"] for r in rows)
    keys = _unique(r["implementation"] for r in rows)
    framework = {r["implementation"]: r["framework"] for r in rows}
    keys = sorted(keys, key=lambda k: (framework[k] != "flax", k != "default"))
    series = []
    for key in keys:
        mine = {r["case"]: r for r in rows if r["implementation"] == key}
        resolved = {r["resolved"] for r in mine.values()}
        series.append(
            Series(
                label=label(key) if label else _label(framework[key], key, resolved),
                key=key,
                values=tuple(mine[g][field] if g in mine else None for g in groups),
            )
        )
    return Panel(title, ylabel, groups, tuple(series), baseline_label, target, target_label)


def _with(rows, field, **match):
    return [
        r
        for r in rows
        if not r["skipped"] and r[field] is not None and all(r[k] == v for k, v in match.items())
    ]


def chart_data(rows: list[dict], section: str) -> Chart:
    """The ratios of ``section`` in ``rows``, panel by panel, as the chart draws them."""
    if section not in CHART_SECTIONS:
        raise ValueError(
            f"section ({section!r}) must be one with ratios to chart ({', '.join(CHART_SECTIONS)})"
        )
    rows = [r for r in rows if r["section"] == section]
    match section:
        case "speed":
            panels, title = _speed_panels(rows)
        case "memory":
            panels, title = _memory_panels(rows)
        case "decode":
            panels, title = _decode_panels(rows)
        case "generate":
            panels, title = _generate_panels(rows)
        case "prefill" | "train":
            panels, title = _prefill_train_panels(rows, section)
        case "annotated":
            panels, title = _annotated_panels(rows)
        case "modern":
            panels, title = _modern_panels(rows)
    panels = [p for p in panels if p.groups]
    if not panels:
        raise ValueError(f"rows hold no measured ratio of section ({section!r})")
    return Chart(section, title, tuple(panels))


def _speed_panels(rows):
    """``(panels, title)``: time / torch SDPA, one panel per pass."""
    panels = []
    for mode in _unique(r["mode"] for r in rows):
        mine = [r for r in _with(rows, "ratio_vs_sdpa", mode=mode)
                if r["implementation"] != "sdpa"]  # fmt: skip
        target = SPEED_TARGETS.get(mode)
        panels.append(
            _panel(mine, "ratio_vs_sdpa", mode, "time / torch SDPA time (< 1: faster)",
                   "torch SDPA", target, f"target <= {target:g}" if target else "")
        )  # fmt: skip
    title = "Speed: time / torch SDPA, same run"
    return panels, title


def _memory_panels(rows):
    """``(panels, title)``: a forward's peak growth / torch SDPA's."""
    panels = []
    for mode in _unique(r["mode"] for r in rows):
        mine = [r for r in _with(rows, "ratio_vs_sdpa", mode=mode)
                if r["implementation"] != "sdpa"]  # fmt: skip
        panels.append(
            _panel(mine, "ratio_vs_sdpa", mode, "peak RSS growth / torch SDPA's",
                   "torch SDPA")
        )  # fmt: skip
    title = "Memory: peak RSS growth of one forward / torch SDPA's, fresh process each"
    return panels, title


def _decode_panels(rows):
    """``(panels, title)``: the speedup over recomputing, and the flatness."""
    panels = []
    for ratio_of in _unique(r["ratio_of"] for r in rows if r["ratio_of"]):
        mine = [r for r in _with(rows, "ratio", ratio_of=ratio_of)
                if r["implementation"] != "recompute"]  # fmt: skip
        speedup = ratio_of == "speedup over recompute"
        panels.append(
            _panel(
                mine, "ratio",
                "tokens/s over recomputing the full pass per token" if speedup
                else "flatness: time per token late in the cache / early",
                ratio_of, "recompute" if speedup else "flat",
                DECODE_SPEEDUP_TARGET if speedup else None,
                f"target >= {DECODE_SPEEDUP_TARGET:g}" if speedup else "",
                label=lambda key: {"generate": "flax generate",
                                   "kv_cache": "torch kv_cache"}.get(key, key),
            )
        )  # fmt: skip
    title = "Decode: generation with a cache"
    return panels, title


def _generate_panels(rows):
    """``(panels, title)``: tokens/s over transformers', over the bound, and the flatness."""
    panels = []
    flax = _with(rows, "ratio_vs_sdpa", framework="flax", mode="generate")
    # The Flax row holds both ratios; one series per transformers attention.
    as_bars = [
        {**r, "implementation": name, "framework": "torch", "ratio": r[f"ratio_vs_{name}"]}
        for name in ("eager", "sdpa")
        for r in flax
    ]
    panels.append(
        _panel(as_bars, "ratio", "new tokens/s, Flax generate / transformers generate",
               "Flax tokens/s / transformers' (> 1: faster)",
               "transformers", label=lambda key: f"over transformers {key}")
    )  # fmt: skip
    goal = MODEL_TARGETS["generate b1 / bound"]
    panels.append(
        _panel(_with(rows, "ratio", implementation="bound"), "ratio",
               "new tokens/s / the weight-streaming bound (b x bandwidth / weight bytes)",
               "fraction of the bound", "the bound", goal, f"b1 target >= {goal:g}",
               label=lambda key: "Flax generate")
    )  # fmt: skip
    for ratio_of in _unique(r["ratio_of"] for r in rows if r["unit"] == "ms/token"):
        panels.append(
            _panel(_with(rows, "ratio", ratio_of=ratio_of), "ratio",
                   "flatness: time per token late in the sequence / early", ratio_of,
                   "flat", label=lambda key: {"generate": "Flax GPTModel"}.get(
                       key, f"transformers {key}"))
        )  # fmt: skip
    dtypes = [
        {**r, "implementation": f"{r['framework']} {r['implementation']}", "framework": "flax"}
        for r in _with(rows, "ratio", mode="dtype generate")
        if (r["framework"], r["implementation"]) != ("flax", "float32")
    ]
    if dtypes:
        goal = DTYPE_TARGETS["bfloat16 b1 / float32"]
        panels.append(
            _panel(dtypes, "ratio", "narrower weights: new tokens/s over Flax float32's",
                   dtypes[0]["ratio_of"], "Flax float32", goal, f"bfloat16 b1 goal >= {goal:g}",
                   label=lambda key: key.replace("flax", "Flax").replace("torch", "transformers"))
        )  # fmt: skip
    title = "Generate: flax_attention.models vs transformers generate"
    return panels, title


def _prefill_train_panels(rows, section):
    """``(panels, title)``: Flax time / transformers', one panel per mode."""
    panels = []
    key = "prefill / transformers" if section == "prefill" else "train step / transformers"
    goal = MODEL_TARGETS[key]
    for mode in _unique(r["mode"] for r in rows if r["mode"] != "dtype prefill"):
        panels.append(
            _panel(_with(rows, "ratio_vs_sdpa", mode=mode, framework="flax"),
                   "ratio_vs_sdpa", mode, "Flax time / transformers' (< 1: faster)",
                   "transformers sdpa", goal, f"target <= {goal:g}",
                   label=lambda key: f"Flax {key}")
        )  # fmt: skip
    title = (
        "Prefill: GPTModel forward / GPT2LMHeadModel's (sdpa)"
        if section == "prefill"
        else "Train: one optimiser step, Flax train_step / transformers + torch AdamW"
    )
    return panels, title


def _annotated_panels(rows):
    """``(panels, title)``: the training step's time over the twin's, and greedy decoding's
    tokens/s over the post's loop per row."""
    goal = ANNOTATED_TARGETS["train step / torch twin"]
    train = _panel(
        _with(rows, "ratio_vs_eager", mode="train step", framework="flax"), "ratio_vs_eager",
        "copy-task train step", "Flax time / the torch twin's (< 1: faster)", "torch twin",
        goal, f"target <= {goal:g}", label=lambda key: f"Flax {key}",
    )  # fmt: skip
    goal = ANNOTATED_TARGETS["greedy_decode / the post's loop per row"]
    decode = _panel(
        [r for r in _with(rows, "ratio", mode="greedy decode")
         if r["implementation"] != "post_per_row"], "ratio",
        "greedy decode: tokens/s over the post's loop per row", "tokens/s / the post's loop's",
        "the post's loop, row by row", goal, f"target >= {goal:g}",
        label=lambda key: {"greedy_decode": "Flax greedy_decode",
                           "post_batched": "the post's loop batched (torch)"}.get(key, key),
    )  # fmt: skip
    return [train, decode], "Annotated Transformer: Flax against the post's torch code"


def _modern_panels(rows):
    """``(panels, title)``: grouped-query attention over torch SDPA ``enable_gqa`` (each pass),
    the window over full causal (time: the layer, its core), generate over the book's loop,
    the window's peak memory over full causal's."""
    gqa = [  # one series per pass
        {**r, "implementation": mode}
        for mode in ("forward", "forward+backward")
        for r in _with(rows, "ratio", mode=mode, framework="flax")
    ]
    goal = MODERN_TARGETS["gqa / torch SDPA enable_gqa"]
    panels = [
        _panel(gqa, "ratio", "GroupedQueryAttention",
               "time / torch SDPA enable_gqa's (< 1: faster)", "torch SDPA enable_gqa", goal,
               f"target <= {goal:g}", label=lambda key: f"Flax {key}")
    ]  # fmt: skip
    window = [  # one series per mode: the layer's bars beside its core's
        {**r, "implementation": r["mode"].replace(" forward", "")}
        for mode in ("layer forward", "core forward")
        for r in _with(rows, "ratio", mode=mode, implementation="window")
    ]
    goal = MODERN_TARGETS["sliding window / full causal"]
    panels.append(
        _panel(window, "ratio", "sliding-window prefill", "time / full causal's (< 1: faster)",
               "full causal", goal, f"target <= {goal:g}",
               label=lambda key: f"the window's {key}")
    )  # fmt: skip
    goal = MODERN_TARGETS["generate / the book's cached loop"]
    decode = _with(rows, "ratio", mode="generate", framework="flax")
    shape = decode[0]["case"][decode[0]["case"].rindex("_b") + 1 :] if decode else ""
    decode = [{**r, "case": r["case"][: r["case"].rindex("_b")]} for r in decode]  # the variant
    panels.append(
        _panel(decode, "ratio", f"generate on the book's GPT variants, {shape}",
               "tokens/s / the book's loop's (> 1: faster)",
               "the book's generate_text_simple_cached", goal, f"target >= {goal:g}",
               label=lambda key: "Flax generate")
    )  # fmt: skip
    panels.append(
        _panel(_with(rows, "ratio", mode="peak memory", implementation="window"), "ratio",
               "sliding-window prefill, peak memory", "peak RSS growth / full causal's",
               "full causal", label=lambda key: "the window")
    )  # fmt: skip
    return panels, "Modern: the book's modern attention against torch SDPA and the book's code"


def charted_sections(rows: list[dict]) -> list[str]:
    """The sections of ``rows`` that have a chart with at least one measured ratio."""
    out = []
    for section in CHART_SECTIONS:
        try:
            chart_data(rows, section)
        except ValueError:
            continue
        out.append(section)
    return out


def caption(machine: dict | None) -> str:
    """One line from the run's machine header: date, CPU, versions, load, command."""
    if not machine:
        return ""
    m = machine
    parts = [
        m.get("date"),
        f"{m.get('cpu')}, {m.get('cores')} cores, {m.get('backend')}" if m.get("cpu") else None,
        f"jax {m['jax']}, flax {m.get('flax')}" if m.get("jax") else None,
        f"torch {m['torch']} ({m.get('torch_threads')} threads)" if m.get("torch") else None,
        f"load {m['load_average_start']}" if m.get("load_average_start") else None,
        m.get("command"),
    ]
    return "; ".join(str(p) for p in parts if p)


def load_results(path) -> dict:
    """The JSON ``python -m benchmarks --json`` wrote: ``{"machine", "config", "rows"}``."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(
            f"{os.fspath(path)} ({keys}) must hold a 'rows' list (what python -m benchmarks "
            "--json writes)"
        )
    return data


# ---- drawing ------------------------------------------------------------------------------------


def missing_matplotlib() -> str | None:
    """``None`` when matplotlib can be imported, else how to install it."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is not None:
        return None
    return f"the charts need matplotlib, which is not installed (the 'report' extra):\n{INSTALL}"


def draw(chart: Chart, path, caption_text: str = "") -> str:
    """Grouped bars of ``chart``, one panel beside the other, saved as a PNG at ``path``."""
    message = missing_matplotlib()
    if message:
        raise ModuleNotFoundError(message)
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    labels = _unique(s.label for p in chart.panels for s in p.series)
    colors = {label: plt.get_cmap("tab10")(i % 10) for i, label in enumerate(labels)}
    # Panels one above the other, so a page shows each at a readable width.
    width = max(6.0, max(1.2 + len(p.groups) * (0.4 + 0.22 * len(p.series)) for p in chart.panels))
    legend_width = 2.4
    fig, axes = plt.subplots(
        len(chart.panels), 1, figsize=(width + legend_width, 0.9 + 3.1 * len(chart.panels)),
        squeeze=False,
    )  # fmt: skip
    handles = {}
    for ax, panel in zip(axes[:, 0], chart.panels):
        bar_width = 0.8 / max(2, len(panel.series))
        values = [v for s in panel.series for v in s.values if v is not None]
        for i, series in enumerate(panel.series):
            offset = (i - (len(panel.series) - 1) / 2) * bar_width
            for g, value in enumerate(series.values):
                if value is None:
                    continue
                bar = ax.bar(g + offset, value, bar_width, color=colors[series.label])
                handles.setdefault(series.label, bar)
                ax.annotate(f"{value:.2f}", (g + offset, value), ha="center", va="bottom",
                            fontsize=7, xytext=(0, 1), textcoords="offset points")  # fmt: skip
        line = ax.axhline(1.0, color="black", linewidth=1)
        handles.setdefault(f"{panel.baseline_label} = 1", line)
        if panel.target is not None:
            line = ax.axhline(panel.target, color="tab:red", linestyle="--", linewidth=1)
            several = sum(p.target is not None for p in chart.panels) > 1
            label = f"{panel.title}: {panel.target_label}" if several else panel.target_label
            handles.setdefault(label, line)
        bounds = [*values, 1.0, panel.target or 1.0]
        if max(bounds) / min(bounds) > 20:
            ax.set_yscale("log")
        else:
            ax.set_ylim(0, 1.15 * max(bounds))
        ax.set_xticks(range(len(panel.groups)), panel.groups)
        ax.set_title(panel.title)
        ax.set_ylabel(panel.ylabel)
    fig.suptitle(chart.title)
    if caption_text:
        fig.text(0.01, 0.01, caption_text, ha="left", va="bottom", fontsize=7, wrap=True)
    right = 1 - legend_width / fig.get_figwidth()
    fig.tight_layout(rect=(0, 0.3 / fig.get_figheight() if caption_text else 0, right, 1))
    fig.legend(handles.values(), handles.keys(), loc="center left", bbox_to_anchor=(right, 0.5),
               fontsize=8, frameon=False)  # fmt: skip
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return os.fspath(path)


def write_charts(rows: list[dict], out_dir, machine: dict | None = None, sections=None):
    """``out_dir/<section>.png`` for each of ``sections`` (default: every one with ratios)."""
    if sections is None:
        sections = charted_sections(rows)
    charts = [chart_data(rows, section) for section in sections]  # every ValueError first
    os.makedirs(out_dir, exist_ok=True)
    text = caption(machine)
    return [draw(c, os.path.join(out_dir, f"{c.section}.png"), text) for c in charts]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.charts",
        description="Redraw the charts of python -m benchmarks from the JSON its --json wrote.",
    )
    parser.add_argument("results", help="the JSON python -m benchmarks --json wrote")
    parser.add_argument("out_dir", help="where <section>.png go (created if missing)")
    parser.add_argument("--sections", help=f"comma-separated subset of {','.join(CHART_SECTIONS)}")
    args = parser.parse_args(argv)
    message = missing_matplotlib()
    if message:
        print(f"python -m benchmarks.charts: {message}", file=sys.stderr)
        return 2
    sections = [s for s in args.sections.split(",") if s] if args.sections else None
    try:
        data = load_results(args.results)
        paths = write_charts(data["rows"], args.out_dir, data.get("machine"), sections)
    except ValueError as error:
        print(f"python -m benchmarks.charts: {error}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
