"""The decode caches' bytes of the book's attention variants, read off the layers themselves.

``python -m benchmarks.cache_memory`` prints, for GPT-2 small and for the book's larger examples,
how many bytes a whole model's decode caches hold: each layer is built abstractly
(``nnx.eval_shape``: no weights or caches are allocated, so 17 GB caches cost nothing), its
``init_cache(batch, max_length, dtype)`` run, and the bytes of the arrays it made summed. The
book's memory estimators (``ch04/04_gqa/memory_estimator_gqa.py``, ``05_mla``, ``06_swa``) print
their own totals for the same settings; ``BOOK`` holds them and the tests hold these rows equal
(``conformance_tests/tests/test_modern.py``). ``--chart PATH`` draws the rows as a PNG.

One naming difference: the book's GQA estimator reads ``--n_kv_groups 4`` as four query heads per
key head (``n_heads // n_kv_groups`` key heads), while its ``GroupedQueryAttention`` reads
``num_kv_groups`` as the number of key heads. The layers here follow the layer: the estimator's
``n_kv_groups 4`` of 32 heads is ``GroupedQueryAttention(..., num_kv_groups=8)``.
"""

from __future__ import annotations

import argparse
import functools

import jax.numpy as jnp
from flax import nnx

import flax_attention as fa

__all__ = ["BOOK", "ROWS", "cache_bytes", "gigabytes", "main"]

_CACHES = ("cached_key", "cached_value", "cached_latent")


def cache_bytes(make_layer, batch: int, max_length: int, dtype) -> int:
    """Bytes of the decode cache ``make_layer(rngs=...)`` keeps for ``batch`` sequences of
    ``max_length`` tokens in ``dtype`` (keys and values, or the latent; its 4-byte index not
    counted), without allocating it."""

    def build():
        layer = make_layer(rngs=nnx.Rngs(0))
        layer.init_cache(batch, max_length, dtype)
        return layer

    layer = nnx.eval_shape(build)
    arrays = [getattr(layer, name, None) for name in _CACHES]
    return sum(a.size * jnp.dtype(a.dtype).itemsize for a in arrays if a is not None)


def gigabytes(n: int) -> str:
    """The book's estimators' unit: ``n / 1000**3``, two decimals."""
    return f"{n / 1000**3:,.2f} GB"


def _model(layers):
    """A model's caches: ``layers`` is ``[(count, make_layer), ...]``."""

    def total(batch, max_length, dtype):
        return sum(n * cache_bytes(make, batch, max_length, dtype) for n, make in layers)

    return total


def _gpt2_small(variant):
    d, heads, layers = 768, 12, 12
    make = {
        "MHA": functools.partial(fa.MultiHeadAttention, d, d, 1024, 0.0, heads),
        "GQA (3 key heads)": functools.partial(fa.GroupedQueryAttention, d, d, 0.0, heads, 3),
        "MLA (latent 96)": functools.partial(fa.MultiHeadLatentAttention, d, d, 0.0, heads),
    }
    if variant in make:
        return _model([(layers, make[variant])])
    window = functools.partial(
        fa.MultiHeadAttentionWithSWA, d, d, 0.0, heads, sliding_window_size=256
    )
    full = functools.partial(fa.MultiHeadAttentionWithSWA, d, d, 0.0, heads)
    return _model([(10, window), (2, full)])  # 5:1 over 12 layers: 10 window, 2 full


def _book_example(variant):
    """The book's READMEs' examples: 4096 features, 32 heads, 32 layers (MLA: 2048, 48 layers)."""
    d, heads, n = 4096, 32, 32
    if variant == "MHA":
        return _model([(n, functools.partial(fa.MultiHeadAttention, d, d, 32768, 0.0, heads))])
    if variant == "GQA (8 key heads)":
        gqa = functools.partial(fa.GroupedQueryAttention, d, d, 0.0, heads, 8)
        return _model([(n, gqa)])
    if variant == "MLA (latent 1024)":
        mla = functools.partial(fa.MultiHeadLatentAttention, 2048, 2048, 0.0, 16, latent_dim=1024)
        return _model([(48, mla)])
    window = functools.partial(
        fa.MultiHeadAttentionWithSWA, d, d, 0.0, heads, sliding_window_size=1024
    )
    full = functools.partial(fa.MultiHeadAttentionWithSWA, d, d, 0.0, heads)
    return _model([(27, window), (5, full)])  # the estimator's 5:1 over 32 layers: 27 and 5


_BOOK_GQA = "the book's GQA/SWA example, 32768 tokens, bf16"

#: (setting, variant, batch, max_length, dtype, total(batch, max_length, dtype)).
ROWS = [
    *(
        ("GPT-2 small, 1024 tokens, fp32", v, 1, 1024, jnp.float32, _gpt2_small(v))
        for v in ("MHA", "GQA (3 key heads)", "MLA (latent 96)", "SWA 256, 5:1")
    ),
    *(
        (_BOOK_GQA, v, 1, 32768, jnp.bfloat16, _book_example(v))
        for v in ("MHA", "GQA (8 key heads)", "SWA 1024, 5:1")
    ),
    ("the book's MLA example, 8192 tokens, bf16", "MLA (latent 1024)", 1, 8192, jnp.bfloat16,
     _book_example("MLA (latent 1024)")),
]  # fmt: skip

#: The book's estimators' printed totals for the same settings (its READMEs).
BOOK = {
    ("the book's GQA/SWA example, 32768 tokens, bf16", "MHA"): "17.18 GB",
    ("the book's GQA/SWA example, 32768 tokens, bf16", "GQA (8 key heads)"): "4.29 GB",
    ("the book's GQA/SWA example, 32768 tokens, bf16", "SWA 1024, 5:1"): "3.14 GB",
    ("the book's MLA example, 8192 tokens, bf16", "MLA (latent 1024)"): "0.81 GB",
}


def table() -> list[tuple[str, str, int, str]]:
    """``(setting, variant, bytes, the book's printed total or "")`` for every row."""
    return [
        (setting, variant, total(batch, length, dtype), BOOK.get((setting, variant), ""))
        for setting, variant, batch, length, dtype, total in ROWS
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cache_memory", description=__doc__)
    parser.add_argument("--chart", help="draw the rows as a PNG at this path (needs matplotlib)")
    args = parser.parse_args(argv)
    rows = table()
    print(f"{'setting':48} {'variant':18} {'bytes':>15} {'MB':>9} {'here':>9} {'the book':>9}")
    for setting, variant, n, book in rows:
        print(f"{setting:48} {variant:18} {n:15,d} {n / 1e6:9.1f} {gigabytes(n):>9} {book:>9}")
    if args.chart:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
        for ax, setting in zip(axes, dict.fromkeys(r[0] for r in rows)):
            mine = [(v, n) for s, v, n, _ in rows if s == setting]
            ax.barh([v for v, _ in mine], [n / 1e6 for _, n in mine], color="#4477aa")
            ax.set_title(setting, fontsize=9)
            ax.set_xlabel("decode cache, MB (10^6 bytes)")
        fig.suptitle("A whole model's decode cache by attention variant (benchmarks.cache_memory)")
        fig.tight_layout()
        fig.savefig(args.chart, dpi=110)


if __name__ == "__main__":
    main()
