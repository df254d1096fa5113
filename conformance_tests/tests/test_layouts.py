"""Layouts on the weight bridge: names and shapes per layout, which layer takes which, the same
strict and atomic checks as the documents' names (every bad key named, nothing written), ``prefix``
selection out of a whole model's state dict, files, and the ``fused_qkv`` layout against the
book's combined-QKV module and nanoGPT-style code (renamed ``c_attn``/``c_proj``).
"""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import save_file as torch_save_file

import flax_attention as fa
from flax_attention import layouts

SMALL = 1e-6
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _close(what: str, got, want, tol: float = SMALL) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    err = float(np.abs(got - want).max())
    assert err <= tol, f"{what}: max abs diff {err:.3e} > {tol:.0e}"
    return err


def _mha(qkv_bias=True, seed=0, d_in=6, d_out=6):
    return fa.MultiHeadAttention(d_in, d_out, 5, 0.0, 3, qkv_bias, rngs=nnx.Rngs(seed))


def _mhd(seed=0):
    return fa.MultiHeadedAttention(3, 6, 0.0, rngs=nnx.Rngs(seed))


def _snapshot(layer) -> dict[str, np.ndarray]:
    return {k: np.array(v, copy=True) for k, v in fa.state_dict(layer).items()}


def _assert_untouched(layer, before, what):
    after = _snapshot(layer)
    for key, value in before.items():
        assert after[key].dtype == value.dtype and np.array_equal(after[key], value), (
            f"{what}: {key} changed"
        )


#: The keys and shapes each layout gives a MultiHeadAttention(6, 6, 5, 0.0, 3, qkv_bias).
EXPECTED_KEYS = {
    ("documents", True): {
        "W_query.weight": (6, 6),
        "W_query.bias": (6,),
        "W_key.weight": (6, 6),
        "W_key.bias": (6,),
        "W_value.weight": (6, 6),
        "W_value.bias": (6,),
        "out_proj.weight": (6, 6),
        "out_proj.bias": (6,),
        "mask": (5, 5),
    },
    ("torch_nn", True): {
        "in_proj_weight": (18, 6),
        "in_proj_bias": (18,),
        "out_proj.weight": (6, 6),
        "out_proj.bias": (6,),
    },
    ("torch_nn", False): {  # torch's default bias=True: in_proj_bias exported as zeros
        "in_proj_weight": (18, 6),
        "in_proj_bias": (18,),
        "out_proj.weight": (6, 6),
        "out_proj.bias": (6,),
    },
    ("gpt2", True): {
        "c_attn.weight": (6, 18),
        "c_attn.bias": (18,),
        "c_proj.weight": (6, 6),
        "c_proj.bias": (6,),
    },
    ("gpt2", False): {  # Conv1D always has a bias: zeros
        "c_attn.weight": (6, 18),
        "c_attn.bias": (18,),
        "c_proj.weight": (6, 6),
        "c_proj.bias": (6,),
    },
    ("fused_qkv", True): {
        "qkv.weight": (18, 6),
        "qkv.bias": (18,),
        "proj.weight": (6, 6),
        "proj.bias": (6,),
        "mask": (5, 5),
    },
    ("fused_qkv", False): {
        "qkv.weight": (18, 6),
        "proj.weight": (6, 6),
        "proj.bias": (6,),
        "mask": (5, 5),
    },
}


