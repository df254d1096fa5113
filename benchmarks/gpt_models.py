"""The whole model, in both frameworks with one set of weights: transformers'
``GPT2LMHeadModel`` and ``flax_attention.models.GPTModel`` (sections ``generate``, ``prefill``,
``train``).

- ``torch_models(config, attentions)``: ``GPT2LMHeadModel``s of ``config.gpt_model``'s shape
  (``{}``: GPT-2 small), random weights (``torch.manual_seed(0)``), float32, one per attention
  implementation, all holding the first one's weights; no end-of-text token, so ``generate``
  runs every step.
- ``flax_model(model)``: the ``GPTModel`` a user gets from that model's ``save_pretrained``
  directory (``GPTModel.from_pretrained``), and the seconds the load took.
- ``weight_bytes(model)``: the bytes of parameters one decode step reads.
- ``read_bandwidth``: the machine's memory read bandwidth, measured in this process.
- ``count_compiles()``: how many XLA compilations ran in a ``with`` block (a timed call that
  compiles is a bug of the benchmark, not a slow call).
"""

from __future__ import annotations

import contextlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from benchmarks.torch_device import to_torch
from flax_attention.models import GPTModel

__all__ = [
    "count_compiles",
    "flax_model",
    "hf_config",
    "read_bandwidth",
    "readers",
    "torch_models",
    "weight_bytes",
]


def hf_config(config, *, dropout: float | None = None, attention: str = "sdpa"):
    """``transformers.GPT2Config`` of ``config.gpt_model``, no special tokens; ``dropout``
    (``None``: transformers' default 0.1) sets every dropout rate."""
    import transformers

    rates = {} if dropout is None else dict.fromkeys(("resid_pdrop", "embd_pdrop", "attn_pdrop"),
                                                     dropout)  # fmt: skip
    gpt_config = transformers.GPT2Config(
        **config.gpt_model, **rates, bos_token_id=None, eos_token_id=None, pad_token_id=None
    )
    gpt_config._attn_implementation = attention
    return gpt_config


def torch_models(config, attentions=("eager", "sdpa"), *, dropout=None) -> dict:
    """``{attention: GPT2LMHeadModel}`` in eval mode, every one with the first one's weights."""
    import transformers

    torch.manual_seed(0)
    models = {}
    for attention in attentions:
        model = transformers.GPT2LMHeadModel(hf_config(config, dropout=dropout,
                                                       attention=attention)).eval()  # fmt: skip
        if models:
            model.load_state_dict(next(iter(models.values())).state_dict())
        model.set_attn_implementation(attention)
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        models[attention] = model
    return models


def flax_model(model) -> tuple[GPTModel, float]:
    """``(GPTModel, load seconds)``: ``model.save_pretrained`` into a temporary directory, then
    ``GPTModel.from_pretrained`` of it (timed), so both hold identical float32 weights."""
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory, safe_serialization=True)
        start = time.perf_counter()
        flax = GPTModel.from_pretrained(directory)
        return flax, time.perf_counter() - start


def weight_bytes(model: GPTModel) -> int:
    """Bytes of parameters a decode step reads: every parameter (the tied head's matrix, the
    token embedding, once: the head reads all of it), but one row of the position embedding."""
    from flax_attention.models.quantized import Int8Weight, WeightScale

    held = nnx.Any(nnx.Param, Int8Weight, WeightScale)  # a quantized model's int8 weights too
    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, held)))
    positions = model.pos_emb.embedding[...]
    return int(total - positions.nbytes + positions[0].nbytes)


# ---- memory read bandwidth -----------------------------------------------------------------------


def readers(megabytes: int, reads: int) -> dict:
    """``{name: call}``: each call reduces (max) a float32 array of ``megabytes`` MB ``reads``
    times, with numpy (one thread), a jitted JAX reduction (XLA's CPU threads) and torch (its
    ``set_num_threads``). Bytes per call: ``megabytes * 2**20 * reads``."""
    values = np.random.default_rng(0).standard_normal(megabytes * 2**18, np.float32)
    on_jax, on_torch = jnp.asarray(values), to_torch(values)
    jax_max = jax.jit(jnp.max)

    def repeat(read):
        def call():
            out = None
            for _ in range(reads):
                out = read()
            return out

        return call

    return {
        "numpy": repeat(values.max),
        "jax": repeat(lambda: jax_max(on_jax).block_until_ready()),
        "torch": repeat(on_torch.max),
    }


def read_bandwidth(calls: dict, nbytes: int, repeats: int) -> dict:
    """``{name: (GB/s, Timing)}`` of each of ``readers``' ``calls`` (``nbytes`` a call), timed
    round-robin after one warm-up call each: GB/s of the median call."""
    from benchmarks.timing import interleaved

    for call in calls.values():
        call()
    timings = interleaved(calls, repeats)
    return {name: (gbs(nbytes, t["median_ms"]), t) for name, t in timings.items()}


def gbs(nbytes: int, ms: float) -> float:
    """GB/s of ``nbytes`` read in ``ms`` milliseconds."""
    return nbytes / 1e9 / (ms / 1e3)


# ---- compilations --------------------------------------------------------------------------------

_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


class Compiles:
    """What ``count_compiles`` counted: ``count`` backend compilations, ``seconds`` spent
    tracing, lowering and compiling them (JAX's own ``jax.monitoring`` durations)."""

    def __init__(self):
        self.count = 0
        self.seconds = 0.0

    def __call__(self, event: str, duration: float, **_):
        if event in _COMPILE_EVENTS:
            self.seconds += duration
            self.count += event == _COMPILE_EVENTS[-1]


@contextlib.contextmanager
def count_compiles():
    """``with count_compiles() as found:`` ... ``found.count``, ``found.seconds``."""
    found = Compiles()
    jax.monitoring.register_event_duration_secs_listener(found)
    try:
        yield found
    finally:
        jax.monitoring.unregister_event_duration_listener(found)
