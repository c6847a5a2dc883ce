"""FP4-UE8M0: rotated vectors in groups of 32 as FP4 E2M1 codes with one power-of-two scale per group.

Layout per vector: ``qdata`` [ceil(dim/2)] bytes of nibble-packed E2M1 codes (element 2j in the low
nibble of byte j, so each 32-element group is one contiguous 16-byte run) and ``scale`` [G] UE8M0
bytes, ``G = ceil(dim / group_size)``. For dim = 32 that is 16 + 1 = 17 bytes (4.25 bits/element).
Decode: ``value = e2m1(code) · 2^(scale - 127)``, exact in float32 and bfloat16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from . import kernels
from .codebooks import (E2M1_MAGNITUDES, E2M1_VALUES, SCALE_ROUNDINGS, e2m1_encode, ue8m0_byte, ue8m0_exponent,
                        ue8m0_scale)
from .codes import Codes
from .directions import CodeRun
from .encoder import Encoder, register_class, register_name
from .packing import pack, packed_size, unpack_values
from .rotation import ROTATION_KINDS


@register_class
@dataclass(eq=False, repr=False)
class FP4UE8M0(Encoder):
    """UltraQuant's FP4 E2M1 + UE8M0 format after a seeded rotation (Hadamard for power-of-two dims).

    Group exponent ``E = scale_rounding(log2(scale_constant · absmax))``; "ceil" keeps the scale at or
    above ``scale_constant · absmax`` (so values saturate at most by 6.4/6), "round" is the literal
    formula of the paper. ``rotation="none"`` stores the raw coordinates.
    """

    dim: int
    group_size: int = 32
    scale_constant: float = 0.156
    scale_rounding: str = "ceil"
    seed: int = 0
    rotation: str = "auto"
    backend: str | None = None

    def _validate(self) -> None:
        if not isinstance(self.group_size, int) or self.group_size < 2 or self.group_size % 2:
            raise ValueError(f"group_size must be an even integer >= 2, got {self.group_size!r}")
        if not (isinstance(self.scale_constant, (int, float)) and 0 < self.scale_constant < math.inf):
            raise ValueError(f"scale_constant must be a positive finite number, got {self.scale_constant!r}")
        if self.scale_rounding not in SCALE_ROUNDINGS:
            raise ValueError(f"scale_rounding must be one of {SCALE_ROUNDINGS}, got {self.scale_rounding!r}")
        if self.rotation not in ROTATION_KINDS:
            raise ValueError(f"rotation must be one of {ROTATION_KINDS}, got {self.rotation!r}")

    @property
    def groups(self) -> int:
        """Scale groups per vector."""
        return -(-self.dim // self.group_size)

    @property
    def code_size(self) -> int:
        return packed_size(self.dim, 4) + self.groups

    def _expected_qdata_bytes(self) -> int:
        return packed_size(self.dim, 4)

    def _grouped(self, y: Tensor) -> Tensor:
        """[..., dim] -> [..., G, group_size], zero padded."""
        pad = self.groups * self.group_size - self.dim
        y = torch.nn.functional.pad(y, (0, pad))
        return y.reshape(*y.shape[:-1], self.groups, self.group_size)

    def _encode(self, x: Tensor, backend: str | None = None) -> Codes:
        # The Triton kernel (groups of a power of two) runs where asked for by name: "auto" keeps PyTorch until
        # the kernel has been compiled and timed on a GPU.
        named = self.group_size & (self.group_size - 1) == 0 and kernels.requested(backend) == "triton"
        chosen = kernels.select(x, backend, ("triton",) if named else (), "FP4 encoding")
        if chosen == "triton":
            from .kernels.encode_fp4_triton import encode_fp4_triton  # imports triton

            qdata, scale = encode_fp4_triton(self._rotation(x.device).apply(x), self.group_size, self.scale_constant,
                                             self.scale_rounding)
            return Codes(qdata=qdata, scale=scale)
        y = self._grouped(self._rotation(x.device).apply(x))  # [N, G, gs]
        exp = ue8m0_exponent(y.abs().amax(-1), self.scale_constant, self.scale_rounding)  # [N, G]
        scale = ue8m0_scale(ue8m0_byte(exp))
        codes = e2m1_encode(y / scale[..., None]).reshape(x.shape[0], -1)[:, : self.dim]
        return Codes(qdata=pack(codes, 4), scale=ue8m0_byte(exp))

    def _decode_rotated(self, codes: Codes) -> Tensor:
        vals = self._grouped(unpack_values(codes.qdata, 4, self.dim, E2M1_VALUES.to(codes.device)))  # [..., G, gs]
        vals = vals * ue8m0_scale(codes.scale)[..., None]
        return vals.flatten(-2)[..., : self.dim]

    def level_run(self) -> CodeRun:
        """The E2M1 levels as one 4-bit run of a symmetric codebook (GPU kernels decode through it): its
        code ``c ^ 8`` (``c ^ 15`` where the sign bit 3 of E2M1 code c is set) has E2M1 code c's value."""
        mags = torch.tensor(E2M1_MAGNITUDES)
        levels = torch.cat([-mags.flip(0), mags])
        return CodeRun(self.dim, levels, (levels[1:] + levels[:-1]) / 2)


register_name("fp4", lambda dim, **kw: FP4UE8M0(dim=dim, **kw))
