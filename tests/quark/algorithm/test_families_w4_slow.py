"""The issue-35 target on the fused-projection and mixture-of-experts families (``bench/families_w4.py`` at a small
scale): at W4 g128, GPTQ and AWQ have a lower held-out logits error against the float model than round-to-nearest on
Phi-3 (grouped-query attention), GPT-NeoX, Mixtral, Qwen2-MoE and Qwen3-MoE (slow: trains each tiny model for a few
steps first)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.families_w4 import run, windows
from quark_lightning.tasks.char_lm import load_python_corpus

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


@pytest.mark.parametrize("family", ["phi3", "gpt-neox", "mixtral", "qwen2-moe", "qwen3-moe"])
def test_gptq_and_awq_beat_round_to_nearest_held_out(family: str, tmp_path: Path) -> None:
    corpus = load_python_corpus(train_bytes=1, val_bytes=100_000, test_bytes=100_000)
    calib, held = windows(corpus["val"], 16, seed=3), windows(corpus["test"], 16, seed=4)
    args = argparse.Namespace(train_steps=30, cache_dir=tmp_path, symmetric=False, methods=["rtn", "gptq", "awq"])
    mse = {row["method"]: row["mse"] for row in run(family, args, calib, held)}
    assert mse["gptq"] < mse["rtn"] and mse["awq"] < mse["rtn"], mse
