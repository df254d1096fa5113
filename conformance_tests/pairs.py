"""Pairs: one torch module and one Flax module with the same weights, the data they run on, and
how to call either, all read from the layer's ``LayerSpec`` (no branch on a layer's name).

- ``build_pair(case, workdir, ...)``: torch makes the weights from ``case.seed``; both sides load
  them from one safetensors file (the one pair builder).
- ``make_inputs(case)``, ``make_mask(case, inputs)``: the case's data as NumPy.
- ``call_torch``/``call_flax``: every output (returned and kept), in ``LayerSpec.output_names``
  order; ``flax_forward`` is ``call_flax`` under one cached ``jax.jit``.
- ``Subject``: what a check runs on (a pair factory, its layer description, inputs and mask);
  ``subject_of(case, workdir)`` makes one from a spec case, ``parity.py`` from a user's pair.
"""

from __future__ import annotations

import functools
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.torch import save_file as torch_save_file

import flax_attention as fa
import torch_reference as tr
from conformance_tests.documents import INPUTS
from conformance_tests.layers import LayerSpec
from conformance_tests.spec import DOCUMENTS, DOCUMENTS_BATCH, Case

__all__ = [
    "DTYPES",
    "Subject",
    "build_pair",
    "call_flax",
    "call_torch",
    "constructor_args",
    "export_of",
    "flax_forward",
    "is_integer",
    "make_inputs",
    "make_mask",
    "mesh_skip_reason",
    "named",
    "output_names",
    "prepare",
    "rng",
    "subject_of",
    "to_torch",
]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def rng(case, salt: str) -> np.random.Generator:
    """The NumPy generator for ``salt`` (inputs, mask, cotangent, ...) of a case or subject:
    seeded by its ``seed`` and ``name``."""
    return np.random.default_rng([case.seed, zlib.crc32(f"{case.name}/{salt}".encode())])


# ---- data -------------------------------------------------------------------------------------


def make_inputs(case: Case) -> list[np.ndarray]:
    """The case's positional inputs as float32 NumPy arrays (standard normal unless documents)."""
    if case.inputs == DOCUMENTS:
        return [INPUTS.copy()]
    if case.inputs == DOCUMENTS_BATCH:
        return [np.stack([INPUTS, INPUTS])]
    generator = rng(case, "inputs")
    return [generator.standard_normal(shape).astype(np.float32) for shape in case.inputs]


def make_mask(case: Case, inputs) -> np.ndarray | None:
    """The case's mask (``1`` = attend), shaped as spec.py says, or ``None``."""
    if case.mask is None:
        return None
    layer = case.layer_spec
    query, key = inputs[0], inputs[layer.key_inputs[0]]
    lead, t, s = query.shape[:-2], query.shape[-2], key.shape[-2]
    if case.mask == "causal":
        mask = np.tril(np.ones((t, s), np.float32))[None]  # (1, t, s)
    elif case.mask == "fully_masked_row":
        mask = np.broadcast_to(np.tril(np.ones((t, s), np.float32)), (query.shape[0], t, s))
        mask = mask.copy()
        mask[0, 0, :] = 0.0  # (b, t, s), row 0 of batch 0 sees nothing
    elif case.mask == "padding":
        keep = rng(case, "mask").integers(1, s + 1, size=query.shape[0])  # >= 1 key kept
        mask = (np.arange(s)[None, :] < keep[:, None]).astype(np.float32)[:, None]  # (b, 1, s)
    else:
        raise ValueError(f"case.mask ({case.mask!r}) must be causal, padding or fully_masked_row")
    if layer.mask_over_heads:  # (b, t, s) -> (b, 1, t, s): broadcast over the inputs' heads
        mask = mask.reshape(mask.shape[0], *([1] * (len(lead) - 1)), *mask.shape[1:])
    return mask


# ---- the pair ---------------------------------------------------------------------------------


def constructor_args(case: Case, dropout: float | None = None) -> tuple:
    """The case's constructor arguments, with the dropout rate replaced by ``dropout``."""
    args = list(case.args)
    if dropout is not None:
        index = case.layer_spec.dropout_arg
        if index is None:
            raise ValueError(f"dropout ({dropout}) needs a layer with dropout ({case.layer})")
        args[index] = dropout
    return tuple(args)


