"""What a run measures: the full configuration (GPT-2 small's sizes, the shapes docs/performance.md
reports) and ``--quick``, the tiny one the tests run."""

from __future__ import annotations

import dataclasses

__all__ = ["Config", "FULL", "QUICK", "SECTIONS", "SPEED_DTYPES", "parse_shape"]

SECTIONS = (
    "speed",
    "memory",
    "decode",
    "compile",
    "generate",
    "prefill",
    "train",
    "parts",
    "annotated",
    "modern",
    "products",
)

#: The speed section's dtypes (``--dtype``): float32, and bfloat16 where the fused GPU kernels run
#: (cuDNN's on the Flax side, torch SDPA's flash attention on torch's).
SPEED_DTYPES = ("float32", "bfloat16")


def parse_shape(text: str) -> tuple[int, int]:
    """``"b8t1024"`` (or ``"8x1024"``) -> ``(8, 1024)``."""
    cleaned = text.lower().replace("b", "").replace("x", "t")
    try:
        batch, tokens = (int(part) for part in cleaned.split("t"))
    except ValueError:
        raise ValueError(f"shape ({text!r}) must look like b8t1024") from None
    if batch < 1 or tokens < 1:
        raise ValueError(f"shape ({text!r}) must have a positive batch and token count")
    return batch, tokens


