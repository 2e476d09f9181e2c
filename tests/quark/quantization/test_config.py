"""Config > QuantizationConfig > QuantizationSpec: Quark's documented API, validation and JSON round trips."""

from __future__ import annotations

import json
from typing import Any

import pytest
from specs import int_spec
from torch import nn

from quark.torch.quantization.config.config import (
    AWQConfig,
    CLEConfig,
    Config,
    GPTQConfig,
    LSQSpec,
    QuantizationConfig,
    QuantizationSpec,
    SmoothQuantConfig,
    TQTSpec,
)
from quark.torch.quantization.config.type import (
    DeviceType,
    Dtype,
    QSchemeType,
    QuantizationMode,
    RoundType,
    ScaleType,
    TQTThresholdInitMeth,
    ZeroPointType,
)
from quark.torch.quantization.observer.observer import (
    PerBlockBFPObserver,
    PerBlockMXObserver,
    PerChannelMinMaxObserver,
    PerGroupMinMaxObserver,
    PerTensorHistogramObserver,
    PerTensorHistogramObserverPro,
    PerTensorMinMaxObserver,
    PerTensorMSEObserver,
    PerTensorPercentileObserver,
    PlaceholderObserver,
)


def json_round_trip(obj: Any) -> Any:
    return type(obj).from_dict(json.loads(json.dumps(obj.to_dict())))


# ----------------------------------------------------------------------------------------------- the documented script
def test_documented_script_runs_unchanged() -> None:
    # written against the configuration guide and the autoapi pages, nothing engine-specific
    from quark.torch.quantization.config.config import Config, QuantizationConfig, QuantizationSpec
    from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType
    from quark.torch.quantization.observer.observer import (
        PerBlockMXObserver,
        PerChannelMinMaxObserver,
        PerGroupMinMaxObserver,
        PerTensorMinMaxObserver,
        PlaceholderObserver,
    )

    int8_per_channel = QuantizationSpec(
        dtype=Dtype.int8,
        qscheme=QSchemeType.per_channel,
        observer_cls=PerChannelMinMaxObserver,
        symmetric=True,
        scale_type=ScaleType.float,
        round_method=RoundType.half_even,
        is_dynamic=False,
        ch_axis=0,
    )
    int4_per_group = QuantizationSpec(
        dtype=Dtype.int4,
        observer_cls=PerGroupMinMaxObserver,
        symmetric=False,
        scale_type=ScaleType.float,
        round_method=RoundType.half_even,
        qscheme=QSchemeType.per_group,
        ch_axis=1,
        is_dynamic=False,
        group_size=32,
    )
    mx_fp4 = QuantizationSpec(
        dtype=Dtype.mx,
        mx_element_dtype=Dtype.fp4,
        observer_cls=PerBlockMXObserver,
        qscheme=QSchemeType.per_group,
        is_dynamic=True,
        ch_axis=-1,
        group_size=32,
    )
    bf16 = QuantizationSpec(dtype=Dtype.bfloat16, observer_cls=PlaceholderObserver)
    fp8_per_tensor = QuantizationSpec(
        dtype=Dtype.fp8_e4m3, qscheme=QSchemeType.per_tensor, observer_cls=PerTensorMinMaxObserver, is_dynamic=False
    )
    int8_per_tensor = QuantizationSpec(
        dtype=Dtype.int8,
        qscheme=QSchemeType.per_tensor,
        observer_cls=PerTensorMinMaxObserver,
        symmetric=True,
        scale_type=ScaleType.float,
        round_method=RoundType.half_even,
        is_dynamic=False,
    )

    global_cfg = QuantizationConfig(input_tensors=int8_per_tensor, weight=int8_per_channel)
    quant_config = Config(
        global_quant_config=global_cfg,
        layer_type_quant_config={"Linear": QuantizationConfig(weight=int4_per_group)},
        layer_quant_config={"*.fc2": QuantizationConfig(input_tensors=mx_fp4, weight=mx_fp4)},
        exclude=["lm_head", "*.gate"],
        algo_config=GPTQConfig(),
        pre_quant_opt_config=SmoothQuantConfig(),
    )
    other = Config(global_quant_config=QuantizationConfig(input_tensors=bf16, weight=fp8_per_tensor))

    # what the script built is what it asked for
    assert int8_per_channel.dtype is Dtype.int8 and int8_per_channel.ch_axis == 0
    assert int8_per_channel.observer_cls is PerChannelMinMaxObserver
    assert int8_per_channel.round_method is RoundType.half_even and int8_per_channel.is_dynamic is False
    assert int4_per_group.group_size == 32 and int4_per_group.ch_axis == 1 and int4_per_group.symmetric is False
    assert mx_fp4.mx_element_dtype is Dtype.fp4 and mx_fp4.qscheme is QSchemeType.per_group
    assert mx_fp4.group_size == 32 and mx_fp4.ch_axis == -1 and mx_fp4.is_dynamic is True
    assert bf16.observer_cls is PlaceholderObserver
    assert fp8_per_tensor.qscheme is QSchemeType.per_tensor
    assert quant_config.global_quant_config.weight is int8_per_channel
    assert quant_config.global_quant_config.output_tensors is None
    assert quant_config.layer_type_quant_config["Linear"].weight is int4_per_group
    assert quant_config.layer_quant_config["*.fc2"].input_tensors is mx_fp4
    assert quant_config.exclude == ["lm_head", "*.gate"]
    assert isinstance(quant_config.algo_config, GPTQConfig)
    assert isinstance(quant_config.pre_quant_opt_config, SmoothQuantConfig)
    assert quant_config.quant_mode is QuantizationMode.eager_mode
    assert other.global_quant_config.input_tensors is bf16


