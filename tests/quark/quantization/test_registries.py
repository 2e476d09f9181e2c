"""The observer and algorithm registries: one place each, read by validation and the engine."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import quark.torch  # noqa: F401 - registers the algorithms' handlers
from quark.torch.quantization.algo_registry import algorithm_entry, algorithm_stage
from quark.torch.quantization.config.config import (
    AlgoConfig,
    AWQConfig,
    CLEConfig,
    Config,
    GPTQConfig,
    SmoothQuantConfig,
)
from quark.torch.quantization.config.spec import QuantizationSpec
from quark.torch.quantization.observer import observer as observer_module
from quark.torch.quantization.observer.observer import ObserverBase, PerTensorMinMaxObserver
from quark.torch.quantization.observer.registry import OBSERVER_MAP, observer_class, observer_methods

DOCUMENTED = [n for n in observer_module.__all__ if n.endswith("Observer") or n == "ObserverBase"]


@pytest.mark.parametrize("name", DOCUMENTED)
def test_every_documented_observer_name_resolves_to_its_class(name: str) -> None:
    assert observer_class(name) is getattr(observer_module, name)


def test_amd_quark_observer_methods_name_registered_observers() -> None:
    methods = observer_methods()
    assert methods == {
        "min_max": "PerTensorMinMaxObserver",
        "histogram": "PerTensorHistogramObserver",
        "histogrampro": "PerTensorHistogramObserverPro",
        "MSE": "PerTensorMSEObserver",
        "percentile": "PerTensorPercentileObserver",
    }
    assert all(observer_class(c) is not None for c in methods.values())


def test_a_new_observer_subclass_registers_itself() -> None:
    class RegistryTestObserver(PerTensorMinMaxObserver):
        pass

    try:
        assert OBSERVER_MAP["RegistryTestObserver"] is RegistryTestObserver
        spec = QuantizationSpec(
            dtype="int8",
            qscheme="per_tensor",
            observer_cls="RegistryTestObserver",
            symmetric=True,
            round_method="half_even",
            scale_type="float",
        )
        assert spec.observer_cls is RegistryTestObserver
    finally:
        OBSERVER_MAP.pop("RegistryTestObserver")


def test_unknown_observer_name_lists_the_allowed_ones() -> None:
    with pytest.raises(
        ValueError, match="observer_cls='NoSuchObserver' is not an observer; allowed: .*PerTensorMinMaxObserver"
    ):
        QuantizationSpec(dtype="int8", qscheme="per_tensor", observer_cls="NoSuchObserver")
    with pytest.raises(ValueError, match="is not an observer"):
        observer_class(int)


def test_an_unregistered_class_is_not_an_observer() -> None:
    class NotAnObserver:
        pass

    with pytest.raises(ValueError, match="allowed: "):
        observer_class(NotAnObserver)
    assert issubclass(PerTensorMinMaxObserver, ObserverBase)


@pytest.mark.parametrize(
    ("config", "stage", "handler"),
    [
        (SmoothQuantConfig(), "before_calibration", "run_smoothquant"),
        (AWQConfig(), "before_calibration", "run_awq"),
        (GPTQConfig(), "after_calibration", "run_gptq"),
        (CLEConfig(), "graph", "_equalize"),
    ],
)
def test_each_algorithm_config_maps_to_its_stage_and_handler(config: AlgoConfig, stage: str, handler: str) -> None:
    entry = algorithm_entry(config, need_handler=True)
    assert algorithm_stage(config) == stage
    assert entry.handler is not None and entry.handler.__name__ == handler


@dataclass(eq=True)
class _UnregisteredConfig(AlgoConfig):
    name: str = "unregistered"


def test_an_unregistered_algorithm_config_gets_a_clear_error() -> None:
    with pytest.raises(
        ValueError, match=r"_UnregisteredConfig is not registered; allowed: \[.*'GPTQConfig'.*register_algorithm"
    ):
        algorithm_stage(_UnregisteredConfig())
    with pytest.raises(ValueError, match="_UnregisteredConfig is not registered"):
        Config(
            global_quant_config={
                "weight": {
                    "dtype": "int8",
                    "qscheme": "per_tensor",
                    "observer_cls": "PerTensorMinMaxObserver",
                    "symmetric": True,
                    "round_method": "half_even",
                    "scale_type": "float",
                }
            },
            algo_config=_UnregisteredConfig(),
        )
