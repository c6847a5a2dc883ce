"""The two passes of a GPU scan of 1-16 queries over one 4-bit run of direction codes by CUDA C++ kernels, built at
first use by ``torch.utils.cpp_extension`` (nvcc; once, cached by torch between processes):

- tile maxima (``csrc/scan_tiles.cu``, whose notes describe them): :class:`~tqindex.kernels.scan_triton.TritonScorer`'s
  ``MODE_TILE_MAX`` scan, each tile of TILE rows' best score per query. They score in int8: levels and queries
  rounded to int8 (:func:`int8_levels`), products summed exactly (dp4a, int8 tensor-core MMAs). Their reference,
  :func:`tile_maxima_ref`, computes the same roundings in PyTorch; it differs from the exact scores by at most
  :func:`rounding_bound`.
- exact re-scoring (``csrc/rescore_rows.cu``): the float32 scores of every row of each query's best tiles, as
  ``TritonScorer.rescore`` computes them, from a table of each coordinate's products with the sixteen levels.
  Reference: :func:`rescore_ref`.

They read codes of one 4-bit run over every coordinate with float16 norms (``tq4`` and its variants) whose code rows
are a multiple of 32 bytes (dims a multiple of 64); elsewhere the Triton kernels compute the same.
"""

from __future__ import annotations

import warnings
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..codes import Codes
from .planes import RunLayout, cdiv

TILE = 256
"""Rows per tile (and threads per block) of the kernel."""
MAX_QUERIES = 16
"""Queries up to which the kernels scan (TILE_QUERIES of the Triton scorer: beyond, no tile maxima are taken). On an
H200 over 10M x 128 codes 1, 2, 4, 8, 16 queries took 0.21, 0.23, 0.27, 0.24, 0.31 ms against the Triton kernel's
0.43, 0.60, 0.60, 0.60, 0.57 ms."""
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("scan_tiles.cu", "rescore_rows.cu")]
_DECLARATION = """
void tile_max_launch(int64_t codes, int64_t norm, int64_t q, int64_t qstride, int64_t half, int64_t qscale, int64_t m,
                     int64_t n, int64_t row_bytes, bool l2, const std::vector<int64_t>& tab, double lscale, int64_t out,
                     int64_t split, int64_t stream);
void rescore_launch(int64_t codes, int64_t norm, int64_t q, int64_t qstride, int64_t half, int64_t qscale,
                    int64_t qrows, int64_t m, int64_t n, int64_t row_bytes, bool l2, const std::vector<double>& mags,
                    int64_t cand, int64_t c, int64_t span, int64_t out_v, int64_t out_i, int64_t stream);
"""
RESCORE_MIN_ROWS = 64 * 1024
"""Candidate rows (all queries together) from which the re-scoring kernel scores them: on an H200 (10M x 128 tq4, CUDA
graphs, L2 flushed) one query's 8,192 and 32,768 rows (k = 10, 100) took 17.2 and 18.0 us against the Triton
kernel's 13.2 and 15.1 (too few blocks), 16 queries' 131,072 and 524,288 rows 18.8 and 32.4 us against 36.8 and
116.4; the best 32 and 128 tiles of 128 rows of 4096 queries (16.8M and 67.1M rows) 0.64 and 2.5 ms against 3.5 and
14.0, the same scores."""
RESCORE_TABLE_BYTES = 200 * 1024
"""Largest table of products (16 float32 per coordinate) the re-scoring kernel keeps in shared memory: dims up to
3,200."""


@cache
def _module() -> Any:
    """The extension, or None where it does not build (warned once; the Triton kernel then scans)."""
    from torch.utils.cpp_extension import load_inline

    try:
        return load_inline("tqindex_scan_tiles", cpp_sources=_DECLARATION,
                           cuda_sources=[source.read_text() for source in SOURCES],
                           functions=["tile_max_launch", "rescore_launch"], extra_cuda_cflags=["-O3", "-std=c++17"],
                           extra_include_paths=[str(SOURCES[0].parent)])
    except Exception as e:  # a compiler or toolkit problem: the Triton kernel still runs
        warnings.warn(f"the CUDA scan kernels could not be built ({e}); the Triton kernels scan", RuntimeWarning,
                      stacklevel=3)
        return None


@cache
def available() -> bool:
    """Whether the kernel can be built here: a CUDA device, a CUDA build of torch and nvcc."""
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.cuda.is_available() and torch.version.cuda is not None and CUDA_HOME is not None


