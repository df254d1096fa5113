"""Sharded layers against single-device ones; run by ``test_sharding.py`` in a subprocess.

Needs 8 devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m
conformance_tests.tests.sharding_script PART OUT.json`` with ``PART`` one of ``PARTS`` (the parent
pytest's JAX stays single-device; two parts, so ``pytest -n 2`` runs them side by side).
Writes one JSON record per check: ``{"check", "layer", "mesh", "max_diff", "passed", "detail"}``.
Nothing here asserts: ``test_sharding.py`` reads the records and fails with their details.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_attention as fa

MESHES = ((8, 1), (1, 8), (2, 4), (4, 2))
TOL = 1e-5
B, T = 8, 4  # batch (divides every data axis), tokens

#: name -> (constructor, number of inputs, d_in). Heads (or d_out, single-head) divide 8.
LAYERS = {
    "MultiHeadAttention": (
        lambda: fa.MultiHeadAttention(6, 16, T, 0.0, num_heads=8, qkv_bias=True, rngs=nnx.Rngs(0)),
        1,
        6,
    ),
    "MultiHeadedAttention": (lambda: fa.MultiHeadedAttention(8, 16, 0.0, rngs=nnx.Rngs(1)), 3, 16),
    "CausalAttention": (
        lambda: fa.CausalAttention(6, 8, T, 0.0, qkv_bias=True, rngs=nnx.Rngs(2)),
        1,
        6,
    ),
    "MultiHeadAttentionWrapper": (
        lambda: fa.MultiHeadAttentionWrapper(6, 8, T, 0.0, num_heads=2, rngs=nnx.Rngs(3)),
        1,
        6,
    ),
    # The attention core's other kernels (CPU picks reference at these sizes): the flash-style
    # blocked one with its custom VJP, and XLA's fused one (what GPU/TPU pick).
    "MultiHeadAttention[blocked]": (
        lambda: fa.MultiHeadAttention(
            6, 16, T, 0.0, num_heads=8, implementation="blocked", rngs=nnx.Rngs(0)
        ),
        1,
        6,
    ),
    "MultiHeadAttention[xla]": (
        lambda: fa.MultiHeadAttention(
            6, 16, T, 0.0, num_heads=8, implementation="xla", rngs=nnx.Rngs(0)
        ),
        1,
        6,
    ),
    "SelfAttention_v1": (lambda: fa.SelfAttention_v1(6, 8, rngs=nnx.Rngs(4)), 1, 6),
    "SelfAttention_v2": (lambda: fa.SelfAttention_v2(6, 8, qkv_bias=True, rngs=nnx.Rngs(5)), 1, 6),
}

#: Layers checked on every mesh; the self-attention layers (the same placement as
#: ``CausalAttention``'s projections) and the other kernels run on (2, 4) only, to keep the file
#: under a minute.
FOUR_MESHES = ("MultiHeadAttention", "MultiHeadedAttention", "CausalAttention")
FOUR_MESHES += ("MultiHeadAttentionWrapper",)

#: What the partition metadata must say, by the parameter's last two path parts.
HEADS_SPEC = P("data", None, "model", None)  # (b, t, h, d): q/k/v and the decode cache
ROW = ("model", None)  # out_proj, proj_weights.3: input features (heads) over model
COLUMN = (None, "model")  # query/key/value projections: output features (heads) over model


def expected_axes(path: tuple) -> tuple:
    owner = ".".join(str(p) for p in path[:-1])
    reduces = owner.endswith("out_proj") or owner.endswith("proj_weights.3")
    if path[-1] == "kernel":
        return ROW if reduces else COLUMN
    if path[-1] == "bias":
        return (None,) if reduces else ("model",)
    return COLUMN  # SelfAttention_v1's raw (d_in, d_out) matrices


def make_mesh(shape, names=("data", "model")):
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def make_inputs(name):
    _, n_inputs, d_in = LAYERS[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    inputs = [rng.standard_normal((B, T, d_in)).astype(np.float32) for _ in range(n_inputs)]
    if name == "MultiHeadedAttention":
        inputs.append(np.tril(np.ones((T, T), np.float32))[None])  # (1, t, s) causal mask
    return inputs


def forward_and_grads(module, inputs, cotangent):
    """Output and the gradients of ``sum(out * cotangent)`` w.r.t. parameters and inputs, by
    name, and the compiled program's text."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    n = LAYERS[type(module).__name__][1]  # differentiable inputs; the rest (a mask) is not

    def run(params, xs, extra):
        def loss(params, xs):
            out = nnx.merge(graphdef, params, rest)(*xs, *extra)
            return (out * cotangent).sum(), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, xs)
        return out, grads

    args = (params, list(inputs[:n]), list(inputs[n:]))
    compiled = jax.jit(run).lower(*args).compile()
    out, (g_params, g_inputs) = compiled(*args)
    flat = {"out": out}
    flat.update({f"grad input.{i}": g for i, g in enumerate(g_inputs)})
    for path, value in nnx.to_flat_state(g_params):
        flat["grad " + ".".join(str(p) for p in path)] = value[...]
    return flat, compiled.as_text()


