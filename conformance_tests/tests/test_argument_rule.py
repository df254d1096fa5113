"""The argument rule, held for every public name (issue 31 items 5 and 8; docs/errors.md).

Each public function and class of ``flax_attention``, ``flax_attention.models``,
``flax_attention.mesh``, ``flax_attention.sharding``, ``flax_attention.launch`` and
``conformance_tests`` (their ``__all__``) has a row in ``TABLE``: a valid call's
arguments, the argument to break, a value of the wrong type and a value of the right type that
breaks the rule. The wrong type must raise
``TypeError`` and the wrong value ``ValueError``, each naming the argument, as
``<name> (<actual>) must <rule> (<expected>)``. ``EXEMPT`` lists, with the reason, each name that
takes no argument to break (constants, type aliases, modules, plain records). A test holds that
every name is in one or the other, so a new public name needs a row.

Small shapes, tiny models and no compiles: every failing check runs before any work.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import conformance_tests as ct
import flax_attention as fa
import flax_attention.launch as fa_launch
import flax_attention.mesh as fa_mesh
import flax_attention.models as fam
import flax_attention.sharding as fa_sharding

#: A wrong value of a row that has none (a bool, a callable: any value of the type is valid).
NONE = object()

CFG = {
    "vocab_size": 11,
    "context_length": 8,
    "emb_dim": 8,
    "n_heads": 2,
    "n_layers": 1,
    "drop_rate": 0.0,
    "qkv_bias": False,
}


def _saved():
    """A safetensors file of a ``SelfAttention_v1(2, 2)``."""
    import tempfile

    path = f"{tempfile.mkdtemp()}/layer.safetensors"
    fa.save_file(fa.SelfAttention_v1(2, 2, rngs=nnx.Rngs(0)), path)
    return path


def _rngs():
    return nnx.Rngs(0)


def _x(*shape):
    return jnp.ones(shape, jnp.float32)


def _gpt():
    return fam.GPTModel(CFG, rngs=_rngs())


def _mesh():
    return jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])


def _divergence_pair():
    """A torch Linear and a Flax one, for ``find_divergence`` (every bad argument is refused
    before either runs)."""
    import torch

    return {
        "torch_model": torch.nn.Linear(2, 2),
        "flax_model": nnx.Linear(2, 2, rngs=_rngs()),
        "inputs": [np.ones((1, 2), np.float32)],
    }


def _optimizer(model):
    import optax

    return nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


@dataclasses.dataclass(frozen=True)
class Row:
    """``call(**valid())`` is a valid call; ``arg`` set to ``wrong_type`` must raise
    ``TypeError`` and to ``wrong_value`` ``ValueError`` (``NONE``: the type has no wrong
    value), each message naming ``arg`` (or ``named``, where the message names a part of it)."""

    name: str
    call: Callable
    valid: Callable[[], dict]
    arg: str
    wrong_type: object
    wrong_value: object
    named: str | None = None
    package: str = ""


QWEN = {"vocab_size": 11, "context_length": 8, "emb_dim": 8, "n_heads": 2, "n_layers": 1,
        "hidden_dim": 8, "head_dim": 4, "qk_norm": True, "n_kv_groups": 1, "rope_base": 1e4,
        "dtype": jnp.float32}  # fmt: skip
LLAMA = {"vocab_size": 11, "context_length": 8, "emb_dim": 8, "n_heads": 2, "n_layers": 1,
         "hidden_dim": 8, "n_kv_groups": 1, "rope_base": 1e4, "rope_freq": None,
         "dtype": jnp.float32}  # fmt: skip


def _layer(cls, **args):
    return lambda: {**args, "rngs": _rngs()}


_ROWS = [
    # ---- flax_attention --------------------------------------------------------------------
    Row("softmax_naive", fa.softmax_naive, lambda: {"x": _x(2, 3)}, "x", "xx", _x()),
    Row(
        "simplified_self_attention",
        fa.simplified_self_attention,
        lambda: {"inputs": _x(3, 4)},
        "inputs",
        "xx",
        _x(4),
    ),
    Row("SelfAttention_v1", fa.SelfAttention_v1, _layer(0, d_in=4, d_out=4), "d_in", 4.0, 0),
    Row("SelfAttention_v2", fa.SelfAttention_v2, _layer(0, d_in=4, d_out=4), "d_out", 4.0, 0),
    Row("SelfAttention", fa.SelfAttention, _layer(0, d_in=4, d_out=4), "d_out", True, -1),
    Row(
        "causal_attn_weights_renormalized",
        fa.causal_attn_weights_renormalized,
        lambda: {"attn_scores": _x(3, 3), "d_key": 4},
        "d_key",
        "4",
        0,
    ),
    Row(
        "causal_attn_weights_masked_fill",
        fa.causal_attn_weights_masked_fill,
        lambda: {"attn_scores": _x(3, 3), "d_key": 4},
        "d_key",
        4.5,
        -4,
    ),
    Row(
        "CausalAttention",
        fa.CausalAttention,
        _layer(0, d_in=4, d_out=4, context_length=4, dropout=0.0),
        "dropout",
        "0.1",
        1.0,
    ),
    Row(
        "MultiHeadAttentionWrapper",
        fa.MultiHeadAttentionWrapper,
        _layer(0, d_in=4, d_out=2, context_length=4, dropout=0.0, num_heads=2),
        "num_heads",
        2.0,
        0,
    ),
    Row(
        "MultiHeadAttention",
        fa.MultiHeadAttention,
        _layer(0, d_in=4, d_out=4, context_length=4, dropout=0.0, num_heads=2),
        "implementation",
        3,
        "flash",
    ),
    Row(
        "GroupedQueryAttention",
        fa.GroupedQueryAttention,
        _layer(0, d_in=4, d_out=4, dropout=0.0, num_heads=2, num_kv_groups=1),
        "num_kv_groups",
        1.0,
        0,
    ),
    Row(
        "MultiHeadLatentAttention",
        fa.MultiHeadLatentAttention,
        _layer(0, d_in=4, d_out=4, dropout=0.0, num_heads=2),
        "latent_dim",
        2.5,
        0,
    ),
    Row(
        "MultiHeadAttentionWithSWA",
        fa.MultiHeadAttentionWithSWA,
        _layer(0, d_in=4, d_out=4, dropout=0.0, num_heads=2),
        "sliding_window_size",
        "2",
        0,
    ),
    Row(
        "MultiHeadedAttention",
        fa.MultiHeadedAttention,
        _layer(0, num_heads=2, d_model=4, dropout=0.0),
        "d_model",
        4.0,
        5,
    ),
    Row(
        "attention",
        fa.attention,
        lambda: {"query": _x(1, 3, 4), "key": _x(1, 3, 4), "value": _x(1, 3, 4)},
        "value",
        "v",
        _x(1, 2, 4),
    ),
    Row(
        "clones",
        fa.clones,
        lambda: {"module": nnx.Linear(2, 2, rngs=_rngs()), "N": 2},
        "N",
        2.0,
        -1,
    ),
    Row(
        "AttentionMask",
        fa.AttentionMask,
        lambda: {"keep": None, "is_causal": True},
        "is_causal",
        1,
        NONE,
    ),
    Row("BlockSizes", fa.BlockSizes, lambda: {"block_q": 8, "block_k": 8}, "block_k", 1.5, 0),
    Row(
        "causal_mask",
        fa.causal_mask,
        lambda: {"num_queries": 3, "num_keys": 3},
        "num_keys",
        3.0,
        -1,
    ),
    Row(
        "masked_softmax",
        fa.masked_softmax,
        lambda: {"attn_scores": _x(3, 3), "d_key": 4},
        "d_key",
        "4",
        0,
    ),
    Row(
        "dot_product_attention",
        fa.dot_product_attention,
        lambda: {"queries": _x(3, 2, 4), "keys": _x(3, 2, 4), "values": _x(3, 2, 4)},
        "kv_layout",
        1,
        "bshd",
    ),
    Row(
        "select_implementation",
        fa.select_implementation,
        lambda: {"queries": _x(3, 2, 4), "keys": _x(3, 2, 4)},
        "kv_layout",
        None,
        "bshd",
    ),
    Row(
        "decode_loop",
        fa.decode_loop,
        lambda: {
            "module": fa.MultiHeadAttention(4, 4, 4, 0.0, 2, rngs=_rngs()),
            "prompt": _x(1, 4),
        },
        "num_steps",
        1.0,
        0,
    ),
    Row(
        "load_state_dict",
        fa.load_state_dict,
        lambda: {"module": fa.SelfAttention_v1(2, 2, rngs=_rngs()), "state_dict": {}},
        "layout",
        3,
        "hf",
    ),
    Row(
        "state_dict",
        fa.state_dict,
        lambda: {"module": fa.SelfAttention_v1(2, 2, rngs=_rngs())},
        "layout",
        None,
        "torch",
    ),
    Row(
        "save_file",
        fa.save_file,
        lambda: {"module": fa.SelfAttention_v1(2, 2, rngs=_rngs()), "path": "/nonexistent/x"},
        "layout",
        b"documents",
        "hf",
    ),
    Row(
        "load_file",
        fa.load_file,
        lambda: {"module": fa.SelfAttention_v1(2, 2, rngs=_rngs()), "path": _saved()},
        "strict",
        "yes",
        NONE,
    ),
    Row(
        "from_torch",
        fa.from_torch,
        lambda: {
            "module": __import__("torch").nn.MultiheadAttention(4, 2),
            "causal": True,
            "context_length": 4,
        },
        "causal",
        1,
        NONE,
    ),
    Row(
        "from_nnx",
        fa.from_nnx,
        lambda: {"module": nnx.MultiHeadAttention(2, 4, decode=False, rngs=_rngs())},
        "module",
        "mha",
        NONE,
    ),
    Row(
        "shard",
        fa.shard,
        lambda: {"module": fa.SelfAttention_v1(2, 2, rngs=_rngs()), "mesh": _mesh()},
        "mesh",
        "mesh",
        NONE,
    ),
    "flax_attention.models",
    Row("Config", fam.Config, lambda: {"cfg": {"vocab_size": 3}}, "cfg", 3, NONE),
    Row("FeedForward", fam.FeedForward, _layer(0, cfg=CFG), "cfg", [1], {**CFG, "emb_dim": 0}),
    Row("GPTModel", fam.GPTModel, _layer(0, cfg=CFG), "cfg", "gpt2", {**CFG, "n_heads": 3}),
    Row("LayerNorm", fam.LayerNorm, lambda: {"emb_dim": 8}, "emb_dim", 8.0, 0),
    Row(
        "Llama3Model",
        fam.Llama3Model,
        _layer(0, cfg=LLAMA),
        "cfg",
        "llama",
        {**LLAMA, "n_heads": 3},
    ),
    Row("Qwen3Model", fam.Qwen3Model, _layer(0, cfg=QWEN), "cfg", [1], {**QWEN, "n_kv_groups": 3}),
    Row(
        "TransformerBlock",
        fam.TransformerBlock,
        _layer(0, cfg=CFG),
        "cfg",
        None,
        {**CFG, "drop_rate": 1.0},
    ),
    Row("quantize", fam.quantize, lambda: {"model": _gpt()}, "scheme", 8, "int4"),
    Row("read_pth", fam.read_pth, lambda: {"path": "/nonexistent.pth"}, "path", 3, NONE),
    Row(
        "generate",
        fam.generate,
        lambda: {"model": _gpt(), "idx": [[1, 2]], "max_new_tokens": 1, "context_size": 4},
        "temperature",
        "hot",
        -1.0,
    ),
    Row(
        "generate_text_simple",
        fam.generate_text_simple,
        lambda: {"model": _gpt(), "idx": [[1, 2]], "max_new_tokens": 1, "context_size": 4},
        "context_size",
        4.0,
        0,
    ),
    Row(
        "calc_loss_batch",
        fam.calc_loss_batch,
        lambda: {"input_batch": [[1, 2]], "target_batch": [[2, 3]], "model": _gpt()},
        "ignore_index",
        -100.0,
        3,
    ),
    Row(
        "calc_loss_loader",
        fam.calc_loss_loader,
        lambda: {"batches": [], "model": _gpt()},
        "num_batches",
        1.0,
        0,
    ),
    Row(
        "evaluate_model",
        fam.evaluate_model,
        lambda: {"model": _gpt(), "train_batches": [], "val_batches": [], "eval_iter": 1},
        "eval_iter",
        "1",
        0,
    ),
    Row(
        "generate_and_print_sample",
        fam.generate_and_print_sample,
        lambda: {"model": _gpt(), "tokenizer": None, "start_context": "hi"},
        "start_context",
        3,
        "",
    ),
    Row(
        "train_model",
        fam.train_model,
        lambda: {
            "model": _gpt(),
            "train_loader": [],
            "val_loader": [],
            "n_epochs": 1,
            "eval_freq": 1,
            "eval_iter": 1,
            "warmup_steps": 1,
            "peak_lr": 0.1,
        },
        "peak_lr",
        "0.1",
        -0.1,
    ),
    Row(
        "train_model_simple",
        fam.train_model_simple,
        lambda: {
            "model": (model := _gpt()),
            "train_loader": [],
            "val_loader": [],
            "optimizer": _optimizer(model),
            "num_epochs": 1,
            "eval_freq": 1,
            "eval_iter": 1,
        },
        "num_epochs",
        1.0,
        0,
    ),
    Row(
        "train_step",
        fam.train_step,
        lambda: {
            "model": (model := _gpt()),
            "optimizer": _optimizer(model),
            "input_batch": [[1, 2]],
            "target_batch": [[2, 3]],
        },
        "optimizer",
        "adam",
        NONE,
    ),
    "flax_attention.mesh",
    Row(
        "LinearAxes",
        fa_mesh.LinearAxes,
        lambda: {"kernel": (None, None), "bias": (None,)},
        "kernel",
        "model",
        (None,),
    ),
    Row(
        "constrain",
        fa_mesh.constrain,
        lambda: {"x": _x(2, 2), "axes": (None, None)},
        "axes",
        3,
        (None,),
    ),
    Row("expand_axes", fa_mesh.expand_axes, lambda: {"axes": (None,), "ndim": 2}, "ndim", 2.0, 0),
    Row(
        "mesh_axis_size",
        fa_mesh.mesh_axis_size,
        lambda: {"mesh": _mesh(), "name": "data"},
        "name",
        0,
        "heads",
    ),
    Row(
        "place",
        fa_mesh.place,
        lambda: {"value": _x(2), "sharding": None},
        "sharding",
        "data",
        NONE,
    ),
    Row(
        "place_like_parameters",
        fa_mesh.place_like_parameters,
        lambda: {"module": fa.SelfAttention_v1(2, 2, rngs=_rngs()), "variables": {}},
        "variables",
        [1],
        NONE,
    ),
    Row(
        "partition_spec",
        fa_mesh.partition_spec,
        lambda: {"variable": nnx.Param(_x(2)), "mesh": _mesh()},
        "variable",
        _x(2),
        NONE,
    ),
    Row(
        "check_variable",
        fa_mesh.check_variable,
        lambda: {"variable": nnx.Param(_x(2)), "mesh": _mesh(), "name": "w"},
        "variable",
        _x(2),
        NONE,
    ),
    Row(
        "parameters_mesh",
        fa_mesh.parameters_mesh,
        lambda: {"module": fa.SelfAttention_v1(2, 2, rngs=_rngs())},
        "module",
        {"w": _x(2)},
        NONE,
    ),
    Row("fetch", fa_mesh.fetch, lambda: {"values": [_x(2)]}, "values", 3, NONE),
    "flax_attention.sharding",
    Row(
        "check_shardable",
        fa_sharding.check_shardable,
        lambda: {"module": fa.SelfAttention_v1(2, 2, rngs=_rngs()), "mesh": _mesh()},
        "mesh",
        None,
        NONE,
    ),
    Row(
        "shard",
        fa_sharding.shard,
        lambda: {"module": fa.SelfAttention_v1(2, 2, rngs=_rngs()), "mesh": _mesh()},
        "module",
        "layer",
        NONE,
    ),
    Row("data_slices", fa_sharding.data_slices, lambda: {"mesh": _mesh()}, "process", 0.0, -1),
    Row(
        "global_batch",
        fa_sharding.global_batch,
        lambda: {"local": np.ones((2, 3)), "mesh": _mesh()},
        "batch_size",
        2.0,
        0,
    ),
    Row(
        "check_data_over_processes",
        fa_sharding.check_data_over_processes,
        lambda: {"data": 2, "held": {0: (0, 1)}},
        "data",
        2.0,
        0,
    ),
    "flax_attention.launch",
    Row(
        "initialize",
        fa_launch.initialize,
        lambda: {"initialization_timeout": 300},
        "initialization_timeout",
        "300",
        0,
    ),
    Row(
        "launch",
        fa_launch.launch,
        lambda: {"command": ["true"], "processes": 1},
        "processes",
        1.5,
        0,
    ),
    Row(
        "main",
        fa_launch.main,
        lambda: {"argv": ["--processes", "1", "true"]},
        "argv",
        "true",
        NONE,  # a command line: argparse exits 2 with the usage (test_multiprocess holds it)
    ),
    "conformance_tests",
    Row("find_divergence", ct.find_divergence, _divergence_pair, "layout", 3, "nope"),
    Row(
        "assert_no_divergence",
        ct.assert_no_divergence,
        _divergence_pair,
        "names",
        ["weight"],
        {"nope": ""},
    ),
]


def _table(rows) -> list[Row]:
    """``_ROWS`` with each row's package: a string starts the rows of that package."""
    table, package = [], "flax_attention"
    for row in rows:
        if isinstance(row, str):
            package = row
        else:
            table.append(dataclasses.replace(row, package=package))
    return table


