"""Bit packing of sub-byte codes: two 4-bit codes per byte (low nibble first), as int4/uint4/fp4 are stored; four
6-bit codes per three bytes, as amd-quark stores MX fp6."""

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


def pack_sextets(codes: torch.Tensor) -> torch.Tensor:
    """6-bit codes [..., n] (n a multiple of 4) -> uint8 [..., 3n/4]: each run of four codes v0..v3 becomes the
    24-bit little-endian word ``v0 | v1 << 6 | v2 << 12 | v3 << 18`` (amd-quark's MX fp6 layout, which AMD's
    f8f6f4 MFMA instructions read)."""
    if codes.shape[-1] % 4:
        raise ValueError(f"6-bit packing needs a multiple of 4 codes along the last axis, got {codes.shape[-1]}")
    v = codes.to(torch.int32).reshape(*codes.shape[:-1], -1, 4) & 0x3F
    word = v[..., 0] | (v[..., 1] << 6) | (v[..., 2] << 12) | (v[..., 3] << 18)
    packed = torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=-1)
    return packed.reshape(*codes.shape[:-1], -1).to(torch.uint8)


def unpack_sextets(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_sextets``: uint8 [..., 3m] -> int32 codes [..., 4m]."""
    b = packed.to(torch.int32).reshape(*packed.shape[:-1], -1, 3)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    v = torch.stack([(word >> (6 * i)) & 0x3F for i in range(4)], dim=-1)
    return v.reshape(*packed.shape[:-1], -1)


PACK_ORDER = {"reorder": (0, 2, 4, 6, 1, 3, 5, 7), "order": (0, 1, 2, 3, 4, 5, 6, 7)}


#: ``pack_int4`` packs this many codes at a time (its int64 temporaries are ~3 x 8 bytes per code: about 100 MB),
#: so exporting a large weight does not hold several int64 copies of it at once
PACK_CHUNK = 2**22


def pack_int4(codes: torch.Tensor, pack_method: str = "reorder") -> torch.Tensor:
    """amd-quark's 4-bit packing along the last axis: [..., n] integer codes -> [..., ceil(n/8)] int32 (rows packed
    a chunk at a time: each row's words depend on that row alone)."""
    if codes.ndim >= 2 and codes.numel() > PACK_CHUNK:
        rows = codes.reshape(-1, codes.shape[-1])
        step = max(1, PACK_CHUNK // max(1, codes.shape[-1]))
        packed = torch.cat([_pack_int4(rows[i : i + step], pack_method) for i in range(0, rows.shape[0], step)])
        return packed.reshape(*codes.shape[:-1], -1)
    return _pack_int4(codes, pack_method)


def _pack_int4(codes: torch.Tensor, pack_method: str) -> torch.Tensor:
    """``pack_int4`` of one chunk."""
    order = torch.tensor(PACK_ORDER[pack_method])
    n = codes.shape[-1]
    flat = codes.to(torch.int64) & 0xF
    pad = (-n) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(*flat.shape[:-1], pad)], dim=-1)
    groups = flat.reshape(*flat.shape[:-1], -1, 8)[..., order]  # nibble i holds element 8c + order[i]
    word = (groups << (4 * torch.arange(8))).sum(dim=-1)
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32)


def unpack_int4(packed: torch.Tensor, count: int, signed: bool, pack_method: str = "reorder") -> torch.Tensor:
    """The inverse of ``pack_int4``: [..., m] int32 -> [..., count] int32 codes (sign-extended when ``signed``)."""
    order = torch.tensor(PACK_ORDER[pack_method])
    words = packed.to(torch.int64) & 0xFFFFFFFF
    nibbles = (words.unsqueeze(-1) >> (4 * torch.arange(8))) & 0xF  # [..., m, 8], position i
    out = torch.empty_like(nibbles)
    out[..., order] = nibbles
    out = out.reshape(*packed.shape[:-1], -1)[..., :count]
    if signed:
        out = torch.where(out >= 8, out - 16, out)
    return out.to(torch.int32)
