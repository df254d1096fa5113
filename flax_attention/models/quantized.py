"""Int8 weights for inference: ``quantize(model, "int8")``.

``quantize`` returns a copy of a ``GPTModel`` (or ``Qwen3Model``, ``Llama3Model``) whose
``nnx.Linear`` layers (the attention projections, the MLP, an untied head) are ``Int8Linear``
and whose token embedding, when the head is tied to it, is ``Int8Embed`` (a mixture of experts'
stacked experts stay as they are): each weight matrix held as int8 with one float32 scale per
output feature (symmetric: ``scale = max|w| / 127`` over that feature's weights, ``q =
round(w / scale)``; a feature of zeros gets scale 1). Activations, biases, norms, the positional
embedding and the decode caches keep the model's dtypes; every product accumulates in float32.

Every product reads the int8 weights through the native narrow-weight kernel
(``flax_attention.kernels.native.narrow``), a quarter of float32's bytes: a decode step's few
rows widen each weight in registers, a prompt's many rows widen each block of weights once into
a float32 panel (XLA would first write the whole dequantized matrix). Machines without the
kernel, and products on a mesh, multiply by the dequantized matrix in XLA.
``flax_attention.state_dict(q)`` gives the dequantized weights in the model's names, so the
book's torch ``GPTModel`` loads them; quantizing a model that holds the dequantized weights
gives the same int8 values and scales.

A quantized model is for inference: taking a gradient through it (training it) is a
``TypeError`` that says so, as is loading a state dict into it (load the float model, then
quantize).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_attention._checks import check_choice, check_instance
from flax_attention._layers import narrow_product_ok
from flax_attention.layouts import Names, register

__all__ = ["SCHEMES", "Int8Embed", "Int8Linear", "Int8Weight", "WeightScale", "quantize"]

#: The schemes ``quantize`` takes.
SCHEMES = ("int8",)


class Int8Weight(nnx.Variable):
    """An int8 weight matrix, output features first (``Int8Linear.weight`` ``(out, in)``,
    ``Int8Embed.embedding`` ``(V, d)``); its module's ``scale`` (a ``WeightScale``) holds one
    float32 scale per output feature. Not an ``nnx.Param``: no optimiser trains it."""


class WeightScale(nnx.Variable):
    """The float32 scales of an ``Int8Weight``, one per output feature."""


def _quantize(w):
    """``(q int8, scale float32)`` of ``w`` ``(features, k)`` with one scale per row (output
    feature): ``scale = max|w| / 127`` over the row (1 where that is 0). In NumPy, on the host:
    IEEE float32 arithmetic, op by op, as written."""
    w = np.asarray(jax.device_get(w), np.float32)
    amax = np.max(np.abs(w), axis=1)  # (features,)
    # Quantizing the dequantized weights again gives this scale (and q) back: their max is
    # fl(127 * scale), and fl(fl(127 * fl(a / 127)) / 127) == fl(a / 127) for every normal
    # float32 a (the tests try every mantissa).
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return jnp.asarray(q), jnp.asarray(scale)


def _refuse_training(*_):
    raise TypeError(
        "a model quantized to int8 (flax_attention.models.quantize) cannot be trained or "
        "differentiated: train the float model, then quantize it"
    )


@jax.custom_vjp
def _int8_product(rows, q, scale):
    """``rows (m, k)`` times the dequantized ``q`` ``(n, k)`` transposed, float32 ``(m, n)``."""
    if narrow_product_ok(rows.shape[0], q):
        from flax_attention.kernels.native import narrow

        return narrow.matmul(rows, q, scale, nk=True)
    return rows.astype(jnp.float32) @ (q.astype(jnp.float32) * scale[:, None]).T


_int8_product.defvjp(
    lambda rows, q, scale: (_int8_product(rows, q, scale), None),
    lambda residuals, d_out: _refuse_training(),
)


def _product(x, q, scale, dtype):
    rows = x.reshape(-1, x.shape[-1])  # (m, k)
    out = _int8_product(rows, q, scale).astype(dtype)  # (m, n)
    return out.reshape(*x.shape[:-1], out.shape[-1])


class Int8Linear(nnx.Module):
    """An ``nnx.Linear`` held as an int8 ``weight`` ``(out, in)`` (torch's ``nn.Linear``
    layout, the transpose of the layer's ``kernel``) and ``scale`` ``(out,)``; the bias, dtype
    and call as the layer it replaces.

    Why ``(out, in)``: a decode step's product reads each output feature's weights as one
    contiguous run, which the kernel streams faster than the rows of an ``(in, out)`` kernel
    (GPT-2 small's layer products at one row: 2.7 against 4.0 ms a step,
    ``docs/performance.md``)."""

    def __init__(self, linear: nnx.Linear):
        q, scale = _quantize(linear.kernel[...].T)  # (out, in), a scale per row
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = Int8Weight(q)
        self.scale = WeightScale(scale)
        self.bias = linear.bias
        self.dtype, self.param_dtype = linear.dtype, linear.kernel[...].dtype

    def __call__(self, x, *, out_sharding=None):
        dtype = self.dtype or jnp.result_type(x, self.param_dtype)
        y = _product(x, self.weight[...], self.scale[...], dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(dtype).reshape((1,) * (y.ndim - 1) + (-1,))
        return y


class Int8Embed(nnx.Module):
    """An ``nnx.Embed`` whose ``embedding`` ``(V, d)`` is int8 with a ``scale`` per row, for a
    head tied to it: ``model(ids)`` looks rows up (times their scales), ``attend(x)`` is the
    tied head's ``x @ embedding.T``."""

    def __init__(self, embed: nnx.Embed):
        q, scale = _quantize(embed.embedding[...])
        self.num_embeddings, self.features = embed.num_embeddings, embed.features
        self.embedding = Int8Weight(q)
        self.scale = WeightScale(scale)
        self.dtype = embed.dtype or embed.embedding[...].dtype

    def __call__(self, ids, *, out_sharding=None):
        rows = jnp.take(self.embedding[...], ids, axis=0).astype(jnp.float32)  # (..., d)
        return (rows * jnp.take(self.scale[...], ids, axis=0)[..., None]).astype(self.dtype)

    def attend(self, x):
        return _product(x, self.embedding[...], self.scale[...], x.dtype)


# The bridge exports each int8 weight times its scales (the float weight it stands for).
register(Int8Linear, Names(dequantized=(("weight", "scale"),)))
register(Int8Embed, Names(dequantized=(("embedding", "scale"),)))


def _replace_linears(node) -> None:
    """Every ``nnx.Linear`` under ``node`` replaced in place by its ``Int8Linear``."""
    children = (
        list(enumerate(node))
        if isinstance(node, nnx.List)
        else [(name, value) for name, value in vars(node).items() if isinstance(value, nnx.Module)]
    )
    for name, child in children:
        if isinstance(child, nnx.Linear):
            replacement = Int8Linear(child)
            if isinstance(node, nnx.List):
                node[name] = replacement
            else:
                setattr(node, name, replacement)
        elif isinstance(child, nnx.Module):
            _replace_linears(child)


def quantize(model, scheme: str = "int8"):
    """A copy of ``model`` (a ``GPTModel``, ``Qwen3Model`` or ``Llama3Model``) with int8 weights
    (see the module's text); ``model`` is left as it is."""
    from flax_attention.models.gpt import DecoderModel

    check_choice("scheme", scheme, SCHEMES, "int8 weights")
    expected = "a flax_attention.models.GPTModel, Qwen3Model or Llama3Model"
    check_instance("model", model, DecoderModel, expected)
    if any(isinstance(node, (Int8Linear, Int8Embed)) for _, node in nnx.iter_graph(model)):
        raise ValueError("model is already quantized (it holds Int8Linear layers)")
    quantized = nnx.clone(model)
    _replace_linears(quantized)
    if quantized.out_head is None:  # tied: the head is the token embedding
        quantized.tok_emb = Int8Embed(quantized.tok_emb)
    return quantized
