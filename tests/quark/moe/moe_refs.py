"""Independent references for the algorithms on fused MoE experts (not collected: no test_ prefix): the tokens the
router sends to each expert, computed here from the float model with torch ops (the router's ``F.linear``, softmax
and top-k), and each expert's gate/up and down inputs."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quark.torch.quantization.config.config import Config


def moe_block_inputs(model: nn.Module, layer: int, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """What the MoE block (``mlp``) of decoder layer ``layer`` of the float ``model`` receives on ``batches``, one row
    per token [tokens, hidden]."""
    seen: list[torch.Tensor] = []
    mlp = model.model.layers[layer].mlp
    handle = mlp.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().reshape(-1, args[0].shape[-1])))
    try:
        with torch.no_grad():
            for b in batches:
                model(**b)
    finally:
        handle.remove()
    return torch.cat(seen)


def routed(router_weight: torch.Tensor, x: torch.Tensor, top_k: int) -> torch.Tensor:
    """[tokens, top_k]: the experts each token is sent to (softmax of ``x W^T`` in float32, its top k; the
    renormalisation of Mixtral / Qwen does not change which)."""
    probs = torch.softmax(F.linear(x, router_weight).float(), dim=-1)
    return torch.topk(probs, top_k, dim=-1).indices


def expert_inputs(
    x: torch.Tensor, routes: torch.Tensor, gate_up: torch.Tensor, e: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``e``'s gate/up input (the rows of ``x`` routed to it) and its down projection's input
    ``silu(x W_gate^T) * (x W_up^T)`` for its [2I, H] weights ``gate_up``."""
    mine = x[(routes == e).any(dim=-1)]
    gate, up = F.linear(mine, gate_up).chunk(2, dim=-1)
    return mine, F.silu(gate) * up


def two_over_n_gram(x: torch.Tensor) -> torch.Tensor:
    """GPTQ's Hessian ``2 / n X^T X`` in float64."""
    x = x.double()
    return 2.0 / x.shape[0] * x.T @ x


def weight_only(spec: dict[str, Any], **extra: Any) -> Config:
    """A weight-only Config with ``spec`` for every layer, ``lm_head`` excluded, plus ``extra`` entries."""
    return Config.from_dict({"global_quant_config": {"weight": spec}, "exclude": ["lm_head"], **extra})