def compare(reference: dict, actual: dict) -> tuple[float, bool, str]:
    """Max abs difference over same-named tensors, whether every tensor is within
    ``TOL * max(1, max|reference|)`` (the repository's rule, ``tolerances.py``), and which tensor
    differs most, with its scale."""
    worst, passed, where = 0.0, True, ""
    for key in reference:
        ref = np.asarray(reference[key], np.float64)
        diff = float(np.max(np.abs(ref - np.asarray(actual[key], np.float64))))
        scale = float(np.abs(ref).max())
        passed &= diff <= TOL * max(1.0, scale)
        if diff >= worst:
            worst, where = diff, f"{key} (max|ref| {scale:.3g})"
    return worst, passed, where


def shard_inputs(inputs, mesh):
    out = []
    for x in inputs:
        batched = "data" in mesh.axis_names and x.shape[0] % dict(mesh.shape)["data"] == 0
        spec = P("data") if batched else P()
        out.append(jax.device_put(x, NamedSharding(mesh, spec)))
    return out


def placed_as(array, mesh, spec) -> bool:
    """``array`` is laid out on ``mesh`` as ``spec`` says (trailing ``None``s do not matter)."""
    return array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim)


def record(records, check, layer, mesh, max_diff, passed, detail=""):
    records.append(
        {
            "check": check,
            "layer": layer,
            "mesh": "x".join(map(str, mesh)) if mesh else "",
            "max_diff": max_diff,
            "passed": bool(passed),
            "detail": detail,
        }
    )


def check_layers(records):
    """Forward and gradients on every mesh equal single-device; parameters sit where the metadata
    says; for the multi-head layers, the compiled program has no all-gather at all (q/k/v stay
    split by heads; only ``out_proj`` reduces over ``model``)."""
    for name, (make, _, _) in LAYERS.items():
        reference_module = make()
        reference_module.eval()
        inputs = make_inputs(name)
        graphdef, state = nnx.split(reference_module)
        out = jax.eval_shape(lambda s, g=graphdef, xs=inputs: nnx.merge(g, s)(*xs), state)
        cotangent = np.random.default_rng(7).standard_normal(out.shape).astype(np.float32)
        reference, _ = forward_and_grads(reference_module, inputs, cotangent)
        for shape in MESHES if name in FOUR_MESHES else ((2, 4),):
            mesh = make_mesh(shape)
            module = fa.shard(nnx.clone(reference_module), mesh)
            with jax.set_mesh(mesh):
                actual, hlo = forward_and_grads(module, shard_inputs(inputs, mesh), cotangent)
            diff, passed, where = compare(reference, actual)
            record(records, "forward+grad", name, shape, diff, passed, f"worst: {where}")

            wrong = []
            for path, variable in nnx.to_flat_state(nnx.state(module, nnx.Param)):
                axes = expected_axes(path)
                metadata = variable.get_metadata().get("out_sharding")
                spec = variable[...].sharding.spec
                if tuple(metadata or ()) != axes or not placed_as(variable[...], mesh, P(*axes)):
                    wrong.append(f"{'.'.join(map(str, path))}: metadata {metadata} spec {spec}")
            record(records, "param_specs", name, shape, 0.0, not wrong, "; ".join(wrong))
            multi_head = name.split("[")[0] in ("MultiHeadAttention", "MultiHeadedAttention")
            if multi_head and shape[1] > 1:
                gathers = hlo.count("all-gather(")
                record(records, "no_all_gather", name, shape, float(gathers), gathers == 0)


