"""Quantized ``nn.MultiheadAttention`` and the Transformer containers that must run through it.

``nn.MultiheadAttention`` hands its raw weights to ``F.multi_head_attention_forward`` (or a fused kernel), so a
swapped ``out_proj`` would never run and ``in_proj_weight`` would never be quantized. The twin computes the same
attention with its own code path: the query, key and value inputs each pass their input quantizer (as the three
``q/k/v_proj`` Linears of a Hugging Face attention do: in self-attention the three see the same tensor), the
in-projection weights and bias pass their quantizers, and the context goes through ``self.out_proj``, which is a
quantized Linear following this layer's configuration (an owned child). With every quantizer off it equals the float
module (same masks, ``batch_first``, unbatched inputs, ``kdim``/``vdim``, ``add_bias_kv``, ``add_zero_attn``,
``need_weights``/``average_attn_weights``, ``is_causal``).

The packed ``in_proj_weight`` (q, k and v stacked) has one weight quantizer: per channel (one scale per output row)
that is exactly three per-projection quantizers; per tensor the three share one scale, as fused QKV layers do when
served. With ``kdim``/``vdim`` the three projection weights are separate Parameters with one quantizer each.
``bias_k`` / ``bias_v`` (``add_bias_kv``) are learned key/value rows, not weights of a product: they stay float.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from quark.torch.quantization.nn.modules.quant_modules import (
    QuantMixin,
    QuantSlot,
    register_prepare_hook,
    register_quant_module,
)

__all__ = ["QuantMultiheadAttention", "disable_fused_transformer_paths"]


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True = not allowed to attend) as the additive float mask torch builds from it."""
    if mask is None or torch.is_floating_point(mask):
        return mask
    if mask.dtype != torch.bool:
        raise TypeError(f"attention masks must be bool or floating point, got {mask.dtype}")
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


