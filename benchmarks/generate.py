"""Section ``generate``: ``flax_attention.models.generate`` on a ``GPTModel`` against
transformers' ``generate``, and the bound memory bandwidth sets.

GPT-2 small's shape (random weights, float32; ``gpt_model`` picks another size), a
``generate_prompt``-token prompt, ``generate_steps`` new tokens, greedy, at each batch of
``generate_batches``:

- ``flax`` ``generate``: ``flax_attention.models.generate(model, prompt, steps,
  context_size=context_length)`` (one jit: prefill, then a ``lax.while_loop`` over the cache) on
  the ``GPTModel`` that ``GPTModel.from_pretrained`` reads from the transformers model's
  ``save_pretrained`` directory, so the two hold identical weights. Its first call compiles
  (``compile_s``, apart: JAX's own trace, lower and compile durations); a timed call that
  compiled again would be an error of the benchmark, and none does.
- ``torch`` ``eager`` / ``sdpa``: ``GPT2LMHeadModel.generate(do_sample=False, use_cache=True)``
  with that attention implementation, ``torch.no_grad()``, no end-of-text stop.
- the weight-streaming bound: a decode step reads every weight once (``weight_bytes``: the
  float32 parameters, the tied head's matrix once, one row of the position embedding), so at
  batch ``b`` no step can beat ``b * bandwidth / weight_bytes`` tokens/s. The bandwidth is
  measured right before each batch's rounds: a max over a float32 array of ``bandwidth_mb`` MB
  (``gpt_models.readers``) by numpy (one thread), JAX and torch (both cores), round-robin in
  ``bandwidth_repeats`` rounds (the ``read bandwidth`` rows); the fastest reader's median is the
  machine's. (Read inside the generate rounds instead, torch's reader lost a quarter of its
  speed to the other callables' threads, so the bound is taken where the machine reads best;
  it still moves with what else the host runs: docs/performance.md gives the range measured.)
  ``ratio``: Flax tokens/s over the bound (whole calls, prefill included; the KV cache read on
  top of the weights is not counted).

The three generate calls and a Flax generate of one new token (the prefill, for the step part
below) are timed round-robin (``benchmarks.timing.interleaved``); ``value`` is new tokens per
second summed over the batch, ``ratio_vs_*`` the Flax figure over torch's. Greedy tokens are
compared before timing (equal count in the note).

Then, per batch: ms per token of ``generate_flat_steps`` decode steps started at the first new
position and at the last ones (``ratio``: end over start), for Flax (the model's decode step in
a jitted loop from a cache prefilled to that position, as long as the steps need) and both torch
attentions (``past_key_values``); and where a Flax step's time goes (``step part`` rows, ms per
step), each part in a jitted loop of ``generate_flat_steps`` steps, its output fed back so
nothing is hoisted, with a cache as long as generate's (every step attends to all of it under a
mask):

- ``generate``: generate's own step, (``steps`` new tokens - 1 new token) / (``steps`` - 1)
  from the generate rounds (``None`` where that difference is below the noise);
- ``decode loop``: the step alone, as generate's loop makes it (``hidden_states(decode=True)``
  of the last token, the tied head, the package's greedy choice);
- ``layers``: the ``n_layers`` blocks and the final norm; ``head``: the tied head against the
  ``(V, d)`` embedding; ``argmax``: the package's greedy choice over ``(b, V)`` float32 logits;
  ``embeddings``: the token and position embeddings.

Their notes say how far the whole step is from the sum of the parts (the loop's own work).
"""

from __future__ import annotations

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import flax_attention as fa
from benchmarks.gpt_models import (
    count_compiles,
    flax_model,
    read_bandwidth,
    readers,
    torch_models,
    weight_bytes,
)
from benchmarks.models import loaded
from benchmarks.rows import make_row
from benchmarks.timing import Timing, interleaved
from benchmarks.torch_device import device, to_numpy, to_torch
from flax_attention.cache import decode_step, split_for_decode
from flax_attention.models import GPTModel, generate, quantize
from flax_attention.models.generation import next_token
from flax_attention.models.quantized import Int8Weight, WeightScale

__all__ = ["dtype_models", "format_rows", "plan_calls", "run"]

