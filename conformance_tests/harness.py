"""One harness for the spec: weights made once by torch, one safetensors file, loaded into both.

``run_case(case, check, ...)`` builds the pair for a case, runs one check on both sides and
returns report rows (``Row``). Every check compares torch (float32, TF32 off) with Flax (highest
matmul precision unless asked otherwise) tensor by tensor, by name, and names the worst tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import tempfile
import zlib
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from safetensors.torch import save_file as torch_save_file

import flax_attention as fa
import torch_reference as tr
from conformance_tests.documents import INPUTS
from conformance_tests.spec import DOCUMENTS, DOCUMENTS_BATCH, Case, is_shift_invariant
from conformance_tests.tolerances import tolerance

__all__ = [
    "Row",
    "Backend",
    "backends",
    "parse_mesh",
    "make_mesh",
    "mesh_skip_reason",
    "run_case",
    "build_pair",
    "make_inputs",
    "make_mask",
]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclass
class Row:
    """One line of the report (API.md's fields, plus which tensor was worst)."""

    case: str
    backend: str
    dtype: str
    check: str
    max_abs_err: float
    max_rel_err: float
    tol: float
    passed: bool
    worst: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


#: What ``--precision default`` means on each backend, for the tolerance table: the backend's
#: default float32 matmul (``None``: full float32, as strict).
DEFAULT_PRECISION = {"cpu": None, "gpu": "tf32", "tpu": "bf16"}


@dataclass(frozen=True)
class Backend:
    """Where both sides run: a jax device (or a mesh of them) and the matching torch device."""

    name: str  # "cpu", "gpu" or "tpu"
    jax_device: object
    torch_device: str
    strict: bool = True  # highest matmul precision in jax, TF32 off in torch
    mesh: object = None  # a jax.sharding.Mesh ("data", "model"): the Flax side runs sharded

    @property
    def label(self) -> str:
        """The report's backend column: ``cpu``, ``gpu/default``, ``cpu[mesh 2x4]``, ..."""
        label = self.name if self.strict else f"{self.name}/default"
        if self.mesh is not None:
            label += f"[mesh {'x'.join(str(n) for n in self.mesh.devices.shape)}]"
        return label

    @property
    def precision(self) -> str | None:
        """The float32 matmul precision in effect: ``None`` (full float32), ``"tf32"`` or
        ``"bf16"``; it picks the tolerance entries."""
        return None if self.strict else DEFAULT_PRECISION[self.name]

    @contextlib.contextmanager
    def scope(self):
        precision = "highest" if self.strict else "default"
        torch.backends.cuda.matmul.allow_tf32 = not self.strict
        torch.backends.cudnn.allow_tf32 = not self.strict
        with contextlib.ExitStack() as stack:
            stack.enter_context(jax.default_device(self.jax_device))
            stack.enter_context(jax.default_matmul_precision(precision))
            if self.mesh is not None:
                stack.enter_context(jax.set_mesh(self.mesh))
            yield


def parse_mesh(text: str) -> tuple[int, int]:
    """``"2x4"`` -> ``(2, 4)``: the sizes of the mesh's ``data`` and ``model`` axes."""
    parts = str(text).lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"mesh ({text!r}) must be DATAxMODEL with positive sizes (e.g. 2x4)")
    return int(parts[0]), int(parts[1])