@pytest.mark.parametrize(
    "layout, qkv_bias", EXPECTED_KEYS, ids=[f"{a}-{b}" for a, b in EXPECTED_KEYS]
)
def test_each_layout_exports_its_names_and_loads_them_back_exactly(layout, qkv_bias):
    layer = _mha(qkv_bias)
    exported = fa.state_dict(layer, layout=layout)
    assert {k: v.shape for k, v in exported.items()} == EXPECTED_KEYS[layout, qkv_bias]
    q, k, v = (np.asarray(getattr(layer, n).kernel[...]).T for n in ("W_query", "W_key", "W_value"))
    stacked = np.concatenate([q, k, v])  # (3 d_out, d_in): q, k, v in that order
    fused = {"torch_nn": "in_proj_weight", "gpt2": "c_attn.weight", "fused_qkv": "qkv.weight"}
    if layout in fused:
        want = stacked.T if layout == "gpt2" else stacked  # Conv1D stores (in, out)
        assert np.array_equal(exported[fused[layout]], want), fused[layout]
    if not qkv_bias and layout in ("torch_nn", "gpt2"):
        bias = exported["in_proj_bias" if layout == "torch_nn" else "c_attn.bias"]
        assert not bias.any(), "the bias the layer lacks must be exported as zeros"

    fresh = _mha(qkv_bias, seed=1)
    assert fa.load_state_dict(fresh, exported, layout=layout) == fa.IncompatibleKeys([], [], [])
    for key, value in _snapshot(layer).items():
        assert np.array_equal(fa.state_dict(fresh)[key], value), f"{layout}: {key}"


@pytest.mark.quick
@pytest.mark.parametrize("layout", ["documents", "torch_nn", "fused_qkv"])
def test_multiheaded_attention_layouts_round_trip(layout):
    layer = _mhd()
    exported = fa.state_dict(layer, layout=layout, prefix="enc.0.")
    assert all(k.startswith("enc.0.") for k in exported)
    fresh = _mhd(seed=1)
    fa.load_state_dict(fresh, exported, layout=layout, prefix="enc.0.")
    for key, value in _snapshot(layer).items():
        assert np.array_equal(fa.state_dict(fresh)[key], value), f"{layout}: {key}"


_REFUSED = [
    (lambda: fa.SelfAttention_v1(4, 4, rngs=nnx.Rngs(0)), "torch_nn", "SelfAttention_v1"),
    (lambda: fa.SelfAttention_v2(4, 4, rngs=nnx.Rngs(0)), "fused_qkv", "SelfAttention_v2"),
    (lambda: fa.CausalAttention(4, 4, 3, 0.0, rngs=nnx.Rngs(0)), "fused_qkv", "CausalAttention"),
    (
        lambda: fa.MultiHeadAttentionWrapper(4, 4, 3, 0.0, 2, rngs=nnx.Rngs(0)),
        "gpt2",
        "MultiHeadAttentionWrapper",
    ),
    (lambda: _mhd(), "gpt2", "MultiHeadedAttention"),
]


@pytest.mark.parametrize(
    "make, layout, name", _REFUSED, ids=[f"{n}-{lay}" for _, lay, n in _REFUSED]
)
def test_a_layout_a_layer_cannot_take_is_refused_by_name(make, layout, name):
    layer = make()
    pattern = rf"layout \('{layout}'\) must be one of the layouts {name} takes \("
    with pytest.raises(ValueError, match=pattern):
        fa.state_dict(layer, layout=layout)
    with pytest.raises(ValueError, match=pattern):
        fa.load_state_dict(layer, {}, layout=layout)


@pytest.mark.quick
def test_bad_layout_prefix_and_sizes_are_refused():
    layer = _mha()
    with pytest.raises(ValueError, match=r"layout \('hf'\) must be one of \('documents', "):
        fa.state_dict(layer, layout="hf")
    with pytest.raises(TypeError, match=r"prefix \(3\) must be a str"):
        fa.load_state_dict(layer, {}, prefix=3)
    with pytest.raises(
        ValueError, match=r"d_in \(4\) must equal d_out \(6\) for layout 'torch_nn'"
    ):
        fa.state_dict(_mha(d_in=4), layout="torch_nn")
    for layout in ("gpt2", "fused_qkv"):  # these layouts hold d_in != d_out
        wide = _mha(d_in=4)
        fa.load_state_dict(_mha(d_in=4, seed=2), fa.state_dict(wide, layout=layout), layout=layout)


@pytest.mark.quick
def test_the_mask_buffer_is_never_required_and_is_checked_when_present():
    layer = _mha()
    state = fa.state_dict(layer)
    del state["mask"]
    assert fa.load_state_dict(_mha(seed=1), state) == fa.IncompatibleKeys([], [], [])
    state = fa.state_dict(layer, layout="fused_qkv")
    state["mask"] = np.zeros((5, 5), np.float32)
    with pytest.raises(ValueError, match=r"mask: differs from triu\(ones\(5, 5\), diagonal=1\)"):
        fa.load_state_dict(_mha(), state, layout="fused_qkv")


