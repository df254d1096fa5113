"""GPT-2 in Flax NNX on ``flax_attention.MultiHeadAttention``: Hugging Face checkpoints in, text
out.

The model the documents' chapter builds towards, whole: token and learned position embeddings,
``n_layer`` pre-norm blocks (``nnx.LayerNorm``, ``fa.MultiHeadAttention`` with its decode cache
and default implementation, a tanh-GELU MLP), a final ``nnx.LayerNorm`` and the output head tied
to the token embedding. It reads a Hugging Face GPT-2 checkpoint directory (``config.json`` and
``model.safetensors``, as ``save_pretrained`` writes them or as downloaded from the hub), of any
size in the config (small to xl), and generates in one ``jax.jit``: prefill of the prompt, then a
``lax.scan`` over the new tokens with the cache, greedy or sampled (temperature, top-k) from an
explicit ``jax.random`` key.

Shape legend: ``b`` batch, ``t`` tokens of a call, ``d`` = ``n_embd``, ``V`` = ``vocab_size``,
``N`` new tokens.

Command line::

    python examples/gpt2.py --checkpoint DIR (--prompt TEXT | --prompt-ids 1,2,3) \\
        --max-new-tokens N [--batch B] [--json PATH] [--temperature T --top-k K --seed S]

``--prompt`` goes through the checkpoint's own tokenizer files (``tokenizer.json``, or
``vocab.json`` + ``merges.txt``) with ``tokenizers``; nothing is downloaded. ``--batch B`` runs
the prompt as B identical rows. ``--json PATH`` writes ``{"tokens": [[new ids of row 0], ...],
"prefill_ms", "tokens_per_s", "compile_s"}``; ``tokens_per_s`` is new tokens per second summed
over the batch for one whole generate call (prefill included, compile excluded).

Prompts in a batch must have equal lengths: there is no padding or attention mask, so a batch of
unequal prompts is a ``ValueError`` (generate them one at a time, or group them by length).

In Python::

    model = load_checkpoint("gpt2")                      # a directory
    new_ids = generate(model, [[464, 3290]], 20)         # (b, N) greedy
    new_ids = generate(model, ids, 20, key=jax.random.key(0), temperature=0.8, top_k=40)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import sys
import time
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flax_attention as fa

__all__ = [
    "GPT2",
    "GPT2Config",
    "compile_generate",
    "decode_steps",
    "export_weights",
    "generate",
    "load_attention",
    "load_checkpoint",
    "load_weights",
    "main",
]

#: The activations Hugging Face names for the tanh approximation of GELU (GPT-2 uses gelu_new).
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


# ---- configuration ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """The fields of a Hugging Face ``GPT2Config`` this model uses (defaults: GPT-2 small)."""

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None  # None: 4 * n_embd
    layer_norm_epsilon: float = 1e-5
    attn_pdrop: float = 0.1
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1

    @property
    def d_mlp(self) -> int:
        return self.n_inner or 4 * self.n_embd

    @classmethod
    def from_dict(cls, values: Mapping) -> GPT2Config:
        """From a ``config.json``'s contents; options this model does not implement (another
        activation, ``scale_attn_by_inverse_layer_idx``, ``reorder_and_upcast_attn``, an untied
        head, cross-attention) are a ``ValueError`` naming them."""
        unsupported = {
            "activation_function": (values.get("activation_function", "gelu_new"), TANH_GELU),
            "scale_attn_weights": (values.get("scale_attn_weights", True), (True,)),
            "scale_attn_by_inverse_layer_idx": (
                values.get("scale_attn_by_inverse_layer_idx", False),
                (False,),
            ),
            "reorder_and_upcast_attn": (values.get("reorder_and_upcast_attn", False), (False,)),
            "tie_word_embeddings": (values.get("tie_word_embeddings", True), (True,)),
            "add_cross_attention": (values.get("add_cross_attention", False), (False,)),
        }
        for name, (value, allowed) in unsupported.items():
            if value not in allowed:
                raise ValueError(
                    f"config {name} ({value!r}) must be one of {allowed} for this GPT-2 model"
                )
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in fields})

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> GPT2Config:
        with open(path) as f:
            return cls.from_dict(json.load(f))


# ---- the model ----------------------------------------------------------------------------------


class MLP(nnx.Module):
    """``c_fc`` (d -> d_mlp), tanh-GELU, ``c_proj`` (d_mlp -> d), dropout."""

    def __init__(self, config: GPT2Config, *, precision=None, rngs: nnx.Rngs):
        linear = functools.partial(nnx.Linear, precision=precision, rngs=rngs)
        self.c_fc = linear(config.n_embd, config.d_mlp)
        self.c_proj = linear(config.d_mlp, config.n_embd)
        self.dropout = nnx.Dropout(config.resid_pdrop, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.gelu(self.c_fc(x), approximate=True)  # (b, t, d_mlp)
        return self.dropout(self.c_proj(x))  # (b, t, d)


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPT2Config, *, precision=None, rngs: nnx.Rngs):
        d = config.n_embd
        norm = functools.partial(nnx.LayerNorm, d, epsilon=config.layer_norm_epsilon, rngs=rngs)
        self.ln_1 = norm()
        self.attn = fa.MultiHeadAttention(
            d, d, config.n_positions, config.attn_pdrop, config.n_head, qkv_bias=True,
            precision=precision, rngs=rngs,
        )  # fmt: skip
        self.resid_dropout = nnx.Dropout(config.resid_pdrop, rngs=rngs)
        self.ln_2 = norm()
        self.mlp = MLP(config, precision=precision, rngs=rngs)

    def __call__(self, x, *, decode: bool = False):
        x = x + self.resid_dropout(self.attn(self.ln_1(x), decode=decode))  # (b, t, d)
        return x + self.mlp(self.ln_2(x))  # (b, t, d)


class GPT2(nnx.Module):
    """GPT-2 (``GPT2LMHeadModel``): ``ids`` ``(b, t)`` int -> logits ``(b, t, V)``.

    With ``decode=True`` the tokens continue the sequence held in the attention layers' caches
    (``init_cache`` first): their positions start at the cache's index.
    """

    def __init__(self, config: GPT2Config, *, precision=None, rngs: nnx.Rngs):
        self.config = config
        self.precision = precision
        self.wte = nnx.Embed(config.vocab_size, config.n_embd, rngs=rngs)
        self.wpe = nnx.Embed(config.n_positions, config.n_embd, rngs=rngs)
        self.drop = nnx.Dropout(config.embd_pdrop, rngs=rngs)
        self.h = nnx.List(
            [Block(config, precision=precision, rngs=rngs) for _ in range(config.n_layer)]
        )
        self.ln_f = nnx.LayerNorm(config.n_embd, epsilon=config.layer_norm_epsilon, rngs=rngs)

    def init_cache(self, batch_size: int, max_length: int) -> None:
        """An empty decode cache of ``max_length`` tokens in every attention layer."""
        for block in self.h:
            block.attn.init_cache(batch_size, max_length)

    def hidden_states(self, ids, *, decode: bool = False):
        """``ids`` ``(b, t)`` -> the final layer norm's output ``(b, t, d)``."""
        offset = self.h[0].attn.cache_index[...] if decode else 0
        positions = offset + jnp.arange(ids.shape[-1])  # (t,)
        x = self.wte(ids) + self.wpe(positions)[None]  # (b, t, d)
        x = self.drop(x)
        for block in self.h:
            x = block(x, decode=decode)  # (b, t, d)
        return self.ln_f(x)  # (b, t, d)

    def head(self, x):
        """The tied output head: ``x`` ``(..., d)`` -> logits ``(..., V)``, contracting the
        ``(V, d)`` embedding as stored (a copy transposed to ``(d, V)`` once before the decode
        loop measured slower on CPU: ``python -m benchmarks --sections generate``)."""
        return jnp.einsum("...d,vd->...v", x, self.wte.embedding[...], precision=self.precision)

    def __call__(self, ids, *, decode: bool = False):
        return self.head(self.hidden_states(ids, decode=decode))  # (b, t, V)


