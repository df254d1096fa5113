"""Speed, memory, decode and compile-time benchmarks of ``flax_attention.MultiHeadAttention``
against the documents' eager torch module and torch's fused SDPA, with identical weights, and of
the whole model (``flax_attention.models``) against transformers' GPT-2.

``python -m benchmarks`` prints one table per section and the machine it ran on; ``--json PATH``
writes the rows (``ROW_FIELDS``), ``--charts DIR`` draws each section's ratios as a PNG
(``benchmarks.charts``, which also redraws them from that JSON), ``--quick`` runs a small smoke
configuration. Sections:

- ``speed``: forward and forward+backward at GPT-2 small sizes, every Flax implementation (jitted
  over ``nnx.split``/``nnx.merge``) against torch eager and torch SDPA; median ms and the ratios
  ``time / torch-eager`` and ``time / torch-SDPA`` from the same run.
- ``memory``: peak RSS growth of one forward and of one training step with dropout (compile
  included) in a fresh subprocess each.
- ``decode``: tokens/s of ``flax_attention.decode_loop`` against a torch KV-cache loop and against
  recomputing the full causal pass per token; per-token time early vs late in the cache.
- ``compile``: ``jax.jit(f).lower(...).compile()`` wall time of the GPT-2 small forward.
- ``generate``: the whole model, ``flax_attention.models.generate`` on a ``GPTModel`` against
  transformers' ``generate`` (tokens/s), the weight-streaming bound it runs against, and where
  a decode step's time goes.
- ``prefill``: the whole model's forward over a prompt against ``GPT2LMHeadModel``'s, and the
  same weights' prefill in bfloat16 and int8 against float32's.
- ``train``: ``flax_attention.models.train_step`` with optax's AdamW against
  ``GPT2LMHeadModel`` with ``torch.optim.AdamW``.
- ``parts``: the whole model's pieces (LayerNorm, the attention's projections and core, the MLP,
  a whole layer, the tied head with the loss, the embeddings) forward and forward+backward,
  each against transformers' own.
- ``annotated``: the Annotated Transformer's encoder-decoder (``flax_attention.models.annotated``)
  at the post's copy-task size against its torch twin written from the post's code
  (``conformance_tests/annotated_model.py``): a copy-task training step, and batched
  ``greedy_decode`` against the post's loop row by row and the same loop batched in torch.
- ``modern``: the book's modern attention (``benchmarks.modern``): ``GroupedQueryAttention``
  against torch SDPA with ``enable_gqa``, forward and forward+backward; the sliding window's
  prefill (the layer and its core) against full causal attention, its time and its peak memory;
  ``generate`` on each of the book's GPT variants (grouped-query, latent, windows) against the
  book's ``generate_text_simple_cached``.
- ``products``: the models' weight products alone (``benchmarks.products``), per weight dtype
  and way (XLA's dot, XLA with YNNPACK's dots, the narrow-weight kernel, oneDNN through
  ``jax.ffi`` where built, torch), at decode and prefill row counts: what the product entry
  chooses by.

Every timed Flax module holds the torch module's ``state_dict`` (``flax_attention.load_state_dict``;
the whole model: ``GPTModel.from_pretrained`` of the transformers model's ``save_pretrained``;
the Annotated Transformer's and the book's modern layers and models: their twins' ``state_dict``)
and its outputs are compared with torch before timing; rows record the max difference.
"""

#: How to install what ``python -m benchmarks`` needs (the ``report`` extra, torch's CPU build
#: first), from the clone's root: the package is not installed, it runs where it lies.
INSTALL = (
    "  pip install torch==2.13.0  # first: the CPU build (else pip may pull a multi-GB CUDA one)\n"
    "  pip install -e '.[report]'  # from the clone's root, where python -m benchmarks runs"
)

#: The keys of every JSON row (``None`` where a field does not apply to the row's section).
ROW_FIELDS = (
    "section",  # speed | memory | decode | compile | generate | prefill | train | parts |
    # annotated | modern | products | targets
    "case",  # e.g. "b8_t1024"
    "mode",  # forward | forward+backward | generate | recompute | steps@16 | compile ...
    "framework",  # flax | torch (generate's read-bandwidth rows: numpy | jax | torch)
    "implementation",  # reference | xla | blocked | default | cudnn | eager | sdpa | kv_cache
    "resolved",  # what implementation=None ran (default rows), else the implementation
    "batch",
    "tokens",
    "repeats",  # timed calls behind the median (0 for a skipped row)
    "median_ms",
    "min_ms",
    "value",  # the section's quantity: MB (memory), tokens/s (decode), s (compile)
    "unit",
    "ratio_vs_eager",  # time / torch-eager time, same run (speed, annotated's train step), or
    # speedup (decode; annotated's greedy decode: over the post's loop batched in torch)
    "ratio_vs_sdpa",  # time / torch-SDPA time, same run (speed, memory)
    "ratio",  # another ratio, described by ratio_of (decode speedup, flatness, modern, targets)
    "ratio_of",
    "target",  # the target this row checks (section "targets"; benchmarks.targets), else None
    "met",  # whether it is met (section "targets"), else None
    "max_abs_diff",  # max |flax - torch| over outputs (and gradients), None if not compared
    "max_rel_diff",  # max over tensors of max|diff| / max(1, max|torch|)
    "skipped",  # True when the row was not measured; note says why
    "note",
)
