"""Section ``prefill``: the whole model's forward over a prompt, ``GPTModel`` against
transformers' ``GPT2LMHeadModel``.

At ``prefill_shape`` (b1 t1024: GPT-2 small's whole context), random weights, float32, the
same weights in both (``benchmarks.gpt_models``), two modes timed alike in both frameworks:

- ``last-position logits`` (the prefill proper, what generation needs of the prompt): Flax
  ``model.logits(model.hidden_states(ids)[:, -1])`` jitted over ``nnx.split``; transformers
  ``model(ids, logits_to_keep=1, use_cache=False).logits[:, -1]``; ``(b, V)``.
- ``all logits``: Flax ``model(ids)`` jitted; transformers ``model(ids,
  use_cache=False).logits``; ``(b, t, V)`` (the head over every position: what training and
  the book's ``generate_text_simple`` compute).

transformers with ``attn_implementation="sdpa"``, eval mode, ``torch.no_grad()``; Flax's
attention is the default implementation (``native`` on CPU where built). The logits are
compared before timing (``max_*_diff``); each mode's two calls are timed round-robin, with the
other mode's. ``ratio_vs_sdpa``: Flax time / transformers' time (< 1: Flax faster).

- ``dtype prefill``: the last-position logits at ``prefill_dtype_shape`` (b1 t512) of the same
  weights in each dtype: Flax float32, bfloat16 (``GPTModel(dtype=param_dtype=bfloat16)``) and
  int8 (``models.quantize``), transformers float32 and bfloat16 (``.to(torch.bfloat16)``), all
  round-robin; ``ratio``: the time over Flax float32's (goals: ``benchmarks.targets``);
  ``max_*_diff`` of every row (transformers' bfloat16 too) against transformers' float32: each
  dtype's own error, Flax bfloat16's to be read against transformers' bfloat16's.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import torch
from flax import nnx

from benchmarks.gpt_models import count_compiles, flax_model, torch_models
from benchmarks.rows import make_row, max_diffs
from benchmarks.timing import interleaved
from benchmarks.torch_device import device, to_numpy, to_torch

__all__ = ["MODES", "TOLERANCE", "plan_calls", "run"]

MODES = ("last-position logits", "all logits")
DTYPES = ("float32", "bfloat16", "int8")
#: What the ``dtype prefill`` rows' ``ratio`` is of.
DTYPE_RATIO_OF = "time / Flax float32's, same shape"
#: Parity bound before timing, relative (``max|diff| / max(1, max|torch|)``), as in ``speed``.
TOLERANCE = 1e-4


def plan_calls(config) -> int:
    dtypes = (len(DTYPES) + 2) * (config.prefill_repeats + 1)
    return 2 * len(MODES) * (config.prefill_repeats + 1) + dtypes


@functools.partial(jax.jit, static_argnames=("graphdef", "last"))
def _forward(graphdef, state, ids, *, last):
    model = nnx.merge(graphdef, state)
    if last:
        return model.logits(model.hidden_states(ids)[:, -1])  # (b, V)
    return model(ids)  # (b, t, V)


def run(config, progress=None) -> list[dict]:
    batch, tokens = config.prefill_shape
    hf = torch_models(config, ("sdpa",))["sdpa"]
    model, _ = flax_model(hf)
    hf.to(device())
    model.eval()
    graphdef, state = nnx.split(model)
    ids = np.random.default_rng(0).integers(0, model.cfg["vocab_size"], (batch, tokens))
    ids_jax, ids_torch = jax.numpy.asarray(ids, jax.numpy.int32), to_torch(ids)

    def torch_forward(last):
        with torch.no_grad():
            if last:
                return hf(ids_torch, logits_to_keep=1, use_cache=False).logits[:, -1]
            return hf(ids_torch, use_cache=False).logits

    calls, diffs = {}, {}
    for mode in MODES:
        last = mode == MODES[0]
        calls["flax", mode] = functools.partial(_forward, graphdef, state, ids_jax, last=last)
        calls["torch", mode] = functools.partial(torch_forward, last)
        ours = np.asarray(jax.block_until_ready(calls["flax", mode]()))
        reference = to_numpy(calls["torch", mode]())
        diffs[mode] = max_diffs({"logits": ours}, {"logits": reference})
        if progress is not None:
            progress.update(2)
        if diffs[mode][1] > TOLERANCE:
            raise RuntimeError(
                f"prefill {mode}: Flax logits differ from transformers' by {diffs[mode][1]:.1e} "
                f"(relative) > {TOLERANCE:g}; not timing a wrong result"
            )
    with count_compiles() as timed:
        timings = interleaved(calls, config.prefill_repeats, progress)
    if timed.count:
        raise RuntimeError(f"the Flax forward compiled {timed.count} times during timing")
    case = f"b{batch}_t{tokens}"
    rows = []
    for mode in MODES:
        ratio = timings["flax", mode]["median_ms"] / timings["torch", mode]["median_ms"]
        for framework in ("flax", "torch"):
            flax = framework == "flax"
            rows.append(
                make_row(
                    "prefill", case, mode, framework, "GPTModel" if flax else "sdpa",
                    batch=batch, tokens=tokens,
                    timing=timings[framework, mode], value=batch * tokens / (
                        timings[framework, mode]["median_ms"] / 1e3),
                    unit="tokens/s", ratio_vs_sdpa=ratio if flax else 1.0,
                    diffs=diffs[mode] if flax else None,
                    note="GPTModel forward, jitted, default attention" if flax
                    else "GPT2LMHeadModel, attn_implementation=sdpa, no_grad, use_cache=False",
                )
            )  # fmt: skip
    return rows + _dtype_rows(config, model, hf, progress)


def _dtype_rows(config, model, hf, progress) -> list[dict]:
    """The ``dtype prefill`` rows: last-position logits in each weight dtype, round-robin."""
    from benchmarks.generate import dtype_models

    batch, tokens = config.prefill_dtype_shape
    models = dtype_models({"model": model, "models": {"sdpa": hf}})
    ids = np.random.default_rng(1).integers(0, model.cfg["vocab_size"], (batch, tokens))
    ids_jax, ids_torch = jax.numpy.asarray(ids, jax.numpy.int32), to_torch(ids)

    def torch_last(hf_model):
        with torch.no_grad():
            return hf_model(ids_torch, logits_to_keep=1, use_cache=False).logits[:, -1]

    calls, outputs = {}, {}
    for (framework, dtype), held in models.items():
        if framework == "flax":
            graphdef, state = nnx.split(held)
            calls[framework, dtype] = functools.partial(
                _forward, graphdef, state, ids_jax, last=True
            )
            outputs[framework, dtype] = np.asarray(
                jax.block_until_ready(calls[framework, dtype]()), np.float32
            )
        else:
            calls[framework, dtype] = functools.partial(torch_last, held)
            outputs[framework, dtype] = to_numpy(calls[framework, dtype]().float())
        if progress is not None:
            progress.update(1)
    with count_compiles() as timed:
        timings = interleaved(calls, config.prefill_repeats, progress)
    if timed.count:
        raise RuntimeError(f"a Flax prefill compiled {timed.count} times during timing")
    base = timings["flax", "float32"]["median_ms"]
    truth = ("torch", "float32")
    case = f"b{batch}_t{tokens}"
    rows = []
    for (framework, dtype), timing in timings.items():
        diffs = max_diffs({"logits": outputs[framework, dtype]}, {"logits": outputs[truth]})
        rows.append(
            make_row(
                "prefill", case, "dtype prefill", framework, dtype, batch=batch, tokens=tokens,
                timing=timing, value=batch * tokens / (timing["median_ms"] / 1e3),
                unit="tokens/s", ratio=timing["median_ms"] / base, ratio_of=DTYPE_RATIO_OF,
                diffs=diffs,
                note="GPTModel last-position logits, jitted" if framework == "flax"
                else "GPT2LMHeadModel sdpa, logits_to_keep=1, no_grad",
            )
        )  # fmt: skip
    return rows


def format_rows(rows: list[dict], table) -> str:
    """The section's table (``table(headers, lines)`` from ``benchmarks.cli``)."""
    title = (
        "Prefill: the whole model's forward over the prompt, median ms; /transformers = Flax "
        "time / transformers sdpa time, same run (< 1: Flax faster); dtype prefill: time / "
        "Flax float32's"
    )
    return format_model_rows(rows, table, title)


def format_model_rows(rows, table, title) -> str:
    """A table of the ``prefill`` or ``train`` rows under ``title``."""

    def num(value, spec):
        return "-" if value is None else format(value, spec)

    headers = ["case", "mode", "framework", "implementation", "median ms", "min ms", "n",
               "/transformers", "max diff (rel)", "note"]  # fmt: skip
    lines = [
        [r["case"], r["mode"], r["framework"], r["implementation"], num(r["median_ms"], ".1f"),
         num(r["min_ms"], ".1f"), r["repeats"], num(r["ratio_vs_sdpa"] or r["ratio"], ".2f"),
         num(r["max_rel_diff"], ".1e"), r["note"]]
        for r in rows
    ]  # fmt: skip
    if not lines:
        return ""
    return f"{title}\n{table(headers, lines)}\n"
