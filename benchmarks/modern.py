"""Section ``modern``: the book's modern attention (its grouped-query, sliding-window and latent
layers, and the GPT variants built on them), each against what a torch user of the book runs.
Each ratio's two rows: the Flax row holds ``ratio`` (what of, ``ratio_of``), the baseline's 1.

- ``forward``, ``forward+backward``: ``fa.GroupedQueryAttention`` (``modern_gqa_layer``: GPT-2
  small's 768 features, 12 query heads over 4 key and value heads) at each of
  ``modern_gqa_shapes`` (b8 t1024, b1 t4096), jitted, default implementation, against
  ``benchmarks.torch_modules.SDPAGroupedQueryAttention`` with the same weights, whose core is
  ``scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)`` (the keys and values
  as the layer projects them, not repeated); forward+backward: the gradients of ``sum(out)``
  w.r.t. ``x`` and every parameter (``benchmarks.speed``'s callables). ``ratio``: Flax time /
  torch's.
- ``layer forward``: ``fa.MultiHeadAttentionWithSWA`` (``modern_swa_layer``) with a window of
  ``modern_swa_window`` (1024) over a ``modern_swa_tokens`` (8192) prefill at batch 1, against
  the same layer, the same weights, without a window (full causal); ``core forward``: the
  attention core alone (``fa.dot_product_attention`` with and without ``window``, the layer's
  heads), the projections left out. ``ratio``: the window's time / full causal's. The window's
  kernels skip the tiles outside it, so the core's time grows with ``t * W``, not ``t^2 / 2``:
  about ``2 W / t`` of full causal's work (0.25 at these sizes); the layer's four projections
  cost the same either way, which keeps its ratio well above the core's.
- ``peak memory``: the same layer, window against none, at each of ``modern_memory_tokens``
  (32768): the peak RSS growth of its first call (compile included) in a fresh process each
  (``benchmarks.memory.measure``, as the ``memory`` section measures). The ``(h, t, t)`` float32
  scores alone would be ``4 h t^2`` bytes (51.5 GB). ``ratio``: the window's growth / none's.
- ``generate``: tokens per second of ``flax_attention.models.generate`` (greedy, batch 1, through
  the decode caches) on each of the book's GPT variants (``modern_variants``: grouped-query,
  latent, 5:1 windows, on ``modern_model``: GPT-2 small, untied head) against the book's
  ``generate_text_simple_cached`` on its torch model (``conformance_tests/book_modern.py``) with
  the same weights; the tokens must be equal. ``ratio``: Flax tokens/s / the book's loop's.

Before timing, outputs are compared (and gradients; the window against full causal over the first
``W`` tokens, which see the same keys either way): a pair that differs by more than
``TOLERANCE`` (relative), or decodes other tokens, is not timed, its rows skipped with why. Each
pair is then timed round-robin (``benchmarks.timing.interleaved``), its first calls (the compile)
being the comparison's; a timed call that compiles is an error of the benchmark. The goals the
ratios are read against: ``benchmarks.targets.MODERN_TARGETS``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import flax_attention as fa
import torch_reference as tr
from benchmarks import memory
from benchmarks.gpt_models import count_compiles
from benchmarks.models import loaded
from benchmarks.rows import make_row, max_diffs
from benchmarks.speed import (
    as_named,
    flax_forward,
    flax_forward_backward,
    flax_grads_by_torch_name,
    torch_forward,
    torch_forward_backward,
)
from benchmarks.timing import interleaved
from benchmarks.torch_device import device, to_numpy, to_torch
from benchmarks.torch_modules import SDPAGroupedQueryAttention

__all__ = ["BOOK_GPT2_SMALL", "TOLERANCE", "format_rows", "plan_calls", "run"]

#: Parity bound before timing: max |flax - torch| / max(1, max |torch|) per tensor, as ``speed``.
TOLERANCE = 1e-4
#: The book's GPT-2 small config (``GPT_CONFIG_124M``, no dropout): the decode rows' model,
#: before ``modern_model``'s changes and each variant's keys.
BOOK_GPT2_SMALL = {"vocab_size": 50257, "context_length": 1024, "emb_dim": 768, "n_heads": 12,
                   "n_layers": 12, "drop_rate": 0.0, "qkv_bias": False}  # fmt: skip


def plan_calls(config) -> int:
    """Calls the progress bar counts: each pair's two compared, then timed; two processes per
    memory t."""
    pairs = 2 * len(config.modern_gqa_shapes) + 2 + len(config.modern_variants)
    return pairs * 2 * (config.modern_repeats + 1) + 2 * len(config.modern_memory_tokens)


def _tick(progress, n=1):
    if progress is not None:
        progress.update(n)


def run(config, progress=None) -> list[dict]:
    rows = []
    for batch, tokens in config.modern_gqa_shapes:
        rows += _gqa(config, batch, tokens, progress)
    rows += _swa(config, progress)
    rows += _peak_memory(config, progress)
    rows += _decode(config, progress)
    return rows


def _differs(diffs) -> str | None:
    """Why a pair is not timed, or ``None``."""
    if diffs[1] > TOLERANCE:
        return f"outputs differ (max rel {diffs[1]:.1e} > {TOLERANCE:g}): not timed"
    return None


def _pair(case, mode, calls, diffs, why_not, config, progress, ratio_of, *, resolved=None,
          tokens_per_call=None, notes=("", ""), **common):  # fmt: skip
    """The two rows of one ratio: ``calls`` ``{(framework, implementation): call}``, Flax's
    first, the baseline second, both warm, timed round-robin unless ``why_not``. ``ratio``: time
    over the baseline's, or with ``tokens_per_call`` tokens/s over the baseline's (``value``)."""
    (ours, base), repeats = calls, config.modern_repeats
    row = functools.partial(make_row, "modern", case, mode, **common)
    if why_not:
        _tick(progress, 2 * repeats)
        return [row(*ours, resolved=resolved, skipped=True, note=why_not, diffs=diffs),
                row(*base, skipped=True, note=why_not)]  # fmt: skip
    with count_compiles() as compiled:
        timings = interleaved(calls, repeats, progress)
    if compiled.count:
        raise RuntimeError(f"modern {case} {mode}: {compiled.count} compiles in the timed calls")
    ms = {key: timings[key]["median_ms"] for key in calls}
    ratio = ms[base] / ms[ours] if tokens_per_call else ms[ours] / ms[base]
    speed = {}
    if tokens_per_call:
        speed = {key: dict(value=tokens_per_call / (ms[key] / 1e3), unit="tokens/s")
                 for key in calls}  # fmt: skip
    return [
        row(*ours, resolved=resolved, timing=timings[ours], ratio=ratio, ratio_of=ratio_of,
            diffs=diffs, note=notes[0], **speed.get(ours, {})),
        row(*base, timing=timings[base], ratio=1.0, ratio_of=ratio_of, note=notes[1],
            **speed.get(base, {})),
    ]  # fmt: skip


def _gqa(config, batch, tokens, progress) -> list[dict]:
    """Forward and forward+backward: Flax's grouped-query layer over torch SDPA ``enable_gqa``."""
    d, heads, groups = config.modern_gqa_layer
    torch.manual_seed(0)
    sdpa = SDPAGroupedQueryAttention(d, d, 0.0, heads, groups).eval()
    layer = loaded(lambda: fa.GroupedQueryAttention(d, d, 0.0, heads, groups, rngs=nnx.Rngs(0)),
                   {k: to_numpy(v) for k, v in sdpa.state_dict().items()})  # fmt: skip
    layer.eval()
    sdpa.to(device())
    x = np.random.default_rng(0).standard_normal((batch, tokens, d)).astype(np.float32)
    x_jax, x_torch = jnp.asarray(x), to_torch(x)
    q = x_jax[..., None, : d // heads]  # what implementation=None runs: by the shape and dtype
    resolved = fa.select_implementation(q, q, need_weights=False)
    case = f"b{batch}_t{tokens}_h{heads}_kv{groups}"
    rows = []
    for mode in ("forward", "forward+backward"):
        if mode == "forward":
            ours, base = flax_forward(layer, None, x_jax), torch_forward(sdpa, x_torch)
            result = as_named(ours())
        else:
            ours = flax_forward_backward(layer, None, x_jax)
            base = torch_forward_backward(sdpa, x_torch)
            result = flax_grads_by_torch_name(layer, ours())
        diffs = max_diffs(result, as_named(base()))
        _tick(progress, 2)
        calls = {("flax", "GroupedQueryAttention"): ours, ("torch", "sdpa enable_gqa"): base}
        rows += _pair(case, mode, calls, diffs, _differs(diffs), config, progress,
                      "time / torch SDPA enable_gqa's", resolved=resolved, batch=batch,
                      tokens=tokens)  # fmt: skip
    return rows


def _swa(config, progress) -> list[dict]:
    """The window's prefill over full causal's: the whole layer, then its core alone."""
    d, heads = config.modern_swa_layer
    tokens, window = config.modern_swa_tokens, config.modern_swa_window
    torch.manual_seed(0)  # the book's layer's initial weights, in both layers
    weights = {k: to_numpy(v) for k, v in tr.MultiHeadAttentionWithSWA(
        d, d, 0.0, heads).state_dict().items()}  # fmt: skip
    windowed, full = (
        loaded(lambda w=w: fa.MultiHeadAttentionWithSWA(
            d, d, 0.0, heads, sliding_window_size=w, rngs=nnx.Rngs(0)), weights)
        for w in (window, None)
    )  # fmt: skip
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, tokens, d)), jnp.float32)
    layer = {"window": flax_forward(windowed, None, x), "full causal": flax_forward(full, None, x)}

    rng = np.random.default_rng(2)
    qkv = [jnp.asarray(rng.standard_normal((1, tokens, heads, d // heads)), jnp.float32)
           for _ in "qkv"]  # fmt: skip

    def core(window):
        run = jax.jit(functools.partial(
            fa.dot_product_attention, is_causal=True, window=window, implementation=None,
            need_weights=False))  # fmt: skip
        return lambda: run(*qkv)[0]

    rows, case = [], f"b1_t{tokens}_w{window}"
    note = f"the first {window} positions compared with full causal's"
    head = slice(0, window)  # the first W queries see the same keys either way
    for mode, calls in (
        ("layer forward", layer),
        ("core forward", {"window": core(window), "full causal": core(None)}),
    ):
        outs = {name: np.asarray(call())[:, head] for name, call in calls.items()}
        diffs = max_diffs({"out": outs["window"]}, {"out": outs["full causal"]})
        _tick(progress, 2)
        pair = {("flax", name): call for name, call in calls.items()}
        rows += _pair(case, mode, pair, diffs, _differs(diffs), config, progress,
                      "time / full causal's", batch=1, tokens=tokens, notes=(note, ""))  # fmt: skip
    return rows


def _peak_memory(config, progress) -> list[dict]:
    """The window's prefill and full causal's, peak RSS growth, a fresh process each."""
    d, heads = config.modern_swa_layer
    window = config.modern_swa_window
    rows = []
    for tokens in config.modern_memory_tokens:
        measured = {}
        for name, w in (("window", window), ("full causal", None)):
            measured[name] = memory.measure(
                dict(framework="flax", layer="swa", window=w, heads=heads, d_model=d, batch=1,
                     tokens=tokens, implementation="default", mode="forward")
            )  # fmt: skip
            _tick(progress)
        scores = f"the (h, t, t) scores alone: {4 * heads * tokens**2 / 1e9:.1f} GB"
        base = measured["full causal"].get("growth_bytes")
        for name, result in measured.items():
            row = functools.partial(make_row, "modern", f"b1_t{tokens}_w{window}", "peak memory",
                                    "flax", name, batch=1, tokens=tokens, unit="MB")  # fmt: skip
            if "error" in result:
                rows.append(row(skipped=True, note=result["error"]))
                continue
            note = "first call, compile included; " + scores
            if not result["peak_reset"]:
                note += "; ru_maxrss growth: a lower bound"
            rows.append(
                row(timing={"median_ms": result["seconds"] * 1e3, "min_ms": None, "repeats": 1},
                    value=result["growth_bytes"] / 1e6,
                    ratio=result["growth_bytes"] / base if base else None,
                    ratio_of="peak growth / full causal's" if base else None, note=note)
            )  # fmt: skip
    return rows


def _decode(config, progress) -> list[dict]:
    """``models.generate`` on each variant against the book's cached loop, the same tokens."""
    from conformance_tests import book_modern
    from flax_attention import models

    prompt, new = config.modern_decode_prompt, config.modern_decode_tokens
    rows = []
    for name, keys in config.modern_variants.items():
        cfg = {**BOOK_GPT2_SMALL, **config.modern_model, **keys}
        torch.manual_seed(0)
        twin = book_modern.GPTModel(cfg).eval()
        model = loaded(lambda cfg=cfg: models.GPTModel(cfg, rngs=nnx.Rngs(0)),
                       {k: to_numpy(v) for k, v in twin.state_dict().items()})  # fmt: skip
        twin.to(device())
        ids = np.random.default_rng(3).integers(0, cfg["vocab_size"], (1, prompt))
        ids_torch = to_torch(ids)

        def flax_call(model=model, ids=ids, context=cfg["context_length"]):
            return models.generate(model, ids, new, context)

        def torch_call(twin=twin, ids=ids_torch):
            return book_modern.generate_text_simple_cached(twin, ids, new)

        ours, theirs = np.asarray(flax_call()), to_numpy(torch_call())
        _tick(progress, 2)
        equal = int((ours == theirs).sum()) if ours.shape == theirs.shape else 0
        note = f"tokens equal to the book's loop: {equal}/{theirs.size}"
        why_not = None if equal == theirs.size else note + ": not timed"
        calls = {("flax", "generate"): flax_call, ("torch", "generate_text_simple_cached"):
                 torch_call}  # fmt: skip
        rows += _pair(f"{name}_b1_p{prompt}_n{new}", "generate", calls, (0.0, 0.0) if not why_not
                      else None, why_not, config, progress, "tokens/s / the book's loop's",
                      tokens_per_call=new, notes=(note, ""), batch=1, tokens=new)  # fmt: skip
    return rows


def format_rows(rows: list[dict], table) -> str:
    """The section's table (``table(headers, lines)`` from ``benchmarks.cli``)."""

    def num(value, spec):
        return "-" if value is None else format(value, spec)

    headers = ["case", "mode", "framework", "implementation", "median ms", "n", "value", "unit",
               "ratio", "ratio of", "max diff (rel)", "note"]  # fmt: skip
    lines = [
        [r["case"], r["mode"], r["framework"],
         f"{r['implementation']} ({r['resolved']})" if r["resolved"] != r["implementation"]
         else r["implementation"], num(r["median_ms"], ".1f"), r["repeats"],
         num(r["value"], ".1f"), r["unit"] or "", num(r["ratio"], ".2f"), r["ratio_of"] or "",
         num(r["max_rel_diff"], ".1e"), r["note"]]
        for r in rows
    ]  # fmt: skip
    if not lines:
        return ""
    title = (
        "Modern: the book's modern attention, median ms; ratio = Flax time / the baseline's "
        "(< 1: Flax faster), for generate Flax tokens/s / the book's loop's (> 1: Flax faster)"
    )
    return f"{title}\n{table(headers, lines)}\n"
