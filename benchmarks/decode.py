"""Section ``decode``: generating ``steps`` tokens after a ``prompt``-token prompt.

- ``flax`` ``generate``: ``module.init_cache(b, prompt + steps)`` then
  ``flax_attention.decode_loop(module, prompt, steps)`` (one jitted ``lax.scan``, each output fed
  back as the next input; ``d_in == d_out``). Timed per call, cache allocation included.
- ``torch`` ``kv_cache``: ``benchmarks.models.torch_generate``, the same loop in Python over a
  preallocated torch KV cache, ``torch.no_grad()``, the same weights. Its outputs are the
  reference the Flax outputs are compared with (all ``steps + 1`` of them, feedback included).
- ``flax`` ``recompute``: what decoding costs without a cache, the full causal pass (default
  implementation, jitted) over the whole sequence for every new token. It is not run 256 times:
  the forward is timed at ``decode_recompute_samples`` exact lengths spread over
  ``prompt + 1 .. prompt + steps`` (one compilation each), interpolated linearly between them and
  summed over every length; tokens/s is ``b * steps`` over that sum. Exact lengths make this
  estimate faster than padding every step to the final length, so the speedup is conservative.
- flatness: the cache advanced to position ``p`` (outside the timing), then ``generate`` of a
  one-token prompt and ``flat_steps - 1`` steps (``flat_steps`` tokens), at an early and a late
  ``p``: ms per token at each and their ratio.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

import flax_attention as fa
from benchmarks.models import make_modules, random_input, torch_generate
from benchmarks.rows import make_row, max_diffs
from benchmarks.timing import interleaved, time_calls
from benchmarks.torch_device import to_numpy, to_torch

__all__ = ["plan_calls", "run"]

#: Parity bound before timing (relative, as in ``speed``).
TOLERANCE = 1e-4


def plan_calls(config) -> int:
    per_batch = (
        2 * (config.decode_repeats + 1)
        + config.decode_recompute_samples * (config.decode_repeats + 1)
        + 2 * (config.decode_repeats + 1)
    )
    return per_batch * len(config.decode_batches)


def _tick(progress, n=1):
    if progress is not None:
        progress.update(n)


def run(config, progress=None) -> list[dict]:
    rows = []
    for batch in config.decode_batches:
        rows += _run_batch(config, batch, progress)
    return rows


def _run_batch(config, batch, progress):
    """The rows of one batch: generate and the torch loop, recompute, flatness."""
    steps, prompt_len = config.decode_steps, config.decode_prompt
    max_length = prompt_len + steps
    eager, _, module = make_modules(context_length=max(1024, max_length))
    module.implementation = None
    prompt_np = random_input(batch, prompt_len, seed=1)
    prompt_torch, prompt_jax = to_torch(prompt_np), np.asarray(prompt_np)
    row = functools.partial(make_row, "decode", f"b{batch}_p{prompt_len}_n{steps}", batch=batch)

    def flax_generate():
        module.init_cache(batch, max_length)
        return fa.decode_loop(module, prompt_jax, steps)  # (b, steps + 1, d_out)

    def torch_kv():
        return torch_generate(eager, prompt_torch, steps, max_length)

    torch_out = torch_kv()  # also the warm-up
    _tick(progress)
    flax_out = flax_generate()  # compiles
    _tick(progress)
    diffs = max_diffs({"y": np.asarray(flax_out)}, {"y": to_numpy(torch_out)})
    if diffs[1] > TOLERANCE:
        note = f"outputs differ from torch (max rel {diffs[1]:.1e}): not timed"
        return [
            row("generate", framework, impl, tokens=steps, skipped=True, note=note, diffs=diffs)
            for framework, impl in (("flax", "generate"), ("torch", "kv_cache"))
        ]
    timings = interleaved(
        {"generate": flax_generate, "kv_cache": torch_kv}, config.decode_repeats, progress
    )
    lengths, sample_ms = _recompute_samples(config, module, batch, progress)
    every = np.arange(prompt_len + 1, max_length + 1)
    recompute_ms = float(np.interp(every, lengths, sample_ms).sum())
    samples = ", ".join(f"t{n}: {ms:.1f} ms" for n, ms in zip(lengths, sample_ms))
    per_s = 1e3 * batch * steps
    speedup = dict(unit="tokens/s", ratio_of="speedup over recompute", tokens=steps)
    return [
        row("generate", "flax", "generate", resolved="default", timing=timings["generate"],
            value=per_s / timings["generate"]["median_ms"], diffs=diffs,
            ratio=recompute_ms / timings["generate"]["median_ms"], **speedup),
        row("generate", "torch", "kv_cache", timing=timings["kv_cache"],
            value=per_s / timings["kv_cache"]["median_ms"], diffs=(0.0, 0.0),
            ratio=recompute_ms / timings["kv_cache"]["median_ms"], **speedup),
        row("recompute", "flax", "recompute", resolved="default",
            timing={"median_ms": recompute_ms, "min_ms": None, "repeats": len(lengths)},
            value=per_s / recompute_ms, ratio=1.0,
            note=f"sum of interpolated full forwards ({samples})", **speedup),
        *_flatness_rows(config, module, batch, max_length, row, progress),
    ]  # fmt: skip


def _recompute_samples(config, module, batch, progress):
    """``(lengths, median ms)``: the full causal pass (default implementation, jitted) at
    ``decode_recompute_samples`` exact lengths over ``prompt + 1 .. prompt + steps``."""
    prompt_len = config.decode_prompt
    graphdef, state = nnx.split(module)
    lengths = np.unique(
        np.linspace(prompt_len + 1, prompt_len + config.decode_steps,
                    config.decode_recompute_samples).round()
    ).astype(int)  # fmt: skip
    sample_ms = []
    for length in lengths:
        x = random_input(batch, int(length), seed=2)
        forward = _jit_forward(graphdef)
        _tick(progress)
        forward(state, x).block_until_ready()  # compile
        sample_ms.append(
            time_calls(lambda f=forward, x=x: f(state, x), config.decode_repeats)["median_ms"]
        )
        _tick(progress, config.decode_repeats)
    return lengths, sample_ms


def _flatness_rows(config, module, batch, max_length, row, progress):
    """ms per token of ``decode_flat_steps`` tokens from an early and a late position; the last
    row holds late / early."""
    flat = config.decode_flat_steps
    one = random_input(batch, 1, seed=3)
    rows, per_token = [], {}
    for position in config.decode_flat_positions:
        module.init_cache(batch, max_length)
        _advance(module, random_input(batch, position, seed=4))
        snapshot = jax.tree.map(lambda a: a, nnx.state(module, nnx.Cache))  # a copy
        fa.decode_loop(module, one, flat - 1)  # compile (once: same shapes at every position)
        _tick(progress)

        def from_position(snapshot=snapshot):
            nnx.update(module, snapshot)
            return fa.decode_loop(module, one, flat - 1)

        timing = time_calls(from_position, config.decode_repeats)
        _tick(progress, config.decode_repeats)
        per_token[position] = timing["median_ms"] / flat
        rows.append(
            row(f"{flat} tokens from position {position}", "flax", "generate",
                resolved="default", tokens=flat, timing=timing, value=per_token[position],
                unit="ms/token")
        )  # fmt: skip
    early, late = config.decode_flat_positions
    rows[-1]["ratio"] = per_token[late] / per_token[early]
    rows[-1]["ratio_of"] = f"ms/token at position {late} / at {early}"
    return rows


@nnx.jit
def _advance(module, x):
    """The cache advanced by ``x``'s tokens, ``(b, t, d_in)``, in one compiled program (run
    eagerly, each of the layer's operations would compile on its own, at each position)."""
    module(x, decode=True)


def _jit_forward(graphdef):
    return jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
