"""The attention layers and the book's ``GPTModel`` on a mesh that spans JAX processes, checked
against one process.

Three steps, each a command (on one machine; on a cluster the middle one is started by the
cluster's own tools, and ``flax_attention.launch.initialize()`` then calls
``jax.distributed.initialize()`` plain, which finds the coordinator itself)::

    python examples/multiprocess.py reference OUT    # one process, one device
    python -m flax_attention.launch --processes 2 --devices-per-process 2 -- \\
        python examples/multiprocess.py run OUT      # 2 processes x 2 CPU devices
    python examples/multiprocess.py compare OUT      # one process: the table

``reference`` writes the files ``run`` reads (``prepare``: the book's weights
``OUT/gpt.safetensors``, two Hugging Face GPT-2 directories ``OUT/gpt2``, ``OUT/gpt2_other``, an
orbax checkpoint ``OUT/one_process.ckpt``), computes every case on one device and writes
``OUT/reference.npz``.
``run`` computes the same cases on meshes of all the processes' devices (``make_mesh``), every
process from the same seeds and files, each feeding and holding only its own share:

- ``layer[<kernel>,<axes>]``: ``MultiHeadAttention`` with the ``native`` (where it is built) and
  ``blocked`` kernels in train mode (dropout 0.5 from the layer's own RNG stream, placed on the
  mesh) on a ``(data, model)`` mesh with ``Explicit`` (``jax.make_mesh``'s default) and
  ``Auto`` axes: the output, the gradients of every parameter and of the input, and the
  kernel's dropout keep-mask (read back through zero queries and one-hot values, an
  ``nnx.Dropout`` placed on the mesh);
- ``decode[explicit]``: ``fa.decode_loop``, prefill and decode steps through the placed cache;
- ``gpt ...``: the book's ``GPTModel`` (its weights loaded into an abstract model placed by
  ``fa.shard``) trained 3 steps with ``optax.adamw`` (chapter 5's lr 4e-4, weight decay 0.1) by
  ``flax_attention.models.train_step`` on a global batch fed with ``fa.sharding.global_batch``:
  each step's loss, the parameters and ``fa.state_dict`` after, then greedy tokens of
  ``flax_attention.models.generate`` (through the decode cache and past ``context_size``); the
  initial weights loaded back into the trained, sharded model by ``fa.load_file`` and by
  ``fa.load_state_dict``;
- ``load[...]``: on a mesh whose ``model`` axis spans the processes,
  ``GPTModel.from_pretrained(path, mesh=mesh)`` and ``from_pretrained`` then ``fa.shard``, then
  the other directory loaded into each (``fa.load_file``, ``fa.load_state_dict``), and the
  bytes of the model-parallel weights each process holds;
- ``orbax ...``: the one-process checkpoint restored onto the mesh, and the trained parameters
  saved by both processes (``OUT/two_process.ckpt``), which ``compare`` restores in one.

Process 0 writes ``OUT/run.npz``. ``compare`` prints each case's largest difference against the
reference with the repository's float32 rule, ``max_abs_err <= 1e-5 * max(1, max|reference|)``
tensor by tensor; keep-masks, tokens, loaded weights and checkpoints must match bit for bit.
``conformance_tests/tests/test_multiprocess.py`` runs the three steps.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_attention as fa
from flax_attention import models
from flax_attention.kernels import native
from flax_attention.mesh import place
from flax_attention.models.checkpoints import new_model
from flax_attention.sharding import data_slices, global_batch

TOL = 1e-5  # the repository's float32 forward/gradient tolerance (relative to max(1, scale))
B, T, D, HEADS = 4, 8, 16, 4  # batch, tokens, features, heads: 2 heads per device on 2x2
RATE = 0.5  # the layers' dropout in train mode
KEEP_RATE, KEEP_SEED = 0.3, 1234  # the keep-mask read-back's dropout
#: The layer cases' kernels: ``native`` where it is built (``native.why_unavailable()`` says why
#: not; a machine without a compiler still runs every other case), and ``blocked``.
KERNELS = ("native", "blocked") if native.available() else ("blocked",)
AXES = ("explicit", "auto")
#: The book's model, small: one block of 4 heads (hidden 128: divides over model = 2), no
#: query/key/value bias as in the book's GPT_CONFIG_124M (a key bias's gradient is zero in exact
#: arithmetic, softmax being blind to a shift shared by every key, so the float32 noise left in
#: it is all adamw's normalised step sees: its trajectory would differ between any two
#: summation orders, one process or many). Dropout off: its random bits double the compiled
#: step (threefry), and the layer cases above already check dropout across processes.
CFG = {
    "vocab_size": 64,
    "context_length": 16,
    "emb_dim": 32,
    "n_heads": 4,
    "n_layers": 1,
    "drop_rate": 0.0,
    "qkv_bias": False,
}
STEPS = 3  # training steps
PROMPT, NEW, CONTEXT = 4, 6, 8  # generation: 5 steps through the cache, 1 on the cropped window


# ---- one program for one device and for a mesh ------------------------------------------------


def make_mesh(kind: str):
    """``explicit``/``auto``: ``(data, model)`` with data across processes (the devices of one
    process along ``model``: ``jax.make_mesh`` puts each process's devices together);
    ``across``: ``model`` across processes (each holds half of every split weight)."""
    n = jax.device_count()
    if kind == "across":
        return jax.make_mesh((n // 2, 2), ("model", "data"))
    types = (AxisType.Auto,) * 2 if kind == "auto" else (AxisType.Explicit,) * 2
    return jax.make_mesh((2, n // 2), ("data", "model"), axis_types=types)


def feed(x: np.ndarray, mesh):
    """``x`` (the whole batch, the same in every process) as a global array split over
    ``data``, each process passing only its own rows; ``x`` itself without a mesh."""
    if mesh is None:
        return x
    per = x.shape[0] // dict(mesh.shape).get("data", 1)
    local = np.concatenate([x[i * per : (i + 1) * per] for i in data_slices(mesh)])
    return global_batch(local, mesh, batch_size=x.shape[0])


def to_host(tree, mesh) -> dict:
    """Every leaf as NumPy in every process (one compiled gather to replicated, then local)."""
    if mesh is not None:
        tree = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))(tree)
    return jax.tree.map(np.asarray, tree)


def flat(state, prefix: str) -> dict:
    return {
        f"{prefix} {'.'.join(map(str, path))}": value[...]
        for path, value in nnx.to_flat_state(state)
    }


def placed(module, mesh):
    return module if mesh is None else fa.shard(module, mesh)


def in_mesh(mesh):
    return jax.set_mesh(mesh) if mesh is not None else _Nothing()


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def rows(seed: int, shape) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def layer_case(kernel: str, mesh) -> dict:
    """Train-mode output and gradients of ``MultiHeadAttention`` (dropout ``RATE``), and the
    kernel's dropout keep-mask ``(b, t, h, s)``, in one compiled program. The keep-mask: zero
    queries give every key weight ``1 / s``, one-hot values ``v[j] = e_j`` read each weight
    back, times ``(1 - rate) s``."""
    layer = placed(
        fa.MultiHeadAttention(
            D, D, T, RATE, num_heads=HEADS, qkv_bias=True, implementation=kernel, rngs=nnx.Rngs(0)
        ),
        mesh,
    )
    dropout = placed(nnx.Dropout(KEEP_RATE, rngs=nnx.Rngs(KEEP_SEED)), mesh)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    x, cotangent = feed(rows(1, (B, T, D)), mesh), feed(rows(2, (B, T, D)), mesh)
    q = np.zeros((B, T, HEADS, 4), np.float32)
    v = np.ascontiguousarray(
        np.broadcast_to(np.eye(T, dtype=np.float32)[None, :, None, :], (B, T, HEADS, T))
    )

    def loss(params, rest, x, cotangent):
        out = nnx.merge(graphdef, params, rest, copy=True)(x)  # (b, t, d)
        return (out * cotangent).sum(), out

    @nnx.jit
    def run(params, rest, x, cotangent, dropout, q, v):
        grad = jax.value_and_grad(loss, argnums=(0, 2), has_aux=True)
        (_, out), grads = grad(params, rest, x, cotangent)
        mask, _ = fa.dot_product_attention(
            q, q, v, dropout=dropout, implementation=kernel, need_weights=False
        )
        return {"out": out, "grads": grads, "keep": mask * ((1 - KEEP_RATE) * T)}

    with in_mesh(mesh):
        result = run(params, rest, x, cotangent, dropout, feed(q, mesh), feed(v, mesh))
        result = to_host(result, mesh)
    out = {"out": result["out"], "grad x": result["grads"][1], "keepmask": result["keep"]}
    out.update(flat(result["grads"][0], "grad"))
    return out


def decode_case(mesh) -> np.ndarray:
    """``fa.decode_loop``: a 3-token prompt, then 4 steps fed back through the decode cache."""
    layer = fa.MultiHeadAttention(D, D, T, 0.0, num_heads=HEADS, rngs=nnx.Rngs(4))
    layer.eval()
    placed(layer, mesh).init_cache(B)  # placed on the mesh with the parameters
    with in_mesh(mesh):
        return to_host(fa.decode_loop(layer, feed(rows(5, (B, 3, D)), mesh), 4), mesh)


def tokens(seed: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, CFG["vocab_size"], (B, T + 1))
    return ids[:, :-1].astype(np.int32), ids[:, 1:].astype(np.int32)  # inputs, targets


def abstract_gpt(cfg, mesh):
    """A ``GPTModel`` with abstract parameters (``new_model``: nothing drawn), placed on
    ``mesh`` by ``fa.shard`` (each parameter learns its sharding): what a load fills."""
    return placed(new_model(models.GPTModel, cfg), mesh)


def gpt_case(out_dir: pathlib.Path, mesh, save: pathlib.Path | None = None) -> dict:
    """The book's weights (``gpt.safetensors``, its names) loaded into a placed model, then
    ``STEPS`` adamw steps (the book's lr 4e-4, weight decay 0.1) and greedy generation; the
    initial weights loaded again into the trained model (``load_file`` and ``load_state_dict``
    into a sharded model); ``save``: an orbax checkpoint of the trained parameters."""
    from safetensors.numpy import load_file

    weights = out_dir / "gpt.safetensors"
    model = abstract_gpt(CFG, mesh)
    fa.load_file(model, weights)
    # Placed like the parameters (moments) and replicated (step count) from the first step on:
    # otherwise the second step compiles again, for state the first one placed.
    optimizer = placed(
        nnx.Optimizer(model, optax.adamw(4e-4, weight_decay=0.1), wrt=nnx.Param), mesh
    )
    out = {}
    with in_mesh(mesh):
        for step in range(STEPS):
            inputs, targets = tokens(10 + step)
            loss = models.train_step(model, optimizer, feed(inputs, mesh), feed(targets, mesh))
            out[f"gpt loss {step}"] = to_host(loss, mesh)
        out.update(to_host(flat(nnx.state(model, nnx.Param), "gpt param"), mesh))
        # The book's state dict, gathered into every process.
        out.update({f"gpt state_dict {k}": v for k, v in fa.state_dict(model).items()})
        model.eval()
        prompt = np.random.default_rng(20).integers(0, CFG["vocab_size"], (2, PROMPT))
        ids = models.generate(model, prompt, NEW, CONTEXT)
        out["gpt tokens"] = to_host(ids, mesh)
    if save is not None:
        import orbax.checkpoint as ocp

        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(save, nnx.state(model, nnx.Param), force=True)
        checkpointer.wait_until_finished()
        checkpointer.close()
    trained = jax.tree.map(lambda a: a, nnx.state(model, nnx.Param))  # a snapshot
    for name, load in (
        ("load_file", lambda: fa.load_file(model, weights)),
        ("load_state_dict", lambda: fa.load_state_dict(model, load_file(weights))),
    ):
        nnx.update(model, trained)  # the trained weights, then the initial ones loaded over them
        load()
        out.update(to_host(flat(nnx.state(model, nnx.Param), f"reload[{name}]"), mesh))
    return out


def restore(path: pathlib.Path, mesh) -> dict:
    """The parameters of an orbax checkpoint restored into a ``GPTModel`` placed on ``mesh``
    (this process's first device without), as NumPy."""
    import orbax.checkpoint as ocp

    target = nnx.state(abstract_gpt(CFG, mesh), nnx.Param)  # shapes and shardings only
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                              target)  # fmt: skip
    checkpointer = ocp.StandardCheckpointer()
    restored = checkpointer.restore(path, target)
    checkpointer.close()
    return to_host(flat(restored, "param"), mesh)


def split_bytes(model, mesh) -> tuple[int, int]:
    """Bytes of the model-parallel parameters (split over ``model``): the distinct slices this
    process's devices hold, and the whole."""
    held = total = 0
    for _, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = variable[...]
        if "model" not in jax.tree.leaves(tuple(value.sharding.spec)):
            continue
        total += value.nbytes
        slices = {str(s.index): s.data.nbytes for s in value.addressable_shards}
        held += sum(slices.values())
    return held, total


class CountingSource:
    """An array-like read only by slices, counting the elements read (as ``place`` reads a
    file's tensor through ``get_slice``)."""

    def __init__(self, value: np.ndarray):
        self.value, self.shape, self.dtype, self.read = value, value.shape, value.dtype, 0

    def __getitem__(self, index):
        piece = self.value[index]
        self.read += piece.size
        return piece


def read_fraction(mesh) -> float:
    """The fraction of a ``(64, 64)`` weight this process reads to place it split over
    ``model`` (``flax_attention.mesh.place``)."""
    source = CountingSource(np.ones((64, 64), np.float32))
    place(source, NamedSharding(mesh, P(None, "model")))
    return source.read / source.value.size


#: The ways a checkpoint reaches a placed model (``load_cases``), and the directory each reads.
LOAD_WAYS = {
    "from_pretrained(mesh)": "gpt2",
    "from_pretrained+shard": "gpt2",
    "load_file into sharded": "gpt2_other",
    "load_state_dict into sharded": "gpt2_other",
}
#: The tied, biased GPT-2 layout of ``CFG`` the Hugging Face directories hold.
HF_CFG = {**CFG, "tie_word_embeddings": True, "qkv_bias": True}


def load_cases(out_dir: pathlib.Path, mesh) -> dict:
    """The Hugging Face directories loaded each of ``LOAD_WAYS`` onto ``mesh``: the
    parameters, and the bytes of model-parallel weights this process holds against their
    whole. The last two load ``gpt2_other`` into the models the first two made."""
    from safetensors.numpy import load_file

    other = out_dir / "gpt2_other" / "model.safetensors"
    made = {
        "from_pretrained(mesh)": models.GPTModel.from_pretrained(out_dir / "gpt2", mesh=mesh),
        "from_pretrained+shard": fa.shard(models.GPTModel.from_pretrained(out_dir / "gpt2"), mesh),
    }
    out = {}
    for name in LOAD_WAYS:
        if name == "load_file into sharded":
            model = made["from_pretrained(mesh)"]
            fa.load_file(model, other, layout="gpt2")
        elif name == "load_state_dict into sharded":
            model = made["from_pretrained+shard"]
            fa.load_state_dict(model, load_file(other), layout="gpt2")
        else:
            model = made[name]
        out.update(to_host(flat(nnx.state(model, nnx.Param), f"load[{name}]"), mesh))
        out[f"bytes[{name}]"] = np.array(split_bytes(model, mesh))
    out["read fraction"] = np.array(read_fraction(mesh))
    return out


def refusals(mesh) -> dict:
    """The messages of what a user gets wrong on processes: a local batch that is not this
    process's share, and a mesh of this process's devices only (``jax.local_devices()``)."""
    own = jax.sharding.Mesh(np.array(jax.local_devices()), ("model",))
    layer = fa.MultiHeadAttention(D, D, T, 0.0, num_heads=HEADS, rngs=nnx.Rngs(0))
    attempts = {
        "local batch": lambda: global_batch(np.zeros((3, T), np.int32), mesh, batch_size=B),
        "shard on own devices": lambda: fa.shard(layer, own),
        "global_batch on own devices": lambda: global_batch(np.zeros((B, T)), own),
    }
    out = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            out[f"refused[{name}]"] = np.array("(nothing raised)")
        except ValueError as error:
            out[f"refused[{name}]"] = np.array(str(error))
    return out


def cases(mesh_of, out_dir: pathlib.Path, *, save=None) -> dict:
    """The computed cases, on the meshes ``mesh_of(kind)`` gives (``None``: one device)."""
    out = {}
    for kernel in KERNELS:
        for axes in AXES:
            mesh = mesh_of(axes)
            label = f"[{kernel},{axes}]"
            out.update({f"layer{label} {k}": v for k, v in layer_case(kernel, mesh).items()})
    out["decode[explicit]"] = decode_case(mesh_of("explicit"))
    out.update(gpt_case(out_dir, mesh_of("explicit"), save=save))
    return out


# ---- the three steps ------------------------------------------------------------------------


def _save_orbax(path: pathlib.Path, state) -> None:
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path.absolute(), state, force=True)
    checkpointer.wait_until_finished()
    checkpointer.close()


def prepare(out_dir) -> None:
    """The files ``run`` and ``reference`` read: the book's weights of ``CFG``, two GPT-2
    directories, an orbax checkpoint; their parameters in ``inputs.npz``."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    book = models.GPTModel(CFG, rngs=nnx.Rngs(0))
    fa.save_file(book, out_dir / "gpt.safetensors")
    out.update(flat(nnx.state(book, nnx.Param), "initial"))
    for seed, name in enumerate(("gpt2", "gpt2_other"), start=1):
        source = models.GPTModel(HF_CFG, rngs=nnx.Rngs(seed))
        source.save_pretrained(out_dir / name)
        out.update(flat(nnx.state(source, nnx.Param), f"source[{name}]"))
    saved = models.GPTModel(CFG, rngs=nnx.Rngs(3))
    _save_orbax(out_dir / "one_process.ckpt", nnx.state(saved, nnx.Param))
    out.update(flat(nnx.state(saved, nnx.Param), "saved"))
    np.savez(out_dir / "inputs.npz", **{k: np.asarray(v) for k, v in out.items()})


def reference(out_dir) -> None:
    """One process, one device (after ``prepare``): every case, into ``reference.npz``."""
    out_dir = pathlib.Path(out_dir)
    out = dict(np.load(out_dir / "inputs.npz"))
    out.update(cases(lambda kind: None, out_dir))
    np.savez(out_dir / "reference.npz", **{k: np.asarray(v) for k, v in out.items()})


def run(out_dir) -> None:
    """Every process: the cases on meshes of every process's devices; process 0 writes them."""
    out_dir = pathlib.Path(out_dir).absolute()
    meshes = {kind: make_mesh(kind) for kind in ("explicit", "auto", "across")}
    out = cases(meshes.get, out_dir, save=out_dir / "two_process.ckpt")
    out.update(load_cases(out_dir, meshes["across"]))
    restored = restore(out_dir / "one_process.ckpt", meshes["explicit"])
    out.update({f"orbax[1->2] {k}": v for k, v in restored.items()})
    out.update(refusals(meshes["explicit"]))
    out["devices"] = np.array([jax.process_count(), jax.device_count()])
    out["collectives"] = np.array(jax.config.jax_cpu_collectives_implementation)
    if jax.process_index() == 0:
        np.savez(out_dir / "run.npz", **out)


def compare(out_dir) -> dict[str, dict]:
    """One process: each case's largest difference (``run`` against ``reference``), the scale
    of the tensor it is in, and whether every tensor of the case passes: within
    ``TOL * max(1, max|reference|)`` of its own reference, or (``exact``) equal bit for bit. The
    two-process checkpoint is restored here, onto this process's one device."""
    out_dir = pathlib.Path(out_dir).absolute()
    ref = dict(np.load(out_dir / "reference.npz"))
    got = dict(np.load(out_dir / "run.npz"))
    restored = restore(out_dir / "two_process.ckpt", None)
    table: dict[str, dict] = {}

    def add(case, pairs, exact=False, **extra):
        row = {"max_abs_err": 0.0, "scale": 0.0, "exact": True, "passed": True}
        largest = 0.0  # the case's scale where nothing differs
        for want, have in pairs:
            diff = float(np.max(np.abs(want.astype(np.float64) - have), initial=0.0))
            scale = float(np.max(np.abs(want.astype(np.float64)), initial=0.0))
            same = want.dtype == have.dtype and np.array_equal(want, have)
            row["exact"] &= same
            row["passed"] &= same if exact else diff <= TOL * max(1.0, scale)
            largest = max(largest, scale)
            if diff > row["max_abs_err"]:  # the worst tensor's difference and scale
                row["max_abs_err"], row["scale"] = diff, scale
        if row["max_abs_err"] == 0.0:
            row["scale"] = largest
        table[case] = {**row, **extra}

    def pairs(prefix, other=None, rename=None):
        names = sorted(k for k in ref if k.startswith(prefix))
        other = got if other is None else other
        return [(ref[k], other[rename(k) if rename else k]) for k in names]

    for kernel in KERNELS:
        for axes in AXES:
            label = f"layer[{kernel},{axes}]"
            add(f"{label} forward", pairs(f"{label} out"))
            add(f"{label} gradients", pairs(f"{label} grad "))
            add(f"{label} keep-mask", pairs(f"{label} keepmask"), exact=True)
    add("decode[explicit] fa.decode_loop", pairs("decode[explicit]"))
    add("gpt adamw losses", pairs("gpt loss "))
    add("gpt parameters after adamw", pairs("gpt param "))
    add("gpt state_dict after adamw", pairs("gpt state_dict "))
    add("gpt greedy tokens", pairs("gpt tokens"), exact=True)
    initial = [k.removeprefix("initial ") for k in sorted(ref) if k.startswith("initial ")]
    for name in ("load_file", "load_state_dict"):
        reloaded = [(ref[f"initial {k}"], got[f"reload[{name}] {k}"]) for k in initial]
        add(f"gpt reloaded by {name}", reloaded, exact=True)
    for way, directory in LOAD_WAYS.items():
        source = f"source[{directory}] "
        held, total = got[f"bytes[{way}]"]
        add(
            f"load[{way}] on model-across-processes",
            pairs(source, rename=lambda k, w=way, s=source: f"load[{w}] " + k.removeprefix(s)),
            exact=True,
            held_fraction=float(held / total),
        )
    add(
        "orbax 1 process -> 2",
        pairs("saved ", rename=lambda k: "orbax[1->2] param " + k.removeprefix("saved ")),
        exact=True,
    )
    trained = sorted(k.removeprefix("gpt param ") for k in got if k.startswith("gpt param "))
    add(
        "orbax 2 processes -> 1",
        [(got[f"gpt param {k}"], restored[f"param {k}"]) for k in trained],
        exact=True,
    )
    return table


def print_table(table: dict[str, dict]) -> None:
    print(f"{'case':62} {'max_abs_err':>11} {'scale':>7}  verdict")
    for case, row in table.items():
        verdict = "bit for bit" if row["exact"] else "within 1e-5 * max(1, scale)"
        verdict = verdict if row["passed"] else "FAILED"
        if "held_fraction" in row:
            verdict += f"; each process holds {row['held_fraction']:.2f} of the split weights"
        print(f"{case:62} {row['max_abs_err']:11.2e} {row['scale']:7.3g}  {verdict}")


def main(argv) -> int:
    jax.config.update("jax_default_matmul_precision", "highest")
    if len(argv) != 2 or argv[0] not in ("reference", "run", "compare"):
        print("\n\n".join(__doc__.split("\n\n")[1:3]), file=sys.stderr)
        return 2
    step, out_dir = argv
    if step == "run":
        from flax_attention.launch import initialize

        initialize()
        run(out_dir)
    elif step == "reference":
        prepare(out_dir)
        reference(out_dir)
    else:
        table = compare(out_dir)
        print_table(table)
        read = float(np.load(pathlib.Path(out_dir) / "run.npz")["read fraction"])
        print(f"placing a weight split over model across processes, each read {read:.2f} of it")
        return 0 if all(row["passed"] for row in table.values()) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