def build_pair(
    case: Case,
    workdir: str | None,
    *,
    dropout: float | None = None,
    dtype="float32",
    dropout_seed=None,
    mesh=None,
    distinct_clones: bool = False,
    draws: bool = False,
):
    """torch makes the weights from ``case.seed``; both sides load them from one safetensors file.

    Returns ``(torch_module, flax_module)`` in eval mode, or the two functions for a function case.
    With a ``mesh``, the Flax module is placed on it by ``flax_attention.shard``.

    For the tests: ``workdir=None`` hands the weights over in memory (``load_state_dict``)
    instead of through a file; ``distinct_clones`` re-initialises the sublayers that the torch
    constructor deep-copies (``LayerSpec.equal_clones``: the annotated-transformer post's four
    projections start equal), so each has its own weights.

    The Flax side is built with ``nnx.eval_shape`` (nothing initialised, no random draw to
    compile: every weight comes from torch), its dropout then without a key; ``draws=True``
    builds it in full, for a dropout that draws its own masks.
    """
    if case.is_function:
        return getattr(tr, case.layer), getattr(fa, case.layer)
    args = constructor_args(case, dropout)
    torch.manual_seed(case.seed)
    kwargs = dict(case.kwargs)
    torch_module = getattr(tr, case.layer)(*args, **kwargs).eval()
    clones = case.layer_spec.equal_clones
    if distinct_clones and clones is not None:
        for clone in getattr(torch_module, clones):
            clone.reset_parameters()
    rngs = dict(params=case.seed, dropout=case.seed if dropout_seed is None else dropout_seed)

    def make_flax():
        return getattr(fa, case.layer)(*args, **kwargs, dtype=DTYPES[dtype], rngs=nnx.Rngs(**rngs))

    flax_module = make_flax() if draws else nnx.eval_shape(make_flax)
    if mesh is not None:  # before the load, which then places each weight where it goes
        fa.shard(flax_module, mesh)
    if workdir is None:
        state = {k: v.numpy() for k, v in torch_module.state_dict().items()}
        fa.load_state_dict(flax_module, state, strict=True)
    else:
        path = os.path.join(workdir, f"{case.name}.safetensors")
        torch_save_file(torch_module.state_dict(), path)
        fa.load_file(flax_module, path, strict=True)
    flax_module.eval()
    return torch_module, flax_module


def mesh_skip_reason(case: Case, backend) -> str | None:
    """Why ``case`` cannot run on ``backend.mesh`` (a layer size that does not divide over the
    mesh's ``model`` axis, as ``flax_attention.shard`` would say), or ``None``."""
    if backend.mesh is None or case.is_function:
        return None
    module = getattr(fa, case.layer)(*constructor_args(case), **dict(case.kwargs), rngs=nnx.Rngs(0))
    try:
        fa.sharding.check_shardable(module, backend.mesh)
    except ValueError as error:
        return str(error)
    return None


# ---- calling both sides -----------------------------------------------------------------------
#
# ``described`` is anything with a ``layer_spec`` (a ``LayerSpec``) and ``call_args`` (trailing
# positional call arguments): a spec ``Case`` or a ``Subject``.


def output_names(described) -> tuple[str, ...]:
    return described.layer_spec.output_names


def _call(described, module, inputs, mask, adapt=None) -> tuple:
    layer: LayerSpec = described.layer_spec
    args = [*inputs, *([mask] if layer.takes_mask else []), *described.call_args]
    out = module(*args)
    out = out if adapt is None else adapt(out)
    return out if isinstance(out, tuple) else (out,)


def call_torch(described, module, inputs, mask) -> tuple:
    """Every output of the torch side: the returned ones (through the subject's
    ``torch_output``, if any), then the kept attributes."""
    out = _call(described, module, inputs, mask, getattr(described, "torch_output", None))
    return out + tuple(getattr(module, name) for name in described.layer_spec.kept_outputs)


def call_flax(described, module, inputs, mask) -> tuple:
    """Every output of the Flax side: the returned ones, then each kept attribute that the
    layer keeps (its ``keep_<name>`` option, where it has one, is true)."""
    out = _call(described, module, inputs, mask)
    kept = [
        getattr(module, name)[...]
        for name in described.layer_spec.kept_outputs
        if getattr(module, f"keep_{name}", True)
    ]
    return out + tuple(kept)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _jit_forward(layer, call_args, graphdef, state, inputs, mask):
    described = Subject("jit", layer, None, [], call_args=call_args)
    return call_flax(described, nnx.merge(graphdef, *state), inputs, mask)


def flax_forward(described, fm, inputs, mask=None) -> tuple:
    """``call_flax`` compiled once per layer, configuration and shape (one XLA compilation, not
    one per op; a later call with the same shapes hits the cache). Functions run eagerly."""
    if described.layer_spec.is_function:
        return call_flax(described, fm, inputs, mask)
    graphdef, *state = nnx.split(fm, nnx.Param, ...)
    layer, call_args = described.layer_spec, tuple(described.call_args)
    return _jit_forward(layer, call_args, graphdef, tuple(state), list(inputs), mask)


def named(described, outputs) -> dict:
    """``{output name: output}``, every output named."""
    return dict(zip(output_names(described), outputs, strict=True))


# ---- placing data -----------------------------------------------------------------------------


