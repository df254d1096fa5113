"""``conformance_tests.find_divergence`` against every model of the package and its torch side:
a clean pair departs nowhere (forward and gradients); each planted bug is named where it is.

The pairs are tiny (2 blocks, d 32) and each is searched several times: the Flax side runs op by
op (its operations compile once per shape, the first search of a model pays for them) and the
backward pass is one compiled program per search that gets that far (a forward departure stops
before it).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import conformance_tests
import flax_attention as fa
from conformance_tests import annotated_model as post
from conformance_tests import book_gpt
from conformance_tests.cli import main as cli_main
from conformance_tests.divergence import find_divergence
from flax_attention import MultiHeadedAttention
from flax_attention._layers import Embed
from flax_attention.models import GPTModel, Llama3Model, Qwen3Model, annotated
from flax_attention.models.gpt import TransformerBlock

GPT = {"vocab_size": 97, "context_length": 16, "emb_dim": 32, "n_heads": 2, "n_layers": 2,
       "drop_rate": 0.0, "qkv_bias": True}  # fmt: skip
IDS = np.random.default_rng(0).integers(0, 97, (2, 11))


def _moved(variable, index, by):
    """``variable`` with one entry moved by ``by``: a wrong weight."""
    variable[...] = variable[...].at[index].add(by)


# ---- the book's GPTModel -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def book():
    torch.manual_seed(0)
    return book_gpt.GPTModel(GPT).eval()


def _gpt(book, **options):
    model = GPTModel(GPT, rngs=nnx.Rngs(0), **options)
    fa.load_state_dict(model, {k: v.detach().numpy() for k, v in book.state_dict().items()})
    model.eval()
    return model


class NoShortcut(TransformerBlock):
    """The attention half without its shortcut: every child right, the block's wiring wrong."""

    def __call__(self, x, *, decode=False, mask=None):
        x = self.drop_resid(self.att._forward(self.norm1(x), decode=decode, mask=mask))
        return self.drop_resid(self.ff(self.norm2(x))) + x


class StoppedShortcut(TransformerBlock):
    """The forward right, the gradient through the first shortcut stopped: the block's wiring
    of the backward pass is wrong, each child's is right."""

    def __call__(self, x, *, decode=False, mask=None):
        shortcut = jax.lax.stop_gradient(x)
        x = self.drop_resid(self.att._forward(self.norm1(x), decode=decode, mask=mask)) + shortcut
        return self.drop_resid(self.ff(self.norm2(x))) + x


class Relu(nnx.Module):
    def __call__(self, x):
        return jax.nn.relu(x)


class StoppedEmbed(Embed):
    """The lookup with its gradient stopped: the forward holds, the table learns nothing."""

    def __call__(self, inputs, out_sharding=None):
        return jax.lax.stop_gradient(super().__call__(inputs, out_sharding))


def _plant(model, bug):
    block = model.trf_blocks[1]
    if bug == "norm":
        _moved(block.norm1.scale, 3, 0.1)
    elif bug == "projection":
        _moved(block.att.W_value.kernel, (0, 5), 0.05)
    elif bug == "activation":
        model.trf_blocks[0].ff.layers[1] = Relu()
    elif bug == "shortcut":
        object.__setattr__(block, "__class__", NoShortcut)
    return model


#: Each planted bug and the submodule that must be named.
PLANTED = {
    "norm": "trf_blocks.1.norm1",
    "projection": "trf_blocks.1.att.W_value",
    "activation": "trf_blocks.0.ff.layers.1",
    "shortcut": "trf_blocks.1",  # the block, not a child: each holds on its own inputs
}


