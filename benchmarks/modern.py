"""The book's modern attention, timed: grouped-query attention against torch's SDPA with
``enable_gqa=True``, and a sliding-window prefill against full causal attention.

``python -m benchmarks.modern [--repeats N] [--quick]`` prints median ms and the ratios, each
ratio's callables timed round-robin in one run (``benchmarks.timing.interleaved``):

- ``gqa``: ``fa.GroupedQueryAttention`` at GPT-2 small's width (768 features, 12 query heads over
  4 key heads), forward and forward+backward (the gradient of every parameter and of ``x``),
  jitted, against a torch module with the same weights whose core is
  ``scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)`` (its keys and
  values as the book's layer projects them, not repeated); goal: at most 0.9x its time.
- ``swa``: ``fa.MultiHeadAttentionWithSWA`` with a window of 1024 over an 8192-token prefill
  against the same layer without a window (full causal attention, same weights), and the
  attention core alone (``dot_product_attention`` with and without ``window``, 12 heads of 64);
  goal: at most 0.25x its time (the window's kernels skip the tiles outside it, so the core's
  time grows with ``t * W``, not ``t^2``; the layer's four projections cost the same either
  way, which bounds the whole layer's ratio well above the core's).

- ``decode``: tokens per second of ``flax_attention.models.generate`` on each of the book's GPT
  variants (GPT-2 small with grouped heads, a latent, or 5:1 windows) against the book's
  ``generate_text_simple_cached`` on its torch model (``conformance_tests/book_modern.py``),
  same weights; the tokens must be equal (``max diff`` 0, else inf).

Outputs are compared before anything is timed; the rows record the largest difference.
``--peak-memory`` measures instead the peak RSS of a 32768-token prefill through the window
layer and through the same layer without a window, each in a fresh process.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import flax_attention as fa
import torch_reference as tr
from benchmarks.machine import describe as describe_machine
from benchmarks.timing import median_ms

__all__ = ["main", "run_gqa", "run_swa"]


class _TorchSDPAGroupedQuery(torch.nn.Module):
    """The book's ``GroupedQueryAttention`` (its weights) with torch's fused SDPA as the core."""

    def __init__(self, book: tr.GroupedQueryAttention):
        super().__init__()
        self.book = book

    def forward(self, x):
        book, (b, t, _) = self.book, x.shape
        q = book.W_query(x).view(b, t, book.num_heads, book.head_dim).transpose(1, 2)
        k = book.W_key(x).view(b, t, book.num_kv_groups, book.head_dim).transpose(1, 2)
        v = book.W_value(x).view(b, t, book.num_kv_groups, book.head_dim).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )
        return book.out_proj(out.transpose(1, 2).reshape(b, t, book.d_out))


def _row(case, pass_, flax_ms, baseline_ms, goal, max_diff) -> dict:
    """One table row: the two medians, their ratio, the goal it is held to, the outputs'
    largest difference."""
    return {
        "case": case,
        "pass": pass_,
        "flax_ms": flax_ms,
        "baseline_ms": baseline_ms,
        "ratio": flax_ms / baseline_ms,
        "goal": goal,
        "max_diff": max_diff,
    }


def _flax_calls(layer, x):
    """Jitted forward and forward+backward of ``layer`` on ``x`` (over ``nnx.split``)."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    @jax.jit
    def forward(params, x):
        return nnx.merge(graphdef, params, rest)(x)

    @jax.jit
    def forward_backward(params, x):
        def loss(params, x):
            return nnx.merge(graphdef, params, rest)(x).sum()

        return jax.grad(loss, argnums=(0, 1))(params, x)

    return (lambda: forward(params, x)), (lambda: forward_backward(params, x))


def _torch_calls(module, x):
    x_grad = x.clone().requires_grad_(True)

    def forward():
        with torch.no_grad():
            return module(x)

    def forward_backward():
        module.zero_grad(set_to_none=True)
        x_grad.grad = None
        module(x_grad).sum().backward()
        return x_grad.grad

    return forward, forward_backward


