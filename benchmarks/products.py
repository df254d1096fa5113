"""Section ``products``: the whole models' weight products alone, ``x (m, k) @ W`` for each
weight dtype and each way of running it, so the product entry (``flax_attention._layers``,
``rows_dot_general``) can take the fastest per shape class by measurement.

Shapes (``products_shapes``): GPT-2 small's MLP products ``768 x 3072`` and ``3072 x 768``
and its tied head ``x @ E.T`` (``E`` ``(50257, 768)``), and a Qwen3-0.6B-sized model's
``1024 x 3072``, ``3072 x 1024`` and head (``(151936, 1024)``), at ``m`` rows in
``products_rows`` (1 and 8: decode steps; 32: a short prompt; 512: a prefill; the heads only
up to 32, as a prefill needs the last position's logits). Weights (random normal, std 0.02):

- ``float32``; ``bfloat16`` (activations bfloat16 too, as a bfloat16 model's); ``int8`` (one
  float32 scale per output feature, activations float32, as ``models.quantize``'s).

Ways (``implementation``), each jitted, every one in the same run:

- ``xla``: XLA's dot as the models call it today: float32 ``dot``; bfloat16 ``dot`` with a
  float32 result rounded to bfloat16 (``rows_dot_general``); int8 the float32 product with the
  dequantized matrix (``models.quantized``).
- ``xla+ynn``: the same program compiled with ``xla_cpu_experimental_ynn_fusion_type =
  INDIVIDUAL_DOT`` (every dot a YNNPACK fusion, the operands at their own width).
- ``narrow``: ``kernels.native.narrow.matmul`` (where built): up to 15 rows each weight widened
  in registers per pass of 8 rows, from 16 rows once into a float32 panel per block.
- ``onednn``: oneDNN's matmul through ``jax.ffi`` (``benchmarks.onednn_ffi``, where built;
  float32 and bfloat16: the oneDNN on PyPI that runs here, 3.2, has no int8-weight product);
  ``onednn packed``: the same with each weight reordered once into oneDNN's own layout.
- ``torch``: ``torch.nn.functional.linear`` in float32 and bfloat16 (oneDNN/MKL underneath), for
  reference.

One call multiplies ``x`` by ``copies`` distinct weight matrices, as many as make
``products_weight_mb`` of float32 weights (more than the caches hold, as a model's layers do),
so every weight is read from memory; the rows report the time per product. ``value``: weight
GB/s (bytes as held, per second); ``ratio``: the time over ``xla``'s float32 time at the same
shape and rows, same run (a way this machine refuses, e.g. oneDNN's bfloat16 product held
to AVX2, is a skipped row saying why). Every way's result is compared with ``xla``'s of its
dtype before timing (``max_rel_diff``), every copy's product: a way beyond ``AGREE`` is not
timed (a skipped row says by how much). Each shape's and row count's calls are timed round-robin
(``benchmarks.timing.interleaved``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.rows import make_row, max_diffs
from benchmarks.timing import interleaved

__all__ = ["AGREE", "DTYPES", "HEAD_MAX", "RATIO_OF", "plan_calls", "run", "ways"]

DTYPES = ("float32", "bfloat16", "int8")
#: The most rows a head is timed at (a prefill needs one position's logits).
HEAD_MAX = 32
RATIO_OF = "time / xla float32's, same shape and rows"
#: The most a way's products may differ from XLA's of their dtype (relative, as ``max_diffs``)
#: and still be timed: float32 sums in another order; bfloat16 XLA's result rounded to bfloat16
#: (half an ulp, 2^-9) against the others' float32.
AGREE = {"float32": 1e-4, "bfloat16": 2**-7, "int8": 1e-4}
_YNN = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


def _operands(k, n, nk, dtype, copies, m, seed=0):
    """``x`` and ``copies`` weights (each ``(k, n)``, or ``(n, k)`` with ``nk``) with their
    scales (int8) in ``dtype``'s form."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), np.float32)
    shape = (n, k) if nk else (k, n)
    weights, scales = [], []
    for _ in range(copies):
        w = (0.02 * rng.standard_normal(shape)).astype(np.float32)
        if dtype == "int8":
            amax = np.abs(w).max(axis=1 if nk else 0)
            scale = (amax / 127).astype(np.float32)
            q = np.rint(w / (scale[:, None] if nk else scale[None, :])).astype(np.int8)
            weights.append(jnp.asarray(q))
            scales.append(jnp.asarray(scale))
        else:
            weights.append(jnp.asarray(w, jnp.dtype(dtype)))
    x = jnp.asarray(x, jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)
    return x, tuple(weights), tuple(scales)


def _xla_product(x, w, scale, nk):
    numbers = (((1,), (1 if nk else 0,)), ((), ()))
    if w.dtype == jnp.int8:
        shaped = scale[:, None] if nk else scale[None, :]
        return jax.lax.dot_general(x, w.astype(jnp.float32) * shaped, numbers)
    if w.dtype == jnp.bfloat16:
        out = jax.lax.dot_general(x, w, numbers, preferred_element_type=jnp.float32)
        return out.astype(jnp.bfloat16)
    return jax.lax.dot_general(x, w, numbers)


def ways(m: int, dtype: str) -> dict:
    """``{implementation: product(x, w, scale, nk)}`` that run here for ``m`` rows of
    ``dtype``; ``product`` returns float32 or the activations' dtype."""
    found = {"xla": _xla_product, "xla+ynn": _xla_product}
    from flax_attention.kernels.native import narrow

    if narrow.available():
        found["narrow"] = lambda x, w, scale, nk: narrow.matmul(
            x, w, scale if w.dtype == jnp.int8 else None, nk=nk
        )
    try:
        from benchmarks import onednn_ffi
    except ImportError:
        onednn_ffi = None
    if onednn_ffi is not None and onednn_ffi.available() and dtype != "int8":
        for name, packed in (("onednn", False), ("onednn packed", True)):
            found[name] = functools.partial(_onednn, onednn_ffi.matmul, packed=packed)
    return found