def test_the_book_gpt_clean_and_each_planted_bug(book):
    """One test, so that one worker runs the model's operations for the first time."""
    report = find_divergence(book, _gpt(book), [IDS])
    assert report.first is None and report.first_grad is None, str(report)
    assert all(row.passed and row.grad_passed is not False for row in report.rows), str(report)
    names = [row.name for row in report.rows]
    assert names[:3] == ["", "tok_emb", "pos_emb"]  # torch's call order
    assert names.count("trf_blocks.1.drop_resid") == 2  # called twice: compared per call
    assert report.merged["trf_blocks"] == ""  # nn.Sequential, an nnx.List here
    assert report.merged["trf_blocks.0.ff.layers"] == "trf_blocks.0.ff"
    assert report.params["trf_blocks.0.att.W_key.bias"][0] <= 1e-5  # noise, within the floor
    for bug, expected in PLANTED.items():
        report = find_divergence(book, _plant(_gpt(book), bug), [IDS])
        assert (report.first, report.first_grad) == (expected, None), f"{bug}:\n{report}"
        first = next(row for row in report.rows if row.name == expected)
        assert not first.passed and first.given_torch > 100 * first.bound, bug
    # the dropped shortcut: each child holds on torch's inputs, though not as the model runs
    children = [r for r in report.rows if r.name.startswith("trf_blocks.1.")]
    assert all(r.passed for r in children) and max(r.flowing for r in children) > 1e-2
    model = _gpt(book)
    object.__setattr__(model.pos_emb, "__class__", StoppedEmbed)
    report = find_divergence(book, model, [IDS])
    assert (report.first, report.first_grad) == (None, "pos_emb"), str(report)
    error, bound = report.params["pos_emb.weight"]
    assert error > 1e3 * bound
    assert all(e <= b for k, (e, b) in report.params.items() if k != "pos_emb.weight")
    model = _gpt(book)
    object.__setattr__(model.trf_blocks[1], "__class__", StoppedShortcut)
    report = find_divergence(book, model, [IDS])
    # every parameter before block 1 departs, block 1's own children hold: the block is named
    assert (report.first, report.first_grad) == (None, "trf_blocks.1"), str(report)


