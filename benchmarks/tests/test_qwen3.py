"""``benchmarks.qwen3`` on a tiny Qwen3: it compares what it times before timing it (float32
logits and greedy tokens equal to transformers'), and its bound counts the bytes transformers'
model holds (the tied head once). Values only: no timing is asserted."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers

from benchmarks import qwen3


@pytest.fixture(scope="module")
def rows():
    return qwen3.run(dataclasses.replace(qwen3.QUICK, repeats=1, bandwidth_repeats=1))


@pytest.mark.quick
def test_each_dtype_has_its_rows_and_float32_equals_transformers(rows):
    n = qwen3.QUICK.new_tokens
    for dtype in ("float32", "bfloat16"):
        mine = {(r["mode"], r["framework"]): r for r in rows if r["case"] == f"{dtype} b1"}
        assert set(mine) == {
            (mode, framework)
            for mode in ("prefill", "generate", "decode step")
            for framework in ("flax", "torch")
        } | {("compile prefill", "flax"), ("compile generate", "flax"), ("bound", "flax")}
        assert mine["compile generate", "flax"]["value"] > 0  # the first call compiled
        bound = mine["bound", "flax"]
        assert bound["value"] > 0 and "GB/s" in bound["note"]
        prefill = mine["prefill", "flax"]
        assert prefill["max_rel_diff"] < (1e-5 if dtype == "float32" else 5e-2), prefill
        assert "argmax equal" in prefill["note"]
    float32 = next(r for r in rows if r["case"] == "float32 b1" and r["mode"] == "generate")
    assert f"greedy tokens equal {n}/{n};" in float32["note"]  # else run() would have raised


@pytest.mark.quick
def test_the_bound_reads_the_bytes_transformers_holds(tmp_path):
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(qwen3.hf_config(qwen3.TINY))
    hf.save_pretrained(tmp_path)
    ours, _, _ = qwen3._pair(str(tmp_path), "float32", hf)
    assert ours.out_head is None  # tied, as the checkpoint: its matrix is read once
    assert qwen3.weight_bytes(ours) == qwen3._torch_bytes(hf)


def test_first_difference_names_the_first_new_token_that_parts():
    a = np.array([[1, 2, 3, 4]])
    assert qwen3._first_difference(a, a.copy()) is None
    assert qwen3._first_difference(a, np.array([[1, 2, 9, 4]])) == 2
