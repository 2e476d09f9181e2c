"""Buffers whose shape is set by the data (per-channel and per-group statistics and qparams)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ResizableBuffersMixin(nn.Module):
    """Resize a buffer to the shape found in a loaded state_dict, so a fresh module loads a calibrated one's state."""

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        for name, buf in self._buffers.items():
            key = prefix + name
            if buf is not None and key in state_dict and state_dict[key].shape != buf.shape:
                self._buffers[name] = torch.empty_like(state_dict[key], device=buf.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