def check_decode(records):
    """Token-by-token decode on every mesh equals single-device decode (outputs and the caches
    themselves), and the caches sit on the mesh as their metadata says: keys and values
    ``(b, max_length, h, d)`` over ``("data", None, "model", None)`` (one head: its ``d_out``
    features over ``model``), the index replicated. Half the meshes shard the layer before
    ``init_cache`` (the cache follows the parameters), half after (``shard`` places it)."""
    decoders = ("MultiHeadAttention", "CausalAttention", "MultiHeadAttentionWrapper")
    for name in decoders:
        make, _, d_in = LAYERS[name]
        reference_module = make()
        reference_module.eval()
        rng = np.random.default_rng(sum(map(ord, name)) + 1)
        tokens = rng.standard_normal((T, B, 1, d_in)).astype(np.float32)  # T steps of 1 token

        def decode(module, tokens, mesh=None):
            step = nnx.jit(lambda m, x: m(x, decode=True))
            outs = []
            for x in tokens:
                x = x if mesh is None else shard_inputs([x], mesh)[0]
                outs.append(step(module, x))
            return np.concatenate([np.asarray(o) for o in outs], axis=-2)  # (b, T, d_out)

        reference = nnx.clone(reference_module)
        reference.init_cache(B)
        expected = {"out": decode(reference, tokens)}
        expected.update(_caches(reference))
        # decode really decodes: the full causal pass over the same tokens gives the same
        full = np.asarray(reference_module(np.concatenate(list(tokens), axis=-2)))
        full_diff = float(np.abs(full - expected["out"]).max())
        for shape in MESHES:
            mesh = make_mesh(shape)
            module = nnx.clone(reference_module)
            if shape in ((8, 1), (2, 4)):
                fa.shard(module, mesh)
                module.init_cache(B)  # placed on the parameters' mesh at once
            else:
                module.init_cache(B)
                fa.shard(module, mesh)
            wrong = _cache_placement(module, mesh)
            with jax.set_mesh(mesh):
                actual = {"out": decode(module, tokens, mesh)}
            actual.update(_caches(module))
            diff, passed, where = compare(expected, actual)
            detail = f"worst: {where}; misplaced: {wrong}; decode vs full pass {full_diff:.1e}"
            ok = passed and not wrong and full_diff <= TOL
            record(records, "decode", name, shape, diff, ok, detail)


def _caches(module) -> dict:
    """Every cache variable of ``module`` by path (values as float64 NumPy)."""
    out = {}
    for path, variable in nnx.to_flat_state(nnx.state(module, nnx.Cache)):
        out[".".join(map(str, path))] = np.asarray(variable[...], np.float64)
    return out


def _cache_placement(module, mesh) -> list[str]:
    """Cache variables not where the layout says (keys/values by heads, the index replicated)."""
    wrong = []
    for path, variable in nnx.to_flat_state(nnx.state(module, nnx.Cache)):
        value = variable[...]
        if path[-1] == "cache_index":
            want = P()
        elif value.shape[-2] == 1:  # one head: features over model
            want = P("data", None, None, "model")
        else:
            want = P("data", None, "model", None)
        if not value.sharding.is_equivalent_to(NamedSharding(mesh, want), value.ndim):
            wrong.append(f"{'.'.join(map(str, path))}: {value.sharding.spec}, want {want}")
    return wrong


def check_missing_axes(records):
    """A mesh without ``model`` (or ``data``) counts it as size 1: replicated parameters."""
    name = "MultiHeadAttention"
    module = LAYERS[name][0]()
    module.eval()
    inputs = make_inputs(name)
    reference = np.asarray(module(*inputs))
    for names in (("data",), ("model",)):
        mesh = make_mesh((8,), names)
        sharded = fa.shard(nnx.clone(module), mesh)
        kernel = sharded.W_query.kernel[...]
        spec = kernel.sharding.spec
        with jax.set_mesh(mesh):
            out = np.asarray(nnx.jit(lambda m, x: m(x))(sharded, shard_inputs(inputs, mesh)[0]))
        diff = float(np.abs(out - reference).max())
        expected = P(None, None) if names == ("data",) else P(None, "model")
        ok = diff <= TOL and placed_as(kernel, mesh, expected)
        record(records, "missing_axis", name, (8,), diff, ok, f"mesh axes {names}, spec {spec}")


