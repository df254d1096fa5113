"""The models the attention layers exist for: the book's chapter 4 ``GPTModel`` (which is also
Hugging Face's GPT-2), its checkpoints, generation and training.

- ``GPTModel(cfg, *, rngs)``, ``LayerNorm``, ``GELU``, ``FeedForward``, ``TransformerBlock``:
  chapter 4's modules on ``flax_attention.MultiHeadAttention`` (``gpt``).
- Checkpoints: the book's torch state dict through ``flax_attention.load_state_dict`` and
  ``state_dict`` (``read_pth`` reads a ``.pth``); Hugging Face GPT-2 directories through
  ``GPTModel.from_pretrained`` and ``save_pretrained`` (``checkpoints``).
- ``generate_text_simple``, ``generate``: chapters 4 and 5's generation (``generation``).
- ``calc_loss_batch``, ``train_step``, ``calc_loss_loader``, ``evaluate_model``,
  ``train_model_simple``: chapter 5's training with optax (targets of -100 left out, as chapter
  7 needs), and appendix D's ``train_model`` (warmup, cosine decay, clipping) (``training``).
- ``classify``: chapter 6, the model fine-tuned as a classifier (``trainable_filter``,
  ``train_classifier_simple``, ``classify_review``, ...).
- ``instruct``: chapter 7, instruction fine-tuning (``format_input``, ``custom_collate_fn``).
- ``lora``: appendix E's LoRA (``LoRALayer``, ``LinearWithLoRA``, ``replace_linear_with_lora``,
  ``merge_lora``).
- ``quantize(model, "int8")``: a copy with int8 weights for inference (``quantized``).
- ``qwen3``, ``llama3``: the book's package's next models, ``Qwen3Model(cfg)`` (dense or a
  mixture of experts) and ``Llama3Model(cfg)``, its config dicts and names, Hugging Face
  directories through ``from_pretrained``/``save_pretrained`` (their shared pieces: ``decoder``).
- ``annotated``: the Annotated Transformer's encoder-decoder (``make_model``, its modules, masks,
  label smoothing, the learning-rate schedule, training and batched ``greedy_decode``).

Nothing here imports torch (``read_pth`` does, when called).
"""

from flax_attention.models import annotated, classify, instruct, llama3, lora, qwen3
from flax_attention.models.checkpoints import read_pth
from flax_attention.models.generation import generate, generate_text_simple
from flax_attention.models.gpt import (
    GELU,
    GPT_CONFIG_124M,
    Config,
    FeedForward,
    GPTModel,
    LayerNorm,
    TransformerBlock,
)
from flax_attention.models.llama3 import Llama3Model
from flax_attention.models.quantized import quantize
from flax_attention.models.qwen3 import Qwen3Model
from flax_attention.models.training import (
    calc_loss_batch,
    calc_loss_loader,
    evaluate_model,
    generate_and_print_sample,
    train_model,
    train_model_simple,
    train_step,
)

__all__ = [
    "GPT_CONFIG_124M",
    "GELU",
    "Config",
    "FeedForward",
    "GPTModel",
    "LayerNorm",
    "Llama3Model",
    "Qwen3Model",
    "TransformerBlock",
    "annotated",
    "classify",
    "instruct",
    "llama3",
    "lora",
    "qwen3",
    "quantize",
    "read_pth",
    "generate",
    "generate_text_simple",
    "calc_loss_batch",
    "calc_loss_loader",
    "evaluate_model",
    "generate_and_print_sample",
    "train_model",
    "train_model_simple",
    "train_step",
]