TABLE = _table(_ROWS)

#: Names with no argument to break, each with the reason.
EXEMPT = {
    # constants
    ("flax_attention", "IMPLEMENTATIONS"): "a constant (the implementations' names)",
    ("flax_attention.models", "GPT_CONFIG_124M"): "a constant (the book's config dict)",
    ("flax_attention.mesh", "DATA"): "a constant (a mesh axis's name)",
    ("flax_attention.mesh", "MODEL"): "a constant (a mesh axis's name)",
    ("flax_attention.mesh", "HEADS"): "a constant (partition axes)",
    ("flax_attention.mesh", "CACHE_HEADS"): "a constant (partition axes)",
    ("flax_attention.mesh", "ONE_HEAD"): "a constant (partition axes)",
    ("flax_attention.mesh", "TO_HEADS"): "a constant (a LinearAxes)",
    ("flax_attention.mesh", "FROM_HEADS"): "a constant (a LinearAxes)",
    ("flax_attention.mesh", "SplitsOverModel"): "a Protocol (what a layer declares)",
    ("flax_attention.launch", "COORDINATOR"): "a constant (an environment variable's name)",
    ("flax_attention.launch", "NUM_PROCESSES"): "a constant (an environment variable's name)",
    ("flax_attention.launch", "PROCESS_ID"): "a constant (an environment variable's name)",
    # records the package returns, never built from a user's arguments
    ("flax_attention", "ProjectedKV"): "a NamedTuple of two arrays project_kv returns",
    ("flax_attention", "IncompatibleKeys"): "a NamedTuple of key lists load_state_dict returns",
    ("flax_attention.launch", "Launch"): "a dataclass of the results launch returns",
    ("conformance_tests", "DivergenceReport"): "a dataclass find_divergence returns",
    ("conformance_tests", "DivergenceRow"): "a dataclass of DivergenceReport's rows",
    # no arguments
    ("flax_attention.models", "GELU"): "a module with no arguments (the book's GELU())",
    # modules: their own public names are held where their chapters' tests are
    ("flax_attention.models", "annotated"): "a module (the Annotated Transformer)",
    ("flax_attention.models", "classify"): "a module (chapter 6)",
    ("flax_attention.models", "instruct"): "a module (chapter 7)",
    ("flax_attention.models", "lora"): "a module (appendix E)",
    ("flax_attention.models", "llama3"): "a module (the book's package's Llama 3)",
    ("flax_attention.models", "qwen3"): "a module (the book's package's Qwen3)",
}

