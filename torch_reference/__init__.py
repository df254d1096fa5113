"""PyTorch reference: the attention layers of the documents in ``shared/seeds``, as written there.

Every class and function mirrors a document (named in its docstring); the only changes are the
input checks that ``shared/API.md`` asks for (listed under "Deviations" in the README).
"""

from torch_reference.annotated import MultiHeadedAttention, attention, clones
from torch_reference.causal import (
    CausalAttention,
    MultiHeadAttentionWrapper,
    causal_attn_weights_masked_fill,
    causal_attn_weights_renormalized,
)
from torch_reference.multihead import MultiHeadAttention
from torch_reference.self_attention import (
    SelfAttention,
    SelfAttention_v1,
    SelfAttention_v2,
    simplified_self_attention,
    softmax_naive,
)

__all__ = [
    "softmax_naive",
    "simplified_self_attention",
    "SelfAttention_v1",
    "SelfAttention_v2",
    "SelfAttention",
    "causal_attn_weights_renormalized",
    "causal_attn_weights_masked_fill",
    "CausalAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadAttention",
    "MultiHeadedAttention",
    "attention",
    "clones",
]
