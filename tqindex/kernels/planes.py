"""The planar view of direction codes that the GPU kernels read and write.

A run of b-bit codes (``CodeRun``) is a sequence of *groups*: one byte holding 8/b codes for b = 1, 2,
4 (one code for b = 8), three bytes holding eight codes for b = 3 (``packing``'s bit stream). Plane p
of a run is code p of every group, so coordinate ``start + g * planes + p`` is group g of plane p. A
kernel handles a plane as one tensor [rows, groups]: the scan multiplies it with the queries' matching
coordinates (``planar_queries``), the encoder computes it from the rotation's matching rows and packs
the planes of a group with shifts. No slicing or reshaping of registers is needed.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple, Sequence

import torch
from torch import Tensor

MAX_RUNS = 3
"""Coded runs a kernel reads (TurboQuantPCA has at most widths 4, 2 and 1)."""
FP4_GROUP = 32
"""Elements per scale group of the FP4 codes the attention kernel reads: one 16-byte k-step of codes."""


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (plain Python: launch code calls it often)."""
    return -(-a // b)


class RunLayout(NamedTuple):
    """How a kernel reads one coded run (all compile-time constants): bits, group bytes, planes, groups,
    groups padded to the k-step, k-step (groups per tile), byte offset in the code row, offset in the
    planar row, bytes, magnitude offset, coordinates, first coordinate."""

    bits: int
    group_bytes: int
    planes: int
    groups: int
    padded: int
    step: int
    byte_offset: int
    plane_offset: int
    nbytes: int
    mag_offset: int
    width: int
    start: int


ABSENT = RunLayout(1, 1, 1, 0, 0, 16, 0, 0, 0, 0, 0, 0)
"""The layout of a run that is not there (zero groups)."""


def run_layouts(runs: Sequence[Any], max_step: int = 64) -> tuple[list[RunLayout], Tensor, Tensor]:
    """Layouts of the coded ``runs`` (``CodeRun``), padded with :data:`ABSENT` to MAX_RUNS, and the
    positive halves of their codebooks: (layouts, magnitudes float32 [total], boundaries float32 [total]),
    run r's at ``mag_offset`` (the positive boundaries of a 2^b-level codebook: 2^(b-1) - 1 of them, its
    middle boundary is 0)."""
    out, mags, bounds = [], [], []
    byte = poff = moff = start = 0
    for run in runs:
        if run.bits:
            b = run.bits
            gb, planes = (3, 8) if b == 3 else (1, 8 // b if b < 8 else 1)
            groups = cdiv(run.width, planes)
            step = min(max_step, max(16, next_power_of_2(groups)))
            padded = cdiv(groups, step) * step
            out.append(RunLayout(b, gb, planes, groups, padded, step, byte, poff, run.nbytes, moff, run.width, start))
            h = len(run.centroids) // 2
            mags.append(run.centroids[h:].float())
            bounds.append(torch.cat([run.boundaries[h:].float(), run.boundaries.new_zeros(1)]))  # h - 1, padded to h
            byte, poff, moff = byte + run.nbytes, poff + planes * padded, moff + h
        start += run.width
    if len(out) > MAX_RUNS:
        raise ValueError(f"the GPU kernels read at most {MAX_RUNS} coded runs, got {len(out)}")
    return out + [ABSENT] * (MAX_RUNS - len(out)), torch.cat(mags), torch.cat(bounds)


def plane_width(layouts: Sequence[RunLayout]) -> int:
    """Entries of one planar row: every plane of every run, padded."""
    return sum(lay.planes * lay.padded for lay in layouts)


def plane_coordinates(layouts: Sequence[RunLayout], dim: int) -> Tensor:
    """For every entry of a planar row, the coordinate it holds (int64 [plane_width]; ``dim`` for padding)."""
    parts = []
    for lay in layouts:
        if lay.groups:
            g = torch.arange(lay.padded)
            for p in range(lay.planes):
                coord = g * lay.planes + p
                parts.append(torch.where((coord < lay.width) & (g < lay.groups), lay.start + coord, dim))
    return torch.cat(parts)


def to_planes(x: Tensor, layouts: Sequence[RunLayout]) -> Tensor:
    """Rows x [m, dim] in planar order [m, plane_width] (zeros where padded)."""
    return torch.nn.functional.pad(x, (0, 1))[:, coordinates_on(tuple(layouts), x.shape[1], x.device)]


@lru_cache(maxsize=64)
def coordinates_on(layouts: tuple[RunLayout, ...], dim: int, device: torch.device) -> Tensor:
    """:func:`plane_coordinates` on ``device`` (cached)."""
    return plane_coordinates(layouts, dim).to(device)


def attention_reads(key_encoder: Any, value_encoder: Any, mask: Tensor | None) -> bool:
    """Whether the GPU attention kernel reads these codes and this mask: direction codes of one coded run
    or FP4 codes with 32-element scale groups (``level_run``; dims from 32), dims up to 256 (keys and
    values), and no mask or one shared by all query heads ([B|1, 1, Q, T])."""
    for enc in (key_encoder, value_encoder):
        if hasattr(enc, "level_run"):
            if enc.group_size != FP4_GROUP or not FP4_GROUP <= enc.dim <= 256:
                return False
            continue
        runs = enc.code_runs() if hasattr(enc, "code_runs") and enc.is_trained else []
        if len(runs) != 1 or not runs[0].bits or enc.dim > 256:
            return False
    return mask is None or (mask.dim() == 4 and mask.shape[1] == 1)
