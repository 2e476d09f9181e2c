"""OCP MX E8M0 scale rules side by side: ``scale_calculation_mode`` floor (OCP MX v1.0), even (amd-quark's default) and
ceil, for every MX element type.

Two measurements, both seeded:
1. relative RMS error of fake-quantizing a 4096 x 4096 tensor, blocks of 32 along the last axis, for Gaussian values
   and heavy-tailed ones (Student-t with 3 degrees of freedom);
2. a small MLP (512 -> 2048 -> 512, GELU) with MX weights and activations, built from amd-quark's spec helpers
   (``OCP_MXFP4Spec(ch_axis=-1, scale_calculation_mode=...)``): relative RMS error of its output against float.

    .venv/bin/python -m bench.mx_scale_modes
"""

from __future__ import annotations

import time

import torch
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import (
    OCP_MXFP4Spec,
    OCP_MXFP6E2M3Spec,
    OCP_MXFP6E3M2Spec,
    OCP_MXFP8E4M3Spec,
    OCP_MXINT8Spec,
    QConfig,
    QLayerConfig,
)
from quark.torch.quantization.config.type import Dtype
from quark.torch.quantization.formats import MX_SCALE_MODES, fake_quantize_mx

ELEMENTS = {
    Dtype.fp4: OCP_MXFP4Spec,
    Dtype.fp6_e2m3: OCP_MXFP6E2M3Spec,
    Dtype.fp6_e3m2: OCP_MXFP6E3M2Spec,
    Dtype.fp8_e4m3: OCP_MXFP8E4M3Spec,
    Dtype.int8: OCP_MXINT8Spec,
}


def rel_rms(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    gauss = torch.randn(4096, 4096, generator=gen)
    t3 = torch.distributions.StudentT(3.0).sample((4096, 4096))
    return {"gaussian": gauss, "student-t(3)": t3}


def mlp_error(spec_cls: type, mode: str) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
    x = torch.randn(256, 512)
    with torch.no_grad():
        ref = model(x)
    spec = spec_cls(ch_axis=-1, scale_calculation_mode=mode).to_quantization_spec()
    config = QConfig(global_quant_config=QLayerConfig(weight=spec, input_tensors=spec))
    quantized = ModelQuantizer(config).quantize_model(model, [x])
    with torch.no_grad():
        return rel_rms(quantized(x), ref)


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    data = tensors()
    print("| element | data | " + " | ".join(MX_SCALE_MODES) + " | even vs floor |")
    print("|---|---|" + "---|" * (len(MX_SCALE_MODES) + 1))
    for element, spec_cls in ELEMENTS.items():
        rows = {
            name: {m: rel_rms(fake_quantize_mx(x, element, 32, -1, m), x) for m in MX_SCALE_MODES}
            for name, x in data.items()
        }
        rows["MLP output (W+A)"] = {m: mlp_error(spec_cls, m) for m in MX_SCALE_MODES}
        for name, errs in rows.items():
            cells = " | ".join(f"{errs[m]:.4f}" for m in MX_SCALE_MODES)
            print(f"| {element.name} | {name} | {cells} | {errs['even'] / errs['floor']:.2f}x |")
    print(f"(relative RMS error; {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