def test_config_defaults_match_docs() -> None:
    cfg = Config(global_quant_config=QuantizationConfig())
    assert cfg.layer_type_quant_config == {}
    assert cfg.layer_quant_config == {}
    assert cfg.exclude == []
    assert cfg.algo_config is None
    assert cfg.pre_quant_opt_config is None
    # mutable defaults are not shared between instances
    cfg.exclude.append("x")
    assert Config(global_quant_config=QuantizationConfig()).exclude == []
    qc = QuantizationConfig()
    assert (qc.input_tensors, qc.output_tensors, qc.weight, qc.bias, qc.target_device) == (None,) * 5


def test_quantization_spec_defaults_match_docs() -> None:
    spec = QuantizationSpec(dtype=Dtype.bfloat16)
    assert spec.is_dynamic is None
    assert spec.ch_axis is None and spec.group_size is None
    assert spec.symmetric is None and spec.round_method is None and spec.scale_type is None
    assert spec.zero_point_type is ZeroPointType.int32
    assert spec.qat_spec is None


def test_smoothquant_defaults() -> None:
    sq = SmoothQuantConfig()
    assert sq.name == "smoothquant"
    assert sq.alpha == 1
    assert sq.scale_clamp_min == 1e-3
    assert sq.scaling_layers is None
    assert sq.embedding_layers is None
    assert sq.model_decoder_layers is None


def test_awq_defaults() -> None:
    awq = AWQConfig()
    assert awq.name == "awq"
    assert awq.bit == 4
    assert awq.sym is False
    assert awq.group_size == 128
    assert awq.scaling_layers is None
    assert awq.model_decoder_layers is None
    assert awq.embedding_layers is None


def test_gptq_defaults() -> None:
    gptq = GPTQConfig()
    assert gptq.name == "gptq"
    assert gptq.bit == 4
    assert gptq.sym is False
    assert gptq.group_size == 128
    assert gptq.damp_percent == 0.01
    assert gptq.desc_act is True
    assert gptq.static_groups is False
    assert gptq.true_sequential is True
    assert gptq.inside_layer_modules is None
    assert gptq.model_decoder_layers is None
    assert gptq.embedding_layers is None


def test_block_and_cast_specs_fill_their_defaults() -> None:
    mx = QuantizationSpec(dtype=Dtype.mx, mx_element_dtype=Dtype.fp8_e4m3)
    assert mx.qscheme is QSchemeType.per_group and mx.ch_axis == -1 and mx.group_size == 32
    assert mx.observer_cls is PerBlockMXObserver
    bfp = QuantizationSpec(dtype="bfp16")
    assert bfp.observer_cls is PerBlockBFPObserver and bfp.group_size == 8
    assert QuantizationSpec(dtype="mx6").group_size == 16
    assert QuantizationSpec(dtype="float16").observer_cls is PlaceholderObserver


