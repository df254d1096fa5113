"""Qwen3-0.6B's shape on CPU: ``flax_attention.models.Qwen3Model`` against transformers'
``Qwen3ForCausalLM``, prefill and greedy decode, float32 and bfloat16, with the bound that
reading the weights once per token sets.

``python -m benchmarks.qwen3 [--quick] [--repeats N] [--json PATH] [--torch-threads N]
[--dtypes float32,bfloat16]`` prints the machine and one table (about 6 minutes on the 2-core
machine of docs/performance.md when nothing else runs); every ratio's callables are timed
round-robin in the same run (``benchmarks.timing.interleaved``), medians of ``--repeats`` calls
(default 3) after a warm-up call each. Progress goes to stderr.

The models: ``QWEN_CONFIG_06_B`` (the real Qwen3-0.6B's sizes: vocabulary 151936, 1024 features,
28 layers, 16 query heads over 8 key heads of 128, SwiGLU 3072, QK-norm, rotary base 1e6) with
its checkpoint's tied head and ``rms_norm_eps`` 1e-6: 596 M parameters, 2.39 GB in float32.
transformers builds the model with random weights (``torch.manual_seed(0)``, its own
initialisation: normal(0.02) matrices, norms at one) and ``save_pretrained`` writes it once to a
temporary directory; ``Qwen3Model.from_pretrained`` of that directory is ours, so both hold the
same weights. In bfloat16 both load that directory again at that width
(``Qwen3ForCausalLM.from_pretrained(dir, dtype=torch.bfloat16)``, ``Qwen3Model.from_pretrained(
dir, dtype=param_dtype=jnp.bfloat16)``: the same rounding of the same float32 weights); only one
dtype's pair is held at a time. transformers' attention is its default (``sdpa``), eval mode,
``torch.no_grad()``; no end-of-text token, so every step runs.

Per dtype, batch 1:

- ``prefill``: one forward of a ``prefill_tokens``-token prompt to the last position's logits
  (what generation needs of the prompt, as ``benchmarks.prefill``'s ``last-position logits``):
  ours ``model.logits(model.hidden_states(ids)[:, -1])`` jitted over ``nnx.split``, theirs
  ``model(ids, logits_to_keep=1, use_cache=False)``; ratio: our time over theirs (goal <= 1.0).
- ``generate``: ``new_tokens`` greedy tokens after a ``prompt_tokens``-token prompt, whole calls
  (prompt included): ``flax_attention.models.generate`` (one jit: prefill, then a
  ``lax.while_loop`` over the KV cache) against ``generate(do_sample=False)`` with its default
  cache; tokens/s = ``new_tokens`` / the median call; ratio: ours over theirs (goal >= 1.5).
- ``decode step``: the step alone, (``new_tokens``-token call - 1-token call) / (``new_tokens``
  - 1), both calls from the same rounds, as tokens/s.
- ``compile``: our first prefill and generate calls' trace, lower and compile seconds
  (``jax.monitoring``), apart from the timing; a timed call that compiled would stop the run.
- ``bound``: a decode step reads every weight once (the tied head's matrix once: it is also the
  token embedding), so no step beats ``bandwidth / weight bytes`` tokens/s. The bandwidth is
  measured in this process right before the dtype's rounds: a max over a float32 array of
  ``bandwidth_mb`` MB by numpy, JAX and torch (``benchmarks.gpt_models.readers``), round-robin,
  the fastest reader's median. The KV cache a step also reads (at most 13 MB in float32 here) is
  not counted.

Before timing, the outputs are compared: the prefill's last-position logits (max difference,
relative to the largest logit) and the greedy tokens. In float32 the tokens must be equal (else
the run stops: it would be timing different computations); in bfloat16 the row's note gives the
first position where they part, if they do (the two round in different places: transformers'
norms cast to bfloat16 before their weight, ours keep a float32 scale as the book's).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from benchmarks.gpt_models import count_compiles, read_bandwidth, readers
from benchmarks.machine import describe, load_average
from benchmarks.rows import make_row, max_diffs
from benchmarks.timing import Timing, interleaved
from flax_attention.models import Qwen3Model, generate
from flax_attention.models.qwen3 import QWEN_CONFIG_06_B

__all__ = ["FULL", "QUICK", "Settings", "format_rows", "hf_config", "main", "run"]

#: The goals this benchmark holds the ratios to.
PREFILL_GOAL = 1.0  # our prefill time / transformers' at most this
DECODE_GOAL = 1.5  # our generate tokens/s / transformers' at least this

#: Qwen3-0.6B as its checkpoint has it: the book's config, a tied head, rms_norm_eps 1e-6.
QWEN3_06B = {**QWEN_CONFIG_06_B, "tie_word_embeddings": True, "rms_norm_eps": 1e-6}
#: A few-layer model of the same kind for the smoke run (quick seconds, same code paths).
TINY = {**QWEN3_06B, "vocab_size": 151, "context_length": 256, "emb_dim": 64, "n_heads": 4,
        "n_kv_groups": 2, "head_dim": 16, "hidden_dim": 96, "n_layers": 2}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Settings:
    cfg: dict = dataclasses.field(default_factory=lambda: dict(QWEN3_06B))
    prefill_tokens: int = 512
    prompt_tokens: int = 64
    new_tokens: int = 32
    repeats: int = 3
    bandwidth_mb: int = 1024
    bandwidth_reads: int = 4
    bandwidth_repeats: int = 5
    dtypes: tuple[str, ...] = ("float32", "bfloat16")


FULL = Settings()
QUICK = Settings(cfg=dict(TINY), prefill_tokens=32, prompt_tokens=8, new_tokens=8, repeats=2,
                 bandwidth_mb=16, bandwidth_reads=1, bandwidth_repeats=2)  # fmt: skip


def hf_config(cfg):
    """``transformers.Qwen3Config`` of the book's ``cfg`` (no special tokens: every step runs)."""
    import transformers

    return transformers.Qwen3Config(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["emb_dim"],
        intermediate_size=cfg["hidden_dim"], num_hidden_layers=cfg["n_layers"],
        num_attention_heads=cfg["n_heads"], num_key_value_heads=cfg["n_kv_groups"],
        head_dim=cfg["head_dim"], max_position_embeddings=cfg["context_length"],
        rms_norm_eps=cfg["rms_norm_eps"], tie_word_embeddings=cfg["tie_word_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_base"]},
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip


