"""TurboQuant encoders: Q_mse (rotation + Lloyd-Max codebook) and Q_prod (Q_mse + 1-bit QJL residual)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from . import native
from .codebooks import lloyd_max, lookup
from .codes import Codes
from .checks import NORM_SAFE, check_choice, unit_rows
from .encoder import ENCODE_BLOCK_ELEMENTS, WIDE_NORMS, Encoder, register_class, register_name
from .packing import pack, pack_reference, packed_size, unpack_values
from .rotation import ROTATION_KINDS, Rotation, seeded_rng

RESCALE_MODES = ("norm", "unbiased", "cos")
CODE_SEARCH_RANGE = (0.85, 1.25)
"""Pre-scales tried by ``code_search``: codes of ``alpha · R u`` for alpha in this range."""
NORM_DTYPES = {"float16": torch.float16, "float32": torch.float32}
MSE_BITS = (1, 2, 3, 4, 8)
_SIGNS = torch.tensor([-1.0, 1.0])


NORM_LIMITS = {"float16": (2.0**-13, 2.0**15), "float32": WIDE_NORMS}
"""Nonzero input norms whose scale each norm_dtype holds faithfully: a scale is the norm times a factor
within [1/2, 2], and float16 is exact to 2^-11 between 2^-14 and 65504."""


def store_scale(scale: Tensor, norm_dtype: str) -> Tensor:
    """float32 per-vector scales -> their storage type, saturating at its largest finite value."""
    dtype = NORM_DTYPES[norm_dtype]
    top = torch.finfo(dtype).max
    return scale.clamp(-top, top).to(dtype)


Run = tuple[int, Tensor | None, Tensor | None]
"""(coordinates, centroids, boundaries): consecutive columns that share one codebook (None: columns
left out of the code)."""


def _quantize_rotated(y: Tensor, centroids: Tensor, boundaries: Tensor) -> tuple[Tensor, Tensor]:
    """Nearest codebook level of each coordinate: y [N, d] -> (idx [N, d] int32, levels float [N, d])."""
    idx = torch.bucketize(y, boundaries, out_int32=True)
    return idx, lookup(centroids, idx)


def search_alphas(candidates: int, device: torch.device | str = "cpu") -> Tensor:
    """Pre-scales tried by the direction search: [1] for ``candidates`` <= 1, else 1 and ``candidates``
    values spread over CODE_SEARCH_RANGE."""
    if candidates <= 1:
        return torch.ones(1, device=device)
    return torch.cat([torch.ones(1), torch.linspace(*CODE_SEARCH_RANGE, candidates)]).to(device)


def _run_bits(centroids: Tensor) -> int:
    return len(centroids).bit_length() - 1


def encode_directions(x: Tensor, rotation: Rotation, runs: list[Run], alphas: Tensor
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Codes of the directions of rows x [N, d]: ``y = R x``, ``u = y / ||y||``, and per coded run the
    nearest levels c of ``alpha · u``, the pre-scale alpha (one of ``alphas`` [A], the first on ties)
    chosen for the largest cos(u, c) over all runs. The ``runs`` cover y's columns in order.

    -> (qdata uint8 [N, bytes]: each coded run bit-packed (``packing``) after the previous one,
    ||y|| [N], <u, c> [N], ||c||² [N]). Runs the compiled kernel (``csrc/quantize.c``) for float32 CPU
    rows and symmetric codebooks of up to 16 levels, else :func:`encode_directions_reference`.
    """
    coded = [c for _, c, _ in runs if c is not None]
    if (x.device.type == "cpu" and x.dtype == torch.float32 and native.available()
            and all(len(c) <= 16 and torch.equal(c, -c.flip(0)) for c in coded)):
        encode = _encode_directions_native
    else:
        encode = encode_directions_reference
    qdata, norm, dot, sq = encode(x, rotation, runs, alphas)
    # Rows whose float32 sum of squares under- or overflowed: encoded again scaled by a power of two
    # (their codes do not depend on the scale), their norms scaled back exactly.
    unsafe = torch.nonzero(~((norm >= NORM_SAFE[0]) & (norm <= NORM_SAFE[1]))).squeeze(1)
    if len(unsafe):
        true_norm = torch.linalg.vector_norm(x[unsafe].double(), dim=-1)
        unsafe, true_norm = unsafe[true_norm > 0], true_norm[true_norm > 0]
        if len(unsafe):
            exp = torch.round(torch.log2(true_norm)).int()
            q2, n2, dot[unsafe], sq[unsafe] = encode(torch.ldexp(x[unsafe].double(), -exp).float(), rotation, runs, alphas)
            qdata[unsafe], norm[unsafe] = q2, torch.ldexp(n2.double(), exp).float()
    return qdata, norm, dot, sq


