"""Determinism: the same seeds give bit-identical results, within a process and across two."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import flax_attention as fa
import torch_reference as tr
from conformance_tests import harness
from conformance_tests.layers import LAYER_SPECS
from conformance_tests.tests.helpers import LAYERS, ROOT, small_case, to_numpy

#: The layers the fingerprint covers: the last of each kind in the documents' order, the causal
#: family's (nn.Linear initialisers, split heads, dropout) and the caller-masked one's (document
#: 001's masked heads, dropout). The other layers are made of the same parts; each layer costs a
#: fresh process a few XLA compilations.
FINGERPRINT_LAYERS = (
    [name for name in LAYERS if LAYER_SPECS[name].causal][-1],
    [name for name in LAYERS if LAYER_SPECS[name].takes_mask][-1],
)


def _run_everything(layer: str) -> dict[str, np.ndarray]:
    """Every number a user gets from seeds alone, on CPU: torch's and Flax's initial weights,
    eval outputs and (where there is dropout, at rate 0.5) a train-mode output."""
    has_dropout = LAYER_SPECS[layer].has_dropout
    case = small_case(layer, dropout=0.5 if has_dropout else 0.0)
    inputs = harness.make_inputs(case)
    out: dict[str, np.ndarray] = {}
    torch.manual_seed(0)
    tm = getattr(tr, layer)(*case.args, **dict(case.kwargs))
    out.update({f"torch init {k}": v.numpy().copy() for k, v in tm.state_dict().items()})
    fm = getattr(fa, layer)(*case.args, **dict(case.kwargs), rngs=nnx.Rngs(params=0, dropout=1))
    out.update({f"flax init {k}": v for k, v in fa.state_dict(fm).items()})
    t_inputs = [torch.from_numpy(x) for x in inputs]
    f_inputs = [jnp.asarray(x) for x in inputs]
    for mode in ("eval", "train") if has_dropout else ("eval",):
        getattr(tm, mode)()
        getattr(fm, mode)()
        torch.manual_seed(1)
        with torch.no_grad():
            t_out = harness.call_torch(case, tm, t_inputs, None)
        out.update({f"torch {mode} {i}": to_numpy(v) for i, v in enumerate(t_out)})
        f_out = harness.flax_forward(case, fm, f_inputs)  # train mode draws from fm's rngs
        out.update({f"flax {mode} {i}": to_numpy(v) for i, v in enumerate(f_out)})
    return out


def fingerprint() -> dict[str, str]:
    """sha256 of every array ``_run_everything`` makes for ``FINGERPRINT_LAYERS``."""
    with jax.default_matmul_precision("highest"):
        return {
            f"{layer}: {name}": hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()
            for layer in FINGERPRINT_LAYERS
            for name, value in _run_everything(layer).items()
        }


@pytest.mark.quick
def test_same_seeds_give_bit_identical_results_in_one_process_and_across_two():
    """Initial weights, eval outputs and dropout draws from the same seeds: the same
    bits twice in this process and once more in a fresh one (started first, run alongside)."""
    code = (
        "import json, jax; jax.config.update('jax_numpy_rank_promotion', 'raise');"
        "from conformance_tests.tests.test_determinism import fingerprint;"
        "print(json.dumps(fingerprint()))"
    )
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    other = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = fingerprint()
        second = fingerprint()
        stdout, stderr = other.communicate(timeout=300)
    finally:
        other.kill()
    assert first == second, [name for name in first if first[name] != second.get(name)][:10]
    assert other.returncode == 0, stderr[-3000:]
    theirs = json.loads(stdout.strip().splitlines()[-1])
    assert theirs.keys() == first.keys(), sorted(set(theirs) ^ set(first))
    differ = [name for name in first if first[name] != theirs[name]]
    assert not differ, f"{len(differ)} arrays differ between two processes: {differ[:10]}"
    for layer in FINGERPRINT_LAYERS:  # a train-mode draw is a real draw, not the eval output
        if LAYER_SPECS[layer].has_dropout:
            for package in ("torch", "flax"):
                train, eval_ = (
                    first[f"{layer}: {package} train 0"],
                    first[f"{layer}: {package} eval 0"],
                )
                assert train != eval_, f"{layer} {package}: dropout drew nothing"