# ---- weights ------------------------------------------------------------------------------------


def load_attention(layer: fa.MultiHeadAttention, tensors: Mapping, prefix: str) -> None:
    """Load one Hugging Face ``GPT2Attention``'s weights (keys under ``prefix``) into ``layer``.

    The weight bridge's ``"gpt2"`` layout does the work: ``c_attn`` is a ``Conv1D``, weight
    ``(d, 3 d)`` = ``[W_query | W_key | W_value]`` stored ``(d_in, d_out)``, split and
    transposed; ``c_proj`` is ``out_proj``. Strict under ``prefix``: a missing, unexpected or
    mis-shaped key is a ``ValueError`` naming it, and nothing is loaded. The old checkpoints'
    buffers ``attn.bias`` (the causal mask, checked) and ``attn.masked_bias`` carry no weights.
    """
    fa.load_state_dict(layer, tensors, layout="gpt2", prefix=prefix)


def _tensor(tensors: Mapping, key: str, shape: tuple[int, ...]) -> np.ndarray:
    """``tensors[key]`` as a NumPy array of ``shape``, or a ``ValueError`` naming ``key``."""
    if key not in tensors:
        raise ValueError(f"checkpoint is missing tensor {key} (expected shape {shape})")
    value = np.asarray(tensors[key])
    if value.shape != shape:
        raise ValueError(f"checkpoint tensor {key} has shape {value.shape}, expected {shape}")
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise ValueError(f"checkpoint tensor {key} has dtype {value.dtype}, expected floating")
    return value


