"""``MultiHeadedAttention``, ``attention`` and ``clones``: the annotated-transformer post.

Shape legend: ``b`` batch, ``h`` = ``num_heads``, ``t`` = ``q_len`` query tokens, ``s`` =
``k_len`` key/value tokens, ``d_model`` model features, ``d`` = ``k_dim = d_model // h``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from flax_attention._checks import (
    check_dropout,
    check_int,
    check_positive_int,
    check_splits_over_heads,
)
from flax_attention._init import set_linear_axes
from flax_attention._inputs import (
    check_annotated_inputs,
    check_array,
    check_projected_inputs,
)
from flax_attention._layers import Dropout, linear_factory
from flax_attention.core import (
    AttentionMask,
    BlockSizes,
    Implementation,
    KVLayout,
    attend,
    check_block_sizes,
    check_implementation,
    dot_product_attention,
)
from flax_attention.mesh import FROM_HEADS, HEADS, TO_HEADS, constrain

__all__ = ["MultiHeadedAttention", "attention", "clones"]  # as torch_reference.annotated

#: The annotated-transformer post fills ``mask == 0`` with this finite value, not ``-inf``.
MASK_FILL_VALUE = -1e10


class AttentionScore(nnx.Intermediate):
    """The last attention weights ``(b, h, q_len, k_len)`` of a ``MultiHeadedAttention`` call."""


class ProjectedKV(NamedTuple):
    """Keys and values already through ``W^K``/``W^V``, ``(b, k_len, h, d)`` each: an encoder's
    memory projected once (``MultiHeadedAttention.project_kv``) for every decoder step."""

    keys: jax.Array
    values: jax.Array


class MultiHeadedAttention(nnx.Module):
    """The annotated-transformer post, ``MultiHeadedAttention(num_heads, d_model, dropout=0.1)``.

    ``query`` ``(b, q_len, d_model)``, ``key`` and ``value`` ``(b, k_len, d_model)``, ``mask``
    ``(b, q_len, k_len)`` or any 3-D shape that broadcasts to it, such as ``(1, q_len, k_len)``
    or a padding mask ``(b, 1, k_len)``; positions where ``mask == 0`` get ``-1e10``. Returns
    ``(b, q_len, d_model)``; the last weights ``(b, h, q_len, k_len)`` stay in
    ``self.attention_score`` (an ``AttentionScore`` variable, ``None`` before the first call).

    As in the document, the four projections are ``clones`` of one ``Linear``: they start equal.
    ``torch_reference/annotated.py`` is the document's code; its ``forward`` and ``attention``
    map to ``__call__`` here (its checks and ``project_kv``, then ``_forward``, the rest):

    ===================================================  ========================================
    document (``torch_reference/annotated.py``)           here
    ===================================================  ========================================
    ``mask.unsqueeze(1)``                                 ``mask[:, None]``, then ``mask != 0``
    1) ``proj_weight(x).view(b, -1, h, d_k)``             ``project_kv`` and ``_split_heads``;
    ``.transpose(1, 2)``                                  no transpose: the core takes
                                                          ``(b, t, h, d)``
    2) ``attention(query, key, value, mask, dropout)``:   ``dot_product_attention`` (core):
    ``scores = query @ key.transpose(-2, -1)``            its scores
    ``/ math.sqrt(d_k)``, ``softmax(scores, dim=-1)``     ``masked_softmax`` (float32 or wider)
    ``scores.masked_fill(mask == 0, -1e10)``              ``fill_value=MASK_FILL_VALUE``
    ``p_attn = dropout(p_attn)``                          ``dropout=self.dropout``
    ``torch.matmul(p_attn, value)``                       the core's weighted sum
    ``self.attention_score = ...``                        ``AttentionScore`` (if kept)
    3) ``out.transpose(1, 2).contiguous().view(...)``     ``out.reshape(b, t, d_model)``
    4) ``self.proj_weights[-1](out)``                     the same
    ===================================================  ========================================

    Flax options: ``implementation`` and ``block_sizes`` (``flax_attention.core``) and
    ``keep_attention_score``:
    ``True`` (the document) needs the weights, so ``implementation=None`` runs ``reference``;
    ``False`` leaves ``attention_score`` ``None`` and lets ``None`` pick a faster kernel. A
    decoder attending to a fixed memory projects it once, ``kv = mha.project_kv(key, value)``,
    and then calls ``mha(query, mask=mask, kv=kv)`` at every step.
    """

    def __init__(
        self,
        num_heads: int,
        d_model: int,
        dropout: float = 0.1,
        *,
        implementation: Implementation | None = None,
        block_sizes: BlockSizes | None = None,
        keep_attention_score: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        rngs: nnx.Rngs,
    ):
        check_positive_int("num_heads", num_heads)
        check_positive_int("d_model", d_model)
        check_dropout(dropout)
        check_splits_over_heads("d_model", d_model, num_heads)
        check_implementation(implementation)
        check_block_sizes(block_sizes)
        if implementation not in (None, "reference") and keep_attention_score:
            raise ValueError(
                f"implementation ({implementation!r}) must be 'reference' or None while "
                "keep_attention_score (True) keeps the weights (pass keep_attention_score=False)"
            )
        # Assume v_dim always equals k_dim
        self.k_dim = d_model // num_heads
        self.num_heads = num_heads
        self.implementation = implementation
        self.block_sizes = block_sizes
        self.keep_attention_score = keep_attention_score
        self.precision = precision
        linear = linear_factory(
            dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs
        )
        self.proj_weights = clones(linear(d_model, d_model, axes=TO_HEADS), 4)  # W^Q, W^K, W^V, W^O
        set_linear_axes(self.proj_weights[-1], FROM_HEADS)  # W^O reduces over the heads
        self.attention_score = nnx.data(None)
        self.dropout = Dropout(dropout, rngs=rngs)

    def model_axis_sizes(self) -> dict[str, int]:
        """What ``flax_attention.shard`` splits over ``model``: the heads."""
        return {"num_heads": self.num_heads}

    def _split_heads(self, proj_weight, x):
        x = proj_weight(x).reshape(*x.shape[:-1], self.num_heads, self.k_dim)  # (b, t, h, d)
        return constrain(x, HEADS)  # on a mesh: each head stays on its device

    def project_kv(self, key, value) -> ProjectedKV:
        """``key``, ``value`` ``(b, k_len, d_model)`` through ``W^K``, ``W^V``: two
        ``(b, k_len, h, d)`` arrays, to pass as ``kv=`` to every later call."""
        check_annotated_inputs(key, key, value, None, self.num_heads * self.k_dim)
        return ProjectedKV(
            self._split_heads(self.proj_weights[1], key),
            self._split_heads(self.proj_weights[2], value),
        )

    def __call__(self, query, key=None, value=None, mask=None, *, kv: ProjectedKV | None = None):
        if kv is None:
            check_annotated_inputs(query, key, value, mask, self.num_heads * self.k_dim)
            kv = self.project_kv(key, value)  # 1) W^K, W^V
        else:
            _check_kv_call(key, value, kv)
            check_projected_inputs(query, kv, mask, self.num_heads, self.k_dim)
        return self._forward(query, kv, mask)

    def _forward(self, query, kv: ProjectedKV, mask, kv_layout: KVLayout = "shd"):
        """``__call__`` on checked inputs, the keys and values projected: what a decoder layer
        calls with its decode cache, heads first (``kv_layout="hsd"``: ``(b, h, k_len, d)``
        each, read as they are stored; ``flax_attention.cache``)."""
        d_model = self.num_heads * self.k_dim
        if mask is not None:
            mask = jnp.asarray(mask)[:, None]  # (b or 1, 1, t or 1, s)

        # 1) Apply W^Q (W^K, W^V: project_kv); (b, seq_len, d_model) -> (b, seq_len, h, d)
        query = self._split_heads(self.proj_weights[0], query)

        # 2) Attention and the weights, (b, t, h, d) and (b, h, t, s)
        attention_mask = AttentionMask.build(
            None if mask is None else mask != 0,
            fill_value=MASK_FILL_VALUE,
            dtype=jnp.result_type(query, kv.keys),
        )
        out = attend(
            query,
            kv.keys,
            kv.values,
            attention_mask,
            dropout=self.dropout,
            precision=self.precision,
            implementation=self.implementation,
            need_weights=self.keep_attention_score,
            block_sizes=self.block_sizes,
            kv_layout=kv_layout,
        )
        if self.keep_attention_score:
            out, attention_score = out
            self.attention_score = AttentionScore(attention_score)

        # 3) "Concat" output, (b, t, d_model)
        out = out.reshape(*out.shape[:-2], d_model)

        # 4) Apply W^O to get the final output (on an explicit mesh, laid out like query)
        return self.proj_weights[-1](out)


def clones(module, N):
    "Produce N identical layers."
    check_int("N", N, 0)
    return nnx.List([nnx.clone(module) for _ in range(N)])


def attention(query, key, value, mask=None, dropout=None, *, precision=None):
    """The annotated-transformer post, ``attention``: scaled dot product, ``mask == 0`` filled.

    Args:
      query: ``(..., q_len, k_dim)``, e.g. ``(b, h, q_len, k_dim)`` as in the document.
      key: ``(..., k_len, k_dim)``.
      value: ``(..., k_len, v_dim)``.
      mask: broadcastable to ``(..., q_len, k_len)``; ``mask == 0`` gets ``-1e10``.
      dropout: an ``nnx.Dropout`` applied to the weights, or ``None``.

    Returns:
      ``out`` ``(..., q_len, v_dim)`` and ``attention_score`` ``(..., q_len, k_len)``.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_array(name, x, 2, "..., length, features")
    if value.shape[-2] != key.shape[-2]:
        raise ValueError(
            f"value.shape[-2] ({value.shape[-2]}) must equal key.shape[-2] ({key.shape[-2]}): "
            "one value per key"
        )
    # The core's layout is (..., t, h, d): the document's (..., t, d) is one head.
    out, attention_score = dot_product_attention(
        query[..., None, :],
        key[..., None, :],
        value[..., None, :],
        None if mask is None else jnp.asarray(mask)[..., None, :, :] != 0,
        fill_value=MASK_FILL_VALUE,
        dropout=dropout,
        precision=precision,
    )
    return out[..., 0, :], attention_score[..., 0, :, :]


def _check_kv_call(key, value, kv):
    """A call with ``kv`` (projected keys and values) instead of ``key`` and ``value``."""
    if key is not None or value is not None:
        raise ValueError("key and value must be None when kv (projected keys and values) is given")
    if not isinstance(kv, ProjectedKV):
        raise TypeError(f"kv ({type(kv).__name__}) must be a ProjectedKV (from project_kv)")
