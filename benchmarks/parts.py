"""Section ``parts``: the whole model's pieces one by one, each against transformers' own, so the
next bottleneck of the ``prefill`` and ``train`` sections is visible.

At ``parts_shape`` (b8 t256, the training step's), GPT-2 small, random weights, float32,
dropout 0, the same weights in both (``benchmarks.gpt_models``); one layer's pieces (every layer
has the same shapes), then the model's ends; Flax / transformers:

- ``layernorm``: ``trf_blocks[0].norm1`` / ``h[0].ln_1``.
- ``attention projections``: ``W_query``, ``W_key``, ``W_value`` of x and ``out_proj`` of a
  context / ``c_attn`` of x (the three in one) and ``c_proj`` of the context.
- ``attention core``: ``causal_attention`` (the layer's implementation, default: the fastest) of
  ``(b, t, h, d)`` / ``scaled_dot_product_attention`` (causal) between the heads' transposes, as
  ``GPT2Attention`` runs it.
- ``mlp``: ``trf_blocks[0].ff`` / ``h[0].mlp``.
- ``block``: ``trf_blocks[0]`` / ``h[0]`` (the pieces above and the residual adds).
- ``head + loss``: the tied head ``x @ tok_emb.T`` and ``calc_loss_batch``'s mean cross-entropy /
  ``F.linear(x, wte.weight)`` and ``F.cross_entropy``.
- ``embeddings``: ``tok_emb(ids) + pos_emb(positions)`` / ``wte(ids) + wpe(positions)``.

Each part runs forward and forward+backward: Flax ``jax.jit`` of the part (its parameters an
argument) and of its ``jax.vjp`` (gradients of every parameter and floating input); torch eager,
under ``no_grad`` for the forward, ``torch.autograd.grad`` of the same cotangents (random, the
same numbers in both; 1 for the loss) for forward+backward. Before timing, the outputs (forward)
and the floating inputs' gradients (forward+backward) are compared; the two callables of a part
and mode are then timed round-robin. ``ratio_vs_sdpa``: Flax time / transformers' time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx

from benchmarks.gpt_models import flax_model, torch_models
from benchmarks.rows import make_row, max_diffs
from benchmarks.timing import block, interleaved
from flax_attention.causal import causal_attention

__all__ = ["MODES", "PARTS", "TOLERANCE", "format_rows", "plan_calls", "run"]

PARTS = ("layernorm", "attention projections", "attention core", "mlp", "block", "head + loss",
         "embeddings")  # fmt: skip
MODES = ("forward", "forward+backward")
#: Parity bound before timing: max |flax - torch| / max(1, max |torch|) per compared tensor.
TOLERANCE = 1e-4


@dataclasses.dataclass(frozen=True)
class _Part:
    """One part in both frameworks: ``flax(params, *inputs)`` and ``torch(*inputs)`` each return
    a tuple of outputs; ``torch_params`` are the torch tensors whose gradients it takes."""

    flax: Callable
    params: object
    torch: Callable
    torch_params: list
    inputs: tuple  # numpy arrays, the same in both


def plan_calls(config) -> int:
    return len(PARTS) * len(MODES) * 2 * (2 + config.parts_repeats)


def _parts(model, hf, batch: int, tokens: int) -> dict[str, _Part]:
    """Every part of ``PARTS`` on ``(batch, tokens)``: inputs drawn from a fixed seed."""
    rng = np.random.default_rng(0)
    d = model.cfg["emb_dim"]
    heads = model.cfg["n_heads"]

    def normal(*shape):
        return rng.standard_normal(shape, np.float32)

    def split(module):
        graphdef, state = nnx.split(module)
        return lambda params, *xs: nnx.merge(graphdef, params)(*xs), state

    layer, peer = model.trf_blocks[0], hf.transformer.h[0]
    x, context = normal(batch, tokens, d), normal(batch, tokens, d)
    q, k, v = (normal(batch, tokens, heads, d // heads) for _ in range(3))
    ids = rng.integers(0, model.cfg["vocab_size"], (batch, tokens + 1))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    parts = {}

    norm, norm_params = split(layer.norm1)
    parts["layernorm"] = _Part(lambda p, x: (norm(p, x),), norm_params, lambda x: (peer.ln_1(x),),
                               list(peer.ln_1.parameters()), (x,))  # fmt: skip

    att_graph, att_params = nnx.split(layer.att)

    def projections(params, x, context):
        att = nnx.merge(att_graph, params)
        return att.W_query(x), att.W_key(x), att.W_value(x), att.out_proj(context)

    def peer_projections(x, context):  # c_attn's (b, t, 3d) as Flax's three
        return (*peer.attn.c_attn(x).split(d, dim=-1), peer.attn.c_proj(context))

    parts["attention projections"] = _Part(
        projections, att_params, peer_projections,
        [*peer.attn.c_attn.parameters(), *peer.attn.c_proj.parameters()], (x, context),
    )  # fmt: skip

    def core(params, q, k, v):
        return (causal_attention(q, k, v, cache=None, dropout=layer.att.dropout, precision=None,
                                 implementation=layer.att.implementation,
                                 block_sizes=layer.att.block_sizes),)  # fmt: skip

    def peer_core(q, k, v):  # (b, t, h, d) -> (b, h, t, d) and back, as GPT2Attention does
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return (out.transpose(1, 2).contiguous(),)

    parts["attention core"] = _Part(core, {}, peer_core, [], (q, k, v))

    mlp, mlp_params = split(layer.ff)
    parts["mlp"] = _Part(lambda p, x: (mlp(p, x),), mlp_params, lambda x: (peer.mlp(x),),
                         list(peer.mlp.parameters()), (x,))  # fmt: skip

    whole, whole_params = split(layer)
    parts["block"] = _Part(lambda p, x: (whole(p, x),), whole_params,
                           lambda x: (_first(peer(x)),), list(peer.parameters()), (x,))  # fmt: skip

    embedding = hf.transformer.wte.weight  # the tied head's matrix

    def head(table, x):
        logits = jnp.einsum("btd,vd->btv", x, table)  # (b, t, V)
        logits = logits.reshape(-1, logits.shape[-1])  # (b * t, V)
        return (_cross_entropy(logits, targets),)

    def peer_head(x):
        logits = torch.nn.functional.linear(x, embedding)  # (b, t, V)
        labels = torch.from_numpy(targets).flatten()  # (b * t,)
        return (torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels),)

    parts["head + loss"] = _Part(head, model.tok_emb.embedding[...], peer_head, [embedding], (x,))

    def embeddings(tables, shift):  # ``shift`` (zeros) gives the part a floating input
        tok, pos = tables
        return (jnp.take(tok, inputs, axis=0) + jnp.take(pos, jnp.arange(tokens), axis=0)[None]
                + shift,)  # fmt: skip

    def peer_embeddings(shift):
        wte, wpe = hf.transformer.wte, hf.transformer.wpe
        return (wte(torch.from_numpy(inputs)) + wpe(torch.arange(tokens))[None] + shift,)

    parts["embeddings"] = _Part(
        embeddings, (model.tok_emb.embedding[...], model.pos_emb.embedding[...]),
        peer_embeddings, [hf.transformer.wte.weight, hf.transformer.wpe.weight],
        (np.zeros((batch, tokens, d), np.float32),),
    )  # fmt: skip
    return parts


def _first(outputs):
    """A transformers block's hidden states (a tuple in some versions)."""
    return outputs[0] if isinstance(outputs, tuple) else outputs


