"""Composition of conf/: every preset makes a valid quark Config; roles, layer types and layers swap from the command
line; mistakes are named with what is allowed; the bit-width knobs map into the dtypes."""

from __future__ import annotations

import pytest
from app_helpers import PRESETS, REQUIRED_PRESETS, compose_cfg
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.config.type import Dtype
from quark_lightning.app.conf import (
    QuantConfigError,
    apply_bits,
    build_quant,
    check_overrides,
    flatten_layer_names,
    nominal_bits,
    with_bits,
)
from quark_lightning.app.mixed import candidate_configs, with_candidate

SPEC_INT8 = OmegaConf.to_container(OmegaConf.load("conf/quant/spec/int8_per_channel_sym.yaml"))


def _plans(config: Config, model) -> dict[str, dict[str, tuple]]:  # noqa: ANN001
    """layer -> role -> (dtype, qscheme, group_size, source)."""
    return {
        plan.name: {
            role: (spec.dtype.name, spec.qscheme, spec.group_size, plan.source[role])
            for role in ("weight", "input_tensors", "output_tensors", "bias")
            if (spec := getattr(plan.qconfig, role)) is not None
        }
        for plan in ModelQuantizer(config).resolve(model)
    }


# ----------------------------------------------------------------------------------------------- presets
def test_required_presets_exist() -> None:
    assert set(REQUIRED_PRESETS) <= set(PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes_and_instantiates(preset: str) -> None:
    cfg = compose_cfg(f"quant={preset}", "trainer=smoke")
    flow, config = build_quant(cfg.quant)
    assert flow.name == preset
    model, data = instantiate(cfg.model), instantiate(cfg.data)
    trainer = instantiate(cfg.trainer, logger=False, enable_checkpointing=False)
    assert trainer.max_epochs == 1 and data.batch_size == 64
    if preset == "none":
        assert config is None and flow.mode == "none"
        return
    assert flow.mode in ("ptq", "qat")
    if flow.target_bits is not None:  # mixed precision: the weights come from the candidates (each checked in run)
        config = with_candidate(config, next(iter(candidate_configs(config, flow).values())))
    if config.quant_mode.name == "fx_graph_mode":  # graph presets: the network is captured (the callback's job)
        from quark.torch.quantization.graph import capture

        data.setup("fit")
        graph = ModelQuantizer(config).prepare(
            capture(model.net, (next(iter(data.train_dataloader()))[0],)), name_prefix="net."
        )
        assert {p.name for p in ModelQuantizer(config).resolve(graph)} == {"conv1", "conv2", "fc1", "fc2"}
        return
    plans = ModelQuantizer(config).resolve(model)
    assert {p.name for p in plans} == {"net.conv1", "net.conv2", "net.fc1", "net.fc2"}
    ModelQuantizer(config).prepare(model)  # shapes fit (group sizes, channel axes) on the demo CNN


def test_default_is_int8_per_channel_ptq() -> None:
    cfg = compose_cfg()
    flow, config = build_quant(cfg.quant)
    assert (flow.name, flow.mode) == ("int8_per_channel", "ptq")
    assert config.global_quant_config.weight.dtype is Dtype.int8
    assert config.global_quant_config.weight.qscheme.name == "per_channel"
    assert config.global_quant_config.input_tensors.qscheme.name == "per_tensor"


def test_w4a8_tqt_is_qat_with_learned_pof2_thresholds() -> None:
    flow, config = build_quant(compose_cfg("quant=w4a8_tqt").quant)
    weight = config.global_quant_config.weight
    assert flow.mode == "qat" and weight.dtype is Dtype.int4 and weight.scale_type.name == "pof2"
    assert weight.qat_spec.threshold_init_meth.name == "_3SD"
    flow, config = build_quant(
        compose_cfg("quant=w4a8_tqt", "quant.global_quant_config.weight.qat_spec.threshold_init_meth=_LL_J").quant
    )
    assert config.global_quant_config.weight.qat_spec.threshold_init_meth.name == "_LL_J"


def test_quantizer_lr_reaches_the_flow_and_bad_values_are_refused() -> None:
    flow, config = build_quant(compose_cfg("quant=w4a8_tqt_graph").quant)
    assert flow.mode == "qat" and config.quant_mode.name == "fx_graph_mode" and flow.quantizer_lr is None
    assert config.global_quant_config.weight.qat_spec is not None  # TQT: thresholds with the optimizer's own rates
    flow, _ = build_quant(compose_cfg("quant=w4a8_tqt_graph", "quant.quantizer_lr=0.01").quant)
    assert flow.quantizer_lr == 0.01
    with pytest.raises(QuantConfigError, match=r"quant.quantizer_lr=-1.*null or a finite number > 0"):
        build_quant(compose_cfg("quant=w4a8_tqt_graph", "quant.quantizer_lr=-1").quant)


# ----------------------------------------------------------------------------------------------- swapping roles
def test_swap_one_role_from_the_command_line() -> None:
    base = build_quant(compose_cfg("quant=int8_per_channel").quant)[1]
    swapped = build_quant(
        compose_cfg("quant=int8_per_channel", "quant/weight=int4_g32", "quant/input_tensors=fp8_e4m3").quant
    )[1]
    assert (
        swapped.global_quant_config.weight.dtype is Dtype.int4 and swapped.global_quant_config.weight.group_size == 32
    )
    assert swapped.global_quant_config.input_tensors.dtype is Dtype.fp8_e4m3
    assert base.global_quant_config.weight.dtype is Dtype.int8  # the preset file is untouched


def test_a_null_role_of_a_preset_can_be_filled() -> None:
    config = build_quant(compose_cfg("quant=int4_per_group", "quant/input_tensors=int8_per_tensor").quant)[1]
    assert config.global_quant_config.input_tensors.dtype is Dtype.int8
    config = build_quant(compose_cfg("quant=int8_per_channel", "~quant/input_tensors").quant)[1]
    assert config.global_quant_config.input_tensors is None


def test_unknown_spec_option_lists_the_options() -> None:
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg("quant/weight=int4_g33")
    assert "int4_g32" in str(err.value.__cause__ or err.value) or "int4_g32" in repr(err.value)


def test_per_layer_override_from_command_line_changes_that_layer_only() -> None:
    model = instantiate(compose_cfg().model)
    before = _plans(build_quant(compose_cfg().quant)[1], model)
    cfg = compose_cfg("+quant/spec@quant.layer_quant_config.net.fc2.weight=int4_per_channel_sym")
    after = _plans(build_quant(cfg.quant)[1], model)
    assert after["net.fc2"]["weight"] == ("int4", before["net.fc2"]["weight"][1], None, "layer 'net.fc2'")
    assert after["net.fc2"]["input_tensors"] == before["net.fc2"]["input_tensors"]
    assert {k: v for k, v in after.items() if k != "net.fc2"} == {k: v for k, v in before.items() if k != "net.fc2"}


def test_per_layer_field_override_and_layer_type_group() -> None:
    model = instantiate(compose_cfg().model)
    cfg = compose_cfg(
        "quant=int4_per_group",  # Conv2d weights int8 by layer type
        "+quant/spec@quant.layer_type_quant_config.Conv2d.input_tensors=uint8_asym",
        "quant.layer_type_quant_config.Conv2d.weight.dtype=int6",
    )
    plans = _plans(build_quant(cfg.quant)[1], model)
    for conv in ("net.conv1", "net.conv2"):
        assert plans[conv]["weight"][0] == "int6" and plans[conv]["input_tensors"][0] == "uint8"
    for fc in ("net.fc1", "net.fc2"):
        assert plans[fc] == {"weight": ("int4", plans[fc]["weight"][1], 32, "global")}


def test_mixed_precision_preset_keeps_edges_int8() -> None:
    model = instantiate(compose_cfg().model)
    plans = _plans(build_quant(compose_cfg("quant=w4_edges8").quant)[1], model)
    assert {name: p["weight"][0] for name, p in plans.items()} == {
        "net.conv1": "int8",
        "net.conv2": "int4",
        "net.fc1": "int4",
        "net.fc2": "int8",
    }


def test_exclude_from_command_line() -> None:
    model = instantiate(compose_cfg().model)
    plans = _plans(build_quant(compose_cfg("quant.exclude=[net.fc2,net.conv1]").quant)[1], model)
    assert set(plans) == {"net.conv2", "net.fc1"}


def test_flatten_layer_names() -> None:
    spec = {"dtype": "int8"}
    assert flatten_layer_names(
        {"net": {"fc2": {"weight": spec}, "conv1": {"bias": None}}, "*.fc1": {"weight": spec}}
    ) == {"net.fc2": {"weight": spec}, "net.conv1": {"bias": None}, "*.fc1": {"weight": spec}}
    # a layer with its own config and a child's
    assert flatten_layer_names({"block": {"weight": spec, "inner": {"weight": spec}}}) == {
        "block": {"weight": spec},
        "block.inner": {"weight": spec},
    }


# ----------------------------------------------------------------------------------------------- errors
def test_unknown_key_appended_is_named_with_allowed_fields() -> None:
    cfg = compose_cfg("+quant.global_quant_config.weight.dtyp=int4")
    with pytest.raises(QuantConfigError, match=r"no field\(s\) \['dtyp'\]; allowed: \['dtype'"):
        build_quant(cfg.quant)


def test_bad_value_is_named_with_allowed_values() -> None:
    cfg = compose_cfg("quant.global_quant_config.weight.dtype=int33")
    with pytest.raises(
        QuantConfigError, match=r"weight: QuantizationSpec.dtype='int33' is not a valid Dtype; allowed: \['int2'"
    ):
        build_quant(cfg.quant)
    with pytest.raises(QuantConfigError, match=r"observer_cls='MinMax' is not an observer; allowed"):
        build_quant(compose_cfg("quant.global_quant_config.input_tensors.observer_cls=MinMax").quant)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("quant.mode=train", r"quant.mode='train' is not allowed; allowed: \['none', 'ptq', 'qat'\]"),
        ("quant.weight_bits=1", r"quant.weight_bits=1 must be null or an int in 2..16"),
        ("quant.calib_batches=0", r"quant.calib_batches=0 must be null or an int >= 1"),
        ("quant.qat_lr_scale=0", r"quant.qat_lr_scale=0 must be a finite number > 0"),
        ("quant.qat_lr_scale=inf", r"quant.qat_lr_scale=inf must be a finite number > 0"),
        ("quant.qat_lr_scale=nan", r"quant.qat_lr_scale=nan must be a finite number > 0"),
        ("quant.quantizer_lr=inf", r"quant.quantizer_lr=inf must be null or a finite number > 0"),
        (
            "+quant.epochs=3",
            r"unknown key quant.epochs; allowed: \[.*'qat_epochs'.*\]; did you mean quant.qat_epochs\?",
        ),
    ],
)
def test_flow_errors(override: str, message: str) -> None:
    with pytest.raises(QuantConfigError, match=message):
        build_quant(compose_cfg(override).quant)


