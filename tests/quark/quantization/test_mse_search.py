"""The MSE observer's candidate search against a brute-force reference (one candidate at a time, through torch's own
fake-quant kernels), and small-model calibration that never reaches a compiled format kernel."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from specs import int_spec

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.config.type import Dtype
from quark.torch.quantization.formats import grouping
from quark.torch.quantization.observer.observer import PerTensorMSEObserver

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "amd_quark_reference"))
from load import CONFIG_NAMES, load_reference  # noqa: E402
from reference_recipes import CONFIGS, SmallCNN  # noqa: E402


def _reference_best(
    hist: torch.Tensor, edges: torch.Tensor, idx: list[int], dtype: Dtype, symmetric: bool
) -> tuple[float, float]:
    """(min, max) of the candidate with the least count-weighted squared error of the bin centres, one candidate at a
    time: torch.fake_quantize_per_tensor_affine for integers, a cast through float8_e4m3fn for fp8."""
    e = edges.double()
    centers = ((e[1:] + e[:-1]) / 2).float()
    n = hist.numel()
    best: tuple[float, float, float] | None = None
    for i in idx:
        if symmetric:
            lo, hi = 0.0, float(torch.tensor(float(e[i + 1])).float())
        else:
            nz = torch.nonzero(hist).flatten()
            frac = (i + 1) / n
            lo = float(torch.tensor(float(e[nz[0]]) * frac).float().clamp(max=0))
            hi = float(torch.tensor(float(e[nz[-1] + 1]) * frac).float().clamp(min=0))
        if dtype == Dtype.fp8_e4m3:
            scale = torch.tensor(hi, dtype=torch.float32) / 448
            q = (centers / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        elif symmetric:
            scale = torch.tensor(hi, dtype=torch.float32) / 127.5
            q = torch.fake_quantize_per_tensor_affine(centers, float(scale), 0, -128, 127)
        else:
            scale = (torch.tensor(hi, dtype=torch.float32) - torch.tensor(lo, dtype=torch.float32)) / 255
            zp = int(torch.clamp(-torch.round(torch.tensor(lo, dtype=torch.float32) / scale), 0, 255))
            q = torch.fake_quantize_per_tensor_affine(centers, float(scale), zp, 0, 255)
        err = float((((q.double() - centers.double()) ** 2) * hist.double()).sum())
        if best is None or err < best[0]:
            best = (err, lo, hi)
    assert best is not None
    return best[1], best[2]


@pytest.mark.parametrize(
    ("dtype", "symmetric"), [(Dtype.int8, True), (Dtype.uint8, False), (Dtype.fp8_e4m3, True)], ids=str
)
@pytest.mark.parametrize("seed", [0, 1])
def test_mse_search_picks_the_brute_force_minimum(dtype: Dtype, symmetric: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    obs = PerTensorMSEObserver(int_spec(dtype=dtype, symmetric=symmetric, observer_cls=PerTensorMSEObserver))
    with torch.random.fork_rng():  # StudentT samples from the global generator: seeded here, restored after
        torch.manual_seed(seed)
        x = torch.distributions.StudentT(2.5).sample((20_000,)) if seed else torch.randn(20_000, generator=g)
    obs(x + (0.0 if symmetric else 0.7))
    hist, edges = obs.histogram()
    stride = 4
    idx = list(range(0, hist.numel(), stride)) + [hist.numel() - 1]
    mn, mx = obs.get_min_max_by_mse(hist, edges, stride=stride, start_bin=0)
    ref_mn, ref_mx = _reference_best(hist, edges, idx, dtype, symmetric)
    assert (float(mn), float(mx)) == (ref_mn, ref_mx)
    if seed and dtype != Dtype.fp8_e4m3:  # heavy tails: the best integer range clips (not trivially min-max)
        assert float(mx) < float(edges[-1]) * 0.9


def _spy_compiled(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of the tensors for which a compilable format kernel would run compiled (auto mode, nothing failed)."""
    monkeypatch.setattr(grouping.Backend, "compile", None)
    monkeypatch.setattr(grouping.Backend, "failure", None)
    compiled: list[int] = []
    decide = grouping.compiled_kernels_active

    def spy(x: torch.Tensor, min_numel: int | None = None, count: bool = True, gain: int = 1) -> bool:
        active = decide(x, min_numel, count, gain)
        if active:
            compiled.append(x.numel())
        return active

    monkeypatch.setattr(grouping, "compiled_kernels_active", spy)
    return compiled


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_small_model_calibration_runs_no_compiled_kernel(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """amd-quark's small recipes: no tensor reaches the compile threshold, so the first calibration in a process
    compiles nothing (the MSE observer's K x 2048 candidate grid used to, for seconds)."""
    compiled = _spy_compiled(monkeypatch)
    ref: dict[str, Any] = load_reference(name)
    model = SmallCNN()
    model.load_state_dict(ref["model_state"])
    ModelQuantizer(Config.from_dict(CONFIGS[name])).quantize_model(model, ref["calib_batches"])
    assert compiled == []


def test_mse_search_stays_eager_past_the_compile_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = _spy_compiled(monkeypatch)
    obs = PerTensorMSEObserver(int_spec(observer_cls=PerTensorMSEObserver))
    obs(torch.randn(1000, generator=torch.Generator().manual_seed(3)))
    obs.calculate_qparams()  # 65 candidates x 2048 bins, twice: past Backend.min_numel
    assert compiled == []