def _no_stop(model):
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def _pair(directory: str, dtype: str, hf=None):
    """``(ours, theirs, our load seconds)`` in ``dtype``, both from ``directory`` (theirs is
    ``hf`` where given: the float32 model that wrote it)."""
    import transformers

    if hf is None:
        hf = transformers.Qwen3ForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype))
    width = {"dtype": jnp.bfloat16, "param_dtype": jnp.bfloat16} if dtype == "bfloat16" else {}
    start = time.perf_counter()
    ours = Qwen3Model.from_pretrained(directory, **width)
    return ours, _no_stop(hf), time.perf_counter() - start


def weight_bytes(model) -> int:
    """Bytes of the parameters one decode step reads: all of them (the tied head's matrix once:
    the embedding's one row is part of it)."""
    return int(sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def _torch_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied: counted once


@functools.partial(jax.jit, static_argnames="graphdef")
def _prefill(graphdef, state, ids):
    model = nnx.merge(graphdef, state)
    return model.logits(model.hidden_states(ids)[:, -1])  # (b, V)


def _hf_prefill(model, ids):
    with torch.no_grad():
        return model(ids, logits_to_keep=1, use_cache=False).logits[:, -1]


def _hf_generate(model, ids, steps):
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, use_cache=True,
            max_new_tokens=steps, min_new_tokens=steps,
        )  # fmt: skip
    return out[:, ids.shape[1] :]


def _first_difference(ours: np.ndarray, theirs: np.ndarray):
    """The first new-token position (0-based) where the two differ, ``None`` if none does."""
    where = np.flatnonzero((ours != theirs).any(axis=0))
    return None if where.size == 0 else int(where[0])


def _say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {load_average()}] {message}", file=sys.stderr,
          flush=True)  # fmt: skip


def run(settings: Settings = FULL, progress=None) -> list[dict]:
    """The rows of every dtype in ``settings.dtypes`` (module docstring)."""
    import transformers

    cfg = settings.cfg
    _say("building transformers' model (random weights) and saving it")
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(hf_config(cfg))
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        hf.save_pretrained(directory)
        for dtype in settings.dtypes:
            _say(f"{dtype}: loading the pair")
            ours, theirs, load_s = _pair(directory, dtype, hf if dtype == "float32" else None)
            hf = None  # the float32 model is released with its pair
            rows += _run_dtype(settings, dtype, ours, theirs, load_s, progress)
            del ours, theirs
            gc.collect()
    return rows


def _bandwidth(settings):
    """``(GB/s, Timing, reader)``: the readers round-robin, the fastest one's median."""
    calls = readers(settings.bandwidth_mb, settings.bandwidth_reads)
    nbytes = settings.bandwidth_mb * 2**20 * settings.bandwidth_reads
    found = read_bandwidth(calls, nbytes, settings.bandwidth_repeats)
    reader = max(found, key=lambda name: found[name][0])
    return (*found[reader], reader)


