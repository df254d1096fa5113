"""Where a port departs: the first submodule whose output or gradients differ between a torch
model and its Flax port (``find_divergence``).

``assert_parity`` says *that* a whole model differs; this says *where*. Every submodule call of
the torch model is recorded (its inputs, its output, the gradients reaching both), and each
paired Flax submodule is then run twice:

- **given torch's inputs**: called on the very inputs torch's submodule received (converted;
  int64 ids as int32), so an error is measured where it arises, not where it has grown;
- **flowing**: as the Flax model runs itself, on its own activations (how far the error has
  grown by then).

A submodule *departs* when its error given torch's inputs exceeds the bound, by default the
report's forward rule ``tol * max(1, max|torch|)`` with ``tol`` from ``tolerances.py`` for the
dtype the Flax submodule computes in (1e-5 in float32, 6e-2 in bfloat16). ``first`` is the first
submodule, in torch's call order, that departs while none of the submodules called *inside its
call* departs: a wrong weight in a LayerNorm names the LayerNorm, not the block around it; a
block whose wiring is wrong while each of its children is right (a dropped shortcut) names the
block. Nesting is that of the calls, not of the names: the post's ``src_attn`` runs inside
``sublayer.1``'s call though it is its sibling by name.

With ``backward`` (the default) and every forward holding, the gradients of a fixed-cotangent
loss on the final output (``sum(output * cotangent)``, the cotangent seeded) are compared: every
parameter's (by torch name, gathered by the submodule that owns it), and at every call the
gradient reaching its output and the gradients it passes back to its inputs. ``first_grad`` is
the innermost call whose output's gradient holds while its own parameters' gradients or its
inputs' gradients depart, the last such in torch's call order (the first the backward pass
reaches); gradients are held to the same rule (``grad`` tolerance in float32), whose floor
``tol * 1`` absorbs the rounding noise of gradients that are exactly zero (a key bias's).

Pairing (torch's dotted name -> the Flax path): the root with the root; ``names`` (torch name
-> Flax path, a prefix rewriting everything under it); the same dotted names (``nnx.List``
children by index); then, for a Flax model of a registered class, the weight registry in
``layout`` (``"documents"`` by default; ``"gpt2"``: transformers' ``GPT2LMHeadModel``): a torch
submodule is paired with the outermost callable Flax submodule holding exactly the parameters
its weights load into (``h.0.mlp`` with ``trf_blocks.0.ff``, ``linears.0`` with
``proj_weights.0``). A torch submodule with no counterpart (GPT-2's fused ``c_attn``, an
activation module the port inlines, ``nn.Sequential`` whose Flax twin is an ``nnx.List``) is
compared as part of its nearest paired ancestor: ``report.merged`` lists them. A submodule called
several times is compared call by call (the k-th call with the k-th).

On the Flax side the paired submodules are intercepted while the finder runs, through their
class's ``__call__`` and ``_forward`` (what the package's blocks call on their attention: the
checked ``__call__`` without the checks), on copies of the model (``nnx.merge`` of its state):
neither model is changed, and no weight moves. Arrays are matched to torch's tensors in order,
by kind (floating or integer) and size; everything else a Flax call takes (its masks, a
``decode`` flag, the closure a ``SublayerConnection`` is given) is its own. Shapes that differ by
1-sized axes or by an order of axes (heads before tokens) are matched as such.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import itertools
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import flax_attention as fa
from conformance_tests.backends import torch_tf32
from conformance_tests.tolerances import tolerance
from flax_attention import weights as fa_weights
from flax_attention.layouts import LAYOUTS, TORCH_VARIABLES, names_of

__all__ = [
    "DivergenceReport",
    "DivergenceRow",
    "assert_no_divergence",
    "find_divergence",
    "main",
]

#: The methods of a Flax submodule through which its parent may call it: ``__call__``, and
#: ``_forward``, the attention layers' call without the input checks (the package's blocks).
ENTRY_METHODS = ("__call__", "_forward")

#: The backward pass's compilation on the CPU: LLVM without its optimisation passes and XLA's
#: elemental emitters (its default before the fusion emitters). The program is the same; it
#: compiles in a third of the time (1.2 s instead of 3.6 s for the post's small
#: encoder-decoder) and runs about as fast at the sizes a search runs (the conftest's
#: ``QUICK_CODEGEN``, as options of this one compilation).
QUICK_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}

#: How a torch module's dotted name is shown when it is the root.
ROOT = "(model)"


# ---- the report --------------------------------------------------------------------------------


@dataclasses.dataclass
class DivergenceRow:
    """One compared call: torch's ``name`` (``""``: the model) and its ``call`` (0 for the first
    call of that submodule), the paired Flax ``flax_path``, ``depth`` (paired calls around it),
    ``given_torch`` (max abs error of the Flax submodule called on torch's inputs), ``flowing``
    (its error as the Flax model ran itself), ``bound`` and ``passed`` (``given_torch <=
    bound``). Gradients (``None`` where not compared): ``grad`` (the worst error over its own
    parameters' gradients and its inputs' gradients, relative to its ``grad_bound``: the value
    shown is the absolute error of the worst), ``output_grad`` (the gradient reaching its output,
    flowing), ``grad_passed``. ``note``: what was not compared, or how."""

    name: str
    call: int
    flax_path: str
    depth: int
    given_torch: float
    flowing: float
    bound: float
    passed: bool
    grad: float | None = None
    grad_bound: float | None = None
    output_grad: float | None = None
    output_grad_bound: float | None = None
    grad_passed: bool | None = None
    note: str = ""

    def as_dict(self) -> dict:
        """The row's fields; a value not measured (NaN) or not measurable (infinite: shapes
        torch's cannot be read as) as ``None``, so that the JSON is strict."""
        return {
            k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in dataclasses.asdict(self).items()
        }


@dataclasses.dataclass
class DivergenceReport:
    """What ``find_divergence`` found.

    ``first``: torch's dotted name of the innermost submodule whose output departs given torch's
    inputs (``""`` the model itself), or ``None``. ``first_grad``: of the submodule whose own
    parameters' (or inputs') gradients depart while every forward holds, or ``None``. ``rows``:
    one ``DivergenceRow`` per compared call, in torch's call order. ``merged``: torch submodules
    with no Flax counterpart -> the paired ancestor they were compared in. ``params``: torch
    parameter name -> ``(error, bound)`` of its gradient. ``notes``: what else the finder says.
    ``str(report)`` is the table; ``to_json()`` the same as JSON."""

    first: str | None
    first_grad: str | None
    rows: list[DivergenceRow]
    merged: dict[str, str]
    params: dict[str, tuple[float, float]]
    notes: list[str]

    @property
    def departs(self) -> bool:
        """Whether anything departs (forward or gradients)."""
        return self.first is not None or self.first_grad is not None

    def as_dict(self) -> dict:
        return {
            "first": self.first,
            "first_grad": self.first_grad,
            "merged": dict(self.merged),
            "notes": list(self.notes),
            "rows": [row.as_dict() for row in self.rows],
            "params": {k: {"error": e, "bound": b} for k, (e, b) in self.params.items()},
        }

    def to_json(self, **options) -> str:
        """The report as a JSON document (``json.dumps`` options pass through)."""
        return json.dumps(self.as_dict(), **{"allow_nan": False, **options})

    def __str__(self) -> str:
        return format_report(self)


def _shown(name: str) -> str:
    return ROOT if name == "" else name


def _e(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def format_report(report: DivergenceReport) -> str:
    """The report as a table: one line per compared call, indented by its nesting (``=`` in the
    ``flax`` column: the same path as torch's name), the first departures marked ``<- first``
    and ``<- first_grad``; then the merged submodules and the notes."""
    compared = any(row.grad_passed is not None for row in report.rows)
    lines = [
        "first departure (forward, given torch's inputs): "
        + ("none" if report.first is None else _shown(report.first)),
        "first departure (gradients): "
        + (_shown(report.first_grad) if report.first_grad is not None else "none")
        + ("" if compared else " compared"),
    ]
    names = ["  " * row.depth + _shown(row.name) for row in report.rows]
    flax = ["=" if r.flax_path == r.name else _shown(r.flax_path) for r in report.rows]
    wide, flax_wide = max(map(len, names), default=12), max(map(len, flax), default=4)
    header = (
        f"{'torch module':<{wide}} {'call':>4} {'flax':<{flax_wide}} {'given torch':>11} "
        f"{'flowing':>9} {'bound':>8} {'grad':>9} {'grad bound':>10}  result"
    )
    lines += [header, "-" * len(header)]
    marks = {"first": report.first, "first_grad": report.first_grad}
    for name, path, row in zip(names, flax, report.rows):
        result = "-" if math.isnan(row.given_torch) else "ok" if row.passed else "DEPARTS"
        if row.grad_passed is False:
            result += " grad-departs"
        for mark, target in marks.items():
            departs = not row.passed if mark == "first" else row.grad_passed is False
            if target is not None and row.name == target and departs:
                result += f"  <- {mark}"
                marks[mark] = None  # marked once
        lines.append(
            f"{name:<{wide}} {row.call:>4} {path:<{flax_wide}} {_e(row.given_torch):>11} "
            f"{_e(row.flowing):>9} {_e(row.bound):>8} {_e(row.grad):>9} {_e(row.grad_bound):>10}"
            f"  {result}" + (f"  ({row.note})" if row.note else "")
        )
    if report.merged:
        folded = ", ".join(f"{k} -> {_shown(v)}" for k, v in report.merged.items())
        lines.append(f"merged (no Flax counterpart; compared in their ancestor): {folded}")
    lines += report.notes
    return "\n".join(lines)


# ---- arrays ------------------------------------------------------------------------------------


def _torch_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.float()
    return tensor.numpy().copy()


def _torch_leaves(value) -> list[torch.Tensor]:
    """The tensors of a torch module's return value in order (tuples, lists, mappings such as
    transformers' ``ModelOutput``); anything else is skipped."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [leaf for item in value.values() for leaf in _torch_leaves(item)]
    if isinstance(value, (tuple, list)):
        return [leaf for item in value for leaf in _torch_leaves(item)]
    return []


def _first_float_torch(value) -> torch.Tensor | None:
    return next((t for t in _torch_leaves(value) if t.is_floating_point()), None)


def _is_array(value) -> bool:
    return isinstance(value, (jax.Array, np.ndarray))


def _kind(dtype) -> str | None:
    """``"f"`` floating, ``"i"`` integer, ``None`` (bool and the rest): what is matched."""
    dtype = np.dtype(dtype) if not isinstance(dtype, torch.dtype) else dtype
    if isinstance(dtype, torch.dtype):
        if dtype.is_floating_point:
            return "f"
        return None if dtype == torch.bool or dtype.is_complex else "i"
    if jnp.issubdtype(dtype, jnp.floating):
        return "f"
    if jnp.issubdtype(dtype, jnp.integer):
        return "i"
    return None


def _first_float_leaf(value) -> tuple[int | None, list, Any]:
    """``(index, leaves, treedef)`` of a Flax return value; ``index`` of its first floating
    array (``None`` if none)."""
    leaves, treedef = jax.tree_util.tree_flatten(value)
    index = next(
        (i for i, leaf in enumerate(leaves) if _is_array(leaf) and _kind(leaf.dtype) == "f"),
        None,
    )
    return index, leaves, treedef


def _arrangements(source: tuple, target: tuple) -> list[Callable[[np.ndarray], np.ndarray]]:
    """The ways to read an array of shape ``source`` as one of ``target``: as it is; a reshape
    when they differ only by 1-sized axes; each order of axes that gives ``target`` (heads before
    tokens); else a reshape of the same size. Empty when the sizes differ."""
    source, target = tuple(source), tuple(target)
    if source == target:
        return [lambda a: a]
    if math.prod(source) != math.prod(target):
        return []
    if tuple(d for d in source if d != 1) == tuple(d for d in target if d != 1):
        return [lambda a: a.reshape(target)]
    orders = []
    if len(source) == len(target) and len(source) <= 6:
        orders = [
            p
            for p in itertools.permutations(range(len(source)))
            if tuple(source[i] for i in p) == target
        ]
    if orders:
        return [lambda a, p=p: np.transpose(a, p) for p in orders]
    return [lambda a: a.reshape(target)]


def _max_abs(got, want) -> float:
    """``max|got - want|``, in float32 (both sides' values are float32 or narrower: their
    difference is exact where they are close, which is where it matters)."""
    got = np.asarray(got).astype(np.float32, copy=False)
    want = np.asarray(want).astype(np.float32, copy=False)
    if got.size == 0:
        return 0.0
    return float(np.max(np.abs(got - want)))


def _compare(flax_value, torch_value: np.ndarray) -> tuple[float, int]:
    """``(error, arrangement)``: the smallest max abs error over the ways ``torch_value`` reads
    as ``flax_value``'s shape (``inf`` when none does)."""
    flax_value = np.asarray(flax_value)
    best, which = math.inf, 0
    for i, arrange in enumerate(_arrangements(torch_value.shape, flax_value.shape)):
        error = _max_abs(flax_value, arrange(torch_value))
        if error < best:
            best, which = error, i
    return best, which


def _scale(torch_value: np.ndarray) -> float:
    return max(1.0, float(np.max(np.abs(torch_value)))) if torch_value.size else 1.0


def _dtype_name(dtype) -> str:
    name = np.dtype(dtype).name
    return name if name in ("float32", "bfloat16", "float16") else "float32"


# ---- arguments ---------------------------------------------------------------------------------


def _describe(value) -> str:
    return type(value).__name__


def _check_callable(name: str, value) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{name} ({_describe(value)}) must be None or a callable (output -> array)")


def _check_tolerance(name: str, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} ({value!r}) must be None or a positive number (a tolerance)")
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name} ({value!r}) must be None or a positive number (a tolerance)")


def _as_numpy_input(index: int, value) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return _torch_numpy(value) if value.is_floating_point() else value.detach().cpu().numpy()
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"inputs[{index}] ({_describe(value)}) must be an array-like ({error})"
        ) from None
    if array.dtype == object:
        raise TypeError(f"inputs[{index}] ({_describe(value)}) must be an array-like of numbers")
    if _kind(array.dtype) == "f":
        array = array.astype(np.float32)
    return array


