"""The base of the algorithm configs (re-exported by ``quark.torch.quantization.config.config``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quark.torch.quantization.config.spec import ConfigBase

__all__ = ["AlgoConfig"]


@dataclass(eq=True)
class AlgoConfig(ConfigBase):
    """Base of the algorithm configs; ``name`` tells them apart in dicts."""

    def to_dict(self) -> dict[str, Any]:
        """A dict of plain JSON types that ``from_dict`` turns back into an equal object."""
        return super().to_dict()
