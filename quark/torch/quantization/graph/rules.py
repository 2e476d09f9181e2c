"""What each op of a captured graph means for quantization: one table, so placement, folding, equalization and
the error for an op without a rule all read the same facts.

Kinds:
- ``compute``: an op with a weight or two activation operands (conv, linear, matmul, bmm, embedding): inputs
  quantized by its ``input_tensors`` spec, weights and bias by ``weight`` / ``bias``.
- ``activation``: ReLU / ReLU6 / clamp, fused into the compute op or add before it (no quantizer between them).
- ``quantized_output``: add, mul, cat, mean and average pooling: their inputs and their output are quantized.
- ``passthrough``: max pooling and layout ops: the output keeps the input's grid (same qparams).
- ``float``: elementwise math that runs on dequantized values (softmax, sigmoid, norms ...); every op whose outputs
  are integer or bool tensors (indices, attention-mask building: ``eq``, ``le``, ``__and__``, ``diff`` ...), which is
  never quantized; and the higher-order ops that only switch a mode around a body (``wrap_with_set_grad_enabled``,
  ``wrap_with_autocast``: the rotary embedding of Hugging Face models) when that body has no weighted op.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx, nn

from quark.torch.compat import inplace_overload

aten = torch.ops.aten

COMPUTE = {
    aten.conv1d.default: "conv",
    aten.conv2d.default: "conv",
    aten.conv3d.default: "conv",
    aten.conv1d.padding: "conv",
    aten.conv2d.padding: "conv",
    aten.conv3d.padding: "conv",
    aten.linear.default: "linear",
    aten.matmul.default: "matmul",
    aten.bmm.default: "matmul",
    aten.mm.default: "matmul",
    aten.embedding.default: "embedding",
}

#: ops fused into the op before them; value: whether the op is ReLU-like (positively homogeneous: CLE may scale it)
ACTIVATIONS = {
    aten.relu.default: "relu",
    aten.relu_.default: "relu",
    aten.relu6.default: "relu6",
    aten.hardtanh.default: "hardtanh",
    aten.hardtanh_.default: "hardtanh",
    aten.clamp.default: "clamp",
    aten.clamp_.default: "clamp",
    aten.clamp_min.default: "clamp",
}

QUANTIZED_OUTPUT = {
    aten.add.Tensor,
    aten.add_.Tensor,
    aten.sub.Tensor,
    aten.mul.Tensor,
    aten.mul_.Tensor,
    aten.cat.default,
    aten.mean.dim,
    aten.avg_pool1d.default,
    aten.avg_pool2d.default,
    aten.avg_pool3d.default,
    aten.adaptive_avg_pool1d.default,
    aten.adaptive_avg_pool2d.default,
    aten.adaptive_avg_pool3d.default,
}

PASSTHROUGH = {
    aten.max_pool1d.default,
    aten.max_pool2d.default,
    aten.max_pool3d.default,
    aten.max_pool2d_with_indices.default,
    aten.adaptive_max_pool2d.default,
    aten.view.default,
    aten.reshape.default,
    aten.flatten.using_ints,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.unsqueeze.default,
    aten.contiguous.default,
    aten.clone.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.expand.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.chunk.default,
    aten.unbind.int,
    aten.narrow.default,
    aten.upsample_nearest2d.vec,
    aten.pixel_shuffle.default,
    aten.alias.default,
    aten.unflatten.int,
    aten.detach.default,
    operator.getitem,
}

FLOAT = {
    aten.sigmoid.default,
    aten.tanh.default,
    aten.softmax.int,
    aten._softmax.default,
    aten.log_softmax.int,
    aten.gelu.default,
    aten.silu.default,
    aten.silu_.default,
    aten.hardswish.default,
    aten.hardswish_.default,
    aten.hardsigmoid.default,
    aten.leaky_relu.default,
    aten.elu.default,
    aten.softplus.default,
    aten.mish.default,
    aten.layer_norm.default,
    aten.group_norm.default,
    aten.instance_norm.default,
    aten.rms_norm.default,
    aten.div.Tensor,
    aten.div.Scalar,
    aten.sub.Scalar,
    aten.add.Scalar,
    aten.mul.Scalar,
    aten.rsub.Scalar,
    aten.exp.default,
    aten.log.default,
    aten.pow.Tensor_Scalar,
    aten.sqrt.default,
    aten.rsqrt.default,
    aten.neg.default,
    aten.abs.default,
    aten.sum.dim_IntList,
    aten.sum.default,
    aten.amax.default,
    aten.max.dim,
    aten.var.correction,
    aten.std.correction,
    aten.mean.default,
    aten.norm.ScalarOpt_dim,
    aten.scaled_dot_product_attention.default,
    aten.upsample_bilinear2d.vec,
    aten.pad.default,
    aten.constant_pad_nd.default,
    aten._to_copy.default,
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.type_as.default,
    aten.to.device,
    aten.cos.default,
    aten.sin.default,
    aten.new_ones.default,
    aten.new_zeros.default,
    aten.masked_fill.Scalar,
    aten.where.self,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.arange.default,
    aten.arange.start,
    aten.zeros.default,
    aten.ones.default,
    aten.full.default,
    aten.argmax.default,
    aten.topk.default,
    aten.sort.default,
    aten.gather.default,
    aten.index.Tensor,
    aten.cumsum.default,
    aten.tril.default,
    aten.triu.default,
    aten.eq.Scalar,
    aten.ne.Scalar,
    aten.lt.Scalar,
    aten.gt.Scalar,
    aten.scalar_tensor.default,
    aten.repeat.default,
    aten.stack.default,
    aten.roll.default,
    aten.lstm.input,
    aten.gru.input,
    aten.rnn_tanh.input,
    aten.rnn_relu.input,
    aten.where.ScalarOther,
    aten.where.ScalarSelf,
    aten.where.Scalar,
    aten._weight_norm.default,
}


#: casts: the same values in another dtype or on another device
CASTS = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.type_as.default}


def _in_place(ops: set[Any]) -> set[Any]:
    """The in-place forms (``sigmoid_``, ``masked_fill_.Scalar``) of ``ops``, where aten has them: the same value,
    written into the input, so the same rule (capture keeps them for modules built with ``inplace=True``)."""
    return {overload for overload in map(inplace_overload, ops) if overload is not None}


FLOAT |= _in_place(FLOAT)


#: higher-order ops that run their body (a submodule of the graph, argument ``body_arg``) under a mode switch
MODE_WRAPPERS = {"wrap_with_set_grad_enabled": 1, "wrap_with_autocast": 4}
#: ops with a weight operand: inside a higher-order op's body nothing quantizes them, so such a body has no rule
_WEIGHTED = {target for target, op in COMPUTE.items() if op in ("conv", "linear", "embedding")}


def _wrapper_body(node: fx.Node, gm: fx.GraphModule) -> fx.GraphModule | None:
    """The body of a mode-switching higher-order op call (None for any other node)."""
    index = MODE_WRAPPERS.get(getattr(node.target, "__name__", ""))
    if index is None or len(node.args) <= index:
        return None
    body = node.args[index]
    if not isinstance(body, fx.Node) or body.op != "get_attr":
        return None
    module = gm.get_submodule(str(body.target))
    return module if isinstance(module, fx.GraphModule) else None


def weighted_ops_in_body(node: fx.Node, gm: fx.GraphModule) -> list[str]:
    """The weighted ops (conv, linear, embedding) inside a mode-switching higher-order op's body, nested ones too."""
    body = _wrapper_body(node, gm)
    if body is None:
        return []
    found = []
    for inner in body.graph.nodes:
        if inner.op == "call_function" and inner.target in _WEIGHTED:
            found.append(f"{inner.target} (node '{inner.name}')")
        found += weighted_ops_in_body(inner, body)
    return found