def _check_arity(inputs: list, torch_model, flax_model) -> None:
    """The inputs must bind to both models' signatures: a ``TypeError`` naming ``inputs``, how
    many were given and each signature otherwise."""
    for side, function in (
        ("torch_model.forward", torch_model.forward),
        (f"flax_model ({type(flax_model).__name__}.__call__)", flax_model.__call__),
    ):
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):
            continue
        try:
            signature.bind(*inputs)
        except TypeError as error:
            raise TypeError(
                f"inputs ({len(inputs)} arrays) must be the positional arguments of {side}"
                f"{signature} ({error})"
            ) from None


def _flax_training(flax_model) -> bool | None:
    """Whether the Flax model is in train mode (a dropout that draws not deterministic);
    ``None`` when no dropout of it draws (rate 0: no mode to tell)."""
    dropouts = [
        node
        for _, node in nnx.iter_graph(flax_model)
        if isinstance(node, nnx.Dropout) and node.rate > 0
    ]
    if not dropouts:
        return None
    return any(dropout.deterministic is False for dropout in dropouts)


def _check_modes(torch_model, flax_model) -> None:
    flax_training = _flax_training(flax_model)
    if flax_training is None or flax_training == torch_model.training:
        return
    mode = {True: "train", False: "eval"}
    raise ValueError(
        f"flax_model ({mode[flax_training]} mode) must be in the mode of torch_model "
        f"({mode[torch_model.training]} mode): call .eval() (or .train()) on both"
    )


