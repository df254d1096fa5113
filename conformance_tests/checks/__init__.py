"""One module per check; each takes a ``pairs.Subject`` (a pair factory, its ``LayerSpec``,
inputs and mask), a backend and a dtype, and returns report rows.

| check | module | compares |
|---|---|---|
| ``forward`` | ``forward.py`` | every output (returned and kept), eval mode |
| ``grad`` | ``grad.py`` | gradients of every input and parameter, by torch name |
| ``train`` | ``train.py`` | 50 steps of Adam, AdamW and SGD with momentum |
| ``dropout`` | ``dropout.py`` | injected keep-masks exactly; the layer's own draws statistically |
| ``mask`` | ``mask.py`` | masked positions have no influence |
| ``dtype`` | ``dtype.py`` | the Flax side in bfloat16/float16 against torch in float32 |
"""

from conformance_tests.checks.dropout import check_dropout
from conformance_tests.checks.dtype import check_dtype
from conformance_tests.checks.forward import check_forward
from conformance_tests.checks.grad import check_grad
from conformance_tests.checks.mask import check_mask
from conformance_tests.checks.train import check_train

__all__ = ["CHECK_FUNCTIONS", "check_dropout", "check_dtype"]

#: The float32 checks by name (``dtype`` runs ``check_dtype`` in each lower precision).
CHECK_FUNCTIONS = {
    "forward": check_forward,
    "grad": check_grad,
    "train": check_train,
    "dropout": check_dropout,
    "mask": check_mask,
}
