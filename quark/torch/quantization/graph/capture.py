"""Capture a model as an FX graph with ``torch.export`` and make the graph train/eval aware again.

torch 2.13 has no ``torch.export.export_for_training``; ``torch.export.export`` returns the same training IR
(``aten.conv2d``, ``aten.batch_norm``, ``aten.dropout``, not decomposed). The batch dimension is captured dynamic,
so the last, smaller batch of an epoch runs too. Capture bakes the mode of BatchNorm and dropout into the graph;
``normalize`` turns those calls back into modules, so ``graph.train()`` / ``graph.eval()`` work as on the model.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch
from torch import fx, nn

from quark.torch.quantization.graph.loss import attach_loss, drop_unset_loss_keywords
from quark.torch.quantization.hf import no_kv_cache

__all__ = ["GraphModeError", "capture", "normalize", "is_graph_module", "module_path", "fetch_attr", "example_inputs"]

EAGER_FALLBACK = "Config(quant_mode=QuantizationMode.eager_mode) quantizes such a model by swapping its layers instead"
#: key of ``GraphModule.meta`` holding the (args, kwargs) a graph was captured with: the batch the function-preserving
#: passes (BatchNorm folding, CLE) run to check that they kept the function; ``meta`` survives ``copy.deepcopy``
EXAMPLE_KEY = "quark_example_inputs"
_BATCH_NORMS = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


class GraphModeError(ValueError):
    """A model or an op that graph mode cannot handle; the message names the op, the node and the fallback."""


def is_graph_module(model: nn.Module) -> bool:
    """Whether ``model`` is an FX graph (what ``torch.export.export(...).module()`` returns)."""
    return isinstance(model, fx.GraphModule)


def module_path(node: fx.Node) -> tuple[str, str]:
    """(name, class name) of the innermost module of the original model that ran ``node`` (("", "") at top level)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, kind = list(stack.values())[-1]
    type_name = kind if isinstance(kind, str) else getattr(kind, "__qualname__", str(kind))
    return path, type_name.rsplit(".", 1)[-1]


def _batch_dim(a: Any) -> Any:
    """Dynamic dimensions of an example input: dimension 0 of a tensor whose batch is larger than 1 (a batch of 1
    would be specialised by torch.export anyway), and dimension 1 of integer and bool tensors of two or more
    dimensions (token ids, attention masks: the sequence, so batches of other lengths run too); None for
    anything else. ``Dim.AUTO``: a dimension the model fixes is specialised, not an error."""
    if not isinstance(a, torch.Tensor) or a.ndim == 0:
        return None
    dims = {0: torch.export.Dim.AUTO} if a.shape[0] > 1 else {}
    if a.ndim >= 2 and not a.is_floating_point() and not a.is_complex() and a.shape[1] > 1:
        dims[1] = torch.export.Dim.AUTO
    return dims or None