def _onednn(matmul, x, w, scale, nk, *, packed):
    return matmul(x, w, nk=nk, packed=packed)


def _jitted(product, implementation, nk):
    def call(x, weights, scales):
        if scales:
            return [product(x, w, s, nk) for w, s in zip(weights, scales)]
        return [product(x, w, None, nk) for w in weights]

    options = _YNN if implementation == "xla+ynn" else None
    return jax.jit(call, compiler_options=options)


def _cases(config):
    for model, shapes in config.products_shapes.items():
        for k, n, nk in shapes:
            for m in config.products_rows:
                if nk and m > HEAD_MAX:
                    continue  # a head's prefill needs one position's logits
                yield model, k, n, nk, m


def plan_calls(config) -> int:
    total = 0
    for _, _, _, _, m in _cases(config):
        for dtype in DTYPES:
            total += (len(ways(m, dtype)) + (dtype != "int8")) * (config.products_repeats + 1)
    return total


def _torch_calls(x, weights, nk, dtype):
    import torch

    tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    xt = torch.from_numpy(np.array(x.astype(jnp.float32))).to(tdtype)
    # torch's Linear holds (out, in): the head's table as it is, a kernel (k, n) transposed.
    wt = [
        torch.from_numpy(np.array(w.astype(jnp.float32))).to(tdtype)
        if nk
        else torch.from_numpy(np.asarray(w.astype(jnp.float32)).T.copy()).to(tdtype)
        for w in weights
    ]

    def call():
        with torch.no_grad():
            return [torch.nn.functional.linear(xt, w) for w in wt]

    def result():  # every copy's, as the Flax ways'
        return np.stack([out.float().numpy() for out in call()])

    return call, result


def run(config, progress=None) -> list[dict]:
    rows = []
    for model, k, n, nk, m in _cases(config):
        copies = max(1, math.ceil(config.products_weight_mb * 1e6 / (4 * k * n)))
        calls, results, held, refused = {}, {}, {}, {}
        for dtype in DTYPES:
            x, weights, scales = _operands(k, n, nk, dtype, copies, m)
            held[dtype] = sum(w.nbytes for w in weights) + sum(s.nbytes for s in scales)
            for implementation, product in ways(m, dtype).items():
                fn = functools.partial(_jitted(product, implementation, nk), x, weights, scales)
                try:
                    out = jax.block_until_ready(fn())  # compiles
                except jax.errors.JaxRuntimeError as error:  # e.g. oneDNN without bf16 here
                    refused[dtype, implementation] = str(error).splitlines()[0][:160]
                    continue
                if progress is not None:
                    progress.update(1)
                result = np.stack([np.asarray(o, np.float32) for o in out])  # every copy's
                if implementation != "xla":  # "xla" comes first: the reference of its dtype
                    _, rel = max_diffs({"p": result}, {"p": results[dtype, "xla"]})
                    if rel > AGREE[dtype]:
                        refused[dtype, implementation] = (
                            f"differs from XLA's product by {rel:.1e} (relative) > "
                            f"{AGREE[dtype]:g}: not timing a wrong result"
                        )
                        continue
                results[dtype, implementation] = result
                calls[dtype, implementation] = fn
            if dtype != "int8":
                call, result = _torch_calls(x, weights, nk, dtype)
                call()
                results[dtype, "torch"] = result()
                calls[dtype, "torch"] = call
                if progress is not None:
                    progress.update(1)
        timings = interleaved(calls, config.products_repeats, progress)
        base = timings["float32", "xla"]["median_ms"]
        case = f"{model}_{'head_' if nk else ''}{k}x{n}_m{m}"
        for (dtype, implementation), timing in timings.items():
            per = timing["median_ms"] / copies
            diffs = max_diffs(
                {"product": results[dtype, implementation]},
                {"product": results[dtype, "xla"]},
            )
            rows.append(
                make_row(
                    "products", case, dtype, "torch" if implementation == "torch" else "flax",
                    implementation, batch=m, timing=timing,
                    value=held[dtype] / copies / (per / 1e3) / 1e9, unit="weight GB/s",
                    ratio=timing["median_ms"] / base, ratio_of=RATIO_OF, diffs=diffs,
                    note=f"{copies} products a call; ms per product {per:.3f}",
                )
            )  # fmt: skip
        for (dtype, implementation), why in refused.items():
            rows.append(
                make_row("products", case, dtype, "flax", implementation, batch=m,
                         skipped=True, note=f"refused here: {why}")
            )  # fmt: skip
    return rows


def format_rows(rows: list[dict], table) -> str:
    """The section's table (``table(headers, lines)`` from ``benchmarks.cli``)."""
    headers = ["case", "dtype", "implementation", "ms/product", "GB/s", "/xla f32",
               "max diff (rel)"]  # fmt: skip
    lines = [
        [r["case"], r["mode"], r["implementation"], "-", "-", "-", r["note"]] if r["skipped"]
        else [r["case"], r["mode"], r["implementation"],
              f"{r['median_ms'] / int(r['note'].split()[0]):.3f}", f"{r['value']:.1f}",
              f"{r['ratio']:.2f}", f"{r['max_rel_diff']:.1e}"]
        for r in rows
    ]  # fmt: skip
    if not lines:
        return ""
    title = (
        "Products: x (m, k) @ W per weight dtype and way, median ms per product; /xla f32 = "
        "time / XLA's float32 time at that shape, same run (< 1: faster)"
    )
    return f"{title}\n{table(headers, lines)}\n"
