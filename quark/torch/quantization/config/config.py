"""Quark Quantization Config API for PyTorch: Config > QuantizationConfig > QuantizationSpec, plus algorithm configs.

Every enum-typed field also takes its string (``dtype="int8"``), ``observer_cls`` takes the class name, nested configs
take dicts, so YAML/JSON map onto the dataclasses directly; ``to_dict`` / ``from_dict`` round-trip through JSON.
Validation runs in ``__post_init__`` and raises ValueError naming the field, the value and what is allowed.
The tensor level (QuantizationSpec, ConfigBase) lives in ``spec``, amd-quark's spec helpers (``Int8PerTensorSpec``, ...)
in ``spec_helpers``; both are re-exported here, where amd-quark has them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from quark.torch.quantization.algo_registry import algorithm_stage, register_algorithm, registered_algorithms
from quark.torch.quantization.config import spec_helpers
from quark.torch.quantization.config.algo_base import AlgoConfig
from quark.torch.quantization.config.attention_fields import (
    check_kv_cache_group,
    check_kv_spec,
    check_min_kv_scale,
    check_softmax_spec,
)
from quark.torch.quantization.config.rotation_fields import OnlineRotationConfig, RotationConfig
from quark.torch.quantization.config.spec import (
    ConfigBase,
    LSQSpec,
    QATSpec,
    QuantizationSpec,
    TQTSpec,
    coerce_enum,
)
from quark.torch.quantization.config.spec_helpers import *  # noqa: F403  (amd-quark's spec helpers, generated names)
from quark.torch.quantization.config.type import DeviceType, QSchemeType, QuantizationMode

__all__ = [
    "ConfigBase",
    "QATSpec",
    "TQTSpec",
    "LSQSpec",
    "QuantizationSpec",
    "QuantizationConfig",
    "AlgoConfig",
    "PreQuantOptConfig",
    "GPTQConfig",
    "AWQConfig",
    "SmoothQuantConfig",
    "CLEConfig",
    "RotationConfig",
    "OnlineRotationConfig",
    "Config",
]


def _spec(owner: str, value: Any) -> QuantizationSpec | None:
    if value is None or isinstance(value, QuantizationSpec):
        return value
    if isinstance(value, dict):
        try:
            return QuantizationSpec.from_dict(value)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{owner}: {err}") from None
    raise ValueError(f"{owner}={value!r} must be a QuantizationSpec, a dict or None")


# ----------------------------------------------------------------------------------------------- QuantizationConfig
@dataclass(eq=True)
class QuantizationConfig(ConfigBase):
    """The specs of one module's tensors; a role left None falls back to the next level of the hierarchy.

    Args:
        input_tensors (Optional[QuantizationSpec]): Input tensors quantization specification.
        output_tensors (Optional[QuantizationSpec]): Output tensors quantization specification.
        weight (Optional[QuantizationSpec]): The weights tensors quantization specification.
        bias (Optional[QuantizationSpec]): The bias tensors quantization specification.
        target_device (Optional[DeviceType]): The target device of the quantized model.
    """

    input_tensors: QuantizationSpec | None = None
    output_tensors: QuantizationSpec | None = None
    weight: QuantizationSpec | None = None
    bias: QuantizationSpec | None = None
    target_device: DeviceType | None = None

    ROLES = ("input_tensors", "output_tensors", "weight", "bias")

    def __post_init__(self) -> None:
        for role in self.ROLES:
            setattr(self, role, _spec(f"QuantizationConfig.{role}", getattr(self, role)))
            spec = getattr(self, role)
            if role != "weight" and spec is not None and spec.qscheme == QSchemeType.per_block:
                raise ValueError(
                    f"QuantizationConfig.{role}: qscheme=per_block (block_size={spec.block_size}) quantizes 2-D "
                    "weights in tiles; allowed for weight only (per_tensor, per_channel or per_group elsewhere)"
                )
        self.target_device = coerce_enum("QuantizationConfig", "target_device", DeviceType, self.target_device)


def _qconfig(owner: str, value: Any) -> QuantizationConfig:
    if isinstance(value, QuantizationConfig):
        return value
    if isinstance(value, dict):
        try:
            return QuantizationConfig.from_dict(value)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{owner}: {err}") from None
    raise ValueError(f"{owner}={value!r} must be a QuantizationConfig or a dict")


# ----------------------------------------------------------------------------------------------- algorithm configs
@dataclass(eq=True)
class PreQuantOptConfig(AlgoConfig):
    """Base of the pre-quantization optimisations (SmoothQuant)."""


def _check_positive_int(owner: str, name: str, value: Any, allow_minus_one: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (value <= 0 and not (allow_minus_one and value == -1)):
        extra = " or -1 (the whole row)" if allow_minus_one else ""
        raise ValueError(f"{owner}.{name}={value!r} must be a positive int{extra}")


def _check_str_list(owner: str, name: str, value: Any) -> None:
    if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ValueError(f"{owner}.{name}={value!r} must be a list of module names or None")


def _check_scaling_layers(owner: str, value: Any) -> None:
    if value is None:
        return
    keys = {"prev_op", "layers", "inp", "module2inspect", "help"}  # "help": Quark's documented comment key, unused
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ValueError(f"{owner}.scaling_layers must be a list of dicts with keys {sorted(keys)}, got {value!r}")
    for i, entry in enumerate(value):
        unknown = set(entry) - keys
        if unknown:
            raise ValueError(
                f"{owner}.scaling_layers[{i}] has unknown key(s) {sorted(unknown)}; allowed: {sorted(keys)}"
            )
        if "prev_op" not in entry or "layers" not in entry:
            raise ValueError(f"{owner}.scaling_layers[{i}] needs 'prev_op' and 'layers', got {entry!r}")


@dataclass(eq=True)
class SmoothQuantConfig(PreQuantOptConfig):
    """SmoothQuant: migrate activation outliers into the weights with s_j = max|X_j|^alpha / max|W_j|^(1-alpha)."""

    name: str = "smoothquant"
    alpha: float = 1
    scale_clamp_min: float = 1e-3
    scaling_layers: list[dict[str, Any]] | None = None
    model_decoder_layers: str | None = None
    embedding_layers: list[str] | None = None

    def __post_init__(self) -> None:
        own = "SmoothQuantConfig"
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or not 0 <= self.alpha <= 1:
            raise ValueError(f"{own}.alpha={self.alpha!r} must be a number in [0, 1]")
        if (
            isinstance(self.scale_clamp_min, bool)
            or not isinstance(self.scale_clamp_min, int | float)
            or self.scale_clamp_min <= 0
        ):
            raise ValueError(f"{own}.scale_clamp_min={self.scale_clamp_min!r} must be a positive number")
        _check_scaling_layers(own, self.scaling_layers)
        _check_str_list(own, "embedding_layers", self.embedding_layers)


@dataclass(eq=True)
class AWQConfig(AlgoConfig):
    """Activation-aware Weight Quantization; bit width, symmetry and group size come from the weight spec."""

    name: str = "awq"
    bit: int = 4
    sym: bool = False
    group_size: int = 128
    algo_processor: Any = None
    scaling_layers: list[dict[str, Any]] | None = None
    model_decoder_layers: str | None = None
    embedding_layers: list[str] | None = None

    def __post_init__(self) -> None:
        own = "AWQConfig"
        _check_positive_int(own, "bit", self.bit)
        _check_positive_int(own, "group_size", self.group_size, allow_minus_one=True)
        _check_scaling_layers(own, self.scaling_layers)
        _check_str_list(own, "embedding_layers", self.embedding_layers)
        if isinstance(self.algo_processor, type):
            self.algo_processor = self.algo_processor.__name__


@dataclass(eq=True)
class GPTQConfig(AlgoConfig):
    """GPTQ (Frantar et al. 2022): second-order weight rounding, layer by layer; bit/sym/group_size from the weight spec.
    ``block_size``: columns per lazy batch update (the paper's B; amd-quark's default 128).

    Fused MoE experts get GPTQ per expert and projection, with the Hessian of the tokens routed to that expert. A
    projection whose expert received fewer than ``MIN_EXPERT_TOKENS_PER_FEATURE`` times its input features
    calibration tokens (at least one) keeps round-to-nearest and is named in a warning: its Hessian is singular, and
    GPTQ from it can be worse than RTN on other data. Measured (``bench/moe_gptq_tokens.py``, trained tiny Mixtral /
    Qwen2-MoE / Qwen3-MoE, held-out output error per projection): from 0.3 x the input features the median projection
    has 0.03 to 0.06 of RTN's error but the worst up to 1.1x; from 1 x, the worst 0.08 to 0.25x. A class constant,
    not a field (amd-quark's GPTQConfig has none): set it on the class or on one instance."""

    #: a fused-MoE expert's projection with fewer routed calibration tokens than this times its input features: RTN
    MIN_EXPERT_TOKENS_PER_FEATURE: ClassVar[float] = 1.0

    name: str = "gptq"
    bit: int = 4
    sym: bool = False
    group_size: int = 128
    damp_percent: float = 0.01
    desc_act: bool = True
    static_groups: bool = False
    true_sequential: bool = True
    inside_layer_modules: list[str] | None = None
    model_decoder_layers: str | None = None
    embedding_layers: list[str] | None = None
    block_size: int = 128

    def __post_init__(self) -> None:
        own = "GPTQConfig"
        _check_positive_int(own, "bit", self.bit)
        _check_positive_int(own, "group_size", self.group_size, allow_minus_one=True)
        _check_positive_int(own, "block_size", self.block_size)
        if (
            isinstance(self.damp_percent, bool)
            or not isinstance(self.damp_percent, int | float)
            or not 0 < self.damp_percent <= 1
        ):
            raise ValueError(f"{own}.damp_percent={self.damp_percent!r} must be a number in (0, 1]")
        _check_str_list(own, "inside_layer_modules", self.inside_layer_modules)
        _check_str_list(own, "embedding_layers", self.embedding_layers)


@dataclass(eq=True)
class CLEConfig(PreQuantOptConfig):
    """Cross-layer equalization (Nagel et al. 2019) of conv/linear -> ReLU -> conv/linear chains (zero pads between
    looked through), depthwise included, on the BatchNorm-folded graph (``quant_mode=fx_graph_mode``): rescales
    output channel i of the first layer by 1/s_i and input channel i of the second by s_i so both have equal ranges;
    the float function is unchanged (checked on the captured batch). Pairs with ReLU6 between are left alone, the
    activation between a pair keeps its range, and CLE is undone when it makes the quantized error worse (see
    ``quark.torch.quantization.graph.passes``).

    Args:
        iterations (int): Passes over all chains (a chain of three layers converges over several passes).
        threshold (float): Stop early once no channel scale of a pass differs from 1 by more than this (relative).
        high_bias_absorption (bool): Also move the part of a bias that ReLU never cuts (beta - 3 gamma of the folded
            BatchNorm, at most the captured batch's smallest pre-activation) into the next layer's bias (section 4.2 of
            the paper; ReLU chains into an unpadded layer with a bias only). An approximation: values below that bound
            on other data are computed differently, so it is off by default.
    """

    name: str = "cle"
    iterations: int = 5
    threshold: float = 1e-3
    high_bias_absorption: bool = False

    def __post_init__(self) -> None:
        own = "CLEConfig"
        _check_positive_int(own, "iterations", self.iterations)
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int | float) or self.threshold < 0:
            raise ValueError(f"{own}.threshold={self.threshold!r} must be a number >= 0")
        if not isinstance(self.high_bias_absorption, bool):
            raise ValueError(f"{own}.high_bias_absorption={self.high_bias_absorption!r} must be true or false")


