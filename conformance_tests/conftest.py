"""Strict settings for every test: highest matmul precision, rank promotion raises, TF32 off.

Hypothesis profiles for ``tests/test_fuzz.py``, chosen with ``HYPOTHESIS_PROFILE`` (default
``ci``):

- ``ci``: derandomised (the same examples on every run, so CI is never flaky), no example
  database, no deadline; ``FUZZ_EXAMPLES`` forward examples per group of test_fuzz.py (9 groups:
  every layer, document 001's once per mask kind) and a third as many gradient examples: 207 in
  all, about 70 s on 2 CPU cores.
- ``dev``: random examples, 10x as many; ``HYPOTHESIS_PROFILE=dev python -m pytest
  conformance_tests/tests/test_fuzz.py`` (about 12 minutes on 2 cores). A failure prints the
  ``@reproduce_failure`` blob to paste above the test.
"""

import os

import jax
import torch
from hypothesis import HealthCheck, settings

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_numpy_rank_promotion", "raise")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

#: Examples per test in the ``ci`` profile (test_fuzz.py: 9 groups x (17 forward + 6 gradient)).
FUZZ_EXAMPLES = 17

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    max_examples=10 * FUZZ_EXAMPLES,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