#: Torch's callables in the generate rounds, after Flax's.
TORCH_ATTENTIONS = ("eager", "sdpa")
#: The weight dtypes of the ``dtype generate`` rows: Flax's float32 model, the same weights in
#: bfloat16 (``GPTModel(dtype=param_dtype=bfloat16)``) and ``models.quantize(model, "int8")``;
#: transformers' float32 and bfloat16 (``.to(torch.bfloat16)``) beside them.
DTYPES = ("float32", "bfloat16", "int8")
#: What the ``dtype generate`` rows' ``ratio`` is of.
DTYPE_RATIO_OF = "tokens/s / Flax float32's, same batch"
#: The ``step part`` rows, in order.
PARTS = ("generate", "decode loop", "layers", "head", "argmax", "embeddings")


def plan_calls(config) -> int:
    per_batch = (
        4 * (config.generate_repeats + 1)  # generate x 4, one warm-up each
        + 6 * (config.generate_repeats + 1)  # flatness: 3 implementations x 2 positions
        + (len(PARTS) - 1) * (config.generate_repeats + 1)  # parts (generate's from above)
    )
    per_batch += 3 * (config.bandwidth_repeats + 1)  # the readers, one warm-up each
    per_batch += 2 * len(DTYPES) * (config.generate_repeats + 1)  # dtypes: flax + transformers
    return per_batch * len(config.generate_batches)


def _tick(progress, n=1):
    if progress is not None:
        progress.update(n)


def run(config, progress=None) -> list[dict]:
    models = torch_models(config, TORCH_ATTENTIONS)
    model, load_s = flax_model(models["sdpa"])
    for torch_model in models.values():
        torch_model.to(device())
    context = {"models": models, "model": model, "load_s": load_s,
               "nbytes": weight_bytes(model),
               "readers": readers(config.bandwidth_mb, config.bandwidth_reads)}  # fmt: skip
    rows = []
    for batch in config.generate_batches:
        rows += _run_batch(config, context, batch, progress)
    return rows


def _bandwidth(config, context, case, progress):
    """``(GB/s, Timing, reader, rows)``: the readers round-robin, the fastest one's median."""
    read_bytes = config.bandwidth_mb * 2**20 * config.bandwidth_reads
    bandwidth = read_bandwidth(context["readers"], read_bytes, config.bandwidth_repeats)
    _tick(progress, 3 * (config.bandwidth_repeats + 1))
    reader = max(bandwidth, key=lambda name: bandwidth[name][0])
    rows = [
        make_row(
            "generate", case, "read bandwidth", name, "max", timing=timing, value=gbs,
            unit="GB/s",
            note=f"max of {config.bandwidth_mb} MB float32, {config.bandwidth_reads} reads a call"
            + ("; the fastest: the bound's" if name == reader else ""),
        )
        for name, (gbs, timing) in bandwidth.items()
    ]  # fmt: skip
    return (*bandwidth[reader], reader, rows)