def _run_dtype(settings, dtype, ours, theirs, load_s, progress):
    cfg, repeats = settings.cfg, settings.repeats
    rng = np.random.default_rng(0)
    long = rng.integers(0, cfg["vocab_size"], (1, settings.prefill_tokens)).astype(np.int32)
    prompt = rng.integers(0, cfg["vocab_size"], (1, settings.prompt_tokens)).astype(np.int32)
    long_torch, prompt_torch = (torch.from_numpy(x.astype(np.int64)) for x in (long, prompt))
    n, context = settings.new_tokens, cfg["context_length"]
    graphdef, state = nnx.split(ours)
    long_jax = jnp.asarray(long)

    calls = {
        "flax prefill": lambda: _prefill(graphdef, state, long_jax),
        "torch prefill": lambda: _hf_prefill(theirs, long_torch),
        "flax generate": lambda: generate(ours, prompt, n, context)[:, settings.prompt_tokens :],
        "torch generate": lambda: _hf_generate(theirs, prompt_torch, n),
        "flax generate 1": lambda: generate(ours, prompt, 1, context),
        "torch generate 1": lambda: _hf_generate(theirs, prompt_torch, 1),
    }
    _say(f"{dtype}: first calls (compile, warm up, compare)")
    with count_compiles() as prefill_compile:
        flax_logits = np.asarray(jax.block_until_ready(calls["flax prefill"]()), np.float32)
    with count_compiles() as generate_compile:
        flax_tokens = np.asarray(jax.block_until_ready(calls["flax generate"]()))
        jax.block_until_ready(calls["flax generate 1"]())
    torch_logits = calls["torch prefill"]().float().numpy()
    torch_tokens = calls["torch generate"]().numpy()
    calls["torch generate 1"]()
    diffs = max_diffs({"logits": flax_logits}, {"logits": torch_logits})
    same_argmax = bool((flax_logits.argmax(-1) == torch_logits.argmax(-1)).all())
    equal = int((flax_tokens == torch_tokens).sum())
    first = _first_difference(flax_tokens, torch_tokens)
    if dtype == "float32" and first is not None:
        raise RuntimeError(
            f"float32 greedy tokens differ from transformers' from new token {first} "
            f"(ours {flax_tokens[0, first:].tolist()}, theirs {torch_tokens[0, first:].tolist()}):"
            " the timed calls would compute different sequences"
        )
    if progress is not None:
        progress.update(len(calls))

    _say(f"{dtype}: read bandwidth, then {repeats} timed rounds")
    bandwidth, read_timing, reader = _bandwidth(settings)
    with count_compiles() as timed:
        timings = interleaved(calls, repeats, progress)
    if timed.count:
        raise RuntimeError(
            f"{timed.count} compilations during the timed calls: a second call with the same "
            "shapes must reuse the first call's executable"
        )
    ms = {name: t["median_ms"] for name, t in timings.items()}
    case = f"{dtype} b1"
    rows = []
    prefill_ratio = ms["flax prefill"] / ms["torch prefill"]
    argmax = "equal" if same_argmax else "DIFFERENT"
    parity = (
        f"last-position logits max diff {diffs[0]:.2e} ({diffs[1]:.2e} relative), argmax {argmax}"
    )
    for framework in ("flax", "torch"):
        rows.append(
            make_row(
                "qwen3", case, "prefill", framework, _implementation(framework, theirs),
                batch=1, tokens=settings.prefill_tokens, timing=timings[f"{framework} prefill"],
                value=ms[f"{framework} prefill"], unit="ms", ratio=prefill_ratio,
                ratio_of="Flax time / transformers' time", target=PREFILL_GOAL,
                met=prefill_ratio <= PREFILL_GOAL, diffs=diffs,
                note=f"{settings.prefill_tokens}-token prompt to the last position's logits; "
                + parity,
            )
        )  # fmt: skip
    per_s = {name: 1e3 * n / ms[f"{name} generate"] for name in ("flax", "torch")}
    generate_ratio = per_s["flax"] / per_s["torch"]
    tokens_note = (
        f"greedy tokens equal {equal}/{n}"
        + ("" if first is None else f", first difference at new token {first}")
        + f"; our load {load_s:.2f} s"
    )
    for framework in ("flax", "torch"):
        rows.append(
            make_row(
                "qwen3", case, "generate", framework, _implementation(framework, theirs),
                batch=1, tokens=n, timing=timings[f"{framework} generate"],
                value=per_s[framework], unit="tokens/s", ratio=generate_ratio,
                ratio_of="Flax tokens/s / transformers' tokens/s", target=DECODE_GOAL,
                met=generate_ratio >= DECODE_GOAL,
                note=f"{n} new tokens after {settings.prompt_tokens}, whole calls; " + tokens_note,
            )
        )  # fmt: skip
    step = {}
    for name in ("flax", "torch"):
        difference = (ms[f"{name} generate"] - ms[f"{name} generate 1"]) / max(n - 1, 1)
        step[name] = 1e3 / difference if difference > 0 else None
    step_ratio = step["flax"] / step["torch"] if step["flax"] and step["torch"] else None
    for framework in ("flax", "torch"):
        one = ms[f"{framework} generate 1"]
        rows.append(
            make_row(
                "qwen3", case, "decode step", framework, _implementation(framework, theirs),
                batch=1, tokens=n, timing=timings[f"{framework} generate 1"],
                value=step[framework], unit="tokens/s", ratio=step_ratio,
                ratio_of="Flax tokens/s / transformers' tokens/s",
                note=f"({n}-token call - 1-token call: {one:.1f} ms) / {n - 1}",
            )
        )  # fmt: skip
    for what, found in (("prefill", prefill_compile), ("generate", generate_compile)):
        rows.append(
            make_row(
                "qwen3", case, f"compile {what}", "flax", "jit", batch=1,
                timing=Timing.of([found.seconds]), value=found.seconds, unit="s",
                note=f"{found.count} compilations in the first call(s), none in the timed ones",
            )
        )  # fmt: skip
    nbytes = weight_bytes(ours)
    bound = bandwidth * 1e9 / nbytes
    rows.append(
        make_row(
            "qwen3", case, "bound", "flax", "weights / bandwidth", batch=1, tokens=n,
            timing=read_timing, value=bound, unit="tokens/s",
            ratio=None if step["flax"] is None else step["flax"] / bound,
            ratio_of="Flax decode step tokens/s / bound",
            note=f"{bandwidth:.1f} GB/s read ({reader}, max of {settings.bandwidth_mb} MB "
            f"float32 x {settings.bandwidth_reads}) / {nbytes / 1e6:.1f} MB of weights per token "
            f"(transformers holds {_torch_bytes(theirs) / 1e6:.1f} MB); whole generate "
            f"{per_s['flax'] / bound:.2f} of it",
        )
    )  # fmt: skip
    return rows


