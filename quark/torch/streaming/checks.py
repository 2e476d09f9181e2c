"""What a streamed quantization refuses, checked on the model skeleton before any weight is read: each refusal
names what cannot stream and what to do instead."""

from __future__ import annotations

from typing import Any

from torch import nn

from quark.torch.algorithm.structure import MODEL_FAMILIES, find_decoder_layers
from quark.torch.quantization.batches import needs_data
from quark.torch.quantization.config.config import AWQConfig, Config, GPTQConfig, SmoothQuantConfig
from quark.torch.quantization.config.type import QuantizationMode
from quark.torch.quantization.nn.modules import QuantMixin

__all__ = ["STREAMED_ALGORITHMS", "check_config", "check_prepared", "decoder_stack"]

#: the algorithm configs a streamed run applies per decoder layer (each as the in-memory path does)
STREAMED_ALGORITHMS = (SmoothQuantConfig, AWQConfig, GPTQConfig)


def check_config(config: Config, batches: list[Any] | None) -> None:
    """The parts of ``config`` that need the whole model at once are refused, and algorithms need batches.

    Raises:
        ValueError: graph mode, a KV-cache or softmax spec, an algorithm other than SmoothQuant, AWQ and one GPTQ,
            or algorithms without calibration batches.
    """
    if config.quant_mode == QuantizationMode.fx_graph_mode:
        raise ValueError(
            "streamed quantization works on Hugging Face decoder layers in eager mode; quant_mode=fx_graph_mode "
            "captures the whole model as one graph: use ModelQuantizer on a model that fits in memory"
        )
    if config.kv_cache_quant_config or config.softmax_quant_spec is not None:
        raise ValueError(
            "streamed quantization does not calibrate KV-cache or softmax scales (they need the calibration forward "
            "of the whole model): remove kv_cache_quant_config / softmax_quant_spec, or quantize in memory"
        )
    algos = config.pre_quant_opt_configs + config.algo_configs
    other = [type(a).__name__ for a in algos if not isinstance(a, STREAMED_ALGORITHMS)]
    if other:
        raise ValueError(
            f"streamed quantization runs {[c.__name__ for c in STREAMED_ALGORITHMS]} one decoder layer at a time; "
            f"{other} cannot stream: quantize in memory (ModelQuantizer) instead"
        )
    if sum(isinstance(a, GPTQConfig) for a in algos) > 1:
        raise ValueError("streamed quantization runs at most one GPTQConfig; the Config has several")
    if algos and not batches:
        raise ValueError(
            f"{[type(a).__name__ for a in algos]} need calibration batches: pass a non-empty list of batches "
            "(each as the model takes it: a dict such as {'input_ids': ...}, or a tensor of token ids)"
        )


def check_prepared(model: nn.Module) -> None:
    """The prepared skeleton has no quantizer that needs the whole model's calibration forward or training.

    Raises:
        ValueError: a static activation quantizer (its scale comes from calibrating the whole model) or a learnable
            (QAT) quantizer, naming the first layer.
    """
    if needs_data(model):
        raise ValueError(
            "streamed quantization supports weight-only configs and dynamic activation quantization; this Config "
            "has static activation quantizers (input/output tensors with calibrated scales), which need the "
            "calibration forward of the whole model: make them dynamic (is_dynamic: true), drop them, or quantize "
            "in memory"
        )
    for name, m in model.named_modules():
        if isinstance(m, QuantMixin):
            for _, q in m.quantizer_slots():
                if getattr(q.spec, "qat_spec", None) is not None:
                    raise ValueError(
                        f"layer '{name}' has a learnable quantizer ({type(q.spec.qat_spec).__name__}): that is "
                        "quantization-aware training, which trains the whole model; streamed quantization is PTQ "
                        "(RTN, GPTQ, AWQ, SmoothQuant). Train with QuantCallback, then stream the trained checkpoint "
                        "with a PTQ config"
                    )


def decoder_stack(model: nn.Module, config: Config) -> tuple[str, nn.ModuleList]:
    """The decoder stack every algorithm of ``config`` works on (``model_decoder_layers`` or the model family's).

    Raises:
        ValueError: the model has no stack of a known family, or the algorithms name different stacks.
    """
    paths = {getattr(a, "model_decoder_layers", None) for a in config.pre_quant_opt_configs + config.algo_configs}
    found = {find_decoder_layers(model, p) for p in paths or {None}}
    stacks = {f[0] if f is not None else None for f in found}
    if None in stacks:
        raise ValueError(
            f"streamed quantization goes one decoder layer at a time, and {type(model).__name__} has no stack of "
            f"decoder layers of a known family ({[f.name for f in MODEL_FAMILIES]}): give model_decoder_layers in "
            "the algorithm config, add a ModelFamily to quark.torch.algorithm.structure.MODEL_FAMILIES, or quantize "
            "in memory"
        )
    if len(stacks) > 1:
        raise ValueError(f"the algorithm configs name different decoder stacks {sorted(stacks)}; give one")
    name = stacks.pop()
    return name, model.get_submodule(name)  # type: ignore[arg-type, return-value]
