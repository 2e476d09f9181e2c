"""The loss keywords of a captured Hugging Face model (``labels=``), computed outside the graph.

A graph captured from ``model(input_ids=...)`` takes exactly the keywords of that call: a training step written as
``self.model(input_ids=ids, labels=ids).loss`` would hit torch's ``unexpected keyword argument 'labels'``. For a
causal or masked LM (transformers' ``loss_type`` ``ForCausalLM`` / ``ForMaskedLM``), the graph runs without the loss
keywords and the loss is computed from its logits with the model's own ``loss_function``, which is what the model's
forward does; capture checks that on the example (float model, the example's token ids as labels) and keeps the
support only where the two agree. Any other model called with a loss keyword gets a ValueError saying what to do.
Hooks do the work (pre-hook: take the keywords; hook: add the loss), so the graph stays a plain GraphModule.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import fx, nn

from quark.torch.quantization.hf import no_kv_cache
from quark.torch.quantization.state import preserve_modes

__all__ = ["LOSS_KEYWORDS", "GraphLoss", "attach_loss", "carry_hf_attributes", "drop_unset_loss_keywords"]

#: the keywords through which a Hugging Face model's forward receives what its loss needs
LOSS_KEYWORDS = ("labels", "num_items_in_batch", "shift_labels", "ignore_index")
#: loss types whose loss is ``loss_function(logits=, labels=, vocab_size=, ...)`` on the model's own logits
_LM_LOSSES = ("ForCausalLM", "ForMaskedLM")


def _has_loss_function(model: nn.Module) -> bool:
    """A Hugging Face model (transformers' ``PreTrainedModel.loss_function``): the ones ``attach_loss`` serves."""
    return hasattr(type(model), "loss_function")


def drop_unset_loss_keywords(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face model's example keywords without loss keywords left None (``labels=None``: the default), so the
    graph does not bake them in as constants (the loss hooks take them at call time); other models' as they are."""
    if not _has_loss_function(model):
        return kwargs
    return {k: v for k, v in kwargs.items() if not (k in LOSS_KEYWORDS and v is None)}


class GraphLoss:
    """Forward hooks of a captured graph that take the loss keywords the graph was not captured with and, where the
    model's loss is known (``loss_function`` set), add the loss to the output as the model would."""

    def __init__(
        self,
        name: str,
        accepted: frozenset[str],
        loss_function: Any = None,
        vocab_size: int | None = None,
        why: str = "",
    ) -> None:
        self.name = name  # the model's class, for messages
        self.accepted = accepted  # keywords the graph takes
        self.loss_function = loss_function
        self.vocab_size = vocab_size
        self.why = why  # why the loss is not computed here (empty when it is)
        self._pending: list[dict[str, Any]] = []

    def pre_hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Take the loss keywords the graph does not accept out of the call."""
        taken = {k: kwargs.pop(k) for k in LOSS_KEYWORDS if k in kwargs and k not in self.accepted}
        if taken.get("labels") is not None and self.loss_function is None:
            raise ValueError(
                f"graph mode: the captured graph of {self.name} takes no 'labels' ({self.why}). Compute the loss from "
                "the outputs in your step (e.g. F.cross_entropy on out.logits), or capture with the labels in the "
                "example batch (example_input_array / the first batch) so that the graph computes it"
            )
        self._pending.append(taken)
        return args, kwargs

    def hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        """The output with the loss of the taken keywords (as the model returns it: ``loss`` first)."""
        taken = self._pending.pop() if self._pending else {}
        labels = taken.pop("labels", None)
        if labels is None or output is None:  # no loss asked for, or the forward raised
            return output
        logits = output["logits"] if isinstance(output, dict) else output[0]
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size, **taken)
        if isinstance(output, dict):  # a ModelOutput: its dataclass orders the fields, loss first
            return type(output)(**{**output, "loss": loss})
        return (loss, *output)

    def register(self, gm: fx.GraphModule) -> None:
        """Install the hooks on ``gm`` (and keep this object as ``gm.hf_loss`` for copies: ``carry_hf_attributes``)."""
        gm.register_forward_pre_hook(self.pre_hook, with_kwargs=True, prepend=True)  # before torch.export's input check
        gm.register_forward_hook(self.hook, with_kwargs=True, always_call=True)
        gm.hf_loss = self


def _same_loss(model: nn.Module, kwargs: dict[str, Any], loss_function: Any, vocab_size: int) -> bool:
    """Whether the model's own loss on the example (its token ids as labels) is ``loss_function`` of its logits."""
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        return False
    with preserve_modes(model, mode=False), torch.no_grad(), no_kv_cache(model):
        out = model(**{**kwargs, "labels": ids})
        expected = getattr(out, "loss", None)
        if not isinstance(expected, torch.Tensor):
            return False
        loss = loss_function(logits=out.logits, labels=ids, vocab_size=vocab_size)
        return bool(torch.allclose(loss, expected, rtol=1e-6, atol=0))


def attach_loss(gm: fx.GraphModule, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Give the graph of a Hugging Face model (one with ``loss_function``) the loss keywords it was not captured with
    (see the module docstring); nothing for other models, or when the graph takes ``labels`` itself."""
    if not _has_loss_function(model):
        return
    try:
        accepted = frozenset(inspect.signature(model.forward).bind(*args, **kwargs).arguments)
    except TypeError:
        return
    if "labels" in accepted:
        return  # captured with labels: the graph computes the loss
    name = type(model).__name__
    loss_type = getattr(model, "loss_type", None)
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    if loss_type not in _LM_LOSSES or vocab_size is None:
        GraphLoss(
            name, accepted, why=f"its loss_type {loss_type!r} is not one computed outside the graph: {list(_LM_LOSSES)}"
        ).register(gm)
        return
    loss_function = model.loss_function
    if not _same_loss(model, kwargs, loss_function, vocab_size):
        GraphLoss(
            name, accepted, why="its forward's loss is not loss_function(logits, labels) on the example"
        ).register(gm)
        return
    GraphLoss(name, accepted, loss_function, vocab_size).register(gm)


def carry_hf_attributes(source: fx.GraphModule, copy: fx.GraphModule) -> None:
    """What a deep copy of a captured Hugging Face graph drops: its ``config`` (the amd-quark export writes it into
    config.json) and the loss hooks."""
    if getattr(source, "config", None) is not None:
        copy.config = source.config
    loss: GraphLoss | None = getattr(source, "hf_loss", None)
    if loss is not None:
        GraphLoss(loss.name, loss.accepted, loss.loss_function, loss.vocab_size, loss.why).register(copy)