def check_load_keeps_sharding(records):
    """``load_state_dict`` into a sharded module writes the values and keeps the shardings."""
    mesh = make_mesh((2, 4))
    module = fa.shard(LAYERS["MultiHeadAttention"][0](), mesh)
    other = LAYERS["MultiHeadAttention"][0]()
    other.W_query.kernel[...] = other.W_query.kernel[...] + 1.0
    before = {k: v[...].sharding for k, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}
    fa.load_state_dict(module, fa.state_dict(other))
    after = {k: v[...].sharding for k, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}
    same_values = all(
        np.array_equal(v, fa.state_dict(other)[k]) for k, v in fa.state_dict(module).items()
    )
    moved = [".".join(map(str, k)) for k in before if before[k] != after[k]]
    record(
        records,
        "load_keeps_sharding",
        "MultiHeadAttention",
        (2, 4),
        0.0,
        same_values and not moved,
        f"values loaded: {same_values}; shardings changed: {moved}",
    )


def check_orbax(records):
    """Save a sharded module with orbax on one mesh, restore it into a module with other weights
    on another mesh: the parameters come back bit for bit with the new mesh's shardings, and the
    outputs equal those of the original parameters placed on the new mesh bit for bit (and the
    old mesh's within 1e-5)."""
    import orbax.checkpoint as ocp

    for name, source, target in (
        ("MultiHeadAttention", (2, 4), (4, 2)),
        ("MultiHeadedAttention", (8, 1), (1, 8)),
    ):
        make, n, _ = LAYERS[name]
        inputs = make_inputs(name)
        mesh_a, mesh_b = make_mesh(source), make_mesh(target)
        original = make()
        original.eval()
        on_a = fa.shard(nnx.clone(original), mesh_a)
        fresh = make()
        fresh.eval()
        nnx.update(fresh, jax.tree.map(lambda a: a + 1.0, nnx.state(fresh, nnx.Param)))
        fresh = fa.shard(fresh, mesh_b)
        params = lambda m: nnx.to_flat_state(nnx.state(m, nnx.Param))  # noqa: E731
        problems = (
            []
            if not any(
                np.array_equal(got[...], want[...])
                for (_, got), (_, want) in zip(params(fresh), params(original), strict=True)
            )
            else ["the target's weights equal the checkpoint's before the restore"]
        )
        with tempfile.TemporaryDirectory() as tmp:
            checkpointer = ocp.StandardCheckpointer()
            checkpointer.save(f"{tmp}/ckpt", nnx.state(on_a, nnx.Param))
            checkpointer.wait_until_finished()
            abstract = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                nnx.state(fresh, nnx.Param),
            )
            nnx.update(fresh, checkpointer.restore(f"{tmp}/ckpt", abstract))
            checkpointer.close()
        for (path, got), (_, want) in zip(params(fresh), params(original), strict=True):
            label = ".".join(map(str, path))
            if not np.array_equal(np.asarray(got[...]), np.asarray(want[...])):
                problems.append(f"{label} differs")
            sharding = got[...].sharding
            on_target = sharding.mesh.devices.shape == tuple(target)
            if not placed_as(got[...], mesh_b, P(*expected_axes(path))) or not on_target:
                problems.append(f"{label} on {sharding}")
        on_b = fa.shard(nnx.clone(original), mesh_b)
        run = nnx.jit(lambda m, xs, extra: m(*xs, *extra))
        with jax.set_mesh(mesh_b):
            xs_b = shard_inputs(inputs, mesh_b)
            out_restored = np.asarray(run(fresh, xs_b[:n], xs_b[n:]))
            out_original = np.asarray(run(on_b, xs_b[:n], xs_b[n:]))
        with jax.set_mesh(mesh_a):
            xs_a = shard_inputs(inputs, mesh_a)
            out_a = np.asarray(run(on_a, xs_a[:n], xs_a[n:]))
        if not np.array_equal(out_restored, out_original):
            problems.append("outputs on the new mesh differ from the original's")
        diff = float(np.abs(out_restored - out_a).max())
        label = f"{'x'.join(map(str, source))} -> {'x'.join(map(str, target))}"
        ok = not problems and diff <= TOL
        record(records, "orbax_round_trip", name, target, diff, ok, f"{label}: {problems}")


