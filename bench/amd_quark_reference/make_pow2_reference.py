"""qparams of amd-quark 0.13's power-of-two observers on seeded batches, for tests/quark/quantization/test_pow2_observers.py.

    /tmp/aqref/venv/bin/python bench/amd_quark_reference/make_pow2_reference.py   # writes reference_pow2_observers.pt

Each case feeds 4 batches (the 3rd with a wider range, so the running range changes and the most frequent pair is
not the last) to one observer built from a QTensorConfig, computing its qparams after every batch as amd-quark's
fake quantizer does, and stores the inputs and the final ``_calculate_qparams()``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE.parent.parent]  # AMD's quark, not ours
os.environ.setdefault("QUARK_LOG_LEVEL", "warning")

import torch  # noqa: E402

import quark  # noqa: E402

if "site-packages" not in (quark.__file__ or ""):
    raise SystemExit(f"Imported quark from {quark.__file__!r}; run with the amd-quark venv (see README.md)")

from quark.torch.quantization.config.config import QTensorConfig  # noqa: E402
from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType  # noqa: E402
from quark.torch.quantization.observer.observer import (  # noqa: E402
    PerChannelPowOf2MinMaxObserver,
    PerTensorPowOf2MinMaxObserver,
    PerTensorPowOf2MinMSEObserver,
)


def batches(shape: tuple[int, ...], shift: float) -> list[torch.Tensor]:
    torch.manual_seed(3)
    xs = [torch.randn(shape) * 0.7 + shift for _ in range(4)]
    xs[2] = xs[2] * 3.1
    return xs


def main() -> None:
    cases = {}
    for obs in (PerTensorPowOf2MinMaxObserver, PerTensorPowOf2MinMSEObserver, PerChannelPowOf2MinMaxObserver):
        for dtype, symmetric, shift in ((Dtype.int8, True, 0.0), (Dtype.uint8, False, 0.4), (Dtype.int8, False, -0.3)):
            per_channel = obs is PerChannelPowOf2MinMaxObserver
            spec = QTensorConfig(
                dtype=dtype,
                observer_cls=obs,
                symmetric=symmetric,
                scale_type=ScaleType.float,
                round_method=RoundType.half_even,
                is_dynamic=False,
                qscheme=QSchemeType.per_channel if per_channel else QSchemeType.per_tensor,
                ch_axis=0 if per_channel else None,
            )
            observer = obs(spec)
            xs = batches((6, 40) if per_channel else (64, 33), shift)
            for x in xs:  # as amd-quark's StaticScaledFakeQuantize: qparams recomputed after every observed tensor
                observer(x)
                scale, zp = observer._calculate_qparams()
            cases[f"{obs.__name__}-{dtype.name}-{'sym' if symmetric else 'asym'}"] = {
                "inputs": xs,
                "scale": scale.detach().float().reshape(-1),
                "zero_point": zp.detach().to(torch.int32).reshape(-1),
            }
    torch.save(cases, HERE / "reference_pow2_observers.pt")
    for name, case in cases.items():
        print(name, case["scale"][:3].tolist(), case["zero_point"][:3].tolist())


if __name__ == "__main__":
    main()
