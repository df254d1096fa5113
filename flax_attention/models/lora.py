"""Appendix E of the book: parameter-efficient fine-tuning with LoRA, in Flax NNX.

"Build a Large Language Model (From Scratch)" (Sebastian Raschka) ends with low-rank adaptation
(`appendix E <https://github.com/rasbt/LLMs-from-scratch/tree/main/appendix-E>`_; the package's
``pkg/llms_from_scratch/appendix_e.py``): every ``Linear`` of the chapter 6 model gets a trainable
update ``x @ A @ B`` of rank ``rank`` beside its frozen weight. The same three pieces here, with
the book's names, so the book's LoRA ``state_dict`` loads as it is:

=================================================  ============================================
book (torch)                                       here
=================================================  ============================================
``LoRALayer(in_dim, out_dim, rank, alpha)``:       ``LoRALayer(in_dim, out_dim, rank, alpha, *,
``A`` ``(in_dim, rank)``,                          rngs)``: ``A`` and ``B``, both
``kaiming_uniform_(A, a=sqrt(5))``; ``B`` zeros    ``nnx.LoRAParam``, drawn the same way
``(rank, out_dim)``
``forward``: ``(alpha / rank) * (x @ A @ B)``      ``__call__``: the same
``LinearWithLoRA(linear, rank, alpha)``:           ``LinearWithLoRA(linear, rank, alpha, *,
``linear(x) + lora(x)``                            rngs)``: the same
``replace_linear_with_lora(model, rank, alpha)``:  ``replace_linear_with_lora(model, rank, alpha,
every ``nn.Linear`` under ``model`` wrapped,       *, rngs)``: every ``nnx.Linear``, in place
in place (``named_children``, recursively)
(no counterpart)                                   ``merge_lora(model)``: each update folded into
                                                   its base weight, for inference
=================================================  ============================================

The book freezes the model (``requires_grad = False``) before it adds the LoRA layers, so that
only ``A`` and ``B`` train. Here nothing is frozen: ``A`` and ``B`` are ``nnx.LoRAParam`` (a kind
of ``nnx.Param``), and an optimiser built with ``wrt=nnx.LoRAParam`` trains them alone
(``nnx.Optimizer(model, optax.adamw(8e-4, weight_decay=0.1), wrt=nnx.LoRAParam)``, the book's
``AdamW`` of appendix E); ``wrt=nnx.Param`` would train the base weights too.

The scale is ``alpha / rank``, as the book's code has had it since September 2025 (the printed
chapter scaled by ``alpha`` alone; with ``rank == alpha``, as the book runs it, that is a factor
``rank`` apart). ``A`` is drawn as torch's ``kaiming_uniform_(a=sqrt(5))`` draws an ``(in_dim,
rank)`` tensor: torch takes a 2-D tensor's fan-in from its second axis, here ``rank``, so ``A``
is uniform in ``+-1/sqrt(rank)`` (not ``+-1/sqrt(in_dim)``, as an ``nn.Linear`` weight is).

State dict names (``flax_attention.load_state_dict``/``state_dict``): a wrapped layer's weight
moves under ``linear`` and its update under ``lora``: ``trf_blocks.0.att.W_query.linear.weight``,
``trf_blocks.0.att.W_query.lora.A`` ``(in_dim, rank)``, ``...W_query.lora.B`` ``(rank,
out_dim)``, as the book's ``model.state_dict()`` after ``replace_linear_with_lora``. A LoRA model
has names in the book's layout only; ``merge_lora`` gives back the plain model and all its
layouts (GPT-2's included). Both rules are this module's, given to the weight bridge through
``LoRALayer``'s registration (``flax_attention.layouts.Names``' ``layout_refusal`` and
``load_hint``): a peer's layout for a LoRA model is refused naming ``merge_lora``, and a LoRA
state dict offered to a model without LoRA layers (or the converse) says so in the error's first
line.

Shape legend: ``...`` leading axes (batch, tokens), ``d_in`` = ``in_dim``, ``r`` = ``rank``,
``d_out`` = ``out_dim``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from flax_attention._checks import check_instance, check_positive_int, check_real
from flax_attention._layers import rows_dot_general
from flax_attention.layouts import Names, register

__all__ = [
    "LinearWithLoRA",
    "LoRALayer",
    "merge_lora",
    "replace_linear_with_lora",
    "torch_kaiming_uniform_a_sqrt5",
]


def _rows(x) -> tuple:
    """``x (..., k) @ w (k, n)``: contract the input's last axis with the matrix's first."""
    return ((x.ndim - 1,), (0,)), ((), ())


def torch_kaiming_uniform_a_sqrt5(key, shape, dtype=jnp.float32):
    """``torch.nn.init.kaiming_uniform_(tensor, a=math.sqrt(5))`` of a 2-D ``shape``: uniform in
    ``+-gain * sqrt(3 / fan_in)`` with ``gain = sqrt(2 / (1 + 5))`` and torch's fan-in of a 2-D
    tensor, ``shape[1]``: ``+-1 / sqrt(shape[1])``."""
    bound = 1.0 / math.sqrt(shape[1])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def _check_alpha(alpha) -> None:
    check_real("alpha", alpha, finite=True, why="the update's scale is alpha / rank")


def _check_rngs(rngs) -> None:
    check_instance("rngs", rngs, nnx.Rngs, "an nnx.Rngs (e.g. nnx.Rngs(0))")


class LoRALayer(nnx.Module):
    """The book's ``LoRALayer``: ``x`` ``(..., in_dim)`` -> ``(alpha / rank) * (x @ A @ B)``
    ``(..., out_dim)``.

    Args:
      in_dim, out_dim: the features of the ``Linear`` it adapts.
      rank: the inner size of ``A`` ``(in_dim, rank)`` and ``B`` ``(rank, out_dim)``, an int >= 1.
      alpha: the scale of the update, a real number (the update is scaled by ``alpha / rank``).
      rngs: draws ``A`` (``rngs.params()``), as torch's ``kaiming_uniform_(a=sqrt(5))``; ``B``
        starts at zeros, so a new layer adds nothing.
      dtype, param_dtype, precision: as ``nnx.Linear``'s (``LinearWithLoRA`` passes the wrapped
        layer's).
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        rank: int,
        alpha: float,
        *,
        rngs: nnx.Rngs,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
    ):
        check_positive_int("in_dim", in_dim)
        check_positive_int("out_dim", out_dim)
        check_positive_int("rank", rank)
        _check_alpha(alpha)
        _check_rngs(rngs)
        draw = torch_kaiming_uniform_a_sqrt5(rngs.params(), (in_dim, rank), param_dtype)
        self.A = nnx.LoRAParam(draw)  # (d_in, r)
        self.B = nnx.LoRAParam(jnp.zeros((rank, out_dim), param_dtype))  # (r, d_out)
        self.alpha = alpha
        self.rank = rank
        self.dtype = dtype
        self.precision = precision

    @property
    def scaling(self) -> float:
        """``alpha / rank``, the factor of the update."""
        return self.alpha / self.rank

    def __call__(self, x, *, out_sharding=None):
        """``(alpha / rank) * (x @ A @ B)``; ``out_sharding`` as ``nnx.Linear``'s (an explicit
        mesh's layout of the result)."""
        dtype = self.dtype or jnp.result_type(x, self.A[...])
        x = x.astype(dtype)
        xa = rows_dot_general(x, self.A[...].astype(dtype), _rows(x), self.precision)  # (..., r)
        xab = rows_dot_general(
            xa, self.B[...].astype(dtype), _rows(xa), self.precision, out_sharding=out_sharding
        )  # (..., d_out)
        return (self.scaling * xab).astype(dtype)

    def delta(self) -> jax.Array:
        """The update as one matrix, ``(alpha / rank) * A @ B`` ``(in_dim, out_dim)`` (a Flax
        kernel's layout: torch's ``weight`` is its transpose), in at least float32."""
        wide = jnp.promote_types(self.A.dtype, jnp.float32)
        product = jnp.matmul(
            self.A[...].astype(wide), self.B[...].astype(wide), precision=jax.lax.Precision.HIGHEST
        )  # (d_in, d_out)
        return self.scaling * product