def reads(layouts: tuple, codes: Codes, m: int) -> bool:
    """Whether the tile-maxima kernel scans these codes (:func:`reads_codes`) for ``m`` queries."""
    return 0 < m <= MAX_QUERIES and reads_codes(layouts, codes)


def rescores(layouts: tuple, codes: Codes, m: int, width: int) -> bool:
    """Whether the re-scoring kernel scores ``width`` candidate rows for each of ``m`` queries of these codes
    (:func:`reads_codes`): at least RESCORE_MIN_ROWS rows in all, a table of products that fits in shared memory."""
    return (m * width >= RESCORE_MIN_ROWS
            and codes.qdata.shape[1] * 2 * 16 * 4 <= RESCORE_TABLE_BYTES and reads_codes(layouts, codes))


def reads_codes(layouts: tuple, codes: Codes) -> bool:
    """Whether the kernels read these codes (CUDA, in one 4-bit run over every coordinate of rows of a multiple of 32
    bytes at a 16-byte aligned address, float16 norms), and the extension builds and passes its check."""
    first, rest = RunLayout(*layouts[0]), layouts[1:]
    qdata, norm = codes.qdata, codes.norm
    return (qdata.device.type == "cuda" and first.bits == 4 and not any(r[3] for r in rest)
            and first.byte_offset == 0 and first.width == 2 * qdata.shape[1] and qdata.shape[1] % 32 == 0
            and qdata.data_ptr() % 16 == 0 and norm is not None and norm.dtype == torch.float16 and available()
            and _checked(qdata.device))


_CHECKED: dict[torch.device, bool] = {}


def _checked(device: torch.device) -> bool:
    """Whether the extension builds and its maxima equal the reference's on a small problem on ``device`` (checked
    once per process and device: a build by another toolkit than the one tested must not scan wrongly unnoticed).
    While a CUDA graph is being captured an unchecked device is not checked (that synchronizes): the Triton
    kernel scans."""
    if device not in _CHECKED:
        if _module() is None or torch.cuda.is_current_stream_capturing():
            return False
        _CHECKED[device] = _check(device)
    return _CHECKED[device]


def _check(device: torch.device) -> bool:
    """The check of :func:`_checked` (warns where it fails)."""
    from .. import make_encoder
    from .scan_triton import TritonScorer

    g = torch.Generator().manual_seed(0)
    enc = make_encoder("tq4", 64)
    codes = enc.encode(torch.randn(3 * TILE - 5, 64, generator=g).to(device))
    ok = True
    for m, l2 in ((1, False), (3, True), (9, True)):  # both tile kernels, both re-scoring ones
        qs = enc.rotate(torch.randn(m, 64, generator=g).to(device))
        scorer = TritonScorer(enc, qs, l2)
        args = (codes, scorer.qp32, RunLayout(*scorer.runs[0]), scorer.qscale, scorer.levels_i8, l2)
        ref = tile_maxima_ref(*args)
        ok &= bool(torch.allclose(tile_maxima(*args), ref, rtol=0, atol=1e-5 * float(ref.abs().max())))
        cand = torch.tensor([[2, -1, 0]], device=device).expand(m, 3)
        (v, i), (rv, ri) = rescore(*args, None, cand, TILE), rescore_ref(*args, None, cand, TILE)
        top = float(rv[ri >= 0].abs().max())
        ok &= bool(torch.equal(i, ri) and torch.allclose(v, rv, rtol=1e-5, atol=1e-5 * top))
    if not ok:
        warnings.warn("the CUDA scan kernels differ from their references here; the Triton kernels scan",
                      RuntimeWarning, stacklevel=3)
    return ok


def coordinate_order(qp: Tensor, layout: RunLayout) -> Tensor:
    """Planar queries qp [m, plane_width] of one 4-bit run (first in the row) in coordinate order [m, width]: the
    kernel's eight per 32-bit code word."""
    m, half = qp.shape[0], layout.padded
    return qp[:, : 2 * half].view(m, 2, half)[:, :, : layout.groups].transpose(1, 2).reshape(m, 2 * layout.groups)


class Int8Levels(NamedTuple):
    """The levels of a 4-bit run of direction codes as the kernels read them: ``levels`` int8 [16] (code c < 8:
    -mag8[7 - c]; c >= 8: mag8[c - 8], where mag8 = round(126 mags / mags[7]) raised to at least 1: the MMA kernel's
    lookups need every level nonzero and one below 127), ``scale`` float (level = int8 level x scale), ``words``, the
    four int32 words the tile-maxima kernel reads (bytes of codes 0-3, 4-7, 8-11, 12-15), and ``mags``, the eight
    float32 magnitudes themselves (exact as Python floats), which the re-scoring kernel reads."""

    levels: Tensor
    scale: float
    words: list[int]
    mags: list[float]