for _type, _stage in (
    (GPTQConfig, "after_calibration"),
    (AWQConfig, "before_calibration"),
    (SmoothQuantConfig, "before_calibration"),
    (CLEConfig, "graph"),
    (RotationConfig, "before_calibration"),
):
    register_algorithm(_type, stage=_stage)  # the handlers come with their modules


def _algos_by_name() -> dict[str, type[AlgoConfig]]:
    """The registered algorithm config types by their ``name`` (what a dict's ``name`` selects)."""
    return {t.name: t for t in registered_algorithms() if issubclass(t, AlgoConfig)}  # type: ignore[attr-defined]


def _algo(owner: str, value: Any, base: type[AlgoConfig]) -> Any:
    """One algorithm config or a list of them, from objects or dicts keyed by ``name``."""
    if value is None or isinstance(value, base):
        return value
    if isinstance(value, list | tuple):
        return [_algo(f"{owner}[{i}]", v, base) for i, v in enumerate(value)]
    algos = _algos_by_name()
    allowed = [n for n, c in algos.items() if issubclass(c, base)]
    if isinstance(value, dict):
        name = str(value.get("name", "")).lower()
        if name not in allowed:
            raise ValueError(f"{owner}.name={value.get('name')!r} is not known; allowed: {allowed}")
        return algos[name].from_dict(value)
    raise ValueError(f"{owner}={value!r} must be one of {allowed} (a config object or a dict with 'name')")


