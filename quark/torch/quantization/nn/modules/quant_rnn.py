"""Quantized recurrent layers: ``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` and their cells.

The float modules pass all their weights to one fused kernel, so nothing outside it can quantize them. The twins run
the same kernel one layer at a time (``num_layers=1``, both directions together) on fake-quantized weights: every
``weight_ih/hh(_hr)_l{k}(_reverse)`` and bias has its own quantizer (so per-tensor scales are per gate matrix, per
channel one scale per gate row), and the input of every layer has one (``_input_quantizer`` for layer 0,
``_input_quantizer_l{k}`` for the layers above, which read the layer below's output). ``_output_quantizer`` takes
the returned sequence. The hidden and cell states inside the recurrence stay float: they never leave the kernel.
With every quantizer off a twin equals its float module (packed sequences, ``batch_first``, unbatched input,
``bidirectional``, ``proj_size``, inter-layer ``dropout``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from quark.torch.compat import rnn_flat_weight_names, rnn_kernel
from quark.torch.quantization.nn.modules.quant_modules import QuantMixin, QuantSlot, register_quant_module

__all__ = ["QuantLSTM", "QuantGRU", "QuantRNN", "QuantLSTMCell", "QuantGRUCell", "QuantRNNCell"]

#: the fused kernel (``torch._VF``, through quark.torch.compat) each float class runs
_KERNELS = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn_tanh", "RNN_RELU": "rnn_relu"}
_CELL_KERNELS = {"LSTMCell": "lstm_cell", "GRUCell": "gru_cell", "tanh": "rnn_tanh_cell", "relu": "rnn_relu_cell"}


def _param_slot(name: str) -> QuantSlot:
    return QuantSlot("weight" if name.startswith("weight") else "bias", f"_{name}_quantizer", name)


class _QuantRNNBase(QuantMixin):
    """The layer loop shared by LSTM, GRU and RNN twins."""

    @classmethod
    def slots_for(cls, module: nn.Module) -> tuple[QuantSlot, ...]:
        layers = [QuantSlot("input_tensors", "_input_quantizer")]
        layers += [QuantSlot("input_tensors", f"_input_quantizer_l{k}") for k in range(1, module.num_layers)]  # type: ignore[arg-type]
        return (
            *layers,
            QuantSlot("output_tensors", "_output_quantizer"),
            *(_param_slot(n) for n in rnn_flat_weight_names(module)),
        )

    def _layer_input_quantizer(self, layer: int) -> nn.Module | None:
        return getattr(self, "_input_quantizer" if layer == 0 else f"_input_quantizer_l{layer}", None)

    def _layer_weights(self, layer: int) -> list[torch.Tensor]:
        """Layer ``layer``'s weights (both directions, in the kernel's order), fake-quantized where configured."""
        names = [n for n in rnn_flat_weight_names(self) if n.endswith((f"_l{layer}", f"_l{layer}_reverse"))]  # type: ignore[arg-type]
        return [self._quantize(getattr(self, f"_{n}_quantizer", None), getattr(self, n)) for n in names]  # type: ignore[misc]

    def _zeros(self, batch: int, size: int, like: torch.Tensor) -> torch.Tensor:
        layers = self.num_layers * (2 if self.bidirectional else 1)  # type: ignore[attr-defined]
        return torch.zeros(layers, batch, size, dtype=like.dtype, device=like.device)

    def forward(self, input: Any, hx: Any = None) -> tuple[Any, Any]:
        lstm = self.mode == "LSTM"  # type: ignore[attr-defined]
        packed = isinstance(input, PackedSequence)
        batch_sizes = sorted_indices = unsorted_indices = None
        if packed:
            x, batch_sizes, sorted_indices, unsorted_indices = input
            batch, is_batched = int(batch_sizes[0]), True
        else:
            if input.dim() not in (2, 3):
                raise ValueError(f"{type(self).__name__}: expected 2D or 3D input, got {input.dim()}D")
            is_batched = input.dim() == 3
            x = input if is_batched else input.unsqueeze(0 if self.batch_first else 1)  # type: ignore[attr-defined]
            batch = x.size(0 if self.batch_first else 1)  # type: ignore[attr-defined]
        if hx is None:
            hidden = self.proj_size or self.hidden_size if lstm else self.hidden_size  # type: ignore[attr-defined]
            hx = (
                (self._zeros(batch, hidden, x), self._zeros(batch, self.hidden_size, x))
                if lstm
                else self._zeros(batch, self.hidden_size, x)
            )  # type: ignore[attr-defined]
        elif not is_batched:
            hx = (hx[0].unsqueeze(1), hx[1].unsqueeze(1)) if lstm else hx.unsqueeze(1)
        else:
            hx = self.permute_hidden(hx, sorted_indices)  # type: ignore[attr-defined]
        self.check_forward_args(x, hx, batch_sizes)  # type: ignore[attr-defined]
        if not packed and self.batch_first:  # type: ignore[attr-defined]
            x = x.transpose(0, 1)
        x, hidden = self._layers(x, hx, batch_sizes)
        x = self._quantize(self._output_quantizer, x)
        if packed:
            return PackedSequence(x, batch_sizes, sorted_indices, unsorted_indices), self.permute_hidden(
                hidden, unsorted_indices
            )  # type: ignore[attr-defined]
        if self.batch_first:  # type: ignore[attr-defined]
            x = x.transpose(0, 1)
        if not is_batched:
            x = x.squeeze(0 if self.batch_first else 1)  # type: ignore[attr-defined]
            hidden = (hidden[0].squeeze(1), hidden[1].squeeze(1)) if lstm else hidden.squeeze(1)
        return x, hidden

    def _layers(self, x: torch.Tensor, hx: Any, batch_sizes: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
        """Run the layers one at a time (time-major ``x``), each on its quantized input and weights."""
        lstm = self.mode == "LSTM"  # type: ignore[attr-defined]
        kernel = rnn_kernel(_KERNELS[self.mode])  # type: ignore[attr-defined]
        dirs = 2 if self.bidirectional else 1  # type: ignore[attr-defined]
        hs, cs = [], []
        for layer in range(self.num_layers):  # type: ignore[attr-defined]
            x = self._quantize(self._layer_input_quantizer(layer), x)  # type: ignore[arg-type]
            part = slice(layer * dirs, (layer + 1) * dirs)
            h = (hx[0][part], hx[1][part]) if lstm else hx[part]
            args = (self._layer_weights(layer), self.bias, 1, 0.0, self.training, self.bidirectional)  # type: ignore[attr-defined]
            out = kernel(x, h, *args, False) if batch_sizes is None else kernel(x, batch_sizes, h, *args)
            x = out[0]
            hs.append(out[1])
            if lstm:
                cs.append(out[2])
            if self.dropout and self.training and layer < self.num_layers - 1:  # type: ignore[attr-defined]
                x = F.dropout(x, self.dropout, True)  # type: ignore[attr-defined]
        return x, ((torch.cat(hs), torch.cat(cs)) if lstm else torch.cat(hs))


class QuantLSTM(_QuantRNNBase, nn.LSTM):
    _float_class = nn.LSTM


class QuantGRU(_QuantRNNBase, nn.GRU):
    _float_class = nn.GRU


class QuantRNN(_QuantRNNBase, nn.RNN):
    _float_class = nn.RNN


class _QuantCellBase(QuantMixin):
    """Cells: input and output quantizers, one quantizer per weight and bias; the hidden state passed in stays float."""

    @classmethod
    def slots_for(cls, module: nn.Module) -> tuple[QuantSlot, ...]:
        params = [n for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh") if getattr(module, n, None) is not None]
        return (
            QuantSlot("input_tensors", "_input_quantizer"),
            QuantSlot("output_tensors", "_output_quantizer"),
            *(_param_slot(n) for n in params),
        )

    def forward(self, input: torch.Tensor, hx: Any = None) -> Any:
        lstm = isinstance(self, nn.LSTMCell)
        if input.dim() not in (1, 2):
            raise ValueError(f"{type(self).__name__}: expected 1D or 2D input, got {input.dim()}D")
        is_batched = input.dim() == 2
        x = input if is_batched else input.unsqueeze(0)
        if hx is None:
            zeros = torch.zeros(x.size(0), self.hidden_size, dtype=x.dtype, device=x.device)  # type: ignore[attr-defined]
            hx = (zeros, zeros) if lstm else zeros
        elif not is_batched:
            hx = (hx[0].unsqueeze(0), hx[1].unsqueeze(0)) if lstm else hx.unsqueeze(0)
        weights = [
            self._quantize(getattr(self, f"_{n}_quantizer", None), getattr(self, n))
            for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
        ]
        kernel = rnn_kernel(_CELL_KERNELS[getattr(self, "nonlinearity", type(self)._float_class.__name__)])
        out = kernel(self._quantize(self._input_quantizer, x), hx, *weights)
        if lstm:
            h, c = out
            h = self._quantize(self._output_quantizer, h)
            return (h, c) if is_batched else (h.squeeze(0), c.squeeze(0))
        out = self._quantize(self._output_quantizer, out)
        return out if is_batched else out.squeeze(0)


class QuantLSTMCell(_QuantCellBase, nn.LSTMCell):
    _float_class = nn.LSTMCell


class QuantGRUCell(_QuantCellBase, nn.GRUCell):
    _float_class = nn.GRUCell


class QuantRNNCell(_QuantCellBase, nn.RNNCell):
    _float_class = nn.RNNCell


for _float, _twin in (
    (nn.LSTM, QuantLSTM),
    (nn.GRU, QuantGRU),
    (nn.RNN, QuantRNN),
    (nn.LSTMCell, QuantLSTMCell),
    (nn.GRUCell, QuantGRUCell),
    (nn.RNNCell, QuantRNNCell),
):
    register_quant_module(_float, _twin)