def int8_levels(mags: Tensor) -> Int8Levels:
    """:class:`Int8Levels` of a 4-bit run's eight ascending magnitudes ``mags`` float32 [8] (any device)."""
    mags = mags.detach().float().cpu()
    top = float(mags[7])
    pos = torch.round(mags * (126 / top)).clamp(min=1)
    levels = torch.cat([-pos.flip(0), pos]).to(torch.int8)
    b = levels.view(torch.uint8).long().view(4, 4)
    words = (b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16 | b[:, 3] << 24).tolist()
    return Int8Levels(levels, float(torch.tensor(top / 126, dtype=torch.float32)), words, mags.tolist())


def _code_levels(qdata: Tensor, levels: Tensor) -> Tensor:
    """The levels (``levels`` [16], indexed by code) of every coordinate of 4-bit code rows qdata uint8 [..., bytes]
    -> [..., 2 * bytes] (coordinate 2i: the low nibble of byte i)."""
    return levels[torch.stack([qdata & 15, qdata >> 4], -1).flatten(-2).long()]


def _int8_queries(queries: Tensor) -> tuple[Tensor, Tensor]:
    """Queries float32 [m, d] rounded to int8 on the scale 127 / their largest magnitude, as the kernel does ->
    (int8 values as float64 [m, d], largest magnitudes float32 [m])."""
    q = queries.float()
    mx = q.abs().amax(1)
    to8 = torch.where(mx > 0, 127 / mx, torch.zeros_like(mx))
    return torch.round(q * to8[:, None]).double(), mx


def tile_maxima_ref(codes: Codes, qp: Tensor, layout: RunLayout, qscale: Tensor, lv: Int8Levels, l2: bool) -> Tensor:
    """The reference of :func:`tile_maxima` (same arguments): the int8 roundings and exact sums of the kernel in
    PyTorch, then each tile's maximum."""
    q8, mx = _int8_queries(coordinate_order(qp, layout))
    lev = _code_levels(codes.qdata, lv.levels.to(codes.qdata.device).double())  # [n, d]
    nv = codes.norm.float()
    sc = qscale.float() * lv.scale * mx / 127
    scores = (lev @ q8.T).float() * nv[:, None] * sc[None, :]
    if l2:
        scores -= (nv * nv * lev.square().sum(1).float() * lv.scale * lv.scale)[:, None]
    return tile_max(scores.T)


def rounding_bound(qp: Tensor, layout: RunLayout, qscale: Tensor, lv: Int8Levels, mags: Tensor, max_norm: float,
                   l2: bool) -> Tensor:
    """How far :func:`tile_maxima_ref` may lie from the exact maxima (float32 levels ``mags`` [8] and queries, rows of
    norm up to ``max_norm``), per query float32 [m]: each product q_j L_j is off by at most e_q |L8_j| + |q_j| e_L
    (e_q: half the query's int8 step, e_L: the levels' largest rounding error), and for l2 each L_j^2 by at most
    (2 max|L| + e_L) e_L."""
    q = coordinate_order(qp, layout).float()
    d, mx = q.shape[1], q.abs().amax(1)
    e_q = mx / 254
    e_l = float((lv.levels[8:].float() * lv.scale - mags.detach().float().cpu()).abs().max())
    top8 = float(lv.levels.abs().max()) * lv.scale
    bound = qscale.float() * max_norm * (e_q * d * top8 + q.abs().sum(1) * e_l)
    if l2:
        bound += max_norm**2 * d * (2 * float(mags.max()) + e_l) * e_l
    return bound


def tile_max(scores: Tensor) -> Tensor:
    """Scores [m, n] -> each tile of TILE rows' maximum [m, ceil(n / TILE)] (rows past the end: -inf)."""
    m, n = scores.shape
    tiles = cdiv(n, TILE)
    return torch.nn.functional.pad(scores, (0, tiles * TILE - n), value=float("-inf")).view(m, tiles, TILE).amax(2)