# ----------------------------------------------------------------------------------------------- Config
@dataclass(eq=True)
class Config(ConfigBase):
    """Quantization configuration of a whole model, hierarchical: layer name > layer type > global.

    Args:
        global_quant_config (QuantizationConfig): Applied to every layer unless overridden.
        layer_type_quant_config (Dict[str, QuantizationConfig]): By layer type ("Linear", "Conv2d" or the class).
        layer_quant_config (Dict[str, QuantizationConfig]): By layer name (fnmatch patterns such as ``"*.fc2"``).
        exclude (List[str]): Layer names (fnmatch patterns) left in float.
        algo_config (Optional[AlgoConfig]): GPTQ / AWQ / SmoothQuant / rotation (amd-quark 0.13 places it here), one or a
            list applied in order.
        pre_quant_opt_config (Optional[PreQuantOptConfig]): SmoothQuant (eager mode) or CLE (graph mode), one or a list.
        quant_mode (QuantizationMode): eager_mode (module swapping) or fx_graph_mode.
        inherit_roles (bool): False (amd-quark's rule): the most specific entry that matches a layer (name, then
            type, then global) is its whole QuantizationConfig, and a role left None there is not quantized. True (ours,
            opt-in): a role left None in an entry is taken from the next level, so an entry can override one role.
        kv_cache_quant_config (Dict[str, QuantizationConfig]): KV cache (amd-quark's): layer-name pattern (``"*k_proj"``)
            -> the matching layers' whole QuantizationConfig, above every other level; its ``output_tensors`` (per
            tensor: fp8_e4m3, fp8_e5m2 or int8) quantizes the keys / values. An excluded layer keeps that output
            quantizer only. See ``quark.torch.quantization.attention``.
        kv_cache_group (List[str]): Patterns whose matches share one scale in an export (``["*k_proj", "*v_proj"]``:
            each k_proj with the v_proj named alike), both written as max(k, v, min_kv_scale).
        min_kv_scale (float): The smallest k/v scale an export writes (through ``kv_cache_group``).
        kv_cache_post_rope (bool): False: the k/v layers' outputs are quantized (before RoPE). True: the keys and
            values as the attention sees them, after RoPE (Hugging Face attention modules only).
        softmax_quant_spec (Optional[QuantizationSpec]): Quantizes the attention probabilities (the softmax output)
            of every Hugging Face attention module; needs ``attn_implementation="eager"``.
    """

    global_quant_config: QuantizationConfig
    layer_type_quant_config: dict[str, QuantizationConfig] = field(default_factory=dict)
    layer_quant_config: dict[str, QuantizationConfig] = field(default_factory=dict)
    exclude: list[str] = field(default_factory=list)
    algo_config: AlgoConfig | list[AlgoConfig] | None = None
    pre_quant_opt_config: PreQuantOptConfig | list[PreQuantOptConfig] | None = None
    quant_mode: QuantizationMode = QuantizationMode.eager_mode
    inherit_roles: bool = False
    kv_cache_quant_config: dict[str, QuantizationConfig] = field(default_factory=dict)
    kv_cache_group: list[str] = field(default_factory=list)
    min_kv_scale: float = 0.0
    kv_cache_post_rope: bool = False
    softmax_quant_spec: QuantizationSpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.inherit_roles, bool):
            raise ValueError(f"Config.inherit_roles={self.inherit_roles!r} must be true or false")
        self.global_quant_config = _qconfig("Config.global_quant_config", self.global_quant_config)
        self.layer_type_quant_config = self._mapping(
            "layer_type_quant_config", self.layer_type_quant_config, types=True
        )
        self.layer_quant_config = self._mapping("layer_quant_config", self.layer_quant_config, types=False)
        if not isinstance(self.exclude, list | tuple) or not all(isinstance(e, str) for e in self.exclude):
            raise ValueError(f"Config.exclude={self.exclude!r} must be a list of layer names or fnmatch patterns")
        self.exclude = list(self.exclude)
        self.algo_config = _algo("Config.algo_config", self.algo_config, AlgoConfig)
        self.pre_quant_opt_config = _algo("Config.pre_quant_opt_config", self.pre_quant_opt_config, PreQuantOptConfig)
        self.quant_mode = coerce_enum("Config", "quant_mode", QuantizationMode, self.quant_mode, optional=False)  # type: ignore[assignment]
        self._check_stages()
        self._check_attention_fields()

    def _check_attention_fields(self) -> None:
        """The KV-cache and softmax fields: types, and the formats each path can hold (see ``attention_fields``)."""
        self.kv_cache_quant_config = self._mapping("kv_cache_quant_config", self.kv_cache_quant_config, types=False)
        for pattern, qc in self.kv_cache_quant_config.items():
            check_kv_spec(f"Config.kv_cache_quant_config[{pattern!r}]", qc.output_tensors)
        self.kv_cache_group = check_kv_cache_group(self.kv_cache_group)
        self.min_kv_scale = check_min_kv_scale(self.min_kv_scale)
        if not isinstance(self.kv_cache_post_rope, bool):
            raise ValueError(f"Config.kv_cache_post_rope={self.kv_cache_post_rope!r} must be true or false")
        self.softmax_quant_spec = _spec("Config.softmax_quant_spec", self.softmax_quant_spec)
        check_softmax_spec(self.softmax_quant_spec)
        attention = self.kv_cache_quant_config or self.softmax_quant_spec is not None
        if attention and self.quant_mode == QuantizationMode.fx_graph_mode:
            raise ValueError(
                "Config.kv_cache_quant_config / softmax_quant_spec work in eager_mode only (they quantize inside the "
                "model's attention modules, which a captured graph no longer has)"
            )

    def _check_stages(self) -> None:
        """Graph-stage algorithms (CLE) run from pre_quant_opt_config in fx_graph_mode, the others in eager_mode."""
        stages = {id(a): algorithm_stage(a) for a in self.algo_configs + self.pre_quant_opt_configs}
        in_algo = [type(a).__name__ for a in self.algo_configs if stages[id(a)] == "graph"]
        if in_algo:
            raise ValueError(
                f"Config.algo_config holds a {in_algo[0]}, which runs from pre_quant_opt_config only: move it there"
            )
        graph_only = [a.name for a in self.pre_quant_opt_configs if stages[id(a)] == "graph"]  # type: ignore[attr-defined]
        if graph_only and self.quant_mode != QuantizationMode.fx_graph_mode:
            raise ValueError(
                f"Config.pre_quant_opt_config {graph_only} needs quant_mode=fx_graph_mode (it equalizes the "
                "BatchNorm-folded layer chains of the captured graph)"
            )
        eager_only = [a.name for a in self.algo_configs + self.pre_quant_opt_configs if stages[id(a)] != "graph"]  # type: ignore[attr-defined]
        if self.quant_mode == QuantizationMode.fx_graph_mode and eager_only:
            names = eager_only
            raise ValueError(
                f"Config algorithm(s) {names} run in eager_mode only; fx_graph_mode has pre_quant_opt_config=[CLEConfig()]"
            )

    @staticmethod
    def _mapping(name: str, value: Any, types: bool) -> dict[str, QuantizationConfig]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ValueError(
                f"Config.{name}={value!r} must be a dict of {'layer types' if types else 'layer names'} to QuantizationConfig"
            )
        out: dict[str, QuantizationConfig] = {}
        for key, qc in value.items():
            if types and isinstance(key, type):
                key = key.__name__  # the class is matched by its name, like "Linear"
            if not isinstance(key, str):
                raise ValueError(
                    f"Config.{name} key {key!r} must be a {'type name or class' if types else 'layer name'}"
                )
            out[key] = _qconfig(f"Config.{name}[{key!r}]", qc)
        return out

    @property
    def algo_configs(self) -> list[AlgoConfig]:
        """``algo_config`` as a list (possibly empty)."""
        return _as_list(self.algo_config)

    @property
    def pre_quant_opt_configs(self) -> list[PreQuantOptConfig]:
        """``pre_quant_opt_config`` as a list (possibly empty)."""
        return _as_list(self.pre_quant_opt_config)


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


# ----------------------------------------------------------------------------------------------- amd-quark >= 0.11 names
#: amd-quark 0.11 renamed the three levels; scripts written for it run unchanged with these aliases
QConfig = Config
QLayerConfig = QuantizationConfig
QTensorConfig = QuantizationSpec
__all__ += ["QConfig", "QLayerConfig", "QTensorConfig"]
__all__ += spec_helpers.__all__
