"""A core install (``pip install -e .``, no extras) runs ``python train.py``; each extra-only feature stops at once,
before training, with the install line of its extra (issue 33, item 4).

The optional packages are hidden from a child process by a ``sitecustomize`` on its PYTHONPATH: every import finder
answers "not found" for them and ``importlib.metadata`` lists no distribution of them, as on a machine where they were
never installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from quark.torch.extras import EXTRAS, MissingExtraError, available, import_extra, install_line, require_extra
from tests.app.app_helpers import ROOT

HIDDEN = ("hydra_plugins", "optuna", "transformers", "onnx", "onnxruntime", "safetensors", "brevitas", "onnxoptimizer")
SMOKE = ("trainer=smoke", "trainer.accelerator=cpu", "quant.calib_batches=2")

_SITECUSTOMIZE = f'''
import sys

HIDDEN = {HIDDEN!r}
DISTRIBUTIONS = {{"hydra_optuna_sweeper", *HIDDEN}}


def _normalized(name):
    return (name or "").lower().replace("-", "_").replace(".", "_")


class _Hide:
    """Wraps one meta-path finder: the hidden packages are not found, nor listed as installed distributions."""

    def __init__(self, finder):
        self.finder = finder
        if hasattr(finder, "find_distributions"):
            self.find_distributions = self._find_distributions

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            return None
        return self.finder.find_spec(name, path, target)

    def _find_distributions(self, *args, **kwargs):
        found = self.finder.find_distributions(*args, **kwargs)
        return (d for d in found if _normalized(d.metadata["Name"]) not in DISTRIBUTIONS)

    def __getattr__(self, name):
        return getattr(self.finder, name)


sys.meta_path[:] = [_Hide(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
'''

_PROBE = """
import importlib.metadata, importlib.util, sys
for name in sys.argv[1:]:
    try:
        __import__(name)
    except ImportError:
        pass
    else:
        sys.exit(f"{name} imports")
for dist in ("transformers", "onnx", "safetensors", "optuna", "hydra-optuna-sweeper"):
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        continue
    sys.exit(f"{dist} is listed as installed")
print("hidden")
"""


@pytest.fixture(scope="module")
def core_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a child process that sees a core install: the optional packages cannot be imported."""
    folder = tmp_path_factory.mktemp("core_install")
    (folder / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return {**os.environ, "PYTHONPATH": f"{folder}{os.pathsep}{ROOT}", "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1"}


def _train(env: dict[str, str], run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(ROOT / "train.py"), *SMOKE, f"hydra.run.dir={run_dir}", *args]
    return subprocess.run(command, cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=300)


def test_the_optional_packages_are_hidden(core_env: dict[str, str]) -> None:
    """The premise of the tests below: in the child, none of the extras' packages imports or is listed."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *HIDDEN], env=core_env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "hidden", proc.stdout + proc.stderr


def test_train_py_runs_on_a_core_install(core_env: dict[str, str], tmp_path: Path) -> None:
    """Before the fix: ModuleNotFoundError 'hydra_plugins' at train.py's import (quark_lightning.app.search.sweeper_installed)."""
    proc = _train(core_env, tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "results.json").is_file()
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "extra", "module"),
    [
        (("export=[onnx]",), "export", "onnx"),
        (("export=[safetensors]",), "export", "safetensors"),
        (("export=[quark]",), "export", "safetensors"),
        (("experiment=hf_lm",), "hf", "transformers"),
        (("hparams_search=optuna_bits",), "search", None),
    ],
)
def test_an_extra_only_feature_stops_at_once_with_its_install_line(
    core_env: dict[str, str], tmp_path: Path, args: tuple[str, ...], extra: str, module: str | None
) -> None:
    """One ``error:`` line naming the feature and ``pip install -e ".[<extra>]"``; nothing trained (no checkpoint)."""
    run_dir = tmp_path / "run"
    proc = _train(core_env, run_dir, *args)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert args[0] in errors[0] and f'pip install -e ".[{extra}]"' in errors[0]
    if module is not None:
        assert f"{module} is not installed" in errors[0]
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "results.json").exists()


# ----------------------------------------------------------------------------------------------- the helpers
def _without_hydra_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hydra_plugins`` absent, whatever an earlier test imported: an import of it raises ModuleNotFoundError, and no
    submodule of it is cached (``find_spec`` answers a cached module without looking at its parents)."""
    for name in [n for n in sys.modules if n.startswith("hydra_plugins.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "hydra_plugins", None)


def test_available_is_false_when_a_parent_package_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """``importlib.util.find_spec('a.b')`` raises when ``a`` is absent; ``available`` says False instead."""
    _without_hydra_plugins(monkeypatch)
    assert available("hydra_plugins.hydra_optuna_sweeper") is False
    assert available("quark_lightning_no_such_package") is False
    assert available("json") is True


def test_sweeper_installed_without_hydra_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    from quark_lightning.app.search import check_search_args, sweeper_installed

    _without_hydra_plugins(monkeypatch)
    assert sweeper_installed() is False
    message = check_search_args(["hparams_search=optuna_bits"])
    assert message is not None and 'pip install -e ".[search]"' in message


def test_require_and_import_extra_name_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(
        MissingExtraError,
        match=r'^export=\[onnx\] needs the \'export\' extra \(onnx is not installed\): pip install -e "\.\[export\]"$',
    ):
        require_extra("export", "export=[onnx]", ("onnx",))
    with pytest.raises(MissingExtraError, match=r'ONNX export needs .*pip install -e "\.\[export\]"'):
        import_extra("onnx", "export", "ONNX export")
    assert isinstance(MissingExtraError("x"), ImportError)  # what a library user of the engine catches
    assert {install_line(e) for e in EXTRAS} == {
        f'pip install -e ".[{e}]"' for e in ("export", "hf", "brevitas", "search")
    }
    with pytest.raises(ValueError, match="allowed"):
        install_line("exports")