def run_gqa(batch, tokens, repeats, d=768, heads=12, groups=4) -> list[dict]:
    """Forward and forward+backward rows: Flax (default implementation) over torch SDPA."""
    torch.manual_seed(0)
    book = tr.GroupedQueryAttention(d, d, 0.0, heads, groups).eval()
    layer = fa.GroupedQueryAttention(d, d, 0.0, heads, groups, rngs=nnx.Rngs(0))
    fa.load_state_dict(layer, {k: v.numpy() for k, v in book.state_dict().items()})
    layer.eval()
    x = np.random.default_rng(0).standard_normal((batch, tokens, d)).astype(np.float32)
    flax_fwd, flax_both = _flax_calls(layer, jnp.asarray(x))
    torch_fwd, torch_both = _torch_calls(_TorchSDPAGroupedQuery(book), torch.tensor(x))
    diff = float(np.abs(np.asarray(flax_fwd()) - torch_fwd().numpy()).max())
    rows = []
    for name, flax_call, torch_call in (
        ("forward", flax_fwd, torch_fwd),
        ("forward+backward", flax_both, torch_both),
    ):
        flax_call(), torch_call()  # warm: compiled, allocated
        ms = median_ms({"flax": flax_call, "torch sdpa": torch_call}, repeats)
        rows.append(
            _row(
                f"gqa b{batch} t{tokens} ({heads} heads over {groups})",
                name,
                ms["flax"],
                ms["torch sdpa"],
                0.9,
                diff,
            )
        )
    return rows


def run_swa(tokens, window, repeats, d=768, heads=12) -> list[dict]:
    """A prefill of ``tokens`` through a window of ``window`` over the same full causal layer."""
    windowed = fa.MultiHeadAttentionWithSWA(
        d, d, 0.0, heads, sliding_window_size=window, rngs=nnx.Rngs(0)
    )
    full = fa.MultiHeadAttentionWithSWA(d, d, 0.0, heads, rngs=nnx.Rngs(0))  # same weights
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, tokens, d)), jnp.float32)
    win_fwd, _ = _flax_calls(windowed, x)
    full_fwd, _ = _flax_calls(full, x)
    head = slice(0, window)  # the first W tokens see the same keys either way
    diff = float(np.abs(np.asarray(win_fwd())[:, head] - np.asarray(full_fwd())[:, head]).max())
    win_fwd(), full_fwd()
    ms = median_ms({"window": win_fwd, "full": full_fwd}, repeats)
    return [
        _row(f"swa prefill t{tokens} W{window}", "forward", ms["window"], ms["full"], 0.25, diff)
    ]


def run_swa_core(tokens, window, repeats, heads=12, head_dim=64) -> list[dict]:
    """The attention core alone (``attend``, the default implementation): the window's causal
    attention over full causal attention, the projections left out (they cost the same)."""
    rng = np.random.default_rng(2)
    q, k, v = (
        jnp.asarray(rng.standard_normal((1, tokens, heads, head_dim)), jnp.float32) for _ in "qkv"
    )

    def core(window):
        @jax.jit
        def run(q, k, v):
            return fa.dot_product_attention(
                q, k, v, is_causal=True, window=window, implementation=None, need_weights=False
            )[0]

        return lambda: run(q, k, v)

    win, full = core(window), core(None)
    diff = float(np.abs(np.asarray(win())[:, :window] - np.asarray(full())[:, :window]).max())
    ms = median_ms({"window": win, "full": full}, repeats)
    return [_row(f"swa core t{tokens} W{window}", "forward", ms["window"], ms["full"], 0.25, diff)]


#: GPT-2 small's config, for the decode rows (each variant's keys added).
GPT2_SMALL = {"vocab_size": 50257, "context_length": 1024, "emb_dim": 768, "n_heads": 12,
              "n_layers": 12, "drop_rate": 0.0, "qkv_bias": False}  # fmt: skip
VARIANTS = {
    "gqa (4 key heads)": {"n_kv_groups": 4},
    "mla (latent 96)": {"latent_dim": 96},
    "swa (W 128, 5:1)": {"sliding_window_size": 128, "sliding_window_stride": 5},
}