def _dynamic_batch(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``dynamic_shapes`` for torch.export: positionally for positional-only calls, else by parameter name (what
    torch.export expects once keyword arguments are given: one entry per parameter of ``forward``); None (static
    shapes) when keywords land in a ``**kwargs`` parameter."""
    if not kwargs:
        return tuple(_batch_dim(a) for a in args)
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    shapes: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind == inspect.Parameter.VAR_KEYWORD:  # torch 2.13's export rejects every dynamic_shapes form for
            return None  # these (an internal assertion): captured at the example's shapes
        elif kind == inspect.Parameter.VAR_POSITIONAL:
            shapes[name] = tuple(_batch_dim(v) for v in value)
        else:
            shapes[name] = _batch_dim(value)
    return shapes


def _explain(err: BaseException, model: nn.Module) -> str:
    """The user-code line torch.export blamed, and the op or guard it was evaluating."""
    text = str(err)
    where = re.search(r"The following call raised this error:\s*\n\s*(File [^\n]+)\n\s*([^\n]+)", text)
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    line = f" at {where.group(1).strip()}: `{where.group(2).strip()}`" if where else ""
    kind = "data-dependent control flow" if "data-dependent" in text else type(err).__name__
    return (
        f"torch.export cannot capture {type(model).__name__} for quant_mode=fx_graph_mode ({kind}){line}: {first}. "
        f"Rewrite that code without branching on tensor values, or use eager mode: {EAGER_FALLBACK}."
    )


def capture(
    model: nn.Module, example_inputs: Any, example_kwargs: dict[str, Any] | None = None, dynamic_batch: bool = True
) -> fx.GraphModule:
    """``model`` as a train/eval-aware FX graph sharing its Parameters (``torch.export.export(...).module()`` then
    ``normalize``). ``example_inputs``: a tensor or a tuple of positional arguments. Hugging Face models are captured
    with ``use_cache`` off (``no_kv_cache``): the graph returns no KV cache."""
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs = example_kwargs or {}
    if is_graph_module(model):
        if example_inputs is not None and EXAMPLE_KEY not in model.meta:  # type: ignore[operator]
            _keep_example(model, args, kwargs)  # type: ignore[arg-type]
        return normalize(model)  # type: ignore[arg-type]
    kwargs = drop_unset_loss_keywords(model, kwargs)
    shapes = _dynamic_batch(model, args, kwargs) if dynamic_batch else None
    try:
        with no_kv_cache(model):  # a cache object is no graph output; calibration and evaluation never read one
            exported = torch.export.export(model, args, kwargs or None, dynamic_shapes=shapes, strict=False)
    except Exception as err:  # torch.export raises many types; all mean "cannot capture"
        raise GraphModeError(_explain(err, model)) from err
    gm = normalize(exported.module())
    hf_config = getattr(model, "config", None)
    if hf_config is not None and hasattr(hf_config, "to_dict"):
        gm.config = hf_config  # a Hugging Face model's config: the amd-quark export writes it into config.json
    _keep_example(gm, args, kwargs)  # type: ignore[arg-type]
    attach_loss(gm, model, args, kwargs)  # labels= of a training step: the loss from the graph's logits
    return gm  # type: ignore[return-value]


def _keep_example(gm: fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Keep the example inputs on the graph (detached, not copied) for the checks of its equivalence passes."""
    detach = lambda v: v.detach() if isinstance(v, torch.Tensor) else v  # noqa: E731
    gm.meta[EXAMPLE_KEY] = (tuple(detach(a) for a in args), {k: detach(v) for k, v in kwargs.items()})


def example_inputs(gm: nn.Module) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The (args, kwargs) ``gm`` was captured with, or None (a graph not made by ``capture``)."""
    meta = getattr(gm, "meta", None)
    return meta.get(EXAMPLE_KEY) if isinstance(meta, dict) else None


# ----------------------------------------------------------------------------------------------- normalize
def fetch_attr(gm: fx.GraphModule, node: Any) -> Any:
    """The tensor behind a ``get_attr`` node; None for anything else (a None argument, a computed tensor)."""
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    owner, _, name = str(node.target).rpartition(".")
    return getattr(gm.get_submodule(owner), name)


def _set_submodule(gm: fx.GraphModule, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(gm.get_submodule(parent), name, module)


def _batch_norm_module(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """Replace an ``aten.batch_norm`` call on module tensors by a call of a real BatchNorm module holding the same
    Parameters and buffers; returns its path (None when the call does not read module tensors)."""
    x, weight, bias, mean, var, _training, momentum, eps = node.args[:8]
    getattrs = [a for a in (weight, bias, mean, var) if a is not None]
    if not all(isinstance(a, fx.Node) and a.op == "get_attr" for a in getattrs) or mean is None:
        return None
    path = mean.target.rpartition(".")[0]  # type: ignore[union-attr]
    ndim = x.meta["val"].ndim if isinstance(x, fx.Node) and "val" in x.meta else 4  # type: ignore[union-attr]
    holder = gm.get_submodule(path)
    if isinstance(holder, nn.modules.batchnorm._BatchNorm):
        return path  # a second call of one BatchNorm
    bn_cls = _BATCH_NORMS.get(ndim, nn.BatchNorm2d)
    channels = fetch_attr(gm, mean).shape[0]
    bn = bn_cls(channels, eps=float(eps), momentum=momentum, affine=weight is not None, device="meta")  # type: ignore[arg-type]
    if weight is not None:
        bn.weight, bn.bias = fetch_attr(gm, weight), fetch_attr(gm, bias)
    bn.running_mean, bn.running_var = fetch_attr(gm, mean), fetch_attr(gm, var)
    tracked = getattr(holder, "num_batches_tracked", None)
    bn.num_batches_tracked = (
        tracked
        if isinstance(tracked, torch.Tensor)
        else torch.tensor(0, dtype=torch.long, device=bn.running_mean.device)
    )
    for child_name, child in holder.named_children():
        bn.add_module(child_name, child)
    _set_submodule(gm, path, bn)
    return path


def normalize(gm: fx.GraphModule) -> fx.GraphModule:
    """Make a captured graph follow ``train()`` / ``eval()``: BatchNorm calls become BatchNorm modules (same tensors),
    dropout calls ``nn.Dropout`` modules, and the ``num_batches_tracked += 1`` updates go (the modules do them).
    Idempotent. Returns ``gm``, changed in place."""
    for name in ("train", "eval"):  # torch.export's module() refuses train()/eval(): the modules below make them work
        gm.__dict__.pop(name, None)
    graph = gm.graph
    aten = torch.ops.aten
    baked: set[bool] = set()  # the train/eval mode capture baked into BatchNorm and dropout calls
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.batch_norm.default:
            baked.add(bool(node.args[5]))
            path = _batch_norm_module(gm, node)
            if path is None:
                continue
            with graph.inserting_before(node):
                call = graph.call_module(path, (node.args[0],))
            call.meta = dict(node.meta)
            node.replace_all_uses_with(call)
            graph.erase_node(node)
        elif node.target in (aten.dropout.default, aten.dropout_.default):  # dropout_: nn.Dropout(inplace=True)
            baked.add(bool(node.args[2]))
            p = float(node.args[1])
            name = f"_dropout_{node.name}"
            gm.add_submodule(name, nn.Dropout(p, inplace=node.target is aten.dropout_.default))
            with graph.inserting_before(node):
                call = graph.call_module(name, (node.args[0],))
            call.meta = dict(node.meta)
            node.replace_all_uses_with(call)
            graph.erase_node(node)
    for node in list(graph.nodes):  # BatchNorm's counter update: the module counts itself now
        if node.op == "call_function" and node.target is aten.add_.Tensor and not node.users:
            target = node.args[0]
            if (
                isinstance(target, fx.Node)
                and target.op == "get_attr"
                and str(target.target).endswith("num_batches_tracked")
            ):
                graph.erase_node(node)
    graph.eliminate_dead_code()
    _drop_unused_get_attrs(graph)
    gm.recompile()
    if len(baked) == 1:
        gm.train(baked.pop())  # behave as captured until the caller switches the mode
    return gm


def _drop_unused_get_attrs(graph: fx.Graph) -> None:
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