def _cross_entropy(logits, targets):
    """``calc_loss_batch``'s loss of flattened ``(b * t, V)`` logits."""
    labels = jnp.asarray(targets).reshape(-1)  # (b * t,)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _calls(part: _Part, cotangents: tuple):
    """``{mode: (flax call, torch call)}``; each returns what the parity check compares first:
    the outputs (forward), the floating inputs' gradients (forward+backward)."""
    flax_inputs = tuple(jnp.asarray(x) for x in part.inputs)
    torch_inputs = tuple(torch.from_numpy(x) for x in part.inputs)
    forward = jax.jit(part.flax)

    @jax.jit
    def forward_backward(params, inputs, cotangents):
        _, vjp = jax.vjp(part.flax, params, *inputs)
        grads = vjp(cotangents)
        return grads[1:], grads[0]  # inputs' gradients first

    flax_cotangents = tuple(jnp.asarray(c) for c in cotangents)
    torch_cotangents = tuple(torch.from_numpy(c) for c in cotangents)
    leaves = [x.clone().requires_grad_(True) for x in torch_inputs]

    def torch_forward():
        with torch.no_grad():
            return part.torch(*torch_inputs)

    def torch_forward_backward():
        grads = torch.autograd.grad(part.torch(*leaves), leaves + part.torch_params,
                                    torch_cotangents)  # fmt: skip
        return grads[: len(leaves)], grads[len(leaves) :]

    return {
        "forward": (lambda: forward(part.params, *flax_inputs), torch_forward),
        "forward+backward": (
            lambda: forward_backward(part.params, flax_inputs, flax_cotangents),
            torch_forward_backward,
        ),
    }


