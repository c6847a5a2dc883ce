"""Tile maxima of 1-4 queries over one 4-bit run of direction codes by a CUDA C++ kernel (``csrc/scan_tiles.cu``,
whose notes describe it), built at first use by ``torch.utils.cpp_extension`` (nvcc; once, cached by torch between
processes).

It computes :class:`~tqindex.kernels.scan_triton.TritonScorer`'s ``MODE_TILE_MAX`` scan (each tile of TILE rows'
best score per query, the first pass of a scan of few queries) where the codes are one 4-bit run over every
coordinate with float16 norms (``tq4`` and its variants) and code rows are a multiple of 32 bytes (dims a multiple
of 64); elsewhere the Triton kernel computes it. Its reference is the same as the Triton kernel's: the scores of
:class:`~tqindex.scorer.DecodeScorer` (float16 levels and queries, so up to their rounding).
"""

from __future__ import annotations

import warnings
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..codes import Codes
from .planes import RunLayout, cdiv

TILE = 256
"""Rows per tile (and threads per block) of the kernel."""
MAX_QUERIES = 4
"""Queries up to which the kernel scans: its work per code grows with them, where the Triton kernel decodes a
tile once for the tensor-core products of 16 queries (on an H200 over 10M x 128 codes: 1, 2, 4 queries 0.30, 0.33,
0.44 ms against the Triton kernel's 0.43, 0.59, 0.59 ms; 8 queries 0.70 against 0.59 ms)."""
SOURCE = Path(__file__).parent / "csrc" / "scan_tiles.cu"
_DECLARATION = """
void tile_max_launch(int64_t codes, int64_t norm, int64_t q, int64_t qscale, int64_t m, int64_t n, int64_t row_bytes,
                     bool l2, const std::vector<int64_t>& tab, int64_t out, int64_t stream);
"""


@cache
def _module() -> Any:
    """The extension, or None where it does not build (warned once; the Triton kernel then scans)."""
    from torch.utils.cpp_extension import load_inline

    try:
        return load_inline("tqindex_scan_tiles", cpp_sources=_DECLARATION, cuda_sources=SOURCE.read_text(),
                           functions=["tile_max_launch"], extra_cuda_cflags=["-O3", "-std=c++17"],
                           extra_include_paths=[str(SOURCE.parent)])
    except Exception as e:  # a compiler or toolkit problem: the Triton kernel still runs
        warnings.warn(f"the CUDA scan kernel could not be built ({e}); the Triton kernel scans", RuntimeWarning,
                      stacklevel=3)
        return None


@cache
def available() -> bool:
    """Whether the kernel can be built here: a CUDA device, a CUDA build of torch and nvcc."""
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.cuda.is_available() and torch.version.cuda is not None and CUDA_HOME is not None


def reads(layouts: tuple, codes: Codes, m: int) -> bool:
    """Whether the kernel scans these codes (CUDA, in one 4-bit run over every coordinate of rows of a multiple of
    32 bytes at a 16-byte aligned address, float16 norms) for ``m`` queries, and builds and passes its check."""
    first, rest = RunLayout(*layouts[0]), layouts[1:]
    qdata, norm = codes.qdata, codes.norm
    return (0 < m <= MAX_QUERIES and qdata.device.type == "cuda" and first.bits == 4 and not any(r[3] for r in rest)
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
    from ..scorer import DecodeScorer
    from .scan_triton import TritonScorer

    g = torch.Generator().manual_seed(0)
    enc = make_encoder("tq4", 64)
    codes = enc.encode(torch.randn(3 * TILE - 5, 64, generator=g).to(device))
    ok = True
    for m, l2 in ((1, False), (3, True)):
        qs = enc.rotate(torch.randn(m, 64, generator=g).to(device))
        scorer = TritonScorer(enc, qs, l2)
        got = tile_maxima(codes, scorer.qp, RunLayout(*scorer.runs[0]), scorer.qscale, scorer.tables[:4], l2)
        ref = tile_maxima_ref(DecodeScorer(enc, qs, l2).scores(codes))
        ok &= bool(torch.allclose(got, ref, rtol=0, atol=3e-3 * float(ref.abs().max())))
    if not ok:
        warnings.warn("the CUDA scan kernel's maxima differ from the reference's here; the Triton kernel scans",
                      RuntimeWarning, stacklevel=3)
    return ok


def coordinate_order(qp: Tensor, layout: RunLayout) -> Tensor:
    """Planar queries qp [m, plane_width] of one 4-bit run (first in the row) in coordinate order [m, width]: the
    kernel's eight per 32-bit code word."""
    m, half = qp.shape[0], layout.padded
    return qp[:, : 2 * half].view(m, 2, half)[:, :, : layout.groups].transpose(1, 2).reshape(m, 2 * layout.groups)


def tile_maxima_ref(scores: Tensor) -> Tensor:
    """The reference of :func:`tile_maxima`: scores [m, n] -> each tile of TILE rows' maximum [m, ceil(n / TILE)]."""
    m, n = scores.shape
    tiles = cdiv(n, TILE)
    return torch.nn.functional.pad(scores, (0, tiles * TILE - n), value=float("-inf")).view(m, tiles, TILE).amax(2)


def tile_maxima(codes: Codes, qp: Tensor, layout: RunLayout, qscale: Tensor, table: list[int], l2: bool) -> Tensor:
    """Each tile of TILE rows' best score per query: float32 [m, ceil(n / TILE)] (rows past the end score -inf).

    codes: n rows the kernel :func:`reads`; qp: the Triton scan's planar float16 queries [m, plane_width] of the
    run ``layout`` (queries doubled for l2, as every scorer takes them), qscale float32 [m] their scales;
    ``table``: the prmt words of the run's magnitudes (``scan_triton.prmt_tables``); l2: minus each row's squared
    norm (``q.x - |x|^2``)."""
    qdata, norm = codes.qdata.contiguous(), codes.norm.contiguous()
    queries, qscale = coordinate_order(qp, layout).contiguous(), qscale.contiguous()
    n, m = qdata.shape[0], qp.shape[0]
    out = torch.empty(cdiv(n, TILE), m, device=qdata.device)
    if n:
        with torch.cuda.device(qdata.device):
            _module().tile_max_launch(qdata.data_ptr(), norm.data_ptr(), queries.data_ptr(), qscale.data_ptr(), m, n,
                                      qdata.shape[1], l2, table, out.data_ptr(),
                                      torch.cuda.current_stream(qdata.device).cuda_stream)
    return out.T
