"""A model's train/eval mode around a call: ``in_eval_mode``, which generation, decoding,
evaluation and the fine-tuning chapters' accuracy loops share (a module of its own, so that
each imports it without importing the others)."""

from __future__ import annotations

import functools

from flax import nnx

__all__ = ["in_eval_mode"]


def in_eval_mode(function):
    """``function(model, ...)`` run with every dropout off, the model's modes put back after."""

    @functools.wraps(function)
    def run(model, *args, **kwargs):
        dropouts = [node for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Dropout)]
        modes = [dropout.deterministic for dropout in dropouts]
        model.eval()
        try:
            return function(model, *args, **kwargs)
        finally:
            for dropout, deterministic in zip(dropouts, modes):
                dropout.deterministic = deterministic

    return run