def _implementation(framework, theirs) -> str:
    if framework == "flax":
        return "Qwen3Model"
    return f"Qwen3ForCausalLM {theirs.config._attn_implementation}"


def format_rows(rows: list[dict]) -> str:
    """The table: one line per row."""

    def num(value, spec=".2f"):
        return "-" if value is None else format(value, spec)

    lines = [
        f"{'case':12} {'mode':17} {'framework':9} {'value':>10} {'unit':9} {'ratio':>6} "
        f"{'goal':>6} {'met':5} note"
    ]
    for r in rows:
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        lines.append(
            f"{r['case']:12} {r['mode']:17} {r['framework']:9} {num(r['value']):>10} "
            f"{r['unit']:9} {num(r['ratio']):>6} {num(r['target']):>6} {met:5} {r['note']}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.qwen3", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a tiny Qwen3 (smoke), 2 repeats")
    parser.add_argument("--repeats", type=int, help="timed calls per median (default 3)")
    parser.add_argument("--json", metavar="PATH", help="also write machine, settings and rows")
    parser.add_argument(
        "--torch-threads", type=int, help="torch.set_num_threads (default: its own)"
    )
    parser.add_argument(
        "--dtypes", default="float32,bfloat16", help="comma-separated (default: both)"
    )
    args = parser.parse_args(argv)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    settings = QUICK if args.quick else FULL
    if args.repeats is not None:
        settings = dataclasses.replace(settings, repeats=args.repeats)
    dtypes = tuple(args.dtypes.split(","))
    if not set(dtypes) <= {"float32", "bfloat16"}:
        parser.error(f"--dtypes ({args.dtypes!r}) must name float32 and/or bfloat16")
    settings = dataclasses.replace(settings, dtypes=dtypes)
    started = time.perf_counter()
    machine = describe(torch.get_num_threads())
    machine["command"] = "python -m benchmarks.qwen3 " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    print("\n".join(f"{key:<30} {value}" for key, value in machine.items()), flush=True)
    rows = run(settings)
    machine["load_average_end"] = load_average()
    machine["wall_s"] = round(time.perf_counter() - started, 1)
    print(format_rows(rows))
    print(f"load average at end: {machine['load_average_end']}; total {machine['wall_s']} s")
    if args.json:
        config = {**dataclasses.asdict(settings)}
        config["cfg"] = {k: str(v) if k == "dtype" else v for k, v in settings.cfg.items()}
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "settings": config, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