def _run_batch(config, context, batch, progress):
    model, models = context["model"], context["models"]
    prompt_len, steps = config.generate_prompt, config.generate_steps
    context_size = model.cfg["context_length"]
    rng = np.random.default_rng(batch)
    prompt = rng.integers(0, model.cfg["vocab_size"], (batch, prompt_len)).astype(np.int32)
    prompt_torch = to_torch(prompt.astype(np.int64))
    case = f"b{batch}_p{prompt_len}_n{steps}"
    bandwidth, read_timing, reader, rows = _bandwidth(config, context, case, progress)

    def flax_generate():
        return generate(model, prompt, steps, context_size)[:, prompt_len:]

    calls = {
        "generate": flax_generate,
        "eager": lambda: _hf_generate(models["eager"], prompt_torch, steps),
        "sdpa": lambda: _hf_generate(models["sdpa"], prompt_torch, steps),
        "generate 1": lambda: generate(model, prompt, 1, context_size),
    }
    outputs = {}
    with count_compiles() as first:
        outputs["generate"] = np.asarray(jax.block_until_ready(flax_generate()))
    for name in ("eager", "sdpa"):  # warm-up, and the tokens compared
        outputs[name] = to_numpy(calls[name]())
    jax.block_until_ready(calls["generate 1"]())
    _tick(progress, len(calls))
    equal = {name: int((outputs["generate"] == outputs[name]).sum()) for name in ("eager", "sdpa")}
    with count_compiles() as timed:
        timings = interleaved(calls, config.generate_repeats, progress)
    if timed.count:
        raise RuntimeError(
            f"generate compiled {timed.count} times during its timed calls: a second call with "
            "the same shapes must reuse the first call's executable"
        )
    per_s = {name: 1e3 * batch * steps / timings[name]["median_ms"] for name in calls}
    for name in ("generate", *TORCH_ATTENTIONS):
        framework = "flax" if name == "generate" else "torch"
        note = (
            f"compile {first.seconds:.2f} s apart ({first.count} compilations in the first call, "
            f"none in the timed ones); checkpoint load {context['load_s']:.2f} s; greedy tokens "
            f"equal to eager {equal['eager']}/{batch * steps}, sdpa "
            f"{equal['sdpa']}/{batch * steps}"
            if framework == "flax"
            else f"transformers generate, attn_implementation={name}, cache on"
        )
        rows.append(
            make_row(
                "generate", case, "generate", framework, name, batch=batch, tokens=steps,
                timing=timings[name], value=per_s[name], unit="tokens/s",
                ratio_vs_eager=per_s["generate"] / per_s["eager"],
                ratio_vs_sdpa=per_s["generate"] / per_s["sdpa"],
                note=note,
            )
        )  # fmt: skip
    rows.append(
        make_row(
            "generate", case, "compile", "flax", "generate", batch=batch, tokens=steps,
            timing=Timing.of([first.seconds]), value=first.seconds, unit="s",
            note="the first generate call: trace, lower and compile (jax.monitoring), once",
        )
    )  # fmt: skip
    bound = batch * bandwidth * 1e9 / context["nbytes"]
    rows.append(
        make_row(
            "generate", case, "weight-streaming bound", "flax", "bound", batch=batch,
            tokens=steps, timing=read_timing, value=bound, unit="tokens/s",
            ratio=per_s["generate"] / bound, ratio_of="Flax tokens/s / weight-streaming bound",
            note=f"{batch} x {bandwidth:.1f} GB/s read ({reader}, the read bandwidth row) / "
            f"{context['nbytes'] / 1e6:.1f} MB of float32 weights per step",
        )
    )  # fmt: skip
    rows += _dtype_rows(config, context, batch, case, bandwidth, reader, progress)
    rows += _flatness(config, model, models, batch, case, progress)
    rows += _breakdown(config, model, batch, case, timings, progress)
    return rows


def dtype_models(context) -> dict:
    """``{(framework, dtype): model}``, made once per ``context`` (``{"model": the Flax float32
    model, "models": {"sdpa": its transformers twin}}``): Flax float32, bfloat16 and int8 (the
    same weights, eval mode), transformers float32 and bfloat16; the ``generate`` section's and
    the ``prefill`` section's dtype rows."""
    if "dtype models" not in context:
        model = context["model"]
        bf16 = loaded(
            lambda: GPTModel(
                dict(model.cfg), rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16
            ),
            fa.state_dict(model),
        )
        bf16.eval()  # as the float32 model: generate sets it, a plain forward does not
        torch_bf16 = copy.deepcopy(context["models"]["sdpa"]).to(torch.bfloat16)
        context["dtype models"] = {
            ("flax", "float32"): model,
            ("flax", "bfloat16"): bf16,
            ("flax", "int8"): quantize(model, "int8"),
            ("torch", "float32"): context["models"]["sdpa"],
            ("torch", "bfloat16"): torch_bf16,
        }
    return context["dtype models"]


def resident_bytes(model) -> int:
    """Bytes of a Flax model's weights as held (parameters, int8 weights and their scales)."""
    held = nnx.Any(nnx.Param, Int8Weight, WeightScale)
    return int(sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, held))))


