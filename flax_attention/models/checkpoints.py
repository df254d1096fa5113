"""Checkpoints of ``GPTModel``: Hugging Face GPT-2 directories in and out, the book's ``.pth``.

- ``load_pretrained(GPTModel, path)`` (``GPTModel.from_pretrained(path)``) reads a directory
  as ``save_pretrained`` writes it or as the hub serves it: ``config.json`` and
  ``model.safetensors``, or a sharded ``model.safetensors.index.json`` with its shard files.
  The model is built abstractly (no parameter is drawn at random) and filled through the weight
  bridge's ``"gpt2"`` layout, one strict, all-or-nothing load; its RNG state is concrete, so
  the result jits, differentiates and trains like any module.
- ``save_pretrained(model, path)`` (``model.save_pretrained(path)``) writes ``config.json`` and
  ``model.safetensors`` that ``transformers.GPT2LMHeadModel.from_pretrained`` loads to the same
  logits.
- ``read_pth(path)``: the book saves its model with ``torch.save(model.state_dict(), ...)`` (or a
  dict holding it under ``"model_state_dict"``); this reads one with
  ``torch.load(..., weights_only=True)`` (nothing is unpickled beyond tensors) into NumPy
  arrays for ``flax_attention.load_state_dict``. It needs torch, and says so.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickletools
import zipfile
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_attention._checks import check_instance
from flax_attention.sharding import shard
from flax_attention.weights import (
    load_state_dict,
    open_safetensors,
    state_dict,
    write_safetensors,
)

__all__ = [
    "config_from_hf",
    "config_to_hf",
    "load_pretrained",
    "new_model",
    "read_pth",
    "save_pretrained",
]

#: Hugging Face activation names of the tanh GELU, the book's ``GELU``.
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def config_from_hf(hf: Mapping) -> dict:
    """The book's ``cfg`` from a Hugging Face ``config.json``'s contents, read by its
    ``model_type`` (``CONFIG_READERS``; absent: ``"gpt2"``, as GPT-2's first checkpoints); a
    type no reader knows is a ``ValueError`` naming it and the known ones."""
    check_instance("hf", hf, Mapping, "a config.json's contents (a dict)")
    model_type = hf.get("model_type", "gpt2")
    reader = CONFIG_READERS.get(model_type)
    if reader is None:
        raise ValueError(
            f"config model_type ({model_type!r}) must be one of {tuple(CONFIG_READERS)} (the "
            "models whose config.json this package reads)"
        )
    return reader(hf)


def _gpt2_config(hf: Mapping) -> dict:
    """GPT-2's ``config.json`` as the book's ``GPTModel`` cfg. Options the book's model does not
    have are a ``ValueError`` naming them (another activation, ``layer_norm_epsilon`` other than
    the book's 1e-5, ``n_inner`` other than ``4 * n_embd``, unequal dropout rates, scaled or
    reordered attention, cross-attention)."""
    fixed = {  # name: (value, what the book's model takes, why)
        "activation_function": (
            hf.get("activation_function", "gelu_new"),
            TANH_GELU,
            "the book's GELU is the tanh approximation",
        ),
        "layer_norm_epsilon": (
            hf.get("layer_norm_epsilon", 1e-5),
            (1e-5,),
            "the book's LayerNorm adds eps 1e-5 to the variance",
        ),
        "scale_attn_weights": (
            hf.get("scale_attn_weights", True),
            (True,),
            "the book's attention divides the scores by sqrt(head_dim)",
        ),
        "scale_attn_by_inverse_layer_idx": (
            hf.get("scale_attn_by_inverse_layer_idx", False),
            (False,),
            "the book's attention scales every layer alike",
        ),
        "reorder_and_upcast_attn": (
            hf.get("reorder_and_upcast_attn", False),
            (False,),
            "the book's attention has no such option",
        ),
        "add_cross_attention": (
            hf.get("add_cross_attention", False),
            (False,),
            "the book's GPTModel is a decoder alone",
        ),
    }
    for name, (value, allowed, why) in fixed.items():
        if value not in allowed:
            raise ValueError(
                f"config {name} ({value!r}) must be one of {allowed} for GPTModel ({why})"
            )
    n_embd = hf.get("n_embd", 768)
    if hf.get("n_inner") not in (None, 4 * n_embd):
        raise ValueError(
            f"config n_inner ({hf['n_inner']}) must be null or 4 * n_embd ({4 * n_embd})"
        )
    rates = {name: hf.get(name, 0.1) for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    if len(set(rates.values())) > 1:
        raise ValueError(f"config dropout rates ({rates}) must be equal (the book's drop_rate)")
    return {
        "vocab_size": hf.get("vocab_size", 50257),
        "context_length": hf.get("n_positions", 1024),
        "emb_dim": n_embd,
        "n_heads": hf.get("n_head", 12),
        "n_layers": hf.get("n_layer", 12),
        "drop_rate": rates["resid_pdrop"],
        "qkv_bias": True,
        # absent means tied: transformers' GPT2Config defaults it to True (the hub's gpt2)
        "tie_word_embeddings": hf.get("tie_word_embeddings", True),
    }


#: Hugging Face ``model_type`` -> the reader of its ``config.json`` into the book's cfg of the
#: matching model: a new model registers its reader here, and nothing else reads configs.
CONFIG_READERS: dict[str, Callable[[Mapping], dict]] = {"gpt2": _gpt2_config}


def config_to_hf(cfg: Mapping) -> dict:
    """A GPT-2 ``config.json``'s contents for the book's ``cfg``."""
    out = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg["vocab_size"],
        "n_positions": cfg["context_length"],
        "n_embd": cfg["emb_dim"],
        "n_layer": cfg["n_layers"],
        "n_head": cfg["n_heads"],
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": cfg["drop_rate"],
        "embd_pdrop": cfg["drop_rate"],
        "attn_pdrop": cfg["drop_rate"],
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "use_cache": True,
        "tie_word_embeddings": cfg.get("tie_word_embeddings", False),
    }
    # GPT-2's <|endoftext|>, where the vocabulary has it; else null, which transformers'
    # GPT2Config would otherwise fill with 50256 (outside the vocabulary, warned about on load).
    out["bos_token_id"] = out["eos_token_id"] = 50256 if cfg["vocab_size"] > 50256 else None
    return out


def new_model(cls, cfg, *, seed: int = 0, **options):
    """A ``cls`` (``GPTModel``) whose parameters are abstract (shapes only, nothing drawn) and
    whose other state (dropout RNG streams) is concrete: what a checkpoint is loaded into. A
    strict load then leaves nothing abstract."""

    def make():
        return cls(cfg, rngs=nnx.Rngs(seed), **options)

    model = nnx.eval_shape(make)
    # Only the RNG state comes out of this jit, so XLA drops every parameter's initialiser.
    rest = jax.jit(lambda: nnx.state(make(), nnx.Not(nnx.Param)))()
    nnx.update(model, rest)
    return model


def _weight_files(directory: pathlib.Path) -> list[pathlib.Path]:
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(
                f"checkpoint index ({str(index)!r}) must be JSON with a weight_map ({error})"
            ) from error
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ValueError(
                    f"checkpoint ({str(directory)!r}) must hold {file.name}, a shard named by "
                    "model.safetensors.index.json"
                )
        return files
    unread = (
        "; its pytorch_model.bin is not read (a pickle): load the directory in transformers and "
        "save_pretrained it again, which writes model.safetensors"
        if (directory / "pytorch_model.bin").is_file()
        else ""
    )
    raise ValueError(
        f"checkpoint ({str(directory)!r}) must hold model.safetensors or "
        f"model.safetensors.index.json (as save_pretrained writes them){unread}"
    )


def _check_directory(path) -> None:
    """``path`` must be a local directory: a hub name (``"gpt2"``) is never downloaded, so the
    message says how to fetch one; a file is not its directory."""
    name, directory = os.fspath(path), pathlib.Path(path)
    if directory.is_dir():
        return
    if directory.is_file():
        raise ValueError(
            f"path ({name!r}) must be a checkpoint directory, not a file: pass the directory "
            f"that holds config.json and model.safetensors ({str(directory.parent)!r}?)"
        )
    local = f"{directory.name}-checkpoint"
    raise ValueError(
        f"path ({name!r}) must be a local checkpoint directory holding config.json and "
        "model.safetensors (as transformers' save_pretrained writes them); there is no such "
        "directory, and hub names are never downloaded. Fetch the files first, e.g. "
        f"`hf download {name} config.json model.safetensors --local-dir {local}` "
        "(huggingface_hub's command line) or, with transformers, "
        f"`GPT2LMHeadModel.from_pretrained({name!r}).save_pretrained({local!r})`; then "
        f"GPTModel.from_pretrained({local!r})"
    )


def load_pretrained(cls, path: str | os.PathLike, *, seed: int = 0, mesh=None, **options):
    """A ``cls`` (``GPTModel``, in eval mode) from a Hugging Face GPT-2 checkpoint directory
    (``Qwen3Model``, ``Llama3Model``: theirs; ``cls.HF_MODEL_TYPES`` the ``model_type`` values
    it takes, ``cls.HF_LAYOUT`` the weight bridge's layout of their names).

    ``options``: ``GPTModel``'s keyword options (``dtype``, ``param_dtype``, ``precision``,
    ``implementation``); ``seed`` seeds the dropout streams. Every tensor is checked by name,
    shape and dtype (``layout="gpt2"``, both ``transformer.h.{i}.`` and the hub's ``h.{i}.``,
    old checkpoints' ``attn.bias``/``attn.masked_bias`` buffers checked, a tied
    ``lm_head.weight`` equal to ``wte.weight``); a missing file or a bad tensor is a
    ``ValueError`` naming it, and so is a ``path`` that is no local directory (a hub name such
    as ``"gpt2"`` is never downloaded: the message says how to fetch the files). ``mesh``: the
    model is placed on it as ``flax_attention.shard`` places it, each tensor straight from the
    file to its slices (each process of a mesh over several reads and holds only its own
    devices' slices); a size that does not divide over the mesh is a ``ValueError`` before the
    file is read."""
    from safetensors import SafetensorError

    directory = pathlib.Path(path)
    _check_directory(path)
    if not (directory / "config.json").is_file():
        raise ValueError(
            f"checkpoint ({str(directory)!r}) must hold config.json (as save_pretrained writes it)"
        )
    try:
        hf = json.loads((directory / "config.json").read_text())
    except ValueError as error:
        raise ValueError(f"config.json in {str(directory)!r} must be JSON ({error})") from error
    model_type = hf.get("model_type", "gpt2") if isinstance(hf, Mapping) else None
    if model_type not in cls.HF_MODEL_TYPES:
        raise ValueError(
            f"checkpoint ({str(directory)!r}) config model_type ({model_type!r}) must be one of "
            f"{cls.HF_MODEL_TYPES} for {cls.__name__}"
        )
    cfg = config_from_hf(hf)
    files = _weight_files(directory)
    model = new_model(cls, cfg, seed=seed, **options)
    if mesh is not None:
        shard(model, mesh)  # the abstract parameters learn where they go
    try:  # the shards' tensors, read when checked, then by the slices this process places
        with open_safetensors(files) as tensors:
            load_state_dict(model, tensors, layout=cls.HF_LAYOUT)
    except SafetensorError as error:
        raise ValueError(f"checkpoint ({str(directory)!r}): unreadable file ({error})") from error
    except ValueError as error:
        raise ValueError(f"checkpoint ({str(directory)!r}): {error}") from error
    model.eval()
    return model


def save_pretrained(model, path: str | os.PathLike) -> None:
    """Write ``config.json`` and ``model.safetensors`` (Hugging Face's names, ``transformer.``
    prefixed; a tied head's ``lm_head.weight`` left out, as transformers writes it)."""
    directory = pathlib.Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = state_dict(model, layout=model.HF_LAYOUT)
    if model.cfg["tie_word_embeddings"]:
        tensors.pop("lm_head.weight")
    write_safetensors(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(model.hf_config(), indent=2) + "\n")


#: What ``read_pth`` reads, as its messages say it.
_PTH = (
    "a state dict saved with torch.save(model.state_dict(), path), or the book's checkpoint "
    'dict {"model_state_dict": ..., ...}'
)


def _pickled_class(name: str) -> str | None:
    """The class of the object a torch file pickles (``"module.GPTModel"``), read from the
    pickle's opcodes without unpickling anything; ``None`` if it is not one (a dict, a list,
    not a zip file torch wrote)."""
    try:
        with zipfile.ZipFile(name) as archive:
            member = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
            data = archive.read(member)
    except (zipfile.BadZipFile, StopIteration, OSError):
        return None
    strings = []
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name in ("PROTO", "FRAME", "MEMOIZE", "BINPUT", "LONG_BINPUT", "PUT"):
                continue
            if opcode.name == "GLOBAL":  # protocol 2, torch.save's: the first object's class
                return arg.replace(" ", ".")
            if opcode.name == "STACK_GLOBAL" and len(strings) == 2:
                return ".".join(strings)
            if "UNICODE" not in opcode.name:
                return None  # a container or a value built from no class
            strings.append(arg)
    except ValueError:  # not a pickle after all
        return None
    return None


def _unreadable(torch, name: str, error: Exception) -> str:
    """Why ``torch.load(name, weights_only=True)`` failed, in a line: a safetensors file, a
    file that is no zip archive (as torch.save writes), the classes the file pickles besides
    tensors (a module inside a dict, ...), else torch's own first line."""
    with open(name, "rb") as file:
        head = file.read(9)
    if len(head) == 9 and head[8:] == b"{" and int.from_bytes(head[:8], "little") > 1:
        return "it is a safetensors file, which flax_attention.load_file(model, path) reads"
    if not zipfile.is_zipfile(name):
        return f"it is not a zip archive as torch.save writes ({type(error).__name__})"
    try:
        classes = torch.serialization.get_unsafe_globals_in_checkpoint(name)
    except Exception:  # noqa: BLE001 - its own error is the one to report
        classes = []
    if classes:
        return f"it pickles objects of {sorted(classes)}, which only unpickling code can read"
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def read_pth(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The book's torch checkpoint (``torch.save(model.state_dict(), path)``, or a dict with
    ``"model_state_dict"`` as chapter 5 saves model and optimizer) as NumPy arrays, for
    ``flax_attention.load_state_dict(model, read_pth(path))``. Reads with
    ``torch.load(path, map_location="cpu", weights_only=True)``: tensors only, no code.

    A missing file is a ``FileNotFoundError``, and a file of anything else a ``ValueError``,
    each naming ``path`` and what it holds instead: a pickled module (``torch.save(model)``,
    not its ``state_dict()``), a safetensors file (``flax_attention.load_file`` reads it), a
    dict with values other than tensors."""
    try:
        import torch
    except ImportError as error:
        raise ImportError(
            "read_pth needs torch to read a .pth file: pip install torch (the CPU build: "
            "pip install torch --index-url https://download.pytorch.org/whl/cpu)"
        ) from error
    check_instance("path", path, (str, os.PathLike), "a str or os.PathLike (a .pth file)")
    name = os.fspath(path)
    if not os.path.isfile(name):
        found = "a directory" if os.path.isdir(name) else "no such file"
        raise FileNotFoundError(f"path ({name!r}) must be a file ({found}): {_PTH}")
    try:
        loaded = torch.load(name, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - torch's unpickler raises several types
        held = _pickled_class(name)
        if held is None:
            raise ValueError(
                f"path ({name!r}) must hold {_PTH}; torch.load(weights_only=True) could not read "
                f"it: {_unreadable(torch, name, error)}"
            ) from error
        raise ValueError(
            f"path ({name!r}) must hold {_PTH}, not a pickled {held.rsplit('.', 1)[-1]} object "
            f"({held}): torch.save(model) pickles the module itself, and read_pth reads tensors "
            "only, never code. Save its state dict instead: "
            'torch.save(model.state_dict(), "model.pth") (this file\'s model, only if you trust '
            "the file and can import its class: torch.load it with weights_only=False, then "
            "save its state_dict())"
        ) from None
    if isinstance(loaded, Mapping) and "model_state_dict" in loaded:
        loaded = loaded["model_state_dict"]
    if not isinstance(loaded, Mapping):
        raise ValueError(f"path ({name!r}) must hold {_PTH}, not a {type(loaded).__name__}")
    others = {key: type(v).__name__ for key, v in loaded.items() if not torch.is_tensor(v)}
    if others:
        raise ValueError(
            f"path ({name!r}) must hold {_PTH}: a dict whose values are tensors, but it holds "
            f"non-tensors {others}"
        )

    def numpy(tensor):
        tensor = tensor.detach().cpu()
        if tensor.dtype == torch.bfloat16:  # NumPy has no bfloat16: through its bits
            return tensor.view(torch.int16).numpy().view(jnp.bfloat16)
        return tensor.numpy()

    return {key: numpy(value) for key, value in loaded.items()}
