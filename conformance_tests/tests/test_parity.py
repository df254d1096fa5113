"""The parity API on a pair that is not in the spec: a user's own causal attention (nanoGPT-style
names, its own forward) against ``flax_attention.MultiHeadAttention``, through a key map."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flax import nnx

import flax_attention as fa
from conformance_tests.parity import ParityOptions, assert_parity, check_parity


class UserAttention(torch.nn.Module):
    """Someone's causal multi-head attention: other names, no mask buffer, its own forward."""

    def __init__(self, d, heads, scale=1.0):
        super().__init__()
        self.heads, self.scale = heads, scale
        self.query, self.key, self.value = (torch.nn.Linear(d, d, bias=False) for _ in range(3))
        self.proj = torch.nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (
            m(x).view(b, t, self.heads, -1).transpose(1, 2)
            for m in (self.query, self.key, self.value)
        )
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads) * self.scale
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(out)


KEY_MAP = {
    "query.weight": "W_query.weight",
    "key.weight": "W_key.weight",
    "value.weight": "W_value.weight",
    "proj.weight": "out_proj.weight",
    "proj.bias": "out_proj.bias",
}


def _pair(scale=1.0):
    torch.manual_seed(0)
    theirs = UserAttention(8, 2, scale)
    ours = fa.MultiHeadAttention(8, 8, 6, 0.0, 2, rngs=nnx.Rngs(0))
    x = np.random.default_rng(0).standard_normal((2, 6, 8)).astype(np.float32)
    return theirs, ours, x


def test_a_users_pair_passes_every_parity_check():
    theirs, ours, x = _pair()
    before = {k: np.asarray(v).copy() for k, v in fa.state_dict(ours).items()}
    rows = assert_parity(
        theirs, ours, [x], key_map=KEY_MAP, causal=True, checks=("forward", "grad", "train", "mask")
    )
    checks = [r.check for r in rows]
    assert checks == [
        "forward",
        "grad",
        "train/adam",
        "train/adamw",
        "train/sgd_momentum",
        "mask/causal",
    ]
    assert all(r.case == "UserAttention" and r.passed for r in rows), rows
    assert max(r.max_abs_err for r in rows if r.check == "forward") < 1e-6, rows
    for key, value in fa.state_dict(ours).items():  # the module passed in is not changed
        np.testing.assert_array_equal(value, before[key], err_msg=key)


@pytest.mark.quick
def test_a_users_pair_that_differs_fails_by_name():
    theirs, ours, x = _pair(scale=1.001)  # a 0.1% scale bug on the torch side
    rows = check_parity(theirs, ours, [x], key_map=KEY_MAP, checks=("forward", "grad"))
    assert [r.passed for r in rows] == [False, False], rows
    with pytest.raises(AssertionError, match=r"2 of 2 parity rows failed:\nUserAttention forward"):
        assert_parity(theirs, ours, [x], key_map=KEY_MAP, checks=("forward", "grad"))
    with pytest.raises(ValueError, match=r"checks \(\['dtype'\]\) must be some of"):
        check_parity(theirs, ours, [x], key_map=KEY_MAP, checks=("dtype",))
    # the same options as one ParityOptions: the same rows; never both, nor another type
    options = ParityOptions(key_map=KEY_MAP, checks=("forward", "grad"))
    assert check_parity(theirs, ours, [x], options) == rows
    with pytest.raises(TypeError, match=r"options \(a ParityOptions\) and keywords \(seed\)"):
        check_parity(theirs, ours, [x], options, seed=1)
    with pytest.raises(TypeError, match=r"options \(dict\) must be a ParityOptions or None"):
        check_parity(theirs, ours, [x], {"key_map": KEY_MAP})
    with pytest.raises(TypeError, match="unexpected keyword argument 'key_mapping'"):
        check_parity(theirs, ours, [x], key_mapping=KEY_MAP)


@pytest.mark.quick
@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(weights=(fa.load_state_dict, fa.state_dict), key_map=KEY_MAP), ValueError,
         "replaces layout"),
        (dict(weights=(fa.load_state_dict,)), TypeError, "pair of callables"),
        (dict(train_steps=0), ValueError, r"train_steps \(0\)"),
        (dict(train_steps=2.5), TypeError, r"train_steps \(2.5\) must be an int"),
        (dict(reference_dtype="float16"), ValueError, "reference_dtype"),
        (dict(reference_dtype="float64"), ValueError, "integer inputs"),
    ],
)  # fmt: skip
def test_bad_parity_options_are_rejected_by_name(options, error, message):
    theirs, ours, x = _pair()
    with pytest.raises(error, match=message):
        check_parity(theirs, ours, [x], checks=("forward",), **options)


@pytest.mark.quick
def test_own_weight_transfer_and_few_train_steps():
    """``weights=(load, export)`` in place of the key map gives the same rows; ``train_steps``
    compares after the last step."""
    theirs, ours, x = _pair()
    back = {v: k for k, v in KEY_MAP.items()}

    def load(module, state):
        fa.load_state_dict(module, {KEY_MAP.get(k, k): v for k, v in state.items()}, strict=False)

    def export(module):
        return {back.get(k, k): v for k, v in fa.state_dict(module).items() if k != "mask"}

    rows = assert_parity(theirs, ours, [x], weights=(load, export), train_steps=3)
    assert [r.check for r in rows] == ["forward", "grad", "train/adam", "train/adamw",
                                       "train/sgd_momentum"]  # fmt: skip
    assert all(0 < r.max_abs_err < 1e-5 for r in rows), rows


class _Recording(UserAttention):
    """``UserAttention`` that notes the dtype of each input it is called with and torch's default
    dtype then (in a class attribute: the checks call copies of the module)."""

    seen: list = []

    def forward(self, x):
        _Recording.seen.append((x.dtype, self.query.weight.dtype, torch.get_default_dtype()))
        return super().forward(x)


@pytest.mark.quick
def test_the_train_check_holds_flax_to_torchs_float64_run():
    """The train rows' reference is torch training in float64 (inputs, weights and the tensors a
    module makes as it runs), and torch's default dtype is float32 again afterwards."""
    torch.manual_seed(0)
    theirs = _Recording(8, 2)
    _, ours, x = _pair()
    _Recording.seen.clear()
    rows = assert_parity(theirs, ours, [x], key_map=KEY_MAP, checks=("train",), train_steps=2)
    assert [r.check for r in rows] == ["train/adam", "train/adamw", "train/sgd_momentum"]
    assert all(0 < r.max_abs_err < 1e-6 for r in rows), rows
    # The parity API's one float32 call to name the outputs; then per optimiser one call for
    # the output's shape, two steps and the trained output.
    assert _Recording.seen == [(torch.float32,) * 3] + [(torch.float64,) * 3] * 12, _Recording.seen
    assert torch.get_default_dtype() == torch.float32
