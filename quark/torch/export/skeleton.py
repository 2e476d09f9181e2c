"""Model skeletons for import: Parameters on the meta device (no memory, no initialisation), buffers real, so
that buffers a checkpoint does not hold (a rotary embedding's ``inv_freq``) keep the values their module computed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark.torch.compat import buffer_registry, parameter_registry
from quark.torch.extras import import_extra

__all__ = ["parameters_on_meta", "hf_skeleton", "materialize", "meta_tensors"]


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside have every Parameter on the meta device (their initialisation runs on meta: free)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            parameter_registry(module)[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def hf_skeleton(
    model_dir: str | Path,
    trust_remote_code: bool = False,
    attn_implementation: str = "eager",
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """The Hugging Face model ``model_dir/config.json`` describes, Parameters on meta (amd-quark's ``model=None``),
    in ``dtype`` when given (else config.json's, or float32)."""
    transformers = import_extra(
        "transformers", "hf", "import_model_from_safetensors(model=None, ...) (it builds a Hugging Face model)"
    )
    config = transformers.AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # applied by this import, not by transformers
    cls = _architecture(transformers, getattr(config, "architectures", None), Path(model_dir) / "config.json")
    with parameters_on_meta():
        if cls is not None:
            model = cls._from_config(config, attn_implementation=attn_implementation, dtype=dtype or config.dtype)
        else:
            model = transformers.AutoModelForCausalLM.from_config(
                config,
                trust_remote_code=trust_remote_code,
                attn_implementation=attn_implementation,
                dtype=dtype or config.dtype,
            )
    return model.eval()


def _architecture(transformers: Any, archs: Any, path: Path) -> type | None:
    """The model class config.json's ``architectures[0]`` names (None: none named, or a class transformers does not
    have, which ``AutoModelForCausalLM`` builds, with remote code where allowed); a name of transformers that is no
    model class (``AutoModelForCausalLM``, a function) is a ValueError naming the key."""
    if archs is None or archs == []:
        return None
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(
            f"{path}: architectures={archs!r} must be a list of model class names (e.g. ['LlamaForCausalLM'])"
        )
    cls = getattr(transformers, archs[0], None)
    if cls is None:
        return None
    if not (
        isinstance(cls, type)
        and issubclass(cls, transformers.PreTrainedModel)
        and not cls.__name__.startswith("PreTrained")
    ):
        raise ValueError(
            f"{path}: architectures[0]={archs[0]!r} is not a model class of transformers; it names the class "
            "the model was saved from (e.g. 'LlamaForCausalLM'), as save_pretrained writes it"
        )
    return cls


def meta_tensors(model: nn.Module) -> tuple[list[str], list[str]]:
    """(Parameter names, buffer names) of ``model`` on the meta device."""
    params = [n for n, p in model.named_parameters(remove_duplicate=False) if p.device.type == "meta"]
    buffers = [n for n, b in model.named_buffers(remove_duplicate=False) if b.device.type == "meta"]
    return params, buffers


def materialize(model: nn.Module, device: torch.device | str | None, stored: set[str]) -> None:
    """Give every meta Parameter uninitialised storage on ``device`` (tied ones stay tied), for an import that
    fills each of them; a meta buffer the file does not hold (``stored``) cannot be recovered: ValueError naming it."""
    params, buffers = meta_tensors(model)
    lost = [b for b in buffers if b not in stored]
    if lost:
        raise ValueError(
            f"buffer(s) {lost[:4]} are on the meta device and not in the file: their values are lost. Build the "
            "skeleton with quark.torch.export.skeleton.parameters_on_meta() (buffers stay real), or pass model=None"
        )
    target = torch.device(device) if device is not None else torch.device("cpu")
    new: dict[int, Any] = {}
    for module in model.modules():
        params, buffers = parameter_registry(module), buffer_registry(module)
        for name, p in list(params.items()):
            if p is not None and p.device.type == "meta":
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty_like(p, device=target), requires_grad=p.requires_grad)
                params[name] = new[id(p)]
        for name, b in list(buffers.items()):
            if b is not None and b.device.type == "meta":
                buffers[name] = torch.empty_like(b, device=target)
