"""Session-wide test settings.

The format kernels run eagerly in tests (and in the scripts they start) unless ``QUARK_COMPILE`` is set in the
environment: compiling each kernel variant the suite touches would cost seconds apiece, and the compiled kernels (the
default for users) are checked bit for bit against eager, forward and backward, in
``tests/quark/quantization/formats/test_compile_backend.py`` (and the fused observe-and-quantize pass in
``tests/quark/quantization/test_observe_quantize.py``), which use the ``compiler`` fixture below.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("QUARK_COMPILE", "0")  # before quark is imported: Backend reads it once
# read once at import as well: a threshold exported in the shell (the prebuilding fit's QUARK_DIRECT_KERNELS=2) would
# build direct kernels where tests do not expect them; a test that wants another sets kernel_cache.DIRECT_AFTER_CALLS
os.environ.pop("QUARK_DIRECT_KERNELS", None)
# compiled kernels stored by an earlier run would be loaded instead of compiled: each session starts with an empty
# store of its own, removed when the session ends
if "QUARK_KERNEL_CACHE" not in os.environ:
    _STORE = tempfile.mkdtemp(prefix="quark_kernels_tests_")
    os.environ["QUARK_KERNEL_CACHE"] = _STORE
    atexit.register(shutil.rmtree, _STORE, True)

#: test folders whose every test runs the Hydra app (or a task's whole training loop) end to end: ``integration``
INTEGRATION_DIRS = ("app", "tasks")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the app's and the tasks' tests ``integration`` (other files mark themselves with ``pytestmark``), so that
    ``pytest -m "not slow and not integration"`` is the quick unit tier while writing code."""
    root = Path(__file__).parent
    for item in items:
        parts = item.path.relative_to(root).parts if item.path.is_relative_to(root) else ()
        if parts and parts[0] in INTEGRATION_DIRS:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def compiler() -> None:
    """Skip where torch.compile cannot build CPU kernels (no C++ compiler): auto mode runs eagerly there."""
    import torch

    try:
        torch.compile(lambda t: t * 2 + 1, dynamic=True)(torch.ones(4))
    except Exception as err:  # noqa: BLE001 - whatever stops inductor here
        pytest.skip(f"torch.compile does not work on this machine: {type(err).__name__}: {err}"[:300])


@pytest.fixture
def compiled(compiler: None) -> Iterator[None]:
    """The compiled kernels on from the first call (``set_compile(True)``) for one test, off again after it."""
    from quark.torch.quantization.formats import Backend, set_compile

    before = Backend.compile
    set_compile(True)
    try:
        yield
    finally:
        set_compile(before)


@pytest.fixture
def backend_state() -> Iterator[type]:
    """The compile policy's process-wide state (``formats.Backend``) restored after the test, every field; no run plan
    left over from before it. Yields ``Backend``."""
    from quark.torch.quantization.formats import Backend

    saved = {name: value for name, value in vars(Backend).items() if not name.startswith("_")}
    Backend.remaining_numel = Backend.step_mark = Backend.run_mark = None
    try:
        yield Backend
    finally:
        for name, value in saved.items():
            setattr(Backend, name, value)


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``torch.compile`` replaced by a recorder: each compiled call appends "compiled" and runs the eager body (nothing
    is really compiled)."""
    import torch

    calls: list[str] = []

    def recording_compile(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
        def run(*args: Any, **kw: Any) -> Any:
            calls.append("compiled")
            return fn(*args, **kw)

        return run

    monkeypatch.setattr(torch, "compile", recording_compile)
    return calls


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the kernels the kernel cache serves (compiled calls), in order."""
    from quark.torch.quantization.formats.kernel_cache import KernelCache

    names: list[str] = []
    original = KernelCache.__call__

    def spy(self: KernelCache, *args: Any, **kwargs: Any) -> Any:
        names.append(getattr(self.fn, "__name__", "?"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(KernelCache, "__call__", spy)
    return names
