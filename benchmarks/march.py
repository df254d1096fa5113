"""The native kernel built portable against built for this CPU alone: medians in one run.

``python -m benchmarks.march`` builds ``flax_attention/kernels/native/attention.cc`` twice
against scipy-openblas32, with ``setup.py``'s flags: ``portable`` (the default: on x86-64 its hot
functions compiled for AVX-512, AVX2 and baseline x86-64, the widest this CPU runs picked when
the library loads) and ``native`` (``FLAX_ATTENTION_MARCH=native``: one copy for this CPU). It
registers each build's FFI targets under their own names, traces the package's
``native_attention`` with each (``benchmarks.blas``), and times the two interleaved round-robin
in one process, forward and forward+backward, causal, GPT-2 small's 12 heads of 64, float32.
Prints each median, portable / native, and the largest difference between the two builds'
outputs and gradients. Options: ``--repeats``, ``--shapes 8x1024,1x4096``, ``--json PATH``,
``--build-cache DIR`` (reuse the builds kept there, ``benchmarks.blas.build``: a ``python -m
benchmarks.blas`` run with ``FLAX_ATTENTION_MARCH=native`` and the same folder leaves the
``native`` one).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

import numpy as np

from benchmarks import blas as bench
from benchmarks.timing import median_ms

BUILDS = {"portable": "", "native": "native"}  # name -> FLAX_ATTENTION_MARCH


def run(shapes=bench.KERNEL_SHAPES, repeats=20, build_cache=None) -> dict:
    """``{"machine", "rows"}``: per shape and pass, each build's median and their ratio
    (``build_cache``: ``benchmarks.blas.build``'s ``cache``)."""
    import jax
    import jax.numpy as jnp

    from flax_attention.kernels.native import available, native_attention, why_unavailable
    from flax_attention.masking import AttentionMask

    if not available():  # also registers the package's own build, under its own names
        raise RuntimeError(f"the package's native kernel is unavailable: {why_unavailable()}")
    causal = AttentionMask(is_causal=True)

    def forward(q, k, v, *, targets):
        return native_attention(q, k, v, causal, targets=targets)

    def forward_backward(q, k, v, *, targets):  # the gradient of sum(out): d_out = 1
        def loss(q, k, v):
            return forward(q, k, v, targets=targets).sum()

        return jax.grad(loss, (0, 1, 2))(q, k, v)

    machine = {"cpu": bench._cpu_model(), "load_before": bench._load()}
    blas = bench.openblas32()
    rows = []
    with tempfile.TemporaryDirectory(prefix="flax_attention_march_") as scratch:
        names = {}
        for name, march in BUILDS.items():
            path = bench.build(blas, bench.KERNEL_SOURCE, pathlib.Path(scratch), name, march,
                               build_cache)  # fmt: skip
            names[name] = bench._register(f"march_{name}", path)
        for batch, tokens in shapes:
            rng = np.random.default_rng(0)
            shape = (batch, tokens, bench.HEADS, bench.HEAD_DIM)
            qkv = tuple(jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in "qkv")
            for mode, fn in (("fwd", forward), ("fwd+bwd", forward_backward)):
                calls, results = {}, {}
                for name in BUILDS:
                    compiled = bench._compile(fn, qkv, names[name], mode != "fwd")
                    results[name] = jax.tree.leaves(jax.block_until_ready(compiled(*qkv)))
                    calls[name] = lambda c=compiled, a=qkv: jax.block_until_ready(c(*a))
                ms = median_ms(calls, repeats)
                diff = max(
                    float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                    for a, b in zip(results["portable"], results["native"], strict=True)
                )
                rows.append(
                    dict(
                        shape=f"b{batch} t{tokens}",
                        mode=mode,
                        portable_ms=ms["portable"],
                        native_ms=ms["native"],
                        portable_over_native=ms["portable"] / ms["native"],
                        max_abs_diff=diff,
                    )
                )
                print(
                    f"{rows[-1]['shape']:>10} {mode:>7}: portable {ms['portable']:8.2f} ms  "
                    f"native {ms['native']:8.2f} ms  portable/native "
                    f"{rows[-1]['portable_over_native']:.3f}  max|diff| {diff:.1e}",
                    flush=True,
                )
    machine["load_after"] = bench._load()
    print(f"load before {machine['load_before']}, after {machine['load_after']}")
    return {"machine": machine, "repeats": repeats, "rows": rows}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="rounds of both builds")
    parser.add_argument("--shapes", help="BxT,BxT (default 8x256,8x1024,1x4096)")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    parser.add_argument(
        "--build-cache", metavar="DIR", help="reuse the builds kept in DIR, and keep new ones"
    )
    args = parser.parse_args(argv)
    shapes = bench.KERNEL_SHAPES
    if args.shapes:
        shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    result = run(shapes, args.repeats, args.build_cache)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