def to_torch(array, device, requires_grad=False):
    if array is None:
        return None
    tensor = torch.from_numpy(np.array(array, np.float32)).to(device)
    return tensor.requires_grad_(requires_grad)


def torch_on(module, device):
    return module.to(device) if isinstance(module, torch.nn.Module) else module


def _place(x, mesh, batched=True):
    """On a mesh: a batched input ``(b, ..., t, d)`` split over ``data`` when ``b`` divides,
    anything else (one unbatched sequence, a mask) replicated. Without a mesh: ``x``."""
    if mesh is None:
        return x
    data = dict(mesh.shape)["data"]
    split = batched and x.ndim >= 3 and x.shape[0] % data == 0
    return jax.device_put(x, NamedSharding(mesh, PartitionSpec("data" if split else None)))


def is_integer(x) -> bool:
    """An integer input (token ids): kept as integers on both sides, with no gradient."""
    return np.issubdtype(np.asarray(x).dtype, np.integer)


def prepare(backend, inputs, mask, dtype="float32"):
    """Inputs and mask for both sides: torch float32 tensors, jax arrays in ``dtype``; integer
    inputs (token ids) stay integers."""
    t_inputs = [
        torch.from_numpy(np.asarray(x)).to(backend.torch_device)
        if is_integer(x)
        else to_torch(x, backend.torch_device)
        for x in inputs
    ]
    t_mask = to_torch(mask, backend.torch_device)
    f_inputs = [
        _place(jnp.asarray(x, None if is_integer(x) else DTYPES[dtype]), backend.mesh)
        for x in inputs
    ]
    f_mask = None if mask is None else _place(jnp.asarray(mask), backend.mesh, batched=False)
    return t_inputs, t_mask, f_inputs, f_mask


# ---- what a check runs on ---------------------------------------------------------------------


@dataclass
class Subject:
    """A pair to check, with everything a check needs and nothing about which layer it is.

    Attributes:
      name: the report's ``case`` column; with ``seed`` it seeds the cotangents, targets and
        perturbations (``rng``).
      layer_spec: how to call both sides (``layers.LayerSpec``).
      make_pair: ``(*, dtype="float32", dropout=None, dropout_seed=None, mesh=None,
        draws=False) -> (torch_module, flax_module)``: a fresh pair with the same weights, in
        eval mode; ``draws``: the Flax side's dropout can draw its own masks.
      inputs: the positional inputs (float32 NumPy; integer ones, token ids, stay integers and
        get no gradient).
      mask: the caller's mask (``1`` = attend) or ``None``.
      mask_kind: ``"causal"``, ``"padding"``, ``"fully_masked_row"`` or ``None`` (the mask check).
      call_args: trailing positional call arguments (a function's).
      dropout: the rate the dropout check builds the pair with.
      forward_key: the tolerance entry of the float32 forward check.
      export: ``flax_module -> {torch name: array}``, the names the torch side's parameters
        have (``flax_attention.state_dict``; another layout for a user's own pair).
      load: ``(flax_module, {torch name: array}) -> None``, loading some of them (non-strict).
      torch_output: what the torch module returns -> its output or tuple of outputs (a
        ``transformers`` model's ``ModelOutput`` -> ``out.logits``); ``None``: as returned.
      train_steps: the ``train`` check's optimiser steps.
      shift_invariant: torch name -> the slice of its last axis that cannot change the output
        (a fused ``c_attn.bias``'s key third): its gradient is rounding noise, which Adam scales
        up to steps of ``lr``, so the ``train`` check leaves that slice out of the trajectories.
    """

    name: str
    layer_spec: LayerSpec
    make_pair: Callable[..., tuple] | None
    inputs: list
    mask: np.ndarray | None = None
    mask_kind: str | None = None
    call_args: tuple = ()
    seed: int = 0
    dropout: float = 0.0
    forward_key: str = "forward"
    export: Callable = fa.state_dict
    load: Callable = functools.partial(fa.load_state_dict, strict=False)
    torch_output: Callable | None = None
    train_steps: int = 50
    shift_invariant: dict = field(default_factory=dict)


def export_of(described) -> Callable:
    """How ``described`` names the Flax side's parameters as torch's (a case: the documents')."""
    return getattr(described, "export", fa.state_dict)


def subject_of(case: Case, workdir: str) -> Subject:
    """The subject of a spec case: ``build_pair`` in ``workdir``, ``make_inputs``, ``make_mask``."""
    inputs = make_inputs(case)
    return Subject(
        name=case.name,
        layer_spec=case.layer_spec,
        make_pair=functools.partial(build_pair, case, workdir),
        inputs=inputs,
        mask=make_mask(case, inputs),
        mask_kind=case.mask,
        call_args=case.call_args,
        seed=case.seed,
        dropout=case.dropout,
        forward_key="forward:documents" if case.uses_documents_input else "forward",
    )