def run_decode(new_tokens, repeats, cfg=None, prompt_tokens=16) -> list[dict]:
    """Tokens per second of ``models.generate`` (greedy, b1, through the decode caches) on each
    of the book's GPT variants against the book's ``generate_text_simple_cached`` on its torch
    model with the same weights; the tokens must be equal."""
    from conformance_tests import book_modern
    from flax_attention import models

    rows = []
    for name, keys in VARIANTS.items():
        config = {**(cfg or GPT2_SMALL), **keys}
        torch.manual_seed(0)
        twin = book_modern.GPTModel(config).eval()
        model = models.GPTModel(config, rngs=nnx.Rngs(0))
        fa.load_state_dict(model, {k: v.numpy() for k, v in twin.state_dict().items()})
        ids = np.random.default_rng(3).integers(0, config["vocab_size"], (1, prompt_tokens))
        context = config["context_length"]

        def flax_call(model=model, ids=ids, context=context):
            return models.generate(model, ids, new_tokens, context)

        def torch_call(twin=twin, ids=ids):
            return book_modern.generate_text_simple_cached(twin, torch.tensor(ids), new_tokens)

        same = np.array_equal(np.asarray(flax_call()), torch_call().numpy())
        ms = median_ms({"flax": flax_call, "torch": torch_call}, repeats)
        rows.append(
            _row(
                f"decode {name} b1, {new_tokens} tokens",
                "generate",
                ms["flax"],
                ms["torch"],
                1.0,
                0.0 if same else float("inf"),
            )
        )
    return rows


_PEAK = """
import resource, sys, time
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
import flax_attention as fa
tokens, window = int(sys.argv[1]), None if sys.argv[2] == "none" else int(sys.argv[2])
layer = fa.MultiHeadAttentionWithSWA(
    768, 768, 0.0, 12, sliding_window_size=window, rngs=nnx.Rngs(0)
)
graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
forward = jax.jit(lambda p, x: nnx.merge(graphdef, p, rest)(x))
x = jnp.asarray(np.random.default_rng(0).standard_normal((1, tokens, 768)), jnp.float32)
jax.block_until_ready(forward(params, x))
start = time.perf_counter()
jax.block_until_ready(forward(params, x))
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def run_peak_memory(tokens: int = 32768, window: int = 1024) -> list[dict]:
    """A ``tokens``-token prefill through ``MultiHeadAttentionWithSWA`` (768 features, 12 heads)
    with and without the window, each in a fresh process: its peak RSS (the process's whole,
    inputs and compile included) and the second call's time. The materialised scores alone
    would be ``12 * tokens^2 * 4`` bytes."""
    import subprocess
    import sys

    rows = []
    for w in (window, None):
        done = subprocess.run(
            [sys.executable, "-c", _PEAK, str(tokens), str(w).lower()],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        seconds, peak = done.stdout.split()
        rows.append({"window": w, "seconds": float(seconds), "peak_bytes": int(peak)})
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.modern", description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 repeats (smoke)")
    parser.add_argument(
        "--peak-memory", action="store_true", help="only the 32k-token window prefill's peak RSS"
    )
    args = parser.parse_args(argv)
    if args.peak_memory:
        scores = 12 * 32768**2 * 4 / 1e9
        for row in run_peak_memory():
            print(
                f"window {row['window']}: peak RSS {row['peak_bytes'] / 1e6:.0f} MB, "
                f"second call {row['seconds']:.2f} s (the scores alone: {scores:.1f} GB)"
            )
        return
    repeats = 2 if args.quick else args.repeats
    if args.quick:
        rows = run_gqa(1, 64, repeats, d=48, heads=6, groups=2)
        rows += run_swa(256, 32, repeats, d=48, heads=6) + run_swa_core(256, 32, repeats, 6, 8)
        tiny = {**GPT2_SMALL, "vocab_size": 97, "context_length": 64, "emb_dim": 48, "n_heads": 4}
        rows += run_decode(8, repeats, {**tiny, "n_layers": 2})
    else:
        rows = run_gqa(8, 1024, repeats) + run_gqa(1, 4096, repeats)
        rows += run_swa(8192, 1024, repeats) + run_swa_core(8192, 1024, repeats)
        rows += run_decode(64, repeats)
    print(describe_machine(torch.get_num_threads()))
    header = ("case", "pass", "flax ms", "base ms", "ratio", "goal", "max diff")
    print("{:38} {:17} {:>9} {:>9} {:>6} {:>5} {:>9}".format(*header))
    for r in rows:
        met = "met" if r["ratio"] <= r["goal"] else "NOT met"
        print(
            f"{r['case']:38} {r['pass']:17} {r['flax_ms']:9.1f} {r['baseline_ms']:9.1f} "
            f"{r['ratio']:6.2f} {r['goal']:5.2f} {r['max_diff']:9.1e} {met}"
        )


if __name__ == "__main__":
    main()