def _poke(key, value):
    def damage(state):
        state[key] = np.array(state[key], copy=True)
        state[key].reshape(-1)[0] = value

    return damage


def _set(key, make):
    def damage(state):
        state[key] = make(state.get(key))

    return damage


#: (layout, layer's qkv_bias, damage, key named, where strict=False reports it, message part)
BAD_CONTENT = {
    "gpt2_transposed_c_attn": (
        "gpt2",
        True,
        _set("c_attn.weight", lambda v: np.ascontiguousarray(v.T)),
        "c_attn.weight",
        "mismatched",
        "shape (18, 6) must be (6, 18)",
    ),
    "gpt2_nan_bias": (
        "gpt2",
        True,
        _poke("c_attn.bias", np.nan),
        "c_attn.bias",
        "mismatched",
        "NaN",
    ),
    "gpt2_nonzero_bias_the_layer_lacks": (
        "gpt2",
        False,
        _poke("c_attn.bias", 0.5),
        "c_attn.bias",
        "mismatched",
        "c_attn.bias[0:6]: must be zeros, as the layer has no W_query.bias (qkv_bias=False)",
    ),
    "gpt2_bad_tril_buffer": (
        "gpt2",
        True,
        _set("bias", lambda v: np.ones((1, 1, 5, 5), bool)),
        "bias",
        "mismatched",
        "bias: differs from tril(ones(5, 5)).view(1, 1, 5, 5)",
    ),
    "gpt2_missing_c_proj_bias": (
        "gpt2",
        True,
        lambda state: state.pop("c_proj.bias"),
        "c_proj.bias",
        "missing",
        "missing key",
    ),
    "torch_nn_int_weight": (
        "torch_nn",
        True,
        _set("in_proj_weight", lambda v: v.astype(np.int32)),
        "in_proj_weight",
        "mismatched",
        "dtype int32 must be a floating dtype",
    ),
    "torch_nn_mask_is_not_a_torch_nn_key": (
        "torch_nn",
        True,
        _set("mask", lambda v: np.triu(np.ones((5, 5), np.float32), 1)),
        "mask",
        "unexpected",
        "unexpected key",
    ),
    "torch_nn_overflow_float16": (
        "torch_nn",
        True,
        _poke("out_proj.weight", 1e6),
        "out_proj.weight",
        "mismatched",
        "overflows float16",
    ),
    "fused_qkv_extra_key": (
        "fused_qkv",
        True,
        _set("qkv.scale", lambda v: np.ones(3, np.float32)),
        "qkv.scale",
        "unexpected",
        "unexpected key",
    ),
}


@pytest.mark.parametrize("case", BAD_CONTENT)
def test_bad_content_in_a_layout_names_the_prefixed_key_and_changes_nothing(case):
    layout, qkv_bias, damage, key, kind, part = BAD_CONTENT[case]
    dtype = {"param_dtype": np.float16} if "float16" in part else {}
    source = fa.MultiHeadAttention(6, 6, 5, 0.0, 3, qkv_bias, rngs=nnx.Rngs(1))
    state = fa.state_dict(source, layout=layout)
    if layout == "gpt2":
        state["bias"] = np.tril(np.ones((5, 5), bool)).reshape(1, 1, 5, 5)
    damage(state)
    prefix = "model.h.2.attn."
    whole = {prefix + k: v for k, v in state.items()}
    whole["model.h.1.attn.c_attn.weight"] = np.full((2, 2), np.nan)  # another layer: ignored
    whole["model.wte.weight"] = np.zeros(3, np.int64)
    layer = fa.MultiHeadAttention(6, 6, 5, 0.0, 3, qkv_bias, rngs=nnx.Rngs(0), **dtype)
    before = _snapshot(layer)

    with pytest.raises(ValueError) as error:
        fa.load_state_dict(layer, whole, layout=layout, prefix=prefix)
    message = str(error.value)
    assert "found 1 problem(s); nothing was loaded" in message, f"{case}: {message}"
    assert re.search(rf"(?<![\w.]){re.escape(prefix + key)}(?![\w.])", message), message
    assert part in message, f"{case}: {message}"
    _assert_untouched(layer, before, f"{case} (strict=True)")

    result = fa.load_state_dict(layer, whole, strict=False, layout=layout, prefix=prefix)
    expected = fa.IncompatibleKeys(
        *[[prefix + key] if kind == f else [] for f in ("missing", "unexpected", "mismatched")]
    )
    assert result == expected, f"{case}: {result}"
    loaded = fa.state_dict(layer, layout=layout)
    for name, value in fa.state_dict(source, layout=layout).items():
        if name != key and name in loaded:  # the good keys loaded
            assert np.array_equal(loaded[name], value.astype(loaded[name].dtype)), f"{case}: {name}"


