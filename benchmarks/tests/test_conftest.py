"""The benchmarks' tests run under the suite's strict settings (``conftest.py`` imports
``conformance_tests/tests/conftest.py``), whether or not the conformance tests run beside them."""

import jax
import pytest
import torch


@pytest.mark.quick
def test_the_strict_settings_hold_here():
    assert jax.config.jax_default_matmul_precision == "highest"
    assert jax.config.jax_numpy_rank_promotion == "raise"
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert torch.backends.cudnn.allow_tf32 is False