def _dtype_rows(config, context, batch, case, bandwidth, reader, progress):
    """Tokens/s of generate in each weight dtype and of transformers' float32 and bfloat16
    models, round-robin; each Flax dtype against its own weight-streaming bound (the bytes a
    step reads at that width)."""
    held = dtype_models(context)
    prompt_len, steps = config.generate_prompt, config.generate_steps
    context_size = context["model"].cfg["context_length"]
    rng = np.random.default_rng(1000 + batch)
    prompt = rng.integers(0, context["model"].cfg["vocab_size"], (batch, prompt_len))
    prompt = prompt.astype(np.int32)
    prompt_torch = to_torch(prompt.astype(np.int64))
    calls = {}
    for (framework, dtype), model in held.items():
        if framework == "flax":
            calls[(framework, dtype)] = functools.partial(
                generate, model, prompt, steps, context_size
            )
        else:
            calls[(framework, dtype)] = functools.partial(_hf_generate, model, prompt_torch, steps)
    names = {key: f"{key[0]} {key[1]}" for key in calls}
    for call in calls.values():  # compile, warm up
        jax.block_until_ready(call())
    _tick(progress, len(calls))
    timings = interleaved({names[k]: c for k, c in calls.items()}, config.generate_repeats,
                          progress)  # fmt: skip
    per_s = {key: 1e3 * batch * steps / timings[names[key]]["median_ms"] for key in calls}
    rows = []
    for (framework, dtype), model in held.items():
        key = (framework, dtype)
        same = ("torch", dtype if dtype != "int8" else "float32")
        vs = per_s[key] / per_s[(framework, "float32")]
        if framework == "flax":
            nbytes = weight_bytes(model)
            bound = batch * bandwidth * 1e9 / nbytes
            note = (
                f"{vs:.2f}x flax float32, {per_s[key] / per_s[same]:.2f}x transformers "
                f"{same[1]}; {per_s[key] / bound:.2f} of its bound ({batch} x {bandwidth:.1f} "
                f"GB/s ({reader}) / {nbytes / 1e6:.1f} MB read per step); weights held "
                f"{resident_bytes(model) / 1e6:.1f} MB"
            )
        else:
            note = f"{vs:.2f}x transformers float32; generate in {dtype}, attn sdpa"
        rows.append(
            make_row(
                "generate", case, "dtype generate", framework, dtype, batch=batch, tokens=steps,
                timing=timings[names[key]], value=per_s[key], unit="tokens/s",
                ratio=per_s[key] / per_s[("flax", "float32")], ratio_of=DTYPE_RATIO_OF, note=note,
            )
        )  # fmt: skip
    return rows


def _hf_generate(model, ids, steps):
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, use_cache=True,
            max_new_tokens=steps, min_new_tokens=steps,
        )  # fmt: skip
    return out[:, ids.shape[1] :]


# ---- the model's decode step, in jitted loops ---------------------------------------------------


def _hidden(model, ids):
    """The model's decode forward, as generate's loop runs it: ``(b, t)`` ids -> ``(b, t, d)``."""
    return model.hidden_states(ids, decode=True)


def _logits(model, hidden):
    """The tied head of the last token's hidden state: ``(b, d)`` -> ``(b, V)``."""
    return model.logits(hidden)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _prefill(graphdef, params, state, ids):
    """The state after ``ids`` went through the caches (untimed): where the loops start."""
    return decode_step(graphdef, params, state, _hidden, ids)[0]


def _greedy(logits):
    """generate's choice at temperature 0: ``(b, V)`` -> ``(b,)`` int32."""
    return next_token(logits, None, 1.0, greedy=True)


@functools.partial(jax.jit, static_argnames=("graphdef", "steps"))
def _decode_loop(graphdef, params, state, token, *, steps):
    """``steps`` greedy steps as generate's loop makes them (``decode_step``:
    ``hidden_states(decode=True)`` of the last token, the tied head), the greedy choice fed
    back."""

    def step(_, carry):
        state, token = carry  # token: (b,)
        state, logits = decode_step(graphdef, params, state, _hidden, token[:, None], head=_logits)
        return state, _greedy(logits)

    return jax.lax.fori_loop(0, steps, step, (state, token))[1]


def _blocks(model, x):
    """The blocks with their caches and the final norm: ``(b, 1, d)`` -> ``(b, 1, d)``."""
    for block in model.trf_blocks:
        x = block(x, decode=True)  # (b, 1, d)
    return model.final_norm(x)