class QuantMultiheadAttention(QuantMixin, nn.MultiheadAttention):
    _float_class = nn.MultiheadAttention
    roles = ("input_tensors", "weight", "bias")  # the output is out_proj's: its own output quantizer
    owned_children = ("out_proj",)

    _key_input_quantizer: nn.Module | None
    _value_input_quantizer: nn.Module | None

    @classmethod
    def slots_for(cls, module: nn.Module) -> tuple[QuantSlot, ...]:
        slots = [
            QuantSlot("input_tensors", "_input_quantizer"),
            QuantSlot("input_tensors", "_key_input_quantizer"),
            QuantSlot("input_tensors", "_value_input_quantizer"),
        ]
        if module.in_proj_weight is not None:  # q, k, v packed in one Parameter (same embed dims)
            slots.append(QuantSlot("weight", "_weight_quantizer", "in_proj_weight"))
        else:
            slots += [QuantSlot("weight", f"_{p}_weight_quantizer", f"{p}_proj_weight") for p in "qkv"]
        if module.in_proj_bias is not None:
            slots.append(QuantSlot("bias", "_bias_quantizer", "in_proj_bias"))
        return tuple(slots)

    def _projection_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The q, k and v projection weights as the products see them."""
        if self.in_proj_weight is not None:  # type: ignore[union-attr]
            return self._quantize(self._weight_quantizer, self.in_proj_weight).chunk(3)  # type: ignore[union-attr]
        return tuple(  # type: ignore[return-value]
            self._quantize(getattr(self, f"_{p}_weight_quantizer"), getattr(self, f"{p}_proj_weight")) for p in "qkv"
        )

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        is_batched = query.dim() == 3
        if self.batch_first and is_batched:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        if not is_batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        tgt_len, bsz, embed_dim = query.shape
        if embed_dim != self.embed_dim:
            raise ValueError(f"query has embedding dimension {embed_dim}, this attention expects {self.embed_dim}")
        key_padding_mask = _additive_mask(key_padding_mask, query.dtype)
        if is_causal and attn_mask is None:
            raise RuntimeError("is_causal=True needs attn_mask (nn.Transformer.generate_square_subsequent_mask)")
        sdpa_causal = is_causal and key_padding_mask is None and not need_weights
        attn_mask = None if sdpa_causal else _additive_mask(attn_mask, query.dtype)

        bias_q = bias_k = bias_v = None
        if self.in_proj_bias is not None:
            bias_q, bias_k, bias_v = self._quantize(self._bias_quantizer, self.in_proj_bias).chunk(3)  # type: ignore[union-attr]
        w_q, w_k, w_v = self._projection_weights()
        q = F.linear(self._quantize(self._input_quantizer, query), w_q, bias_q)
        k = F.linear(self._quantize(self._key_input_quantizer, key), w_k, bias_k)
        v = F.linear(self._quantize(self._value_input_quantizer, value), w_v, bias_v)

        heads, head_dim = self.num_heads, self.head_dim
        if attn_mask is not None and attn_mask.dim() == 2:
            attn_mask = attn_mask.unsqueeze(0)
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.repeat(1, bsz, 1)])
            v = torch.cat([v, self.bias_v.repeat(1, bsz, 1)])
            attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
            key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
        q = q.view(tgt_len, bsz * heads, head_dim).transpose(0, 1)
        k = k.view(k.shape[0], bsz * heads, head_dim).transpose(0, 1)
        v = v.view(v.shape[0], bsz * heads, head_dim).transpose(0, 1)
        if self.add_zero_attn:
            zeros = torch.zeros((bsz * heads, 1, head_dim), dtype=k.dtype, device=k.device)
            k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros], dim=1)
            attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
            key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
        src_len = k.size(1)
        if key_padding_mask is not None:
            if key_padding_mask.shape != (bsz, src_len):
                raise ValueError(
                    f"key_padding_mask has shape {tuple(key_padding_mask.shape)}, expected {(bsz, src_len)}"
                )
            merged = (
                key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, heads, -1, -1).reshape(bsz * heads, 1, src_len)
            )
            attn_mask = merged if attn_mask is None else attn_mask + merged
        dropout_p = self.dropout if self.training else 0.0

        weights = None
        if need_weights:
            scores = q * math.sqrt(1.0 / head_dim)
            scores = (
                torch.bmm(scores, k.transpose(-2, -1))
                if attn_mask is None
                else torch.baddbmm(attn_mask, scores, k.transpose(-2, -1))
            )
            scores = F.softmax(scores, dim=-1)
            if dropout_p > 0.0:
                scores = F.dropout(scores, p=dropout_p)
            context = torch.bmm(scores, v).transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
            weights = scores.view(bsz, heads, tgt_len, src_len)
            weights = weights.mean(dim=1) if average_attn_weights else weights
            if not is_batched:
                weights = weights.squeeze(0)
        else:
            if attn_mask is not None:
                attn_mask = (
                    attn_mask.unsqueeze(0) if attn_mask.size(0) == 1 else attn_mask.view(bsz, heads, -1, src_len)
                )
            q4, k4, v4 = (t.view(bsz, heads, -1, head_dim) for t in (q, k, v))
            context = F.scaled_dot_product_attention(q4, k4, v4, attn_mask, dropout_p, is_causal=sdpa_causal)
            context = context.permute(2, 0, 1, 3).contiguous().view(bsz * tgt_len, embed_dim)
        out = self.out_proj(context).view(tgt_len, bsz, -1)
        if not is_batched:
            out = out.squeeze(1)
        elif self.batch_first:
            out = out.transpose(0, 1)
        return out, weights


def disable_fused_transformer_paths(model: nn.Module) -> None:
    """Route Transformer layers holding quantized modules through their modules in every mode.

    In eval without gradients ``nn.TransformerEncoderLayer`` calls one fused kernel with its raw weights (skipping
    the attention and Linear twins) and ``nn.TransformerEncoder`` packs padded input as a nested tensor that only that
    kernel accepts. The fused path is taken only for ReLU/GELU layers (``activation_relu_or_gelu``), so marking the
    layer as neither (its ``activation`` is untouched) and the encoder as not nesting keeps the module path."""
    for module in model.modules():
        if not isinstance(module, nn.TransformerEncoderLayer | nn.TransformerEncoder):
            continue  # only those two hold a fused path; checking their children only keeps this linear in depth
        if not any(isinstance(m, QuantMixin) for m in module.modules()):
            continue
        if isinstance(module, nn.TransformerEncoderLayer):
            module.activation_relu_or_gelu = 0
        else:
            module.use_nested_tensor = False


register_prepare_hook(disable_fused_transformer_paths)
register_quant_module(nn.MultiheadAttention, QuantMultiheadAttention)