class LinearWithLoRA(nnx.Module):
    """The book's ``LinearWithLoRA``: ``linear(x) + lora(x)``.

    Args:
      linear: the ``nnx.Linear`` to adapt, kept as it is (``self.linear``).
      rank, alpha: the ``LoRALayer``'s (``self.lora``).
      rngs: draws the ``LoRALayer``'s ``A``.

    ``in_features`` and ``out_features`` are the wrapped layer's. ``merge()`` gives the wrapped
    ``nnx.Linear`` with the update folded into its kernel.
    """

    def __init__(self, linear: nnx.Linear, rank: int, alpha: float, *, rngs: nnx.Rngs):
        check_instance("linear", linear, nnx.Linear, "an nnx.Linear (the layer to adapt)")
        self.linear = linear
        self.lora = LoRALayer(
            linear.in_features,
            linear.out_features,
            rank,
            alpha,
            rngs=rngs,
            dtype=linear.dtype,
            param_dtype=linear.param_dtype,
            precision=linear.precision,
        )

    @property
    def in_features(self) -> int:
        return self.linear.in_features

    @property
    def out_features(self) -> int:
        return self.linear.out_features

    def __call__(self, x, *, out_sharding=None):
        """``linear(x) + lora(x)`` ``(..., out_features)``; ``out_sharding`` goes to both."""
        return self.linear(x, out_sharding=out_sharding) + self.lora(x, out_sharding=out_sharding)

    def merge(self) -> nnx.Linear:
        """``self.linear`` with ``(alpha / rank) * A @ B`` added to its kernel (in place, in at
        least float32, cast back to the kernel's dtype): a plain layer that computes what this
        one does, up to rounding. A layer wrapped twice is merged from the inside out."""
        if isinstance(self.linear, LinearWithLoRA):  # replace_linear_with_lora called twice
            self.linear = self.linear.merge()
        kernel = self.linear.kernel
        merged = (
            kernel[...].astype(jnp.promote_types(kernel.dtype, jnp.float32)) + self.lora.delta()
        )
        kernel.set_value(merged.astype(kernel.dtype))
        return self.linear


