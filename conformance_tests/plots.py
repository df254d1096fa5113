"""PNG heatmaps of the attention weights on the documents' input: torch, Flax, |difference|.

matplotlib (the ``report`` extra) is imported only by ``write_heatmaps``, which draws.
"""

from __future__ import annotations

import os

import numpy as np
import torch

import flax_attention.core as core
from conformance_tests.documents import INPUTS
from conformance_tests.harness import build_pair
from conformance_tests.spec import CASES, DOCUMENTS, Case

__all__ = ["attention_weights_pair", "write_heatmaps"]

TOKENS = ["Your", "journey", "starts", "with", "one", "step"]


def _spy(owner, attr, captured):
    """Replace ``owner.attr`` (a softmax) by a wrapper that records its results."""
    original = getattr(owner, attr)

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        captured.append(np.asarray(out.detach() if isinstance(out, torch.Tensor) else out))
        return out

    setattr(owner, attr, spy)
    return original


#: The annotated-transformer post's layer on the documents' input needs d_model = 3: one head,
#: a causal mask.
ANNOTATED_PLOT_CASE = Case(
    "plot_annotated", "MultiHeadedAttention", (1, 3, 0.0), ((1, 6, 3),) * 3, "causal", seed=123
)


def attention_weights_pair(case, workdir):
    """The first head's weights on the documents' input, ``(torch, flax)``, each (6, 6).

    The weights are read where each side computes them (``torch.softmax`` in torch_reference,
    ``flax_attention.core.masked_softmax`` in the port), so every layer is shown as it runs.
    """
    tm, fm = build_pair(case, workdir)
    x = np.stack([INPUTS])  # (1, 6, 3)
    args = (x, x, x, np.tril(np.ones((1, 6, 6), np.float32))) if case.mask else (x,)
    if case.inputs == DOCUMENTS:
        args = (INPUTS,)
    t_captured, f_captured = [], []
    original = _spy(torch, "softmax", t_captured)
    try:
        with torch.no_grad():
            tm(*(torch.from_numpy(a) for a in args))
    finally:
        torch.softmax = original
    original = _spy(core, "masked_softmax", f_captured)
    try:
        fm(*args)
    finally:
        core.masked_softmax = original
    if case.layer == "MultiHeadedAttention":  # the annotated-transformer post keeps its weights
        t_captured, f_captured = [tm.attention_score.numpy()], [np.asarray(fm.attention_score[...])]
    return t_captured[-1].reshape(-1, 6, 6)[0], f_captured[-1].reshape(-1, 6, 6)[0]


def write_heatmaps(out_dir, workdir) -> list[str]:
    """One PNG per layer: torch weights, Flax weights and their absolute difference."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    seen = set()
    for case in CASES:
        if case.layer == "MultiHeadedAttention":
            case = ANNOTATED_PLOT_CASE
        if case.is_function or case.layer in seen or not case.name.startswith(("doc_", "plot_")):
            continue
        seen.add(case.layer)
        t, f = attention_weights_pair(case, workdir)
        fig, axes = plt.subplots(1, 3, figsize=(13, 4))
        diff = np.abs(t - f)
        for ax, data, title in zip(
            axes,
            (t, f, diff),
            ("torch_reference", "flax_attention", f"|difference| (max {diff.max():.1e})"),
        ):
            vmax = 1.0 if data is not diff else max(float(diff.max()), 1e-7)
            image = ax.imshow(data, cmap="viridis", vmin=0.0, vmax=vmax)
            ax.set_title(title)
            ax.set_xticks(range(6), TOKENS, rotation=45)
            ax.set_yticks(range(6), TOKENS)
            fig.colorbar(image, ax=ax, fraction=0.046)
        fig.suptitle(f"{case.layer}: attention weights on the documents' input ({case.name})")
        fig.tight_layout()
        path = os.path.join(out_dir, f"{case.layer}.png")
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths
