"""Buffers whose shape (or integer/float kind) is set by the data: per-channel and per-group statistics and qparams."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ResizableBuffersMixin(nn.Module):
    """Resize a buffer to the shape found in a loaded state_dict, so a fresh module loads a calibrated one's state."""

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        for name, buf in self._buffers.items():
            key = prefix + name
            if buf is None or key not in state_dict:
                continue
            saved = state_dict[key]
            # shape set by the data, or an int zero point saved as float32 (ZeroPointType.float32): a plain copy_
            # would truncate 63.75 to 63, so take the saved buffer's shape and kind
            if saved.shape != buf.shape or saved.is_floating_point() != buf.is_floating_point():
                self._buffers[name] = torch.empty_like(saved, device=buf.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
