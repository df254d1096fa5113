"""The packages against each other and against torch's and Flax's own attention layers:
weights that cross exactly, strict loads that change nothing, jit, the shared names and errors."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file as torch_load_file
from safetensors.torch import save_file as torch_save_file

import flax_attention as fa
import torch_reference as tr
from conformance_tests.layers import LAYER_SPECS
from conformance_tests.tests.helpers import LAYERS, small_case

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: Every layer at the helpers' small sizes, from the spec's layer table.
CASES = {name: small_case(name) for name in LAYERS}


def _pair(name, seed=0):
    case = CASES[name]
    torch.manual_seed(seed)
    tm = getattr(tr, name)(*case.args, **dict(case.kwargs)).eval()
    fm = getattr(fa, name)(*case.args, **dict(case.kwargs), rngs=nnx.Rngs(seed))
    fm.eval()
    x = np.random.default_rng(seed).standard_normal(case.inputs[0]).astype(np.float32)
    return tm, fm, x


def _call(module, x):
    """Self-attention: ``x`` is every input (query, key and value for document 001)."""
    return module(*(x,) * len(LAYER_SPECS[type(module).__name__].inputs))


@pytest.mark.quick
@pytest.mark.parametrize("name", LAYERS)
def test_torch_file_flax_file_torch_is_bit_identical(name, tmp_path):
    tm, fm, _ = _pair(name)
    torch_save_file(tm.state_dict(), tmp_path / "torch.safetensors")
    fa.load_file(fm, tmp_path / "torch.safetensors")
    fa.save_file(fm, tmp_path / "flax.safetensors")
    back = torch_load_file(tmp_path / "flax.safetensors")
    original = tm.state_dict()
    assert set(back) == set(original)
    for key, value in original.items():
        assert torch.equal(back[key], value), f"{key} changed in the round trip"
    fresh = getattr(tr, name)(*CASES[name].args, **dict(CASES[name].kwargs))
    fresh.load_state_dict(back, strict=True)
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in fa.state_dict(fm).items()})
    linear_weights = [k for k in original if k.endswith(".weight")]  # v1 holds bare matrices
    for weight in linear_weights[:1]:  # a Linear weight is the transposed kernel
        module = fm
        for part in weight.split(".")[:-1]:
            module = module[int(part)] if part.isdigit() else getattr(module, part)
        np.testing.assert_array_equal(np.asarray(module.kernel[...]), original[weight].numpy().T)


def _snapshot(fm):
    return {k: np.array(v) for k, v in fa.state_dict(fm).items()}


@pytest.mark.quick
def test_failed_strict_load_names_every_key_and_changes_nothing():
    tm, fm, _ = _pair("MultiHeadAttention")
    before = _snapshot(fm)
    bad = {k: v.numpy().copy() for k, v in tm.state_dict().items()}
    del bad["W_query.bias"]  # missing
    bad["extra.weight"] = np.zeros(3, np.float32)  # unexpected
    bad["W_key.weight"] = bad["W_key.weight"].T.copy()  # mis-shaped (a Flax kernel's layout)
    bad["W_value.weight"][0, 0] = np.nan  # non-finite
    bad["mask"] = np.zeros_like(bad["mask"])  # not the causal mask of its context_length
    bad["out_proj.bias"] = np.array(["a"] * 6)  # non-numeric
    with pytest.raises(ValueError) as error:
        fa.load_state_dict(fm, bad)
    message = str(error.value)
    for key in ("W_query.bias", "extra.weight", "W_key.weight", "W_value.weight", "mask"):
        assert key in message, f"{key} not named in: {message}"
    assert "out_proj.bias" in message
    after = _snapshot(fm)
    for key, value in before.items():
        np.testing.assert_array_equal(after[key], value, err_msg=f"{key} changed")


@pytest.mark.quick
def test_non_strict_load_loads_the_good_keys_and_reports_the_rest():
    tm, fm, _ = _pair("CausalAttention")
    good = {k: v.numpy() for k, v in tm.state_dict().items()}
    given = dict(good)
    del given["W_value.bias"]
    given["W_key.weight"] = np.zeros((2, 2), np.float32)
    given["unused"] = np.zeros(1, np.float32)
    result = fa.load_state_dict(fm, given, strict=False)
    assert result == fa.IncompatibleKeys(["W_value.bias"], ["unused"], ["W_key.weight"])
    np.testing.assert_array_equal(np.asarray(fm.W_query.kernel[...]), good["W_query.weight"].T)


@pytest.mark.quick
def test_corrupt_file_raises_and_changes_nothing(tmp_path):
    tm, fm, _ = _pair("SelfAttention_v2")
    path = tmp_path / "w.safetensors"
    torch_save_file(tm.state_dict(), path)
    path.write_bytes(path.read_bytes()[:-10])  # truncated
    before = _snapshot(fm)
    with pytest.raises(ValueError, match="safetensors"):
        fa.load_file(fm, path)
    for key, value in _snapshot(fm).items():
        np.testing.assert_array_equal(value, before[key])
    with pytest.raises(TypeError, match="state_dict"):
        fa.load_state_dict(fm, [1, 2])


@pytest.mark.parametrize("name", LAYERS)
def test_jit_equals_eager_and_does_not_retrace(name):
    tm, fm, x = _pair(name)
    fa.load_state_dict(fm, {k: v.numpy() for k, v in tm.state_dict().items()})
    eager = np.asarray(_call(fm, x))
    traces = []

    @nnx.jit
    def run(module, x):
        traces.append(1)
        return _call(module, x)

    outs = [np.asarray(run(fm, x)) for _ in range(3)]
    # (MultiHeadedAttention's first call adds attention_score to its state; the eager call above
    # made it, so its state structure is already final here)
    assert len(traces) == 1
    for out in outs:
        np.testing.assert_allclose(out, eager, rtol=0, atol=1e-6)
    graphdef, state = nnx.split(fm)
    pure = jax.jit(lambda state, x: _call(nnx.merge(graphdef, state), x))
    np.testing.assert_allclose(np.asarray(pure(state, x)), eager, rtol=0, atol=1e-6)
    torch_out = _call(tm, torch.from_numpy(x))
    np.testing.assert_allclose(eager, torch_out.detach().numpy(), rtol=0, atol=1e-5)


def _nnx_mha_from(torch_module, d_in, d_out, num_heads):
    """``flax.nnx.MultiHeadAttention`` carrying a torch ``MultiHeadAttention``'s weights."""
    head_dim = d_out // num_heads
    ref = nnx.MultiHeadAttention(
        num_heads, d_in, qkv_features=d_out, out_features=d_out, decode=False, rngs=nnx.Rngs(0)
    )
    sd = {k: v.detach().numpy() for k, v in torch_module.state_dict().items()}
    for ours, theirs in (("W_query", "query"), ("W_key", "key"), ("W_value", "value")):
        layer = getattr(ref, theirs)
        layer.kernel[...] = sd[f"{ours}.weight"].T.reshape(d_in, num_heads, head_dim)
        layer.bias[...] = sd[f"{ours}.bias"].reshape(num_heads, head_dim)
    ref.out.kernel[...] = sd["out_proj.weight"].T.reshape(num_heads, head_dim, d_out)
    ref.out.bias[...] = sd["out_proj.bias"]
    return ref


