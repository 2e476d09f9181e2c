"""Produce reference quantization parameters with the public ``amd-quark`` 0.13 package.

Run with the *amd-quark* virtual environment's interpreter (NOT the project venv, whose
``quark`` package is our own re-implementation and shadows AMD's):

    /tmp/aqref/venv/bin/python bench/amd_quark_reference/make_reference.py

Writes ``reference_common.pt`` (float model state, calibration/eval batches, float output) and one
``reference_<config>.pt`` per configuration (qparams + quantized output) next to this file.  Pass config
names (and/or ``common``) as arguments to regenerate only those.  See README.md in this folder.
"""

from __future__ import annotations

import copy
import hashlib
import io
import os
import sys
import traceback
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent

# Make sure we import AMD's `quark` from site-packages, never the project's own `quark/`.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO_ROOT]

# Quark logs every config at INFO level; keep the output readable (set QUARK_LOG_LEVEL=info to see it).
os.environ.setdefault("QUARK_LOG_LEVEL", "warning")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import quark  # noqa: E402

if "site-packages" not in (quark.__file__ or ""):
    raise SystemExit(
        f"Imported quark from {quark.__file__!r}; this script must run with the amd-quark venv "
        "(e.g. /tmp/aqref/venv/bin/python) so that AMD's package is used."
    )

from reference_recipes import SmallCNN  # noqa: E402 - torch only, beside this script (kept on sys.path above)

from quark.torch import ModelQuantizer  # noqa: E402
from quark.torch.quantization.config.config import QConfig, QLayerConfig, QTensorConfig  # noqa: E402
from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType  # noqa: E402
from quark.torch.quantization.observer.observer import (  # noqa: E402
    PerChannelMinMaxObserver,
    PerGroupMinMaxObserver,
    PerTensorMinMaxObserver,
    PerTensorMSEObserver,
    PerTensorPercentileObserver,
)

try:
    from importlib.metadata import version as _pkg_version

    AMD_QUARK_VERSION = _pkg_version("amd-quark")
except Exception:  # pragma: no cover
    AMD_QUARK_VERSION = "unknown"


# --------------------------------------------------------------------------------------
# Model and data (the model is reference_recipes.SmallCNN, torch only, beside this script)
# --------------------------------------------------------------------------------------
def make_model() -> SmallCNN:
    torch.manual_seed(0)
    return SmallCNN().eval()


def make_calib_batches() -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(16, 1, 8, 8) for _ in range(4)]


def make_eval_batch() -> torch.Tensor:
    torch.manual_seed(2)
    return torch.randn(16, 1, 8, 8)


# --------------------------------------------------------------------------------------
# Quark 0.13 tensor specs
# --------------------------------------------------------------------------------------
def w_int8_per_channel() -> QTensorConfig:
    return QTensorConfig(
        dtype=Dtype.int8,
        qscheme=QSchemeType.per_channel,
        ch_axis=0,
        observer_cls=PerChannelMinMaxObserver,
        symmetric=True,
        scale_type=ScaleType.float,
        round_method=RoundType.half_even,
        is_dynamic=False,
    )


def a_per_tensor(dtype: Dtype, symmetric: bool, observer_cls: type) -> QTensorConfig:
    return QTensorConfig(
        dtype=dtype,
        qscheme=QSchemeType.per_tensor,
        observer_cls=observer_cls,
        symmetric=symmetric,
        scale_type=ScaleType.float,
        round_method=RoundType.half_even,
        is_dynamic=False,
    )


def w_int4_per_group() -> QTensorConfig:
    return QTensorConfig(
        dtype=Dtype.int4,
        qscheme=QSchemeType.per_group,
        ch_axis=1,
        group_size=8,
        observer_cls=PerGroupMinMaxObserver,
        symmetric=True,
        scale_type=ScaleType.float,
        round_method=RoundType.half_even,
        is_dynamic=False,
    )


def fp8_per_tensor() -> QTensorConfig:
    return QTensorConfig(
        dtype=Dtype.fp8_e4m3,
        qscheme=QSchemeType.per_tensor,
        observer_cls=PerTensorMinMaxObserver,
        is_dynamic=False,
    )