def check_errors(records):
    """Sizes that do not divide over ``model``, explicit axes and non-meshes are refused."""
    mesh = make_mesh((2, 4))
    cases = [
        (
            lambda: fa.MultiHeadAttention(6, 12, T, 0.0, num_heads=6, rngs=nnx.Rngs(0)),
            mesh,
            ValueError,
            "num_heads (6) must be divisible by the mesh's model axis (4)",
        ),
        (
            lambda: fa.MultiHeadedAttention(2, 8, 0.0, rngs=nnx.Rngs(0)),
            mesh,
            ValueError,
            "num_heads (2) must be divisible by the mesh's model axis (4)",
        ),
        (
            lambda: fa.CausalAttention(6, 6, T, 0.0, rngs=nnx.Rngs(0)),
            mesh,
            ValueError,
            "d_out (6) must be divisible by the mesh's model axis (4)",
        ),
        (
            lambda: fa.MultiHeadAttentionWrapper(6, 6, T, 0.0, num_heads=2, rngs=nnx.Rngs(0)),
            mesh,
            ValueError,
            "d_out (6) of heads.0 must be divisible by the mesh's model axis (4)",
        ),
        (
            lambda: fa.SelfAttention_v1(6, 6, rngs=nnx.Rngs(0)),
            mesh,
            ValueError,
            "d_out (6) must be divisible by the mesh's model axis (4)",
        ),
        (
            lambda: fa.MultiHeadAttention(6, 16, T, 0.0, num_heads=8, rngs=nnx.Rngs(0)),
            jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2),
            ValueError,
            "mesh axis 'data' (Explicit) must be Auto",
        ),
        (
            lambda: fa.MultiHeadAttention(6, 16, T, 0.0, num_heads=8, rngs=nnx.Rngs(0)),
            (2, 4),
            TypeError,
            "mesh (tuple) must be a jax.sharding.Mesh",
        ),
    ]
    for make, mesh_arg, error_type, message in cases:
        module = make()
        before = [v[...].sharding for _, v in nnx.to_flat_state(nnx.state(module, nnx.Param))]
        try:
            fa.shard(module, mesh_arg)
        except error_type as error:
            after = [v[...].sharding for _, v in nnx.to_flat_state(nnx.state(module, nnx.Param))]
            ok = str(error).startswith(message) and before == after
            detail = f"{error_type.__name__}: {error}; untouched: {before == after}"
        except Exception as error:  # noqa: BLE001 - the record names what went wrong
            ok, detail = False, f"{type(error).__name__} (want {error_type.__name__}): {error}"
        else:
            ok, detail = False, f"no error (want {error_type.__name__}: {message})"
        record(records, "error", type(module).__name__, None, 0.0, ok, detail)


def check_cache_error(records):
    """A cache whose batch does not divide over ``data`` is refused by ``init_cache`` on a
    sharded layer, named."""
    module = fa.shard(LAYERS["MultiHeadAttention"][0](), make_mesh((2, 4)))
    message = "cached_key.shape[0] (1) must be divisible by the mesh's data axis (2)"
    try:
        module.init_cache(1)
    except ValueError as error:
        ok, detail = str(error) == message, str(error)
    else:
        ok, detail = False, f"no error (want ValueError: {message})"
    record(records, "error", "MultiHeadAttention", (2, 4), 0.0, ok, detail)


