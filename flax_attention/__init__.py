"""Flax NNX port of the classic attention layers, equal to ``torch_reference`` by test.

Same class names and positional arguments as the documents (and ``torch_reference``); then
keyword-only ``rngs`` and the Flax options ``dtype``, ``param_dtype``, ``precision``. Weights
cross from torch with ``load_state_dict``/``load_file`` and back with ``state_dict``/
``save_file``. The attention math lives once, in ``flax_attention.core``. ``shard(layer, mesh)``
places a layer on a device mesh (``flax_attention.sharding``; the mesh-axis vocabulary is
``flax_attention.mesh``). The faster attention kernels live in ``flax_attention.kernels``.
"""

from flax_attention.annotated import MultiHeadedAttention, ProjectedKV, attention, clones
from flax_attention.cache import decode_loop
from flax_attention.causal import (
    CausalAttention,
    MultiHeadAttentionWrapper,
    causal_attn_weights_masked_fill,
    causal_attn_weights_renormalized,
)
from flax_attention.core import (
    IMPLEMENTATIONS,
    AttentionMask,
    BlockSizes,
    causal_mask,
    dot_product_attention,
    masked_softmax,
    select_implementation,
)
from flax_attention.interop import from_nnx, from_torch
from flax_attention.modern import (
    GroupedQueryAttention,
    MultiHeadAttentionWithSWA,
    MultiHeadLatentAttention,
)
from flax_attention.multihead import MultiHeadAttention
from flax_attention.self_attention import (
    SelfAttention,
    SelfAttention_v1,
    SelfAttention_v2,
    simplified_self_attention,
    softmax_naive,
)
from flax_attention.sharding import shard
from flax_attention.weights import (
    IncompatibleKeys,
    load_file,
    load_state_dict,
    save_file,
    state_dict,
)

__all__ = [
    # The documents' names, as in torch_reference.__all__ (a test checks they match).
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
    # Flax only: the attention core, decoding and the weight bridge.
    "IMPLEMENTATIONS",
    "AttentionMask",
    "BlockSizes",
    "causal_mask",
    "masked_softmax",
    "dot_product_attention",
    "select_implementation",
    "ProjectedKV",
    "decode_loop",
    "IncompatibleKeys",
    "load_state_dict",
    "state_dict",
    "save_file",
    "load_file",
    "from_torch",
    "from_nnx",
    # Flax only: scaling out over a device mesh.
    "shard",
]
