"""Graph mode of QuantCallback: capture the module's children on their recorded calls, and recapture them to load."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from callbacks.calibration_data import as_model_input
from callbacks.quantizer_state import keep_out_of_ddp_broadcast
from quark.torch import ModelQuantizer
from quark.torch.quantization import graph
from quark.torch.quantization.api import format_plans, run_batch
from quark.torch.quantization.state import preserve_modes


def call_spec(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """What recapturing a child needs of the call it was captured from (``self.net(x)``, ``self.model(input_ids=...,
    use_cache=False)``), in a form ``torch.load(weights_only=True)`` reads: positional and keyword arguments, tensors
    as shape and dtype, plain constants as they are."""
    return {"args": [_value_spec(a) for a in args], "kwargs": {k: _value_spec(v) for k, v in kwargs.items()}}


def _value_spec(value: Any) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
    if value is None or isinstance(value, bool | int | float | str):
        return {"value": value}
    return {"unsupported": type(value).__name__}


def _example_value(spec: Any, where: str, device: torch.device) -> Any:
    """An argument like the recorded one: a tensor of its shape and dtype (ones for integer and bool tensors: a valid
    token id, an attention mask that masks nothing; zeros for floats), or the recorded constant."""
    if isinstance(spec, list | tuple):  # written before keywords were recorded: [shape, dtype] of a positional tensor
        spec = {"shape": spec[0], "dtype": spec[1]}
    if not isinstance(spec, dict) or not ({"shape", "value"} & set(spec)):
        kind = spec.get("unsupported") if isinstance(spec, dict) else type(spec).__name__
        raise ValueError(
            f"{where}: the recorded argument is a {kind}, which cannot be recreated to recapture the graph"
        )
    if "value" in spec:
        return spec["value"]
    dtype = getattr(torch, spec["dtype"])
    fill = torch.zeros if dtype.is_floating_point or dtype.is_complex else torch.ones
    return fill(spec["shape"], dtype=dtype, device=device)


def prepare_graphs_like(model: nn.Module, quantizer: ModelQuantizer, inputs: dict[str, Any], path: str) -> None:
    """Graph mode: capture the children the callback captured, called as they were (positional and keyword
    arguments), on tensors of the recorded shapes and dtypes."""
    if not inputs:
        raise ValueError(
            f"{path} is a graph-mode checkpoint without the captured children's input shapes (written by an older version?)"
        )
    for name, spec in inputs.items():
        child = getattr(model, name)
        device = next((p.device for p in child.parameters()), torch.device("cpu"))
        if isinstance(spec, list):  # written before keywords were recorded: the positional tensors only
            spec = {"args": spec, "kwargs": {}}
        where = f"{path}: graph input of '{name}'"
        args = tuple(_example_value(a, f"{where} {i}", device) for i, a in enumerate(spec.get("args", [])))
        kwargs = {k: _example_value(v, f"{where} '{k}'", device) for k, v in spec.get("kwargs", {}).items()}
        setattr(model, name, quantizer.prepare(graph.capture(child, args, kwargs), name_prefix=f"{name}."))


class GraphCapture:
    """Mixin of QuantCallback: graph mode's capture of the module's children in ``setup``."""

    def _prepare_graphs(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Graph mode: capture each child of the module that holds Parameters and that one forward calls once (on
        ``example_input_array`` or the first batch), and put its quantized graph in its place; the LightningModule,
        its steps, logging and checkpointing stay as they are (state_dict keys keep the child's name)."""
        calls = self._record_child_calls(trainer, pl_module)
        prepared, skipped = [], []
        for name, child in list(pl_module.named_children()):
            if next(child.parameters(), None) is None:
                continue
            if len(calls.get(name, [])) != 1:
                skipped.append(f"{name} (called {len(calls.get(name, []))} times by one forward)")
                continue
            args, kwargs = calls[name][0]
            gm = graph.capture(child, args, kwargs)
            setattr(pl_module, name, self.quantizer.prepare(gm, name_prefix=f"{name}."))
            self._graph_inputs[name] = call_spec(args, kwargs)
            prepared.append(name)
        if not prepared:
            raise ValueError(
                f"QuantCallback (fx_graph_mode): no child module of {type(pl_module).__name__} holding Parameters is called "
                f"exactly once by its forward ({skipped}); graph mode captures such children. {graph.EAGER_FALLBACK}."
            )
        if skipped:
            rank_zero_warn(f"QuantCallback (fx_graph_mode): these children stay float: {skipped}")
        plans = [p for name in prepared for p in self.quantizer.resolve(getattr(pl_module, name))]
        pl_module.quant_config = self.config  # the exporters read the Config of the module they write, as in eager mode
        keep_out_of_ddp_broadcast(pl_module)
        if not self._table_logged:
            rank_zero_info(
                f"QuantCallback ({self.mode}, graph mode: {prepared}): quantizing {len(plans)} op(s)\n{format_plans(plans)}"
            )
            self._table_logged = True

    def _record_child_calls(
        self, trainer: Trainer, pl_module: LightningModule
    ) -> dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]]:
        """The arguments each direct child receives in one forward of ``pl_module`` (eval, no_grad)."""
        example = getattr(pl_module, "example_input_array", None)
        batch = None if example is not None else self._example_batch(trainer, pl_module)
        calls: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {}

        def record(name: str) -> Callable[..., None]:
            return lambda module, args, kwargs: calls.setdefault(name, []).append((args, kwargs))

        hooks = [
            child.register_forward_pre_hook(record(name), with_kwargs=True)
            for name, child in pl_module.named_children()
        ]
        try:
            with preserve_modes(pl_module, mode=False), torch.no_grad():
                if example is not None:
                    if isinstance(example, dict):
                        pl_module(**example)
                    else:
                        pl_module(*(example if isinstance(example, tuple) else (example,)))
                elif self.calib_forward is not None:
                    self.calib_forward(pl_module, batch)
                else:
                    run_batch(pl_module, as_model_input(pl_module, batch))
        finally:
            for h in hooks:
                h.remove()
        return calls