def config_w8a8() -> tuple[QConfig, str]:
    cfg = QConfig(
        global_quant_config=QLayerConfig(
            weight=w_int8_per_channel(),
            input_tensors=a_per_tensor(Dtype.int8, True, PerTensorMinMaxObserver),
        )
    )
    desc = (
        "W8A8: weight int8 per_channel ch_axis=0 symmetric PerChannelMinMaxObserver scale_type=float "
        "round=half_even static; input_tensors int8 per_tensor symmetric PerTensorMinMaxObserver static. "
        "Applied to all Conv2d/Linear via global_quant_config. No output/bias quantization."
    )
    return cfg, desc


def config_w8a8_uint8_asym() -> tuple[QConfig, str]:
    cfg = QConfig(
        global_quant_config=QLayerConfig(
            weight=w_int8_per_channel(),
            input_tensors=a_per_tensor(Dtype.uint8, False, PerTensorMinMaxObserver),
        )
    )
    desc = (
        "W8A8 uint8-asym activations: weight int8 per_channel ch_axis=0 symmetric PerChannelMinMaxObserver; "
        "input_tensors uint8 per_tensor asymmetric PerTensorMinMaxObserver static (zero_point_type int32 default)."
    )
    return cfg, desc


def config_w4_per_group_global() -> tuple[QConfig, str]:
    cfg = QConfig(global_quant_config=QLayerConfig(weight=w_int4_per_group()))
    desc = (
        "Weight-only int4 per_group ch_axis=1 group_size=8 symmetric PerGroupMinMaxObserver scale_type=float "
        "round=half_even, applied globally (all Conv2d and Linear)."
    )
    return cfg, desc


def config_w4_per_group_linear_only() -> tuple[QConfig, str]:
    cfg = QConfig(
        global_quant_config=QLayerConfig(weight=w_int8_per_channel()),
        layer_type_quant_config={nn.Linear: QLayerConfig(weight=w_int4_per_group())},
    )
    desc = (
        "Weight-only: Linear layers (fc1, fc2) int4 per_group ch_axis=1 group_size=8 symmetric "
        "PerGroupMinMaxObserver (via layer_type_quant_config[nn.Linear]); Conv2d layers (conv1, conv2) "
        "int8 per_channel ch_axis=0 symmetric PerChannelMinMaxObserver (global_quant_config). "
        "Used because the global per-group config is rejected for conv1 (in_channels=1 not divisible by 8)."
    )
    return cfg, desc


def config_fp8() -> tuple[QConfig, str]:
    cfg = QConfig(global_quant_config=QLayerConfig(weight=fp8_per_tensor(), input_tensors=fp8_per_tensor()))
    desc = (
        "FP8: weight fp8_e4m3 per_tensor PerTensorMinMaxObserver static; input_tensors fp8_e4m3 per_tensor "
        "PerTensorMinMaxObserver static. scale = amax/448 (scale_type unset -> observer scale dtype None)."
    )
    return cfg, desc


def config_percentile() -> tuple[QConfig, str]:
    cfg = QConfig(
        global_quant_config=QLayerConfig(
            weight=w_int8_per_channel(),
            input_tensors=a_per_tensor(Dtype.int8, True, PerTensorPercentileObserver),
        )
    )
    desc = (
        "Percentile: weight int8 per_channel ch_axis=0 symmetric PerChannelMinMaxObserver; input_tensors int8 "
        "per_tensor symmetric PerTensorPercentileObserver static (Quark defaults: 4200-bin histogram of |x|, "
        "zeros skipped, percentile=99.99999999, min fixed at 0)."
    )
    return cfg, desc


def config_mse() -> tuple[QConfig, str]:
    cfg = QConfig(
        global_quant_config=QLayerConfig(
            weight=w_int8_per_channel(),
            input_tensors=a_per_tensor(Dtype.int8, True, PerTensorMSEObserver),
        )
    )
    desc = (
        "MSE: weight int8 per_channel ch_axis=0 symmetric PerChannelMinMaxObserver; input_tensors int8 "
        "per_tensor symmetric PerTensorMSEObserver static (Quark defaults: 2048-bin histogram of |x|, zeros "
        "kept, amax searched over bin centers from index 2045 upward, min fixed at 0)."
    )
    return cfg, desc


