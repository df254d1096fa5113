"""Sharded layers against one device, on 8 virtual CPU devices: ordinary pytest tests.

JAX fixes its device count when its backend starts, so these run in a pytest of their own:
``test_sharding.py`` starts it with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
and XLA's quick CPU code generation (``conftest.QUICK_CODEGEN``: the same programs,
compiled in a third of the time); the main pytest keeps its single device. By hand:

    XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 \
        --xla_cpu_use_fusion_emitters=false" python -m pytest \
        conformance_tests/tests/sharded_tests.py

Meshes ``(data, model)``: (8, 1), (1, 8), (2, 4), (4, 2), each with ``Auto`` axes and with the
``Explicit`` axes that ``jax.make_mesh`` makes by default (sharding in types). Every comparison
is against the same layer on one device, within ``TOL * max(1, max|reference|)`` (the
repository's float32 rule).
"""

from __future__ import annotations

import pathlib
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_attention as fa
from flax_attention.core import select_implementation
from flax_attention.kernels import dropout_hash, native
from flax_attention.masking import AttentionMask
from flax_attention.mesh import HEADS, constrain
from flax_attention.models import GPTModel, Qwen3Model, annotated, generate

if jax.device_count() < 8:  # test_sharding.py runs this file with 8 devices
    pytest.skip(
        f"jax.device_count() ({jax.device_count()}) must be >= 8: run through test_sharding.py "
        "or with XLA_FLAGS=--xla_force_host_platform_device_count=8",
        allow_module_level=True,
    )

ROOT = pathlib.Path(__file__).resolve().parents[2]
MESHES = ((8, 1), (1, 8), (2, 4), (4, 2))
AXIS_TYPES = ("auto", "explicit")
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
    # The C++ kernel (an FFI custom call): each device runs it on its batch rows and heads.
    "MultiHeadAttention[native]": (
        lambda: fa.MultiHeadAttention(
            6, 16, T, 0.0, num_heads=8, implementation="native", rngs=nnx.Rngs(0)
        ),
        1,
        6,
    ),
    "SelfAttention_v1": (lambda: fa.SelfAttention_v1(6, 8, rngs=nnx.Rngs(4)), 1, 6),
    "SelfAttention_v2": (lambda: fa.SelfAttention_v2(6, 8, qkv_bias=True, rngs=nnx.Rngs(5)), 1, 6),
}
#: Checked on every mesh; the others (the same placement as ``CausalAttention``'s projections,
#: or the same layer with another kernel) on 2x4 only.
EVERY_MESH = ("MultiHeadAttention", "MultiHeadedAttention", "CausalAttention")
EVERY_MESH += ("MultiHeadAttentionWrapper",)
MULTI_HEAD = ("MultiHeadAttention", "MultiHeadedAttention")
#: One head, no output projection: the output keeps its ``d_out`` features over ``model``.
SINGLE_HEAD = ("CausalAttention", "SelfAttention_v1", "SelfAttention_v2")
DECODERS = ("MultiHeadAttention", "CausalAttention", "MultiHeadAttentionWrapper")

#: What the partition metadata must say, by the parameter's last two path parts.
CACHE_SPEC = P("data", "model", None, None)  # (b, h, max_length, d): the decode cache
ROW = ("model", None)  # out_proj, proj_weights.3: input features (heads) over model
COLUMN = (None, "model")  # query/key/value projections: output features (heads) over model

LAYER_CASES = [
    (name, mesh, kind)
    for name in LAYERS
    for mesh in (MESHES if name in EVERY_MESH else ((2, 4),))
    for kind in AXIS_TYPES
]


def _id(value):
    return "x".join(map(str, value)) if isinstance(value, tuple) else str(value)


def expected_axes(path: tuple) -> tuple:
    owner = ".".join(str(p) for p in path[:-1])
    reduces = owner.endswith("out_proj") or owner.endswith("proj_weights.3")
    if path[-1] == "kernel":
        return ROW if reduces else COLUMN
    if path[-1] == "bias":
        return (None,) if reduces else ("model",)
    return COLUMN  # SelfAttention_v1's raw (d_in, d_out) matrices


def expected_out_axes(name) -> tuple:
    """Where a layer's output ``(b, t, d_out)`` goes on an ``Explicit`` mesh (its type): rows over
    ``data``; the features whole, gathered by ``out_proj``'s all-reduce or, in the wrapper, before
    its heads are concatenated; a single head's over ``model``, like its projections."""
    return ("data", None, "model" if name in SINGLE_HEAD else None)


def make_mesh(shape, names=("data", "model"), kind="auto"):
    """A mesh of the first ``prod(shape)`` devices; ``kind="explicit"`` is what
    ``jax.make_mesh(shape, names)`` gives by default in jax 0.10."""
    if kind == "explicit":
        mesh = jax.make_mesh(shape, names)
        assert set(mesh.axis_types) == {AxisType.Explicit}, mesh.axis_types
        return mesh
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def make_inputs(name):
    _, n_inputs, d_in = LAYERS[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    inputs = [rng.standard_normal((B, T, d_in)).astype(np.float32) for _ in range(n_inputs)]
    if name == "MultiHeadedAttention":
        inputs.append(np.tril(np.ones((T, T), np.float32))[None])  # (1, t, s) causal mask
    return inputs


def shard_inputs(inputs, mesh):
    out = []
    for x in inputs:
        batched = "data" in mesh.axis_names and x.shape[0] % dict(mesh.shape)["data"] == 0
        out.append(jax.device_put(x, NamedSharding(mesh, P("data") if batched else P())))
    return out


def placed_as(array, mesh, spec) -> bool:
    """``array`` is laid out on ``mesh`` as ``spec`` says (trailing ``None``s do not matter)."""
    return array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim)