@dataclasses.dataclass(frozen=True)
class Config:
    # speed: (batch, tokens) and timed calls per shape (after one warm-up/compile call)
    speed_shapes: tuple[tuple[int, int], ...] = ((8, 256), (8, 1024), (1, 4096))
    speed_modes: tuple[str, ...] = ("forward", "forward+backward")
    speed_repeats: dict = dataclasses.field(
        default_factory=lambda: {(8, 256): 5, (8, 1024): 3, (1, 4096): 3}
    )
    default_repeats: int = 5
    #: The dtype of the layer, its input and torch's two modules in the speed section
    #: (``SPEED_DTYPES``); every row of a run not in float32 says it in its note.
    speed_dtype: str = "float32"
    #: ``{(implementation, mode, batch, tokens): reason}`` not run, the reason in its row. Empty:
    #: ``reference`` forward+backward at b1 t4096 fits the machine of docs/performance.md (its
    #: time and memory there: "Measurements behind the benchmarks' own choices"), so it is timed
    #: with the others.
    speed_skip: dict = dataclasses.field(default_factory=dict)
    # memory: forward (and a training step) at batch 1, one fresh subprocess per measurement
    memory_tokens: tuple[int, ...] = (4096, 8192, 32768)
    memory_reference_max_tokens: int = 8192  # Flax reference (materialises (h, t, t) scores)
    memory_eager_max_tokens: int = 4096  # torch eager (same; t = 8192: docs/performance.md)
    #: A training step with dropout at these t, of these implementations (``default``: what
    #: ``None`` picks).
    memory_train_tokens: tuple[int, ...] = (8192,)
    memory_train_implementations: tuple[str, ...] = ("default", "blocked")
    #: Measurement subprocesses at a time. RSS is per process, so concurrency changes only the
    #: call times, which this section reports for information; the full run keeps 1.
    memory_jobs: int = 1
    # decode
    decode_batches: tuple[int, ...] = (1, 8)
    decode_prompt: int = 16
    decode_steps: int = 256
    decode_repeats: int = 5
    decode_flat_steps: int = 64
    decode_flat_positions: tuple[int, int] = (16, 200)
    decode_recompute_samples: int = 5
    # compile
    compile_shape: tuple[int, int] = (1, 1024)
    compile_repeats: int = 3
    #: Implementations compiled (labels as in the rows); ``None``: every one on the backend.
    compile_implementations: tuple[str, ...] | None = None
    #: The whole model of the generate, prefill and train sections: ``transformers.GPT2Config``
    #: keywords ({}: GPT-2 small), random weights, float32.
    gpt_model: dict = dataclasses.field(default_factory=dict)
    # generate: flax_attention.models.generate against transformers' generate
    generate_batches: tuple[int, ...] = (1, 8)
    generate_prompt: int = 32
    generate_steps: int = 128
    generate_repeats: int = 3
    generate_flat_steps: int = 16
    #: The array each read-bandwidth sample reduces (much bigger than any cache), and how many
    #: times one sample reads it.
    bandwidth_mb: int = 1024
    bandwidth_reads: int = 4
    bandwidth_repeats: int = 7
    # prefill: GPTModel's forward against GPT2LMHeadModel's (sdpa), (batch, tokens)
    prefill_shape: tuple[int, int] = (1, 1024)
    prefill_repeats: int = 5
    #: The ``dtype prefill`` rows' (batch, tokens): float32, bfloat16 and int8 weights.
    prefill_dtype_shape: tuple[int, int] = (1, 512)
    # train: flax_attention.models.train_step against GPT2LMHeadModel + torch.optim.AdamW
    train_shape: tuple[int, int] = (8, 256)
    train_repeats: int = 3
    # parts: the model's pieces (one layer's, the head, the embeddings) against transformers'
    parts_shape: tuple[int, int] = (8, 256)
    parts_repeats: int = 7
    # annotated: the Annotated Transformer's model against its torch twin, the post's copy-task
    # size (vocabulary V, N layers each side, d_model, d_ff, h heads)
    annotated_model: dict = dataclasses.field(
        default_factory=lambda: {"V": 11, "N": 2, "d_model": 512, "d_ff": 2048, "h": 8}
    )
    #: A copy-task training step: rows of 10 ids (the post's batch of 80).
    annotated_train_rows: int = 80
    #: Greedy decoding: (rows, source tokens) padded, and ids out per row (start symbol included).
    annotated_decode_shape: tuple[int, int] = (8, 64)
    annotated_max_len: int = 64
    annotated_repeats: int = 3
    # modern: the book's modern attention (benchmarks.modern)
    #: Grouped-query attention against torch SDPA ``enable_gqa``: (batch, tokens), and the layer
    #: (features in and out, query heads, key and value heads).
    modern_gqa_shapes: tuple[tuple[int, int], ...] = ((8, 1024), (1, 4096))
    modern_gqa_layer: tuple[int, int, int] = (768, 12, 4)
    #: The sliding window's prefill against full causal attention: batch 1, ``tokens``, a window
    #: of ``window``; the layer (features, heads; its core alone: those heads of features /
    #: heads).
    modern_swa_tokens: int = 8192
    modern_swa_window: int = 1024
    modern_swa_layer: tuple[int, int] = (768, 12)
    #: Peak RSS growth of the window's prefill and of full causal's at these t (a fresh process
    #: each, ``benchmarks.memory``), the window and the layer as above.
    modern_memory_tokens: tuple[int, ...] = (32768,)
    #: Decoding: the book's GPT variants (name: the config keys each adds), on the book's
    #: config with ``modern_model``'s changes ({}: GPT-2 small), greedy, batch 1.
    modern_model: dict = dataclasses.field(default_factory=dict)
    modern_variants: dict = dataclasses.field(
        default_factory=lambda: {
            "gqa_kv4": {"n_kv_groups": 4},
            "mla_latent96": {"latent_dim": 96},
            "swa_w128_5to1": {"sliding_window_size": 128, "sliding_window_stride": 5},
        }
    )
    modern_decode_prompt: int = 16
    modern_decode_tokens: int = 64
    modern_repeats: int = 5
    # products: the models' weight products alone (benchmarks.products): model -> (k, n, nk)
    # (nk: a tied head, x @ E.T with E (n, k)), at each row count
    products_shapes: dict = dataclasses.field(
        default_factory=lambda: {
            "gpt2": ((768, 3072, False), (3072, 768, False), (768, 50257, True)),
            "qwen3": ((1024, 3072, False), (3072, 1024, False), (1024, 151936, True)),
        }
    )
    products_rows: tuple[int, ...] = (1, 8, 32, 512)
    #: Float32 megabytes of distinct weights one timed call reads (beyond the caches).
    products_weight_mb: int = 64
    products_repeats: int = 7

    def repeats_for(self, shape) -> int:
        return self.speed_repeats.get(tuple(shape), self.default_repeats)