def _set(variable: nnx.Variable, value: np.ndarray) -> None:
    variable.set_value(jnp.asarray(value, variable.dtype))


def _fill(model: GPT2, tensors: Mapping) -> None:
    """Every tensor of the checkpoint into ``model`` (checked by name and shape)."""
    config = model.config
    prefix = "transformer." if "transformer.wte.weight" in tensors else ""
    d, d_mlp = config.n_embd, config.d_mlp
    _set(model.wte.embedding, _tensor(tensors, prefix + "wte.weight", (config.vocab_size, d)))
    _set(model.wpe.embedding, _tensor(tensors, prefix + "wpe.weight", (config.n_positions, d)))

    def norm(layer: nnx.LayerNorm, name: str) -> None:
        _set(layer.scale, _tensor(tensors, f"{name}.weight", (d,)))
        _set(layer.bias, _tensor(tensors, f"{name}.bias", (d,)))

    def conv1d(layer: nnx.Linear, name: str, d_in: int, d_out: int) -> None:
        # A Conv1D weight is (d_in, d_out), already the layout of a Flax kernel.
        _set(layer.kernel, _tensor(tensors, f"{name}.weight", (d_in, d_out)))
        _set(layer.bias, _tensor(tensors, f"{name}.bias", (d_out,)))

    for i, block in enumerate(model.h):
        name = f"{prefix}h.{i}"
        norm(block.ln_1, f"{name}.ln_1")
        load_attention(block.attn, tensors, f"{name}.attn.")
        norm(block.ln_2, f"{name}.ln_2")
        conv1d(block.mlp.c_fc, f"{name}.mlp.c_fc", d, d_mlp)
        conv1d(block.mlp.c_proj, f"{name}.mlp.c_proj", d_mlp, d)
    norm(model.ln_f, prefix + "ln_f")
    if "lm_head.weight" in tensors:  # tied: a copy of wte when present
        head = _tensor(tensors, "lm_head.weight", (config.vocab_size, d))
        if not np.array_equal(head, np.asarray(tensors[prefix + "wte.weight"])):
            raise ValueError("checkpoint tensor lm_head.weight differs from wte.weight (untied)")
    blocks = tuple(f"{prefix}h.{i}." for i in range(config.n_layer))
    top = {prefix + n for n in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")}
    unexpected = sorted(
        k for k in tensors if not k.startswith(blocks) and k not in top and k != "lm_head.weight"
    )
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensors: {unexpected}")


def _skeleton(config: GPT2Config, precision=None) -> GPT2:
    """A GPT-2 of ``config`` with abstract parameters (no memory, no random draws)."""
    return nnx.eval_shape(lambda: GPT2(config, precision=precision, rngs=nnx.Rngs(0)))


def load_weights(model: GPT2, tensors: Mapping) -> None:
    """Load a Hugging Face GPT-2 state dict (``transformer.``-prefixed or not) into ``model``.

    Every tensor is read, checked and placed into a fresh skeleton first; ``model`` changes only
    once all of them loaded, so a missing, unexpected or mis-shaped tensor (a ``ValueError``
    naming it) leaves ``model`` as it was.
    """
    skeleton = _skeleton(model.config, model.precision)
    _fill(skeleton, tensors)
    nnx.update(model, nnx.state(skeleton, nnx.Param))


def export_weights(model: GPT2) -> dict[str, np.ndarray]:
    """``model``'s parameters under a Hugging Face ``GPT2LMHeadModel``'s names and shapes
    (``transformer.``-prefixed; ``Conv1D`` weights ``(d_in, d_out)``, ``c_attn`` fused): the
    inverse of ``load_weights``, which reads the result back unchanged.

    The head is tied: ``transformer.wte.weight`` stands for both uses and ``lm_head.weight`` is
    left out, as ``save_pretrained`` and torch's ``named_parameters()`` leave it out (HF's
    ``state_dict()`` lists the same tensor under both keys). Exported from a gradient (a model
    whose parameters hold gradients), ``transformer.wte.weight`` is the sum over both uses, the
    token lookup and the head, as torch accumulates both into the one tied parameter.
    """

    def value(variable: nnx.Variable) -> np.ndarray:
        return np.array(variable[...], np.float32, order="C")

    out = {"transformer.wte.weight": value(model.wte.embedding)}
    out["transformer.wpe.weight"] = value(model.wpe.embedding)

    def norm(layer: nnx.LayerNorm, name: str) -> None:
        out[f"{name}.weight"], out[f"{name}.bias"] = value(layer.scale), value(layer.bias)

    def conv1d(layer: nnx.Linear, name: str) -> None:
        out[f"{name}.weight"], out[f"{name}.bias"] = value(layer.kernel), value(layer.bias)

    for i, block in enumerate(model.h):  # in torch's order
        name = f"transformer.h.{i}"
        norm(block.ln_1, f"{name}.ln_1")
        out.update(fa.state_dict(block.attn, layout="gpt2", prefix=f"{name}.attn."))
        norm(block.ln_2, f"{name}.ln_2")
        conv1d(block.mlp.c_fc, f"{name}.mlp.c_fc")
        conv1d(block.mlp.c_proj, f"{name}.mlp.c_proj")
    norm(model.ln_f, "transformer.ln_f")
    return out


class _LazyTensors(Mapping):
    """The tensors of an open safetensors file, read one at a time when asked for."""

    def __init__(self, handle):
        self._handle = handle
        self._keys = list(handle.keys())

    def __getitem__(self, key):
        if key not in self._keys:
            raise KeyError(key)
        return self._handle.get_tensor(key)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self):
        return len(self._keys)

    def __contains__(self, key):
        return key in self._keys


