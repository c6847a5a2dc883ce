"""Direction codes: the family of TurboQuantMSE and TurboQuantPCA.

A vector x is stored as one scale s and the code of its direction in a rotated basis: ``y = R x``,
``u = y / ||y||``, and per *run* of consecutive coordinates (:class:`CodeRun`, sharing one scalar
codebook) the nearest codebook levels c of ``alpha · u``, the pre-scale alpha (from a small list) chosen
for the largest cos(u, c) over the whole vector. The reconstruction in the rotated domain is
``s · c`` (coordinates of runs without a codebook are 0), so ``<R q, R x̂> = s · <R q, c>``: every
scan scores codes from lookup tables or decoded levels times one scale per vector.

:func:`encode_directions` dispatches to the compiled kernels (``kernels.select``);
:func:`encode_directions_reference` is their PyTorch reference.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from . import kernels
from .checks import NORM_SAFE, check_choice
from .codebooks import lookup
from .codes import Codes
from .encoder import ENCODE_BLOCK_ELEMENTS, WIDE_NORMS, Encoder
from .kernels.encode_native import encode_directions_native
from .packing import pack_reference, packed_size, unpack_values
from .rotation import Rotation
from .scorer import direction_scorer

CODE_SEARCH_RANGE = (0.85, 1.25)
"""Pre-scales tried by ``code_search``: codes of ``alpha · R u`` for alpha in this range."""
NORM_DTYPES = {"float16": torch.float16, "float32": torch.float32}
NORM_LIMITS = {"float16": (2.0**-13, 65504 / 2), "float32": WIDE_NORMS}
"""Nonzero input norms whose scale each norm_dtype holds faithfully: a scale is the norm times a factor
within [1/2, 2], and float16 is exact to 2^-11 between 2^-14 and 65504."""


class CodeRun(NamedTuple):
    """Consecutive rotated coordinates sharing one scalar codebook (None: left out of the code)."""

    width: int
    centroids: Tensor | None  # [2^bits] ascending levels
    boundaries: Tensor | None  # [2^bits - 1] midpoints

    @property
    def bits(self) -> int:
        """Bits per coordinate (0: not stored)."""
        return 0 if self.centroids is None else len(self.centroids).bit_length() - 1

    @property
    def nbytes(self) -> int:
        """Packed bytes of the run in a code row."""
        return packed_size(self.width, self.bits) if self.bits else 0


RESCALE_MODES = ("norm", "unbiased", "cos")
"""The per-vector scale s of a direction code c (``x̂ = s · Rᵀ c``): :func:`direction_scale`."""


def check_scale_options(rescale: Any, code_search: Any, norm_dtype: Any) -> None:
    """ValueError naming the field unless ``rescale`` is one of RESCALE_MODES, ``code_search`` an integer >= 1
    and ``norm_dtype`` one of NORM_DTYPES (the scale options of direction codes)."""
    check_choice(rescale, "rescale", RESCALE_MODES)
    if not isinstance(code_search, int) or isinstance(code_search, bool) or code_search < 1:
        raise ValueError(f"code_search must be an integer >= 1, got {code_search!r}")
    check_choice(norm_dtype, "norm_dtype", NORM_DTYPES)


def direction_scale(norm: Tensor, dot: Tensor, sq: Tensor, rescale: str) -> Tensor:
    """The scale s of codes c of unit directions u of vectors of norm ``norm`` [N], with ``dot`` = <u, c> and
    ``sq`` = ||c||² [N]: ``"norm"`` ||x||, ``"unbiased"`` ||x|| / <u, c> (inner products with u unbiased to
    first order), ``"cos"`` ||x|| / ||c|| (the norm kept); 0 for zero vectors."""
    if rescale == "norm":
        return norm
    inv = 1.0 / dot if rescale == "unbiased" else torch.rsqrt(sq)
    return torch.where(norm > 0, norm * inv, torch.zeros_like(norm))


def store_scale(scale: Tensor, norm_dtype: str) -> Tensor:
    """float32 per-vector scales -> their storage type, saturating at its largest finite value."""
    dtype = NORM_DTYPES[norm_dtype]
    top = torch.finfo(dtype).max
    return scale.clamp(-top, top).to(dtype)


@lru_cache(maxsize=64)
def search_alphas(candidates: int, device: torch.device | str = "cpu") -> Tensor:
    """Pre-scales tried by the direction search: [1] for ``candidates`` <= 1, else 1 and ``candidates``
    values spread over CODE_SEARCH_RANGE (cached per device: read, never modify)."""
    if candidates <= 1:
        return torch.ones(1, device=device)
    return torch.cat([torch.ones(1), torch.linspace(*CODE_SEARCH_RANGE, candidates)]).to(device)


def native_encodes(runs: list[CodeRun]) -> bool:
    """Whether the compiled encoder serves these runs: symmetric codebooks of at most 16 levels."""
    coded = [r.centroids for r in runs if r.centroids is not None]
    return all(len(c) <= 16 and torch.equal(c, -c.flip(0)) for c in coded)


def encode_directions(x: Tensor, rotation: Rotation, runs: list[CodeRun], alphas: Tensor,
                      backend: str | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Codes of the directions of rows x [N, d] (module notes; alpha is the first of ``alphas`` [A] on ties).

    -> (qdata uint8 [N, bytes]: each coded run bit-packed (``packing``) after the previous one,
    ||y|| [N], <u, c> [N], ||c||² [N]). ``backend``: as for ``kernels.select`` (native: float32 CPU rows
    and symmetric codebooks of up to 16 levels; triton: any). Exact for any finite input
    (:func:`rescue_unsafe_rows`; the Triton encoder scales the rows it rotates itself).
    """
    # (the native kernel runs on CPU tensors only: comparing device codebooks would wait for the device)
    kinds = ("native", "triton") if x.device.type != "cpu" or native_encodes(runs) else ("triton",)
    chosen = kernels.select(x, backend, kinds, "direction encoding")
    if chosen == "triton":
        from .kernels.encode_triton import encode_directions_triton  # imports triton

        return encode_directions_triton(x, rotation, runs, alphas)
    encode = encode_directions_native if chosen == "native" else encode_directions_reference
    codes = encode(x, rotation, runs, alphas)
    rescue_unsafe_rows(encode, x, rotation, runs, alphas, *codes)
    return codes


