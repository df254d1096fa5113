"""The book's appendix E (LoRA) in torch: the reference that ``flax_attention.models.lora`` is
held to (``tests/test_lora.py``).

"Build a Large Language Model (From Scratch)" (Sebastian Raschka), appendix E, adds low-rank
updates to every ``nn.Linear`` of the chapter 6 model. This module is the book's published code
(https://github.com/rasbt/LLMs-from-scratch, ``pkg/llms_from_scratch/appendix_e.py``, as of 2026),
class for class and line for line, so a model it wraps has the book's ``state_dict`` keys
(``...W_query.linear.weight``, ``...W_query.lora.A``, ``...W_query.lora.B``). It applies to the
book's model twin, ``conformance_tests.book_gpt.GPTModel``.

The book's code scales the update by ``alpha / rank`` (since September 2025; the printed
chapter scaled by ``alpha``), which this module follows. ``freeze`` is the book's loop that sets
``requires_grad = False`` on every parameter before the LoRA layers are added.
"""

from __future__ import annotations

import math

import torch

__all__ = ["LinearWithLoRA", "LoRALayer", "freeze", "replace_linear_with_lora"]


class LoRALayer(torch.nn.Module):
    def __init__(self, in_dim, out_dim, rank, alpha):
        super().__init__()
        self.A = torch.nn.Parameter(torch.empty(in_dim, rank))
        torch.nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))  # as a Linear's weight is drawn
        self.B = torch.nn.Parameter(torch.zeros(rank, out_dim))
        self.alpha = alpha
        self.rank = rank

    def forward(self, x):
        x = (self.alpha / self.rank) * (x @ self.A @ self.B)
        return x


class LinearWithLoRA(torch.nn.Module):
    def __init__(self, linear, rank, alpha):
        super().__init__()
        self.linear = linear
        self.lora = LoRALayer(linear.in_features, linear.out_features, rank, alpha)

    def forward(self, x):
        return self.linear(x) + self.lora(x)


def replace_linear_with_lora(model, rank, alpha):
    for name, module in model.named_children():
        if isinstance(module, torch.nn.Linear):
            # Replace the Linear layer with LinearWithLoRA
            setattr(model, name, LinearWithLoRA(module, rank, alpha))
        else:
            # Recursively apply the same function to child modules
            replace_linear_with_lora(module, rank, alpha)


def freeze(model):
    """Appendix E's ``for param in model.parameters(): param.requires_grad = False``."""
    for param in model.parameters():
        param.requires_grad = False