def computing_users(node: fx.Node) -> list[fx.Node]:
    """The ops that compute with ``node``'s value: its users, looked through casts and layout ops (the same values),
    without bookkeeping (``_assert_tensor_metadata``, ``_assert_scalar``, ``sym_size``: no tensor out) and without
    module calls (the graph's quantizers)."""
    out: list[fx.Node] = []
    pending, seen = list(node.users), set()
    while pending:
        user = pending.pop(0)
        if user in seen or user.op != "call_function" or not tensor_valued(user):
            continue
        seen.add(user)
        if user.target in CASTS or user.target in PASSTHROUGH:
            pending += list(user.users)
        else:
            out.append(user)
    return out


def integer_valued(node: fx.Node) -> bool:
    """A node whose outputs are tensors, none of them floating point (indices, masks)."""
    val = node.meta.get("val")
    values = val if isinstance(val, list | tuple) else [val]
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    return bool(tensors) and not any(t.is_floating_point() for t in tensors)


def tensor_valued(node: fx.Node) -> bool:
    """Whether ``node`` produces a tensor (or a tuple of them); size arithmetic and scalars are not quantized."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return True
    return isinstance(val, list | tuple) and any(isinstance(v, torch.Tensor) for v in val)


def float_tensor(node: Any) -> bool:
    """A node producing a floating-point tensor (integer indices and masks are never quantized)."""
    if not isinstance(node, fx.Node):
        return False
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def kind_of(node: fx.Node, gm: fx.GraphModule) -> str | None:
    """The rule kind of ``node`` (see the module docstring); None for an op with no rule."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return "batch_norm"
        if isinstance(module, nn.Dropout | nn.Identity):
            return "passthrough"
        return "module"
    if node.op != "call_function":
        return node.op  # placeholder, get_attr, output
    target = node.target
    if target in COMPUTE:
        return "compute"
    if target in ACTIVATIONS:
        return "activation"
    if target in QUANTIZED_OUTPUT:
        return "quantized_output"
    if target in PASSTHROUGH:
        return "passthrough"
    if target in FLOAT or not tensor_valued(node) or integer_valued(node):
        return "float"
    if _wrapper_body(node, gm) is not None and not weighted_ops_in_body(node, gm):
        return "float"
    return None


def is_relu6(node: fx.Node) -> bool:
    """ReLU6, or hardtanh / clamp with bounds (0, 6): what CLE rescales per channel."""
    kind = ACTIVATIONS.get(node.target)  # type: ignore[call-overload]
    if kind == "relu6":
        return True
    if kind in ("hardtanh", "clamp"):
        low, high = (list(node.args[1:3]) + [None, None])[:2]
        return low == 0 and high == 6
    return False


def is_relu(node: fx.Node) -> bool:
    """ReLU, or clamp with min 0 and no max."""
    kind = ACTIVATIONS.get(node.target)  # type: ignore[call-overload]
    if kind == "relu":
        return True
    if kind == "clamp":
        bounds = list(node.args[1:3]) + [None, None]
        return bounds[0] == 0 and bounds[1] is None
    return False