def make_mesh(platform: str, shape: tuple[int, int]) -> jax.sharding.Mesh:
    """A ``("data", "model")`` mesh of ``shape`` over the first devices of ``platform``.

    Raises ``ValueError`` when fewer devices exist than the mesh needs (on CPU, saying how to get
    more: ``XLA_FLAGS=--xla_force_host_platform_device_count=N``)."""
    needed = int(np.prod(shape))
    devices = jax.devices(platform)
    if len(devices) < needed:
        hint = (
            f"; on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={needed} "
            "in the environment before Python starts"
            if platform == "cpu"
            else ""
        )
        raise ValueError(
            f"mesh ({shape[0]}x{shape[1]}) must fit the {platform} devices present "
            f"({len(devices)}, {needed} needed){hint}"
        )
    grid = np.array(devices[:needed]).reshape(shape)
    return jax.sharding.Mesh(grid, ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def backends(names=None, strict=True, mesh=None) -> list[Backend]:
    """Every backend both frameworks see: CPU always, then GPU (CUDA) and TPU when present.

    ``mesh`` (``(data, model)``, e.g. ``(2, 4)``) runs the Flax side of every check sharded over
    a mesh of that backend's devices (``flax_attention.shard``, inputs over ``data``)."""
    found = [Backend("cpu", jax.devices("cpu")[0], "cpu", strict)]
    with contextlib.suppress(RuntimeError):
        gpus = jax.devices("gpu")
        if gpus and torch.cuda.is_available():
            found.append(Backend("gpu", gpus[0], "cuda", strict))
    with contextlib.suppress(RuntimeError):
        tpus = jax.devices("tpu")
        if tpus:  # torch has no TPU here: the reference runs on the CPU
            found.append(Backend("tpu", tpus[0], "cpu", strict))
    if names:
        unknown = set(names) - {b.name for b in found}
        if unknown:
            raise ValueError(
                f"backend ({', '.join(sorted(unknown))}) must be one of those present "
                f"({', '.join(b.name for b in found)})"
            )
        found = [b for b in found if b.name in names]
    if mesh is not None:
        found = [dataclasses.replace(b, mesh=make_mesh(b.name, tuple(mesh))) for b in found]
    return found


# ---- inputs, masks, weights --------------------------------------------------------------------


def _rng(case: Case, salt: str) -> np.random.Generator:
    return np.random.default_rng([case.seed, zlib.crc32(f"{case.name}/{salt}".encode())])


def make_inputs(case: Case) -> list[np.ndarray]:
    """The case's positional inputs as float32 NumPy arrays (standard normal unless documents)."""
    if case.inputs == DOCUMENTS:
        return [INPUTS.copy()]
    if case.inputs == DOCUMENTS_BATCH:
        return [np.stack([INPUTS, INPUTS])]
    rng = _rng(case, "inputs")
    return [rng.standard_normal(shape).astype(np.float32) for shape in case.inputs]


def make_mask(case: Case, inputs) -> np.ndarray | None:
    """The case's mask (``1`` = attend), shaped as spec.py says, or ``None``."""
    if case.mask is None:
        return None
    query, key = inputs[0], inputs[1]
    lead, t, s = query.shape[:-2], query.shape[-2], key.shape[-2]
    if case.mask == "causal":
        mask = np.tril(np.ones((t, s), np.float32))[None]  # (1, t, s)
    elif case.mask == "fully_masked_row":
        mask = np.broadcast_to(np.tril(np.ones((t, s), np.float32)), (query.shape[0], t, s))
        mask = mask.copy()
        mask[0, 0, :] = 0.0  # (b, t, s), row 0 of batch 0 sees nothing
    elif case.mask == "padding":
        keep = _rng(case, "mask").integers(1, s + 1, size=query.shape[0])  # >= 1 key kept
        mask = (np.arange(s)[None, :] < keep[:, None]).astype(np.float32)[:, None]  # (b, 1, s)
    else:
        raise ValueError(f"case.mask ({case.mask!r}) must be causal, padding or fully_masked_row")
    if case.layer == "attention":  # the function takes the mask broadcast over heads
        mask = mask.reshape(mask.shape[0], *([1] * (len(lead) - 1)), *mask.shape[1:])
    return mask


def _constructor_args(case: Case, dropout: float | None):
    args = list(case.args)
    if dropout is not None:  # the dropout rate is an argument of every layer that has one
        index = {"MultiHeadedAttention": 2}.get(case.layer, 3)
        args[index] = dropout
    return tuple(args)


def build_pair(
    case: Case,
    workdir: str,
    *,
    dropout: float | None = None,
    dtype="float32",
    dropout_seed=None,
    mesh=None,
):
    """torch makes the weights from ``case.seed``; both sides load them from one safetensors file.

    Returns ``(torch_module, flax_module)`` in eval mode, or the two functions for a function case.
    With a ``mesh``, the Flax module is placed on it by ``flax_attention.shard``.
    """
    if case.is_function:
        return getattr(tr, case.layer), getattr(fa, case.layer)
    args = _constructor_args(case, dropout)
    torch.manual_seed(case.seed)
    torch_module = getattr(tr, case.layer)(*args).eval()
    path = os.path.join(workdir, f"{case.name}.safetensors")
    torch_save_file(torch_module.state_dict(), path)
    flax_module = getattr(fa, case.layer)(
        *args,
        dtype=DTYPES[dtype],
        rngs=nnx.Rngs(
            params=case.seed, dropout=case.seed if dropout_seed is None else dropout_seed
        ),
    )
    fa.load_file(flax_module, path, strict=True)
    flax_module.eval()
    if mesh is not None:
        fa.shard(flax_module, mesh)
    return torch_module, flax_module


def mesh_skip_reason(case: Case, backend: Backend) -> str | None:
    """Why ``case`` cannot run on ``backend.mesh`` (a layer size that does not divide over the
    mesh's ``model`` axis, as ``flax_attention.shard`` would say), or ``None``."""
    if backend.mesh is None or case.is_function:
        return None
    module = getattr(fa, case.layer)(*_constructor_args(case, None), rngs=nnx.Rngs(0))
    try:
        fa.sharding.check_shardable(module, backend.mesh)
    except ValueError as error:
        return str(error)
    return None


# ---- calling both sides -----------------------------------------------------------------------

OUTPUT_NAMES = {
    "simplified_self_attention": ("attn_scores", "attn_weights", "context_vecs"),
    "attention": ("out", "attention_score"),
    "MultiHeadedAttention": ("out", "attention_score"),
}


def output_names(case: Case) -> tuple[str, ...]:
    return OUTPUT_NAMES.get(case.layer, ("out",))


def _call_args(case: Case, inputs, mask):
    args = list(inputs)
    if case.layer in ("MultiHeadedAttention", "attention"):
        args.append(mask)
    elif case.is_function:
        args.extend(case.args)
    return args


def call_torch(case: Case, module, inputs, mask) -> tuple:
    out = module(*_call_args(case, inputs, mask))
    if case.layer == "MultiHeadedAttention":
        out = (out, module.attention_score)
    return out if isinstance(out, tuple) else (out,)


def call_flax(case: Case, module, inputs, mask) -> tuple:
    out = module(*_call_args(case, inputs, mask))
    if case.layer == "MultiHeadedAttention" and module.keep_attention_score:
        out = (out, module.attention_score[...])
    return out if isinstance(out, tuple) else (out,)


def _to_torch(array, device, requires_grad=False):
    if array is None:
        return None
    tensor = torch.from_numpy(np.array(array, np.float32)).to(device)
    return tensor.requires_grad_(requires_grad)


def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy().astype(np.float64)
    return np.asarray(jnp.asarray(x, jnp.float32), dtype=np.float64)


def _err_and_scale(reference, actual) -> tuple[float, float]:
    """Max abs error (NaN on both sides agrees; NaN on one side is inf) and the tensor's scale."""
    ref, act = _np(reference), _np(actual)
    if ref.shape != act.shape:
        raise ValueError(f"shape {act.shape} must equal the reference's {ref.shape}")
    with np.errstate(invalid="ignore"):
        diff = np.abs(ref - act)
    diff = np.where(np.isnan(ref) & np.isnan(act), 0.0, diff)
    err = float(np.where(np.isnan(diff), np.inf, diff).max()) if diff.size else 0.0
    finite = np.abs(ref[np.isfinite(ref)])
    return err, float(finite.max()) if finite.size else 0.0


def compare(reference: dict, actual: dict, tol: float) -> tuple[float, float, bool, str]:
    """``(max_abs_err, max_rel_err, passed, worst)`` over same-named tensors.

    A tensor passes when its max abs error <= ``tol * max(1, max|reference|)``;
    ``max_rel_err`` is the error over ``max|reference|``; ``worst`` names the tensor furthest
    past (or closest to) its tolerance.
    """
    if set(reference) != set(actual):
        raise KeyError(f"tensors differ: {sorted(set(reference) ^ set(actual))}")
    abs_err, rel_err, passed, worst, worst_ratio = 0.0, 0.0, True, "", -1.0
    for name in reference:
        err, ref_max = _err_and_scale(reference[name], actual[name])
        ratio = err / (tol * max(1.0, ref_max))
        passed &= ratio <= 1.0
        if ratio > worst_ratio:
            worst, worst_ratio = name, ratio
        abs_err = max(abs_err, err)
        rel_err = max(rel_err, err / ref_max if ref_max > 0 else err)
    return abs_err, rel_err, bool(passed), worst


def _row(case, backend, dtype, check, reference, actual, tol_key=None, ok=True) -> Row:
    tol = tolerance(dtype, tol_key or check, backend.precision)
    abs_err, rel_err, passed, worst = compare(reference, actual, tol)
    return Row(case.name, backend.label, dtype, check, abs_err, rel_err, tol, passed and ok, worst)


# ---- the checks -------------------------------------------------------------------------------


def _torch_on(module, device):
    return module.to(device) if isinstance(module, torch.nn.Module) else module


def _prepare(case, backend, inputs, mask, dtype="float32"):
    """Inputs and mask for both sides: torch float32 tensors, jax arrays in ``dtype``."""
    t_inputs = [_to_torch(x, backend.torch_device) for x in inputs]
    t_mask = _to_torch(mask, backend.torch_device)
    f_inputs = [_place(jnp.asarray(x, DTYPES[dtype]), backend.mesh) for x in inputs]
    f_mask = None if mask is None else _place(jnp.asarray(mask), backend.mesh, batched=False)
    return t_inputs, t_mask, f_inputs, f_mask


def _place(x, mesh, batched=True):
    """On a mesh: a batched input ``(b, ..., t, d)`` split over ``data`` when ``b`` divides,
    anything else (one unbatched sequence, a mask) replicated. Without a mesh: ``x``."""
    if mesh is None:
        return x
    data = dict(mesh.shape)["data"]
    split = batched and x.ndim >= 3 and x.shape[0] % data == 0
    return jax.device_put(x, NamedSharding(mesh, PartitionSpec("data" if split else None)))


def _named(case, outputs) -> dict:
    return dict(zip(output_names(case), outputs, strict=True))


def check_forward(case: Case, backend: Backend, workdir: str, dtype="float32") -> list[Row]:
    """Eval-mode outputs (and returned weights) of both sides, by name."""
    tm, fm = build_pair(case, workdir, dtype=dtype, mesh=backend.mesh)
    tm = _torch_on(tm, backend.torch_device)
    inputs = make_inputs(case)
    mask = make_mask(case, inputs)
    t_inputs, t_mask, f_inputs, f_mask = _prepare(case, backend, inputs, mask, dtype)
    with torch.no_grad():
        reference = _named(case, call_torch(case, tm, t_inputs, t_mask))
    actual = _named(case, call_flax(case, fm, f_inputs, f_mask))
    key = "forward:documents" if case.uses_documents_input and dtype == "float32" else "forward"
    return [_row(case, backend, dtype, "forward", reference, actual, key)]


def _cotangents(case, outputs) -> list[np.ndarray]:
    rng = _rng(case, "cotangent")
    return [rng.standard_normal(tuple(o.shape)).astype(np.float32) for o in outputs]


def torch_grads(case, tm, inputs, mask, cotangents=None):
    """Outputs and gradients of ``sum(outputs * cotangents)`` w.r.t. inputs and parameters."""
    device = inputs[0].device
    inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    outputs = call_torch(case, tm, inputs, mask)
    cotangents = _cotangents(case, outputs) if cotangents is None else cotangents
    loss = sum((o * torch.from_numpy(c).to(device)).sum() for o, c in zip(outputs, cotangents))
    params = dict(tm.named_parameters()) if isinstance(tm, torch.nn.Module) else {}
    names = [f"input.{i}" for i in range(len(inputs))] + list(params)
    grads = torch.autograd.grad(loss, inputs + list(params.values()), allow_unused=True)
    grads = {
        n: (torch.zeros_like(p) if g is None else g)
        for n, p, g in zip(names, inputs + list(params.values()), grads)
    }
    return outputs, grads, cotangents


def flax_grads(case, fm, inputs, mask, cotangents):
    """The same as ``torch_grads`` for the Flax side, parameters by torch name and layout."""
    cotangents = [jnp.asarray(c) for c in cotangents]

    def loss_of(outputs):
        return sum((o.astype(jnp.float32) * c).sum() for o, c in zip(outputs, cotangents))

    if case.is_function:
        g_inputs = jax.grad(lambda xs: loss_of(call_flax(case, fm, xs, mask)))(list(inputs))
        return {f"input.{i}": g for i, g in enumerate(g_inputs)}
    graphdef, params, rest = nnx.split(fm, nnx.Param, ...)

    def loss(params, xs):
        return loss_of(call_flax(case, nnx.merge(graphdef, params, rest), xs, mask))

    g_params, g_inputs = jax.grad(loss, argnums=(0, 1))(params, list(inputs))
    grads = {f"input.{i}": g for i, g in enumerate(g_inputs)}
    param_names = {n for n, _ in _torch_param_names(fm)}
    by_name = fa.state_dict(nnx.merge(graphdef, g_params, rest))
    grads.update({n: v for n, v in by_name.items() if n in param_names})
    return grads


def _torch_param_names(fm):
    """Torch parameter names of a Flax module (its state_dict keys minus buffers)."""
    for name, value in fa.state_dict(fm).items():
        if not name.endswith("mask"):
            yield name, value


def check_grad(case: Case, backend: Backend, workdir: str, dtype="float32") -> list[Row]:
    """Gradients of a fixed random cotangent w.r.t. every input and parameter, by torch name."""
    tm, fm = build_pair(case, workdir, mesh=backend.mesh)
    tm = _torch_on(tm, backend.torch_device)
    inputs = make_inputs(case)
    mask = make_mask(case, inputs)
    t_inputs, t_mask, f_inputs, f_mask = _prepare(case, backend, inputs, mask)
    _, reference, cotangents = torch_grads(case, tm, t_inputs, t_mask)
    actual = flax_grads(case, fm, f_inputs, f_mask, cotangents)
    finite = all(bool(np.isfinite(_np(g)).all()) for g in actual.values())
    return [_row(case, backend, dtype, "grad", reference, actual, ok=finite)]


def check_dtype(case: Case, backend: Backend, workdir: str, dtype: str) -> list[Row]:
    """Flax computing in ``dtype`` (float32 parameters) against torch in float32."""
    return check_forward(case, backend, workdir, dtype)


# ---- train ------------------------------------------------------------------------------------

TRAIN_STEPS = 50
COMPARE_EVERY = 10
LEARNING_RATE = 1e-2


def scale_by_adam_as_torch(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """``optax.scale_by_adam`` with torch's bias corrections.

    optax computes ``1 - b2**t`` in float32, where ``0.999`` is ``0.99900001``: the correction
    (and so every Adam step) is off by 1.3e-5 relative, which 50 steps turn into a 2e-5 drift of
    the trained outputs (torch, which corrects in float64, drifts 8e-7 from a float64 run).
    ``-expm1(t * log(b))`` is the same number to float32 accuracy.
    """

    def init_fn(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return jnp.zeros([], jnp.int32), zeros, zeros

    def update_fn(updates, state, params=None):
        del params
        count, mu, nu = state
        count = count + 1
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, mu, updates)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, nu, updates)
        correction1 = -jnp.expm1(count * math.log(b1))
        correction2 = -jnp.expm1(count * math.log(b2))
        updates = jax.tree.map(
            lambda m, v: (m / correction1) / (jnp.sqrt(v / correction2) + eps), mu, nu
        )
        return updates, (count, mu, nu)

    return optax.GradientTransformation(init_fn, update_fn)


#: (torch optimiser, optax transformation) with matched hyperparameters. torch's Adam divides by
#: ``sqrt(v_hat) + eps`` as optax does (bias corrections as torch's, above); AdamW's decay is
#: decoupled (``p -= lr * wd * p``) in both; SGD's momentum buffer starts at the first gradient
#: with no dampening in both.
OPTIMIZERS = {
    "adam": (
        lambda p: torch.optim.Adam(p, lr=LEARNING_RATE, betas=(0.9, 0.999), eps=1e-8),
        lambda: optax.chain(scale_by_adam_as_torch(0.9, 0.999, 1e-8), optax.scale(-LEARNING_RATE)),
    ),
    "adamw": (
        lambda p: torch.optim.AdamW(
            p, lr=LEARNING_RATE, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1
        ),
        lambda: optax.chain(
            scale_by_adam_as_torch(0.9, 0.999, 1e-8),
            optax.add_decayed_weights(0.1),
            optax.scale(-LEARNING_RATE),
        ),
    ),
    "sgd_momentum": (
        lambda p: torch.optim.SGD(p, lr=LEARNING_RATE, momentum=0.9),
        lambda: optax.sgd(LEARNING_RATE, momentum=0.9),
    ),
}


def check_train(case: Case, backend: Backend, workdir: str, dtype="float32") -> list[Row]:
    """50 optimiser steps on both sides; parameters compared every 10 steps, outputs at the end.

    The objective regresses the layer's output onto a fixed random target (mean squared error).
    Shift-invariant parameters (the key bias) are compared by their gradient (zero on both
    sides) and their effect (none), in a row of their own.
    """
    rows = []
    inputs = make_inputs(case)
    mask = make_mask(case, inputs)
    for opt_name, (make_torch_opt, make_optax) in OPTIMIZERS.items():
        tm, fm = build_pair(case, workdir, mesh=backend.mesh)
        tm = _torch_on(tm, backend.torch_device)
        t_inputs, t_mask, f_inputs, f_mask = _prepare(case, backend, inputs, mask)
        with torch.no_grad():
            out_shape = call_torch(case, tm, t_inputs, t_mask)[0].shape
        target = _rng(case, "target").standard_normal(tuple(out_shape)).astype(np.float32)
        t_target = _to_torch(target, backend.torch_device)

        optimizer = make_torch_opt(tm.parameters())
        reference, t_snapshots = {}, []
        for step in range(1, TRAIN_STEPS + 1):
            optimizer.zero_grad()
            out = call_torch(case, tm, t_inputs, t_mask)[0]
            ((out - t_target) ** 2).mean().backward()
            optimizer.step()
            if step % COMPARE_EVERY == 0:
                t_snapshots.append({n: p.detach().clone() for n, p in tm.named_parameters()})

        graphdef, params, rest = nnx.split(fm, nnx.Param, ...)
        tx = make_optax()
        opt_state = tx.init(params)
        f_target = jnp.asarray(target)

        def loss_fn(params, graphdef=graphdef, rest=rest, f_target=f_target, xs=f_inputs, m=f_mask):
            module = nnx.merge(graphdef, params, rest)
            out = call_flax(case, module, xs, m)[0]
            return ((out - f_target) ** 2).mean()

        @jax.jit
        def step_fn(params, opt_state, tx=tx, loss_fn=loss_fn):
            grads = jax.grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        f_snapshots = []
        for step in range(1, TRAIN_STEPS + 1):
            params, opt_state = step_fn(params, opt_state)
            if step % COMPARE_EVERY == 0:
                f_snapshots.append(fa.state_dict(nnx.merge(graphdef, params, rest)))

        actual = {}
        for i, (t_snap, f_snap) in enumerate(zip(t_snapshots, f_snapshots), start=1):
            for name, value in t_snap.items():
                if not is_shift_invariant(name):
                    reference[f"{name}@{i * COMPARE_EVERY}"] = value
                    actual[f"{name}@{i * COMPARE_EVERY}"] = f_snap[name]
        with torch.no_grad():
            reference["output"] = call_torch(case, tm, t_inputs, t_mask)[0]
        trained = nnx.merge(graphdef, params, rest)
        actual["output"] = call_flax(case, trained, f_inputs, f_mask)[0]
        rows.append(_row(case, backend, dtype, f"train/{opt_name}", reference, actual, "train"))
    shift_rows = _check_shift_invariant(case, backend, workdir, inputs, mask, dtype)
    return rows + shift_rows


def _check_shift_invariant(case, backend, workdir, inputs, mask, dtype) -> list[Row]:
    """The key bias: zero gradient on both sides, and no effect on the output when changed."""
    tm, fm = build_pair(case, workdir, mesh=backend.mesh)
    names = [n for n, _ in tm.named_parameters() if is_shift_invariant(n)]
    if not names:
        return []
    tm = _torch_on(tm, backend.torch_device)
    t_inputs, t_mask, f_inputs, f_mask = _prepare(case, backend, inputs, mask)
    _, t_grads, cotangents = torch_grads(case, tm, t_inputs, t_mask)
    f_grads = flax_grads(case, fm, f_inputs, f_mask, cotangents)
    reference, actual = {}, {}
    for n in names:
        zero = np.zeros(tuple(t_grads[n].shape), np.float32)
        reference[f"grad {n} (torch)"], actual[f"grad {n} (torch)"] = zero, t_grads[n]
        reference[f"grad {n} (flax)"], actual[f"grad {n} (flax)"] = zero, f_grads[n]

    with torch.no_grad():
        before_t = call_torch(case, tm, t_inputs, t_mask)[0]
    before_f = call_flax(case, fm, f_inputs, f_mask)[0]
    shifted = {n: _rng(case, f"shift/{n}").standard_normal(tuple(t_grads[n].shape)) for n in names}
    with torch.no_grad():
        params = dict(tm.named_parameters())
        for n, v in shifted.items():
            params[n].copy_(torch.from_numpy(v.astype(np.float32)))
        after_t = call_torch(case, tm, t_inputs, t_mask)[0]
    fa.load_state_dict(fm, {n: v.astype(np.float32) for n, v in shifted.items()}, strict=False)
    after_f = call_flax(case, fm, f_inputs, f_mask)[0]
    reference.update({"output after a new key bias (torch)": before_t})
    actual.update({"output after a new key bias (torch)": after_t})
    reference.update({"output after a new key bias (flax)": before_f})
    actual.update({"output after a new key bias (flax)": after_f})
    return [_row(case, backend, dtype, "train/key_bias", reference, actual, "train")]


# ---- dropout ----------------------------------------------------------------------------------


def _injected_keep(name: str, seed: int, rate: float, shape) -> np.ndarray:
    """The keep-mask for dropout module ``name``: the same numbers on both sides.

    Drawn flat and reshaped, so torch's ``(b, t, s)`` and the core's ``(b, 1, t, s)`` (one head)
    get the same elements in the same order.
    """
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    size = int(np.prod(shape))
    return (rng.random(size) >= rate).reshape(shape).astype(np.float32)


class TorchInjectedDropout(torch.nn.Module):
    """``nn.Dropout`` with a fixed keep-mask: ``x * keep / (1 - rate)``."""

    def __init__(self, name, seed, rate):
        super().__init__()
        self.name, self.seed, self.rate = name, seed, rate

    def forward(self, x):
        keep = _injected_keep(self.name, self.seed, self.rate, tuple(x.shape))
        return x * torch.from_numpy(keep).to(x.device) / (1.0 - self.rate)


class FlaxInjectedDropout(nnx.Module):
    """``nnx.Dropout`` with the same fixed keep-mask as ``TorchInjectedDropout``."""

    def __init__(self, name, seed, rate):
        self.name, self.seed, self.rate = name, seed, rate

    def __call__(self, x):
        keep = _injected_keep(self.name, self.seed, self.rate, tuple(x.shape))
        return x * jnp.asarray(keep, x.dtype) / (1.0 - self.rate)


def _flax_dropouts(fm):
    """``(torch-style name, parent, attribute)`` of every ``nnx.Dropout`` in ``fm``."""
    found = []
    for path, node in nnx.iter_graph(fm):
        if isinstance(node, nnx.Dropout):
            parent = fm
            for part in path[:-1]:
                parent = parent[part] if isinstance(part, int) else getattr(parent, part)
            found.append((".".join(map(str, path)), parent, path[-1]))
    return found


def inject_dropout(tm, fm, seed, rate):
    """Replace every dropout of both modules by the same fixed keep-masks, named by path."""
    for name, module in list(tm.named_modules()):
        if isinstance(module, torch.nn.Dropout):
            parent_name, _, attr = name.rpartition(".")
            parent = tm.get_submodule(parent_name) if parent_name else tm
            setattr(parent, attr, TorchInjectedDropout(name, seed, rate))
    for name, parent, attr in _flax_dropouts(fm):
        setattr(parent, attr, FlaxInjectedDropout(name, seed, rate))


def check_dropout(case: Case, backend: Backend, workdir: str, dtype="float32") -> list[Row]:
    """Identical injected masks give identical outputs and gradients; the layer's own dropout
    keeps ``1 - p`` of the weights, scales them by ``1 / (1 - p)``, preserves the mean output,
    and reproduces its mask from the same ``nnx.Rngs`` seed (and not from another)."""
    rate = case.dropout
    inputs = make_inputs(case)
    mask = make_mask(case, inputs)

    tm, fm = build_pair(case, workdir, dropout=rate, mesh=backend.mesh)
    tm = _torch_on(tm, backend.torch_device).train()
    fm.train()
    inject_dropout(tm, fm, case.seed, rate)
    t_inputs, t_mask, f_inputs, f_mask = _prepare(case, backend, inputs, mask)
    t_out, reference, cotangents = torch_grads(case, tm, t_inputs, t_mask)
    actual = flax_grads(case, fm, f_inputs, f_mask, cotangents)
    reference = {f"grad {k}": v for k, v in reference.items()}
    actual = {f"grad {k}": v for k, v in actual.items()}
    reference.update({f"output {k}": v for k, v in _named(case, t_out).items()})
    f_out = call_flax(case, fm, f_inputs, f_mask)
    actual.update({f"output {k}": v for k, v in _named(case, f_out).items()})
    rows = [_row(case, backend, dtype, "dropout/injected", reference, actual, "dropout")]
    rows.append(_dropout_statistics(case, backend, workdir, f_inputs, f_mask, rate, dtype))
    return rows


class _Recorder(nnx.Module):
    """Wraps the layer's own ``nnx.Dropout`` and keeps what went in and came out."""

    def __init__(self, dropout: nnx.Dropout):
        self.dropout = dropout
        self.seen = nnx.data([])

    def __call__(self, x):
        y = self.dropout(x)
        self.seen.append((x, y))
        return y


DROPOUT_DRAWS = 64


def _dropout_statistics(case, backend, workdir, f_inputs, f_mask, rate, dtype) -> Row:
    _, fm = build_pair(case, workdir, dropout=rate, mesh=backend.mesh)
    fm.eval()
    eval_out = np.asarray(call_flax(case, fm, f_inputs, f_mask)[0], np.float64)
    fm.train()
    recorders = []
    for _, parent, attr in _flax_dropouts(fm):
        recorder = _Recorder(getattr(parent, attr))
        setattr(parent, attr, recorder)
        recorders.append(recorder)
    outs, kept, total, scale_err = [], 0, 0, 0.0
    for _ in range(DROPOUT_DRAWS):
        outs.append(np.asarray(call_flax(case, fm, f_inputs, f_mask)[0], np.float64))
        for recorder in recorders:
            for x, y in recorder.seen:
                x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
                live = x != 0
                kept += int((y[live] != 0).sum())
                total += int(live.sum())
                on = live & (y != 0)
                scale_err = max(scale_err, float(np.abs(y[on] / x[on] * (1 - rate) - 1).max()))
            recorder.seen.clear()
    # kept fraction, in standard errors of a binomial proportion
    frac = kept / total
    z_kept = abs(frac - (1 - rate)) / np.sqrt(rate * (1 - rate) / total)
    # mean output over draws against the eval output, in standard errors per element
    outs = np.stack(outs)
    se = outs.std(axis=0, ddof=1) / np.sqrt(DROPOUT_DRAWS)
    z_mean = float(np.max(np.abs(outs.mean(axis=0) - eval_out) / np.maximum(se, 1e-12)))

    # the same nnx.Rngs seed reproduces the draw; another seed does not
    def draw(seed):
        _, module = build_pair(case, workdir, dropout=rate, dropout_seed=seed, mesh=backend.mesh)
        module.train()
        return np.asarray(call_flax(case, module, f_inputs, f_mask)[0])

    same = np.array_equal(draw(11), draw(11))
    other = not np.array_equal(draw(11), draw(12))
    tol = tolerance("float32", "dropout:stats")
    worst = max(z_kept, z_mean)
    passed = bool(z_kept <= tol and z_mean <= tol and scale_err <= 1e-5 and same and other)
    label = f"z_kept={z_kept:.2f} z_mean={z_mean:.2f} scale_err={scale_err:.1e} seed={same}/{other}"
    return Row(
        case.name, backend.label, dtype, "dropout/stats", worst, scale_err, tol, passed, label
    )


# ---- masks ------------------------------------------------------------------------------------


def check_mask(case: Case, backend: Backend, workdir: str, dtype="float32") -> list[Row]:
    """Masked positions have no influence, on both sides; fully masked rows are uniform.

    - causal (every causal layer, and document 001 with a causal mask): changing the tokens from
      position ``k`` on leaves the outputs before ``k`` exactly as they were;
    - padding: changing masked keys and values leaves every output as it was;
    - fully masked row (document 001): that row's weights are ``1 / k_len`` everywhere and every
      output and gradient is finite.
    Each side is compared with itself (before/after), so the expected error is 0.
    """
    tm, fm = build_pair(case, workdir, mesh=backend.mesh)
    tm = _torch_on(tm, backend.torch_device)
    inputs = make_inputs(case)
    mask = make_mask(case, inputs)
    causal = case.mask in ("causal", "fully_masked_row") or case.layer in (
        "CausalAttention",
        "MultiHeadAttentionWrapper",
        "MultiHeadAttention",
    )
    perturbed = [x.copy() for x in inputs]
    rng = _rng(case, "perturb")
    t_len = inputs[0].shape[-2]
    if case.mask != "padding" and t_len < 2:
        raise ValueError(f"case {case.name}: a causal mask check needs >= 2 tokens ({t_len})")
    k = max(1, t_len // 2)
    if case.mask == "padding":
        keep = mask.reshape(mask.shape[0], -1)  # (b, s): 1 = attended key
        for x in perturbed[1:]:  # key and value
            x += rng.standard_normal(x.shape).astype(np.float32) * (1 - keep)[..., None]
        rows_kept = slice(None)
    elif causal:
        targets = perturbed[1:] if case.layer == "MultiHeadedAttention" else perturbed
        for x in targets:
            x[..., k:, :] += rng.standard_normal(x[..., k:, :].shape).astype(np.float32)
        rows_kept = slice(0, k)
    else:
        raise ValueError(f"case {case.name}: the mask check needs a mask or a causal layer")

    def outputs_of(xs):
        t_in, t_mask, f_in, f_mask = _prepare(case, backend, xs, mask)
        with torch.no_grad():
            t_out = call_torch(case, tm, t_in, t_mask)[0]
        f_out = call_flax(case, fm, f_in, f_mask)[0]
        return _np(t_out)[..., rows_kept, :], _np(f_out)[..., rows_kept, :]

    (t_before, f_before), (t_after, f_after) = outputs_of(inputs), outputs_of(perturbed)
    if case.mask == "fully_masked_row":  # that row attends to every key, future ones included
        for out in (t_before, f_before, t_after, f_after):
            out[0, 0] = 0.0
    reference = {"torch, masked positions changed": t_before, "flax, ...": f_before}
    actual = {"torch, masked positions changed": t_after, "flax, ...": f_after}
    ok = True
    if case.mask == "fully_masked_row":
        t_in, t_mask, f_in, f_mask = _prepare(case, backend, inputs, mask)
        with torch.no_grad():
            call_torch(case, tm, t_in, t_mask)
        f_weights = call_flax(case, fm, f_in, f_mask)[1]
        uniform = np.full(f_weights.shape[1:2] + f_weights.shape[-1:], 1.0 / f_weights.shape[-1])
        reference.update(
            {"torch weights, masked row": uniform, "flax weights, masked row": uniform}
        )
        actual["torch weights, masked row"] = _np(tm.attention_score)[0, :, 0, :]
        actual["flax weights, masked row"] = _np(f_weights)[0, :, 0, :]
        _, t_grads, cot = torch_grads(case, tm, t_in, t_mask)
        f_grads = flax_grads(case, fm, f_in, f_mask, cot)
        ok = all(np.isfinite(_np(g)).all() for g in (*t_grads.values(), *f_grads.values()))
    kind = case.mask or "causal"
    return [_row(case, backend, dtype, f"mask/{kind}", reference, actual, "mask", ok=ok)]


# ---- dispatch ---------------------------------------------------------------------------------

CHECK_FUNCTIONS = {
    "forward": check_forward,
    "grad": check_grad,
    "train": check_train,
    "dropout": check_dropout,
    "mask": check_mask,
}


def run_case(case: Case, check: str, backend: Backend, dtype: str = "float32", workdir=None):
    """Rows of one check of one case on one backend. ``dtype`` other than float32 runs the
    ``dtype`` check (a forward pass of the Flax side in that dtype)."""
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory())
        stack.enter_context(backend.scope())
        if dtype != "float32":
            return check_dtype(case, backend, workdir, dtype) if check == "dtype" else []
        if check == "dtype":
            return []
        return CHECK_FUNCTIONS[check](case, backend, workdir, dtype)


def planned(cases, dtypes=("float32", "bfloat16", "float16")):
    """``(case, check, dtype)`` triples to run: float32 for every check but ``dtype``, which runs
    in each lower precision."""
    for case in cases:
        for check in case.checks:
            if check == "dtype":
                for dtype in dtypes:
                    if dtype != "float32":
                        yield case, check, dtype
            elif "float32" in dtypes:
                yield case, check, "float32"