# ----------------------------------------------------------------------------------------------- string forms
def test_string_forms_equal_enum_forms() -> None:
    from_strings = QuantizationSpec(
        dtype="int8",
        qscheme="per_channel",
        observer_cls="PerChannelMinMaxObserver",
        symmetric=True,
        scale_type="float",
        round_method="half_even",
        ch_axis=0,
        zero_point_type="int32",
    )
    from_enums = int_spec(
        qscheme=QSchemeType.per_channel, observer_cls=PerChannelMinMaxObserver, ch_axis=0, is_dynamic=None
    )
    assert from_strings == from_enums
    assert from_strings.dtype is Dtype.int8
    assert from_strings.qscheme is QSchemeType.per_channel
    assert from_strings.observer_cls is PerChannelMinMaxObserver
    assert from_strings.round_method is RoundType.half_even


def test_string_forms_case_insensitive_and_nested() -> None:
    spec = QuantizationSpec(
        dtype="UINT4",
        qscheme="PER_TENSOR",
        observer_cls="PerTensorMinMaxObserver",
        symmetric=False,
        scale_type="POF2",
        round_method="ROUND",
        qat_spec={"method": "lsq"},
    )
    assert spec.dtype is Dtype.uint4
    assert spec.scale_type is ScaleType.pof2
    assert spec.round_method is RoundType.round
    assert spec.qat_spec == LSQSpec()
    qc = QuantizationConfig(weight={"dtype": "bfloat16"}, target_device="cpu")
    assert qc.weight == QuantizationSpec(dtype=Dtype.bfloat16)
    assert qc.target_device is DeviceType.CPU
    tqt = TQTSpec(threshold_init_meth="_kl_j")
    assert tqt.threshold_init_meth is TQTThresholdInitMeth._LL_J


# ----------------------------------------------------------------------------------------------- validation
def test_per_channel_without_ch_axis() -> None:
    with pytest.raises(ValueError, match="ch_axis"):
        int_spec(qscheme=QSchemeType.per_channel, observer_cls=PerChannelMinMaxObserver)


def test_per_group_without_group_size() -> None:
    with pytest.raises(ValueError, match="group_size"):
        int_spec(qscheme=QSchemeType.per_group, observer_cls=PerGroupMinMaxObserver, ch_axis=1)


def test_per_group_without_ch_axis() -> None:
    with pytest.raises(ValueError, match="ch_axis"):
        int_spec(qscheme=QSchemeType.per_group, observer_cls=PerGroupMinMaxObserver, group_size=32)


@pytest.mark.parametrize("group_size", [0, -1, -32])
def test_non_positive_group_size(group_size: int) -> None:
    with pytest.raises(ValueError, match="group_size"):
        int_spec(qscheme=QSchemeType.per_group, observer_cls=PerGroupMinMaxObserver, ch_axis=1, group_size=group_size)


def test_mx_without_element_dtype() -> None:
    with pytest.raises(ValueError, match="mx_element_dtype"):
        QuantizationSpec(
            dtype=Dtype.mx, observer_cls=PerBlockMXObserver, qscheme=QSchemeType.per_group, group_size=32, ch_axis=-1
        )


def test_mx_with_bad_element_dtype() -> None:
    with pytest.raises(ValueError, match="mx_element_dtype"):
        QuantizationSpec(dtype=Dtype.mx, mx_element_dtype=Dtype.int4)


def test_per_tensor_observer_on_per_channel_spec() -> None:
    with pytest.raises(ValueError, match="observer_cls.*PerTensorMinMaxObserver"):
        int_spec(qscheme=QSchemeType.per_channel, observer_cls=PerTensorMinMaxObserver, ch_axis=0)


def test_per_channel_observer_on_per_tensor_spec() -> None:
    with pytest.raises(ValueError, match="observer_cls"):
        int_spec(qscheme=QSchemeType.per_tensor, observer_cls=PerChannelMinMaxObserver)