# name -> factory. The int4 per-group case is resolved at run time (global first, fallback second).
CONFIGS = {
    "w8a8": config_w8a8,
    "w8a8_uint8_asym": config_w8a8_uint8_asym,
    "w4_per_group": None,  # special-cased below
    "fp8_e4m3": config_fp8,
    "a8_percentile": config_percentile,
    "a8_mse": config_mse,
}


# --------------------------------------------------------------------------------------
# Running and extracting
# --------------------------------------------------------------------------------------
COMMON_FILE = "reference_common.pt"

ROLES = {
    "input": "_input_quantizer",
    "weight": "_weight_quantizer",
    "output": "_output_quantizer",
    "bias": "_bias_quantizer",
}


def extract_qparams(qmodel: nn.Module) -> tuple[dict, dict, dict]:
    """Return (qparams, quantizer_classes, observer_state) for every quantized (QuantMixin) module.

    qparams: {layer: {role: {"scale": tensor, "zero_point": tensor}}} read from the quantizer
    buffers ``module._{input,weight,output,bias}_quantizer.scale / .zero_point``.
    observer_state: small per-(layer, role) extras for activation quantizers only (weights' ranges are
    derivable from model_state): observer min_val/max_val as Python floats and, for histogram
    observers, the histogram geometry.
    """
    qparams: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    info: dict[str, dict[str, str]] = {}
    obs_state: dict[str, dict[str, dict]] = {}
    for name, mod in qmodel.named_modules():
        # Quark 0.13 swaps nn.Conv2d/nn.Linear for QuantConv2d/QuantLinear (QuantMixin subclasses) that hold
        # the four quantizer attributes below (None when the role is not quantized).
        if not all(hasattr(mod, attr) for attr in ROLES.values()):
            continue
        layer: dict[str, dict[str, torch.Tensor]] = {}
        layer_info: dict[str, str] = {"module_class": type(mod).__name__}
        layer_obs: dict[str, dict] = {}
        for role, attr in ROLES.items():
            q = getattr(mod, attr, None)
            if q is None:
                continue
            layer[role] = {
                buf: getattr(q, buf).detach().clone().cpu()
                for buf in ("scale", "zero_point")
                if isinstance(getattr(q, buf, None), torch.Tensor)
            }
            obs = getattr(q, "observer", None)
            layer_info[role] = f"{type(q).__name__}[{type(obs).__name__ if obs is not None else None}]"
            if obs is not None and role in ("input", "output"):
                st: dict = {}
                for buf in ("min_val", "max_val"):
                    t = getattr(obs, buf, None)
                    if isinstance(t, torch.Tensor) and t.numel() == 1:
                        st[buf] = float(t.item())
                edges = getattr(obs, "calib_bin_edges", None)
                hist = getattr(obs, "calib_hist", None)
                if isinstance(edges, torch.Tensor) and edges.numel() > 0:
                    st["hist_num_bins_attr"] = int(obs._num_bins)
                    st["hist_len"] = int(hist.numel())
                    st["hist_total"] = float(hist.sum().item())
                    st["edges_len"] = int(edges.numel())
                    st["edges_first"] = float(edges[0].item())
                    st["edges_last"] = float(edges[-1].item())
                    st["skip_zeros"] = bool(obs._skip_zeros)
                    if hasattr(obs, "percentile"):
                        st["percentile"] = float(obs.percentile)
                layer_obs[role] = st
        qparams[name] = layer
        info[name] = layer_info
        if layer_obs:
            obs_state[name] = layer_obs
    return qparams, info, obs_state


