"""Correctness against numpy and a quick timing sanity check for ``benchmarks.onednn_ffi``.

PYTHONPATH=. python -m benchmarks.onednn_ffi.check [--time]
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import onednn_ffi

CASES = [  # (name, x dtype, w dtype, scaled)
    ("f32", np.float32, np.float32, False),
    ("f32+scale", np.float32, np.float32, True),
    ("bf16", jnp.bfloat16, jnp.bfloat16, False),
    ("f32 x s8+scale", np.float32, np.int8, True),
    ("bf16 x s8+scale", jnp.bfloat16, np.int8, True),
]


def operands(rng, m, k, n, xt, wt, scaled, nk):
    x = rng.standard_normal((m, k)).astype(xt)
    if wt == np.int8:
        w = rng.integers(-127, 128, (k, n)).astype(np.int8)
    else:
        w = rng.standard_normal((k, n)).astype(wt)
    s = (rng.random(n).astype(np.float32) + 0.5) / 64 if scaled else None
    return x, (np.ascontiguousarray(w.T) if nk else w), w, s


def check() -> bool:
    rng = np.random.default_rng(0)
    ok = True
    keep = []  # packed=True caches by weights address: keep every weights buffer alive
    for name, xt, wt, scaled in CASES:
        for k, n in ((64, 96), (768, 3072)):
            for nk, packed in ((False, False), (True, False), (False, True), (True, True)):
                errs = []
                for m in (1, 8, 32, 512):
                    x, w_arg, w, s = operands(rng, m, k, n, xt, wt, scaled, nk)
                    ref = x.astype(np.float64) @ w.astype(np.float64)
                    if s is not None:
                        ref = ref * s
                    w_arg = jnp.asarray(w_arg)
                    keep.append(w_arg)
                    try:
                        out = np.asarray(onednn_ffi.matmul(x, w_arg, s, nk=nk, packed=packed))
                    except Exception as e:  # noqa: BLE001
                        msg = str(e).splitlines()[0][:200]
                        errs = None
                        break
                    errs.append(float(np.abs(out - ref).max() / np.abs(ref).max()))
                tag = f"{name:16s} k={k:4d} n={n:4d} nk={nk!s:5s} packed={packed!s:5s}"
                if errs is None:
                    print(f"{tag}  UNSUPPORTED: {msg}")
                    continue
                worst = max(errs)
                ok &= worst < 1e-5
                shown = " ".join(f"m{m}={e:.1e}" for m, e in zip((1, 8, 32, 512), errs))
                print(f"{tag}  max rel err {shown}")
    return ok


def median_ms(f, *args, reps=20):
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def timing() -> None:
    import os

    print("uptime:", os.popen("uptime").read().strip())
    k, n = 768, 3072
    rng = np.random.default_rng(1)
    one = jax.jit(lambda x, w: onednn_ffi.matmul(x, w))
    one_nk = jax.jit(lambda x, w: onednn_ffi.matmul(x, w, nk=True))
    pk = jax.jit(lambda x, w: onednn_ffi.matmul(x, w, packed=True))
    pk_nk = jax.jit(lambda x, w: onednn_ffi.matmul(x, w, nk=True, packed=True))
    xla = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
    xla_nk = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32))
    for m in (1, 512):
        for name, dt in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
            x = jnp.asarray(rng.standard_normal((m, k)), dt)
            w = jnp.asarray(rng.standard_normal((k, n)), dt)
            wt = jnp.asarray(np.ascontiguousarray(np.asarray(w).T))
            a, b = median_ms(one, x, w), median_ms(xla, x, w)
            c, d = median_ms(one_nk, x, wt), median_ms(xla_nk, x, wt)
            p, q = median_ms(pk, x, w), median_ms(pk_nk, x, wt)
            print(
                f"m={m:4d} {name:4s} (k,n): oneDNN {a:7.3f} packed {p:7.3f} XLA {b:7.3f} ms | "
                f"(n,k): oneDNN {c:7.3f} packed {q:7.3f} XLA {d:7.3f} ms"
            )
    print("uptime:", os.popen("uptime").read().strip())


if __name__ == "__main__":
    print(onednn_ffi.info())
    good = check()
    print("correct" if good else "MISMATCH")
    if "--time" in sys.argv:
        timing()
    sys.exit(0 if good else 1)