def _check_layout(layout, flax_model) -> None:
    if layout is None:
        return
    if not isinstance(layout, str):
        raise TypeError(f"layout ({layout!r}) must be None or a layout name ({tuple(LAYOUTS)})")
    if layout not in LAYOUTS:
        raise ValueError(
            f"layout ({layout!r}) must be None or a registered layout ({tuple(LAYOUTS)})"
        )
    if names_of(flax_model) is None:
        raise ValueError(
            f"layout ({layout!r}) must be None for a flax_model of a class the weight bridge "
            f"does not know ({type(flax_model).__name__}): register it "
            "(flax_attention.layouts.register) or pair by names={torch name: flax path}"
        )
    fa_weights._layout(flax_model, layout)  # the bridge's own refusals (a class not taking it)


def _flax_modules(flax_model) -> dict[str, nnx.Module]:
    return {
        ".".join(str(p) for p in path): node
        for path, node in nnx.iter_graph(flax_model)
        if isinstance(node, nnx.Module)
    }


def _check_names(names, torch_modules: dict, flax_modules: dict) -> dict[str, str]:
    if names is None:
        return {}
    if not isinstance(names, Mapping):
        raise TypeError(
            f"names ({_describe(names)}) must be None or a mapping (torch name -> flax path)"
        )
    for torch_name, flax_path in names.items():
        if not isinstance(torch_name, str) or not isinstance(flax_path, str):
            raise TypeError(
                f"names[{torch_name!r}] ({flax_path!r}) must map a torch name (str) to a Flax "
                "path (str)"
            )
        if torch_name not in torch_modules:
            near = [n for n in torch_modules if n][:8]
            raise ValueError(
                f"names key {torch_name!r} must be a submodule of torch_model (torch_model has "
                f"no {torch_name!r}; its submodules include {near})"
            )
        if flax_path not in flax_modules:
            near = [p for p in flax_modules if p][:8]
            raise ValueError(
                f"names[{torch_name!r}] ({flax_path!r}) must be a submodule path of flax_model "
                f"(flax_model has no {flax_path!r}; its submodules include {near})"
            )
    return dict(names)


# ---- pairing -----------------------------------------------------------------------------------


