"""Composition of the app's config as train.py does it, for the tests (not collected: no ``test_`` prefix)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from quark_lightning.app.conf import CONF_DIR, register_role_groups

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted(p.stem for p in (CONF_DIR / "quant").glob("*.yaml"))
REQUIRED_PRESETS = (
    "none",
    "int8_per_tensor",
    "int8_per_channel",
    "int4_per_group",
    "w4a8_tqt",
    "fp8_e4m3",
    "mxfp8",
    "mxfp4",
    "mx6",
    "mx9",
    "bfp16",
    "bf16",
    "w4_rtn",
    "w4_gptq",
    "w4_awq",
    "w3_rtn",
    "w3_gptq",
    "w3_awq",
    "w8a8",
    "w8a8_smoothquant",
)
DECODER_ONLY = ("w4_awq", "w3_awq", "w8a8_smoothquant")  # AWQ / SmoothQuant fold scales inside decoder layers
ROTATED = ("w4a4_rotated", "w4a4_spinquant")  # rotations need a LLaMA-like decoder stack (norms fused, R1/R2/R4)
TINY_LM = (
    "experiment=char_lm",
    "data.train_bytes=20000",
    "data.val_bytes=4000",
    "data.test_bytes=4000",
    "model.n_layers=1",
)

register_role_groups()


def compose_cfg(*overrides: str) -> DictConfig:
    """The composed config of ``python train.py <overrides>`` (without the hydra node)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def run_train(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """``python train.py <args>`` in a subprocess (the real entry point, with its command-line checks)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0"}
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
