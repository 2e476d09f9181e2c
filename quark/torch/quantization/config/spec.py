"""The tensor level of the Quark config API: ``QuantizationSpec`` (with its QAT specs) and ``ConfigBase``.

``quark.torch.quantization.config.config`` builds QuantizationConfig and Config on it and re-exports every name here;
the spec helpers (``spec_helpers``) build QuantizationSpecs, so they depend on this module only.

Every enum-typed field also takes its string (``dtype="int8"``), ``observer_cls`` takes the class name, nested configs
take dicts, so YAML/JSON map onto the dataclasses directly; ``to_dict`` / ``from_dict`` round-trip through JSON.
Validation runs in ``__post_init__`` and raises ValueError naming the field, the value and what is allowed.
"""

from __future__ import annotations

import logging
from dataclasses import MISSING, dataclass, fields
from enum import Enum
from typing import Any, TypeVar

from quark.torch.quantization.config.type import (
    Dtype,
    QSchemeType,
    RoundType,
    ScaleType,
    TQTThresholdInitMeth,
    ZeroPointType,
)
from quark.torch.quantization.formats import (
    BLOCK_FORMATS,
    CAST_FORMATS,
    MX_ELEMENT_DTYPES,
    MX_SCALE_MODES,
    FloatFormat,
    IntFormat,
    format_of,
)
from quark.torch.quantization.observer.observer import (
    ObserverBase,
    PerBlockBFPObserver,
    PerBlockMXObserver,
    PlaceholderObserver,
)
from quark.torch.quantization.observer.registry import OBSERVER_MAP, observer_class, observer_names

logger = logging.getLogger(__name__)

__all__ = ["ConfigBase", "QATSpec", "TQTSpec", "LSQSpec", "QuantizationSpec", "coerce_enum"]

E = TypeVar("E", bound=Enum)
T = TypeVar("T", bound="ConfigBase")


# ----------------------------------------------------------------------------------------------- coercion helpers
def coerce_enum(owner: str, name: str, enum_cls: type[E], value: Any, optional: bool = True) -> E | None:
    """``value`` as a member of ``enum_cls`` (member, name or value), or a ValueError naming ``owner.name``."""
    if value is None:
        if optional:
            return None
        raise ValueError(f"{owner}.{name} is required; allowed: {enum_cls.choices()}")  # type: ignore[attr-defined]
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value)
    except ValueError:
        raise ValueError(
            f"{owner}.{name}={value!r} is not a valid {enum_cls.__name__}; allowed: {enum_cls.choices()}"  # type: ignore[attr-defined]
        ) from None