@pytest.mark.parametrize(
    "observer",
    [PerTensorPercentileObserver, PerTensorMSEObserver, PerTensorHistogramObserver, PerTensorHistogramObserverPro],
)
@pytest.mark.parametrize("qscheme", [QSchemeType.per_channel, QSchemeType.per_group])
def test_histogram_family_rejects_per_channel_and_per_group(observer: type, qscheme: QSchemeType) -> None:
    with pytest.raises(ValueError, match=f"observer_cls.*{observer.__name__}"):
        int_spec(qscheme=qscheme, observer_cls=observer, ch_axis=0, group_size=32)


@pytest.mark.parametrize("field", ["symmetric", "round_method", "scale_type"])
def test_integer_dtype_requires_field(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        int_spec(**{field: None})


@pytest.mark.parametrize("field", ["symmetric", "round_method", "scale_type"])
def test_unsigned_integer_dtype_requires_field(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        int_spec(dtype=Dtype.uint4, **{field: None})


def test_minifloat_does_not_require_integer_fields() -> None:
    spec = QuantizationSpec(dtype=Dtype.fp8_e4m3, qscheme=QSchemeType.per_tensor, observer_cls=PerTensorMinMaxObserver)
    assert spec.symmetric is None


def test_scaled_dtype_requires_observer_and_qscheme() -> None:
    with pytest.raises(ValueError, match="observer_cls"):
        int_spec(observer_cls=None)
    with pytest.raises(ValueError, match="qscheme"):
        int_spec(qscheme=None)


def test_bad_dtype_string() -> None:
    with pytest.raises(ValueError, match="dtype.*int9x"):
        int_spec(dtype="int9x")


def test_unknown_observer_name() -> None:
    with pytest.raises(ValueError, match="observer_cls.*NoSuchObserver"):
        int_spec(observer_cls="NoSuchObserver")


def test_non_observer_class_rejected() -> None:
    with pytest.raises(ValueError, match="observer_cls"):
        int_spec(observer_cls=nn.Linear)


def test_bad_enum_strings_name_their_field() -> None:
    with pytest.raises(ValueError, match="qscheme"):
        int_spec(qscheme="per_row")
    with pytest.raises(ValueError, match="round_method"):
        int_spec(round_method="nearest")
    with pytest.raises(ValueError, match="scale_type"):
        int_spec(scale_type="pof3")
    with pytest.raises(ValueError, match="zero_point_type"):
        int_spec(zero_point_type="int8")


def test_from_dict_unknown_key_names_it_and_lists_allowed() -> None:
    with pytest.raises(ValueError, match="dtyp") as err:
        QuantizationSpec.from_dict({"dtyp": "int4"})
    message = str(err.value)
    assert "'dtyp'" in message
    assert "allowed" in message
    for key in ("dtype", "qscheme", "observer_cls", "group_size", "mx_element_dtype", "qat_spec"):
        assert key in message


def test_from_dict_missing_required_field_is_value_error() -> None:
    with pytest.raises(ValueError, match="dtype"):
        QuantizationSpec.from_dict({"qscheme": "per_tensor"})
    with pytest.raises(ValueError, match="global_quant_config"):
        Config.from_dict({"exclude": []})
    with pytest.raises(ValueError, match="weight.*dtype"):
        QuantizationConfig.from_dict({"weight": {"qscheme": "per_tensor"}})
    with pytest.raises(ValueError):
        QuantizationSpec.from_dict("int8")


def test_qat_specs_round_trip_on_their_own() -> None:
    for qat in (TQTSpec(), TQTSpec(threshold_init_meth="_3SD"), TQTSpec(threshold_init_meth="_LL_J"), LSQSpec()):
        assert json_round_trip(qat) == qat
    with pytest.raises(ValueError, match="method"):
        TQTSpec.from_dict({"method": "lsq"})


def test_from_dict_unknown_key_in_nested_config() -> None:
    with pytest.raises(ValueError, match="weight.*bogus"):
        QuantizationConfig.from_dict({"weight": {"dtype": "bfloat16", "bogus": 1}})
    with pytest.raises(ValueError, match="wieght"):
        QuantizationConfig.from_dict({"wieght": None})
    with pytest.raises(ValueError, match="global_quant_confg"):
        Config.from_dict({"global_quant_confg": {}})


def test_tqt_per_channel_is_accepted_and_per_group_refused() -> None:
    spec = int_spec(
        qscheme=QSchemeType.per_channel,
        observer_cls=PerChannelMinMaxObserver,
        ch_axis=0,
        scale_type=ScaleType.pof2,
        qat_spec=TQTSpec(),
    )
    assert spec.qscheme == QSchemeType.per_channel and spec.ch_axis == 0
    with pytest.raises(ValueError, match="qat_spec=TQTSpec needs qscheme=per_tensor or per_channel.*per_group"):
        int_spec(
            qscheme=QSchemeType.per_group,
            observer_cls=PerGroupMinMaxObserver,
            ch_axis=-1,
            group_size=32,
            scale_type=ScaleType.pof2,
            qat_spec=TQTSpec(),
        )


def test_tqt_takes_pof2_or_float_scale_type_and_needs_signed_symmetric() -> None:
    assert (
        int_spec(scale_type=ScaleType.float, qat_spec=TQTSpec()).qat_spec == TQTSpec()
    )  # amd-quark's examples write float
    with pytest.raises(ValueError, match="qat_spec.*pof2 or float"):
        int_spec(scale_type=ScaleType.bfloat16, qat_spec=TQTSpec())
    with pytest.raises(ValueError, match="qat_spec.*symmetric"):
        int_spec(scale_type=ScaleType.pof2, symmetric=False, qat_spec=TQTSpec())
    with pytest.raises(ValueError, match="qat_spec"):
        int_spec(dtype=Dtype.uint8, scale_type=ScaleType.pof2, qat_spec=TQTSpec())


def test_qat_spec_needs_integer_dtype() -> None:
    with pytest.raises(ValueError, match="qat_spec"):
        QuantizationSpec(
            dtype=Dtype.fp8_e4m3, qscheme="per_tensor", observer_cls=PerTensorMinMaxObserver, qat_spec=LSQSpec()
        )
    with pytest.raises(ValueError, match="qat_spec"):
        int_spec(qat_spec={"method": "nope"})


@pytest.mark.parametrize("dtype", [Dtype.mx6, Dtype.mx9])
def test_microexponent_odd_group_size(dtype: Dtype) -> None:
    with pytest.raises(ValueError, match="group_size"):
        QuantizationSpec(dtype=dtype, group_size=15)
    assert QuantizationSpec(dtype=dtype, group_size=16).group_size == 16


def test_block_format_rejects_other_qschemes() -> None:
    with pytest.raises(ValueError, match="qscheme"):
        QuantizationSpec(dtype=Dtype.mx, mx_element_dtype=Dtype.fp4, qscheme=QSchemeType.per_tensor)


def test_cast_rejects_min_max_observer() -> None:
    with pytest.raises(ValueError, match="observer_cls"):
        QuantizationSpec(dtype=Dtype.bfloat16, observer_cls=PerTensorMinMaxObserver, qscheme="per_tensor")


def test_non_bool_flags_rejected() -> None:
    with pytest.raises(ValueError, match="is_dynamic"):
        int_spec(is_dynamic="yes")
    with pytest.raises(ValueError, match="symmetric"):
        int_spec(symmetric=1)
    with pytest.raises(ValueError, match="ch_axis"):
        int_spec(qscheme=QSchemeType.per_channel, observer_cls=PerChannelMinMaxObserver, ch_axis=True)


def test_nested_errors_name_the_role() -> None:
    with pytest.raises(ValueError, match="weight"):
        QuantizationConfig(weight={"dtype": "int9x"})
    with pytest.raises(ValueError, match="weight"):
        QuantizationConfig(weight=3)
    with pytest.raises(ValueError, match="target_device"):
        QuantizationConfig(target_device="gpu")


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="exclude"):
        Config(global_quant_config=QuantizationConfig(), exclude="lm_head")
    with pytest.raises(ValueError, match="global_quant_config"):
        Config(global_quant_config=None)
    with pytest.raises(ValueError, match="layer_type_quant_config"):
        Config(global_quant_config=QuantizationConfig(), layer_type_quant_config={3: QuantizationConfig()})
    with pytest.raises(ValueError, match="algo_config"):
        Config(global_quant_config=QuantizationConfig(), algo_config={"name": "nope"})
    with pytest.raises(ValueError, match="pre_quant_opt_config"):
        Config(global_quant_config=QuantizationConfig(), pre_quant_opt_config=GPTQConfig())
    with pytest.raises(ValueError, match="quant_mode"):
        Config(global_quant_config=QuantizationConfig(), quant_mode="graph")


def test_algo_config_validation() -> None:
    with pytest.raises(ValueError, match="alpha"):
        SmoothQuantConfig(alpha=1.5)
    with pytest.raises(ValueError, match="scale_clamp_min"):
        SmoothQuantConfig(scale_clamp_min=0)
    with pytest.raises(ValueError, match="damp_percent"):
        GPTQConfig(damp_percent=0)
    with pytest.raises(ValueError, match="bit"):
        GPTQConfig(bit=0)
    with pytest.raises(ValueError, match="group_size"):
        AWQConfig(group_size=0)
    assert AWQConfig(group_size=-1).group_size == -1
    with pytest.raises(ValueError, match="scaling_layers"):
        AWQConfig(scaling_layers=[{"prev_op": "ln", "layers": ["q"], "oops": 1}])
    with pytest.raises(ValueError, match="embedding_layers"):
        SmoothQuantConfig(embedding_layers="embed")


# ----------------------------------------------------------------------------------------------- to_dict / from_dict
ROUND_TRIP_SPECS = [
    int_spec(),
    int_spec(dtype=Dtype.uint8, symmetric=False, zero_point_type=ZeroPointType.float32, round_method=RoundType.round),
    int_spec(qscheme=QSchemeType.per_channel, observer_cls=PerChannelMinMaxObserver, ch_axis=0, is_dynamic=True),
    int_spec(
        dtype=Dtype.int4, qscheme=QSchemeType.per_group, observer_cls=PerGroupMinMaxObserver, ch_axis=1, group_size=128
    ),
    int_spec(observer_cls=PerTensorPercentileObserver, scale_type=ScaleType.bfloat16),
    int_spec(scale_type=ScaleType.pof2, qat_spec=TQTSpec(threshold_init_meth=TQTThresholdInitMeth._LL_J)),
    int_spec(scale_type=ScaleType.pof2, qat_spec=TQTSpec()),
    int_spec(qscheme=QSchemeType.per_channel, observer_cls=PerChannelMinMaxObserver, ch_axis=0, qat_spec=LSQSpec()),
    QuantizationSpec(
        dtype=Dtype.mx,
        mx_element_dtype=Dtype.fp4,
        observer_cls=PerBlockMXObserver,
        qscheme=QSchemeType.per_group,
        ch_axis=-1,
        group_size=32,
        is_dynamic=True,
    ),
    QuantizationSpec(dtype=Dtype.fp8_e4m3, qscheme=QSchemeType.per_tensor, observer_cls=PerTensorMSEObserver),
    QuantizationSpec(dtype=Dtype.bfloat16, observer_cls=PlaceholderObserver),
    QuantizationSpec(dtype=Dtype.bfp16),
]


@pytest.mark.parametrize(
    "spec", ROUND_TRIP_SPECS, ids=lambda s: f"{s.dtype.name}-{s.qscheme.name if s.qscheme else None}"
)
def test_spec_json_round_trip(spec: QuantizationSpec) -> None:
    data = spec.to_dict()
    text = json.dumps(data)  # plain JSON types only
    back = QuantizationSpec.from_dict(json.loads(text))
    assert back == spec
    assert back.observer_cls is spec.observer_cls
    assert type(back.qat_spec) is type(spec.qat_spec)


def test_spec_to_dict_uses_names() -> None:
    spec = int_spec(scale_type=ScaleType.pof2, qat_spec=TQTSpec(threshold_init_meth="_kl_j"))
    data = spec.to_dict()
    assert data["dtype"] == "int8"
    assert data["qscheme"] == "per_tensor"
    assert data["observer_cls"] == "PerTensorMinMaxObserver"
    assert data["round_method"] == "half_even"
    assert data["qat_spec"] == {"method": "tqt", "threshold_init_meth": "_LL_J"}
    mx = QuantizationSpec(dtype=Dtype.mx, mx_element_dtype=Dtype.fp6_e2m3)
    assert mx.to_dict()["mx_element_dtype"] == "fp6_e2m3"


def test_quantization_config_round_trip() -> None:
    qc = QuantizationConfig(
        input_tensors=int_spec(is_dynamic=True),
        output_tensors=int_spec(dtype=Dtype.uint8, symmetric=False, zero_point_type="float32"),
        weight=int_spec(qscheme=QSchemeType.per_channel, observer_cls=PerChannelMinMaxObserver, ch_axis=0),
        bias=QuantizationSpec(dtype=Dtype.bfloat16),
        target_device=DeviceType.IPU,
    )
    assert json_round_trip(qc) == qc
    assert json_round_trip(QuantizationConfig()) == QuantizationConfig()


def test_config_round_trip_with_class_keys_and_algo_lists() -> None:
    w4 = int_spec(
        dtype=Dtype.int4, qscheme=QSchemeType.per_group, observer_cls=PerGroupMinMaxObserver, ch_axis=1, group_size=32
    )
    cfg = Config(
        global_quant_config=QuantizationConfig(input_tensors=int_spec(), weight=int_spec()),
        layer_type_quant_config={
            nn.Linear: QuantizationConfig(weight=w4),
            "Conv2d": QuantizationConfig(weight=int_spec()),
        },
        layer_quant_config={"*.fc2": QuantizationConfig(weight=QuantizationSpec(dtype="mx", mx_element_dtype="fp4"))},
        exclude=["lm_head"],
        algo_config=[AWQConfig(model_decoder_layers="model.layers"), GPTQConfig(damp_percent=0.1, desc_act=False)],
        pre_quant_opt_config=[
            SmoothQuantConfig(alpha=0.5, scaling_layers=[{"prev_op": "ln", "layers": ["q", "k"], "inp": "q"}])
        ],
        quant_mode=QuantizationMode.eager_mode,
    )
    assert set(cfg.layer_type_quant_config) == {"Linear", "Conv2d"}  # the class became its name
    data = json.loads(json.dumps(cfg.to_dict()))
    assert set(data["layer_type_quant_config"]) == {"Linear", "Conv2d"}
    assert [a["name"] for a in data["algo_config"]] == ["awq", "gptq"]
    back = Config.from_dict(data)
    assert back == cfg
    assert isinstance(back.algo_config, list)
    assert [type(a) for a in back.algo_config] == [AWQConfig, GPTQConfig]
    assert back.algo_config[1].damp_percent == 0.1
    assert back.algo_configs == back.algo_config
    assert back.pre_quant_opt_configs[0].alpha == 0.5
    assert back.quant_mode is QuantizationMode.eager_mode
    graph = Config(
        global_quant_config=QuantizationConfig(weight=int_spec()),
        quant_mode="fx_graph_mode",
        pre_quant_opt_config=[CLEConfig(iterations=3, high_bias_absorption=False)],
    )
    back = Config.from_dict(json.loads(json.dumps(graph.to_dict())))
    assert back == graph and back.quant_mode is QuantizationMode.fx_graph_mode
    assert back.pre_quant_opt_configs[0].iterations == 3


def test_config_round_trip_single_algos() -> None:
    cfg = Config(
        global_quant_config=QuantizationConfig(weight=int_spec()),
        algo_config=GPTQConfig(),
        pre_quant_opt_config=SmoothQuantConfig(),
    )
    back = json_round_trip(cfg)
    assert back == cfg
    assert isinstance(back.algo_config, GPTQConfig)
    assert isinstance(back.pre_quant_opt_config, SmoothQuantConfig)
    assert back.algo_configs == [GPTQConfig()]


def test_algo_configs_round_trip() -> None:
    for algo in (
        GPTQConfig(inside_layer_modules=["self_attn.q_proj"]),
        AWQConfig(bit=8, sym=True),
        SmoothQuantConfig(),
    ):
        assert json_round_trip(algo) == algo


def test_config_from_dicts_equals_config_from_objects() -> None:
    from_objects = Config(
        global_quant_config=QuantizationConfig(weight=int_spec(is_dynamic=None)),
        algo_config=GPTQConfig(),
    )
    from_dicts = Config(
        global_quant_config={
            "weight": {
                "dtype": "int8",
                "qscheme": "per_tensor",
                "observer_cls": "PerTensorMinMaxObserver",
                "symmetric": True,
                "scale_type": "float",
                "round_method": "half_even",
            }
        },
        algo_config={"name": "gptq"},
    )
    assert from_dicts == from_objects