PACKAGES = {
    "flax_attention": fa,
    "flax_attention.models": fam,
    "flax_attention.mesh": fa_mesh,
    "flax_attention.sharding": fa_sharding,
    "flax_attention.launch": fa_launch,
    "conformance_tests": ct,
}


@pytest.mark.quick
def test_every_public_name_is_held_or_exempt():
    for row in TABLE:
        assert getattr(PACKAGES[row.package], row.name) is row.call, f"{row.package}.{row.name}"
    held = {(row.package, row.name) for row in TABLE}
    public = {(package, name) for package, module in PACKAGES.items() for name in module.__all__}
    assert not held & set(EXEMPT), f"both held and exempt: {sorted(held & set(EXEMPT))}"
    missing = public - held - set(EXEMPT)
    assert not missing, f"public names with no row in TABLE nor EXEMPT: {sorted(missing)}"
    stale = (held | set(EXEMPT)) - public
    assert not stale, f"rows for names that are not public: {sorted(stale)}"


def _raises(row: Row, value, error):
    arguments = {**row.valid(), row.arg: value}
    named = re.escape(row.named or row.arg)
    with pytest.raises(error) as caught:
        row.call(**arguments)
    message = str(caught.value)
    assert caught.type is error, f"{row.name}: {caught.type.__name__}, not {error.__name__}"
    assert re.search(rf"(^|\W){named}\W.*\bmust\b", message), (
        f"{row.name}({row.arg}={value!r}): the message does not name {row.arg}: {message}"
    )


def _params(rows):
    return [pytest.param(row, id=f"{row.package}.{row.name}.{row.arg}") for row in rows]


@pytest.mark.parametrize("row", _params(TABLE))
def test_a_wrong_type_is_a_type_error_naming_the_argument(row):
    _raises(row, row.wrong_type, TypeError)


VALUED = [row for row in TABLE if row.wrong_value is not NONE]


@pytest.mark.parametrize("row", _params(VALUED))
def test_a_wrong_value_is_a_value_error_naming_the_argument(row):
    _raises(row, row.wrong_value, ValueError)