@functools.partial(jax.jit, static_argnames=("graphdef", "steps"))
def _layers(graphdef, params, state, x, *, steps):
    """The blocks and the final norm (``decode_step``), ``x`` ``(b, 1, d)`` fed back."""

    def step(_, carry):
        state, x = carry
        state, x = decode_step(graphdef, params, state, _blocks, x)  # x: (b, d)
        return state, x[:, None]

    return jax.lax.fori_loop(0, steps, step, (state, x))[1]


@functools.partial(jax.jit, static_argnames=("graphdef", "steps"))
def _head(graphdef, params, state, x, *, steps):
    """The tied head ``(b, d) x (V, d)``; its largest logit (scaled to nothing) fed back."""
    model = nnx.merge(graphdef, params, state)

    def step(_, x):
        logits = model.logits(x).astype(jnp.float32)  # (b, V)
        return x + 1e-30 * jnp.max(logits, axis=-1, keepdims=True)

    return jax.lax.fori_loop(0, steps, step, x)


@functools.partial(jax.jit, static_argnames=("steps",))
def _argmax(logits, *, steps):
    """The greedy choice over ``(b, V)`` logits; the chosen logit set to -inf for the next
    step."""

    def step(_, carry):
        logits, total = carry
        token = _greedy(logits)  # (b,)
        logits = logits.at[jnp.arange(logits.shape[0]), token].set(-jnp.inf)
        return logits, total + token

    return jax.lax.fori_loop(0, steps, step, (logits, jnp.zeros(logits.shape[0], jnp.int32)))[1]


@functools.partial(jax.jit, static_argnames=("graphdef", "steps"))
def _embeddings(graphdef, params, state, token, *, steps):
    """Token and position embeddings of one token per row."""
    model = nnx.merge(graphdef, params, state)

    def step(i, carry):
        token, total = carry
        x = model.tok_emb(token[:, None]) + model.pos_emb(i[None, None])  # (b, 1, d)
        return (token + 1) % model.cfg["vocab_size"], total + x

    zeros = jnp.zeros((token.shape[0], 1, model.cfg["emb_dim"]), jnp.float32)
    return jax.lax.fori_loop(0, steps, step, (token, zeros))[1]


def _prefilled(model, batch, position, length, rng):
    """``(graphdef, params, state, last token)``: a cache of ``length`` slots holding
    ``position`` random tokens."""
    ids = rng.integers(0, model.cfg["vocab_size"], (batch, position)).astype(np.int32)
    model.eval()
    model.init_cache(batch, length)
    graphdef, params, state = split_for_decode(model)
    model.clear_cache()
    state = _prefill(graphdef, params, state, jnp.asarray(ids))
    return graphdef, params, state, jnp.asarray(ids[:, -1])


# ---- per-token time at the start and at the end of the sequence ---------------------------------


def _positions(config):
    flat = config.generate_flat_steps
    start = config.generate_prompt
    end = config.generate_prompt + config.generate_steps - flat
    return flat, start, end


def _flatness(config, model, models, batch, case, progress):
    flat, start, end = _positions(config)
    rng = np.random.default_rng(7)
    calls = {}
    for position in (start, end):
        graphdef, params, state, token = _prefilled(model, batch, position, position + flat, rng)
        calls["generate", position] = functools.partial(
            _decode_loop, graphdef, params, state, token, steps=flat
        )
        ids = rng.integers(0, model.cfg["vocab_size"], (batch, position)).astype(np.int64)
        for name in TORCH_ATTENTIONS:
            calls[name, position] = _TorchSteps(models[name], ids, flat)
    for call in calls.values():
        jax.block_until_ready(call())  # compile, warm-up
    _tick(progress, len(calls))
    timing = interleaved(calls, config.generate_repeats, progress)
    per_token = {key: t["median_ms"] / flat for key, t in timing.items()}
    rows = []
    for name in ("generate", *TORCH_ATTENTIONS):
        ratio = per_token[name, end] / per_token[name, start]
        what = (
            "GPTModel decode steps (hidden_states decode=True, tied head, argmax) in a jitted loop"
            if name == "generate"
            else "GPT2LMHeadModel forward with past_key_values"
        )
        rows.append(
            make_row(
                "generate", case, f"ms/token at {start} and {end}",
                "flax" if name == "generate" else "torch", name, batch=batch, tokens=flat,
                timing=timing[name, end], value=per_token[name, end], unit="ms/token",
                ratio=ratio, ratio_of=f"ms/token at position {end} / at {start}",
                note=f"{flat} greedy steps each, {what}; {per_token[name, start]:.2f} ms/token "
                f"at {start}",
            )
        )  # fmt: skip
    return rows