def load_checkpoint(directory: str | os.PathLike, *, precision=None) -> GPT2:
    """A ``GPT2`` (in ``.eval()`` mode) from a Hugging Face checkpoint directory.

    Reads ``config.json`` and ``model.safetensors`` (one tensor at a time, layer by layer); the
    parameters are never randomly initialised, so an xl checkpoint needs only its own memory.
    """
    from safetensors import safe_open

    directory = pathlib.Path(directory)
    for name in ("config.json", "model.safetensors"):
        if not (directory / name).is_file():
            raise ValueError(
                f"checkpoint ({str(directory)!r}) must hold {name} (as save_pretrained writes it)"
            )
    config = GPT2Config.from_json(directory / "config.json")
    model = _skeleton(config, precision)
    with safe_open(directory / "model.safetensors", framework="numpy") as handle:
        _fill(model, _LazyTensors(handle))
    model.eval()
    return model


# ---- generation ---------------------------------------------------------------------------------


def _next_token(logits, key, temperature, greedy: bool, top_k: int | None):
    """``logits`` ``(b, V)`` -> ids ``(b,)``: argmax, or a draw at ``temperature`` among the
    ``top_k`` largest (all if ``None``)."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]  # (b, 1)
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def decode_steps(graphdef, cache, rest, token, keys, temperature, greedy, top_k):
    """``len(keys)`` decode steps in a ``lax.scan``, each feeding back the token it picked.

    ``cache``/``rest``: the model's ``nnx.Cache`` state and everything else (``nnx.split``);
    ``token`` ``(b,)`` the last token picked. Only the caches travel through the loop; the
    parameters are loop constants. Returns the new cache state and the tokens ``(len(keys), b)``.
    """

    def step(carry, step_key):
        cache, token = carry  # token: (b,)
        model = nnx.merge(graphdef, cache, rest)
        hidden = model.hidden_states(token[:, None], decode=True)[:, 0]  # (b, d)
        token = _next_token(model.head(hidden), step_key, temperature, greedy, top_k)
        return (nnx.state(model, nnx.Cache), token), token

    (cache, _), tokens = jax.lax.scan(step, (cache, token), keys)
    return cache, tokens


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "greedy", "top_k"))
def _generate(graphdef, cache, rest, ids, key, temperature, *, max_new_tokens, greedy, top_k):
    """Prefill ``ids`` ``(b, t)``, then ``max_new_tokens - 1`` decode steps."""
    model = nnx.merge(graphdef, cache, rest)
    keys = jax.random.split(key, max_new_tokens)
    hidden = model.hidden_states(ids, decode=True)[:, -1]  # (b, d): the last prompt position
    first = _next_token(model.head(hidden), keys[0], temperature, greedy, top_k)
    cache = nnx.state(model, nnx.Cache)
    _, tokens = decode_steps(
        graphdef, cache, rest, first, keys[1:], temperature, greedy, top_k
    )  # (N - 1, b)
    return jnp.concatenate([first[None], tokens], axis=0).T  # (b, N)


def _check_ids(prompt_ids, vocab_size: int) -> np.ndarray:
    if isinstance(prompt_ids, (list, tuple)):
        rows = [prompt_ids] if not prompt_ids or np.ndim(prompt_ids[0]) == 0 else prompt_ids
        lengths = sorted({len(row) for row in rows})
        if len(lengths) > 1:
            raise ValueError(
                f"prompt_ids rows have lengths {lengths}: a batch must have prompts of equal "
                "length (there is no padding; generate them separately or group by length)"
            )
        prompt_ids = rows
    ids = np.asarray(prompt_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"prompt_ids (shape {ids.shape}) must be (batch, tokens) with tokens > 0")
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"prompt_ids (dtype {ids.dtype}) must be integers")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(
            f"prompt_ids (range {ids.min()}..{ids.max()}) must lie in 0..{vocab_size - 1}"
        )
    return ids.astype(np.int32)


class CompiledGenerate:
    """``generate`` for one (batch, prompt length, new tokens, sampling mode), compiled ahead of
    time: ``compile_s`` is the compilation's wall time, and calls run only the executable."""

    def __init__(self, model, batch, prompt_len, max_new_tokens, *, greedy=True, top_k=None):
        config = model.config
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens ({max_new_tokens!r}) must be a positive int")
        if top_k is not None and not 1 <= top_k <= config.vocab_size:
            raise ValueError(f"top_k ({top_k}) must be in 1..{config.vocab_size}")
        length = prompt_len + max_new_tokens - 1  # the last new token is never fed back
        if length > config.n_positions:
            raise ValueError(
                f"prompt tokens + max_new_tokens - 1 ({prompt_len} + {max_new_tokens} - 1) "
                f"must not exceed n_positions ({config.n_positions})"
            )
        model.eval()
        model.init_cache(batch, length)
        self.graphdef, self.cache, self.rest = nnx.split(model, nnx.Cache, ...)
        self.shape = (batch, prompt_len)
        ids = jax.ShapeDtypeStruct(self.shape, jnp.int32)
        start = time.perf_counter()
        self._compiled = _generate.lower(
            self.graphdef, self.cache, self.rest, ids, jax.random.key(0), jnp.float32(1.0),
            max_new_tokens=max_new_tokens, greedy=greedy, top_k=top_k,
        ).compile()  # fmt: skip
        self.compile_s = time.perf_counter() - start

    def __call__(self, ids, key=None, temperature=1.0):
        """New ids ``(b, N)`` after ``ids`` ``(b, t)`` (a fresh cache on every call)."""
        key = jax.random.key(0) if key is None else key
        return self._compiled(self.cache, self.rest, ids, key, jnp.float32(temperature))


