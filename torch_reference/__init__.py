"""PyTorch reference: the attention layers of the source documents, as written there.

The documents walk through chapter 3 ("Coding attention mechanisms") of Sebastian Raschka's
"Build a Large Language Model (From Scratch)"
(https://github.com/rasbt/LLMs-from-scratch/tree/main/ch03) and an Annotated Transformer style
``MultiHeadedAttention`` (https://nlp.seas.harvard.edu/annotated-transformer/). Every class and
function mirrors a document (named in its docstring); the only changes are clear errors for bad
input and the causal-mask functions making their mask on the scores' device (listed in
``docs/deviations.md``).
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