FULL = Config()

QUICK = Config(
    speed_shapes=((1, 64),),
    speed_repeats={},
    default_repeats=1,
    memory_tokens=(1024,),
    memory_reference_max_tokens=0,
    memory_eager_max_tokens=0,
    memory_train_tokens=(256,),
    memory_train_implementations=("default",),  # each measurement is a process of its own
    memory_jobs=2,
    decode_batches=(2,),
    decode_prompt=4,
    decode_steps=8,
    decode_repeats=1,
    decode_flat_steps=4,
    decode_flat_positions=(4, 8),
    decode_recompute_samples=2,
    compile_shape=(1, 64),
    compile_repeats=1,
    compile_implementations=("default",),
    # One layer: every program of the whole model compiles its layers unrolled.
    gpt_model={"n_layer": 1, "n_head": 2, "n_embd": 32, "vocab_size": 101, "n_positions": 64},
    generate_batches=(2,),
    generate_prompt=4,
    generate_steps=8,
    generate_repeats=1,
    # steps - 1: the step parts' cache (prompt + steps - 1 slots) is then the early flatness
    # loop's (prompt + flat steps), so that loop and its prefill compile once for both.
    generate_flat_steps=7,
    bandwidth_mb=64,
    bandwidth_reads=1,
    bandwidth_repeats=2,
    prefill_shape=(1, 16),
    prefill_repeats=1,
    prefill_dtype_shape=(1, 16),
    train_shape=(2, 16),
    train_repeats=1,
    parts_shape=(2, 16),
    parts_repeats=1,
    annotated_model={"V": 11, "N": 1, "d_model": 32, "d_ff": 64, "h": 4},
    # One row: the dropout masks of the training step are then (h, t, s) and (t, d), not
    # (rows, h, t, s) and (rows, t, d); XLA's CPU backend unrolls its random-bit loops over
    # every small dimension, so a row less compiles that step in about two thirds of the time.
    annotated_train_rows=1,
    annotated_decode_shape=(2, 8),
    annotated_max_len=8,
    annotated_repeats=1,
    # 64 tokens: the native kernel's path, as the full shapes (below 64 x 64 scores a head the
    # reference's runs, whose gradient compiles in three times the time).
    modern_gqa_shapes=((1, 64),),
    modern_gqa_layer=(24, 6, 2),
    modern_swa_tokens=64,
    modern_swa_window=8,
    modern_swa_layer=(24, 6),
    # No peak memory rows: a fresh process each, about 2 s here; the memory section's rows run
    # that path, test_modern.py the rows' code on stand-ins.
    modern_memory_tokens=(),
    # No decode variant: each compiles its own generate, 1.3 to 1.9 s here, so the tests run the
    # decode rows' code on stand-ins of generate instead (test_modern.py), on this model (one
    # layer, as gpt_model above). To smoke it here, a variant that passes its window's edge:
    # {"swa_w8": {"sliding_window_size": 8, "sliding_window_stride": 1}}.
    modern_model={
        "vocab_size": 97,
        "context_length": 32,
        "emb_dim": 24,
        "n_heads": 4,
        "n_layers": 1,
    },
    modern_variants={},
    modern_decode_prompt=8,
    modern_decode_tokens=8,
    modern_repeats=1,
    products_shapes={"tiny": ((32, 101, True),)},
    products_rows=(1,),
    products_weight_mb=1,
    products_repeats=1,
)
