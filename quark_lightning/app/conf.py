"""The Hydra side of the quant config: role groups, validation of the composed ``quant`` node, the bit-width knobs.

The ``quant`` node of the composed config is a quark ``Config`` (``global_quant_config``, ``layer_type_quant_config``,
``layer_quant_config``, ``exclude``, ...) plus the flow around it (``mode``, ``weight_bits``, calibration and QAT
settings). Everything here runs before any model, data or Trainer is built.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from callbacks.distill import as_distillation
from quark.torch.quantization.config.config import (
    Config,
    LSQSpec,
    QuantizationConfig,
    QuantizationSpec,
    TQTSpec,
)
from quark.torch.quantization.config.type import Dtype, QuantizationMode
from quark.torch.quantization.formats import BLOCK_FORMATS, FLOAT_FORMATS, bits_per_element

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
SPEC_DIR = CONF_DIR / "quant" / "spec"
ROLES: tuple[str, ...] = QuantizationConfig.ROLES
WEIGHT_ROLES = ("weight",)
ACT_ROLES = ("input_tensors", "output_tensors")
MODES = ("none", "ptq", "qat")
CONFIG_KEYS = tuple(f.name for f in fields(Config))
SPEC_KEYS = tuple(f.name for f in fields(QuantizationSpec))
QCONFIG_KEYS = tuple(f.name for f in fields(QuantizationConfig))
QAT_KEYS = tuple(sorted({"method"} | {f.name for f in fields(TQTSpec)} | {f.name for f in fields(LSQSpec)}))

#: minifloat family per width: (exponent-heavy, mantissa-heavy); a bit-width knob keeps the family of the preset
_MINIFLOATS = {8: (Dtype.fp8_e5m2, Dtype.fp8_e4m3), 6: (Dtype.fp6_e3m2, Dtype.fp6_e2m3), 4: (Dtype.fp4, Dtype.fp4)}
_EXPONENT_HEAVY = {Dtype.fp8_e5m2, Dtype.fp6_e3m2}


class ConfigError(ValueError):
    """A composed config that cannot run (found before anything is trained; the message names the key)."""


class QuantConfigError(ConfigError):
    """A composed ``quant`` node that does not make a valid quark Config or flow."""


@dataclass(frozen=True)
class QuantFlow:
    """What ``train.py`` does around the Config: the flow keys of the ``quant`` node.

    ``mode``: ``none`` (float only), ``ptq`` (calibrate the trained model) or ``qat`` (fine-tune it with fake
    quantization for ``qat_epochs`` epochs, the optimizer's learning rates scaled by ``qat_lr_scale``; TQT
    thresholds / LSQ scales at ``quantizer_lr`` when set).
    ``weight_bits`` / ``act_bits``: when set, the bit width of every weight / activation dtype of the global and
    layer-type levels (explicit per-layer entries keep theirs).
    """

    name: str = "custom"
    mode: str = "ptq"
    brevitas: dict[str, Any] | None = None  # a Brevitas-style Config (extensions.brevitas), converted to the engine's
    weight_bits: int | None = None
    act_bits: int | None = None
    calib_batches: int | None = 16
    observer_steps: int = 100
    qat_epochs: int = 4
    qat_lr_scale: float = 0.25
    freeze_bn_epoch: int | None = None
    quantizer_lr: float | None = None
    layer_bits: dict[str, int | str] | None = (
        None  # per layer (group): weight width or spec name; quark_lightning/app/layer_bits.py
    )
    candidates: list[str] | None = (
        None  # mixed precision: spec presets a layer's weight may take (quark_lightning/app/mixed.py)
    )
    target_bits: float | None = None  # mixed precision: average weight bits per parameter, scales counted
    sensitivity: str = "kl"  # mixed precision: kl | mse | hessian
    sensitivity_batches: int = 8
    sensitivity_csv: str | None = (
        None  # mixed precision: allocate from an earlier run's sensitivity.csv, no measurement
    )
    distill: dict[str, Any] | None = None  # QAT: callbacks.distill.Distillation's fields (docs/lightning.md)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise QuantConfigError(f"quant.mode={self.mode!r} is not allowed; allowed: {list(MODES)}")
        _check_layer_bits(self.layer_bits)
        _check_mixed(self)
        _check_distill(self)
        for key in ("weight_bits", "act_bits"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= 16):
                raise QuantConfigError(f"quant.{key}={value!r} must be null or an int in 2..16")
        for key, minimum, optional in (
            ("calib_batches", 1, True),
            ("observer_steps", 1, False),
            ("qat_epochs", 1, False),
            ("freeze_bn_epoch", 0, True),
        ):
            value = getattr(self, key)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise QuantConfigError(
                    f"quant.{key}={value!r} must be {'null or ' if optional else ''}an int >= {minimum}"
                )
        scale = self.qat_lr_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 < scale < float("inf"):
            raise QuantConfigError(f"quant.qat_lr_scale={scale!r} must be a finite number > 0")
        lr = self.quantizer_lr
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, int | float) or not 0 < lr < float("inf")):
            raise QuantConfigError(f"quant.quantizer_lr={lr!r} must be null or a finite number > 0")


def _check_distill(flow: QuantFlow) -> None:
    """``quant.distill``: null, or Distillation's fields with mode=qat (only training can distil)."""
    if flow.distill is None:
        return
    if flow.mode != "qat":
        raise QuantConfigError(
            f"quant.distill is set but quant.mode={flow.mode!r}: distillation trains, use quant.mode=qat"
        )
    if not isinstance(flow.distill, dict):
        raise QuantConfigError(f"quant.distill must be null or a mapping, got {type(flow.distill).__name__}")
    if callable(flow.distill.get("mask")):
        return
    try:
        as_distillation(flow.distill)
    except ValueError as err:
        raise QuantConfigError(f"quant.distill: {err}") from None