@pytest.mark.quick
def test_a_fused_key_whose_value_third_overflows_loads_none_of_its_parts():
    # c_attn.weight is (d_in, 3 d_out): columns 0:6 W_query, 6:12 W_key, 12:18 W_value. Only the
    # value third overflows float16; the query and key thirds are fine but must not be written.
    state = fa.state_dict(_mha(seed=1), layout="gpt2")
    state["c_attn.weight"] = np.array(state["c_attn.weight"], copy=True)
    state["c_attn.weight"][:, 12:] = 1e6
    layer = fa.MultiHeadAttention(6, 6, 5, 0.0, 3, True, rngs=nnx.Rngs(0), param_dtype=np.float16)
    before = _snapshot(layer)

    with pytest.raises(ValueError, match=r"c_attn.weight: overflows float16"):
        fa.load_state_dict(layer, state, layout="gpt2")
    result = fa.load_state_dict(layer, state, strict=False, layout="gpt2")
    assert result == fa.IncompatibleKeys([], [], ["c_attn.weight"]), result
    after = _snapshot(layer)
    for key in ("W_query.weight", "W_key.weight", "W_value.weight"):
        assert np.array_equal(after[key], before[key]), f"{key} changed"
    assert np.array_equal(after["out_proj.weight"], state["c_proj.weight"].T.astype(np.float16))


@pytest.mark.quick
def test_prefix_selects_one_layer_and_strictness_is_under_it():
    layers = [_mha(seed=i) for i in range(3)]
    whole = {}
    for i, layer in enumerate(layers):
        whole.update(fa.state_dict(layer, layout="gpt2", prefix=f"transformer.h.{i}.attn."))
    whole["transformer.wte.weight"] = np.zeros((10, 6), np.float32)
    target = _mha(seed=9)
    fa.load_state_dict(target, whole, layout="gpt2", prefix="transformer.h.1.attn.")
    for key, value in _snapshot(layers[1]).items():
        assert np.array_equal(fa.state_dict(target)[key], value), key
    with pytest.raises(ValueError) as error:
        fa.load_state_dict(target, whole, layout="gpt2", prefix="transformer.h.3.attn.")
    lines = str(error.value).splitlines()[1:]
    assert [line.strip() for line in lines] == [
        f"missing key transformer.h.3.attn.{k}"
        for k in ("c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias")
    ]


@pytest.mark.quick
def test_files_carry_layout_and_prefix(tmp_path):
    layer = _mha()
    path = tmp_path / "model.safetensors"
    fa.save_file(layer, path, layout="torch_nn", prefix="blocks.0.mha.")
    torch_state = {"blocks.1.mha.in_proj_weight": torch.zeros(2)}  # another layer's keys
    from safetensors.torch import load_file as torch_load_file

    torch_state.update(torch_load_file(path))
    torch_save_file(torch_state, path)
    fresh = _mha(seed=3)
    assert fa.load_file(fresh, path, layout="torch_nn", prefix="blocks.0.mha.") == (
        fa.IncompatibleKeys([], [], [])
    )
    for key, value in _snapshot(layer).items():
        assert np.array_equal(fa.state_dict(fresh)[key], value), key
    before = _snapshot(fresh)
    with pytest.raises(ValueError, match=r"^load_file\(.*\): load_state_dict into .*\n  missing"):
        fa.load_file(fresh, path, layout="torch_nn", prefix="blocks.1.mha.")
    _assert_untouched(fresh, before, "wrong prefix")
    path.write_bytes(path.read_bytes()[:-9])
    with pytest.raises(ValueError, match=r"^path \('.*'\) must be a readable safetensors file"):
        fa.load_file(fresh, path, layout="torch_nn", prefix="blocks.0.mha.")
    _assert_untouched(fresh, before, "truncated file")