def _rewrite(name: str, names: dict[str, str]) -> str | None:
    """``name`` under the longest entry of ``names`` that is it or a dotted prefix of it."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in names:
            rest = parts[cut:]
            return ".".join([p for p in [names[prefix], *rest] if p])
    return None


def _registry_params(flax_model, layout: str, torch_keys) -> dict[str, frozenset[str]]:
    """torch (layout) key -> the Flax parameter paths it loads into, as the weight bridge
    resolves them (``flax_attention.weights``); tied aliases and buffers left out."""
    spec = LAYOUTS[layout]
    targets = fa_weights._targets(flax_model, spec, tuple(torch_keys))
    paths = {
        id(node): ".".join(str(p) for p in path)
        for path, node in nnx.iter_graph(flax_model)
        if isinstance(node, nnx.Variable)
    }
    found = {}
    for key, target in targets.items():
        if target.buffer is not None or target.alias:
            continue
        parts = [part.entry.variable for part in target.parts if part.entry is not None]
        found[key] = frozenset(paths[id(v)] for v in parts if id(v) in paths)
    return found


def _pair(torch_model, flax_model, layout, names) -> tuple[dict[str, str], dict[str, str]]:
    """``(pairs, merged)``: torch name -> Flax path for every paired submodule; torch name ->
    its nearest paired ancestor for every other one."""
    torch_modules = dict(torch_model.named_modules())
    flax_modules = _flax_modules(flax_model)
    names = _check_names(names, torch_modules, flax_modules)
    usable = {p for p, m in flax_modules.items() if callable(m)}
    pairs, used = {"": ""}, {""}

    def take(torch_name, flax_path) -> bool:
        if flax_path in usable and flax_path not in used:
            pairs[torch_name] = flax_path
            used.add(flax_path)
            return True
        return False

    rest = [name for name in torch_modules if name]
    for name in rest:
        target = _rewrite(name, names) if names else None
        if target is not None:
            take(name, target)
    for name in rest:
        if name not in pairs:
            take(name, name)
    if names_of(flax_model) is not None:
        torch_keys = [k for k, _ in torch_model.named_parameters()]
        torch_keys += [k for k, _ in torch_model.named_buffers()]
        registry = _registry_params(flax_model, layout or "documents", torch_keys)
        owned = {
            path: frozenset(
                f"{path}.{'.'.join(str(p) for p in sub)}" if path else ".".join(map(str, sub))
                for sub, node in nnx.iter_graph(module)
                if isinstance(node, nnx.Param) and sub
            )
            for path, module in flax_modules.items()
        }
        for name in rest:
            if name in pairs:
                continue
            keys = [f"{name}.{k}" for k, _ in torch_modules[name].named_parameters()]
            if not keys or any(k not in registry for k in keys):
                continue
            wanted = frozenset().union(*(registry[k] for k in keys))
            candidates = sorted(
                (p for p, held in owned.items() if held == wanted and p in usable),
                key=lambda p: (p.count(".") + (p != ""), p),
            )
            for candidate in candidates:
                if take(name, candidate):
                    break
    merged = {name: _paired_ancestor(name, pairs) for name in rest if name not in pairs}
    return pairs, merged


def _paired_ancestor(name: str, pairs, inclusive: bool = False) -> str:
    """The nearest paired ancestor of torch's ``name`` (``name`` itself when ``inclusive``);
    ``""``, the model, at the latest."""
    parts = name.split(".")
    start = len(parts) if inclusive else len(parts) - 1
    for cut in range(start, 0, -1):
        if ".".join(parts[:cut]) in pairs:
            return ".".join(parts[:cut])
    return ""


# ---- torch's record ----------------------------------------------------------------------------


@dataclasses.dataclass
class _TorchCall:
    name: str
    call: int
    index: int
    paired: bool
    tensors: list = dataclasses.field(default_factory=list)  # [(key, np.ndarray)] in order
    takes_function: bool = False
    out: np.ndarray | None = None
    out_grad: np.ndarray | None = None
    in_grads: dict = dataclasses.field(default_factory=dict)  # key -> np.ndarray
    ancestors: tuple = ()


def _record_torch(torch_model, torch_inputs, pairs, torch_output, cotangent_seed, backward):
    """Run torch once with hooks on every submodule: each call's tensors, output and (with
    ``backward``) the gradients reaching its output and inputs; the parameters' gradients.
    The model's hooks and gradients are as before when it returns."""
    names = {id(module): name for name, module in torch_model.named_modules()}
    calls: list[_TorchCall] = []
    stack: list[_TorchCall] = []
    counts: dict[str, int] = {}
    handles = []

    def pre(module, args, kwargs):
        name = names[id(module)]
        call = _TorchCall(
            name,
            counts.get(name, 0),
            len(calls),
            name in pairs,
            ancestors=tuple(c.index for c in stack),
        )
        counts[name] = call.call + 1
        calls.append(call)
        stack.append(call)
        if not call.paired:
            return None
        new_args, new_kwargs = list(args), dict(kwargs)
        items = [(("arg", i), a) for i, a in enumerate(args)]
        items += [(("kw", k), v) for k, v in kwargs.items()]
        for key, value in items:
            if callable(value) and not isinstance(value, torch.Tensor):
                call.takes_function = True
            if not isinstance(value, torch.Tensor) or _kind(value.dtype) is None:
                continue
            call.tensors.append((key, _torch_numpy(value)))
            if backward and value.requires_grad and value.is_floating_point():
                copy = value.clone()  # a node of this call's own: its gradient is this call's

                def keep(grad, key=key, call=call):
                    call.in_grads[key] = _torch_numpy(grad)

                copy.register_hook(keep)
                if key[0] == "arg":
                    new_args[key[1]] = copy
                else:
                    new_kwargs[key[1]] = copy
        return tuple(new_args), new_kwargs

    def post(module, args, kwargs, output):
        call = stack.pop()
        if not call.paired:
            return None
        leaf = _first_float_torch(output)
        if leaf is not None:
            call.out = _torch_numpy(leaf)
            if backward and leaf.requires_grad and call.name:  # the model's: the cotangent

                def keep(grad, call=call):
                    call.out_grad = _torch_numpy(grad)

                leaf.register_hook(keep)
        return None

    saved = {p: p.grad for p in torch_model.parameters()}
    try:
        for module in torch_model.modules():
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post, with_kwargs=True))
        for p in saved:
            p.grad = None
        context = contextlib.nullcontext() if backward else torch.no_grad()
        with context:
            out = torch_model(*torch_inputs)
            final = torch_output(out) if torch_output is not None else out
            final = final if isinstance(final, torch.Tensor) else _first_float_torch(final)
            if final is None:
                raise ValueError(
                    f"torch_output ({type(out).__name__}) must give a floating tensor: the "
                    "model's output to compare (e.g. torch_output=lambda out: out.logits)"
                )
            final_value = _torch_numpy(final)
            calls[0].out = final_value  # the model's row: the output the caller compares
            cotangent = (
                np.random.default_rng(cotangent_seed)
                .standard_normal(final_value.shape)
                .astype(np.float32)
            )
            grads = {}
            if backward and final.requires_grad:
                (final * torch.from_numpy(cotangent).to(final.device, final.dtype)).sum().backward()
                for key, p in torch_model.named_parameters():
                    if p.requires_grad:
                        grads[key] = (
                            np.zeros(tuple(p.shape), np.float32)
                            if p.grad is None
                            else _torch_numpy(p.grad)
                        )
    finally:
        for handle in handles:
            handle.remove()
        for p, grad in saved.items():
            p.grad = grad
    return calls, final_value, cotangent, grads