FLOW_KEYS = tuple(f.name for f in fields(QuantFlow))
MIXED_KEYS = ("candidates", "target_bits", "sensitivity", "sensitivity_batches", "sensitivity_csv")
SENSITIVITY_METHODS = ("kl", "mse", "hessian")


def spec_names(spec_dir: Path = SPEC_DIR) -> list[str]:
    """The spec presets of ``conf/quant/spec`` (the options of ``quant/<role>=`` and of ``quant.candidates``)."""
    return sorted(p.stem for p in spec_dir.glob("*.yaml"))


def candidate_specs(names: Iterable[str], spec_dir: Path = SPEC_DIR) -> dict[str, dict[str, Any]]:
    """Name -> the spec dict of ``conf/quant/spec/<name>.yaml``, for each mixed-precision candidate; QuantConfigError
    naming ``quant.candidates`` and the allowed names when one is not a spec preset."""
    allowed = spec_names(spec_dir)
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        if name not in allowed:
            close = difflib.get_close_matches(str(name), allowed, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise QuantConfigError(
                f"quant.candidates: {name!r} is not a spec preset of conf/quant/spec; allowed: {allowed}{hint}"
            )
        spec = OmegaConf.to_container(OmegaConf.load(spec_dir / f"{name}.yaml"), resolve=True)
        assert isinstance(spec, dict)
        out[name] = spec
    return out


def _check_mixed(flow: QuantFlow) -> None:
    """The mixed-precision keys of the flow (``quant=mixed_auto``): both of candidates / target_bits or neither, the
    candidates spec presets, the budget a finite number no smaller than the fewest element bits of a candidate."""
    candidates, bits = flow.candidates, flow.target_bits
    if flow.sensitivity not in SENSITIVITY_METHODS:
        raise QuantConfigError(
            f"quant.sensitivity={flow.sensitivity!r} is not allowed; allowed: {list(SENSITIVITY_METHODS)}"
        )
    batches = flow.sensitivity_batches
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise QuantConfigError(f"quant.sensitivity_batches={batches!r} must be an int >= 1")
    if flow.sensitivity_csv is not None and not isinstance(flow.sensitivity_csv, str):
        raise QuantConfigError(
            f"quant.sensitivity_csv={flow.sensitivity_csv!r} must be null or the path of a sensitivity.csv"
        )
    if candidates is None and bits is None:
        if flow.sensitivity_csv is not None:
            raise QuantConfigError(
                "quant.sensitivity_csv is set but quant.target_bits / quant.candidates are null (use quant=mixed_auto)"
            )
        return
    if bits is not None and (
        isinstance(bits, bool) or not isinstance(bits, int | float) or not 0 < bits < float("inf")
    ):
        raise QuantConfigError(
            f"quant.target_bits={bits!r} must be a finite number > 0 (average weight bits per parameter)"
        )
    if candidates is None or bits is None:
        given, missing = ("target_bits", "candidates") if candidates is None else ("candidates", "target_bits")
        raise QuantConfigError(
            f"quant.{given} is set but quant.{missing} is null: mixed precision needs both "
            "(quant=mixed_auto sets them; e.g. quant.target_bits=3 quant.candidates=[int2_per_channel_sym,int4_per_channel_sym])"
        )
    if not isinstance(candidates, list | tuple) or not candidates or not all(isinstance(c, str) for c in candidates):
        raise QuantConfigError(
            f"quant.candidates={candidates!r} must be a non-empty list of spec presets of conf/quant/spec: {spec_names()}"
        )
    if len(set(candidates)) != len(candidates):
        raise QuantConfigError(f"quant.candidates={list(candidates)} names a spec twice")
    if flow.mode != "ptq":
        raise QuantConfigError(
            f"quant.target_bits (mixed precision) chooses formats after training: it needs quant.mode=ptq, not {flow.mode!r}"
        )
    if flow.weight_bits is not None:
        raise QuantConfigError(
            f"quant.weight_bits={flow.weight_bits} sets one width for every weight, while quant.target_bits chooses one per "
            "layer from quant.candidates: leave quant.weight_bits null"
        )
    if flow.layer_bits:
        raise QuantConfigError("quant.layer_bits and quant.target_bits both set the layers' weight formats: use one")
    specs = candidate_specs(candidates)
    fewest = {}
    for name, spec in specs.items():
        try:
            fewest[name] = spec_bits(QuantizationSpec.from_dict(spec))
        except (ValueError, TypeError) as err:
            raise QuantConfigError(f"quant.candidates: {name}: {err}") from None
    name = min(fewest, key=fewest.__getitem__)
    if bits < fewest[name]:
        raise QuantConfigError(
            f"quant.target_bits={bits} is below the fewest bits a candidate stores: {name}, {fewest[name]:g} bits per "
            f"weight before its scales; allowed: >= {fewest[name]:g} (plus scales) with these quant.candidates"
        )


def _check_layer_bits(layer_bits: Any) -> None:
    """``quant.layer_bits`` (flattened): layer name / group -> an int 2..16 or a spec name of conf/quant/spec."""
    if layer_bits is None:
        return
    if not isinstance(layer_bits, dict):
        raise QuantConfigError(
            f"quant.layer_bits={layer_bits!r} must be a mapping of layer (group) names to bit widths"
        )
    specs = sorted(p.stem for p in SPEC_DIR.glob("*.yaml"))
    for key, value in layer_bits.items():
        width = isinstance(value, int) and not isinstance(value, bool) and 2 <= value <= 16
        if not width and not (isinstance(value, str) and value in specs):
            raise QuantConfigError(
                f"quant.layer_bits.{key}={value!r} must be an int in 2..16 (the weight width, the layer's format "
                f"family kept) or a weight spec of conf/quant/spec: {specs}"
            )


def flatten_layer_bits(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"net": {"fc2": 4}}`` (Hydra nests dotted keys) -> ``{"net.fc2": 4}``; null entries are dropped."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            out.update(flatten_layer_bits(value, f"{prefix}{key}."))
        elif value is not None:
            out[f"{prefix}{key}"] = value
    return out


# ----------------------------------------------------------------------------------------------- role groups
def register_role_groups(spec_dir: Path = SPEC_DIR) -> list[str]:
    """Register every spec preset of ``conf/quant/spec`` as an option of the groups ``quant/<role>``.

    A quant preset picks its specs in its defaults list (``- weight: int8_per_channel_sym``) and the command line
    swaps one role (``quant/weight=int4_g32``); the files exist once, in ``conf/quant/spec``. Returns the names.
    """
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    names = sorted(p.stem for p in spec_dir.glob("*.yaml"))
    for name in names:
        node = OmegaConf.load(spec_dir / f"{name}.yaml")
        for role in ROLES:
            store.store(group=f"quant/{role}", name=name, node=node, package=f"quant.global_quant_config.{role}")
    return names


# ----------------------------------------------------------------------------------------------- the quant node
def build_quant(node: DictConfig | dict[str, Any]) -> tuple[QuantFlow, Config | None]:
    """Validate the composed ``quant`` node: (the flow, the quark Config with the bit knobs applied, or None for
    ``mode=none``). Raises QuantConfigError naming the key and what is allowed."""
    data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    if not isinstance(data, dict):
        raise QuantConfigError(f"quant must be a mapping, got {type(data).__name__}")
    unknown = [k for k in data if k not in FLOW_KEYS and k not in CONFIG_KEYS]
    if unknown:
        raise QuantConfigError(_unknown("quant", unknown[0], FLOW_KEYS + CONFIG_KEYS))
    if isinstance(data.get("layer_bits"), dict):
        data["layer_bits"] = flatten_layer_bits(data["layer_bits"])
    flow = QuantFlow(**{k: data[k] for k in FLOW_KEYS if k in data})
    config_dict = {k: data[k] for k in CONFIG_KEYS if k in data and data[k] is not None}
    config_dict.setdefault("global_quant_config", {})
    if flow.brevitas is not None:
        config_dict = _from_brevitas(flow.brevitas, config_dict)
    if isinstance(config_dict.get("layer_quant_config"), dict):
        config_dict["layer_quant_config"] = flatten_layer_names(config_dict["layer_quant_config"])
    try:
        config_dict = apply_bits(config_dict, flow.weight_bits, flow.act_bits)
        config = Config.from_dict(config_dict)
    except QuantConfigError:
        raise
    except (ValueError, TypeError) as err:
        raise QuantConfigError(f"quant: {err}") from None
    if flow.target_bits is not None:
        _check_mixed_config(config, data)
        return flow, config  # the weights come from the candidates: the composed roles may all be null
    if flow.mode == "none":
        if flow.layer_bits:
            raise QuantConfigError(f"quant.layer_bits={flow.layer_bits} is set but quant.mode='none' quantizes nothing")
        return flow, None
    levels = [config.global_quant_config, *config.layer_type_quant_config.values(), *config.layer_quant_config.values()]
    if not any(getattr(qc, role) is not None for qc in levels for role in ROLES):
        raise QuantConfigError(
            f"quant.mode={flow.mode!r} but no role is quantized: set quant/weight=... (or another role), "
            "or use quant=none for a float run"
        )
    return flow, config


def _check_mixed_config(config: Config, data: dict[str, Any]) -> None:
    """What mixed precision cannot work with: Brevitas configs, graph mode, algorithms that rewrite the weights."""
    if data.get("brevitas") is not None:
        raise QuantConfigError("quant.brevitas and quant.target_bits (mixed precision) are both set; use one")
    if config.quant_mode == QuantizationMode.fx_graph_mode:
        raise QuantConfigError(
            "quant.target_bits (mixed precision) works on the module's own layers: quant.quant_mode must be eager_mode"
        )
    for key in ("algo_config", "pre_quant_opt_config"):
        if data.get(key) is not None:
            raise QuantConfigError(
                f"quant.{key} and quant.target_bits (mixed precision) are both set: the sensitivity is measured with "
                "round-to-nearest formats; set quant.{key}=null"
            )


def _from_brevitas(brevitas: dict[str, Any], config_dict: dict[str, Any]) -> dict[str, Any]:
    """The engine's Config dict of ``quant.brevitas``; it replaces the quark roles, so those must be unset."""
    from quark.torch.extensions.brevitas import Config as BrevitasConfig
    from quark.torch.extensions.brevitas import to_quark_config

    roles = [r for r, v in (config_dict.get("global_quant_config") or {}).items() if v is not None]
    if roles or config_dict.get("layer_type_quant_config") or config_dict.get("layer_quant_config"):
        raise QuantConfigError(
            f"quant.brevitas and quant.global_quant_config ({roles}) / layer configs are both set; use one"
        )
    try:
        return to_quark_config(BrevitasConfig.from_dict(brevitas)).to_dict()
    except (ValueError, TypeError) as err:
        raise QuantConfigError(f"quant.brevitas: {err}") from None


def flatten_layer_names(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"net": {"fc2": {"weight": ...}}}`` -> ``{"net.fc2": {"weight": ...}}``.

    Hydra and OmegaConf read dots in keys as nesting (``quant.layer_quant_config.net.fc2.weight.dtype=int4``,
    ``+quant/spec@quant.layer_quant_config.net.fc2.weight=int4_g32``): a level whose keys are QuantizationConfig
    fields (weight, input_tensors, ...) is a layer's config, any other key is one more part of a layer name.
    Keys that already hold dots or fnmatch patterns (quoted in YAML: ``"*.fc2":``) pass through as they are.
    """
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if not isinstance(value, dict):
            out[name] = value
            continue
        own = {k: v for k, v in value.items() if k in QCONFIG_KEYS}
        if own:
            out[name] = own
        out.update(flatten_layer_names({k: v for k, v in value.items() if k not in QCONFIG_KEYS}, f"{name}."))
    return out


def apply_bits(config: dict[str, Any], weight_bits: int | None, act_bits: int | None) -> dict[str, Any]:
    """A copy of a Config dict whose global and layer-type weight (activation) specs take ``weight_bits``
    (``act_bits``): integers keep their signedness, minifloats and MX elements their family (fp8 -> fp6 -> fp4)."""
    out = OmegaConf.to_container(OmegaConf.create(config)) if config else {}
    assert isinstance(out, dict)
    levels = [("global_quant_config", out.get("global_quant_config") or {})]
    levels += [(f"layer_type_quant_config.{k}", v or {}) for k, v in (out.get("layer_type_quant_config") or {}).items()]
    for where, qconfig in levels:
        for roles, bits in ((WEIGHT_ROLES, weight_bits), (ACT_ROLES, act_bits)):
            for role in roles:
                spec = qconfig.get(role)
                if bits is not None and isinstance(spec, dict):
                    knob = "weight_bits" if role in WEIGHT_ROLES else "act_bits"
                    qconfig[role] = with_bits(spec, bits, f"quant.{knob}={bits} on quant.{where}.{role}")
    return out


def with_bits(spec: dict[str, Any], bits: int, where: str) -> dict[str, Any]:
    """``spec`` with its element width set to ``bits`` (see ``apply_bits``); QuantConfigError when that width has
    no format of the spec's family."""
    spec = dict(spec)
    try:
        dtype = Dtype(spec.get("dtype"))
    except ValueError as err:
        raise QuantConfigError(f"{where}: {err}") from None
    if dtype.is_integer:
        try:
            spec["dtype"] = Dtype.integer(bits, signed=not dtype.name.startswith("u")).name
        except ValueError as err:
            raise QuantConfigError(f"{where}: {err}") from None
    elif dtype in FLOAT_FORMATS:
        spec["dtype"] = _minifloat(dtype, bits, where).name
    elif dtype == Dtype.mx:
        element = Dtype(spec.get("mx_element_dtype") or "fp8_e4m3")
        if element == Dtype.int8:
            if bits != 8:
                raise QuantConfigError(f"{where}: MX integer elements exist only as int8; allowed: 8")
        else:
            spec["mx_element_dtype"] = _minifloat(element, bits, where).name
    else:
        raise QuantConfigError(
            f"{where}: dtype {dtype.name} has a fixed width; a bit-width knob applies to integer (int2..int16), "
            "minifloat (fp8/fp6/fp4) and mx dtypes"
        )
    return spec


def _minifloat(dtype: Dtype, bits: int, where: str) -> Dtype:
    if bits not in _MINIFLOATS:
        raise QuantConfigError(f"{where}: {dtype.name} is a minifloat; allowed widths: {sorted(_MINIFLOATS)}")
    return _MINIFLOATS[bits][0 if dtype in _EXPONENT_HEAVY else 1]


def spec_bits(spec: QuantizationSpec | None) -> float:
    """Storage bits per element of a spec (block formats with their shared scales; None: float32)."""
    if spec is None:
        return 32.0
    block = spec.group_size if spec.dtype in BLOCK_FORMATS else None
    return float(bits_per_element(spec.dtype, spec.mx_element_dtype, block))


def nominal_bits(config: Config | None, role: str) -> float:
    """The bits of ``role`` at the global level (else the first layer-type entry that sets it); 32 when float."""
    if config is None:
        return 32.0
    for qc in (config.global_quant_config, *config.layer_type_quant_config.values()):
        if getattr(qc, role) is not None:
            return spec_bits(getattr(qc, role))
    return 32.0


# ----------------------------------------------------------------------------------------------- command line
def check_overrides(args: Iterable[str]) -> str | None:
    """Check the ``quant.*`` keys of command-line overrides against the Config's dataclasses before Hydra runs.

    Hydra alone says ``Key 'dtyp' is not in struct`` and suggests appending it; this names the key, what is
    allowed there and the closest match. Returns the message of the first bad key, or None.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            override = parser.parse_override(arg)
        except Exception:  # noqa: BLE001 - Hydra reports its own syntax errors
            continue
        key = override.key_or_group
        if override.is_delete() or "/" in key or "@" in key or not key.startswith("quant."):
            continue
        message = check_quant_key(key.split(".")[1:])
        if message:
            return f"{arg}: {message}"
    return None


def check_quant_key(parts: list[str]) -> str | None:
    """None when ``quant.<parts>`` names a field of the flow or of the Config (per-layer names may hold dots)."""
    head, rest = parts[0], parts[1:]
    path = f"quant.{head}"
    if head not in FLOW_KEYS and head not in CONFIG_KEYS:
        return _unknown("quant", head, FLOW_KEYS + CONFIG_KEYS)
    if not rest:
        return None
    if head == "global_quant_config":
        return _check_qconfig(path, rest)
    if head in ("layer_type_quant_config", "layer_quant_config"):
        # the layer (type) name may itself contain dots: the first role name after it starts the QuantizationConfig
        for i in range(1, len(rest)):
            if rest[i] in QCONFIG_KEYS:
                return _check_qconfig(f"{path}.{'.'.join(rest[:i])}", rest[i:])
        return None
    return None  # flow scalars, exclude, algorithm configs: their values are checked after composition


def _check_qconfig(path: str, parts: list[str]) -> str | None:
    role, rest = parts[0], parts[1:]
    if role not in QCONFIG_KEYS:
        return _unknown(path, role, QCONFIG_KEYS)
    if not rest or role == "target_device":
        return None
    if rest[0] not in SPEC_KEYS:
        return _unknown(f"{path}.{role}", rest[0], SPEC_KEYS, "QuantizationSpec")
    if rest[0] == "qat_spec" and len(rest) > 1 and rest[1] not in QAT_KEYS:
        return _unknown(f"{path}.{role}.qat_spec", rest[1], QAT_KEYS, "TQTSpec / LSQSpec")
    return None


def _unknown(path: str, key: str, allowed: Iterable[str], owner: str | None = None) -> str:
    allowed = list(allowed)
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"; did you mean {path}.{close[0]}?" if close else ""
    of = f" ({owner})" if owner else ""
    return f"unknown key {path}.{key}{of}; allowed: {allowed}{hint}"