def test_quantizing_mode_with_nothing_to_quantize_is_refused() -> None:
    with pytest.raises(QuantConfigError, match="no role is quantized"):
        build_quant(compose_cfg("quant=none", "quant.mode=ptq").quant)


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        (
            "quant.global_quant_config.weight.dtyp=int4",
            "unknown key quant.global_quant_config.weight.dtyp (QuantizationSpec)",
        ),
        ("quant.global_quant_config.wieght.dtype=int4", "did you mean quant.global_quant_config.weight?"),
        ("quant.weight_bit=4", "did you mean quant.weight_bits?"),
        ("quant.layer_quant_config.net.fc2.weight.grp=32", "unknown key quant.layer_quant_config.net.fc2.weight.grp"),
        ("quant.global_quant_config.weight.qat_spec.init=_3SD", "allowed: ['method', 'threshold_init_meth']"),
    ],
)
def test_command_line_keys_are_checked_against_the_dataclasses(arg: str, expected: str) -> None:
    message = check_overrides(["-m", arg, "trainer.max_epochs=1"])
    assert message is not None and expected in message and message.startswith(arg)


@pytest.mark.parametrize(
    "arg",
    [
        "quant.global_quant_config.weight.dtype=int4",
        "quant.weight_bits=2,3,4",
        "quant/weight=int4_g32",
        "+quant/spec@quant.layer_quant_config.net.fc2.weight=int4_g32",
        "quant.layer_quant_config.net.fc2.weight.dtype=int4",
        "quant.exclude=[net.fc2]",
        "trainer.max_epochs=1",
        "~quant/bias",
        "hydra.run.dir=/tmp/x",
    ],
)
def test_valid_command_line_keys_pass(arg: str) -> None:
    assert check_overrides([arg]) is None


