"""The documents' printed numbers, reproduced by torch_reference and by flax_attention.

Each test follows the document's own seed and call sequence; Flax layers get the torch weights
made by that sequence (Flax draws its own numbers from the same distributions, not the same
numbers). Known errata in the documents' printed numbers are not pinned.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import flax_attention as fa
import torch_reference as tr
from conformance_tests import documents as doc
from conformance_tests import spec

ATOL = doc.PRINTED_ATOL


def close(name, actual, expected, atol=ATOL):
    actual = np.asarray(actual.detach() if isinstance(actual, torch.Tensor) else actual)
    expected = np.asarray(expected.detach() if isinstance(expected, torch.Tensor) else expected)
    err = float(np.abs(actual - expected).max())
    assert actual.shape == np.shape(expected), f"{name}: shape {actual.shape}"
    assert err <= atol, f"{name}: max abs diff {err:.2e} > {atol:.0e}"


INPUTS = torch.from_numpy(doc.INPUTS)


@pytest.mark.quick
def test_weight_free_walkthrough_torch():
    query = INPUTS[1]
    attn_scores_2 = torch.empty(INPUTS.shape[0])
    for i, x_i in enumerate(INPUTS):
        attn_scores_2[i] = torch.dot(x_i, query)
    close("attn_scores_2", attn_scores_2, doc.ATTN_SCORES_JOURNEY)
    close(
        "sum-normalised",
        attn_scores_2 / attn_scores_2.sum(),
        doc.ATTN_WEIGHTS_JOURNEY_SUM_NORMALISED,
    )
    close("softmax_naive", tr.softmax_naive(attn_scores_2), doc.ATTN_WEIGHTS_JOURNEY)
    close("torch.softmax", torch.softmax(attn_scores_2, dim=0), doc.ATTN_WEIGHTS_JOURNEY)
    context_vec_2 = torch.softmax(attn_scores_2, dim=0) @ INPUTS
    close("context_vec_2", context_vec_2, doc.CONTEXT_VEC_JOURNEY)
    attn_scores, attn_weights, context_vecs = tr.simplified_self_attention(INPUTS)
    close("attn_scores", attn_scores, doc.ATTN_SCORES)
    close("context_vecs", context_vecs, doc.CONTEXT_VECS)
    close("attn_weights row 2", attn_weights[1], doc.ATTN_WEIGHTS_JOURNEY)


@pytest.mark.quick
def test_weight_free_walkthrough_flax():
    x = jnp.asarray(doc.INPUTS)
    close(
        "softmax_naive",
        fa.softmax_naive(jnp.asarray(doc.ATTN_SCORES_JOURNEY)),
        doc.ATTN_WEIGHTS_JOURNEY,
    )
    attn_scores, attn_weights, context_vecs = fa.simplified_self_attention(x)
    close("attn_scores", attn_scores, doc.ATTN_SCORES)
    close("attn_scores journey", attn_scores[1], doc.ATTN_SCORES_JOURNEY)
    close("attn_weights row 2", attn_weights[1], doc.ATTN_WEIGHTS_JOURNEY)
    close("context_vecs", context_vecs, doc.CONTEXT_VECS)
    close("context_vec_2", context_vecs[1], doc.CONTEXT_VEC_JOURNEY)


@pytest.mark.quick
def test_trainable_weights_seed123():
    torch.manual_seed(123)
    W_query = torch.nn.Parameter(torch.rand(3, 2), requires_grad=False)
    W_key = torch.nn.Parameter(torch.rand(3, 2), requires_grad=False)
    W_value = torch.nn.Parameter(torch.rand(3, 2), requires_grad=False)
    query_2 = INPUTS[1] @ W_query
    keys, values = INPUTS @ W_key, INPUTS @ W_value
    close("query_2", query_2, doc.QUERY_JOURNEY_SEED123)
    close("keys", keys, doc.KEYS_SEED123)
    close("values", values, doc.VALUES_SEED123)
    close("attn_score_22", query_2.dot(keys[1]), np.float32(doc.ATTN_SCORE_22_SEED123))
    attn_scores_2 = query_2 @ keys.T
    close("attn_scores_2", attn_scores_2, doc.ATTN_SCORES_JOURNEY_SEED123)
    attn_weights_2 = torch.softmax(attn_scores_2 / keys.shape[1] ** 0.5, dim=-1)
    close("attn_weights_2", attn_weights_2, doc.ATTN_WEIGHTS_JOURNEY_SEED123)
    close("context_vec_2", attn_weights_2 @ values, doc.CONTEXT_VEC_JOURNEY_SEED123)
    # SelfAttention_v1 after the same seed draws the same three matrices in the same order
    torch.manual_seed(123)
    sa_v1 = tr.SelfAttention_v1(3, 2)
    for name in ("W_query", "W_key", "W_value"):
        assert torch.equal(getattr(sa_v1, name), locals()[name]), name


#: The documents' printed outputs of the self-attention layers, by the spec case that runs them.
PRINTED = {
    "doc_v1_seed123": doc.SELF_ATTENTION_V1_SEED123,
    "doc_v2_seed789": doc.SELF_ATTENTION_V2_SEED789,
    "doc_selfattention_seed123": doc.SELF_ATTENTION_SEED123,
}
LAYERS = [(c.layer, c.seed, PRINTED[c.name]) for c in spec.CASES if c.name in PRINTED]


@pytest.mark.parametrize(("layer", "seed", "printed"), LAYERS, ids=[n for n, _, _ in LAYERS])
def test_self_attention_printed_outputs_both_frameworks(layer, seed, printed):
    torch.manual_seed(seed)
    torch_layer = getattr(tr, layer)(3, 2)
    torch_out = torch_layer(INPUTS)
    close(f"torch {layer}", torch_out, printed)
    flax_layer = getattr(fa, layer)(3, 2, rngs=nnx.Rngs(0))
    fa.load_state_dict(flax_layer, {k: v.numpy() for k, v in torch_layer.state_dict().items()})
    flax_out = flax_layer(jnp.asarray(doc.INPUTS))
    close(f"flax {layer}", flax_out, printed)
    close(f"flax {layer} vs torch", flax_out, torch_out.detach().numpy(), atol=1e-6)


def _seed123_scores():
    torch.manual_seed(123)
    sa = tr.SelfAttention(3, 2)
    return (sa.W_query(INPUTS) @ sa.W_key(INPUTS).T).detach()


@pytest.mark.quick
def test_causal_masking_both_methods_and_dropout_torch():
    attn_scores = _seed123_scores()
    renormalized = tr.causal_attn_weights_renormalized(attn_scores, 2)
    masked_fill = tr.causal_attn_weights_masked_fill(attn_scores, 2)
    close("mask after softmax, renormalised", renormalized, doc.CAUSAL_ATTN_WEIGHTS)
    close("masked_fill(-inf) before softmax", masked_fill, doc.CAUSAL_ATTN_WEIGHTS)
    torch.manual_seed(123)
    dropped = torch.nn.Dropout(0.5)(masked_fill)
    close("dropout(0.5) after seed 123", dropped, doc.CAUSAL_ATTN_WEIGHTS_DROPOUT_SEED123)


def test_causal_masking_methods_agree_on_random_scores():
    scores = torch.randn(4, 9, 9, generator=torch.Generator().manual_seed(0)) * 3
    a = tr.causal_attn_weights_renormalized(scores, 5)
    b = tr.causal_attn_weights_masked_fill(scores, 5)
    assert float((a - b).abs().max()) <= 1e-6
    fa_a = fa.causal_attn_weights_renormalized(jnp.asarray(scores.numpy()), 5)
    fa_b = fa.causal_attn_weights_masked_fill(jnp.asarray(scores.numpy()), 5)
    assert float(jnp.abs(fa_a - fa_b).max()) <= 1e-6
    assert float(np.abs(np.asarray(fa_b) - b.numpy()).max()) <= 1e-6


@pytest.mark.quick
def test_causal_masking_functions_make_their_mask_on_the_scores_device():
    # The documents make the mask with torch.ones on the CPU, which CUDA scores rejected (the
    # report's first GPU run stopped there). The meta device fails the same way without a GPU.
    scores = torch.empty(2, 5, 5, device="meta")
    for function in (tr.causal_attn_weights_renormalized, tr.causal_attn_weights_masked_fill):
        weights = function(scores, 2)
        assert weights.device == scores.device and weights.shape == scores.shape


@pytest.mark.quick
def test_causal_masking_both_methods_flax():
    attn_scores = jnp.asarray(_seed123_scores().numpy())
    close(
        "flax renormalised",
        fa.causal_attn_weights_renormalized(attn_scores, 2),
        doc.CAUSAL_ATTN_WEIGHTS,
    )
    close(
        "flax masked_fill",
        fa.causal_attn_weights_masked_fill(attn_scores, 2),
        doc.CAUSAL_ATTN_WEIGHTS,
    )


@pytest.mark.quick
def test_printed_shapes_with_values():
    batch = torch.stack((INPUTS, INPUTS), dim=0)
    torch.manual_seed(123)
    ca = tr.CausalAttention(3, 2, batch.shape[1], 0.0)
    context_vecs = ca(batch)
    assert tuple(context_vecs.shape) == doc.CAUSAL_BATCH_SHAPE
    assert torch.equal(context_vecs[0], context_vecs[1])  # both batch rows are the same input
    # the first token sees only itself: its context vector is its value projection
    close("token 0", context_vecs[0, 0], ca.W_value(INPUTS[0]).detach().numpy(), atol=1e-7)
    torch.manual_seed(123)
    mha = tr.MultiHeadAttentionWrapper(3, 2, batch.shape[1], 0.0, num_heads=2)
    out = mha(batch)
    assert tuple(out.shape) == doc.WRAPPER_BATCH_SHAPE
    close("wrapper = its heads", out, torch.cat([h(batch) for h in mha.heads], -1).detach(), 0)
    # document 002: d_out 1024 and the (2, 5, 16) -> (2, 5, 32) MultiHeadAttention example
    wide = tr.CausalAttention(3, 1024, 6, 0.0)(batch)
    assert tuple(wide.shape) == (2, 6, 1024) and torch.equal(wide[0], wide[1])
    x = torch.rand(2, 5, 16)
    mha2 = tr.MultiHeadAttention(16, 32, 5, 0.1, 4).eval()
    y = mha2(x)
    assert tuple(y.shape) == (2, 5, 32)
    close("eval is deterministic", y, mha2(x).detach(), 0)
    # document 001 __main__: b 6, seq_len 3, d_model 8, (1, 3, 3) causal mask -> (6, 3, 8)
    mask = torch.tril(torch.ones((3, 3)), diagonal=0).unsqueeze(0)
    attn = tr.MultiHeadedAttention(num_heads=2, d_model=8, dropout=0.1).eval()
    out = attn(*(torch.rand(6, 3, 8),) * 3, mask=mask)
    assert tuple(out.shape) == (6, 3, 8)
    assert float(attn.attention_score.detach()[..., 0, 1:].abs().max()) == 0.0  # token 0: itself