def _opt_type(owner: str, name: str, value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    """Check an optional scalar field's type (bools are not ints)."""
    if value is None:
        return None
    if isinstance(value, bool) and kind is not bool:
        raise ValueError(f"{owner}.{name}={value!r} must be {what}")
    if not isinstance(value, kind):
        raise ValueError(f"{owner}.{name}={value!r} must be {what}")
    return value


def _encode(value: Any) -> Any:
    """JSON-friendly form: enums by name, classes by name, nested configs as dicts."""
    if isinstance(value, ConfigBase):
        return value.to_dict()
    if isinstance(value, Enum):
        return value.name
    if isinstance(value, type):
        return value.__name__
    if isinstance(value, dict):
        return {(_encode(k) if isinstance(k, type) else k): _encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    return value


class ConfigBase:
    """to_dict / from_dict shared by every config dataclass."""

    def to_dict(self) -> dict[str, Any]:
        """A dict of plain JSON types that ``from_dict`` turns back into an equal object."""
        return {f.name: _encode(getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        """Build from a dict (YAML/JSON), rejecting unknown keys with the list of allowed ones."""
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__} must be given as a dict, got {type(data).__name__}: {data!r}")
        allowed = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        unknown = [k for k in data if k not in allowed]
        if unknown:
            raise ValueError(f"{cls.__name__} has no field(s) {unknown}; allowed: {allowed}")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]  # type: ignore[arg-type]
        missing = [k for k in required if k not in data]
        if missing:
            raise ValueError(f"{cls.__name__} needs field(s) {missing}; allowed: {allowed}")
        return cls(**data)


# ----------------------------------------------------------------------------------------------- QAT specs
@dataclass(eq=True)
class QATSpec(ConfigBase):
    """Base of the learnable-quantizer specs carried by ``QuantizationSpec.qat_spec``."""

    method = "qat"

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, **super().to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        """As ``ConfigBase.from_dict``, also taking the ``method`` key that ``to_dict`` writes."""
        if isinstance(data, dict) and "method" in data:
            data = dict(data)
            method = str(data.pop("method")).lower()
            if method != cls.method:
                raise ValueError(f"{cls.__name__}.method={method!r} does not match; expected {cls.method!r}")
        return super().from_dict(data)

    @staticmethod
    def coerce(owner: str, value: Any) -> QATSpec | None:
        """A QATSpec from itself, a dict with ``method`` ("tqt" / "lsq"), or the bare method name."""
        if value is None or isinstance(value, QATSpec):
            return value
        specs = {"tqt": TQTSpec, "lsq": LSQSpec}
        if isinstance(value, str):
            value = {"method": value}
        if isinstance(value, dict):
            data = dict(value)
            method = str(data.pop("method", "")).lower()
            if method not in specs:
                raise ValueError(f"{owner}.qat_spec.method={method!r} is not known; allowed: {list(specs)}")
            return specs[method].from_dict(data)
        raise ValueError(f"{owner}.qat_spec={value!r} must be a TQTSpec, an LSQSpec or a dict with 'method'")


@dataclass(eq=True)
class TQTSpec(QATSpec):
    """Trained Quantization Thresholds (Jain et al. 2019): learn log2 of a power-of-two threshold.

    ``threshold_init_meth`` initialises the threshold from the first batch; None means ``_3SD``.
    """

    threshold_init_meth: TQTThresholdInitMeth | None = None
    method = "tqt"

    def __post_init__(self) -> None:
        self.threshold_init_meth = coerce_enum(
            "TQTSpec", "threshold_init_meth", TQTThresholdInitMeth, self.threshold_init_meth
        )


@dataclass(eq=True)
class LSQSpec(QATSpec):
    """Learned Step Size Quantization (Esser et al. 2020): learn the scale, initialised to 2*mean|x|/sqrt(qmax)."""

    method = "lsq"


# ----------------------------------------------------------------------------------------------- QuantizationSpec
@dataclass(eq=True)
class QuantizationSpec(ConfigBase):
    """A data class that defines the specifications for quantizing tensors within a model.

    Args:
        dtype (Dtype): The data type for quantization (e.g., int8, int4).
        is_dynamic (Optional[bool]): Dynamic (qparams per call) or static quantization; None means static.
        observer_cls (Optional[Type[ObserverBase]]): The observer that determines the qparams (or its class name).
        qscheme (Optional[QSchemeType]): per_tensor, per_channel, per_group or per_block (2-D weights only).
        ch_axis (Optional[int]): The channel axis for per-channel and per-group quantization (unused by per_block).
        group_size (Optional[int]): The size of a group for per-group quantization (also the block of MX formats).
        block_size (Optional[List[int]]): The tile ``[rows, cols]`` of ``qscheme=per_block``: one scale per tile of
            a 2-D weight ``[out, in]`` (e.g. ``[128, 128]``, DeepSeek-V3's block-wise fp8; edge tiles may be partial);
            scales of shape ``[ceil(out / rows), ceil(in / cols)]``. Only with per_block; held as a list.
        symmetric (Optional[bool]): Symmetric around zero (required for integer dtypes).
        round_method (Optional[RoundType]): Rounding of x / scale (required for integer dtypes).
        scale_type (Optional[ScaleType]): How the scale is held (required for integer dtypes); ``float8_e8m0fnu``
            rounds it up to a power of two (UE8M0).
        mx_element_dtype (Optional[Dtype]): The element type of ``dtype=mx``.
        zero_point_type (Optional[ZeroPointType]): int32 (rounded, clamped) or float32 zero point.
        qat_spec (Optional[QATSpec]): A learnable quantizer (TQTSpec or LSQSpec) for quantization-aware training.
        scale_format (Optional[str]): How block scales are stored, as amd-quark >= 0.11 spells formats: ``"e8m0"``
            (OCP MX: a minifloat dtype with ``qscheme=per_group`` and this format is read as ``dtype=mx`` with that
            element) or ``"float32"`` (a scale in float: what scaled formats have anyway).
        scale_calculation_mode (Optional[str]): The E8M0 scale rule of OCP MX: ``"floor"`` (OCP MX v1.0),
            ``"even"`` (amd-quark's choice: the block max rounded to the element's precision first) or ``"ceil"``.
            None means ``"floor"`` for ``dtype=mx`` and ``"even"`` for the ``scale_format="e8m0"`` spelling, as each
            spelling behaves in the Quark release that has it. Accepted and unused for mx6 / mx9 / bfp16, whose
            exponent rule is fixed (amd-quark 0.13's kernels ignore it there too).
    """

    dtype: Dtype
    is_dynamic: bool | None = None
    observer_cls: type[ObserverBase] | None = None
    qscheme: QSchemeType | None = None
    ch_axis: int | None = None
    group_size: int | None = None
    block_size: list[int] | None = None
    symmetric: bool | None = None
    round_method: RoundType | None = None
    scale_type: ScaleType | None = None
    mx_element_dtype: Dtype | None = None
    zero_point_type: ZeroPointType | None = ZeroPointType.int32
    qat_spec: QATSpec | None = None
    scale_format: str | None = None
    scale_calculation_mode: str | None = None

    SCALE_FORMATS = ("e8m0", "float32")

    def __post_init__(self) -> None:
        self._coerce()
        self._check_scale_format()
        self._check_block_size()
        fmt = format_of(self.dtype)
        if self.dtype in CAST_FORMATS:
            self._check_cast()
        elif self.dtype in BLOCK_FORMATS:
            self._check_block()
        else:
            self._check_scaled(fmt)
        self._check_observer()
        self._check_qat(fmt)

    # -- helpers of __post_init__, one concern each
    def _coerce(self) -> None:
        own = "QuantizationSpec"
        self.dtype = coerce_enum(own, "dtype", Dtype, self.dtype, optional=False)  # type: ignore[assignment]
        self.qscheme = coerce_enum(own, "qscheme", QSchemeType, self.qscheme)
        self.round_method = coerce_enum(own, "round_method", RoundType, self.round_method)
        self.scale_type = coerce_enum(own, "scale_type", ScaleType, self.scale_type)
        self.mx_element_dtype = coerce_enum(own, "mx_element_dtype", Dtype, self.mx_element_dtype)
        self.zero_point_type = coerce_enum(own, "zero_point_type", ZeroPointType, self.zero_point_type)
        self.is_dynamic = _opt_type(own, "is_dynamic", self.is_dynamic, bool, "True, False or None")
        self.symmetric = _opt_type(own, "symmetric", self.symmetric, bool, "True, False or None")
        self.ch_axis = _opt_type(own, "ch_axis", self.ch_axis, int, "an int (the channel axis) or None")
        self.group_size = _opt_type(own, "group_size", self.group_size, int, "a positive int or None")
        self.observer_cls = observer_class(self.observer_cls)
        self.qat_spec = QATSpec.coerce(own, self.qat_spec)
        if self.group_size is not None and self.group_size <= 0:
            raise ValueError(f"QuantizationSpec.group_size={self.group_size} must be a positive int")
        if self.mx_element_dtype is not None and self.dtype != Dtype.mx:
            logger.warning(
                "QuantizationSpec.mx_element_dtype is only used with dtype=mx; ignored for %s", self.dtype.name
            )

    def _check_scale_format(self) -> None:
        """Validate ``scale_format`` / ``scale_calculation_mode`` and read amd-quark's MX spelling (a minifloat,
        per_group, ``scale_format="e8m0"``) as ``dtype=mx`` with that element."""
        own = f"QuantizationSpec(dtype={self.dtype.name})"
        if self.scale_format is not None:
            self.scale_format = str(self.scale_format).lower()
            if self.scale_format not in self.SCALE_FORMATS:
                raise ValueError(
                    f"{own}.scale_format={self.scale_format!r}; allowed: {list(self.SCALE_FORMATS)} or None "
                    "(amd-quark's two-level e4m3 / e5m3 scales are not supported)"
                )
        if self.scale_calculation_mode is not None:
            self.scale_calculation_mode = str(self.scale_calculation_mode).lower()
            if self.scale_calculation_mode not in MX_SCALE_MODES:
                raise ValueError(
                    f"{own}.scale_calculation_mode={self.scale_calculation_mode!r}; allowed: {list(MX_SCALE_MODES)} or None"
                )
        if self.scale_format == "e8m0" and self.dtype in MX_ELEMENT_DTYPES and self.dtype != Dtype.int8:
            if self.qscheme not in (None, QSchemeType.per_group):
                raise ValueError(f"{own}.scale_format='e8m0' (OCP MX) needs qscheme=per_group, got {self.qscheme.name}")
            self.dtype, self.mx_element_dtype = Dtype.mx, self.dtype
            self.group_size = 32 if self.group_size is None else self.group_size
            if self.scale_calculation_mode is None:
                self.scale_calculation_mode = "even"
            return
        if self.scale_format == "e8m0" and self.dtype != Dtype.mx:
            raise ValueError(
                f"{own}.scale_format='e8m0' (an OCP MX scale) needs dtype=mx, or a minifloat element "
                f"({[d.name for d in MX_ELEMENT_DTYPES if d != Dtype.int8]}) with qscheme=per_group"
            )
        if self.scale_format == "float32" and self.dtype in BLOCK_FORMATS:
            raise ValueError(
                f"{own}.scale_format='float32': a block format's scales are shared exponents; allowed: 'e8m0' or None"
            )
        if self.scale_calculation_mode is not None and self.dtype not in BLOCK_FORMATS:
            raise ValueError(
                f"{own}.scale_calculation_mode={self.scale_calculation_mode!r} applies to OCP MX scales only; "
                "leave it None for integer and minifloat scales"
            )

    def _check_block_size(self) -> None:
        """``block_size`` is the ``[rows, cols]`` tile of ``qscheme=per_block``, required there and used nowhere else."""
        own = f"QuantizationSpec(dtype={self.dtype.name})"
        size = self.block_size
        if size is not None:
            if (
                not isinstance(size, list | tuple)
                or len(size) != 2
                or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in size)
            ):
                raise ValueError(
                    f"{own}.block_size={size!r} must be a list of two positive ints [rows, cols] (e.g. [128, 128]) or None"
                )
            self.block_size = [int(b) for b in size]
        if self.qscheme != QSchemeType.per_block:
            if self.block_size is not None:
                raise ValueError(
                    f"{own}.block_size={self.block_size} is used only with qscheme=per_block (2-D tiles of a weight), got "
                    f"qscheme={_name(self.qscheme)}; set qscheme='per_block' or leave block_size None "
                    "(per_group takes group_size, the MX / MX6 / MX9 / BFP16 block too)"
                )
            return
        if self.block_size is None:
            raise ValueError(
                f"{own}.block_size is required with qscheme=per_block: a list of two positive ints [rows, cols] of the "
                "2-D weight, e.g. [128, 128]"
            )
        if not isinstance(format_of(self.dtype), IntFormat | FloatFormat):
            raise ValueError(
                f"{own}.qscheme=per_block needs an integer or minifloat dtype with a scale (e.g. fp8_e4m3, int8), "
                f"got {self.dtype.name}"
            )
        if self.group_size is not None:
            raise ValueError(
                f"{own}.group_size={self.group_size} cannot be used with qscheme=per_block, whose tile is "
                f"block_size={self.block_size}; leave group_size None"
            )
        if self.ch_axis is not None:
            logger.warning(
                "QuantizationSpec.ch_axis=%s is not used with qscheme=per_block (tiles of block_size)", self.ch_axis
            )

    @property
    def mx_scale_mode(self) -> str | None:
        """The E8M0 scale rule this spec runs with (dtype=mx), else None."""
        if self.dtype != Dtype.mx:
            return None
        return self.scale_calculation_mode or "floor"

    def _check_cast(self) -> None:
        if self.observer_cls is None:
            self.observer_cls = PlaceholderObserver
        if self.observer_cls is not PlaceholderObserver:
            raise ValueError(
                f"QuantizationSpec.observer_cls={self.observer_cls.__name__} cannot serve dtype={self.dtype.name} "
                "(a plain cast); allowed: PlaceholderObserver or None"
            )

    def _check_block(self) -> None:
        fmt = BLOCK_FORMATS[self.dtype]
        if self.qscheme not in (None, QSchemeType.per_group):
            raise ValueError(
                f"QuantizationSpec.qscheme={self.qscheme.name} cannot be used with dtype={self.dtype.name} "
                "(a block format); allowed: per_group or None"
            )
        self.qscheme = QSchemeType.per_group
        self.ch_axis = -1 if self.ch_axis is None else self.ch_axis
        self.group_size = fmt.default_block if self.group_size is None else self.group_size
        if self.dtype == Dtype.mx and self.mx_element_dtype not in MX_ELEMENT_DTYPES:
            raise ValueError(
                f"QuantizationSpec.mx_element_dtype={_name(self.mx_element_dtype)} is required with dtype=mx; "
                f"allowed: {[d.name for d in MX_ELEMENT_DTYPES]}"
            )
        if fmt.kind == "microexponent" and self.group_size % 2:
            raise ValueError(
                f"QuantizationSpec.group_size={self.group_size} must be even for dtype={self.dtype.name} "
                "(pairs share a micro-exponent)"
            )
        if self.observer_cls is None:
            self.observer_cls = PerBlockBFPObserver if fmt.kind == "bfp" else PerBlockMXObserver

    def _check_scaled(self, fmt: IntFormat | FloatFormat) -> None:
        own = f"QuantizationSpec(dtype={self.dtype.name})"
        if self.observer_cls is None:
            raise ValueError(f"{own}.observer_cls is required; allowed: {_observer_names(self.dtype, self.qscheme)}")
        if self.qscheme is None:
            raise ValueError(f"{own}.qscheme is required; allowed: {QSchemeType.choices()}")
        if isinstance(fmt, IntFormat):
            for name in ("symmetric", "round_method", "scale_type"):
                if getattr(self, name) is None:
                    allowed = {
                        "symmetric": [True, False],
                        "round_method": RoundType.choices(),
                        "scale_type": ScaleType.choices(),
                    }
                    raise ValueError(f"{own}.{name} is required for integer dtypes; allowed: {allowed[name]}")
        if self.qscheme in (QSchemeType.per_channel, QSchemeType.per_group) and self.ch_axis is None:
            raise ValueError(f"{own}.ch_axis is required with qscheme={self.qscheme.name} (an int, e.g. 0 or -1)")
        if self.qscheme == QSchemeType.per_group and self.group_size is None:
            raise ValueError(f"{own}.group_size is required with qscheme=per_group (a positive int, e.g. 32 or 128)")

    def _check_observer(self) -> None:
        obs = self.observer_cls
        if obs is None or not obs.serves(self.dtype, self.qscheme):
            raise ValueError(
                f"QuantizationSpec.observer_cls={_name(obs)} cannot serve dtype={self.dtype.name} with "
                f"qscheme={_name(self.qscheme)}; allowed: {_observer_names(self.dtype, self.qscheme)}"
            )

    def _check_qat(self, fmt: Any) -> None:
        marker = {"TQTObserver": TQTSpec, "LSQObserver": LSQSpec}.get(_name(self.observer_cls))
        if marker is not None and not isinstance(self.qat_spec, marker):
            raise ValueError(
                f"QuantizationSpec.observer_cls={_name(self.observer_cls)} needs qat_spec={marker.__name__}(...), "
                f"got {type(self.qat_spec).__name__ if self.qat_spec is not None else None}"
            )
        if self.qat_spec is None:
            return
        own = f"QuantizationSpec(dtype={self.dtype.name}).qat_spec={type(self.qat_spec).__name__}"
        if not isinstance(fmt, IntFormat):
            raise ValueError(f"{own} needs an integer dtype (int2..int16, uint2..uint16)")
        if self.qscheme not in (QSchemeType.per_tensor, QSchemeType.per_channel):
            raise ValueError(
                f"{own} needs qscheme=per_tensor or per_channel (one learned "
                f"{'threshold' if isinstance(self.qat_spec, TQTSpec) else 'scale'} per tensor or per channel), "
                f"got {_name(self.qscheme)}"
            )
        if isinstance(self.qat_spec, TQTSpec):
            if self.symmetric is False or not fmt.signed:
                raise ValueError(f"{own} needs a signed dtype with symmetric=True (TQT thresholds are symmetric)")
            if self.scale_type not in (None, ScaleType.pof2, ScaleType.float):  # TQT's scale is 2^k by construction
                raise ValueError(
                    f"{own} needs scale_type=pof2 or float (TQT learns power-of-two scales; amd-quark's examples "
                    f"write float), got {_name(self.scale_type)}"
                )

    @property
    def is_static(self) -> bool:
        """True unless the qparams are recomputed on every call."""
        return not self.is_dynamic


def _name(value: Any) -> str:
    if value is None:
        return "None"
    return value.__name__ if isinstance(value, type) else getattr(value, "name", str(value))


def _observer_names(dtype: Dtype, qscheme: QSchemeType | None) -> list[str]:
    return [n for n in observer_names() if OBSERVER_MAP[n].serves(dtype, qscheme)]
