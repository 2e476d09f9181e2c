"""Session-wide test settings.

The format kernels run eagerly in tests (and in the scripts they start) unless ``QUARK_COMPILE`` is set in the
environment: compiling each kernel variant the suite touches would cost seconds apiece, and the compiled kernels (the
default for users) are checked bit for bit against eager, forward and backward, in
``tests/quark/quantization/formats/test_compile_backend.py``.
"""

from __future__ import annotations

import os

os.environ.setdefault("QUARK_COMPILE", "0")  # before quark is imported: Backend reads it once
