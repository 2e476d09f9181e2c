"""Bit packing of sub-byte codes: two 4-bit codes per byte (low nibble first), as int4/uint4/fp4 are stored."""

from __future__ import annotations

import torch


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes in [0, 15] (two's complement nibbles for signed values) -> uint8 of ceil(n / 2) bytes, flattened.

    Element 2i goes to the low nibble of byte i, element 2i+1 to the high nibble; an odd count is padded with 0."""
    flat = codes.reshape(-1).to(torch.int32) & 0xF
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    pairs = flat.reshape(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor, count: int, signed: bool) -> torch.Tensor:
    """The inverse of ``pack_nibbles``: ``count`` codes as int32 (sign-extended from 4 bits when ``signed``)."""
    b = packed.reshape(-1).to(torch.int32)
    flat = torch.stack([b & 0xF, (b >> 4) & 0xF], dim=1).reshape(-1)[:count]
    if signed:
        flat = torch.where(flat >= 8, flat - 16, flat)
    return flat
