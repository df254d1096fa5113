"""The weight bridge against the real peer classes: Hugging Face ``GPT2Attention`` (eager and
sdpa, with the causal mask as ``GPT2Model`` builds it), ``torch.nn.MultiheadAttention`` and
``flax.nnx.MultiHeadAttention``, through ``fa.from_torch``/``fa.from_nnx`` and the layouts, both
ways: the peer's weights give the peer's outputs here, and our export of other weights loaded
into a fresh peer gives our outputs there. Float32, 1e-6 at small sizes and 1e-5 at GPT-2 size
(d 768, 12 heads, 1024 tokens). Every peer option no layer here expresses is refused by name.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import numpy as np
import pytest
import torch
from flax import nnx
from transformers import GPT2Config
from transformers.masking_utils import create_causal_mask
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

import flax_attention as fa
import torch_reference as tr

SMALL, GPT2_SIZE = 1e-6, 1e-5
SLOW = pytest.mark.slow  # GPT-2 size: a few seconds each, still run by default


def _close(what: str, got, want, tol: float) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    err = float(np.abs(got - want).max())
    assert err <= tol, f"{what}: max abs diff {err:.3e} > {tol:.0e}"
    return err


def _randomise(module: torch.nn.Module, bound: float, seed: int) -> torch.nn.Module:
    """Every parameter uniform in +-bound (torch's Linear scale: outputs of order one, biases
    that matter), from a fixed generator."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_((torch.rand(parameter.shape, generator=generator) * 2 - 1) * bound)
    return module.eval()


def _x(*shape, seed=0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape, np.float32))


