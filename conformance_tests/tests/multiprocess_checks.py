"""What each of 2 JAX processes sees of the pieces that only a mesh over processes exercises,
run in the launch of ``test_multiprocess.py`` after the example's ``run`` (one launch):

    python -m flax_attention.launch --processes 2 --devices-per-process 2 -- \\
        python conformance_tests/tests/multiprocess_checks.py OUT

``examples/multiprocess.py run OUT`` first (its ``main``: the same start-up), then each check of
``CHECKS`` in every process, the same calls in the same order (their collectives meet). A check
returns what it saw (JSON: shapes, flags, differences, messages); one that raises is recorded as
``{"raised": "<type>: <message>"}``, so the others still run. Each process writes
``OUT/checks_<process>.json``; the tests of ``test_multiprocess.py`` assert on them.
"""

from __future__ import annotations

import json
import pathlib
import runpy
import sys
import time
import traceback

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_attention as fa
from flax_attention.mesh import fetch, place
from flax_attention.models import GPTModel
from flax_attention.models.checkpoints import new_model
from flax_attention.sharding import data_slices, global_batch

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = runpy.run_path(str(ROOT / "examples" / "multiprocess.py"))


def meshes() -> dict:
    """2 processes x 2 devices: ``data`` across the processes (one slice each), ``data`` over
    all 4 devices (two slices each), ``data`` inside each process (both feed the same rows)."""
    return {
        "data 2 x model 2": jax.make_mesh((2, 2), ("data", "model")),
        "data 4": jax.make_mesh((4, 1), ("data", "model")),
        "model 2 x data 2": jax.make_mesh((2, 2), ("model", "data")),
    }


def local_rows(x: np.ndarray, mesh) -> np.ndarray:
    """This process's rows of the whole batch ``x``: those of its ``data`` slices, in order."""
    per = x.shape[0] // dict(mesh.shape)["data"]
    return np.concatenate([x[i * per : (i + 1) * per] for i in data_slices(mesh)])


def spread(x: np.ndarray, mesh) -> jax.Array:
    """``x`` (the same whole array in every process) as a global array split over ``data``,
    each process passing its own rows (``global_batch`` with ``batch_size``)."""
    return global_batch(local_rows(x, mesh), mesh, batch_size=x.shape[0])


def check_place_moves_a_spread_array(out_dir: pathlib.Path) -> dict:
    """A ``jax.Array`` over both processes (rows over ``data``), placed by ``place`` as
    columns over ``model`` and as replicated: the new layout, the same values."""
    mesh = meshes()["data 2 x model 2"]
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    rows = place(x, NamedSharding(mesh, P("data")))
    seen = {"spread": not rows.is_fully_addressable}
    for name, spec in (("columns", P(None, "model")), ("replicated", P())):
        target = NamedSharding(mesh, spec)
        moved = place(rows, target)
        seen[name] = {
            "as asked": moved.sharding.is_equivalent_to(target, moved.ndim),
            "equal": bool(np.array_equal(fetch([moved])[0], x)),
        }
    return seen


def check_global_batch_without_batch_size(out_dir: pathlib.Path) -> dict:
    """Each process's rows (``local_rows``) made a global batch by ``global_batch(local,
    mesh)`` (no ``batch_size``), on each mesh of ``meshes``."""
    x = np.arange(8 * 3, dtype=np.int32).reshape(8, 3)
    seen = {}
    for name, mesh in meshes().items():
        local = local_rows(x, mesh)
        batch = global_batch(local, mesh)
        seen[name] = {
            "local rows": local.shape[0],
            "shape": list(batch.shape),
            "over data": batch.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2),
            "equal": bool(np.array_equal(fetch([batch])[0], x)),
        }
    return seen


def check_gpt_outside_jit_on_a_spread_batch(out_dir: pathlib.Path) -> dict:
    """The example's ``GPTModel`` (its ``CFG``, the weights of ``OUT/gpt.safetensors``) placed
    on the mesh and called eagerly (no ``jit``) on token ids over both processes, without and
    with a padding mask over both processes: its logits against the same weights on this
    process's one device; an id out of range and a mask value of 2, each in process 0's rows
    only, refused with the same message in both processes."""
    cfg, weights = EXAMPLE["CFG"], out_dir / "gpt.safetensors"
    mesh = meshes()["data 2 x model 2"]
    ids = np.random.default_rng(3).integers(0, cfg["vocab_size"], (4, 8)).astype(np.int32)
    mask = np.ones(ids.shape, np.int32)
    mask[3, :3] = 0  # row 3 (process 1's) padded on the left
    one_device = new_model(GPTModel, cfg)
    fa.load_file(one_device, weights)
    one_device.eval()
    both = nnx.jit(lambda model, x, m: (model(x), model(x, attention_mask=m)))
    reference, reference_masked = (np.asarray(a) for a in both(one_device, ids, mask))
    model = fa.shard(new_model(GPTModel, cfg), mesh)
    fa.load_file(model, weights)
    model.eval()
    with jax.set_mesh(mesh):
        batch = spread(ids, mesh)
        logits = model(batch)
        masked = model(batch, attention_mask=spread(mask, mesh))
        seen = {"ids spread": not batch.is_fully_addressable}
        seen["logits spread"] = not logits.is_fully_addressable
        got, got_masked = fetch([logits, masked])
        bad, two = ids.copy(), mask.copy()
        bad[0, 1] = cfg["vocab_size"]  # row 0: process 0's rows only
        two[0, 0] = 2
        for name, call in (
            ("refused ids", lambda: model(spread(bad, mesh))),
            ("refused mask", lambda: model(batch, attention_mask=spread(two, mesh))),
        ):
            try:
                call()
                seen[name] = "(nothing raised)"
            except ValueError as error:
                seen[name] = str(error)
    for name, want, have in (("logits", reference, got), ("masked", reference_masked, got_masked)):
        seen[name] = {
            "shape": list(have.shape),
            "max_abs_err": float(np.max(np.abs(have.astype(np.float64) - want))),
            "scale": float(np.max(np.abs(want))),
        }
    return seen


CHECKS = {
    "place moves a spread array": check_place_moves_a_spread_array,
    "global_batch without batch_size": check_global_batch_without_batch_size,
    "gpt outside jit on a spread batch": check_gpt_outside_jit_on_a_spread_batch,
}


def main(out_dir: str) -> int:
    start = time.monotonic()
    code = EXAMPLE["main"](["run", out_dir])  # initialize(), then every case of the example
    print(f"examples/multiprocess.py run: {time.monotonic() - start:.1f} s", flush=True)
    if code:
        return code
    seen = {}
    for name, check in CHECKS.items():
        start = time.monotonic()
        try:
            seen[name] = check(pathlib.Path(out_dir).absolute())
        except Exception as error:  # recorded: the test names it, the other checks still run
            traceback.print_exc()
            seen[name] = {"raised": f"{type(error).__name__}: {error}"}
        print(f"check {name!r}: {time.monotonic() - start:.1f} s", flush=True)
    path = pathlib.Path(out_dir) / f"checks_{jax.process_index()}.json"
    path.write_text(json.dumps(seen, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
