"""Session-wide test settings.

The format kernels run eagerly in tests unless ``QUARK_COMPILE`` is set in the environment: compiling each kernel
variant the suite touches would cost seconds apiece, and the compiled kernels (the default for users) are checked bit
for bit against eager, forward and backward, in ``tests/quark/quantization/formats/test_compile_backend.py``.
"""

from __future__ import annotations

import os

from quark.torch.quantization.formats import set_compile

if "QUARK_COMPILE" not in os.environ:
    set_compile(False)