def _torch_state(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _to_torch(state: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in state.items()}


def _other_weights(layer, seed=11):
    """A copy of ``layer`` with new weights (uniform in +-1/sqrt(fan_in), biases too): our
    export of these into a fresh peer checks the export mapping on its own."""
    other = nnx.clone(layer)
    rng = np.random.default_rng(seed)
    for _, variable in nnx.iter_graph(other):
        if isinstance(variable, nnx.Param):
            bound = variable.shape[0] ** -0.5
            variable[...] = rng.uniform(-bound, bound, variable.shape).astype(np.float32)
    return other


def test_import_leaves_torch_out():
    code = "import sys, flax_attention; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", "import flax_attention imported torch"


# ---- Hugging Face GPT2Attention -----------------------------------------------------------------


def _gpt2(d, heads, n_positions, implementation, seed=0):
    config = GPT2Config(
        n_embd=d,
        n_head=heads,
        n_positions=n_positions,
        n_layer=1,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        attn_implementation=implementation,
    )
    return config, _randomise(GPT2Attention(config, layer_idx=0), d**-0.5, seed)


#: ``create_causal_mask``'s cache argument: ``cache`` from transformers 5.24,
#: ``past_key_values`` before (5.24 still takes it, with a FutureWarning).
_CACHE_ARGUMENT = (
    "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
)


def _gpt2_forward(config, attn, x: torch.Tensor) -> np.ndarray:
    """``attn(x)`` with the causal mask exactly as ``GPT2Model.forward`` makes it (a 4-D float
    mask for eager; ``None`` for sdpa, which then runs ``is_causal``)."""
    position_ids = torch.arange(x.shape[1])[None]
    no_cache = {_CACHE_ARGUMENT: None}
    mask = create_causal_mask(
        config=config, inputs_embeds=x, attention_mask=None, position_ids=position_ids, **no_cache
    )
    with torch.no_grad():
        return attn(x, attention_mask=mask)[0].numpy()


@pytest.mark.parametrize(
    "implementation, d, heads, t, tol",
    [
        ("eager", 16, 4, 7, SMALL),
        ("sdpa", 16, 4, 7, SMALL),
        pytest.param("eager", 768, 12, 1024, GPT2_SIZE, id="eager-gpt2-size", marks=SLOW),
        pytest.param("sdpa", 768, 12, 1024, GPT2_SIZE, id="sdpa-gpt2-size", marks=SLOW),
    ],
)
def test_gpt2_attention_both_ways(implementation, d, heads, t, tol):
    config, attn = _gpt2(d, heads, max(t, 8), implementation)
    x = _x(1 if d > 100 else 2, t, d)
    want = _gpt2_forward(config, attn, x)
    layer = fa.from_torch(attn)
    assert isinstance(layer, fa.MultiHeadAttention)
    assert (layer.num_heads, layer.context_length, layer.W_query.bias is not None) == (
        heads,
        config.n_positions,
        True,
    )
    got = np.asarray(nnx.jit(lambda m, x: m(x))(layer, x.numpy()))
    _close(f"from_torch(GPT2Attention {implementation})", got, want, tol)

    ours = _other_weights(layer)
    fresh = _gpt2(d, heads, max(t, 8), implementation, seed=1)[1]
    fresh.load_state_dict(_to_torch(fa.state_dict(ours, layout="gpt2")), strict=True)
    _close(
        f"GPT2Attention {implementation} from our export",
        _gpt2_forward(config, fresh, x),
        nnx.jit(lambda m, x: m(x))(ours, x.numpy()),
        tol,
    )


def test_gpt2_old_checkpoint_buffers_are_checked_and_model_keys_load_by_prefix():
    """A whole (2-block) GPT2Model state dict with the ``attn.bias``/``attn.masked_bias``
    buffers older transformers saved: each block's layer loads by prefix; a wrong ``bias``
    buffer is refused by name; ``masked_bias`` (a fill value) is accepted and not used."""
    from transformers import GPT2Model

    config = GPT2Config(n_embd=12, n_head=3, n_positions=6, n_layer=2, attn_implementation="eager")
    model = _randomise(GPT2Model(config), 12**-0.5, 3)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    tril = torch.tril(torch.ones(6, 6, dtype=torch.bool)).view(1, 1, 6, 6)
    for i in range(2):
        state[f"h.{i}.attn.bias"] = tril.numpy()
        state[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    x = _x(2, 6, 12, seed=4)
    for i in range(2):
        layer = fa.MultiHeadAttention(12, 12, 6, 0.0, 3, True, rngs=nnx.Rngs(i))
        assert fa.load_state_dict(layer, state, layout="gpt2", prefix=f"h.{i}.attn.") == (
            fa.IncompatibleKeys([], [], [])
        )
        _close(f"h.{i}.attn", layer(x.numpy()), _gpt2_forward(config, model.h[i].attn, x), SMALL)
    state["h.1.attn.bias"] = np.tril(np.ones((6, 6), np.uint8), k=1).reshape(1, 1, 6, 6)
    with pytest.raises(ValueError, match=r"h\.1\.attn\.bias: differs from tril\(ones\(6, 6\)\)"):
        fa.load_state_dict(layer, state, layout="gpt2", prefix="h.1.attn.")


@pytest.mark.quick
@pytest.mark.parametrize(
    "option, value, message",
    [
        ("scale_attn_weights", False, r"config\.scale_attn_weights \(False\) must be True"),
        (
            "scale_attn_by_inverse_layer_idx",
            True,
            r"config\.scale_attn_by_inverse_layer_idx \(True\) must be False",
        ),
        ("is_cross_attention", True, r"is_cross_attention \(True\) must be False"),
    ],
)
def test_gpt2_options_no_layer_expresses_are_refused_by_name(option, value, message):
    config = GPT2Config(n_embd=8, n_head=2, n_positions=4, n_layer=1)
    if option == "is_cross_attention":
        attn = GPT2Attention(config, is_cross_attention=True, layer_idx=0)
    else:
        setattr(config, option, value)
        attn = GPT2Attention(config, layer_idx=0)
    with pytest.raises(ValueError, match=message):
        fa.from_torch(attn)
    with pytest.raises(TypeError, match=r"options \(context_length\) must be among"):
        fa.from_torch(GPT2Attention(GPT2Config(n_embd=8, n_head=2), 0), context_length=4)


@pytest.mark.quick
def test_gpt2_reorder_and_upcast_is_the_same_function():
    config, attn = _gpt2(16, 4, 8, "eager")
    config.reorder_and_upcast_attn = True
    attn.reorder_and_upcast_attn = True
    x = _x(2, 8, 16, seed=2)
    _close(
        "reorder_and_upcast_attn",
        fa.from_torch(attn)(x.numpy()),
        _gpt2_forward(config, attn, x),
        SMALL,
    )


# ---- torch.nn.MultiheadAttention ----------------------------------------------------------------


def _torch_mha(d, heads, seed=0, **options) -> torch.nn.MultiheadAttention:
    return _randomise(torch.nn.MultiheadAttention(d, heads, **options), d**-0.5, seed)


def _batch_first(module, x):
    return x if module.batch_first else x.transpose(0, 1)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_torch_nn_cross_attention_both_ways(batch_first, bias):
    d, heads, t, s = 12, 3, 5, 9
    ref = _torch_mha(d, heads, bias=bias, batch_first=batch_first)
    q, kv = _x(2, t, d, seed=1), _x(2, s, d, seed=2)
    pad = torch.arange(s)[None, :] >= torch.tensor([[4], [9]])  # True = ignore

    def theirs(module):
        args = [_batch_first(module, a) for a in (q, kv, kv)]
        with torch.no_grad():
            out = module(*args, key_padding_mask=pad, need_weights=False)[0]
        return _batch_first(module, out).numpy()

    layer = fa.from_torch(ref)
    assert isinstance(layer, fa.MultiHeadedAttention)
    got = layer(q.numpy(), kv.numpy(), kv.numpy(), (~pad).numpy()[:, None, :])
    want = theirs(ref)
    _close(f"from_torch(MultiheadAttention bias={bias})", got, want, SMALL)

    ours = _other_weights(layer)
    exported = fa.state_dict(ours, layout="torch_nn")  # biased: loads into bias=True
    fresh = _torch_mha(d, heads, seed=5, batch_first=batch_first)
    fresh.load_state_dict(_to_torch(exported), strict=True)
    want = ours(q.numpy(), kv.numpy(), kv.numpy(), (~pad).numpy()[:, None, :])
    _close("MultiheadAttention from our export", theirs(fresh), want, SMALL)


@pytest.mark.parametrize("bias", [True, False])
def test_torch_nn_causal_via_attn_mask_both_ways(bias):
    d, heads, t = 12, 4, 7
    ref = _torch_mha(d, heads, bias=bias, batch_first=True)
    x = _x(3, t, d, seed=3)
    future = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        want = ref(x, x, x, attn_mask=future, need_weights=False)[0].numpy()
    layer = fa.from_torch(ref, causal=True, context_length=t)
    assert isinstance(layer, fa.MultiHeadAttention) and layer.context_length == t
    assert (layer.W_query.bias is not None) == bias
    _close("from_torch(MultiheadAttention, causal=True)", layer(x.numpy()), want, SMALL)

    ours = _other_weights(layer)
    fresh = _torch_mha(d, heads, seed=6, batch_first=True)
    fresh.load_state_dict(_to_torch(fa.state_dict(ours, layout="torch_nn")), strict=True)
    with torch.no_grad():
        back = fresh(x, x, x, attn_mask=future, need_weights=False)[0].numpy()
    _close("causal MultiheadAttention from our export", back, ours(x.numpy()), SMALL)
    # the bias-free state dict itself (no in_proj_bias, no out_proj.bias) loads by layout
    other = fa.MultiHeadAttention(d, d, t, 0.0, heads, bias, rngs=nnx.Rngs(9))
    fa.load_state_dict(
        other, {k: v.numpy() for k, v in ref.state_dict().items()}, layout="torch_nn"
    )
    _close("load_state_dict(layout='torch_nn')", other(x.numpy()), want, SMALL)


@pytest.mark.quick
def test_torch_nn_separate_projections_load_like_the_packed_one():
    """``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` (torch's form when kdim or vdim
    differ from embed_dim) load when their sizes are the layer's; other sizes are refused,
    naming the key and kdim."""
    d, heads = 8, 2
    ref = _torch_mha(d, heads, batch_first=True)
    state = {k: v.numpy() for k, v in ref.state_dict().items()}
    q_w, k_w, v_w = np.split(state.pop("in_proj_weight"), 3)
    separate = {**state, "q_proj_weight": q_w, "k_proj_weight": k_w, "v_proj_weight": v_w}
    layer = fa.MultiHeadedAttention(heads, d, 0.0, rngs=nnx.Rngs(0))
    fa.load_state_dict(layer, separate, layout="torch_nn")
    x = _x(2, 5, d)
    with torch.no_grad():
        want = ref(x, x, x, need_weights=False)[0].numpy()
    _close("separate q/k/v projections", layer(*(x.numpy(),) * 3), want, SMALL)

    other = torch.nn.MultiheadAttention(d, heads, kdim=5, vdim=6, batch_first=True)
    assert "k_proj_weight" in other.state_dict()
    state = {k: v.detach().numpy() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError) as error:
        fa.load_state_dict(layer, state, layout="torch_nn")
    message = str(error.value)
    assert "k_proj_weight: shape (8, 5) must be (8, 8) (torch's kdim must equal d_in)" in message
    assert "v_proj_weight: shape (8, 6) must be (8, 8) (torch's vdim must equal d_in)" in message


@pytest.mark.quick
@pytest.mark.parametrize(
    "options, message",
    [
        ({"add_bias_kv": True}, r"add_bias_kv \(True\) must be False"),
        ({"add_zero_attn": True}, r"add_zero_attn \(True\) must be False"),
        ({"kdim": 5}, r"kdim \(5\) must equal embed_dim \(8\)"),
        ({"vdim": 3}, r"vdim \(3\) must equal embed_dim \(8\)"),
    ],
)
def test_torch_nn_options_no_layer_expresses_are_refused_by_name(options, message):
    module = torch.nn.MultiheadAttention(8, 2, **options)
    with pytest.raises(ValueError, match=message):
        fa.from_torch(module)
    if "add_bias_kv" in options:  # and by the layout, key by key
        layer = fa.MultiHeadedAttention(2, 8, rngs=nnx.Rngs(0))
        state = {k: v.detach().numpy() for k, v in module.state_dict().items()}
        with pytest.raises(ValueError) as error:
            fa.load_state_dict(layer, state, layout="torch_nn")
        for key in ("bias_k", "bias_v"):
            assert f"unexpected key {key} (torch.nn.MultiheadAttention(add_bias_kv=True)" in str(
                error.value
            )


@pytest.mark.quick
def test_from_torch_option_errors():
    module = torch.nn.MultiheadAttention(8, 2)
    with pytest.raises(ValueError, match=r"context_length \(None\) must be given with causal"):
        fa.from_torch(module, causal=True)
    with pytest.raises(ValueError, match=r"context_length \(4\) must be given only with causal"):
        fa.from_torch(module, context_length=4)
    with pytest.raises(TypeError, match=r"options \(num_heads\) must be among"):
        fa.from_torch(module, num_heads=2)
    with pytest.raises(TypeError, match=r"module \(torch\.nn\.modules\.linear\.Linear\) must be"):
        fa.from_torch(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"options \(causal\) must be among"):
        fa.from_torch(tr.CausalAttention(4, 4, 3, 0.0), causal=True)


# ---- torch_reference ---------------------------------------------------------------------------

# Each dropout rate its own (the modules run in eval(), so the outputs still agree): a layer built
# with another rate than its twin's is caught below.
_REFERENCE = [
    ("SelfAttention_v1", (4, 6)),
    ("SelfAttention_v2", (4, 6, True)),
    ("CausalAttention", (4, 6, 5, 0.1, True)),
    ("MultiHeadAttentionWrapper", (4, 3, 5, 0.2, 2)),
    ("MultiHeadAttention", (4, 6, 5, 0.3, 3, True)),
    ("MultiHeadedAttention", (2, 6, 0.4)),
]


@pytest.mark.parametrize("name, args", _REFERENCE, ids=[n for n, _ in _REFERENCE])
def test_from_torch_reference_layers(name, args):
    torch.manual_seed(0)
    module = getattr(tr, name)(*args).eval()
    layer = fa.from_torch(module)
    assert type(layer).__name__ == name
    rates = sorted(node.rate for _, node in nnx.iter_graph(layer) if isinstance(node, nnx.Dropout))
    want_rates = sorted(m.p for m in module.modules() if isinstance(m, torch.nn.Dropout))
    assert rates == want_rates, (name, rates, want_rates)
    d_in = 6 if name == "MultiHeadedAttention" else 4
    x = _x(2, 5, d_in) if name not in ("SelfAttention_v1", "SelfAttention_v2") else _x(5, d_in)
    inputs = (x,) * (3 if name == "MultiHeadedAttention" else 1)
    with torch.no_grad():
        want = module(*inputs).numpy()
    _close(f"from_torch({name})", layer(*(i.numpy() for i in inputs)), want, SMALL)
    for key, value in module.state_dict().items():
        assert np.array_equal(fa.state_dict(layer)[key], value.numpy()), key


# ---- flax.nnx.MultiHeadAttention ---------------------------------------------------------------


def _nnx_mha(heads, d_in, qkv=None, out=None, seed=0, **options):
    module = nnx.MultiHeadAttention(
        heads, d_in, qkv, out, decode=False, deterministic=True, rngs=nnx.Rngs(seed), **options
    )
    rng = np.random.default_rng(seed)
    for _, variable in nnx.iter_graph(module):
        if isinstance(variable, nnx.Param):  # biases start at zero: make them matter
            variable[...] = rng.uniform(-0.4, 0.4, variable.shape).astype(np.float32)
    return module


def _into_nnx(layer, module):
    """Our export (documents layout) written into a ``flax.nnx.MultiHeadAttention``."""
    state = fa.state_dict(layer)
    heads, head_dim = module.num_heads, module.head_dim
    causal = isinstance(layer, fa.MultiHeadAttention)
    names = (
        ["W_query", "W_key", "W_value", "out_proj"]
        if causal
        else [f"proj_weights.{i}" for i in range(4)]
    )
    for name, linear in zip(names, (module.query, module.key, module.value)):
        linear.kernel[...] = state[f"{name}.weight"].T.reshape(-1, heads, head_dim)
        if linear.bias is not None:
            linear.bias[...] = state[f"{name}.bias"].reshape(heads, head_dim)
    module.out.kernel[...] = state[f"{names[3]}.weight"].T.reshape(heads, head_dim, -1)
    if module.out.bias is not None:
        module.out.bias[...] = state[f"{names[3]}.bias"]


@pytest.mark.parametrize("use_bias", [True, False])
def test_nnx_cross_attention_both_ways(use_bias):
    heads, d, t, s = 3, 12, 5, 8
    ref = _nnx_mha(heads, d, use_bias=use_bias)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, t, d), np.float32)
    kv = rng.standard_normal((2, s, d), np.float32)
    keep = np.arange(s)[None, :] < np.array([[3], [8]])  # (b, s)
    want = np.asarray(ref(q, kv, kv, mask=keep[:, None, None, :]))
    layer = fa.from_nnx(ref)
    assert isinstance(layer, fa.MultiHeadedAttention) and layer.dropout.deterministic
    _close(f"from_nnx(use_bias={use_bias})", layer(q, kv, kv, keep[:, None, :]), want, SMALL)
    ours = _other_weights(layer)
    fresh = _nnx_mha(heads, d, seed=7)
    _into_nnx(ours, fresh)
    _close(
        "nnx.MultiHeadAttention from our export",
        fresh(q, kv, kv, mask=keep[:, None, None, :]),
        ours(q, kv, kv, keep[:, None, :]),
        SMALL,
    )