def test_a_class_of_your_own_is_registered_and_round_trips():
    """The registry (``flax_attention.layouts.register``): a user's block is refused until its
    class is registered, then its graph's paths are its names (the layer inside brings its
    ``mask``); a user's attention layer takes a peer's layout through its ``roles``."""

    class Block(nnx.Module):  # a layer here, a Linear and a bare parameter
        def __init__(self, seed):
            self.att, self.proj = _mha(seed=seed), nnx.Linear(6, 4, rngs=nnx.Rngs(seed))
            self.gate = nnx.Param(np.arange(3, dtype=np.float32) + seed)

    class Projections(nnx.Module):  # an attention layer's projections under its own names
        def __init__(self, seed):
            rngs = nnx.Rngs(seed)
            self.q, self.k, self.v, self.o = (nnx.Linear(6, 6, rngs=rngs) for _ in range(4))

    unknown = r"module \(.*Block\) must be of a class the weight bridge knows \(.*register"
    with pytest.raises(TypeError, match=unknown + r"\(Block, flax_attention.layouts.Names\(\)\)"):
        fa.state_dict(Block(0))
    layouts.register(Block, layouts.Names())
    block, other = Block(0), Block(1)
    state = fa.state_dict(block)
    att = {f"att.{key}" for key in EXPECTED_KEYS["documents", True]}
    assert set(state) == att | {"proj.weight", "proj.bias", "gate"}
    assert np.array_equal(state["proj.weight"], np.asarray(block.proj.kernel[...]).T)
    assert np.array_equal(state["att.mask"], np.triu(np.ones((5, 5)), 1))
    fa.load_state_dict(other, state)
    for key, value in fa.state_dict(other).items():
        assert np.array_equal(value, state[key]), key

    roles = {"q": "q", "k": "k", "v": "v", "o": "o"}
    layouts.register(Projections, layouts.Names(layouts=("documents", "fused_qkv"), roles=roles))
    mine, back = Projections(0), Projections(1)
    fused = fa.state_dict(mine, layout="fused_qkv")
    stacked = [np.asarray(linear.kernel[...]).T for linear in (mine.q, mine.k, mine.v)]
    assert np.array_equal(fused["qkv.weight"], np.concatenate(stacked))
    assert np.array_equal(fused["proj.weight"], np.asarray(mine.o.kernel[...]).T)
    fa.load_state_dict(back, fused, layout="fused_qkv")
    for key, value in fa.state_dict(back).items():
        assert np.array_equal(value, fa.state_dict(mine)[key]), key

    with pytest.raises(ValueError, match=r"names.roles \(None\) must name the projections"):
        layouts.register(Projections, layouts.Names(layouts=("documents", "gpt2")))
    with pytest.raises(ValueError, match=r"names.layouts \(\('hf',\)\) must be among"):
        layouts.register(Projections, layouts.Names(layouts=("hf",)))
    with pytest.raises(TypeError, match=r"names \(dict\) must be a flax_attention.layouts.Names"):
        layouts.register(Projections, {})
    assert fa.state_dict(mine, layout="fused_qkv").keys() == fused.keys()  # entry kept


# ---- fused_qkv against the book's combined-QKV module and nanoGPT-style code ----------------