# ---- the Flax side -----------------------------------------------------------------------------


def _module_at(model, path: str):
    module = model
    for part in path.split(".") if path else ():
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module


def _defines(cls, method: str) -> bool:
    """Whether ``cls`` or a base of it other than ``object`` defines ``method`` (a class's
    ``__call__`` attribute is otherwise its metaclass's, which builds instances)."""
    return any(method in base.__dict__ for base in cls.__mro__ if base is not object)


@contextlib.contextmanager
def _intercepted(classes, handler):
    """Each of ``classes``' entry methods (``ENTRY_METHODS``) routed through ``handler(module,
    original, args, kwargs)`` while inside; every class as it was on exit."""
    patched = [
        (cls, method, getattr(cls, method), method in cls.__dict__)
        for cls in classes
        for method in ENTRY_METHODS
        if _defines(cls, method)
    ]  # every original read before any class is patched (a subclass inherits its base's)
    try:
        for cls, method, original, _ in patched:

            def wrapper(module, *args, _original=original, **kwargs):
                return handler(module, _original, args, kwargs)

            setattr(cls, method, wrapper)
        yield
    finally:
        for cls, method, original, own in reversed(patched):
            if own:
                setattr(cls, method, original)
            else:
                delattr(cls, method)


def _paired_modules(model, pairs) -> dict[int, tuple[str, str]]:
    """``id(module) -> (Flax path, torch name)`` of ``model``'s paired submodules."""
    return {id(_module_at(model, path)): (path, name) for name, path in pairs.items()}


def _flax_arrays(args, kwargs) -> list:
    """``[(key, array)]``: the floating and integer arrays a Flax call takes, positional then
    keyword, in order."""
    items = [(("arg", i), a) for i, a in enumerate(args)]
    items += [(("kw", k), v) for k, v in kwargs.items()]
    return [(key, v) for key, v in items if _is_array(v) and _kind(v.dtype) is not None]


def _match(flax_arrays, torch_tensors) -> list:
    """``[(flax key, torch key, torch value)]``: each Flax array with the next torch tensor of
    its kind and size, in order."""
    matched, start = [], 0
    for key, value in flax_arrays:
        for j in range(start, len(torch_tensors)):
            torch_key, torch_value = torch_tensors[j]
            if _kind(torch_value.dtype) == _kind(value.dtype) and torch_value.size == value.size:
                matched.append((key, torch_key, torch_value))
                start = j + 1
                break
    return matched


def _with(args, kwargs, replaced: dict):
    args = list(args)
    kwargs = dict(kwargs)
    for key, value in replaced.items():
        if key[0] == "arg":
            args[key[1]] = value
        else:
            kwargs[key[1]] = value
    return args, kwargs


@dataclasses.dataclass
class _FlaxCall:
    path: str
    call: int
    flowing: float = math.nan
    given_torch: float = math.nan
    dtype: str = "float32"
    matched: list = dataclasses.field(default_factory=list)  # [(flax key, torch key)]
    note: str = ""


class _ForwardRun:
    """The Flax model run on its own (flowing), each paired call also run on torch's inputs."""

    def __init__(self, model, pairs, torch_calls):
        self.paths = _paired_modules(model, pairs)
        self.torch_calls = torch_calls
        self.counts: dict[str, int] = {}
        self.active: set[int] = set()
        self.suspended = False
        self.results: dict[tuple[str, int], _FlaxCall] = {}

    def __call__(self, module, original, args, kwargs):
        found = self.paths.get(id(module))
        if self.suspended or found is None or id(module) in self.active:
            return original(module, *args, **kwargs)
        path, torch_name = found
        self.active.add(id(module))
        try:
            k = self.counts.get(path, 0)
            self.counts[path] = k + 1
            out = original(module, *args, **kwargs)
            self._compare(path, torch_name, k, module, original, args, kwargs, out)
            return out
        finally:
            self.active.discard(id(module))

    def _compare(self, path, torch_name, k, module, original, args, kwargs, out):
        record = _FlaxCall(path, k)
        self.results[(path, k)] = record
        index, leaves, _ = _first_float_leaf(out)
        torch_call = self.torch_calls.get((torch_name, k))
        if index is None or torch_call is None or torch_call.out is None:
            record.note = "no output to compare" if torch_call is not None else ""
            return
        leaf = np.asarray(leaves[index])
        record.dtype = _dtype_name(leaves[index].dtype)
        record.flowing, _ = _compare(leaf, torch_call.out)
        matched = _match(_flax_arrays(args, kwargs), torch_call.tensors)
        options = []  # per matched argument: its torch value read as the Flax argument
        same = True
        for key, _, torch_value in matched:
            flax_value = args[key[1]] if key[0] == "arg" else kwargs[key[1]]
            readings = [
                jnp.asarray(arrange(torch_value), dtype=flax_value.dtype)
                for arrange in _arrangements(torch_value.shape, flax_value.shape)
            ]
            options.append(readings)
            same = same and len(readings) == 1 and np.array_equal(readings[0], flax_value)
        record.matched = [(key, torch_key) for key, torch_key, _ in matched]
        if not matched:
            record.note = "no array of it matched torch's inputs: its own"
        if same:  # torch's inputs are the Flax call's own (the model's ids): nothing to rerun
            record.given_torch = record.flowing
            return
        best = math.inf
        self.suspended = True
        try:
            for choice in itertools.islice(itertools.product(*[range(len(o)) for o in options]), 8):
                replaced = {m[0]: options[i][c] for i, (m, c) in enumerate(zip(matched, choice))}
                new_args, new_kwargs = _with(args, kwargs, replaced)
                again = original(module, *new_args, **new_kwargs)
                again_index, again_leaves, _ = _first_float_leaf(again)
                if again_index is None:
                    continue
                error, _ = _compare(np.asarray(again_leaves[again_index]), torch_call.out)
                best = min(best, error)  # of the readings of torch's shapes as the Flax ones
        finally:
            self.suspended = False
        record.given_torch = best