def save_deflated(obj, path: Path) -> None:
    """torch.save, then re-pack the zip archive with DEFLATE compression.

    torch.load reads DEFLATE-compressed archive members (only ``mmap=True`` needs stored members), and this
    keeps the committed files small (random float32 data still compresses by ~10%, zero tensors and the
    pickled text much more).
    """
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    with zipfile.ZipFile(buf) as zin, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for item in zin.infolist():
            # Fixed timestamp so that re-running produces byte-identical files.
            info = zipfile.ZipInfo(item.filename, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(info, zin.read(item.filename), compresslevel=9)
    check = torch.load(path, weights_only=True)  # must load with the safe default
    assert set(check) == set(obj)


def sha256_of(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def common_payload(model_state, calib, eval_batch) -> dict:
    model = make_model()
    model.load_state_dict(model_state)
    with torch.no_grad():
        float_output = model(eval_batch).detach().clone()
    return {
        "amd_quark_version": AMD_QUARK_VERSION,
        "torch_version": str(torch.__version__),
        "model_description": (
            "SmallCNN (torch.manual_seed(0) init): conv1=Conv2d(1,8,3,padding=1) -> relu -> "
            "conv2=Conv2d(8,16,3,padding=1) -> relu -> flatten(1) -> fc1=Linear(1024,32) -> relu -> fc2=Linear(32,10)"
        ),
        "model_state": {k: v.detach().clone() for k, v in model_state.items()},
        "calib_batches": [b.clone() for b in calib],  # torch.manual_seed(1); 4 x torch.randn(16,1,8,8)
        "eval_batch": eval_batch.clone(),  # torch.manual_seed(2); torch.randn(16,1,8,8)
        "float_output": float_output,
        "sha256_model_state": sha256_of(model_state.values()),
        "sha256_calib_batches": sha256_of(calib),
        "sha256_eval_batch": sha256_of([eval_batch]),
    }


def run_config(name: str, cfg: QConfig, desc: str, model_state, calib, eval_batch, notes: list[str]) -> Path:
    model = make_model()
    model.load_state_dict(model_state)
    qmodel = ModelQuantizer(cfg).quantize_model(copy.deepcopy(model), calib)
    qmodel.eval()
    qparams, info, obs_state = extract_qparams(qmodel)
    with torch.no_grad():
        output = qmodel(eval_batch).detach().clone()
    out = {
        "amd_quark_version": AMD_QUARK_VERSION,
        "torch_version": str(torch.__version__),
        "config_name": name,
        "config_description": desc,
        "config_str": str(cfg),
        "notes": list(notes),
        # model_state / calib_batches / eval_batch live once in reference_common.pt (size budget);
        # load.py:load_reference() merges them back in.  These hashes tie the two files together.
        "common_file": COMMON_FILE,
        "sha256_model_state": sha256_of(model_state.values()),
        "sha256_calib_batches": sha256_of(calib),
        "sha256_eval_batch": sha256_of([eval_batch]),
        "qparams": qparams,
        "quantizer_classes": info,
        "observer_state": obs_state,
        "output": output,
    }
    path = HERE / f"reference_{name}.pt"
    save_deflated(out, path)
    print(f"[make_reference] wrote {path.name} ({path.stat().st_size} bytes)")
    for lname, roles in qparams.items():
        for role, e in roles.items():
            s = e.get("scale")
            z = e.get("zero_point")
            print(
                f"    {lname:6s} {role:6s} scale{tuple(s.shape)} {s.dtype} "
                f"zp{tuple(z.shape) if z is not None else None} {z.dtype if z is not None else None}"
                + (f" scale={s.item():.8g} zp={z.item()}" if s.numel() == 1 else "")
            )
    return path


def main() -> None:
    only = set(sys.argv[1:])
    model_state = {k: v.detach().clone() for k, v in make_model().state_dict().items()}
    calib = make_calib_batches()
    eval_batch = make_eval_batch()

    if not only or "common" in only:
        save_deflated(common_payload(model_state, calib, eval_batch), HERE / COMMON_FILE)
        print(f"[make_reference] wrote {COMMON_FILE} ({(HERE / COMMON_FILE).stat().st_size} bytes)")

    for name, factory in CONFIGS.items():
        if only and name not in only:
            continue
        notes: list[str] = []
        if name == "w4_per_group":
            cfg, desc = config_w4_per_group_global()
            try:
                run_config(name, cfg, desc, model_state, calib, eval_batch, notes)
                continue
            except Exception as exc:  # amd-quark rejects per-group along axis 1 for conv1 ([8,1,3,3])
                msg = (
                    f"global int4 per_group(ch_axis=1, group_size=8) rejected by amd-quark: {type(exc).__name__}: {exc}"
                )
                print("[make_reference] " + msg)
                traceback.print_exc(limit=2)
                notes.append(msg)
                cfg, desc = config_w4_per_group_linear_only()
        else:
            cfg, desc = factory()
        run_config(name, cfg, desc, model_state, calib, eval_batch, notes)


if __name__ == "__main__":
    main()