def _lora_keys(module: nnx.Module) -> list[str]:
    """The torch names of ``module``'s LoRA matrices (``nnx.LoRAParam``: appendix E's ``A`` and
    ``B``), in graph order."""
    return [
        ".".join(str(part) for part in path)
        for path, node in nnx.iter_graph(module)
        if isinstance(node, nnx.LoRAParam)
    ]


def _layout_refusal(module: nnx.Module, layout) -> str:
    """``Names.layout_refusal``: a module holding LoRA matrices has the book's appendix E names
    only, no peer's ``layout`` (a ``flax_attention.layouts.Layout``); ``""`` for one without."""
    lora = _lora_keys(module)
    if not lora:
        return ""
    return (
        f"layout ({layout.name!r}) must be 'documents' for a module with LoRA layers "
        f"({len(lora)} LoRA matrices, such as {lora[0]}: the "
        f"book's appendix E names them, {layout.peer} does not); "
        "flax_attention.models.lora.merge_lora(model) folds them into the plain model first"
    )


def _load_hint(module: nnx.Module, missing, unexpected, state_dict) -> str:
    """``Names.load_hint``: the line that says a LoRA model's state dict meets a model without
    LoRA layers (whatever its class: the hook is asked of every module), or a plain model's
    state dict a LoRA model; ``""`` otherwise."""
    offered = [k for k in unexpected if isinstance(k, str) and k.endswith(".lora.A")]
    if offered and not _lora_keys(module):
        shape = tuple(getattr(state_dict[offered[0]], "shape", ()))
        rank = shape[1] if len(shape) == 2 else "r"
        return (
            f"state_dict (a LoRA model's: {len(offered)} keys such as {offered[0]}, rank {rank}) "
            "must be loaded into a model with LoRA layers (call "
            f"flax_attention.models.lora.replace_linear_with_lora(model, rank={rank}, alpha=..., "
            "rngs=...) first)"
        )
    plain = [k for k in missing if k.endswith(".linear.weight")]
    if plain and plain[0].replace(".linear.weight", ".weight") in unexpected:
        return (
            f"state_dict (a model's without LoRA: {plain[0].replace('.linear.weight', '.weight')} "
            f"where this model has {plain[0]}) must be loaded before replace_linear_with_lora "
            "(load the base weights, then add the LoRA layers)"
        )
    return ""