def _tap(store: dict, key):
    """An identity whose gradient is kept in ``store[key]`` as the backward pass meets it."""

    @jax.custom_vjp
    def identity(x):
        return x

    def forward(x):
        return x, None

    def backward(_, grad):
        jax.debug.callback(lambda g: store.__setitem__(key, np.asarray(g)), grad)
        return (grad,)

    identity.defvjp(forward, backward)
    return identity


class _BackwardRun:
    """The Flax model under ``jax.vjp``, each paired call's matched inputs and output tapped:
    the gradients reaching them are kept."""

    def __init__(self, model, pairs, forward: _ForwardRun):
        self.paths = {key: path for key, (path, _) in _paired_modules(model, pairs).items()}
        self.forward = forward
        self.counts: dict[str, int] = {}
        self.active: set[int] = set()
        self.store: dict = {}

    def __call__(self, module, original, args, kwargs):
        path = self.paths.get(id(module))
        if path is None or id(module) in self.active:
            return original(module, *args, **kwargs)
        self.active.add(id(module))
        try:
            k = self.counts.get(path, 0)
            self.counts[path] = k + 1
            record = self.forward.results.get((path, k))
            replaced = {}
            for key, _ in record.matched if record is not None else ():
                value = args[key[1]] if key[0] == "arg" else kwargs[key[1]]
                if _kind(value.dtype) == "f":
                    replaced[key] = _tap(self.store, (path, k, "in", key))(value)
            new_args, new_kwargs = _with(args, kwargs, replaced)
            out = original(module, *new_args, **new_kwargs)
            index, leaves, treedef = _first_float_leaf(out)
            if index is None:
                return out
            leaves[index] = _tap(self.store, (path, k, "out"))(leaves[index])
            return jax.tree_util.tree_unflatten(treedef, leaves)
        finally:
            self.active.discard(id(module))


def _gradient_export(model, layout, pairs) -> Callable[[nnx.State, set], dict]:
    """``export(grads, torch_keys) -> {torch name: np.ndarray}``: the parameters' gradients
    under torch's names, through the weight bridge for a registered class (in ``layout``: fused
    and transposed as torch holds them), else by path (nnx's ``kernel`` transposed as torch's
    ``weight``); a name torch does not have is rewritten through the pairs (Flax path -> torch
    name)."""
    graphdef, _, rest = nnx.split(model, _floating_param, ...)
    by_flax = sorted(((p, t) for t, p in pairs.items() if p), key=lambda x: -len(x[0]))

    def rename(key: str, torch_keys) -> str:
        if key in torch_keys:
            return key
        for flax_path, torch_name in by_flax:
            if key.startswith(flax_path + "."):
                return torch_name + key[len(flax_path) :]
        return key

    def export(grads, torch_keys) -> dict:
        if names_of(model) is not None:
            holder = nnx.merge(graphdef, grads, rest)
            keywords = {} if layout in (None, "documents") else {"layout": layout}
            state = fa.state_dict(holder, **keywords)
        else:
            state = {}
            for path, value in nnx.to_flat_state(grads):
                last = str(path[-1])
                torch_name, transpose = TORCH_VARIABLES.get(last, (last, False))
                array = np.asarray(value[...], np.float32)
                key = ".".join([*(str(p) for p in path[:-1]), torch_name])
                state[key] = array.T if transpose else array
        return {rename(k, torch_keys): np.asarray(v, np.float32) for k, v in state.items()}

    return export


def _floating_param(path, value) -> bool:
    return isinstance(value, nnx.Param) and jnp.issubdtype(
        jnp.asarray(value[...]).dtype, jnp.floating
    )


def _to_jax(value: np.ndarray) -> np.ndarray:
    """An input as the Flax model takes it: int64 ids as int32 (JAX's); NumPy, so that it stays
    concrete inside the compiled backward pass (the models check their ids' values)."""
    if _kind(value.dtype) == "i" and value.dtype.itemsize > 4:
        return value.astype(np.int32)
    return value


def _flax_final(out, flax_output):
    out = flax_output(out) if flax_output is not None else out
    index, leaves, _ = _first_float_leaf(out)
    if index is None:
        raise ValueError(
            f"flax_output ({type(out).__name__}) must give a floating array: the model's "
            "output to compare"
        )
    return leaves[index]


# ---- the finder --------------------------------------------------------------------------------


def find_divergence(
    torch_model: torch.nn.Module,
    flax_model: nnx.Module,
    inputs: Sequence,
    *,
    layout: str | None = None,
    names: Mapping[str, str] | None = None,
    torch_output: Callable | None = None,
    flax_output: Callable | None = None,
    backward: bool = True,
    rtol: float | None = None,
    grad_rtol: float | None = None,
    seed: int = 0,
) -> DivergenceReport:
    """Where the Flax port departs from the torch model, submodule by submodule.

    Args:
      torch_model, flax_model: the pair, holding the same weights (the finder moves none), in
        the same mode (eval, for dropout that does not draw).
      inputs: the positional inputs of both models (array-likes or torch tensors): token ids
        stay integers (int32 for JAX), masks bools, the rest float32.
      layout: the weight layout that names torch's parameters (a registered layout,
        ``"gpt2"`` for transformers' GPT-2; default ``"documents"``, the Flax model's own
        names), used to pair submodules renamed or fused by the port.
      names: torch dotted name -> Flax path, for a pair whose names differ (each rewrites the
        names under it: ``{"blocks": "layers"}`` pairs ``blocks.0.fc`` with ``layers.0.fc``).
      torch_output, flax_output: the model's return value -> the array to compare (default: the
        first floating tensor of it, ``logits`` of a transformers output).
      backward: also compare gradients (when every forward holds).
      rtol, grad_rtol: the forward and gradient tolerances (``None``: ``tolerances.py``'s
        ``forward`` and ``grad`` entries for the dtype each Flax submodule computes in; the
        bfloat16 gradients take the bfloat16 ``forward`` entry). An error is held to ``tol *
        max(1, max|torch|)``.
      seed: seeds the output's cotangent.

    Returns a ``DivergenceReport`` (``.first``, ``.first_grad``, ``.rows``; ``str()`` the
    table). Bad arguments are a ``TypeError`` or ``ValueError`` naming the argument, before any
    work: names that are not submodules, inputs the models do not take, an unregistered
    layout, models in different modes.
    """
    if not isinstance(torch_model, torch.nn.Module):
        raise TypeError(f"torch_model ({_describe(torch_model)}) must be a torch.nn.Module")
    if not isinstance(flax_model, nnx.Module):
        raise TypeError(f"flax_model ({_describe(flax_model)}) must be a flax.nnx.Module")
    if isinstance(inputs, (str, bytes, Mapping)) or not isinstance(inputs, Sequence):
        raise TypeError(
            f"inputs ({_describe(inputs)}) must be a list or tuple of the models' positional "
            "inputs (array-likes)"
        )
    _check_callable("torch_output", torch_output)
    _check_callable("flax_output", flax_output)
    if not isinstance(backward, bool):
        raise TypeError(f"backward ({backward!r}) must be a bool")
    _check_tolerance("rtol", rtol)
    _check_tolerance("grad_rtol", grad_rtol)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed ({seed!r}) must be an int")
    _check_layout(layout, flax_model)
    arrays = [_as_numpy_input(i, x) for i, x in enumerate(inputs)]
    _check_arity(arrays, torch_model, flax_model)
    _check_modes(torch_model, flax_model)
    pairs, merged = _pair(torch_model, flax_model, layout, names)

    options = dict(
        layout=layout,
        torch_output=torch_output,
        flax_output=flax_output,
        backward=backward,
        rtol=rtol,
        grad_rtol=grad_rtol,
        seed=seed,
    )
    with torch_tf32(False), jax.default_matmul_precision("highest"):
        return _Finder(torch_model, flax_model, arrays, pairs, merged, options).run()