# ----------------------------------------------------------------------------------------------- bit knobs
@pytest.mark.parametrize(
    ("dtype", "element", "bits", "expected"),
    [
        ("int8", None, 4, ("int4", None)),
        ("int8", None, 2, ("int2", None)),
        ("uint8", None, 3, ("uint3", None)),
        ("int4", None, 16, ("int16", None)),
        ("fp8_e4m3", None, 6, ("fp6_e2m3", None)),
        ("fp8_e5m2", None, 6, ("fp6_e3m2", None)),
        ("fp8_e4m3", None, 4, ("fp4", None)),
        ("fp4", None, 8, ("fp8_e4m3", None)),
        ("mx", "fp8_e4m3", 4, ("mx", "fp4")),
        ("mx", "fp4", 6, ("mx", "fp6_e2m3")),
        ("mx", "int8", 8, ("mx", "int8")),
    ],
)
def test_with_bits_maps_into_the_dtype_family(dtype: str, element: str | None, bits: int, expected: tuple) -> None:
    spec = {"dtype": dtype, "mx_element_dtype": element}
    out = with_bits(spec, bits, "here")
    assert (out["dtype"], out["mx_element_dtype"]) == expected
    assert spec["dtype"] == dtype  # the input is not modified


@pytest.mark.parametrize(
    ("dtype", "element", "bits", "message"),
    [
        ("fp8_e4m3", None, 3, r"allowed widths: \[4, 6, 8\]"),
        ("mx6", None, 4, "fixed width"),
        ("bfloat16", None, 8, "fixed width"),
        ("mx", "int8", 4, "allowed: 8"),
    ],
)
def test_with_bits_refuses_widths_without_a_format(dtype: str, element: str | None, bits: int, message: str) -> None:
    with pytest.raises(QuantConfigError, match=f"here: .*{message}"):
        with_bits({"dtype": dtype, "mx_element_dtype": element}, bits, "here")