def test_multihead_attention_equals_flax_nnx_multihead_attention():
    d_in, d_out, heads, t = 12, 16, 4, 9
    torch.manual_seed(1)
    tm = tr.MultiHeadAttention(d_in, d_out, t, 0.0, heads, qkv_bias=True)
    ours = fa.MultiHeadAttention(d_in, d_out, t, 0.0, heads, qkv_bias=True, rngs=nnx.Rngs(0))
    fa.load_state_dict(ours, {k: v.numpy() for k, v in tm.state_dict().items()})
    ref = _nnx_mha_from(tm, d_in, d_out, heads)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, t, d_in)), jnp.float32)
    theirs = ref(x, mask=nnx.make_causal_mask(jnp.ones((2, t))), deterministic=True)
    np.testing.assert_allclose(np.asarray(ours(x)), np.asarray(theirs), rtol=0, atol=1e-6)


def test_multiheaded_attention_equals_flax_nnx_for_cross_attention_with_padding():
    d_model, heads, t, s = 12, 3, 5, 8
    ours = fa.MultiHeadedAttention(heads, d_model, 0.0, rngs=nnx.Rngs(3))
    ref = nnx.MultiHeadAttention(heads, d_model, decode=False, rngs=nnx.Rngs(0))
    sd = fa.state_dict(ours)
    head_dim = d_model // heads
    for i, theirs in enumerate(("query", "key", "value")):
        getattr(ref, theirs).kernel[...] = sd[f"proj_weights.{i}.weight"].T.reshape(
            d_model, heads, head_dim
        )
        getattr(ref, theirs).bias[...] = sd[f"proj_weights.{i}.bias"].reshape(heads, head_dim)
    ref.out.kernel[...] = sd["proj_weights.3.weight"].T.reshape(heads, head_dim, d_model)
    ref.out.bias[...] = sd["proj_weights.3.bias"]
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, t, d_model)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, s, d_model)), jnp.float32)
    keep = np.arange(s)[None, :] < np.array([[3], [8]])  # (b, s)
    ours_out = ours(q, kv, kv, jnp.asarray(keep[:, None, :], jnp.float32))
    theirs = ref(q, kv, kv, mask=jnp.asarray(keep[:, None, None, :]), deterministic=True)
    np.testing.assert_allclose(np.asarray(ours_out), np.asarray(theirs), rtol=0, atol=1e-6)


