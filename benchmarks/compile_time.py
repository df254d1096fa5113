"""Section ``compile``: ``jax.jit(f).lower(...).compile()`` wall time of the GPT-2 small forward.

``f(state, x) = nnx.merge(graphdef, state)(x)`` at ``config.compile_shape``, for the default
implementation (the target) and the others for context. Each repeat wraps a new function object
in a new ``jax.jit``, so nothing is served from JAX's in-memory caches; a tiny unrelated
computation is compiled first, so backend start-up is not counted. ``lower`` (trace + StableHLO)
is reported in the note; the row's time is ``compile()``.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.models import make_modules, random_input
from benchmarks.rows import make_row
from benchmarks.speed import flax_implementations
from benchmarks.timing import Timing

__all__ = ["plan_calls", "run"]


def _implementations(config):
    wanted = config.compile_implementations
    return [i for i in flax_implementations() if wanted is None or (i or "default") in wanted]


def plan_calls(config) -> int:
    return len(_implementations(config)) * config.compile_repeats


def run(config, progress=None) -> list[dict]:
    batch, tokens = config.compile_shape
    jax.jit(lambda a: a + 1).lower(jnp.zeros(3)).compile()  # backend start-up, not counted
    _, _, module = make_modules(context_length=max(1024, tokens))
    x = jnp.asarray(random_input(batch, tokens))
    rows = []
    for implementation in _implementations(config):
        module.implementation = implementation
        graphdef, state = nnx.split(module)
        lower_s, compile_s = [], []
        for _ in range(config.compile_repeats):

            def forward(state, x, graphdef=graphdef):
                return nnx.merge(graphdef, state)(x)

            start = time.perf_counter()
            lowered = jax.jit(forward).lower(state, x)
            lowered_at = time.perf_counter()
            lowered.compile()
            compile_s.append(time.perf_counter() - lowered_at)
            lower_s.append(lowered_at - start)
            if progress is not None:
                progress.update(1)
        timing = Timing.of(compile_s)
        name = "default" if implementation is None else implementation
        rows.append(
            make_row(
                "compile",
                f"b{batch}_t{tokens}",
                "forward compile",
                "flax",
                name,
                batch=batch,
                tokens=tokens,
                timing=timing,
                value=timing["median_ms"] / 1e3,
                unit="s",
                note=f"lower (trace + StableHLO): median {np.median(lower_s):.2f} s",
            )
        )
    return rows
