"""The quantizer of an attention's probabilities (``Config.softmax_quant_spec``), as a layer of its own.

A Hugging Face attention module computes its probabilities inside a function of transformers (the eager attention),
with no layer between the softmax and the product with the values. ``QuantAttentionProbs`` is that missing layer: a
child of the attention module (``ATTENTION_PROBS``) whose forward quantizes what it is given, called on the softmax
output by the attention wrapper of ``quark.torch.quantization.attention``. Being a twin (``QuantMixin``) it is
calibrated, trained (TQT / LSQ), frozen, checkpointed, synchronised across DDP ranks and counted as reached like any
other layer; amd-quark's exports name its scale ``<attention>.prob_output_scale``.
"""

from __future__ import annotations

import torch
from torch import nn

from quark.torch.quantization.config.config import QuantizationConfig, QuantizationSpec
from quark.torch.quantization.nn.modules.quant_modules import QuantMixin

__all__ = ["ATTENTION_PROBS", "PROB_SCALE_SUFFIX", "QuantAttentionProbs", "attention_probs"]

#: the child of an attention module that quantizes its probabilities
ATTENTION_PROBS = "attn_probs"
#: amd-quark's tensor name of the probabilities' scale, after the attention module's name
PROB_SCALE_SUFFIX = "prob_output_scale"


class QuantAttentionProbs(QuantMixin, nn.Identity):
    """The softmax output of one attention module, through the output quantizer of ``softmax_quant_spec``."""

    _float_class = nn.Identity
    roles = ("output_tensors",)

    @classmethod
    def create(cls, spec: QuantizationSpec, device: torch.device | None) -> QuantAttentionProbs:
        """A twin holding an output quantizer of ``spec`` (on ``device``), ready to be set as a child."""
        twin = cls.from_float(nn.Identity(), QuantizationConfig(output_tensors=spec))
        return twin.to(device) if device is not None else twin

    def forward(self, probs: torch.Tensor) -> torch.Tensor:
        """The probabilities quantized (unchanged where no quantizer is set)."""
        return self._quantize(self._output_quantizer, probs)  # type: ignore[return-value]


def attention_probs(module: nn.Module) -> QuantAttentionProbs | None:
    """The probabilities' twin of the attention ``module``, or None when its probabilities are not quantized."""
    child = getattr(module, ATTENTION_PROBS, None)
    return child if isinstance(child, QuantAttentionProbs) else None