class _Finder:
    """One search: torch's record, the Flax runs, the rows (``run``)."""

    def __init__(self, torch_model, flax_model, arrays, pairs, merged, options: dict):
        self.torch_model, self.flax_model = torch_model, flax_model
        self.arrays, self.pairs, self.merged = arrays, pairs, merged
        self.options = options
        self.notes: list[str] = []

    def run(self) -> DivergenceReport:
        options = self.options
        device = next((p.device for p in self.torch_model.parameters()), torch.device("cpu"))
        torch_inputs = [torch.from_numpy(a.copy()).to(device) for a in self.arrays]
        self.calls, final, self.cotangent, self.torch_grads = _record_torch(
            self.torch_model,
            torch_inputs,
            self.pairs,
            options["torch_output"],
            options["seed"],
            options["backward"],
        )
        self.flax_inputs = [_to_jax(a) for a in self.arrays]
        self._forward(final)
        rows = self._rows()
        first = _innermost_first(self.paired_calls, lambda call: not rows[call.index].passed)
        params: dict[str, tuple[float, float]] = {}
        first_grad = None
        if options["backward"] and first is None:
            first_grad = self._gradients(rows, params)
        elif options["backward"]:
            self.notes.append("gradients not compared: a forward departs (fix it first)")
        called = {c.name for c in self.calls}
        merged = {k: v for k, v in self.merged.items() if k in called}
        ordered = [rows[c.index] for c in self.paired_calls]
        return DivergenceReport(first, first_grad, ordered, merged, params, self.notes)

    def _forward(self, final: np.ndarray) -> None:
        """The flowing run, each paired call also run on torch's inputs (``_ForwardRun``), on a
        copy of the Flax model."""
        graphdef, self.state, self.rest = nnx.split(self.flax_model, _floating_param, ...)
        self.graphdef = graphdef
        model = nnx.merge(graphdef, self.state, self.rest)
        self.classes = list(dict.fromkeys(type(_module_at(model, p)) for p in self.pairs.values()))
        torch_calls = {(c.name, c.call): c for c in self.calls if c.paired}
        self.forward = _ForwardRun(model, self.pairs, torch_calls)
        with _intercepted(self.classes, self.forward):
            out = model(*self.flax_inputs)
        self.flax_final = np.asarray(_flax_final(out, self.options["flax_output"]))
        root = self.forward.results.get(("", 0))
        if root is not None and (self.options["torch_output"] or self.options["flax_output"]):
            root.flowing = root.given_torch = _compare(self.flax_final, final)[0]
        # a paired submodule the Flax model never calls (the attention's dropout, which the
        # attention core takes) is compared in its ancestor, as one with no counterpart
        flax_called = {path for path, _ in self.forward.results}
        torch_called = {c.name for c in self.calls}
        uncalled = [n for n in self.pairs if n in torch_called and self.pairs[n] not in flax_called]
        for name in uncalled:
            del self.pairs[name]
        for name in uncalled:
            self.merged[name] = _paired_ancestor(name, self.pairs)
        if uncalled:
            self.notes.append(
                "paired but never called by the Flax model (compared in their ancestor): "
                + ", ".join(uncalled)
            )
        for call in self.calls:
            call.paired = call.name in self.pairs
        self.paired_calls = [c for c in self.calls if c.paired]

    def _rows(self) -> dict[int, DivergenceRow]:
        """torch call index -> its row (forward columns)."""
        rtol, rows = self.options["rtol"], {}
        for call in self.paired_calls:
            path = self.pairs[call.name]
            record = self.forward.results.get((path, call.call))
            depth = sum(1 for a in call.ancestors if self.calls[a].paired)
            row = DivergenceRow(
                call.name, call.call, path, depth, math.nan, math.nan, math.nan, True
            )
            rows[call.index] = row
            if record is None or math.isnan(record.given_torch):
                row.note = "no such call on the Flax side" if record is None else record.note
                row.note = row.note or "no output to compare"
                continue
            tol = rtol if rtol is not None else tolerance(record.dtype, "forward")
            row.given_torch, row.flowing = record.given_torch, record.flowing
            row.bound = tol * _scale(call.out)
            row.passed = bool(record.given_torch <= row.bound)
            notes = [record.note] if record.note else []
            if math.isinf(record.given_torch):
                notes.append(f"its output's shape cannot be read as torch's {call.out.shape}")
            if call.takes_function:
                notes.append("called with a function: the Flax call's own")
            row.note = "; ".join(notes)
        return rows

    def _gradients(self, rows, found: dict) -> str | None:
        """The gradient columns of ``rows`` and ``found`` (torch parameter -> (error, bound));
        returns ``first_grad``."""
        readings = _arrangements(self.cotangent.shape, self.flax_final.shape)
        if not readings:
            self.notes.append("gradients not compared: the outputs' shapes differ")
            return None
        cotangent = jnp.asarray(readings[0](self.cotangent), self.flax_final.dtype)
        runs = []

        def grads_of(params, cotangent):
            def final_of(params):
                model = nnx.merge(self.graphdef, params, self.rest)
                runs.append(_BackwardRun(model, self.pairs, self.forward))
                with _intercepted(self.classes, runs[-1]):
                    out = model(*self.flax_inputs)
                return _flax_final(out, self.options["flax_output"])

            _, pullback = jax.vjp(final_of, params)
            return pullback(cotangent)[0]

        # one compiled program, whose taps call back as it runs: far fewer compilations than
        # the backward pass's operations one by one
        lowered = jax.jit(grads_of).lower(self.state, cotangent)
        quick = QUICK_COMPILE if jax.default_backend() == "cpu" else {}
        grads = lowered.compile(quick)(self.state, cotangent)
        store = runs[-1].store
        export = _gradient_export(self.flax_model, self.options["layout"], self.pairs)
        flax_grads = export(grads, set(self.torch_grads))
        dtype = _dtype_name(self.flax_final.dtype)
        tol = self.options["grad_rtol"]
        if tol is None:
            tol = (
                tolerance("float32", "grad") if dtype == "float32" else tolerance(dtype, "forward")
            )

        def held(got, want) -> tuple[float, float]:
            return _compare(got, want)[0], tol * _scale(want)

        for key, want in self.torch_grads.items():
            if key in flax_grads:
                found[key] = held(flax_grads[key], want)
            else:
                self.notes.append(f"parameter {key}: no Flax gradient of that name")
        own: dict[str, tuple[float, float]] = {}  # paired submodule -> its worst parameter
        owner = {k: _paired_ancestor(k.rpartition(".")[0], self.pairs, True) for k in found}
        for key, (error, bound) in found.items():
            worst = own.get(owner[key])
            if worst is None or error / bound > worst[0] / worst[1]:
                own[owner[key]] = (error, bound)
        arises = set()
        for call in self.paired_calls:
            row, path = rows[call.index], self.pairs[call.name]
            if (path, call.call) not in self.forward.results:
                continue
            if call.out_grad is not None:
                got = store.get((path, call.call, "out"), np.zeros_like(call.out_grad))
                row.output_grad, row.output_grad_bound = held(got, call.out_grad)
            worst = own.get(call.name)
            for flax_key, torch_key in self.forward.results[(path, call.call)].matched:
                want = call.in_grads.get(torch_key)
                if want is not None:
                    got = store.get((path, call.call, "in", flax_key), np.zeros_like(want))
                    error, bound = held(got, want)
                    if worst is None or error / bound > worst[0] / worst[1]:
                        worst = (error, bound)
            if worst is not None:
                row.grad, row.grad_bound = worst
            out_ok = row.output_grad is None or row.output_grad <= row.output_grad_bound
            own_ok = worst is None or worst[0] <= worst[1]
            row.grad_passed = out_ok and own_ok
            if out_ok and not own_ok:
                arises.add(call.index)
        inside = {a for c in self.paired_calls if c.index in arises for a in c.ancestors}
        innermost = [c for c in self.paired_calls if c.index in arises and c.index not in inside]
        if innermost:
            return innermost[-1].name  # the last in torch's call order: the first backwards
        departing = [k for k, (error, bound) in found.items() if error > bound]
        if departing:  # a parameter of a submodule never called (torch's gradient: zeros)
            return owner[departing[0]]
        return None


