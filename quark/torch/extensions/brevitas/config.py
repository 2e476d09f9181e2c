"""Quark Quantization Config API for Brevitas: bit widths, integer or float quant types, stats or MSE parameters.

Mirrors ``quark.torch.extensions.brevitas.config`` of the reference docs (``QTensorConfig`` / ``QLayerConfig`` are
accepted as the newer names of ``QuantizationSpec`` / ``QuantizationConfig``). ``to_quark_config`` converts a Config
to this engine's Config, so it runs without Brevitas installed (ModelQuantizer, QuantCallback, the Hydra app).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from quark.torch.quantization.config import config as quark
from quark.torch.quantization.config.type import Dtype, QSchemeType, ScaleType


class _Named(Enum):
    """Enum that also takes its member name (YAML / dicts)."""

    @classmethod
    def _missing_(cls, value: Any) -> Any:
        if isinstance(value, str):
            for member in cls:
                if member.name == value.strip().lower():
                    return member
        return None

    @classmethod
    def choices(cls) -> list[str]:
        return [m.name for m in cls]


class Backend(_Named):
    """The backend target for quantization: ``layerwise`` quantizes inputs and weights of compute-heavy layers."""

    layerwise = "layerwise"


class QuantType(_Named):
    """The data type of the quantized values: integers or floating point (then exponent and mantissa widths)."""

    int_quant = "int_quant"
    float_quant = "float_quant"


class ParamType(_Named):
    """How scale and zero point are determined: statistics (min / max) or a mean-squared-error search."""

    stats = "stats"
    mse = "mse"


def _enum(owner: str, name: str, cls: type[Enum], value: Any) -> Any:
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{owner}.{name}={value!r} is not allowed; allowed: {cls.choices()}") from None  # type: ignore[attr-defined]


#: (exponent bits, mantissa bits) -> the engine's minifloat dtype
MINIFLOATS = {
    (4, 3): Dtype.fp8_e4m3,
    (5, 2): Dtype.fp8_e5m2,
    (3, 2): Dtype.fp6_e3m2,
    (2, 3): Dtype.fp6_e2m3,
    (2, 1): Dtype.fp4,
}


@dataclass(eq=True, frozen=True)
class QuantizationSpec:
    """How one tensor is quantized; the defaults (8-bit symmetric integers, per tensor, float scales from
    statistics) make ``QuantizationSpec()`` usable as it is."""

    qscheme: QSchemeType = QSchemeType.per_tensor
    symmetric: bool = True
    scale_type: ScaleType = ScaleType.float
    quant_type: QuantType = QuantType.int_quant
    param_type: ParamType = ParamType.stats
    bit_width: int = 8
    exponent_bit_width: int | None = None
    mantissa_bit_width: int | None = None

    def __post_init__(self) -> None:
        own = "QuantizationSpec"
        object.__setattr__(self, "qscheme", _enum(own, "qscheme", QSchemeType, self.qscheme))
        object.__setattr__(self, "scale_type", _enum(own, "scale_type", ScaleType, self.scale_type))
        object.__setattr__(self, "quant_type", _enum(own, "quant_type", QuantType, self.quant_type))
        object.__setattr__(self, "param_type", _enum(own, "param_type", ParamType, self.param_type))
        if self.qscheme == QSchemeType.per_group:
            raise ValueError(f"{own}.qscheme=per_group has no group size here; allowed: ['per_tensor', 'per_channel']")
        if self.scale_type not in (ScaleType.float, ScaleType.pof2):
            raise ValueError(f"{own}.scale_type={self.scale_type.name} is not allowed; allowed: ['float', 'pof2']")
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"{own}.symmetric={self.symmetric!r} must be a bool")
        if isinstance(self.bit_width, bool) or not isinstance(self.bit_width, int):
            raise ValueError(f"{own}.bit_width={self.bit_width!r} must be an int")
        if self.quant_type == QuantType.int_quant:
            if not 2 <= self.bit_width <= 16:
                raise ValueError(f"{own}.bit_width={self.bit_width} is out of range for int_quant; allowed: 2..16")
            if self.exponent_bit_width is not None or self.mantissa_bit_width is not None:
                raise ValueError(f"{own}: exponent_bit_width / mantissa_bit_width apply to quant_type=float_quant only")
        else:
            e, m = self.exponent_bit_width, self.mantissa_bit_width
            if e is None or m is None:
                raise ValueError(f"{own}: quant_type=float_quant needs exponent_bit_width and mantissa_bit_width")
            if 1 + e + m != self.bit_width:
                raise ValueError(
                    f"{own}: 1 sign + exponent_bit_width={e} + mantissa_bit_width={m} = {1 + e + m} bits, "
                    f"but bit_width={self.bit_width}"
                )
            if (e, m) not in MINIFLOATS:
                allowed = [f"e{a}m{b} ({1 + a + b} bits)" for a, b in MINIFLOATS]
                raise ValueError(f"{own}: float_quant with e{e}m{m} is not a format of this engine; allowed: {allowed}")
            if not self.symmetric:
                raise ValueError(f"{own}: float_quant is symmetric (symmetric=True)")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantizationSpec:
        return cls(**_known(cls, data))


@dataclass(eq=True)
class QuantizationConfig:
    """The specs of one layer's tensors: ``input_tensors``, ``output_tensors``, ``weight``, ``bias`` (None: float)."""

    input_tensors: QuantizationSpec | None = None
    output_tensors: QuantizationSpec | None = None
    weight: QuantizationSpec | None = None
    bias: QuantizationSpec | None = None

    def __post_init__(self) -> None:
        for role in ("input_tensors", "output_tensors", "weight", "bias"):
            value = getattr(self, role)
            if isinstance(value, dict):
                setattr(self, role, QuantizationSpec.from_dict(value))
            elif value is not None and not isinstance(value, QuantizationSpec):
                raise ValueError(f"QuantizationConfig.{role}={value!r} must be a QuantizationSpec, a dict or None")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantizationConfig:
        return cls(**_known(cls, data))


