"""The book's generation (chapters 4 and 5) for ``GPTModel`` and any model that meets
``CausalLM`` (below), compiled once per shape.

``generate_text_simple(model, idx, max_new_tokens, context_size)`` and ``generate(model, idx,
max_new_tokens, context_size, temperature=0.0, top_k=None, eos_id=None)`` keep the book's
semantics:

- the result is the prompt followed by the new tokens, ``(b, t + n)``;
- ``top_k`` keeps the ``top_k`` largest logits (the others become ``-inf``) before the
  temperature divides them; temperature 0 is greedy (argmax);
- ``eos_id``: generation stops when the next token is ``eos_id``, which is not appended;
- each step reads the last ``context_size`` tokens: once the sequence outgrows
  ``context_size``, the window is cropped to its last ``context_size`` tokens and run again
  (positions 0 to ``context_size - 1``), exactly as the book's loop.

How: while the whole sequence fits in ``context_size`` the window is the whole sequence, so one
jit prefills the attention layers' decode caches with the prompt and then decodes one token per
step in a ``lax.while_loop`` (the parameters are loop constants, only the caches travel); the
steps after the sequence outgrows ``context_size`` run the cropped window through the model in
the same jit, as the book does. Randomness comes from an explicit ``key`` (``jax.random.key``;
step ``i`` draws with ``fold_in(key, i)``), so a key gives the same tokens every time. The
book's ``torch.multinomial`` draws from the same distribution, not the same numbers.

Batches: ``idx`` ``(b, t)``. Prompts of unequal length are left-padded to one length with an
``attention_mask`` ``(b, t)`` (1 for a token, 0 for padding), as transformers' ``generate``
takes them: each row's positions count from its first token and no token attends to padding,
so each row's tokens are the ones it would get alone.

Compiles: ``generate`` is one XLA program per batch size, padded prompt length,
``max_new_tokens``, ``context_size`` and sampling options. So that every new prompt length does
not compile a new program (seconds for GPT-2 small), the prompt is left-padded with masked
tokens to a multiple of ``prompt_bucket`` tokens (64 by default) as a left-padded batch is, and
a prompt longer than ``context_size`` goes in as the last ``context_size`` tokens the book's
loop reads (the rest only comes back in the result); the padding is never so long that it
turns a cached step into a recomputed window. The tokens are the ones the unpadded prompt
gets. ``prompt_bucket=1`` runs each length as it is.

Generation runs in eval mode (dropout off, as the book's ``generate_and_print_sample`` calls
``model.eval()``): a model in train mode goes in as a copy in eval mode (the same arrays), so
its own modes never change and either mode runs the same compiled program; the decode caches
it uses are dropped at the end. The model goes into that program as a pytree (``jax.jit``
flattens GPT-2 small in about a millisecond) unless JAX cannot flatten it (a module declared
``pytree=False``) or it holds a module or variable twice (an ``nnx.Rngs`` shared by several
modules, say), which ``nnx.split`` keeps shared.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_attention._checks import check_int, check_real
from flax_attention._graph import EVAL_ATTRIBUTES, walk
from flax_attention._inputs import check_token_ids, check_zero_one
from flax_attention.cache import decode_step
from flax_attention.mesh import place, rows_sharding
from flax_attention.models.gpt import GPTModel, describe_head, head_outputs
from flax_attention.models.quantized import Int8Weight, WeightScale

__all__ = ["PROMPT_BUCKET", "CausalLM", "generate", "generate_text_simple", "next_token"]


@runtime_checkable
class CausalLM(Protocol):
    """What ``generate`` asks of a model (an ``nnx.Module``; ``GPTModel`` is one):

    - ``cfg``: a hashable mapping (``flax_attention.models.Config(cfg)`` makes one of a dict:
      it is part of the model's static structure) with ``vocab_size`` (the logits per token)
      and ``context_length``;
    - ``hidden_states(in_idx, *, decode=False, attention_mask=None)``: the last norm's output
      ``(b, t, d)`` for token ids ``(b, t)``; with ``decode=True`` the tokens continue the
      sequence in the decode caches, their positions counted from the caches' length;
      ``attention_mask`` ``(b, s)`` (``s``: ``t``, or the caches' ``max_length`` with
      ``decode``) is 1 for a token and 0 for left padding, each row's positions counted from its
      first token;
    - ``logits(x)``: the head, ``(..., d)`` -> ``(..., vocab_size)`` (a decode step runs it on
      the last token only);
    - ``init_cache(batch_size, max_length)`` and ``clear_cache()``: empty decode caches for
      ``max_length`` tokens in every attention layer, and none again;
    - ``.eval()``/``.train()``, as every ``nnx.Module``.
    """

    cfg: Mapping

    def hidden_states(self, in_idx, *, decode: bool = False, attention_mask=None): ...

    def logits(self, x): ...

    def init_cache(self, batch_size, max_length=None, dtype=None) -> None: ...

    def clear_cache(self) -> None: ...


#: What a decode loop holds constant: the parameters, and a quantized model's int8 weights and
#: scales (``models.quantize``); the rest (the caches) travels through the loop.
_WEIGHTS = nnx.Any(nnx.Param, Int8Weight, WeightScale)

#: ``generate``'s default ``prompt_bucket``: prompts are left-padded to a multiple of 64 tokens.
PROMPT_BUCKET = 64


def generate_text_simple(model: CausalLM, idx, max_new_tokens: int, context_size: int):
    """The book's chapter 4 loop: ``max_new_tokens`` greedy tokens appended to ``idx``
    ``(b, t)``; returns ``(b, t + max_new_tokens)``. ``generate`` with temperature 0."""
    return generate(model, idx, max_new_tokens, context_size)


def generate(
    model: CausalLM,
    idx,
    max_new_tokens: int,
    context_size: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    eos_id: int | None = None,
    *,
    key: jax.Array | None = None,
    attention_mask=None,
    prompt_bucket: int = PROMPT_BUCKET,
) -> jax.Array:
    """The book's chapter 5 ``generate`` (module docstring), in one jit.

    Args:
      model: a ``GPTModel``, or another model meeting ``CausalLM``.
      idx: token ids ``(b, t)``, integers below ``vocab_size`` (rows of unequal length need
        left padding and ``attention_mask``).
      max_new_tokens: tokens to append (at most; ``eos_id`` may stop earlier).
      context_size: tokens each step reads, at most the model's ``context_length``.
      temperature: 0 (greedy) or > 0 (sample from ``softmax(logits / temperature)``).
      top_k: ``None`` or keep the ``top_k`` largest logits (1 to ``vocab_size``).
      eos_id: ``None`` or a token id that stops generation (a batch of one row, as the book's
        ``idx_next == eos_id`` test).
      key: a ``jax.random.key``, required when sampling.
      attention_mask: ``(b, t)`` 0/1, each row zeros (padding) then ones (its tokens).
      prompt_bucket: the prompt is left-padded (with ``attention_mask``) to a multiple of this
        many tokens, so prompts of nearby lengths share one compiled program (module
        docstring, "Compiles"); 1 runs each length as it is.

    Returns:
      ``(b, t + n)`` int32: ``idx`` then the ``n <= max_new_tokens`` new tokens.
    """
    plan, ids, mask, draw = _check_arguments(
        model, idx, max_new_tokens, context_size, temperature, top_k, eos_id, key, attention_mask
    )
    check_int("prompt_bucket", prompt_bucket, 1)
    if max_new_tokens == 0:
        return jnp.asarray(ids)
    # The book's first window is the prompt's last context_size tokens, and no later window
    # reaches further back: the tokens before it only come back in the result.
    crop = max(0, ids.shape[1] - context_size)
    head, ids = ids[:, :crop], ids[:, crop:]
    mask = None if mask is None else mask[:, crop:]
    length = _bucket_length(ids.shape[1], prompt_bucket, context_size - max_new_tokens + 1)
    pad = length - ids.shape[1]
    ids, mask = _bucket(ids, mask, pad)
    # Steps whose window is the whole sequence (tokens + step <= context_size) use the cache.
    plan = plan._replace(cached_steps=min(max_new_tokens, max(0, context_size - length + 1)))
    rows = rows_sharding(model, ids.shape[0], cached=plan.cached_steps > 0)
    out, length = _run(model, plan, _on(ids, rows), None if mask is None else _on(mask, rows), draw)
    # Back to the caller's prompt: the bucket's padding off, the cropped head on.
    out = out[:, pad : int(length)]
    return jnp.concatenate([_on(head, rows), out], axis=1) if crop else out


class _Plan(NamedTuple):
    """What one compiled ``_generate`` program is for (static: a new value compiles anew);
    ``temperature`` and ``key`` go in as arrays, so they do not."""

    max_new_tokens: int
    context_size: int
    greedy: bool
    top_k: int | None
    eos_id: int | None
    cached_steps: int = 0  # steps through the decode cache; the rest on the cropped window


def _check_arguments(
    model, idx, max_new_tokens, context_size, temperature, top_k, eos_id, key, attention_mask
):
    """``generate``'s arguments checked: ``(plan, ids, mask, (key, temperature))``, ``ids`` and
    ``mask`` NumPy ``(b, t)`` int32 (``mask`` ``None`` if none was given), ``key`` a typed key
    and ``temperature`` a float32 array (1 when greedy), so neither compiles a new program."""
    if not isinstance(model, nnx.Module) or not isinstance(model, CausalLM):
        raise TypeError(
            f"model ({type(model).__name__}) must be a GPTModel or another nnx.Module meeting "
            "flax_attention.models.generation.CausalLM (cfg, hidden_states with decode and "
            "attention_mask, logits, init_cache, clear_cache)"
        )
    cfg = model.cfg
    try:
        hash(cfg)
    except TypeError:
        raise TypeError(
            f"model.cfg (a {type(cfg).__name__}) must be hashable: it is part of the model's "
            "static structure, which jit keys its compilations on (store "
            "flax_attention.models.Config(cfg), a read-only mapping, as GPTModel does)"
        ) from None
    outputs = head_outputs(model) if isinstance(model, GPTModel) else cfg["vocab_size"]
    if outputs != cfg["vocab_size"]:
        raise ValueError(
            f"model.out_head ({describe_head(model.out_head)}) must give vocab_size "
            f"({cfg['vocab_size']}) logits per token to generate, not {outputs}: a classification "
            "head (chapter 6) scores classes, not next tokens"
        )
    ids = _check_idx(idx, cfg["vocab_size"])
    check_int("max_new_tokens", max_new_tokens, 0)
    check_int("context_size", context_size, 1)
    if context_size > cfg["context_length"]:
        raise ValueError(
            f"context_size ({context_size}) must not exceed the model's context_length "
            f"({cfg['context_length']})"
        )
    _check_sampling(temperature, top_k, cfg["vocab_size"])
    _check_eos(eos_id, cfg["vocab_size"], ids.shape[0])
    greedy = temperature == 0
    if not greedy and key is None:
        raise ValueError("key (None) must be a jax.random.key when sampling (temperature > 0)")
    key = jax.random.key(0) if key is None else _check_key(key)
    mask = None if attention_mask is None else _check_attention_mask(attention_mask, ids.shape)
    plan = _Plan(max_new_tokens, context_size, greedy, top_k, eos_id)
    return plan, ids, mask, (key, jnp.float32(1.0 if greedy else temperature))


def _check_sampling(temperature, top_k, vocab_size: int) -> None:
    check_real("temperature", temperature, 0, why="0: greedy")
    if top_k is not None:
        check_int("top_k", top_k, 1)
        if top_k > vocab_size:
            raise ValueError(f"top_k ({top_k}) must be in 1..vocab_size ({vocab_size})")


def _check_eos(eos_id, vocab_size: int, batch: int) -> None:
    if eos_id is None:
        return
    check_int("eos_id", eos_id, 0)
    if eos_id >= vocab_size:
        raise ValueError(f"eos_id ({eos_id}) must be below vocab_size ({vocab_size})")
    if batch != 1:
        raise ValueError(
            f"eos_id ({eos_id}) needs a batch of one row (idx has {batch}): the book stops "
            "the whole sequence when the next token is eos_id"
        )


def _run(model, plan: _Plan, ids, mask, draw):
    """``_generate`` on ``model`` with decode caches as long as the cached steps need, dropped
    afterwards."""
    batch, tokens = ids.shape
    try:
        if plan.cached_steps:
            model.init_cache(batch, tokens + plan.cached_steps - 1)
        return _generate(_argument(model), ids, mask, *draw, plan=plan)
    finally:
        model.clear_cache()


def _argument(model):
    """The model as ``_generate`` takes it, in eval mode: itself where it is a plain pytree
    (``jit`` flattens GPT-2 small in about 1 ms), else ``nnx.split(model)`` (nnx's graph
    traversal, 16 ms), which keeps a shared module or variable shared and takes modules declared
    ``pytree=False``. A model in train mode goes as a copy in eval mode (the same arrays), so the
    caller's modes stay and either mode runs one compiled program."""
    found = walk(model)
    if found.training:  # new modules and variables, the same arrays; nnx's copy keeps sharing
        model = jax.tree.map(lambda x: x, model) if found.tree else nnx.merge(*nnx.split(model))
        for module in walk(model).training:  # what model.eval() sets, found by the walk
            for name in EVAL_ATTRIBUTES:
                if hasattr(module, name):
                    setattr(module, name, True)
    return model if found.tree else nnx.split(model)


def _bucket_length(tokens: int, bucket: int, cached_room: int) -> int:
    """The padded prompt's length: ``tokens`` rounded up to a multiple of ``bucket``, but no
    further than where every step still fits the decode cache (``cached_room``: the longest
    prompt whose ``max_new_tokens`` steps all fit ``context_size``), so padding never turns a
    cached step into a recomputed window. Prompts longer than that keep their length."""
    padded = -(-tokens // bucket) * bucket
    return min(padded, max(tokens, cached_room))


def _bucket(ids: np.ndarray, mask: np.ndarray | None, pad: int):
    """``ids`` ``(b, t)`` and its mask left-padded by ``pad`` tokens (token 0, mask 0)."""
    if pad == 0:
        return ids, mask
    mask = np.ones(ids.shape, np.int32) if mask is None else mask
    return np.pad(ids, ((0, 0), (pad, 0))), np.pad(mask, ((0, 0), (pad, 0)))


def _on(value: np.ndarray, sharding):
    """``value`` where ``sharding`` says (``place``: each process its own rows), or on the
    default device, uncommitted, without one."""
    return jnp.asarray(value) if sharding is None else place(value, sharding)


def _check_key(key) -> jax.Array:
    """One typed key (``jax.random.key(seed)``), or a legacy ``jax.random.PRNGKey(seed)``
    (``uint32`` ``(2,)``) as one."""
    if isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(
                f"key (shape {key.shape}) must be one key, shape () (key=jax.random.key(seed))"
            )
        return key
    if isinstance(key, (jax.Array, np.ndarray)) and key.dtype == np.uint32 and key.shape == (2,):
        return jax.random.wrap_key_data(key)
    raise TypeError(
        f"key ({key!r}: {type(key).__name__}) must be a jax.random.key: pass "
        "key=jax.random.key(seed), e.g. key=jax.random.key(0)"
    )


def _check_idx(idx, vocab_size: int) -> np.ndarray:
    if isinstance(idx, (list, tuple)) and idx and all(isinstance(r, (list, tuple)) for r in idx):
        lengths = sorted({len(row) for row in idx})
        if len(lengths) > 1:
            raise ValueError(
                f"idx rows have lengths {lengths}: prompts of unequal length must be left-padded "
                "to one length with an attention_mask (1 for tokens, 0 for padding)"
            )
    ids = np.asarray(idx)
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"idx.ndim ({ids.ndim}, shape {ids.shape}) must be 2 (batch, tokens > 0)")
    check_token_ids("idx", ids, vocab_size)
    return ids.astype(np.int32)


def _check_attention_mask(attention_mask, shape) -> np.ndarray:
    mask = np.asarray(attention_mask)
    if mask.shape != shape:
        raise ValueError(f"attention_mask.shape ({mask.shape}) must equal idx.shape ({shape})")
    if mask.dtype != bool and not np.issubdtype(mask.dtype, np.number):
        raise TypeError(f"attention_mask (dtype {mask.dtype}) must be 0/1 numbers or bools")
    check_zero_one(mask)
    mask = mask.astype(np.int32)
    bad = np.flatnonzero(np.any(np.diff(mask, axis=1) < 0, axis=1))
    if bad.size:
        raise ValueError(
            f"attention_mask row {bad[0]} ({mask[bad[0]].tolist()}) must be left-padded: zeros "
            "(padding) before ones (tokens)"
        )
    empty = np.flatnonzero(mask.sum(axis=1) == 0)
    if empty.size:
        raise ValueError(f"attention_mask row {empty[0]} must have at least one token (a 1)")
    return mask


def next_token(logits, key, temperature, *, greedy: bool, top_k: int | None = None):
    """The book's choice of the next token, as ``generate`` makes it: ``logits`` ``(b, V)`` ->
    ids ``(b,)`` int32. ``top_k`` keeps the ``top_k`` largest logits (the others become
    ``-inf``); then ``greedy`` takes the first largest (``jnp.argmax``'s index, ties, NaN and
    infinities included), else a draw from ``softmax(logits / temperature)`` with ``key``
    (``key`` and ``temperature`` are not read when ``greedy``)."""
    logits = logits.astype(jnp.float32)
    if top_k is not None:
        min_val = jax.lax.top_k(logits, top_k)[0][:, -1:]  # (b, 1)
        logits = jnp.where(logits < min_val, -jnp.inf, logits)
    if greedy:
        return _argmax(logits)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


def _argmax(logits):
    """``jnp.argmax(logits, axis=-1)`` as int32, through plain reductions: the row's maximum,
    whether it holds a NaN, then the first index holding the maximum (the first NaN where there
    is one, as ``jnp.argmax`` picks), so ties, NaN and all ``-inf`` rows give ``jnp.argmax``'s
    index. XLA's CPU argmax is one reduction over (value, index) pairs, which it does not
    vectorise; these reductions are faster (over GPT-2's logits:
    ``docs/performance.md``, "Choosing an implementation")."""
    nan = jnp.isnan(logits)  # (b, V)
    top = jnp.max(logits, axis=-1, keepdims=True)  # (b, 1)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, logits == top)  # (b, V)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)  # (b, V)
    return jnp.min(jnp.where(hit, index, logits.shape[-1]), axis=-1)


@functools.partial(jax.jit, static_argnames=("plan",))
def _generate(model, ids, mask, key, temperature, *, plan: _Plan):
    """``(tokens (b, t + max_new_tokens), length)``: the first ``length`` columns are the
    result. ``model``: ``_argument``'s, in eval mode (the book's ``model.eval()``).
    ``plan.cached_steps`` steps through the decode cache, the rest on the cropped window; each
    step is ``decode_step``, the logits of the last token."""
    model = nnx.merge(*model) if isinstance(model, tuple) else model
    graphdef, weights, state = nnx.split(model, _WEIGHTS, ...)
    new = plan.max_new_tokens
    # Padded, not written into new arrays, so they keep the rows' sharding on a mesh.
    tokens = jnp.pad(ids, ((0, 0), (0, new)))  # (b, T)
    # The mask over every token slot: the prompt's, then ones for the new tokens.
    token_mask = None if mask is None else jnp.pad(mask, ((0, 0), (0, new)), constant_values=1)

    def choose(logits, step):
        # greedy: no key is drawn, so the program holds no random-number code to compile
        key_step = None if plan.greedy else jax.random.fold_in(key, step)
        return next_token(logits, key_step, temperature, greedy=plan.greedy, top_k=plan.top_k)

    step = functools.partial(decode_step, graphdef, weights, head=_logits, weights_filter=_WEIGHTS)
    loop = (state, jnp.int32(0), _Tokens(tokens, jnp.int32(ids.shape[1]), jnp.bool_(False)))
    if plan.cached_steps:
        loop = _cached_loop(step, choose, plan, loop, ids, token_mask)
    if plan.cached_steps < new:
        loop = _windowed_loop(step, choose, plan, loop, token_mask)
    _, _, written = loop
    return written.tokens, written.length


class _Tokens(NamedTuple):
    """The sequence so far in a decode loop's carry: ``tokens`` ``(b, T)``, of which the first
    ``length`` are written; ``done`` once ``eos_id`` came."""

    tokens: jax.Array
    length: jax.Array
    done: jax.Array


def _append(written: _Tokens, new, eos_id) -> _Tokens:
    """``new`` ``(b,)`` written at ``length``, unless ``done`` or it is ``eos_id``."""
    tokens, length, done = written
    if eos_id is not None:
        done = done | (new[0] == eos_id)
    appended = jax.lax.dynamic_update_slice(tokens, new[:, None], (0, length))
    tokens = jnp.where(done, tokens, appended)
    return _Tokens(tokens, jnp.where(done, length, length + 1), done)


def _hidden(model, ids, attention_mask, decode):
    """A decode loop's forward: ``hidden_states`` ``(b, t, d)``."""
    return model.hidden_states(ids, decode=decode, attention_mask=attention_mask)


def _logits(model, hidden):
    """A decode loop's head: the last token's logits ``(b, V)``."""
    return model.logits(hidden)


def _cached_loop(step, choose, plan: _Plan, loop, ids, token_mask):
    """The prompt through the decode caches (prefill), then one token per step through them,
    while the whole sequence fits ``context_size``: ``(state, step, written)`` after."""
    prompt = ids.shape[1]
    cache_mask = None if token_mask is None else token_mask[:, : prompt + plan.cached_steps - 1]
    state, _, written = loop
    state, logits = step(state, _hidden, ids, cache_mask, True)
    written = _append(written, choose(logits, 0), plan.eos_id)

    def cached(loop):
        state, i, written = loop
        last = jax.lax.dynamic_slice_in_dim(written.tokens, written.length - 1, 1, axis=1)
        state, logits = step(state, _hidden, last, cache_mask, True)  # last: (b, 1)
        return state, i + 1, _append(written, choose(logits, i), plan.eos_id)

    def going(loop):
        return (loop[1] < plan.cached_steps) & ~loop[2].done

    return jax.lax.while_loop(going, cached, (state, jnp.int32(1), written))


def _windowed_loop(step, choose, plan: _Plan, loop, token_mask):
    """The steps after the sequence outgrew ``context_size``: the last ``context_size`` tokens
    run through the model again each step, as the book's loop (no cache)."""

    def windowed(loop):
        state, i, written = loop
        start = written.length - context_size
        window = jax.lax.dynamic_slice_in_dim(written.tokens, start, context_size, axis=1)
        window_mask = (
            None
            if token_mask is None
            else jax.lax.dynamic_slice_in_dim(token_mask, start, context_size, axis=1)
        )
        state, logits = step(state, _hidden, window, window_mask, False)  # window: (b, c)
        return state, i + 1, _append(written, choose(logits, i), plan.eos_id)

    def going(loop):
        return (loop[1] < plan.max_new_tokens) & ~loop[2].done

    context_size = plan.context_size
    return jax.lax.while_loop(going, windowed, loop)