def _innermost_first(paired_calls, departs) -> str | None:
    """The torch name of the first call, in torch's call order, that departs while no paired
    call inside its call does."""
    departing = {c.index for c in paired_calls if departs(c)}
    inside = {a for c in paired_calls if c.index in departing for a in c.ancestors}
    for call in paired_calls:
        if call.index in departing and call.index not in inside:
            return call.name
    return None


def assert_no_divergence(torch_model, flax_model, inputs, **options) -> DivergenceReport:
    """``find_divergence``, raising ``AssertionError`` with the report's table when anything
    departs (forward or gradients); returns the report otherwise."""
    report = find_divergence(torch_model, flax_model, inputs, **options)
    if report.departs:
        raise AssertionError(f"the Flax port departs from the torch model:\n{report}")
    return report


# ---- the command line --------------------------------------------------------------------------


def main(argv=None) -> int:
    """``python -m conformance_tests diverge MODULE:FACTORY [--layout L] [--json PATH]
    [--forward-only]``: ``FACTORY()`` (a function of a module importable from the current
    directory) returns ``(torch_model, flax_model, inputs)`` or a dict with those keys and any
    of ``find_divergence``'s keywords. Prints the table; exits 0 when nothing departs, 1 when
    something does, 2 when the factory or what it returns is refused (the reason on stderr)."""
    parser = argparse.ArgumentParser(
        prog="python -m conformance_tests diverge",
        description="Name the first submodule where a Flax port departs from its torch model.",
    )
    parser.add_argument("factory", metavar="MODULE:FACTORY", help="e.g. mypkg.pairs:make_pair")
    parser.add_argument("--layout", help="the weight layout of torch's names (e.g. gpt2)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--forward-only", action="store_true", help="skip the gradients")
    args = parser.parse_args(argv)
    module_name, _, function_name = args.factory.partition(":")
    if "" not in sys.path:
        sys.path.insert(0, "")  # the current directory, as python -m has it
    try:
        factory = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError, ValueError) as error:
        print(f"factory ({args.factory!r}) must be MODULE:FUNCTION ({error})", file=sys.stderr)
        return 2
    made = factory()
    keys = ("torch_model", "flax_model", "inputs")
    options = {}
    if isinstance(made, Mapping) and all(key in made for key in keys):
        options = {k: v for k, v in made.items() if k not in keys}
        made = tuple(made[key] for key in keys)
    if not isinstance(made, tuple) or len(made) != 3:
        print(
            f"factory ({args.factory!r}) must return (torch_model, flax_model, inputs) or a "
            f"dict with those keys (it returned a {type(made).__name__})",
            file=sys.stderr,
        )
        return 2
    if args.layout:
        options["layout"] = args.layout
    if args.forward_only:
        options["backward"] = False
    try:
        report = find_divergence(*made, **options)
    except (TypeError, ValueError) as error:
        print(error, file=sys.stderr)
        return 2
    print(report)
    if args.json:
        with open(args.json, "w") as handle:
            handle.write(report.to_json(indent=1))
    return 1 if report.departs else 0
