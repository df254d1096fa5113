"""Section ``generate``: a whole GPT-2 (``examples/gpt2.py``) against transformers' ``generate``.

GPT-2 small's shape (random weights, float32; ``generate_model`` picks another size), a
``generate_prompt``-token prompt, ``generate_steps`` new tokens, greedy, at each batch of
``generate_batches``:

- ``flax`` ``example``: the example's one-jit generate (prefill + ``lax.scan``), compiled ahead
  of time (``compile_s`` apart) and loaded from the transformers model's ``save_pretrained``
  directory, so the two hold identical weights.
- ``torch`` ``eager`` / ``sdpa``: ``GPT2LMHeadModel.generate(do_sample=False, use_cache=True)``
  with that attention implementation, ``torch.no_grad()``, no end-of-text stop.

The three are timed round-robin (``benchmarks.timing.interleaved``); ``value`` is new tokens per
second summed over the batch (the example's ``--json`` ``tokens_per_s``), ``ratio`` the Flax
figure over torch's. Greedy tokens are compared before timing (equal count in the note).

Then, per batch: ms per token of ``generate_flat_steps`` decode steps started at the first new
position and at the last ones (``ratio``: end over start), for Flax and both torch attentions;
and where a Flax step's time goes: the layers alone, and the tied head against the ``(V, d)``
embedding as stored (what the example does) and against a ``(d, V)`` copy transposed once.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from benchmarks.rows import make_row
from benchmarks.timing import Timing, interleaved

__all__ = ["format_rows", "plan_calls", "run"]

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _example():
    """``examples/gpt2.py`` as a module (the examples are scripts, not a package)."""
    name = "gpt2_example"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / "gpt2.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def plan_calls(config) -> int:
    per_batch = 3 * (config.generate_repeats + 1) + 3 * 2 + 3
    return per_batch * len(config.generate_batches)


def _tick(progress, n=1):
    if progress is not None:
        progress.update(n)


def _torch_models(config, directory):
    import transformers

    torch.manual_seed(0)
    gpt_config = transformers.GPT2Config(
        **config.generate_model, bos_token_id=None, eos_token_id=None, pad_token_id=None
    )
    models = {}
    for attention in ("eager", "sdpa"):
        gpt_config._attn_implementation = attention
        model = transformers.GPT2LMHeadModel(gpt_config).eval()
        if models:  # the same weights in both
            model.load_state_dict(next(iter(models.values())).state_dict())
        else:
            model.save_pretrained(directory, safe_serialization=True)
        model.set_attn_implementation(attention)
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        models[attention] = model
    return models


def _hf_generate(model, ids, steps):
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, use_cache=True,
            max_new_tokens=steps, min_new_tokens=steps,
        )  # fmt: skip
    return out[:, ids.shape[1] :]


def run(config, progress=None) -> list[dict]:
    gpt2 = _example()
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        models = _torch_models(config, directory)
        start = time.perf_counter()
        model = gpt2.load_checkpoint(directory)
        load_s = time.perf_counter() - start
    for batch in config.generate_batches:
        rows += _run_batch(config, gpt2, model, models, batch, load_s, progress)
    return rows


def _run_batch(config, gpt2, model, models, batch, load_s, progress):
    prompt_len, steps = config.generate_prompt, config.generate_steps
    rng = np.random.default_rng(batch)
    prompt = rng.integers(0, model.config.vocab_size, (batch, prompt_len)).astype(np.int32)
    prompt_torch, prompt_jax = torch.from_numpy(prompt.astype(np.int64)), jnp.asarray(prompt)
    case = f"b{batch}_p{prompt_len}_n{steps}"
    compiled = gpt2.compile_generate(model, batch, prompt_len, steps)
    calls = {
        "example": lambda: compiled(prompt_jax),
        "eager": lambda: _hf_generate(models["eager"], prompt_torch, steps),
        "sdpa": lambda: _hf_generate(models["sdpa"], prompt_torch, steps),
    }
    outputs = {}
    for name, call in calls.items():  # warm-up, and the tokens compared
        outputs[name] = np.asarray(jax.block_until_ready(call()))
        _tick(progress)
    equal = {name: int((outputs["example"] == outputs[name]).sum()) for name in ("eager", "sdpa")}
    timings = interleaved(calls, config.generate_repeats, progress)
    per_s = {name: 1e3 * batch * steps / t["median_ms"] for name, t in timings.items()}
    rows = []
    for name in calls:
        framework = "flax" if name == "example" else "torch"
        note = (
            f"compile {compiled.compile_s:.2f} s apart; checkpoint load {load_s:.2f} s; greedy "
            f"tokens equal to eager {equal['eager']}/{batch * steps}, sdpa "
            f"{equal['sdpa']}/{batch * steps}"
            if framework == "flax"
            else f"transformers generate, attn_implementation={name}, cache on"
        )
        rows.append(
            make_row(
                "generate", case, "generate", framework, name, batch=batch, tokens=steps,
                timing=timings[name], value=per_s[name], unit="tokens/s",
                ratio_vs_eager=per_s["example"] / per_s["eager"],
                ratio_vs_sdpa=per_s["example"] / per_s["sdpa"],
                note=note,
            )
        )  # fmt: skip
    rows.append(
        make_row(
            "generate", case, "compile", "flax", "example", batch=batch, tokens=steps,
            timing=Timing.of([compiled.compile_s]), value=compiled.compile_s, unit="s",
            note="compile_generate: lower + compile, once",
        )
    )  # fmt: skip
    rows += _flatness(config, gpt2, model, models, batch, case, progress)
    rows += _breakdown(config, gpt2, model, batch, case, progress)
    return rows


# ---- per-token time at the start and at the end of the sequence ---------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _flax_prefill(graphdef, cache, rest, ids):
    """The cache after ``ids`` (untimed): where ``_flax_steps`` starts."""
    model = nnx.merge(graphdef, cache, rest)
    model.hidden_states(ids, decode=True)
    return nnx.state(model, nnx.Cache)


@functools.partial(jax.jit, static_argnames=("graphdef", "steps"))
def _flax_steps(graphdef, cache, rest, token, *, steps):
    gpt2 = sys.modules["gpt2_example"]
    keys = jax.random.split(jax.random.key(0), steps)
    return gpt2.decode_steps(graphdef, cache, rest, token, keys, 1.0, True, None)[1]


def _positions(config):
    flat = config.generate_flat_steps
    start = config.generate_prompt
    end = config.generate_prompt + config.generate_steps - flat
    return flat, start, end


def _flatness(config, gpt2, model, models, batch, case, progress):
    flat, start, end = _positions(config)
    rng = np.random.default_rng(7)
    per_token, timing = {}, {}
    for name in ("example", "eager", "sdpa"):
        for position in (start, end):
            ids = rng.integers(0, model.config.vocab_size, (batch, position)).astype(np.int32)
            token = ids[:, -1]
            if name == "example":
                model.init_cache(batch, position + flat)
                graphdef, cache, rest = nnx.split(model, nnx.Cache, ...)
                filled = _flax_prefill(graphdef, cache, rest, ids)
                run = functools.partial(_flax_steps, graphdef, filled, rest, token, steps=flat)
                jax.block_until_ready(run())  # compile
                samples = []
                for _ in range(config.generate_repeats):
                    began = time.perf_counter()
                    jax.block_until_ready(run())
                    samples.append(time.perf_counter() - began)
            else:
                samples = [
                    _torch_steps(models[name], ids, flat)
                    for _ in range(config.generate_repeats + 1)
                ][1:]
            timing[name, position] = Timing.of(samples)
            per_token[name, position] = timing[name, position]["median_ms"] / flat
        _tick(progress, 2)
    rows = []
    for name in ("example", "eager", "sdpa"):
        ratio = per_token[name, end] / per_token[name, start]
        rows.append(
            make_row(
                "generate", case, f"ms/token at {start} and {end}",
                "flax" if name == "example" else "torch", name, batch=batch, tokens=flat,
                timing=timing[name, end], value=per_token[name, end], unit="ms/token", ratio=ratio,
                ratio_of=f"ms/token at position {end} / at {start}",
                note=f"{flat} greedy decode steps each; {per_token[name, start]:.2f} ms/token at "
                f"{start}",
            )
        )  # fmt: skip
    return rows


def _torch_steps(model, ids, steps) -> float:
    """Seconds for ``steps`` cached greedy steps after prefilling ``ids`` (untimed)."""
    with torch.no_grad():
        out = model(torch.from_numpy(ids.astype(np.int64)), use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        began = time.perf_counter()
        for _ in range(steps):
            out = model(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - began


# ---- where a Flax step's time goes ---------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef", "steps"))
def _layers_only(graphdef, cache, rest, x, *, steps):
    def step(carry, _):
        cache, x = carry
        model = nnx.merge(graphdef, cache, rest)
        for block in model.h:
            x = block(x, decode=True)  # (b, 1, d)
        return (nnx.state(model, nnx.Cache), model.ln_f(x)), None

    return jax.lax.scan(step, (cache, x), length=steps)[0][1]


@functools.partial(jax.jit, static_argnames=("steps", "transposed"))
def _head_only(embedding, head_kernel, x, *, steps, transposed):
    """``steps`` head products, each feeding back the embedding of its argmax: against the
    ``(V, d)`` embedding as stored (what the example does), or a ``(d, V)`` copy made once
    outside (``head_kernel``)."""

    def step(x, _):
        if transposed:
            logits = jnp.matmul(x, head_kernel)  # (b, V)
        else:
            logits = jnp.einsum("bd,vd->bv", x, embedding)  # (b, V)
        token = jnp.argmax(logits, axis=-1)
        return embedding[token], None  # (b, d): the next input depends on this step

    return jax.lax.scan(step, x, length=steps)[0]


def _breakdown(config, gpt2, model, batch, case, progress):
    flat, start, _ = _positions(config)
    d = model.config.n_embd
    x = jnp.asarray(np.random.default_rng(3).standard_normal((batch, 1, d)), jnp.float32)
    model.init_cache(batch, start + flat)
    graphdef, cache, rest = nnx.split(model, nnx.Cache, ...)
    embedding = model.wte.embedding[...]
    head_kernel = jnp.asarray(np.ascontiguousarray(np.asarray(embedding).T))  # (d, V) copy
    calls = {
        "layers": functools.partial(_layers_only, graphdef, cache, rest, x, steps=flat),
        "head (embedding as stored)": functools.partial(
            _head_only, embedding, head_kernel, x[:, 0], steps=flat, transposed=False
        ),
        "head (transposed copy)": functools.partial(
            _head_only, embedding, head_kernel, x[:, 0], steps=flat, transposed=True
        ),
    }
    for call in calls.values():
        jax.block_until_ready(call())  # compile
    timings = interleaved(calls, config.generate_repeats)
    _tick(progress, 3)
    return [
        make_row(
            "generate", case, f"step part: {name}", "flax", "example", batch=batch, tokens=flat,
            timing=timing, value=timing["median_ms"] / flat, unit="ms/token",
            note=f"{model.config.n_layer} layers, cache at position {start}" if name == "layers"
            else f"(b, d) x (d, V), V = {model.config.vocab_size}, argmax fed back",
        )
        for name, timing in timings.items()
    ]  # fmt: skip


# ---- table --------------------------------------------------------------------------------------


def format_rows(rows: list[dict], table) -> str:
    """The section's table (``table(headers, lines)`` from ``benchmarks.cli``)."""

    def num(value, spec):
        return "-" if value is None else format(value, spec)

    headers = ["case", "mode", "framework", "implementation", "value", "unit", "flax/eager",
               "flax/sdpa", "ratio", "note"]  # fmt: skip
    lines = [
        [r["case"], r["mode"], r["framework"], r["implementation"], num(r["value"], ".2f"),
         r["unit"], num(r["ratio_vs_eager"], ".2f"), num(r["ratio_vs_sdpa"], ".2f"),
         num(r["ratio"], ".2f"), r["note"]]
        for r in rows
    ]  # fmt: skip
    if not lines:
        return ""
    title = (
        "Generate: GPT-2 example vs transformers generate; tokens/s summed over the batch, "
        "flax/torch > 1 = Flax faster"
    )
    return f"{title}\n{table(headers, lines)}\n"