def rescue_unsafe_rows(encode: Any, x: Tensor, rotation: Rotation, runs: list[CodeRun], alphas: Tensor,
                       qdata: Tensor, norm: Tensor, dot: Tensor, sq: Tensor) -> None:
    """Rows of x [N, d] whose float32 sum of squares under- or overflowed in ``encode`` (their norm outside
    NORM_SAFE) encoded again, scaled by a power of two, in place in ``encode``'s outputs: their codes do not
    depend on the scale, their norms are scaled back exactly. Reads the norms on the host (on a GPU it waits
    for the device)."""
    unsafe = torch.nonzero(~((norm >= NORM_SAFE[0]) & (norm <= NORM_SAFE[1]))).squeeze(1)
    if len(unsafe):
        true_norm = torch.linalg.vector_norm(x[unsafe].double(), dim=-1)
        unsafe, true_norm = unsafe[true_norm > 0], true_norm[true_norm > 0]
        if len(unsafe):
            exp = torch.round(torch.log2(true_norm)).int()
            scaled = torch.ldexp(x[unsafe].double(), -exp[:, None]).float()
            q2, n2, dot[unsafe], sq[unsafe] = encode(scaled, rotation, runs, alphas)
            qdata[unsafe], norm[unsafe] = q2, torch.ldexp(n2.double(), exp).float()


