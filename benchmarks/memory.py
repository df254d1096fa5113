"""Section ``memory``: peak RSS growth of one forward at batch 1, one fresh subprocess each;
and of one training step with dropout 0.1 (``memory_train_tokens``; Flax only, the
``memory_train_implementations``: the default implementation and ``blocked``; forward and
backward through ``nnx.value_and_grad`` of ``sum(y**2)``, the layer in train mode, so dropout
runs inside the tiled kernels' tiles).

Each measurement runs ``python -m benchmarks.memory WORKER_JSON`` in a new process that imports
one framework, builds the module (random weights: memory does not depend on their values) and the
input, hands freed heap back (``malloc_trim``), resets the kernel's peak-RSS mark
(``/proc/self/clear_refs``), makes the call (for Flax: ``jax.jit`` trace + compile + run, as a
first call does) and reports the peak RSS growth over the RSS just before the call. The output
array is part of the growth (``4 * t * 768`` bytes).

The peak is read from ``VmHWM`` in ``/proc/self/status``, the memory map's high-water mark that
``getrusage(RUSAGE_SELF).ru_maxrss`` also reports, but without ``ru_maxrss``'s other term: the
kernel keeps ``signal->maxrss`` across ``fork``/``exec``, so a subprocess of a large parent starts
with the parent's peak as its ``ru_maxrss`` and a smaller call shows zero growth (as measured:
docs/performance.md, "Measurements behind the benchmarks' own choices"). ``ru_maxrss`` growth is
kept in the worker's output and used only where ``/proc`` is unavailable (the row then says it is
a lower bound).

A materialising implementation (Flax ``reference``, torch eager) is started only where its
measured need fits in ``MemAvailable``: ``2.5`` score-sized ``(h, t, t)`` float32 buffers plus
1 GiB (``3.5`` for torch eager; the growth they were measured at is in docs/performance.md, as
above); otherwise its row is skipped with the numbers.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import resource
import subprocess
import sys
import time

__all__ = ["measure", "plan_calls", "run"]

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEADS = 12
#: Dropout rate of the training-step measurement.
TRAIN_DROPOUT = 0.1
#: Timeout of one measurement subprocess (s).
TIMEOUT_S = 900


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes


def _status_bytes(field: str) -> int | None:
    """``VmHWM`` (peak RSS of this process's memory map) or ``VmRSS`` from /proc/self/status."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _worker(spec: dict) -> dict:
    """Runs in the subprocess: build, reset the peak, one call, report the growth."""
    build = _flax_call if spec["framework"] == "flax" else _torch_call
    return _peak_growth(build(spec))


def _flax_module(spec: dict):
    """The Flax module a measurement runs, random weights: ``MultiHeadAttention`` (its
    ``implementation``; in train mode with dropout where ``mode`` is ``"train"``), or with
    ``layer`` ``"swa"`` ``MultiHeadAttentionWithSWA`` (``heads`` heads, a ``window`` of that
    many tokens or ``None``: the section ``modern``'s measurements)."""
    from flax import nnx

    import flax_attention as fa

    tokens, d_model = spec["tokens"], spec.get("d_model", 768)
    train = spec.get("mode") == "train"
    if spec.get("layer") == "swa":
        module = fa.MultiHeadAttentionWithSWA(
            d_model, d_model, 0.0, spec.get("heads", HEADS),
            sliding_window_size=spec["window"], rngs=nnx.Rngs(0),
        )  # fmt: skip
    else:
        implementation = spec["implementation"]
        module = fa.MultiHeadAttention(
            d_model,
            d_model,
            tokens,
            TRAIN_DROPOUT if train else 0.0,
            HEADS,
            True,
            implementation=None if implementation == "default" else implementation,
            rngs=nnx.Rngs(0),
        )
    if train:
        module.train()
    else:
        module.eval()
    return module


def _flax_call(spec: dict):
    """``_flax_module``'s jitted forward, or its training step (``mode`` ``"train"``), on a
    random input: a callable that compiles and runs it."""
    import jax
    import numpy as np
    from flax import nnx

    batch, tokens, d_model = spec["batch"], spec["tokens"], spec.get("d_model", 768)
    module = _flax_module(spec)
    x = jax.numpy.asarray(
        np.random.default_rng(0).standard_normal((batch, tokens, d_model), dtype=np.float32)
    )
    if spec.get("mode") == "train":

        @nnx.jit
        def step(module, x):
            return nnx.value_and_grad(lambda module: (module(x) ** 2).sum())(module)

        return lambda: jax.block_until_ready(step(module, x))
    graphdef, state = nnx.split(module)
    forward = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    return lambda: jax.block_until_ready(forward(state, x))


def _torch_call(spec: dict):
    """The documents' module (``eager``) or the SDPA one, ``torch.no_grad()`` forward on a random
    input."""
    import torch

    from benchmarks.torch_modules import SDPAMultiHeadAttention
    from torch_reference import MultiHeadAttention

    batch, tokens, d_model = spec["batch"], spec["tokens"], spec.get("d_model", 768)
    torch.set_num_threads(spec.get("torch_threads") or os.cpu_count() or 1)
    cls = SDPAMultiHeadAttention if spec["implementation"] == "sdpa" else MultiHeadAttention
    torch.manual_seed(0)
    module = cls(d_model, d_model, tokens, 0.0, HEADS, True).eval()
    x = torch.randn(batch, tokens, d_model)

    def call():
        with torch.no_grad():
            return module(x)

    return call


def _peak_growth(call) -> dict:
    """Hand freed heap back, reset the peak, ``call()`` once: the peak RSS over the RSS before."""
    import ctypes
    import gc

    gc.collect()
    try:  # hand freed heap back to the OS, so the baseline RSS holds only live memory
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    reset = _reset_peak()
    before, rss_before = _maxrss_bytes(), _status_bytes("VmRSS")
    start = time.perf_counter()
    out = call()
    seconds = time.perf_counter() - start
    after, hwm_after = _maxrss_bytes(), _status_bytes("VmHWM")
    del out
    exact = reset and rss_before is not None and hwm_after is not None
    return {
        "growth_bytes": hwm_after - rss_before if exact else after - before,
        "maxrss_growth_bytes": after - before,
        "baseline_bytes": rss_before if exact else before,
        "seconds": seconds,
        "peak_reset": exact,
    }


def _estimate_scores_bytes(tokens: int, batch: int = 1) -> int:
    return 4 * batch * HEADS * tokens * tokens


def measure(spec: dict, timeout_s: int = TIMEOUT_S) -> dict:
    """Run one measurement in a fresh subprocess; returns the worker's dict or ``{"error"}``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.memory", json.dumps(spec)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {done.returncode}: {tail[0][:200]}"}
    return json.loads(lines[-1])


def _plan(config):
    """``(framework, implementation, tokens, mode)`` in run order."""
    plan = []
    for tokens in config.memory_tokens:
        plan.append(("flax", "default", tokens, "forward"))
        if tokens <= config.memory_reference_max_tokens:
            plan.append(("flax", "reference", tokens, "forward"))
        if tokens <= config.memory_eager_max_tokens:
            plan.append(("torch", "eager", tokens, "forward"))
        plan.append(("torch", "sdpa", tokens, "forward"))
    for tokens in config.memory_train_tokens:
        plan += [("flax", impl, tokens, "train") for impl in config.memory_train_implementations]
    return plan


def plan_calls(config) -> int:
    return len(_plan(config))


def run(config, progress=None, torch_threads=None) -> list[dict]:
    plan = _plan(config)

    def one(item):
        result = _measure_planned(item, torch_threads)
        if progress is not None:
            progress.update(1)
        return result

    with concurrent.futures.ThreadPoolExecutor(max_workers=config.memory_jobs) as pool:
        measured = list(pool.map(one, plan))
    return _rows(plan, measured)


def _measure_planned(item, torch_threads) -> dict:
    """``measure`` of one ``_plan`` item, or ``{"error"}`` where a materialising implementation's
    need (``2.5`` or ``3.5`` score-sized buffers + 1 GiB) exceeds ``MemAvailable``."""
    framework, implementation, tokens, mode = item
    spec = dict(
        framework=framework,
        implementation=implementation,
        batch=1,
        tokens=tokens,
        mode=mode,
        torch_threads=torch_threads,
    )
    factor = 2.5 if implementation == "reference" else 3.5
    need = factor * _estimate_scores_bytes(tokens) + 2**30
    available = _mem_available_bytes()
    materialises = implementation in ("reference", "eager")
    if materialises and available is not None and need > available:
        return {
            "error": f"skipped: needs ~{need / 2**30:.1f} GiB ({factor} x h t t x 4 B + 1 "
            f"GiB), MemAvailable {available / 2**30:.1f} GiB"
        }
    return measure(spec)


def _rows(plan, measured) -> list[dict]:
    """One row per measurement; a forward's holds its growth / torch SDPA's at the same t."""
    from benchmarks.rows import make_row

    rows, results = [], {}
    for (framework, implementation, tokens, mode), result in zip(plan, measured):
        if mode == "forward":
            results[(implementation, tokens)] = result
        common = dict(batch=1, tokens=tokens, unit="MB")
        case = f"b1_t{tokens}"
        mode = "forward" if mode == "forward" else f"train step, dropout {TRAIN_DROPOUT}"
        if "error" in result:
            rows.append(
                make_row("memory", case, mode, framework, implementation, skipped=True,
                         note=result["error"], **common)
            )  # fmt: skip
            continue
        rows.append(
            make_row(
                "memory", case, mode, framework, implementation,
                timing={"median_ms": result["seconds"] * 1e3, "min_ms": None, "repeats": 1},
                value=result["growth_bytes"] / 1e6,
                note="" if result["peak_reset"] else "ru_maxrss growth: a lower bound",
                **common,
            )
        )  # fmt: skip
    for row in rows:  # a forward's growth / torch SDPA's growth at the same t
        sdpa = results.get(("sdpa", row["tokens"]), {})
        if row["mode"] == "forward" and row["value"] is not None and sdpa.get("growth_bytes"):
            row["ratio_vs_sdpa"] = row["value"] * 1e6 / sdpa["growth_bytes"]
    return rows


if __name__ == "__main__":
    print(json.dumps(_worker(json.loads(sys.argv[1]))))