def check_created_under_jit(records):
    """``shard`` inside ``nnx.jit``: the layer comes out of the compiled function already placed
    (never whole on one device), with the same weights as an eager one."""
    mesh = make_mesh((2, 4))
    make = LAYERS["MultiHeadAttention"][0]
    created = nnx.jit(lambda: fa.shard(make(), mesh))()
    eager = make()
    problems = []
    for (path, got), (_, want) in zip(
        nnx.to_flat_state(nnx.state(created, nnx.Param)),
        nnx.to_flat_state(nnx.state(eager, nnx.Param)),
        strict=True,
    ):
        label = ".".join(map(str, path))
        expected = NamedSharding(mesh, P(*expected_axes(path)))
        if not got[...].sharding.is_equivalent_to(expected, got[...].ndim):
            problems.append(f"{label} on {got[...].sharding.spec}")
        if not np.array_equal(np.asarray(got[...]), np.asarray(want[...])):
            problems.append(f"{label} differs")
    record(
        records,
        "created_under_jit",
        "MultiHeadAttention",
        (2, 4),
        0.0,
        not problems,
        "; ".join(problems),
    )


def check_constrain(records):
    """``constrain``: a no-op without a mesh; under ``jax.set_mesh`` it places ``(b, t, h, d)``
    as ``("data", None, "model", None)``; axes that do not divide are left unconstrained."""
    from flax_attention.sharding import HEADS, constrain

    mesh = make_mesh((2, 4))
    x = np.ones((4, 3, 8, 2), np.float32)  # (b, t, h, d)
    problems = []
    if constrain(x, HEADS) is not x:
        problems.append("without a mesh, constrain changed x")

    def placed(x, axes):
        with jax.set_mesh(mesh):
            return jax.jit(lambda x: constrain(x * 1.0, axes))(x).sharding

    cases = [
        (x, HEADS, P("data", None, "model", None)),  # (b, t, h, d)
        (np.ones((2, 4, 3, 8, 2), np.float32), HEADS, P("data", None, None, "model", None)),
        (np.ones((3, 8, 2), np.float32), HEADS, P(None, "model", None)),  # unbatched: no data
        (np.ones((3, 3, 8, 2), np.float32), HEADS, P(None, None, "model", None)),  # b=3 odd
        (np.ones((4, 3, 6, 2), np.float32), HEADS, P("data", None, None, None)),  # h=6 odd
    ]
    for value, axes, expected in cases:
        got = placed(value, axes)
        if not got.is_equivalent_to(NamedSharding(mesh, expected), value.ndim):
            problems.append(f"{value.shape}: {got.spec}, want {expected}")
    record(records, "constrain", "", (2, 4), 0.0, not problems, "; ".join(problems))


def check_readme_example(records):
    """The README's "Scaling out" block runs as written and shards what it says."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "docs/sharding.md").read_text()
    (block,) = [
        b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "fa.shard(" in b
    ]
    namespace: dict = {}
    try:
        exec(compile(block, "README.md scaling out", "exec"), namespace)
        y, y_step, mha = namespace["y"], namespace["y_step"], namespace["mha"]
        mesh, cache = namespace["mesh"], mha.cached_key[...]
        cache_spec = cache.sharding.spec
        ok = y.shape == (8, 128, 64) and placed_as(y, mesh, P("data"))
        ok = ok and y_step.shape == (8, 1, 64) and placed_as(cache, mesh, HEADS_SPEC)
        detail = f"y {y.shape} {y.sharding.spec}, step {y_step.shape}, cache {cache_spec}"
    except Exception as error:  # noqa: BLE001 - the record names what went wrong
        ok, detail = False, f"{type(error).__name__}: {error}"
    record(records, "readme_example", "MultiHeadAttention", (2, 4), 0.0, ok, detail)


PARTS = {
    "layers": (check_layers,),
    "decode": (check_decode,),
    "placement": (
        check_missing_axes,
        check_load_keeps_sharding,
        check_orbax,
        check_errors,
        check_cache_error,
        check_created_under_jit,
        check_constrain,
        check_readme_example,
    ),
}


def main(part: str, path: str) -> None:
    jax.config.update("jax_default_matmul_precision", "highest")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    if jax.device_count() < 8:
        raise SystemExit(f"jax.device_count() ({jax.device_count()}) must be >= 8 (XLA_FLAGS)")
    records: list[dict] = []
    timings = {}
    for check in PARTS[part]:
        start = time.perf_counter()
        check(records)
        timings[check.__name__] = round(time.perf_counter() - start, 2)
    with open(path, "w") as f:
        json.dump({"records": records, "timings": timings}, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