def encode_directions_reference(x: Tensor, rotation: Rotation, runs: list[CodeRun], alphas: Tensor
                                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """PyTorch :func:`encode_directions` (reference of the kernels; no rescue of unsafe rows), in blocks
    of about ENCODE_BLOCK_ELEMENTS elements (its temporaries are A times a block)."""
    rows = max(1, ENCODE_BLOCK_ELEMENTS // x.shape[1])
    if len(x) > rows:
        parts = [encode_directions_reference(x[i : i + rows], rotation, runs, alphas) for i in range(0, len(x), rows)]
        return tuple(torch.cat(p) for p in zip(*parts))
    y = rotation.apply(x)
    norm = torch.linalg.vector_norm(y, dim=-1)
    u = y / torch.where(norm > 0, norm, torch.ones_like(norm))[:, None]
    cols, coded, start = [], [], 0
    for run in runs:
        if run.bits:
            cols.append(u[:, start : start + run.width])
            coded.append(run)
        start += run.width
    idx, dot, sq = quantize_direction_reference(torch.cat(cols, 1), coded, alphas)
    parts, start = [], 0
    for run in coded:
        parts.append(pack_reference(idx[:, start : start + run.width], run.bits))
        start += run.width
    return torch.cat(parts, 1), norm, dot, sq


def quantize_direction_reference(y: Tensor, runs: list[CodeRun], alphas: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The direction search of :func:`encode_directions` on unit rows y [N, d] whose columns are the
    coded ``runs``: -> (idx int32 [N, d] into each run's codebook, <y, c> [N], ||c||² [N]).

    One bucketize per run serves every alpha: the cuts ``boundaries / alpha`` split the axis into
    cells in which each alpha's level is constant, so per-cell tables give every candidate's level.
    """
    n, a = y.shape[0], len(alphas)
    dot = y.new_zeros(n, a)
    sq = y.new_zeros(n, a)
    tables, start = [], 0
    for width, centroids, boundaries in runs:
        yr = y[:, start : start + width].contiguous()
        start += width
        cuts = torch.unique(boundaries[None, :] / alphas[:, None])  # sorted cell edges [C - 1]
        inside = torch.cat([cuts[:1] - 1, (cuts[1:] + cuts[:-1]) / 2, cuts[-1:] + 1])  # a point per cell [C]
        level = torch.bucketize(inside[:, None] * alphas, boundaries, out_int32=True)  # [C, A]
        value = lookup(centroids, level)  # [C, A]
        cell = torch.bucketize(yr, cuts, out_int32=True)  # [N, width]
        c_all = value.index_select(0, cell.reshape(-1)).reshape(n, width, a)  # every candidate's levels
        dot += torch.einsum("nd,nda->na", yr, c_all)
        sq += c_all.square().sum(1)
        tables.append((cell, level))
    best = (dot * sq.rsqrt()).argmax(1, keepdim=True)  # [N, 1]
    idx = [level.reshape(-1).index_select(0, (cell * a + best.to(torch.int32)).reshape(-1)).reshape(cell.shape)
           for cell, level in tables]
    return torch.cat(idx, 1), dot.gather(1, best).squeeze(1), sq.gather(1, best).squeeze(1)


class DirectionEncoder(Encoder):
    """Base of encoders whose codes are direction codes times one scale (module notes).

    Subclasses give :meth:`code_runs`, ``norm_dtype`` and ``_encode``; decoding and scoring are here,
    so every scan (lookup tables, the compiled CPU scan, the GPU kernels) serves them all.
    """

    encodes_in_blocks: ClassVar[bool] = False  # encode_directions bounds its own memory
    norm_dtype: str

    def code_runs(self, device: torch.device | str = "cpu") -> list[CodeRun]:
        """The runs of the code, covering the rotated coordinates in order, codebooks on ``device``."""
        raise NotImplementedError

    @property
    def norm_limits(self) -> tuple[float, float]:
        return NORM_LIMITS[self.norm_dtype]

    def _expected_qdata_bytes(self) -> int:
        return sum(r.nbytes for r in self.code_runs())

    def _decode_rotated(self, codes: Codes) -> Tensor:
        runs = self.code_runs(codes.device)
        if len(runs) == 1:
            (width, levels, _), = runs
            return unpack_values(codes.qdata, runs[0].bits, width, levels) * codes.norm.float()[..., None]
        out = torch.zeros(*codes.qdata.shape[:-1], self.dim, device=codes.device)
        byte = lo = 0
        for run in runs:
            if run.bits:
                rows = codes.qdata[..., byte : byte + run.nbytes]
                out[..., lo : lo + run.width] = unpack_values(rows, run.bits, run.width, run.centroids)
                byte += run.nbytes
            lo += run.width
        return out * codes.norm.float()[..., None]

    def scorer(self, qs: Tensor, l2: bool, backend: str | None = None, shifted: bool = False, bar: Any = None):
        """A :class:`~tqindex.scorer.Scorer` of these codes for prepared queries qs [m, dim]: lookup tables or
        decode-and-GEMM (torch), the compiled nibble scan (native: 1/2/3/4-bit runs) or the GPU scan
        (triton); see :meth:`Encoder.scorer`."""
        return direction_scorer(self, qs, l2, backend, shifted, bar)