@pytest.mark.quick
@pytest.mark.parametrize("attn_mask", ["causal", "padding"])
def test_torch_layers_equal_torch_nn_multihead_attention(attn_mask):
    d, heads, t, s = 12, 3, 6, 9
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(d, heads, batch_first=True).eval()
    w_q, w_k, w_v = ref.in_proj_weight.detach().chunk(3)
    b_q, b_k, b_v = ref.in_proj_bias.detach().chunk(3)
    out_w, out_b = ref.out_proj.weight.detach(), ref.out_proj.bias.detach()
    ours = tr.MultiHeadedAttention(heads, d, 0.0).eval()
    ours.load_state_dict(
        {
            **{f"proj_weights.{i}.weight": w for i, w in enumerate((w_q, w_k, w_v, out_w))},
            **{f"proj_weights.{i}.bias": b for i, b in enumerate((b_q, b_k, b_v, out_b))},
        }
    )
    x = torch.randn(2, t, d)
    if attn_mask == "causal":
        mha = tr.MultiHeadAttention(d, d, t, 0.0, heads, qkv_bias=True).eval()
        mha.load_state_dict(
            {
                "W_query.weight": w_q,
                "W_key.weight": w_k,
                "W_value.weight": w_v,
                "W_query.bias": b_q,
                "W_key.bias": b_k,
                "W_value.bias": b_v,
                "out_proj.weight": out_w,
                "out_proj.bias": out_b,
                "mask": mha.mask,
            }
        )
        future = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        expected, weights = ref(x, x, x, attn_mask=future, average_attn_weights=False)
        got = ours(x, x, x, torch.tril(torch.ones(t, t)).unsqueeze(0))
        torch.testing.assert_close(mha(x), expected, rtol=0, atol=1e-6)
    else:
        kv = torch.randn(2, s, d)
        pad = torch.arange(s)[None, :] >= torch.tensor([[4], [9]])  # True = ignore
        expected, weights = ref(x, kv, kv, key_padding_mask=pad, average_attn_weights=False)
        got = ours(x, kv, kv, (~pad).float().unsqueeze(1))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.attention_score, weights, rtol=0, atol=1e-6)


# ---- the shared surface -----------------------------------------------------------------------