def test_the_book_gpt_in_bfloat16_against_torch_in_float32(book):
    model = _gpt(book, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    report = find_divergence(book, model, [IDS])
    assert report.first is None and report.first_grad is None, str(report)
    assert max(row.given_torch for row in report.rows) > 1e-3  # bfloat16's rounding, held
    _moved(model.trf_blocks[1].norm2.scale, 3, 1.0)
    assert find_divergence(book, model, [IDS], backward=False).first == "trf_blocks.1.norm2"


# ---- the Annotated Transformer -----------------------------------------------------------------


@pytest.fixture(scope="module")
def post_pair():
    torch.manual_seed(0)
    twin = post.make_model(11, 11, N=2, d_model=32, d_ff=64, h=4, dropout=0.0)
    for module in twin.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    twin.eval()
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(1, 11, (2, 9)), rng.integers(1, 11, (2, 8))
    src[1, 6:] = 0  # padding: the masks matter
    tgt[1, 5:] = 0
    batch = post.Batch(torch.from_numpy(src), torch.from_numpy(tgt), pad=0)
    inputs = [batch.src, batch.tgt, batch.src_mask, batch.tgt_mask]
    return twin, inputs


def _encoder_decoder(twin):
    """The post's model in Flax holding the twin's weights: built abstract (nothing drawn, as
    ``checkpoints.new_model``), then loaded."""

    def make():
        return annotated.make_model(11, 11, N=2, d_model=32, d_ff=64, h=4, dropout=0.0,
                                    attention_dropout=0.0, rngs=nnx.Rngs(0))  # fmt: skip

    model = nnx.eval_shape(make)
    nnx.update(model, jax.jit(lambda: nnx.state(make(), nnx.Not(nnx.Param)))())
    fa.load_state_dict(model, {k: v.detach().numpy() for k, v in twin.state_dict().items()})
    model.eval()
    return model


class MasklessAttention(MultiHeadedAttention):
    """Attention that ignores its mask: wrong on the padded source only."""

    def __call__(self, query, key=None, value=None, mask=None, **options):
        return super().__call__(query, key, value, None, **options)


def test_the_encoder_decoder_departs_nowhere_and_a_cross_attention_bug_is_named(post_pair):
    twin, inputs = post_pair
    model = _encoder_decoder(twin)
    report = find_divergence(twin, model, inputs)
    assert report.first is None and report.first_grad is None, str(report)
    row = next(r for r in report.rows if r.name == "decoder.layers.0.src_attn.linears.1")
    assert row.flax_path == "decoder.layers.0.src_attn.proj_weights.1"  # the registry's names
    assert report.params["generator.proj.weight"] == (0.0, 1e-5)  # not called: zeros, as torch
    object.__setattr__(model.decoder.layers[1].src_attn, "__class__", MasklessAttention)
    report = find_divergence(twin, model, inputs)
    # src_attn runs inside sublayer.1's call (its sibling by name): the innermost call is named
    assert report.first == "decoder.layers.1.src_attn", str(report)
    departing = {r.name for r in report.rows if not r.passed}
    assert "decoder.layers.1.sublayer.1" in departing
    assert not any(name.startswith("decoder.layers.1.src_attn.") for name in departing)


# ---- transformers' GPT-2 ----------------------------------------------------------------------


def test_transformers_gpt2_through_the_gpt2_layout():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=2, initializer_range=0.2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    model = GPTModel({**GPT, "tie_word_embeddings": True}, rngs=nnx.Rngs(0))
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    fa.load_state_dict(model, state, layout="gpt2")
    model.eval()
    report = find_divergence(hf, model, [IDS], layout="gpt2")
    assert report.first is None and report.first_grad is None, str(report)
    paired = {row.name: row.flax_path for row in report.rows}
    assert paired["transformer.h.1.mlp"] == "trf_blocks.1.ff"
    assert paired["transformer.h.1.attn.c_proj"] == "trf_blocks.1.att.out_proj"
    # the fused projection the port splits, the inlined activation: compared in their ancestor
    assert report.merged["transformer.h.1.attn.c_attn"] == "transformer.h.1.attn"
    assert report.merged["transformer.h.1.mlp.act"] == "transformer.h.1.mlp"
    assert set(report.params) == {k for k, _ in hf.named_parameters()}
    _moved(model.trf_blocks[1].ff.layers[2].kernel, (2, 3), 0.1)
    report = find_divergence(hf, model, [IDS], layout="gpt2")
    assert report.first == "transformer.h.1.mlp.c_proj", str(report)


# ---- the book's Qwen3 and Llama 3 -------------------------------------------------------------


QWEN = {"vocab_size": 97, "context_length": 16, "emb_dim": 32, "n_heads": 4, "n_layers": 2,
        "hidden_dim": 48, "head_dim": 16, "qk_norm": True, "n_kv_groups": 2,
        "rope_base": 10_000.0}  # fmt: skip
LLAMA = {"vocab_size": 97, "context_length": 16, "emb_dim": 32, "n_heads": 4, "n_layers": 2,
         "hidden_dim": 48, "n_kv_groups": 2, "rope_base": 500_000.0,
         "rope_freq": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_context_length": 1024}}  # fmt: skip


@pytest.mark.parametrize(
    "name, bug, expected",
    [
        ("qwen3", "att.q_norm.scale", "trf_blocks.1.att.q_norm"),  # heads before tokens
        ("llama3", "norm2.weight", "trf_blocks.1.norm2"),
    ],
)
def test_qwen3_and_llama3_against_the_books_package(name, bug, expected):
    from llms_from_scratch import llama3, qwen3

    flax_class, book_class, cfg = {
        "qwen3": (Qwen3Model, qwen3.Qwen3Model, QWEN),
        "llama3": (Llama3Model, llama3.Llama3Model, LLAMA),
    }[name]
    model = flax_class({**cfg, "dtype": jnp.float32}, rngs=nnx.Rngs(0))
    state = fa.state_dict(model)
    rng = np.random.default_rng(1)
    for key in state:  # norms away from 1, so that a norm read wrongly shows
        if "norm" in key:
            state[key] = (1 + 0.3 * rng.standard_normal(state[key].shape)).astype(np.float32)
    fa.load_state_dict(model, state)
    theirs = book_class({**cfg, "dtype": torch.float32})
    theirs.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    theirs.eval()
    ids = IDS[:, :7]  # 7 tokens, 4 heads: one order of axes reads torch's (b, h, t, d) as ours
    report = find_divergence(theirs, model, [ids])
    assert report.first is None and report.first_grad is None, str(report)
    owner, _, variable = f"trf_blocks.1.{bug}".rpartition(".")
    module = model
    for part in owner.split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    _moved(getattr(module, variable), 2, 0.1)
    assert find_divergence(theirs, model, [ids], backward=False).first == expected


# ---- a user's pair with other names, the command line ------------------------------------------


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([TorchBlock(), TorchBlock()])
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class FlaxBlock(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.dense(x))


class FlaxNet(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([FlaxBlock(rngs), FlaxBlock(rngs)])
        self.out = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


NAMES = {"blocks": "layers", "blocks.0.fc": "layers.0.dense", "blocks.1.fc": "layers.1.dense",
         "head": "out"}  # fmt: skip


def user_pair():
    """A torch model and its Flax port under other names, holding the same weights (the
    command line's factory: ``conformance_tests.tests.test_divergence:user_pair``)."""
    torch.manual_seed(0)
    theirs = TorchNet().eval()
    ours = FlaxNet(nnx.Rngs(0))
    for linear, dense in [
        (theirs.blocks[0].fc, ours.layers[0].dense),
        (theirs.blocks[1].fc, ours.layers[1].dense),
        (theirs.head, ours.out),
    ]:
        dense.kernel[...] = linear.weight.detach().numpy().T
        dense.bias[...] = linear.bias.detach().numpy()  # fmt: skip
    x = np.random.default_rng(0).standard_normal((2, 5, 4)).astype(np.float32)
    return {"torch_model": theirs, "flax_model": ours, "inputs": [x], "names": NAMES}


def not_a_pair():
    return "pair"


def broken_user_pair():
    made = user_pair()
    _moved(made["flax_model"].layers[1].dense.bias, 2, 0.01)
    return made


@pytest.mark.quick
def test_a_users_pair_under_other_names_and_the_report_forms(capsys, tmp_path):
    made = user_pair()
    theirs, ours = made["torch_model"], made["flax_model"]
    before = nnx.state(ours)
    report = conformance_tests.assert_no_divergence(theirs, ours, made["inputs"], names=NAMES)
    assert [(r.name, r.flax_path) for r in report.rows[:3]] == [
        ("", ""), ("blocks.0", "layers.0"), ("blocks.0.fc", "layers.0.dense")
    ]  # fmt: skip
    assert set(report.params) == {k for k, _ in theirs.named_parameters()}
    assert all(p.grad is None for p in theirs.parameters())  # the torch model is as it was
    assert jax.tree.all(jax.tree.map(np.array_equal, before, nnx.state(ours)))
    broken = broken_user_pair()
    report = find_divergence(theirs, broken["flax_model"], made["inputs"], names=NAMES)
    assert report.first == "blocks.1.fc", str(report)
    table = str(report)
    assert "first departure (forward, given torch's inputs): blocks.1.fc" in table
    assert "DEPARTS  <- first" in table
    parsed = json.loads(report.to_json())
    assert parsed["first"] == "blocks.1.fc" and len(parsed["rows"]) == len(report.rows)
    with pytest.raises(AssertionError, match="blocks.1.fc"):
        conformance_tests.assert_no_divergence(
            theirs, broken["flax_model"], made["inputs"], names=NAMES
        )
    # the command line: python -m conformance_tests diverge MODULE:FACTORY
    module = "conformance_tests.tests.test_divergence"
    assert cli_main(["diverge", f"{module}:user_pair"]) == 0
    written = tmp_path / "report.json"
    command = ["diverge", f"{module}:broken_user_pair", "--forward-only", "--json", str(written)]
    assert cli_main(command) == 1
    assert "<- first" in capsys.readouterr().out
    assert json.loads(written.read_text())["first"] == "blocks.1.fc"
    assert cli_main(["diverge", f"{module}:no_such_factory"]) == 2
    assert cli_main(["diverge", f"{module}:not_a_pair"]) == 2
    assert "must return (torch_model, flax_model, inputs)" in capsys.readouterr().err


@pytest.mark.quick
@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(names={"blocks.7": "layers.0"}), ValueError, r"names key 'blocks\.7' must be a"),
        (dict(names={"blocks.0": "layers.7"}), ValueError, r"names\['blocks\.0'\] \('layers\.7'\)"),
        (dict(names=["blocks"]), TypeError, r"names \(list\) must be None or a mapping"),
        (dict(inputs=[]), TypeError, r"inputs \(0 arrays\) must be the positional arguments"),
        (dict(layout="nope"), ValueError, r"layout \('nope'\) must be None or a registered"),
        (dict(layout="gpt2"), ValueError, r"layout \(.gpt2.\) must be None for a flax_model"),
        (dict(rtol=-1.0), ValueError, r"rtol \(-1\.0\) must be None or a positive number"),
        (dict(torch_model="model"), TypeError, r"torch_model \(str\) must be a torch\.nn"),
    ],
)  # fmt: skip
def test_bad_arguments_name_themselves(change, error, message):
    made = {**user_pair(), **change}
    with pytest.raises(error, match=message):
        find_divergence(**made)


@pytest.mark.quick
def test_models_in_different_modes_are_refused(book):
    model = GPTModel({**GPT, "drop_rate": 0.1}, rngs=nnx.Rngs(0))  # in train mode, as built
    with pytest.raises(ValueError, match=r"flax_model \(train mode\) must be in the mode of"):
        find_divergence(book, model, [IDS])


@pytest.mark.quick
def test_the_command_line_without_torch_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # what find_spec sees when it is absent
    assert cli_main(["diverge", "conformance_tests.tests.test_divergence:user_pair"]) == 2
    assert capsys.readouterr().err.startswith("python -m conformance_tests needs torch")