def tile_maxima(codes: Codes, qp: Tensor, layout: RunLayout, qscale: Tensor, lv: Int8Levels, l2: bool,
                split: int = 0) -> Tensor:
    """Each tile of TILE rows' best score per query in int8 arithmetic (module notes): float32 [m, ceil(n / TILE)]
    (rows past the end score -inf).

    codes: n rows the kernel :func:`reads`; qp: the Triton scan's planar float32 queries [m, plane_width] of the
    run ``layout`` (queries doubled for l2, as every scorer takes them), qscale float32 [m] their scales; ``lv``:
    the run's :func:`int8_levels`; l2: minus each row's squared norm (``q.x - |x|^2``); split: the warps of the
    MMA kernel (5-16 queries) that share a tile, 1 or 8 (0: the kernel's choice by the tile count)."""
    if split not in (0, 1, 8):
        raise ValueError(f"split must be 0, 1 or 8, got {split!r}")
    qdata, norm = codes.qdata.contiguous(), codes.norm.contiguous()
    qp, qscale = qp.float().contiguous(), qscale.contiguous()  # read in coordinate order by the kernel
    n, m = qdata.shape[0], qp.shape[0]
    out = torch.empty(cdiv(n, TILE), m, device=qdata.device)
    if n:
        with torch.cuda.device(qdata.device):
            _module().tile_max_launch(qdata.data_ptr(), norm.data_ptr(), qp.data_ptr(), qp.shape[1], layout.padded,
                                      qscale.data_ptr(), m, n, qdata.shape[1], l2, lv.words, lv.scale, out.data_ptr(),
                                      split, torch.cuda.current_stream(qdata.device).cuda_stream)
    return out.T


def rescore(codes: Codes, qp: Tensor, layout: RunLayout, qscale: Tensor, lv: Int8Levels, l2: bool,
            qrows: Tensor | None, cand: Tensor, span: int) -> tuple[Tensor, Tensor]:
    """Exact float32 scores of candidates, as ``TritonScorer.rescore`` returns them: codes, qp, layout, qscale, lv and
    l2 as for :func:`tile_maxima` (any number of queries; codes the kernel :func:`rescores`); query rows ``qrows``
    int64 [m] of qp (all when None); cand [m, c]: rows (span 1) or tiles of ``span`` rows, -1 for none -> (scores
    float32 [m, c * span], -inf where none or past the end; rows int64 [m, c * span], -1 there)."""
    qdata, norm = codes.qdata.contiguous(), codes.norm.contiguous()
    qp, qscale, cand = qp.float().contiguous(), qscale.contiguous(), cand.long().contiguous()
    m, c = cand.shape
    out_v = torch.empty(m, c * span, device=qdata.device)
    out_i = torch.empty(m, c * span, dtype=torch.int64, device=qdata.device)
    rows = None if qrows is None else qrows.long().contiguous()
    with torch.cuda.device(qdata.device):
        _module().rescore_launch(qdata.data_ptr(), norm.data_ptr(), qp.data_ptr(), qp.shape[1], layout.padded,
                                 qscale.data_ptr(), 0 if rows is None else rows.data_ptr(), m, qdata.shape[0],
                                 qdata.shape[1], l2, lv.mags, cand.data_ptr(), c, span, out_v.data_ptr(),
                                 out_i.data_ptr(), torch.cuda.current_stream(qdata.device).cuda_stream)
    return out_v, out_i


def rescore_ref(codes: Codes, qp: Tensor, layout: RunLayout, qscale: Tensor, lv: Int8Levels, l2: bool,
                qrows: Tensor | None, cand: Tensor, span: int) -> tuple[Tensor, Tensor]:
    """The reference of :func:`rescore` (same arguments): each candidate row's float32 levels times the query in
    coordinate order, summed in float64."""
    qdata = codes.qdata
    n, (m, c) = len(qdata), cand.shape
    which = slice(None) if qrows is None else qrows.long()
    q, qs = coordinate_order(qp, layout).double()[which], qscale.double()[which]  # [m, d], [m]
    place = torch.arange(c * span, device=cand.device)
    entry = cand.long()[:, place // span]
    rows = entry * span + place % span
    ok = (entry >= 0) & (rows < n)
    rows = torch.where(ok, rows, -1)
    mags = torch.tensor(lv.mags, dtype=torch.float64, device=qdata.device)
    levels = torch.cat([-mags.flip(0), mags])  # code c < 8: -mags[7 - c]
    lev = _code_levels(qdata[rows.clamp_min(0)], levels)  # [m, c * span, d]
    s = codes.norm.double()[rows.clamp_min(0)]
    scores = (lev @ q[:, :, None]).squeeze(2) * s * qs[:, None]
    if l2:
        scores -= s * s * lev.square().sum(2)
    return torch.where(ok, scores, float("-inf")).float(), rows