# The book's appendix E names (linear.weight, lora.A, lora.B): the documents' layout only. The
# hooks, asked by the weight bridge of every module once this module is imported (as importing
# flax_attention.models does), are registered once, with LoRALayer (the LoRA matrices' holder).
register(LoRALayer, Names(layout_refusal=_layout_refusal, load_hint=_load_hint))
register(LinearWithLoRA, Names())


def _check_model(model) -> None:
    expected = "an nnx.Module (e.g. a GPTModel) whose nnx.Linear layers are to be replaced"
    check_instance("model", model, nnx.Module, expected)


def _set_child(parent: nnx.Module, key, child: nnx.Module) -> None:
    """``parent``'s child at ``key`` (an attribute's name, or an ``nnx.List``'s index) becomes
    ``child``: the book's ``setattr(model, name, ...)``."""
    if isinstance(key, int):
        parent[key] = child
    else:
        setattr(parent, key, child)


def replace_linear_with_lora(model: nnx.Module, rank: int, alpha: float, *, rngs: nnx.Rngs):
    """The book's ``replace_linear_with_lora``: every ``nnx.Linear`` among ``model``'s children
    becomes ``LinearWithLoRA(linear, rank, alpha, rngs=rngs)``, in place; every other child
    module is searched the same way, recursively. In ``GPTModel`` that is each attention layer's
    ``W_query``, ``W_key``, ``W_value`` and ``out_proj``, each ``ff.layers`` ``0`` and ``2``, and
    ``out_head`` (a tied head reads ``tok_emb`` and has none). Returns ``None``, as the book's.

    As the book's recursion, a second call wraps each wrapped layer's ``linear`` again. ``A`` is
    drawn from ``rngs.params()`` once per layer, in ``nnx.iter_children``'s order (the children
    sorted by name). A bad ``rank`` or ``alpha`` raises before anything is replaced."""
    _check_model(model)
    check_positive_int("rank", rank)
    _check_alpha(alpha)
    _check_rngs(rngs)
    for key, child in list(nnx.iter_children(model)):
        if isinstance(child, nnx.Linear):
            _set_child(model, key, LinearWithLoRA(child, rank, alpha, rngs=rngs))
        elif isinstance(child, nnx.Module):
            replace_linear_with_lora(child, rank, alpha, rngs=rngs)


def merge_lora(model: nnx.Module) -> None:
    """Fold every ``LinearWithLoRA`` under ``model`` into its ``nnx.Linear``, in place: the
    kernel gains ``(alpha / rank) * A @ B`` (``LinearWithLoRA.merge``) and the plain layer takes
    the wrapper's place, so the model computes what it did (up to rounding) with one product per
    layer, and its state dict is the plain model's again (the book's names without ``linear``
    and ``lora``; GPT-2's layout too). Returns ``None``; copy first (``nnx.clone(model)``) to
    keep the LoRA model."""
    _check_model(model)
    if isinstance(model, LinearWithLoRA):
        raise TypeError(
            "model (LinearWithLoRA) must hold its LoRA layers, not be one: merge_lora replaces "
            "each layer in its parent; layer.merge() gives this one merged"
        )
    for key, child in list(nnx.iter_children(model)):
        if isinstance(child, LinearWithLoRA):
            _set_child(model, key, child.merge())
        elif isinstance(child, nnx.Module):
            merge_lora(child)
