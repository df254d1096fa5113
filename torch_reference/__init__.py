"""PyTorch reference: the attention layers of the source documents, as written there.

The documents walk through chapter 3 ("Coding attention mechanisms") of Sebastian Raschka's
"Build a Large Language Model (From Scratch)"
(https://github.com/rasbt/LLMs-from-scratch/tree/main/ch03) and an Annotated Transformer style
``MultiHeadedAttention`` (https://nlp.seas.harvard.edu/annotated-transformer/). Every class and
function mirrors a document (named in its docstring); the only changes are clear errors for bad
input and the causal-mask functions making their mask on the scores' device (listed in
``docs/deviations.md``).

The documents, by the names the code uses (the conformance data, ``conformance_tests/documents.py``,
cites them by number and cell):

=====  ==================================  ==================================================
no.    name                                what it holds
=====  ==================================  ==================================================
000    the chapter 3 notebook              every layer from weight-free attention to
                                           ``MultiHeadAttention``, with printed outputs
001    the annotated-transformer post      ``attention`` and ``MultiHeadedAttention`` with
                                           separate query, key, value and a ``-1e10`` mask
002    the chapter 3 article               the same walkthrough as 000, explained
003    the self-attention notebook         ``softmax_naive``, ``SelfAttention_v1``/``_v2``,
                                           with printed outputs
004    the ``CausalAttention`` listing     ``CausalAttention`` and its batch test
=====  ==================================  ==================================================

Past the documents, the book's chapter 4 bonus layers (``torch_reference.modern``):
``GroupedQueryAttention``, ``MultiHeadLatentAttention``, ``MultiHeadAttentionWithSWA``, with
their KV caches (``forward(x, use_cache=True)``, ``reset_cache()``).
"""

from torch_reference.annotated import MultiHeadedAttention, attention, clones
from torch_reference.causal import (
    CausalAttention,
    MultiHeadAttentionWrapper,
    causal_attn_weights_masked_fill,
    causal_attn_weights_renormalized,
)
from torch_reference.modern import (
    GroupedQueryAttention,
    MultiHeadAttentionWithSWA,
    MultiHeadLatentAttention,
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
    "GroupedQueryAttention",
    "MultiHeadLatentAttention",
    "MultiHeadAttentionWithSWA",
]