def test_weight_bits_knob_applies_to_global_and_layer_types_not_named_layers() -> None:
    cfg = compose_cfg("quant=w4_edges8", "quant.weight_bits=2", "quant.act_bits=6")
    flow, config = build_quant(cfg.quant)
    assert flow.weight_bits == 2 and config.global_quant_config.weight.dtype is Dtype.int2
    assert config.global_quant_config.input_tensors.dtype is Dtype.int6
    assert {k: qc.weight.dtype for k, qc in config.layer_quant_config.items()} == {
        "net.conv1": Dtype.int8,
        "net.fc2": Dtype.int8,
    }
    config = build_quant(compose_cfg("quant=int4_per_group", "quant.weight_bits=3").quant)[1]
    assert config.global_quant_config.weight.dtype is Dtype.int3
    assert config.layer_type_quant_config["Conv2d"].weight.dtype is Dtype.int3
    assert nominal_bits(config, "weight") == 3.0 and nominal_bits(config, "input_tensors") == 32.0


def test_apply_bits_names_the_level_of_a_bad_width() -> None:
    with pytest.raises(
        QuantConfigError, match=r"quant.weight_bits=4 on quant.global_quant_config.weight: dtype mx6 has a fixed width"
    ):
        apply_bits({"global_quant_config": {"weight": {"dtype": "mx6"}}}, 4, None)
    with pytest.raises(QuantConfigError, match="quant.weight_bits=4"):
        build_quant(compose_cfg("quant=mx6", "quant.weight_bits=4").quant)