QTensorConfig = QuantizationSpec
QLayerConfig = QuantizationConfig


@dataclass(eq=True)
class Config:
    """The whole model: ``global_quant_config`` for every compute-heavy layer (Linear, Conv), optional
    pre-quantization optimisations and algorithms (this engine's SmoothQuantConfig / GPTQConfig / AWQConfig, or their
    dicts), and the ``backend``."""

    global_quant_config: QuantizationConfig
    pre_quant_opt_config: list[Any] = field(default_factory=list)
    algo_config: list[Any] = field(default_factory=list)
    backend: Backend = Backend.layerwise

    def __post_init__(self) -> None:
        if isinstance(self.global_quant_config, dict):
            self.global_quant_config = QuantizationConfig.from_dict(self.global_quant_config)
        if not isinstance(self.global_quant_config, QuantizationConfig):
            raise ValueError(
                f"Config.global_quant_config={self.global_quant_config!r} must be a QuantizationConfig or a dict"
            )
        self.backend = _enum("Config", "backend", Backend, self.backend)
        self.pre_quant_opt_config = list(self.pre_quant_opt_config or [])
        self.algo_config = list(self.algo_config or [])

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        return cls(**_known(cls, data))


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__} must be given as a dict, got {type(data).__name__}")
    allowed = [f.name for f in fields(cls)]
    unknown = [k for k in data if k not in allowed]
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {unknown}; allowed: {allowed}")
    return dict(data)


# ----------------------------------------------------------------------------------------------- the native path
def spec_to_quark(spec: QuantizationSpec, role: str) -> quark.QuantizationSpec:
    """This engine's QuantizationSpec for a Brevitas-style spec: any integer width (``int{b}`` symmetric,
    ``uint{b}`` with a zero point), the minifloat of the given exponent/mantissa widths; float or power-of-two
    scales; stats -> min-max observers, mse -> the MSE observer. Weights' channels are axis 0, activations' axis 1."""
    per_channel = spec.qscheme == QSchemeType.per_channel
    if spec.quant_type == QuantType.int_quant:
        dtype = Dtype.integer(spec.bit_width, signed=spec.symmetric)
    else:
        dtype = MINIFLOATS[(spec.exponent_bit_width, spec.mantissa_bit_width)]  # type: ignore[index]
    if spec.param_type == ParamType.mse:
        if per_channel:
            raise ValueError(
                f"{role}: param_type=mse runs per tensor in this engine; use qscheme=per_tensor or param_type=stats"
            )
        observer = "PerTensorMSEObserver"
    else:
        observer = "PerChannelMinMaxObserver" if per_channel else "PerTensorMinMaxObserver"
    data: dict[str, Any] = {
        "dtype": dtype.name,
        "qscheme": spec.qscheme.name,
        "observer_cls": observer,
        "is_dynamic": False,
    }
    if per_channel:
        data["ch_axis"] = 0 if role in ("weight", "bias") else 1
    if dtype.is_integer:
        data.update(symmetric=spec.symmetric, scale_type=spec.scale_type.name, round_method="half_even")
    elif spec.scale_type == ScaleType.pof2:
        data["scale_type"] = "pof2"
    return quark.QuantizationSpec.from_dict(data)


def to_quark_config(config: Config) -> quark.Config:
    """The engine's Config of a Brevitas-style Config (layerwise: Linear and Conv layers' roles as given)."""
    if not isinstance(config, Config):
        config = Config.from_dict(config)  # type: ignore[arg-type]
    roles = {
        role: spec_to_quark(spec, role)
        for role in ("input_tensors", "output_tensors", "weight", "bias")
        if (spec := getattr(config.global_quant_config, role)) is not None
    }
    return quark.Config(
        global_quant_config=quark.QuantizationConfig(**roles),
        algo_config=config.algo_config or None,
        pre_quant_opt_config=config.pre_quant_opt_config or None,
    )
