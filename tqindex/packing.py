"""Bit packing of b-bit codes (b = 1, 2, 3, 4, 8) along the last dimension.

Layout: each row is a little-endian bit stream. Code j of a row occupies bits ``[b·j, b·j + b)``;
byte i holds stream bits ``8i .. 8i+7``, least significant bit first. A row of ``dim`` codes takes
``ceil(dim · b / 8)`` bytes; unused high bits of the last byte are zero. For b = 4 this is the usual
nibble order: element 2j in the low nibble, element 2j+1 in the high nibble of byte j. For b = 1, 2
element j sits at bit ``b · (j mod 8/b)`` of byte ``j // (8/b)``; b = 3 packs 8 codes into 3 bytes.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from . import kernels

PACK_BITS = (1, 2, 3, 4, 8)


def packed_size(dim: int, bits: int) -> int:
    """Bytes per row of ``dim`` codes of ``bits`` bits."""
    _check_bits(bits)
    return (dim * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if bits not in PACK_BITS:
        raise ValueError(f"bits must be one of {PACK_BITS}, got {bits!r}")


def pack(codes: Tensor, bits: int, backend: str | None = None) -> Tensor:
    """Pack integer codes [..., dim] with values in [0, 2^bits) into uint8 [..., ceil(dim·bits/8)].

    ``backend`` as for ``kernels.select`` (the compiled kernel, ``csrc/packing.c``, serves CPU rows);
    :func:`pack_reference` is the reference."""
    _check_bits(bits)
    c = codes.to(torch.uint8)
    if bits == 8:
        return c
    if c.numel() and kernels.select(c, backend, ("native",), "bit packing") == "native":
        from .kernels.encode_native import pack_native  # it imports this module

        return pack_native(c, bits)
    return pack_reference(c, bits)


def pack_reference(codes: Tensor, bits: int) -> Tensor:
    """PyTorch :func:`pack` (any device; the reference of the compiled kernel)."""
    _check_bits(bits)
    dim = codes.shape[-1]
    c = codes.to(torch.uint8)
    if bits == 8:
        return c
    per_group = 8 if bits == 3 else 8 // bits  # codes per group; a group is `bits` bytes (3) or 1 byte
    groups = -(-dim // per_group)
    c = torch.nn.functional.pad(c, (0, groups * per_group - dim)).unflatten(-1, (groups, per_group))
    if bits == 3:
        word = c[..., 0].to(torch.int32)
        for j in range(1, 8):
            word = word | (c[..., j].to(torch.int32) << (3 * j))  # 24-bit group
        out = torch.stack([(word >> (8 * i)) & 0xFF for i in range(3)], -1).to(torch.uint8).flatten(-2)
    else:
        out = c[..., 0].clone()
        for j in range(1, per_group):
            out |= c[..., j] << (bits * j)
    return out[..., : packed_size(dim, bits)]


def unpack(packed: Tensor, bits: int, dim: int) -> Tensor:
    """Inverse of :func:`pack`: uint8 [..., ceil(dim·bits/8)] -> uint8 codes [..., dim]."""
    _check_bits(bits)
    if packed.shape[-1] != packed_size(dim, bits):
        raise ValueError(
            f"packed rows have {packed.shape[-1]} bytes, expected {packed_size(dim, bits)} "
            f"for dim={dim}, bits={bits}"
        )
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    if bits == 3:
        groups = -(-dim // 8)
        p = torch.nn.functional.pad(packed, (0, groups * 3 - packed.shape[-1])).unflatten(-1, (groups, 3))
        word = p[..., 0].to(torch.int32) | (p[..., 1].to(torch.int32) << 8) | (p[..., 2].to(torch.int32) << 16)
        codes = torch.stack([(word >> (3 * j)) & mask for j in range(8)], -1).to(torch.uint8)
    else:
        codes = torch.stack([(packed >> (bits * j)) & mask for j in range(8 // bits)], -1)
    return codes.flatten(-2)[..., :dim]


def byte_table(levels: Tensor, bits: int) -> Tensor:
    """Values of the ``8 // bits`` codes in every possible byte: levels [2^bits] -> [256, 8 // bits]."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"byte tables exist for bits 1, 2, 4, 8, got {bits!r}")
    return levels.index_select(0, _byte_codes(bits, levels.device)).reshape(256, 8 // bits)


@lru_cache(maxsize=64)
def _byte_codes(bits: int, device: torch.device) -> Tensor:
    """The codes of every byte value, int32 [256 * (8 // bits)] on ``device`` (cached)."""
    all_bytes = torch.arange(256, dtype=torch.uint8, device=device)[:, None]  # [256, 1]
    return unpack(all_bytes, bits, 8 // bits).reshape(-1).to(torch.int32)


def unpack_values(packed: Tensor, bits: int, dim: int, levels: Tensor) -> Tensor:
    """``levels[unpack(packed, bits, dim)]``: packed codes straight to their float values [..., dim].

    For bits 1, 2, 4, 8 every byte is looked up once in a :func:`byte_table` (no unpacking); 3-bit
    codes are unpacked first.
    """
    if bits == 3:
        codes = unpack(packed, bits, dim)
        return levels.index_select(0, codes.reshape(-1).to(torch.int32)).reshape(codes.shape)
    if packed.shape[-1] != packed_size(dim, bits):
        raise ValueError(f"packed rows have {packed.shape[-1]} bytes, expected {packed_size(dim, bits)}")
    vals = byte_table(levels, bits).index_select(0, packed.reshape(-1).to(torch.int32))  # [N·bytes, 8/b]
    return vals.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))[..., :dim]