def test_nominal_bits_of_block_formats_count_shared_scales() -> None:
    assert nominal_bits(build_quant(compose_cfg("quant=mxfp4").quant)[1], "weight") == 4.25
    assert nominal_bits(build_quant(compose_cfg("quant=mx6").quant)[1], "weight") == 6.0
    assert nominal_bits(build_quant(compose_cfg("quant=bf16").quant)[1], "weight") == 16.0
    assert nominal_bits(None, "weight") == 32.0


def test_spec_files_are_valid_quantization_specs() -> None:
    assert Config.from_dict({"global_quant_config": {"weight": SPEC_INT8}}).global_quant_config.weight.ch_axis == 0


# ----------------------------------------------------------------------------------------------- the LM experiment
def test_char_lm_experiment_sets_data_model_and_metric() -> None:
    cfg = compose_cfg("experiment=char_lm")
    assert cfg.data._target_ == "quark_lightning.tasks.char_lm.PythonSourceDataModule"
    assert cfg.model._target_ == "quark_lightning.tasks.char_lm.CharLM"
    assert (cfg.metric.name, cfg.metric.mode) == ("test_ppl", "min")
    assert cfg.trainer.max_epochs == 2 and cfg.quant.name == "int8_per_channel"


@pytest.mark.parametrize(
    "preset", [p for p in PRESETS if p not in ("none", "w4_edges8") and not p.endswith("_graph")]
)  # graph: conv nets (test_graph_mode)
def test_every_preset_fits_the_lm(preset: str) -> None:
    cfg = compose_cfg("experiment=char_lm", f"quant={preset}", "model.n_layers=1")
    flow, config = build_quant(cfg.quant)
    if flow.target_bits is not None:  # mixed precision: the weights come from the candidates
        config = with_candidate(config, next(iter(candidate_configs(config, flow).values())))
    model = instantiate(cfg.model)
    plans = ModelQuantizer(config).resolve(model)
    linears = {"net.lm_head"} | {f"net.model.layers.0.self_attn.{p}_proj" for p in "qkvo"}
    linears |= {f"net.model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")}
    assert {p.name for p in plans} == linears  # embeddings stay float unless named
    ModelQuantizer(config).prepare(model)  # every Linear's in_features fits groups of 32


def test_brevitas_preset_converts_to_the_engine_config() -> None:
    flow, config = build_quant(compose_cfg("quant=brevitas_int8").quant)
    weight, act = config.global_quant_config.weight, config.global_quant_config.input_tensors
    assert (weight.dtype, weight.qscheme.name, weight.ch_axis, act.dtype, act.qscheme.name) == (
        Dtype.int8,
        "per_channel",
        0,
        Dtype.int8,
        "per_tensor",
    )
    config = build_quant(
        compose_cfg("quant=brevitas_int8", "quant.brevitas.global_quant_config.weight.bit_width=3").quant
    )[1]
    assert config.global_quant_config.weight.dtype is Dtype.int3
    with pytest.raises(QuantConfigError, match=r"quant.brevitas: QuantizationSpec.bit_width=1 is out of range"):
        build_quant(compose_cfg("quant=brevitas_int8", "quant.brevitas.global_quant_config.weight.bit_width=1").quant)
    with pytest.raises(QuantConfigError, match="quant.brevitas and quant.global_quant_config"):
        build_quant(compose_cfg("quant=brevitas_int8", "quant/weight=int8_per_channel_sym").quant)