def _compared(result) -> dict:
    """The first element of a call's result (outputs, or the inputs' gradients) by position."""
    first = result[0] if isinstance(result[0], tuple) else result
    return {str(i): np.asarray(x.detach() if hasattr(x, "detach") else x)
            for i, x in enumerate(first)}  # fmt: skip


def run(config, progress=None) -> list[dict]:
    batch, tokens = config.parts_shape
    hf = torch_models(config, ("sdpa",), dropout=0.0)["sdpa"]
    model, _ = flax_model(hf)
    rows = []
    case = f"b{batch}_t{tokens}"
    rng = np.random.default_rng(1)
    for name, part in _parts(model, hf, batch, tokens).items():
        with torch.no_grad():
            outputs = part.torch(*(torch.from_numpy(x) for x in part.inputs))
        cotangents = tuple(
            rng.standard_normal(tuple(o.shape), np.float32) if o.ndim else np.ones((), np.float32)
            for o in outputs
        )
        for mode, (flax_call, torch_call) in _calls(part, cotangents).items():
            got, want = block(flax_call()), torch_call()
            block(flax_call()), torch_call()
            if progress is not None:
                progress.update(4)
            diffs = max_diffs(_compared(got), _compared(want))
            if diffs[1] > TOLERANCE:
                raise RuntimeError(
                    f"parts: {name} {mode}: Flax differs from transformers by {diffs[1]:.1e} "
                    f"(relative) > {TOLERANCE:g}; not timing a wrong result"
                )
            timings = interleaved({"flax": flax_call, "torch": torch_call},
                                  config.parts_repeats, progress)  # fmt: skip
            ratio = timings["flax"]["median_ms"] / timings["torch"]["median_ms"]
            for framework in ("flax", "torch"):
                flax = framework == "flax"
                rows.append(make_row(
                    "parts", case, mode, framework, name, batch=batch, tokens=tokens,
                    timing=timings[framework], ratio_vs_sdpa=ratio if flax else 1.0,
                    diffs=diffs if flax else None,
                    note="GPTModel" if flax else "GPT2LMHeadModel (sdpa)",
                ))  # fmt: skip
    return rows


def format_rows(rows: list[dict], table) -> str:
    """The section's table (``table(headers, lines)`` from ``benchmarks.cli``): one line per
    part and mode, Flax and transformers side by side."""
    pairs = {}
    for row in rows:
        pairs.setdefault((row["implementation"], row["mode"]), {})[row["framework"]] = row
    headers = ["case", "part", "mode", "Flax ms", "transformers ms", "/transformers",
               "Flax - transformers ms", "max diff (rel)"]  # fmt: skip
    lines = []
    for (part, mode), pair in pairs.items():
        flax, peer = pair.get("flax"), pair.get("torch")
        if flax is None or peer is None:
            continue
        lines.append([flax["case"], part, mode, f"{flax['median_ms']:.1f}",
                      f"{peer['median_ms']:.1f}", f"{flax['ratio_vs_sdpa']:.2f}",
                      f"{flax['median_ms'] - peer['median_ms']:+.1f}",
                      f"{flax['max_rel_diff']:.1e}"])  # fmt: skip
    if not lines:
        return ""
    title = (
        "Parts: the model's pieces, median ms; /transformers = Flax time / transformers' time, "
        "same run (< 1: Flax faster)"
    )
    return f"{title}\n{table(headers, lines)}\n"