def _encode_directions_native(x: Tensor, rotation: Rotation, runs: list[Run], alphas: Tensor,
                              allow_simd: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`encode_directions` by the compiled kernel, rows split over torch's thread count (the
    rotation too, unless it is a large-dim Hadamard, which torch applies first); ``allow_simd=False``
    runs the kernel's portable loops."""
    matrix = rotation.matmul_matrix
    if matrix is not None:
        matrix = matrix.float().contiguous()  # referenced here until the kernel has returned
    elif rotation.kind != "none":
        x = rotation.apply(x)
    x, alphas = x.contiguous(), alphas.float().contiguous()
    seg_len = torch.tensor([r[0] for r in runs], dtype=torch.int64)
    seg_h = torch.tensor([0 if c is None else len(c) // 2 for _, c, _ in runs], dtype=torch.int64)
    levels, bounds = torch.zeros(len(runs), 8), torch.zeros(len(runs), 8)
    for i, (_, c, b) in enumerate(runs):  # the positive halves
        if c is not None:
            h = len(c) // 2
            levels[i, :h], bounds[i, : h - 1] = c[h:].float(), b[h:].float()
    n, d = x.shape
    row_bytes = sum(packed_size(w, _run_bits(c)) for w, c, _ in runs if c is not None)
    qdata = torch.empty(n, row_bytes, dtype=torch.uint8)
    norm, dot, sq = torch.empty(n), torch.empty(n), torch.empty(n)
    rot = 0 if matrix is None else matrix.data_ptr()
    lib = native.require()

    def call(a: int, b: int) -> int:
        return lib.tq_encode_directions(x[a:].data_ptr(), b - a, d, rot, alphas.data_ptr(), len(alphas), len(runs),
                                        seg_len.data_ptr(), seg_h.data_ptr(), levels.data_ptr(), bounds.data_ptr(),
                                        qdata[a:].data_ptr(), row_bytes, norm[a:].data_ptr(), dot[a:].data_ptr(),
                                        sq[a:].data_ptr(), int(allow_simd))

    if -1 in native.parallel(call, native.row_jobs(n, d)):
        raise ValueError("encode_directions: runs do not cover the columns or a codebook is not 2^bits levels")
    return qdata, norm, dot, sq


def encode_directions_reference(x: Tensor, rotation: Rotation, runs: list[Run], alphas: Tensor
                                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """PyTorch :func:`encode_directions` (reference of the kernel, and the GPU path), in blocks of
    about ENCODE_BLOCK_ELEMENTS elements (its temporaries are A times a block)."""
    rows = max(1, ENCODE_BLOCK_ELEMENTS // x.shape[1])
    if len(x) > rows:
        parts = [encode_directions_reference(x[i : i + rows], rotation, runs, alphas) for i in range(0, len(x), rows)]
        return tuple(torch.cat(p) for p in zip(*parts))
    y = rotation.apply(x)
    norm = torch.linalg.vector_norm(y, dim=-1)
    u = y / torch.where(norm > 0, norm, torch.ones_like(norm))[:, None]
    cols, coded, start = [], [], 0
    for width, c, b in runs:
        if c is not None:
            cols.append(u[:, start : start + width])
            coded.append((width, c, b))
        start += width
    idx, dot, sq = quantize_direction_reference(torch.cat(cols, 1), coded, alphas)
    parts, start = [], 0
    for width, c, _ in coded:
        parts.append(pack_reference(idx[:, start : start + width], _run_bits(c)))
        start += width
    return torch.cat(parts, 1), norm, dot, sq


def quantize_direction_reference(y: Tensor, runs: list[Run], alphas: Tensor) -> tuple[Tensor, Tensor, Tensor]:
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


@register_class
@dataclass(eq=False, repr=False)
class TurboQuantMSE(Encoder):
    """TurboQuant Q_mse: ``x̂ = s · Rᵀ c[idx]``, b bits per coordinate plus one scalar s per vector.

    ``rescale`` chooses s: ``"norm"`` s = ||x|| (the paper), ``"unbiased"`` s = ||x|| / <R u, c[idx]>
    (inner products with unit u unbiased to first order, as RaBitQ/EDEN do), ``"cos"`` s = ||x|| / ||c||
    (the reconstruction keeps the norm of x exactly, and <q, x̂> is ||x|| ||q|| times the cosine of q and
    the code direction). ``code_search`` > 1 (with "unbiased"/"cos") picks, among the nearest-level codes
    of ``alpha · R u`` for that many alphas, the one whose direction is closest to ``R u``.
    ``norm_dtype`` is the storage type of s ("float16": 2 bytes).
    """

    encodes_in_blocks: ClassVar[bool] = False  # encode_directions bounds its own memory

    dim: int
    bits: int = 4
    seed: int = 0
    rescale: str = "cos"
    code_search: int = 6
    norm_dtype: str = "float16"
    rotation: str = "auto"

    def _validate(self) -> None:
        check_choice(self.bits, "bits", MSE_BITS)
        check_choice(self.rescale, "rescale", RESCALE_MODES)
        if not isinstance(self.code_search, int) or self.code_search < 1:
            raise ValueError(f"code_search must be an integer >= 1, got {self.code_search!r}")
        if self.code_search > 1 and self.rescale == "norm":
            raise ValueError("code_search > 1 needs rescale='unbiased' or 'cos' (rescale='norm' keeps the paper's codes)")
        check_choice(self.norm_dtype, "norm_dtype", NORM_DTYPES)
        check_choice(self.rotation, "rotation", ROTATION_KINDS)

    def _build(self) -> dict[str, Tensor]:
        cb = lloyd_max(self.dim, self.bits)
        return {
            **super()._build(),
            "centroids": torch.from_numpy(cb.centroids).float(),
            "boundaries": torch.from_numpy(cb.boundaries).float(),
        }

    @property
    def code_size(self) -> int:
        return packed_size(self.dim, self.bits) + NORM_DTYPES[self.norm_dtype].itemsize

    @property
    def norm_limits(self) -> tuple[float, float]:
        return NORM_LIMITS[self.norm_dtype]

    def _expected_qdata_bytes(self) -> int:
        return packed_size(self.dim, self.bits)

    def segments(self) -> list[tuple[int, int, Tensor]]:
        """(coordinates, bits, levels) of each run of codes in qdata order: here one run."""
        return [(self.dim, self.bits, self._state["centroids"])]

    def _encode(self, x: Tensor) -> Codes:
        s = self._on(x.device)
        search = self.code_search if self.bits > 1 else 1  # 1-bit codes are signs: nothing to search
        runs = [(self.dim, s["centroids"], s["boundaries"])]
        qdata, n, ydotc, csq = encode_directions(x, self._rotation(x.device), runs, search_alphas(search, x.device))
        if self.rescale == "norm":
            scale = n
        else:
            inv = 1.0 / ydotc if self.rescale == "unbiased" else torch.rsqrt(csq)
            scale = torch.where(n > 0, n * inv, torch.zeros_like(n))
        return Codes(qdata=qdata, norm=store_scale(scale, self.norm_dtype))

    def _decode_rotated(self, codes: Codes) -> Tensor:
        c = self._on(codes.device)["centroids"]
        return unpack_values(codes.qdata, self.bits, self.dim, c) * codes.norm.float()[..., None]


@register_class
@dataclass(eq=False, repr=False)
class TurboQuantProd(Encoder):
    """TurboQuant Q_prod: (bits-1)-bit Q_mse of the unit vector + 1-bit QJL of its residual.

    Stores ``n = ||x||``, the Q_mse codes of ``u = x/n`` (rotated: y = R u), ``γ = ||y - c[idx]||``
    and ``z = sign(S (y - c[idx]))`` with S a seeded [dim, dim] N(0, 1) matrix. The estimate
    ``n (<R q, c[idx]> + γ sqrt(pi/2)/dim <S R q, z>)`` is unbiased for ``<q, x>``. bits=1 is pure QJL.
    """

    dim: int
    bits: int = 4
    seed: int = 0
    norm_dtype: str = "float16"
    rotation: str = "auto"

    def _validate(self) -> None:
        check_choice(self.bits, "bits", (1, 2, 3, 4, 5))
        check_choice(self.norm_dtype, "norm_dtype", NORM_DTYPES)
        check_choice(self.rotation, "rotation", ROTATION_KINDS)

    def _build(self) -> dict[str, Tensor]:
        out = super()._build()
        if self.bits > 1:
            cb = lloyd_max(self.dim, self.bits - 1)
            out["centroids"] = torch.from_numpy(cb.centroids).float()
            out["boundaries"] = torch.from_numpy(cb.boundaries).float()
        s = seeded_rng(self.seed, 2).standard_normal((self.dim, self.dim))
        out["qjl_matrix"] = torch.from_numpy(s).float()
        return out

    @property
    def code_size(self) -> int:
        return self._expected_qdata_bytes() + packed_size(self.dim, 1) + 2 * NORM_DTYPES[self.norm_dtype].itemsize

    @property
    def norm_limits(self) -> tuple[float, float]:
        return NORM_LIMITS[self.norm_dtype]

    def _expected_qdata_bytes(self) -> int:
        return packed_size(self.dim, self.bits - 1) if self.bits > 1 else 0

    def _encode(self, x: Tensor) -> Codes:
        s = self._on(x.device)
        n, u = unit_rows(x)
        y = self._rotation(x.device).apply(u)  # [N, d]
        if self.bits > 1:
            idx, c = _quantize_rotated(y, s["centroids"], s["boundaries"])
            qdata = pack(idx, self.bits - 1)
            r = y - c
        else:
            qdata = torch.empty(x.shape[0], 0, dtype=torch.uint8, device=x.device)
            r = y
        z = (r @ s["qjl_matrix"].T) >= 0  # [N, d] sign bits of S r
        gamma = torch.linalg.vector_norm(r, dim=-1)  # of a unit vector's residual: in [0, 2]
        return Codes(qdata=qdata, norm=store_scale(n, self.norm_dtype), qjl=pack(z, 1),
                     gamma=store_scale(gamma, self.norm_dtype))

    def _decode_rotated(self, codes: Codes) -> Tensor:
        s = self._on(codes.device)
        signs = unpack_values(codes.qjl, 1, self.dim, _SIGNS.to(codes.device))  # [..., d] in {-1, +1}
        qjl = (signs @ s["qjl_matrix"]) * (codes.gamma.float() * math.sqrt(math.pi / 2) / self.dim)[..., None]
        if self.bits > 1:
            qjl = qjl + unpack_values(codes.qdata, self.bits - 1, self.dim, s["centroids"])
        return qjl * codes.norm.float()[..., None]


for _b in MSE_BITS:
    register_name(f"tq{_b}", lambda dim, _b=_b, **kw: TurboQuantMSE(dim=dim, bits=_b, **kw))
    register_name(
        f"tq{_b}-norm",
        lambda dim, _b=_b, **kw: TurboQuantMSE(dim=dim, bits=_b, **{"rescale": "norm", "code_search": 1, **kw}),
    )
for _b in (1, 2, 3, 4):
    register_name(f"tq{_b}-prod", lambda dim, _b=_b, **kw: TurboQuantProd(dim=dim, bits=_b, **kw))