def forward_and_grads(module, inputs, cotangent):
    """Output and the gradients of ``sum(out * cotangent)`` w.r.t. parameters and inputs, by
    name, and the compiled program's text."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    n = LAYERS[type(module).__name__][1]  # differentiable inputs; the rest (a mask) is not

    def run(params, xs, extra):
        def loss(params, xs):
            # copy: a layer in train mode counts its dropout draws in this trace
            out = nnx.merge(graphdef, params, rest, copy=True)(*xs, *extra)
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


#: A layer's output, in one compiled program (op by op, each operation would compile on its own).
_forward = nnx.jit(lambda m, xs, extra: m(*xs, *extra))


def native_calls(hlo: str) -> list[tuple[str, list[tuple[int, ...]]]]:
    """Every native kernel call of a compiled program's text: its target (forward or backward)
    and its operands' shapes (from the custom call's ``operand_layout_constraints``)."""
    calls = []
    for target, operands in re.findall(
        r'custom_call_target="flax_attention_native_(\w+)", '
        r"operand_layout_constraints=\{(.*?)\}, api_version",
        hlo,
    ):
        shapes = re.findall(r"\b[a-z]+\d*\[([\d,]*)\]", operands)
        calls.append((target, [tuple(int(n) for n in shape.split(",") if n) for shape in shapes]))
    return calls


def assert_native_runs_per_shard(hlo: str, mesh_shape, qkv_shapes, backward=True) -> None:
    """The compiled program calls the native kernel on one device's share only: queries, keys
    and values (global ``qkv_shapes``, ``(b, t|s, h, d)``) as ``(b / data, t|s, h / model, d)``
    and the hash's batch and head numbers as ``(b / data,)``, ``(h / model,)``, in the forward
    and (``backward``) the backward, and nothing is all-gathered (every device would then
    compute every head)."""
    data, model = mesh_shape
    local = [(b // data, n, h // model, d) for b, n, h, d in qkv_shapes]
    (b, _, h, _) = qkv_shapes[0]
    calls = native_calls(hlo)
    targets = sorted({target for target, _ in calls})
    assert targets == (["backward", "forward"] if backward else ["forward"]), targets
    for target, shapes in calls:
        assert shapes[:3] == local, f"{target}: q, k, v {shapes[:3]}, want {local}"
        assert shapes[6:8] == [(b // data,), (h // model,)], f"{target}: {shapes[6:8]}"
    assert hlo.count("all-gather(") == 0, "the native kernel's operands are all-gathered"


def assert_close(reference: dict, actual: dict, what: str) -> float:
    """Every same-named tensor within ``TOL * max(1, max|reference|)``; the failure names each
    tensor that is not, with its max diff and scale. Returns the max diff."""
    worst, failed = 0.0, []
    for key in reference:
        ref = np.asarray(reference[key], np.float64)
        diff = float(np.max(np.abs(ref - np.asarray(actual[key], np.float64))))
        scale = float(np.abs(ref).max())
        worst = max(worst, diff)
        if not diff <= TOL * max(1.0, scale):
            failed.append(f"{key}: max diff {diff:.3e} (max|ref| {scale:.3g})")
    assert not failed, f"{what} differs from one device: " + "; ".join(failed)
    return worst


_REFERENCES: dict = {}


def single_device(name):
    """The layer (eval mode), its inputs, the cotangent and its one-device results, once."""
    if name not in _REFERENCES:
        make = LAYERS[name][0]
        module = make()
        module.eval()
        inputs = make_inputs(name)
        graphdef, state = nnx.split(module)
        out = jax.eval_shape(lambda s: nnx.merge(graphdef, s)(*inputs), state)
        cotangent = np.random.default_rng(7).standard_normal(out.shape).astype(np.float32)
        reference, _ = forward_and_grads(module, inputs, cotangent)
        _REFERENCES[name] = (module, inputs, cotangent, reference)
    return _REFERENCES[name]


@pytest.mark.parametrize(("name", "shape", "kind"), LAYER_CASES, ids=_id)
def test_forward_and_gradients_equal_one_device(name, shape, kind):
    """Forward and the gradients of every parameter and input equal one device; every
    parameter sits where its metadata says; on ``Explicit`` axes the output is typed as
    ``expected_out_axes`` says (``Auto`` axes leave its layout to XLA); the multi-head layers'
    compiled forward and backward have no all-gather (q/k/v stay split by heads; only
    ``out_proj`` reduces over ``model``)."""
    module, inputs, cotangent, reference = single_device(name)
    mesh = make_mesh(shape, kind=kind)
    sharded = fa.shard(nnx.clone(module), mesh)
    with jax.set_mesh(mesh):
        actual, hlo = forward_and_grads(sharded, shard_inputs(inputs, mesh), cotangent)
    assert_close(reference, actual, f"{name} on {_id(shape)} ({kind})")
    if kind == "explicit":
        want, got = P(*expected_out_axes(name)), actual["out"].sharding
        assert placed_as(actual["out"], mesh, want), f"output laid out as {got.spec}, not {want}"

    for path, variable in nnx.to_flat_state(nnx.state(sharded, nnx.Param)):
        label = ".".join(map(str, path))
        axes = expected_axes(path)
        assert tuple(variable.get_metadata().get("out_sharding") or ()) == axes, label
        assert placed_as(variable[...], mesh, P(*axes)), f"{label}: {variable[...].sharding}"
    if name.split("[")[0] in MULTI_HEAD and shape[1] > 1:
        assert hlo.count("all-gather(") == 0, f"{name} on {_id(shape)} ({kind}) all-gathers"
    if name.endswith("[native]"):
        assert_native_runs_per_shard(hlo, shape, [(B, T, 8, 2)] * 3)


def _caches(module) -> dict:
    """Every cache variable of ``module`` by path (values as float64 NumPy)."""
    return {
        ".".join(map(str, path)): np.asarray(variable[...], np.float64)
        for path, variable in nnx.to_flat_state(nnx.state(module, nnx.Cache))
    }


_decode_step = nnx.jit(lambda m, x: m(x, decode=True))


def _decode(module, tokens, mesh=None, first_whole=False):
    """The ``tokens`` steps through the decode cache: outputs ``(b, T, d_out)``. On ``mesh``
    the tokens are split over ``data``; ``first_whole``: the first step's as NumPy instead (a
    replicated batch, which the cache write lays out as the cache)."""
    outs = []
    for i, x in enumerate(tokens):
        if mesh is not None and not (first_whole and i == 0):
            x = shard_inputs([x], mesh)[0]
        outs.append(np.asarray(_decode_step(module, x)))
    return np.concatenate(outs, axis=-2)


_DECODE_REFERENCES: dict = {}


def single_device_decode(name):
    """The layer of ``single_device``, its decode steps' tokens, its one-device decode (outputs
    and caches) and its full causal pass, once per layer (every mesh compares with them)."""
    if name not in _DECODE_REFERENCES:
        module, _, _, _ = single_device(name)
        d_in = LAYERS[name][2]
        rng = np.random.default_rng(sum(map(ord, name)) + 1)
        tokens = rng.standard_normal((T, B, 1, d_in)).astype(np.float32)  # T steps of 1 token
        reference = nnx.clone(module)
        reference.init_cache(B)
        expected = {"out": _decode(reference, tokens), **_caches(reference)}
        full = np.asarray(_forward(module, [np.concatenate(list(tokens), axis=-2)], []))
        _DECODE_REFERENCES[name] = (module, tokens, expected, full)
    return _DECODE_REFERENCES[name]


@pytest.mark.parametrize("kind", AXIS_TYPES)
@pytest.mark.parametrize("shape", MESHES, ids=_id)
@pytest.mark.parametrize("name", DECODERS)
def test_decode_equals_one_device(name, shape, kind):
    """Token-by-token decode equals one-device decode (outputs and the caches themselves),
    which equals the full causal pass; the caches sit on the mesh by heads (one head: its
    ``d_out`` features over ``model``), the index replicated. Half the meshes shard the layer
    before ``init_cache`` (the cache follows the parameters), half after (``shard`` places it).
    On ``Explicit`` axes the first step's tokens come as NumPy, a replicated batch (its keys and
    values are relaid as the cache before they are written), the others split over ``data``."""
    module, tokens, expected, full = single_device_decode(name)
    np.testing.assert_allclose(expected["out"], full, atol=TOL, err_msg="decode vs full pass")

    mesh = make_mesh(shape, kind=kind)
    sharded = nnx.clone(module)
    if shape in ((8, 1), (2, 4)):
        fa.shard(sharded, mesh)
        sharded.init_cache(B)  # placed on the parameters' mesh at once
    else:
        sharded.init_cache(B)
        fa.shard(sharded, mesh)
    for path, variable in nnx.to_flat_state(nnx.state(sharded, nnx.Cache)):
        value = variable[...]
        if path[-1] == "cache_index":
            want = P()
        elif value.shape[-3] == 1:  # one head: features over model
            want = P("data", None, None, "model")
        else:
            want = CACHE_SPEC
        assert placed_as(value, mesh, want), f"{'.'.join(map(str, path))}: {value.sharding}"
    with jax.set_mesh(mesh):
        actual = {"out": _decode(sharded, tokens, mesh, first_whole=kind == "explicit")}
    actual.update(_caches(sharded))
    assert_close(expected, actual, f"{name} decode on {_id(shape)} ({kind})")


# ---- the book's GPTModel (flax_attention.models): the whole model on a mesh ------------------

#: A small GPTModel whose heads (4), emb_dim (32) and hidden features (128) divide the model axis.
#: One block: its attention, MLP and norms are each laid out and checked, and its output feeds
#: the final norm and the head as it would feed a second block; a second block would repeat the
#: same layers and double each compilation (the slowest of this file).
GPT_CFG = {
    "vocab_size": 97, "context_length": 16, "emb_dim": 32, "n_heads": 4, "n_layers": 1,
    "drop_rate": 0.0, "qkv_bias": True,
}  # fmt: skip


def _gpt_model(tied: bool) -> GPTModel:
    model = GPTModel({**GPT_CFG, "tie_word_embeddings": tied}, rngs=nnx.Rngs(0))
    model.eval()
    return model


def gpt_axes(path) -> tuple:
    """Where a GPTModel parameter goes: the attention's as ``expected_axes``; the MLP's first
    Linear splits its hidden (output) features over ``model``, its second its input features;
    embeddings, norms and the head replicated (``()``)."""
    names = tuple(map(str, path))
    if "att" in names:
        return expected_axes(path)
    if names[-3:-1] == ("layers", "0"):
        return COLUMN if names[-1] == "kernel" else ("model",)
    if names[-3:-1] == ("layers", "2"):
        return ROW if names[-1] == "kernel" else (None,)
    return ()


@nnx.jit
def gpt_logits_and_grads(model, ids, cotangent):
    """Logits and the gradient of ``sum(logits * cotangent)`` w.r.t. every parameter, by name."""

    def loss(model):
        logits = model(ids)  # (b, t, V)
        return (logits * cotangent).sum(), logits

    (_, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    flat = {"logits": logits}
    flat.update({"grad " + ".".join(map(str, p)): g[...] for p, g in nnx.to_flat_state(grads)})
    return flat


_GPT_REFERENCES: dict = {}


@pytest.mark.parametrize(
    ("tied", "kind"),
    [(False, "auto"), (False, "explicit"), (True, "explicit")],
    ids=["book_head-auto", "book_head-explicit", "tied_head-explicit"],
)
def test_forward_and_gradients_of_the_gpt_model_equal_one_device(tied, kind):
    """The book's GPTModel (its own ``out_head``; or GPT-2's head tied to ``tok_emb``) on 2x4:
    every parameter where ``gpt_axes`` says (the MLP's hidden features over ``model``, the
    embeddings and the head replicated); logits and the gradient of every parameter (the tied
    embedding's sums both uses) equal one device."""
    if tied not in _GPT_REFERENCES:
        rng = np.random.default_rng(21)
        ids = rng.integers(0, GPT_CFG["vocab_size"], (B, 8))
        cotangent = rng.standard_normal((B, 8, GPT_CFG["vocab_size"])).astype(np.float32)
        model = _gpt_model(tied=tied)
        reference = gpt_logits_and_grads(nnx.clone(model), ids, cotangent)
        _GPT_REFERENCES[tied] = model, ids, cotangent, reference
    model, ids, cotangent, reference = _GPT_REFERENCES[tied]
    mesh = make_mesh((2, 4), kind=kind)
    sharded = fa.shard(nnx.clone(model), mesh)
    params = nnx.to_flat_state(nnx.state(sharded, nnx.Param))
    blocks = GPT_CFG["n_layers"] * 16
    assert len(params) == 2 + blocks + 2 + (not tied)  # embeddings, blocks, final norm, head
    for path, variable in params:
        value = variable[...]
        assert placed_as(value, mesh, P(*gpt_axes(path))), f"{path}: {value.sharding}"
    with jax.set_mesh(mesh):
        ids_on_mesh, cotangent_on_mesh = shard_inputs([ids, cotangent], mesh)
        actual = gpt_logits_and_grads(sharded, ids_on_mesh, cotangent_on_mesh)
    assert placed_as(actual["logits"], mesh, P("data")), actual["logits"].sharding
    worst = assert_close(reference, actual, f"GPTModel (tied {tied}) on 2x4 ({kind})")
    print(f"GPTModel (tied {tied}) 2x4 ({kind}): logits, gradients max abs diff {worst:.2e}")


#: The book's mixture-of-experts Qwen3, small: 4 experts (2 a token) over the model axis; 8
#: query heads over 4 key heads, both dividing it.
QWEN3_MOE_CFG = {
    "vocab_size": 97, "context_length": 16, "emb_dim": 32, "n_heads": 8, "n_layers": 1,
    "head_dim": 8, "qk_norm": True, "n_kv_groups": 4, "rope_base": 1e4, "num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 16, "dtype": jnp.float32,
}  # fmt: skip


def test_forward_and_gradients_of_the_qwen3_moe_model_equal_one_device():
    """The book's Qwen3 mixture of experts on 2x4 (explicit axes): each device holds one
    expert of every stacked parameter (``P("model", None, None)``); logits, every gradient and
    the greedy tokens of a decode (whose steps gather their experts on one device, and run all
    of them where they are on the mesh) equal one device."""
    model = Qwen3Model(QWEN3_MOE_CFG, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(23)
    ids = rng.integers(0, QWEN3_MOE_CFG["vocab_size"], (B, 8))
    cotangent = rng.standard_normal((B, 8, QWEN3_MOE_CFG["vocab_size"])).astype(np.float32)
    reference = gpt_logits_and_grads(nnx.clone(model), ids, cotangent)
    tokens = np.asarray(generate(model, ids[:, :4], 6, 16))
    mesh = make_mesh((2, 4), kind="explicit")
    sharded = fa.shard(nnx.clone(model), mesh)
    for name in ("fc1", "fc2", "fc3"):
        value = getattr(sharded.trf_blocks[0].ff, name)[...]
        assert placed_as(value, mesh, P("model", None, None)), f"{name}: {value.sharding}"
    with jax.set_mesh(mesh):
        ids_on_mesh, cotangent_on_mesh = shard_inputs([ids, cotangent], mesh)
        actual = gpt_logits_and_grads(sharded, ids_on_mesh, cotangent_on_mesh)
        got = generate(sharded, ids[:, :4], 6, 16)
    worst = assert_close(reference, actual, "Qwen3 MoE on 2x4 (explicit)")
    print(f"Qwen3 MoE 2x4 (explicit): logits, gradients max abs diff {worst:.2e}")
    np.testing.assert_array_equal(np.asarray(got), tokens)


@pytest.mark.parametrize("kind", AXIS_TYPES)
def test_decode_greedy_generate_of_the_gpt_model_equals_one_device(kind):
    """The book's GPTModel on 2x4 generates, from a left-padded batch with its mask, the tokens
    one device generates (cache steps, then the cropped window past ``context_size``), whether
    the ids come split over ``data`` or as NumPy (placed by rows, as the decode caches split
    their batch); the caches are dropped after; a batch the data axis does not divide is
    refused, naming both. (Untied: this random tied model repeats one token per row.)"""
    if "generate" not in _GPT_REFERENCES:  # one device's tokens, once for both axis types
        model = _gpt_model(tied=False)
        rng = np.random.default_rng(22)
        ids = rng.integers(1, GPT_CFG["vocab_size"], (B, 6))
        mask = np.ones_like(ids)
        for row in range(B):
            ids[row, : row % 4], mask[row, : row % 4] = 0, 0  # rows padded by 0 to 3 tokens
        expected = np.asarray(generate(model, ids, 14, 12, attention_mask=mask))  # 7 cached steps
        _GPT_REFERENCES["generate"] = model, ids, mask, expected
    model, ids, mask, expected = _GPT_REFERENCES["generate"]
    assert len(np.unique(expected[:, 6:])) > 10, "one device repeats itself: a weak check"
    mesh = make_mesh((2, 4), kind=kind)
    sharded = fa.shard(nnx.clone(model), mesh)
    with jax.set_mesh(mesh):
        ids_on_mesh, mask_on_mesh = shard_inputs([ids, mask], mesh)
        got = generate(sharded, ids_on_mesh, 14, 12, attention_mask=mask_on_mesh)
        plain = generate(sharded, ids, 14, 12, attention_mask=mask)  # NumPy in: placed by rows
    assert placed_as(got, mesh, P("data")), got.sharding
    equal = int((np.asarray(got) == expected).sum())
    print(f"GPTModel 2x4 ({kind}) generate: {equal} of {expected.size} tokens equal one device")
    np.testing.assert_array_equal(np.asarray(got), expected)
    np.testing.assert_array_equal(np.asarray(plain), expected)
    assert all(block.att.cached_key is None for block in sharded.trf_blocks)
    with pytest.raises(ValueError) as raised, jax.set_mesh(mesh):
        generate(sharded, ids[:3], 2, 12)
    assert str(raised.value).startswith(
        "idx batch (3) must be divisible by the mesh's data axis (2)"
    ), str(raised.value)


# ---- the Annotated Transformer's model (flax_attention.models.annotated) on a mesh ----------


@nnx.jit
def _annotated_forward(model, src, tgt, src_mask, tgt_mask):
    """The decoder output, in one compiled program (outside ``jit`` each of the model's
    operations compiles on its own, for each mesh: three times the time)."""
    return model(src, tgt, src_mask, tgt_mask)


@pytest.mark.parametrize("kind", AXIS_TYPES)
def test_the_annotated_model_on_a_mesh_equals_one_device(kind):
    """The post's encoder-decoder (8 heads, d_ff 64: both divide every model axis) on 2x4: each
    attention's projections and the feed-forward's hidden features over ``model``; the decoder
    output of a padded batch, and batched greedy decoding, equal one device. The decoder's
    caches split the batch over ``data``, as every decode cache: a batch it does not divide is
    refused at ``greedy_decode``'s door, by name."""
    if "annotated" not in _GPT_REFERENCES:
        # N=1: one encoder and one decoder layer hold every kind of attention (self, masked
        # self, source) and the feed-forward; a second of each would only repeat them.
        model = annotated.make_model(13, 13, N=1, d_model=32, d_ff=64, h=8, rngs=nnx.Rngs(3))
        model.eval()
        rng = np.random.default_rng(23)
        src, tgt = rng.integers(1, 13, (B, 7)), rng.integers(1, 13, (B, 6))
        src[1::2, 4:], tgt[1::2, 3:] = 0, 0
        batch = annotated.Batch(src, tgt, pad=0)
        out = np.asarray(
            _annotated_forward(model, batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
        )
        ids = np.asarray(annotated.greedy_decode(model, src, batch.src_mask, 9, 1))
        _GPT_REFERENCES["annotated"] = model, batch, out, ids
    model, batch, out, ids = _GPT_REFERENCES["annotated"]
    mesh = make_mesh((2, 4), kind=kind)
    sharded = fa.shard(nnx.clone(model), mesh)
    layer = sharded.encoder.layers[0]
    for linear, spec in ((layer.self_attn.proj_weights[0], P(None, "model")),
                         (layer.self_attn.proj_weights[3], P("model", None)),
                         (layer.feed_forward.w_1, P(None, "model"))):  # fmt: skip
        assert placed_as(linear.kernel[...], mesh, spec), linear.kernel[...].sharding
    with jax.set_mesh(mesh):
        got = _annotated_forward(sharded, batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
        decoded = annotated.greedy_decode(sharded, batch.src, batch.src_mask, 9, 1)
    worst = assert_close({"out": out}, {"out": got}, f"annotated model on 2x4 ({kind})")
    print(f"annotated model 2x4 ({kind}): decoder output max abs diff {worst:.2e}")
    np.testing.assert_array_equal(np.asarray(decoded), ids)
    message = r"^src batch \(3\) must be divisible by the mesh's data axis \(2\)"
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=message):
        annotated.greedy_decode(sharded, batch.src[:3], batch.src_mask[:3], 9, 1)


@pytest.mark.parametrize("kind", AXIS_TYPES)
@pytest.mark.parametrize("name", MULTI_HEAD)
def test_train_mode_dropout_equals_one_device(name, kind):
    """Dropout active (rate 0.5): the sharded layer draws the same dropout mask as on one
    device (the same key from the layer's stream; JAX's random bits do not depend on the
    sharding), so the outputs agree too."""
    make = {
        "MultiHeadAttention": lambda: fa.MultiHeadAttention(
            6, 16, T, 0.5, num_heads=8, rngs=nnx.Rngs(0)
        ),
        "MultiHeadedAttention": lambda: fa.MultiHeadedAttention(8, 16, 0.5, rngs=nnx.Rngs(1)),
    }[name]
    inputs = make_inputs(name)
    n = LAYERS[name][1]
    module = make()
    if ("dropout", name) not in _REFERENCES:  # one device, train and eval mode: once a layer
        eval_mode = make()
        eval_mode.eval()
        _REFERENCES["dropout", name] = (
            np.asarray(_forward(nnx.clone(module), inputs[:n], inputs[n:])),
            np.asarray(_forward(eval_mode, inputs[:n], inputs[n:])),
        )
    expected, eval_out = _REFERENCES["dropout", name]
    mesh = make_mesh((2, 4), kind=kind)
    sharded = fa.shard(nnx.clone(module), mesh)
    with jax.set_mesh(mesh):
        xs = shard_inputs(inputs, mesh)
        actual = np.asarray(_forward(sharded, xs[:n], xs[n:]))
    dropped = np.abs(expected - eval_out).max()
    assert dropped > 1e-2, "dropout changed nothing"
    assert_close({"out": expected}, {"out": actual}, f"{name} train mode on 2x4 ({kind})")


@pytest.mark.parametrize("names", [("data",), ("model",)], ids=_id)
def test_a_mesh_without_model_or_data_counts_it_as_size_one(names):
    name = "MultiHeadAttention"
    module, inputs, _, reference = single_device(name)
    mesh = make_mesh((8,), names)
    sharded = fa.shard(nnx.clone(module), mesh)
    kernel = sharded.W_query.kernel[...]
    assert placed_as(kernel, mesh, P(None, None) if names == ("data",) else P(None, "model"))
    with jax.set_mesh(mesh):
        out = np.asarray(_forward(sharded, shard_inputs(inputs, mesh), []))
    np.testing.assert_allclose(out, reference["out"], atol=TOL)


@pytest.mark.parametrize("kind", AXIS_TYPES)
def test_load_state_dict_keeps_the_shardings(kind):
    mesh = make_mesh((2, 4), kind=kind)
    module = fa.shard(LAYERS["MultiHeadAttention"][0](), mesh)
    other = LAYERS["MultiHeadAttention"][0]()
    other.W_query.kernel[...] = other.W_query.kernel[...] + 1.0
    before = {k: v[...].sharding for k, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}
    fa.load_state_dict(module, fa.state_dict(other))
    after = {k: v[...].sharding for k, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}
    for key, value in fa.state_dict(module).items():
        np.testing.assert_array_equal(value, fa.state_dict(other)[key], err_msg=key)
    assert before == after


@pytest.mark.parametrize(
    ("name", "source", "target", "kind"),
    [
        ("MultiHeadAttention", (2, 4), (4, 2), "auto"),
        ("MultiHeadedAttention", (8, 1), (1, 8), "auto"),
        ("MultiHeadAttention", (2, 4), (4, 2), "explicit"),
    ],
    ids=_id,
)
def test_orbax_restores_a_checkpoint_onto_another_mesh(name, source, target, kind):
    """Saved from a layer on one mesh, restored into a layer with other weights on another:
    the parameters come back bit for bit with the new mesh's shardings, and the outputs equal
    those of the original weights placed on the new mesh bit for bit (the old mesh's within
    ``TOL``)."""
    import orbax.checkpoint as ocp

    make, n, _ = LAYERS[name]
    inputs = make_inputs(name)
    mesh_a, mesh_b = make_mesh(source, kind=kind), make_mesh(target, kind=kind)
    original = make()
    original.eval()
    on_a = fa.shard(nnx.clone(original), mesh_a)
    fresh = make()
    fresh.eval()
    nnx.update(fresh, jax.tree.map(lambda a: a + 1.0, nnx.state(fresh, nnx.Param)))
    fresh = fa.shard(fresh, mesh_b)

    def params(m):
        return nnx.to_flat_state(nnx.state(m, nnx.Param))

    assert not any(
        np.array_equal(got[...], want[...])
        for (_, got), (_, want) in zip(params(fresh), params(original), strict=True)
    ), "the target's weights equal the checkpoint's before the restore"
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
        np.testing.assert_array_equal(np.asarray(got[...]), np.asarray(want[...]), label)
        assert got[...].sharding.mesh.devices.shape == tuple(target), label
        assert placed_as(got[...], mesh_b, P(*expected_axes(path))), label
    on_b = fa.shard(nnx.clone(original), mesh_b)
    with jax.set_mesh(mesh_b):
        xs_b = shard_inputs(inputs, mesh_b)
        out_restored = np.asarray(_forward(fresh, xs_b[:n], xs_b[n:]))
        out_original = np.asarray(_forward(on_b, xs_b[:n], xs_b[n:]))
    with jax.set_mesh(mesh_a):
        xs_a = shard_inputs(inputs, mesh_a)
        out_a = np.asarray(_forward(on_a, xs_a[:n], xs_a[n:]))
    np.testing.assert_array_equal(out_restored, out_original)
    np.testing.assert_allclose(out_restored, out_a, atol=TOL)


@pytest.mark.parametrize(
    ("make", "mesh_arg", "error", "message"),
    [
        (
            lambda: fa.MultiHeadAttention(6, 12, T, 0.0, num_heads=6, rngs=nnx.Rngs(0)),
            (2, 4),
            ValueError,
            "num_heads (6) must be divisible by the mesh's model axis (4)",
        ),
        (
            lambda: fa.MultiHeadedAttention(2, 8, 0.0, rngs=nnx.Rngs(0)),
            (2, 4),
            ValueError,
            "num_heads (2) must be divisible by the mesh's model axis (4)",
        ),
        (
            lambda: fa.CausalAttention(6, 6, T, 0.0, rngs=nnx.Rngs(0)),
            (2, 4),
            ValueError,
            "d_out (6) must be divisible by the mesh's model axis (4)",
        ),
        (
            lambda: fa.MultiHeadAttentionWrapper(6, 6, T, 0.0, num_heads=2, rngs=nnx.Rngs(0)),
            (2, 4),
            ValueError,
            "d_out (6) of heads.0 must be divisible by the mesh's model axis (4)",
        ),
        (
            lambda: fa.SelfAttention_v1(6, 6, rngs=nnx.Rngs(0)),
            (2, 4),
            ValueError,
            "d_out (6) must be divisible by the mesh's model axis (4)",
        ),
        (
            lambda: fa.MultiHeadAttention(6, 16, T, 0.0, num_heads=8, rngs=nnx.Rngs(0)),
            None,
            TypeError,
            "mesh (tuple) must be a jax.sharding.Mesh",
        ),
        (
            lambda: GPTModel({**GPT_CFG, "n_heads": 2}, rngs=nnx.Rngs(0)),
            (2, 4),
            ValueError,
            "num_heads (2) of trf_blocks.0.att must be divisible by the mesh's model axis (4)",
        ),
    ],
    ids=["mha_heads", "annotated_heads", "causal_d_out", "wrapper_head", "v1_d_out", "tuple"]
    + ["gpt_heads"],
)
@pytest.mark.parametrize("kind", AXIS_TYPES)
def test_shard_refuses_what_does_not_divide_and_moves_nothing(make, mesh_arg, error, message, kind):
    module = make()
    mesh = (2, 4) if mesh_arg is None else make_mesh(mesh_arg, kind=kind)
    before = [v[...].sharding for _, v in nnx.to_flat_state(nnx.state(module, nnx.Param))]
    with pytest.raises(error) as raised:
        fa.shard(module, mesh)
    assert str(raised.value).startswith(message), str(raised.value)
    after = [v[...].sharding for _, v in nnx.to_flat_state(nnx.state(module, nnx.Param))]
    assert before == after, "a refused shard moved parameters"


@pytest.mark.parametrize("kind", AXIS_TYPES)
def test_init_cache_refuses_a_batch_that_does_not_divide_over_data(kind):
    module = fa.shard(LAYERS["MultiHeadAttention"][0](), make_mesh((2, 4), kind=kind))
    message = "cached_key.shape[0] (1) must be divisible by the mesh's data axis (2)"
    with pytest.raises(ValueError) as raised:
        module.init_cache(1)
    assert str(raised.value) == message
    assert module.cached_key is None and module.cache_index is None  # nothing half-made


def test_shard_under_jit_creates_a_placed_layer():
    """``shard`` inside ``nnx.jit``: the layer comes out of the compiled function already placed
    (never whole on one device), with the same weights as an eager one."""
    mesh = make_mesh((2, 4))
    make = LAYERS["MultiHeadAttention"][0]
    created = nnx.jit(lambda: fa.shard(make(), mesh))()
    eager = make()
    for (path, got), (_, want) in zip(
        nnx.to_flat_state(nnx.state(created, nnx.Param)),
        nnx.to_flat_state(nnx.state(eager, nnx.Param)),
        strict=True,
    ):
        label = ".".join(map(str, path))
        assert placed_as(got[...], mesh, P(*expected_axes(path))), label
        np.testing.assert_array_equal(np.asarray(got[...]), np.asarray(want[...]), label)


def test_constrain_places_heads_on_auto_axes_and_leaves_explicit_ones_to_the_types():
    """``constrain``: a no-op without a mesh; under ``jax.set_mesh`` with ``Auto`` axes it
    places ``(b, t, h, d)`` as ``("data", None, "model", None)``, leaving axes that do not
    divide unconstrained; with ``Explicit`` axes the input's own sharding stays."""
    mesh = make_mesh((2, 4))
    x = np.ones((4, 3, 8, 2), np.float32)  # (b, t, h, d)
    assert constrain(x, HEADS) is x

    def placed(x, axes, mesh=mesh):
        with jax.set_mesh(mesh):
            return jax.jit(lambda x: constrain(x * 1.0, axes))(x).sharding

    cases = [
        (x, P("data", None, "model", None)),  # (b, t, h, d)
        (np.ones((2, 4, 3, 8, 2), np.float32), P("data", None, None, "model", None)),
        (np.ones((3, 8, 2), np.float32), P(None, "model", None)),  # unbatched: no data
        (np.ones((3, 3, 8, 2), np.float32), P(None, None, "model", None)),  # b=3 odd
        (np.ones((4, 3, 6, 2), np.float32), P("data", None, None, None)),  # h=6 odd
    ]
    for value, expected in cases:
        got = placed(value, HEADS)
        assert got.is_equivalent_to(NamedSharding(mesh, expected), value.ndim), value.shape
    explicit = make_mesh((2, 4), kind="explicit")
    x_data = jax.device_put(x, NamedSharding(explicit, P("data")))
    got = placed(x_data, HEADS, explicit)
    assert got.is_equivalent_to(NamedSharding(explicit, P("data")), x.ndim), got


def _scaling_out_block() -> str:
    """The docs' "scaling out" example (docs/sharding.md): the one Python block that calls
    ``fa.shard(``."""
    blocks = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if path.exists():
            found = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
            blocks += [b for b in found if "fa.shard(" in b]
    assert blocks, "no Python block with fa.shard( in README.md or docs/"
    return blocks[0]


def test_the_docs_scaling_out_example_runs_and_shards_what_it_says():
    namespace: dict = {}
    exec(compile(_scaling_out_block(), "scaling out example", "exec"), namespace)
    y, y_step, mha = namespace["y"], namespace["y_step"], namespace["mha"]
    mesh, cache = namespace["mesh"], mha.cached_key[...]
    assert y.shape == (8, 128, 64) and placed_as(y, mesh, P("data")), y.sharding
    assert y_step.shape == (8, 1, 64)
    assert placed_as(cache, mesh, CACHE_SPEC), cache.sharding


#: A multi-head layer big enough (64 x 64 scores per head) that ``implementation=None`` runs
#: ``native`` on the CPU: 8 heads of 4 features.
NATIVE_T = 64


@pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.why_unavailable()}")
@pytest.mark.parametrize("kind", AXIS_TYPES)
@pytest.mark.parametrize(
    ("implementation", "kv_heads"),
    [("native", 8), (None, 8), ("native", 4)],
    ids=["native", "default", "native_grouped"],
)
def test_native_kernel_runs_on_each_devices_heads(implementation, kv_heads, kind):
    """On 2x4, ``native`` (asked for, or what the default picks here) runs once per device on
    its 4 batch rows and 2 of the 8 heads, forward and backward (the compiled program's custom
    calls have those operand shapes, no all-gather), and equals one device, output and every
    gradient (in train mode with dropout too: the kernel hashes the global batch and head
    numbers, so each device drops what one device drops). Grouped heads (4 key heads for the
    8): each device gets its 2 query heads' one key head."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((B, NATIVE_T, 16)).astype(np.float32)
    q = np.zeros((B, NATIVE_T, 8, 4), np.float32)
    assert select_implementation(q, q, dropout=nnx.Dropout(0.5, rngs=nnx.Rngs(0))) == "native"
    mesh = make_mesh((2, 4), kind=kind)
    for rate in (0.0, 0.5):
        module = fa.MultiHeadAttention(
            16, 32, NATIVE_T, rate, num_heads=8, num_kv_heads=kv_heads,
            implementation=implementation, rngs=nnx.Rngs(0),
        )  # fmt: skip
        if rate == 0.0:
            module.eval()
        cotangent = rng.standard_normal((B, NATIVE_T, 32)).astype(np.float32)
        reference, _ = forward_and_grads(nnx.clone(module), [x], cotangent)
        sharded = fa.shard(nnx.clone(module), mesh)
        with jax.set_mesh(mesh):
            actual, hlo = forward_and_grads(sharded, shard_inputs([x], mesh), cotangent)
        what = f"MultiHeadAttention[{implementation}] rate {rate} on 2x4 ({kind})"
        assert_close(reference, actual, what)
        kv_shape = (B, NATIVE_T, kv_heads, 4)
        assert_native_runs_per_shard(hlo, (2, 4), [(B, NATIVE_T, 8, 4), kv_shape, kv_shape])
        if rate:  # dropout did something, and the same on both sides
            module.eval()
            no_dropout, _ = forward_and_grads(module, [x], cotangent)
            assert np.abs(reference["out"] - no_dropout["out"]).max() > 1e-2


@pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.why_unavailable()}")
@pytest.mark.parametrize("kind", AXIS_TYPES)
def test_native_dropout_keep_mask_on_a_mesh_equals_one_device(kind):
    """The keep-mask itself: with zero queries (uniform weights ``1 / s``) and one-hot values
    ``v[j] = e_j``, the output is ``keep / ((1 - rate) s)``, so it reads the mask back. Called
    directly under ``jit`` on 2x4 with q, k, v split over batch and heads, each device's kernel
    drops exactly what the one-device kernel drops, which is ``dropout_hash.keep_mask``."""
    b, t, h, rate, seed = 8, 16, 8, 0.3, 1234
    q = np.zeros((b, t, h, 4), np.float32)
    v = np.broadcast_to(np.eye(t, dtype=np.float32)[None, :, None, :], (b, t, h, t))

    def attend(q, k, v):
        out = native.native_attention(
            q, k, v, AttentionMask(), dropout_rate=rate, dropout_seed=np.uint32(seed)
        )
        return out * ((1 - rate) * t)  # (b, t, h, s): the keep-mask, 1 or 0

    one_device = np.asarray(jax.jit(attend)(q, q, v))
    mesh = make_mesh((2, 4), kind=kind)
    split = NamedSharding(mesh, P("data", None, "model", None))
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, split) for a in (q, q, v)]
        compiled = jax.jit(attend).lower(*args).compile()
        sharded = np.asarray(compiled(*args))
    shapes = [q.shape, q.shape, v.shape]
    assert_native_runs_per_shard(compiled.as_text(), (2, 4), shapes, backward=False)
    expected = np.asarray(dropout_hash.keep_mask(seed, (b, h, t, t), rate))  # (b, h, t, s)
    np.testing.assert_allclose(one_device, expected.transpose(0, 2, 1, 3), atol=1e-6)
    np.testing.assert_array_equal(np.round(sharded), np.round(one_device))
    np.testing.assert_allclose(sharded, one_device, atol=1e-6)
    assert 0.6 < expected.mean() < 0.8  # the mask drops about rate of the weights


@pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.why_unavailable()}")
@pytest.mark.parametrize("kind", AXIS_TYPES)
def test_native_per_head_mask_on_a_mesh_equals_one_device(kind):
    """A ``(b, h, t, s)`` keep-mask that differs by batch row and by head: on 2x4 each device's
    kernel gets its own rows' and heads' slice of the mask (split as the queries are), so the
    output and the gradients of q, k, v equal one device."""
    b, t, h, d = 8, 8, 8, 4
    rng = np.random.default_rng(5)
    q, k, v, cotangent = (rng.standard_normal((b, t, h, d)).astype(np.float32) for _ in range(4))
    keep = rng.random((b, h, t, t)) < 0.5  # (b, h, t, s)
    keep[..., np.arange(t), np.arange(t)] = True  # no row fully masked
    assert len({keep[:, i].tobytes() for i in range(h)}) == h  # each head its own mask
    assert len({keep[i].tobytes() for i in range(b)}) == b  # each batch row its own mask

    def run(q, k, v, keep):
        def loss(q, k, v):
            out = native.native_attention(q, k, v, AttentionMask(keep=keep))
            return (out * cotangent).sum(), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return {"out": out, **{f"grad {n}": g for n, g in zip("qkv", grads, strict=True)}}

    reference = jax.jit(run)(q, k, v, keep)
    mesh = make_mesh((2, 4), kind=kind)
    split = NamedSharding(mesh, P("data", None, "model", None))
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, split) for a in (q, k, v)]
        args.append(jax.device_put(keep, NamedSharding(mesh, P("data", "model"))))
        compiled = jax.jit(run).lower(*args).compile()
        actual = compiled(*args)
    assert_close(reference, actual, f"native with a per-head mask on 2x4 ({kind})")
    assert_native_runs_per_shard(compiled.as_text(), (2, 4), [q.shape] * 3)