def test_nnx_causal_with_other_sizes_both_ways():
    heads, d_in, qkv, t = 2, 6, 8, 7
    ref = _nnx_mha(heads, d_in, qkv, qkv, seed=2)
    x = np.random.default_rng(2).standard_normal((2, t, d_in), np.float32)
    want = np.asarray(ref(x, mask=nnx.make_causal_mask(np.ones((2, t)))))
    layer = fa.from_nnx(ref, causal=True, context_length=t)
    assert isinstance(layer, fa.MultiHeadAttention) and (layer.d_in, layer.d_out) == (d_in, qkv)
    _close("from_nnx(causal=True)", layer(x), want, SMALL)
    ours = _other_weights(layer)
    fresh = _nnx_mha(heads, d_in, qkv, qkv, seed=8)
    _into_nnx(ours, fresh)
    _close(
        "causal nnx from our export",
        fresh(x, mask=nnx.make_causal_mask(np.ones((2, t)))),
        ours(x),
        SMALL,
    )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"normalize_qk": True}, r"normalize_qk \(True\) must be False"),
        ({"num_kv_heads": 1}, r"num_kv_heads \(1\) must equal num_heads \(2\)"),
        ({"in_kv_features": 5}, r"in_kv_features \(5\) must equal in_features \(8\)"),
        ({"qkv_features": 4}, r"qkv_features \(4\) must equal in_features \(8\)"),
        ({"out_features": 6}, r"out_features \(6\) must equal in_features \(8\)"),
        ({"attention_fn": lambda *a, **k: None}, r"attention_fn \(.*\) must be flax\.nnx\."),
    ],
    ids=["normalize_qk", "num_kv_heads", "in_kv_features", "qkv_features", "out_features", "fn"],
)
def test_nnx_options_no_layer_expresses_are_refused_by_name(options, message):
    module = nnx.MultiHeadAttention(2, 8, decode=False, rngs=nnx.Rngs(0), **options)
    with pytest.raises(ValueError, match=message):
        fa.from_nnx(module)
    with pytest.raises(TypeError, match=r"module \(.*Linear\) must be a flax\.nnx\.MultiHead"):
        fa.from_nnx(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