class CombinedQKV(torch.nn.Module):
    """The combined-QKV multi-head attention of the book's chapter 3 bonus material
    ("Efficient multi-head attention implementations", ``MultiHeadAttentionCombinedQKV``): one
    ``qkv`` Linear, ``proj``, the ``mask`` buffer."""

    def __init__(self, d_in, d_out, num_heads, context_length, qkv_bias=False):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_out // num_heads
        self.qkv = torch.nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.proj = torch.nn.Linear(d_out, d_out)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim)
        queries, keys, values = qkv.permute(2, 0, 3, 1, 4)  # each (b, h, t, d)
        scores = (queries @ keys.transpose(-2, -1)).masked_fill(
            self.mask.bool()[:t, :t], -torch.inf
        )
        weights = torch.softmax(scores / self.head_dim**0.5, dim=-1)
        return self.proj((weights @ values).transpose(1, 2).reshape(b, t, -1))


class NanoGPTAttention(torch.nn.Module):
    """nanoGPT's ``CausalSelfAttention``: ``c_attn``/``c_proj`` as ``nn.Linear``, the ``bias``
    buffer (a tril) when flash attention is off."""

    def __init__(self, d, num_heads, block_size):
        super().__init__()
        self.num_heads = num_heads
        self.c_attn = torch.nn.Linear(d, 3 * d)
        self.c_proj = torch.nn.Linear(d, d)
        tril = torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
        self.register_buffer("bias", tril)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.num_heads, -1).transpose(1, 2) for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


def _renamed(state: dict, names: dict[str, str]) -> dict:
    """``c_attn.*`` -> ``qkv.*``, ``c_proj.*`` -> ``proj.*`` (the recipe in docs/weights.md)."""
    out = {}
    for key, value in state.items():
        head, _, tail = key.partition(".")
        out[f"{names.get(head, head)}.{tail}" if tail else key] = value
    return out


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_fused_qkv_is_the_books_combined_qkv_module_both_ways(qkv_bias):
    torch.manual_seed(0)
    peer = CombinedQKV(6, 8, 2, 7, qkv_bias).eval()
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((2, 7, 6), np.float32))
    with torch.no_grad():
        want = peer(x).numpy()
    layer = fa.MultiHeadAttention(6, 8, 7, 0.0, 2, qkv_bias, rngs=nnx.Rngs(0))
    fa.load_state_dict(
        layer, {k: v.numpy() for k, v in peer.state_dict().items()}, layout="fused_qkv"
    )
    _close("fused_qkv: the book's combined-QKV module", layer(x.numpy()), want)
    ours = fa.MultiHeadAttention(6, 8, 7, 0.0, 2, qkv_bias, rngs=nnx.Rngs(5))  # other weights
    fresh = CombinedQKV(6, 8, 2, 7, qkv_bias).eval()
    exported = fa.state_dict(ours, layout="fused_qkv")
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in exported.items()}, strict=True)
    with torch.no_grad():
        back = fresh(x).numpy()
    _close("the book's combined-QKV module from our export", back, ours(x.numpy()))


@pytest.mark.quick
def test_fused_qkv_takes_nanogpt_keys_renamed():
    torch.manual_seed(1)
    peer = NanoGPTAttention(8, 2, 7).eval()
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((2, 7, 8), np.float32))
    with torch.no_grad():
        want = peer(x).numpy()
    state = {k: v.numpy() for k, v in peer.state_dict().items() if k != "bias"}
    layer = fa.MultiHeadAttention(8, 8, 7, 0.0, 2, True, rngs=nnx.Rngs(0))
    fa.load_state_dict(
        layer, _renamed(state, {"c_attn": "qkv", "c_proj": "proj"}), layout="fused_qkv"
    )
    _close("fused_qkv: nanoGPT renamed", layer(x.numpy()), want)
    ours = fa.MultiHeadAttention(8, 8, 7, 0.0, 2, True, rngs=nnx.Rngs(5))  # other weights
    exported = fa.state_dict(ours, layout="fused_qkv")
    exported.pop("mask")
    exported = _renamed(exported, {"qkv": "c_attn", "proj": "c_proj"})
    fresh = NanoGPTAttention(8, 2, 7).eval()
    result = fresh.load_state_dict(
        {k: torch.from_numpy(v) for k, v in exported.items()}, strict=False
    )
    assert (result.missing_keys, result.unexpected_keys) == (["bias"], []), result  # its buffer
    with torch.no_grad():
        _close("nanoGPT from our export", fresh(x).numpy(), ours(x.numpy()))
