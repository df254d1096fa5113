"""The native CPU kernel against torch SDPA and ``blocked``: ratios of medians in one run.

``python -m benchmarks.native`` prints, for GPT-2 small's attention (12 heads, head dim 64,
causal) at b8 t256, b8 t1024 and b1 t4096, the attention core alone (``(b, t, h, d)`` in and
out), forward and forward+backward, each as a time and a ratio to torch's
``scaled_dot_product_attention(is_causal=True)``; then the peak memory growth of a training step
with dropout 0.1 at t8192 b1 through the kernel (a subprocess). The whole ``MultiHeadAttention``
with ``implementation="native"`` is in ``python -m benchmarks`` (the speed section).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np

from benchmarks.timing import median_ms

SHAPES = ((8, 256), (8, 1024), (1, 4096))
HEADS, HEAD_DIM = 12, 64


def _core_calls(batch, tokens):
    import jax
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as F

    from flax_attention.kernels.blocked import blocked_attention
    from flax_attention.kernels.native import native_attention
    from flax_attention.masking import AttentionMask

    CAUSAL = AttentionMask(is_causal=True)  # noqa: N806
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((batch, tokens, HEADS, HEAD_DIM), np.float32) for _ in "qkv")
    tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in (q, k, v))
    jq, jk, jv = (jnp.asarray(x) for x in (q, k, v))
    tg = [x.clone().requires_grad_() for x in (tq, tk, tv)]

    def sdpa():
        with torch.no_grad():
            F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)

    def sdpa_backward():
        F.scaled_dot_product_attention(*tg, is_causal=True).sum().backward()

    kernels = {
        "native": lambda q, k, v: native_attention(q, k, v, CAUSAL),
        "blocked": lambda q, k, v: blocked_attention(q, k, v, CAUSAL),
    }
    forward = {"sdpa": sdpa}
    backward = {"sdpa": sdpa_backward}
    for name, fn in kernels.items():
        f = jax.jit(fn)
        g = jax.jit(jax.grad(lambda q, k, v, fn=fn: fn(q, k, v).sum(), (0, 1, 2)))
        forward[name] = lambda f=f: f(jq, jk, jv).block_until_ready()
        backward[name] = lambda g=g: jax.block_until_ready(g(jq, jk, jv))
    return forward, backward


_MEMORY = """
import json, numpy as np, jax, jax.numpy as jnp
from flax_attention.kernels.native import native_attention
from flax_attention.masking import AttentionMask
t, h, d = {tokens}, {heads}, {head_dim}
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((1, t, h, d)), jnp.float32) for _ in "qkv")
def loss(q, k, v):
    out = native_attention(q, k, v, AttentionMask(is_causal=True), dropout_rate=0.1, dropout_seed=0)
    return (out * out).sum()
step = jax.jit(jax.grad(loss, (0, 1, 2)))
def status(field):  # kB
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])
step.lower(q, k, v).compile()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS
before = status("VmRSS:")
jax.block_until_ready(step(q, k, v))
print(json.dumps({{"peak_growth_mb": (status("VmHWM:") - before) / 1024}}))
"""


def memory(tokens=8192):
    """Peak RSS growth (MB) of one compiled training step (gradients of q, k, v through the
    kernel with dropout) over the process's RSS before it, in a fresh process."""
    script = _MEMORY.format(tokens=tokens, heads=HEADS, head_dim=HEAD_DIM)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])["peak_growth_mb"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    rows = []
    for batch, tokens in SHAPES:
        for level, make in (("core", _core_calls),):
            forward, backward = make(batch, tokens)
            for mode, fns in (("fwd", forward), ("fwd+bwd", backward)):
                ms = median_ms(fns, args.repeats)
                row = {"shape": f"b{batch} t{tokens}", "level": level, "mode": mode, **ms}
                rows.append(row)
                print(
                    f"{row['shape']:>10} {level:>6} {mode:>7}: sdpa {ms['sdpa']:8.1f} ms  "
                    f"native {ms['native']:8.1f} ms ({ms['native'] / ms['sdpa']:.2f}x)  "
                    f"blocked {ms['blocked']:8.1f} ms ({ms['blocked'] / ms['sdpa']:.2f}x)",
                    flush=True,
                )
    print(f"training step, dropout 0.1, b1 t8192: peak growth {memory():.0f} MB", flush=True)
    return rows


if __name__ == "__main__":
    main()