@pytest.mark.quick
def test_shared_names_and_checks_are_identical():
    assert set(tr.__all__) <= set(fa.__all__)
    import importlib

    for module in ("self_attention", "causal", "multihead", "annotated"):
        ours = importlib.import_module(f"flax_attention.{module}").__all__
        theirs = importlib.import_module(f"torch_reference.{module}").__all__
        assert ours == theirs, module
    assert (ROOT / "torch_reference/_checks.py").read_bytes() == (
        ROOT / "flax_attention/_checks.py"
    ).read_bytes()
    # flax_attention never imports torch on import; the one call that reads a torch file
    # (models.read_pth, a .pth through torch.load) imports it when called, and only there
    # (test_packaging.AT_CALL_ONLY; test_packaging also imports the package in a fresh
    # interpreter and finds no torch loaded).
    at_call = {ROOT / "flax_attention/models/checkpoints.py"}
    for path in (ROOT / "flax_attention").rglob("*.py"):
        text = path.read_text()
        if path in at_call:
            assert text.count("import torch") == 1 and "\nimport torch" not in text, path
        else:
            assert "import torch" not in text, path
    for path in (ROOT / "torch_reference").rglob("*.py"):
        assert "import jax" not in path.read_text(), path


# Bad arguments and inputs: the table BAD_INPUTS in bad_inputs.py (both packages, one
# table, every message also listed in docs/errors.md).


def test_eval_and_train_control_dropout_in_both():
    x = np.random.default_rng(0).standard_normal((2, 6, 4)).astype(np.float32)
    torch.manual_seed(0)
    tm = tr.MultiHeadAttention(4, 4, 6, 0.5, 2)
    fm = fa.MultiHeadAttention(4, 4, 6, 0.5, 2, rngs=nnx.Rngs(0, dropout=1))
    fa.load_state_dict(fm, {k: v.numpy() for k, v in tm.state_dict().items()})
    xt = torch.from_numpy(x)
    tm.eval()
    fm.eval()
    np.testing.assert_allclose(np.asarray(fm(x)), tm(xt).detach().numpy(), rtol=0, atol=1e-6)
    tm.train()
    fm.train()
    assert not np.allclose(np.asarray(fm(x)), np.asarray(fm(x)))  # a fresh mask per call
    assert not torch.allclose(tm(xt), tm(xt))


def test_initialisers_follow_torch_distributions():
    layer = fa.SelfAttention_v2(512, 512, qkv_bias=True, rngs=nnx.Rngs(0))
    kernel, bias = np.asarray(layer.W_query.kernel[...]), np.asarray(layer.W_query.bias[...])
    bound = 1 / np.sqrt(512)
    assert np.abs(kernel).max() <= bound and np.abs(bias).max() <= bound
    assert abs(kernel.mean()) < 0.01 * bound
    assert abs(kernel.var() / (bound**2 / 3) - 1) < 0.02  # uniform(-b, b) has variance b^2 / 3
    v1 = np.asarray(fa.SelfAttention_v1(64, 64, rngs=nnx.Rngs(0)).W_query[...])
    assert v1.min() >= 0 and v1.max() < 1 and abs(v1.mean() - 0.5) < 0.02
    # document 001's clones: the four projections start identical, in torch and in Flax
    sd = fa.state_dict(fa.MultiHeadedAttention(2, 8, rngs=nnx.Rngs(0)))
    for i in (1, 2, 3):
        np.testing.assert_array_equal(sd[f"proj_weights.{i}.weight"], sd["proj_weights.0.weight"])
    torch_sd = tr.MultiHeadedAttention(2, 8).state_dict()
    assert torch.equal(torch_sd["proj_weights.3.weight"], torch_sd["proj_weights.0.weight"])


def test_dtype_param_dtype_and_precision_reach_every_sublayer():
    layer = fa.MultiHeadAttention(
        8,
        8,
        4,
        0.0,
        2,
        dtype=jnp.bfloat16,
        param_dtype=jnp.float16,
        precision=jax.lax.Precision.HIGHEST,
        rngs=nnx.Rngs(0),
    )
    for linear in (layer.W_query, layer.W_key, layer.W_value, layer.out_proj):
        assert linear.kernel[...].dtype == jnp.float16
        assert linear.dtype == jnp.bfloat16 and linear.precision == jax.lax.Precision.HIGHEST
    assert layer(jnp.ones((1, 4, 8), jnp.float32)).dtype == jnp.bfloat16
