"""The shared spec: one set of weights in both frameworks, compared on every backend present.

For a user's own pair: ``conformance_tests.parity`` (``check_parity``, ``assert_parity``: does
the port compute what torch computes?) and ``find_divergence`` / ``assert_no_divergence``
(``conformance_tests.divergence``: where does it depart?). Those two are imported when first
used, so that ``python -m conformance_tests`` can say what is missing before importing torch.
"""

from __future__ import annotations

import importlib

__all__ = ["DivergenceReport", "DivergenceRow", "assert_no_divergence", "find_divergence"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("conformance_tests.divergence"), name)
    raise AttributeError(f"module 'conformance_tests' has no attribute {name!r}")