def compile_generate(model, batch, prompt_len, max_new_tokens, *, greedy=True, top_k=None):
    """See ``CompiledGenerate``."""
    return CompiledGenerate(model, batch, prompt_len, max_new_tokens, greedy=greedy, top_k=top_k)


def generate(model: GPT2, prompt_ids, max_new_tokens: int, *, key=None, temperature=None,
             top_k=None) -> jax.Array:  # fmt: skip
    """``max_new_tokens`` new ids ``(b, N)`` after ``prompt_ids`` ``(b, t)`` (or one ``(t,)``).

    Greedy when ``temperature`` is ``None`` or 0 (``key`` unused); otherwise a draw from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits, from ``key``
    (a ``jax.random.key``, required). Rows of unequal length are a ``ValueError``.
    """
    ids = _check_ids(prompt_ids, model.config.vocab_size)
    greedy = temperature is None or temperature == 0
    if not greedy:
        if not temperature > 0:
            raise ValueError(f"temperature ({temperature}) must be > 0 (or None/0 for greedy)")
        if key is None:
            raise ValueError("key (None) must be a jax.random.key when sampling (temperature > 0)")
    run = compile_generate(model, *ids.shape, max_new_tokens, greedy=greedy, top_k=top_k)
    return run(jnp.asarray(ids), key, 1.0 if greedy else temperature)


# ---- command line -------------------------------------------------------------------------------


def _tokenizer(directory: pathlib.Path):
    """The checkpoint's own tokenizer (``tokenizer.json``, or ``vocab.json`` + ``merges.txt``)."""
    import tokenizers

    if (directory / "tokenizer.json").is_file():
        return tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    if (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
        return tokenizers.ByteLevelBPETokenizer(
            str(directory / "vocab.json"), str(directory / "merges.txt")
        )
    return None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python examples/gpt2.py",
        description="Generate with a Hugging Face GPT-2 checkpoint on flax_attention layers.",
    )
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="directory with config.json and model.safetensors")  # fmt: skip
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", metavar="TEXT", help="text, through the checkpoint's tokenizer")
    source.add_argument("--prompt-ids", metavar="IDS", help="token ids, e.g. 464,3290,318")
    parser.add_argument("--max-new-tokens", type=int, required=True, metavar="N")
    parser.add_argument("--batch", type=int, default=1, metavar="B", help="rows (the same prompt)")
    parser.add_argument("--json", metavar="PATH", help="write tokens and timings as JSON")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy; > 0: sample")  # fmt: skip
    parser.add_argument("--top-k", type=int, default=None, metavar="K",
                        help="sample among the K most likely tokens")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="jax.random.key seed for sampling")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    directory = pathlib.Path(args.checkpoint)
    if args.batch < 1:
        raise ValueError(f"--batch ({args.batch}) must be a positive int")
    tokenizer = _tokenizer(directory) if directory.is_dir() else None
    if args.prompt is not None:
        if tokenizer is None:
            raise ValueError(
                f"--prompt needs tokenizer.json (or vocab.json and merges.txt) in --checkpoint "
                f"({str(directory)!r}); none found: pass --prompt-ids instead"
            )
        prompt = tokenizer.encode(args.prompt).ids
    else:
        try:
            prompt = [int(part) for part in args.prompt_ids.split(",") if part.strip()]
        except ValueError:
            raise ValueError(
                f"--prompt-ids ({args.prompt_ids!r}) must be comma-separated integers"
            ) from None
    model = load_checkpoint(directory)
    ids = _check_ids([prompt] * args.batch, model.config.vocab_size)
    greedy = args.temperature == 0
    if args.temperature < 0:
        raise ValueError(f"--temperature ({args.temperature}) must be >= 0")
    run = compile_generate(model, *ids.shape, args.max_new_tokens, greedy=greedy, top_k=args.top_k)
    ids = jnp.asarray(ids)
    key = jax.random.key(args.seed)
    temperature = 1.0 if greedy else args.temperature
    start = time.perf_counter()
    new_ids = np.asarray(jax.block_until_ready(run(ids, key, temperature)))
    generate_s = time.perf_counter() - start
    prefill = compile_generate(model, *ids.shape, 1, greedy=greedy, top_k=args.top_k)
    jax.block_until_ready(prefill(ids, key, temperature))  # warm
    start = time.perf_counter()
    jax.block_until_ready(prefill(ids, key, temperature))
    prefill_ms = 1e3 * (time.perf_counter() - start)
    tokens_per_s = new_ids.size / generate_s
    for row in new_ids.tolist():
        print(tokenizer.decode(prompt + row) if tokenizer is not None else row)
    print(
        f"{new_ids.size} new tokens in {generate_s:.3f} s ({tokens_per_s:.1f} tokens/s over the "
        f"batch); prefill {prefill_ms:.1f} ms; compile {run.compile_s:.2f} s",
        file=sys.stderr,
    )
    if args.json:
        result = {
            "tokens": new_ids.tolist(),
            "prefill_ms": prefill_ms,
            "tokens_per_s": tokens_per_s,
            "compile_s": run.compile_s,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