class _TorchSteps:
    """``steps`` cached greedy steps after ``ids``, whose prefill is made once, untimed; each
    call crops the cache back to ``ids`` when done (``DynamicCache.crop(-steps)``, a view)."""

    def __init__(self, model, ids, steps):
        self.model, self.steps = model, steps
        with torch.no_grad():
            out = model(to_torch(ids), use_cache=True)
        self.cache = out.past_key_values
        self.token = out.logits[:, -1].argmax(-1, keepdim=True)

    def __call__(self):
        token = self.token
        with torch.no_grad():
            for _ in range(self.steps):
                out = self.model(token, past_key_values=self.cache, use_cache=True)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
        self.cache.crop(-self.steps)
        return token


# ---- where a Flax step's time goes ---------------------------------------------------------------


def _breakdown(config, model, batch, case, generate_timings, progress):
    """The ``step part`` rows: generate's own step from its rounds (``steps`` new tokens minus
    1, over ``steps - 1``), then the pieces, each from a cache as long as generate's."""
    flat, start, _ = _positions(config)
    steps = config.generate_steps
    rng = np.random.default_rng(3)
    length = start + steps - 1  # generate's cache: the attention reads all of it every step
    graphdef, params, state, token = _prefilled(model, batch, start, length, rng)
    d, vocab = model.cfg["emb_dim"], model.cfg["vocab_size"]
    x = jnp.asarray(rng.standard_normal((batch, 1, d)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((batch, vocab)), jnp.float32)
    calls = {
        "decode loop": functools.partial(_decode_loop, graphdef, params, state, token, steps=flat),
        "layers": functools.partial(_layers, graphdef, params, state, x, steps=flat),
        "head": functools.partial(_head, graphdef, params, state, x[:, 0], steps=flat),
        "argmax": functools.partial(_argmax, logits, steps=flat),
        "embeddings": functools.partial(_embeddings, graphdef, params, state, token, steps=flat),
    }
    for call in calls.values():
        jax.block_until_ready(call())  # compile
    _tick(progress, len(calls))
    timings = interleaved(calls, config.generate_repeats, progress)
    per_step = {name: t["median_ms"] / flat for name, t in timings.items()}
    whole, one = (
        generate_timings["generate"]["median_ms"],
        generate_timings["generate 1"]["median_ms"],
    )
    difference = (whole - one) / (steps - 1) if steps > 1 else 0.0
    per_step["generate"] = difference if difference > 0 else None
    timings["generate"] = generate_timings["generate"]
    parts = sum(per_step[name] for name in ("layers", "head", "argmax", "embeddings"))
    beyond = f"{{:+.2f}} ms beyond layers + head + argmax + embeddings ({parts:.2f} ms)"
    notes = {
        "generate": f"(generate of {steps} new tokens - of 1: {one:.1f} ms) / {steps - 1}, "
        "from the generate rounds; "
        + (beyond.format(difference - parts) if difference > 0 else "below the noise"),
        "decode loop": f"the step alone, {flat} in a fori_loop; "
        + beyond.format(per_step["decode loop"] - parts),
        "layers": f"{model.cfg['n_layers']} blocks + final norm, a cache of {length} slots",
        "head": f"(b, d) x (V, d) against the token embedding as stored, V = {vocab}",
        "argmax": f"generate's greedy choice over (b, V) float32 logits, V = {vocab}",
        "embeddings": "token and position embedding of one token per row",
    }
    return [
        make_row(
            "generate", case, f"step part: {name}", "flax", name, batch=batch, tokens=flat,
            timing=timings[name], value=per_step[name], unit="ms/step", note=notes[name],
        )
        for name in PARTS
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
        "Generate: flax_attention.models.generate vs transformers generate; tokens/s summed "
        "over the batch, flax/torch > 1 = Flax faster; bound: weights read once per step"
    )
    return f"{title}\n{table(headers, lines)}\n"
