"""Trellis-coded directions: the ``tcq{b}`` encoders (TrellisMSE).

Like :class:`~tqindex.turboquant.TurboQuantMSE`, a vector x is stored as one scale s and a code of its
direction in a rotated basis, ``x̂ = s · Rᵀ c``, b bits per coordinate. The code is not one level per
coordinate but a path through a *bitshift trellis*: the b-bit symbols a_0 .. a_{d-1} form a circular bit
string, coordinate i reads the ``state_bits``-bit window ``state_i = a_{i-m+1} .. a_i`` (m = state_bits / b
symbols, indices mod d, a_i in the lowest bits) and its level is ``levels[state_i] / sqrt(d)`` from one
table of 2^state_bits levels. Each symbol therefore takes part in m coordinates; the encoder (a Viterbi
search, tail-biting: no bits beyond the d symbols) chooses the whole string at once, so the levels of
neighbouring coordinates are chosen jointly. At the same bytes as ``tq{b}`` this stores unit vectors of 128
dims with 0.64-0.78 times the squared error (``tests/test_trellis.py``), at about 100 times the encoding work.

The level table is trained once per bit width (Lloyd iterations of Viterbi paths over seeded Gaussian rows)
and is one of the encoder's tensors, stored with the codes' configuration.
:func:`tail_biting` over :func:`viterbi_reference` is the PyTorch reference of the compiled search
(``kernels/trellis_native.py``); ``kernels/trellis_triton.py`` is the Triton twin of :func:`viterbi_reference`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Callable

import torch
from torch import Tensor

from . import kernels
from .checks import check_choice, unit_rows
from .codes import Codes
from .directions import (NORM_DTYPES, NORM_LIMITS, check_scale_options, direction_scale, search_alphas,
                         store_scale)
from .encoder import Encoder, register_class, register_name
from .packing import pack, packed_size, unpack
from .rotation import ROTATION_KINDS

TRELLIS_BITS = (1, 2, 3, 4)
STATE_BITS = {1: 8, 2: 8, 3: 9, 4: 8}
"""Bits of a trellis state per symbol width: 256 or 512 levels, a whole number of symbols per state."""
TRAIN_ROWS, TRAIN_DIM, TRAIN_ITERATIONS, TRAIN_SEED = 2048, 64, 10, 1
"""The level tables' training: Gaussian rows, Lloyd iterations, the generator's seed."""
SEARCH_BYTES = 1 << 26
"""Bytes of back pointers (rows x d x levels / 2^bits) a search holds at once: the rows (times pre-scales) of one
call of the PyTorch or Triton search."""


def state_symbols(bits: int) -> int:
    """Symbols in one trellis state (the coordinates each symbol takes part in)."""
    return STATE_BITS[bits] // bits


def viterbi_reference(t: Tensor, levels: Tensor, bits: int, history: Tensor | None = None) -> Tensor:
    """The b-bit symbols [N, d] (int64) of the least-squares path through the bitshift trellis for targets
    t [N, d] float32 (level of coordinate i: ``levels[state_i]``, module notes).

    ``history`` [N] int64: the state before the first coordinate has these low ``state_bits - bits`` bits,
    and so must the state after the last (a tail-biting string with these last symbols); None: the state
    before the first coordinate is free (its symbols are not returned). Ties: the lowest state wins."""
    n, d = t.shape
    states = len(levels)
    total, fan = states.bit_length() - 1, 1 << bits
    lows, low_mask = states >> bits, (states >> bits) - 1
    index = torch.arange(states, device=t.device)
    if history is None:
        cost = t.new_zeros(n, states)
    else:
        cost = torch.where((index & low_mask) == history[:, None], 0.0, math.inf).to(t.dtype)
    back = torch.empty(d, n, lows, dtype=torch.uint8, device=t.device)
    for i in range(d):
        best, back[i] = cost.view(n, fan, lows).min(1)  # over the predecessor's high symbol
        cost = best.repeat_interleave(fan, 1) + (t[:, i, None] - levels).square()
    if history is not None:
        cost = torch.where((index & low_mask) == history[:, None], cost, math.inf)
    state = cost.argmin(1)
    out = torch.empty(n, d, dtype=torch.int64, device=t.device)
    for i in range(d - 1, -1, -1):
        out[:, i] = state & (fan - 1)
        high = back[i].gather(1, (state >> bits)[:, None])[:, 0].long()
        state = (high << (total - bits)) | (state >> bits)
    return out


def tail_history(symbols: Tensor, bits: int) -> Tensor:
    """The low ``state_bits - bits`` bits of the state after the last symbol: symbols [N, d] -> [N] int64."""
    h = torch.zeros(symbols.shape[0], dtype=torch.int64, device=symbols.device)
    for j in range(state_symbols(bits) - 1):
        h |= symbols[:, -1 - j].long() << (bits * j)
    return h


def tail_biting(t: Tensor, levels: Tensor, bits: int, viterbi: Callable[..., Tensor] = viterbi_reference) -> Tensor:
    """Tail-biting symbols [N, d] for targets t [N, d]: a free search of t turned by d // 2 chooses the
    symbols around the string's seam (the last ones), then a search whose start and end hold them.
    ``viterbi``: :func:`viterbi_reference` (this is then the reference of the compiled searches) or its Triton
    twin (``kernels/trellis_triton.py``)."""
    turn = t.shape[1] // 2
    seam = viterbi(torch.roll(t, turn, 1), levels, bits)  # position i of t at i + turn
    history = tail_history(torch.roll(seam, -turn, 1), bits)
    return viterbi(t, levels, bits, history)


def tail_biting_search(t: Tensor, backend: str | None = None) -> Callable[[Tensor, Tensor, int], Tensor]:
    """The tail-biting search for targets like t, by ``kernels.select``: the compiled CPU kernel
    (``kernels/trellis_native.py``), :func:`tail_biting` over the GPU kernel (``kernels/trellis_triton.py``) or
    over :func:`viterbi_reference` (the same symbols from each)."""
    chosen = kernels.select(t, backend, ("native", "triton"), "trellis encoding")
    if chosen == "native":
        from .kernels.trellis_native import tail_biting_native

        return tail_biting_native
    if chosen == "triton":
        from .kernels.trellis_triton import viterbi_triton  # imports triton

        return partial(tail_biting, viterbi=viterbi_triton)
    return tail_biting


def trellis_states(symbols: Tensor, bits: int) -> Tensor:
    """The state of every coordinate: symbols [..., d] -> [..., d] int32 (module notes)."""
    m, d = state_symbols(bits), symbols.shape[-1]
    s = symbols.to(torch.int32)
    ring = torch.cat([s[..., d - (m - 1) :], s], -1)  # symbol i - j at ring[m - 1 + i - j]
    states = s.clone()
    for j in range(1, m):
        states |= ring[..., m - 1 - j : m - 1 - j + d] << (bits * j)
    return states


@lru_cache(maxsize=None)
def trellis_levels(bits: int) -> Tensor:
    """The level table of ``bits``-bit trellis codes for unit-variance coordinates: [2^state_bits] float32,
    trained by Lloyd iterations (each level the mean of the training coordinates its state reaches) from
    Gaussian quantiles in a seeded order. Deterministic; cached (read, never modify)."""
    states = 1 << STATE_BITS[bits]
    g = torch.Generator().manual_seed(TRAIN_SEED)
    order = torch.randperm(states, generator=g)
    levels = torch.special.ndtri((order.double() + 0.5) / states).float()
    rows = torch.randn(TRAIN_ROWS, TRAIN_DIM, generator=g)
    search = tail_biting_search(rows, "auto")
    for _ in range(TRAIN_ITERATIONS):
        reached = trellis_states(search(rows, levels, bits), bits).reshape(-1)
        total = torch.zeros(states, dtype=torch.float64).index_add_(0, reached, rows.reshape(-1).double())
        count = torch.bincount(reached, minlength=states)
        levels = torch.where(count > 0, total / count.clamp(min=1), levels.double()).float()
    return levels


def search_directions(u: Tensor, levels: Tensor, bits: int, alphas: Tensor, backend: str | None = None
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """Trellis codes of unit rows u [N, d] (rotated directions): for each pre-scale alpha the tail-biting
    symbols of ``alpha · sqrt(d) · u``, keeping the one whose direction is closest to u (the first alpha on
    ties). -> (symbols uint8 [N, d], <u, c> [N], ||c||² [N]) with c the code's levels / sqrt(d).
    ``backend``: of the search (:func:`tail_biting_search`)."""
    n, d = u.shape
    search = tail_biting_search(u, backend)
    a = len(alphas)
    t = (u[:, None, :] * (alphas[:, None] * math.sqrt(d))).reshape(n * a, d)
    rows = max(1, SEARCH_BYTES // (d * (len(levels) >> bits) * a)) * a
    symbols = torch.cat([search(t[i : i + rows], levels, bits) for i in range(0, n * a, rows)]) if n else \
        torch.zeros(0, d, dtype=torch.int64, device=u.device)
    c = levels[trellis_states(symbols, bits)].reshape(n, a, d) / math.sqrt(d)
    dot = torch.einsum("nd,nad->na", u, c)
    sq = c.square().sum(2)
    best = (dot * sq.clamp(min=1e-30).rsqrt()).argmax(1, keepdim=True)
    pick = symbols.reshape(n, a, d).gather(1, best[:, :, None].expand(n, 1, d))[:, 0]
    return pick.to(torch.uint8), dot.gather(1, best)[:, 0], sq.gather(1, best)[:, 0]


@register_class
@dataclass(eq=False, repr=False)
class TrellisMSE(Encoder):
    """Trellis-coded directions (module notes): ``x̂ = s · Rᵀ c``, b bits per coordinate (1-4) in the same
    bytes as ``tq{b}`` (``dim`` b-bit symbols, packed as ``tq{b}``'s levels) plus one scale s per vector.

    ``rescale`` chooses s as in TurboQuantMSE: ``"norm"`` s = ||x||, ``"unbiased"`` s = ||x|| / <R u, c>,
    ``"cos"`` s = ||x|| / ||c||. ``code_search`` > 1 tries that many pre-scales of the direction (plus 1)
    and keeps the code closest to it (a search per pre-scale). ``norm_dtype``: storage type of s.
    """

    dim: int
    bits: int = 2
    seed: int = 0
    rescale: str = "cos"
    code_search: int = 6
    norm_dtype: str = "float16"
    rotation: str = "auto"
    backend: str | None = None

    def _validate(self) -> None:
        check_choice(self.bits, "bits", TRELLIS_BITS)
        check_scale_options(self.rescale, self.code_search, self.norm_dtype)
        check_choice(self.rotation, "rotation", ROTATION_KINDS)
        if self.dim < state_symbols(self.bits):
            raise ValueError(f"dim must be at least {state_symbols(self.bits)} for {self.bits}-bit trellis codes "
                             f"(the symbols of one state), got {self.dim}")

    def _build(self) -> dict[str, Tensor]:
        return {**super()._build(), "levels": trellis_levels(self.bits).clone()}

    @property
    def code_size(self) -> int:
        return packed_size(self.dim, self.bits) + NORM_DTYPES[self.norm_dtype].itemsize

    @property
    def norm_limits(self) -> tuple[float, float]:
        return NORM_LIMITS[self.norm_dtype]

    def _expected_qdata_bytes(self) -> int:
        return packed_size(self.dim, self.bits)

    def _encode(self, x: Tensor, backend: str | None = None) -> Codes:
        norm, u = unit_rows(self._rotation(x.device).apply(x))
        alphas = search_alphas(self.code_search, x.device)
        symbols, dot, sq = search_directions(u, self._on(x.device)["levels"], self.bits, alphas, backend)
        scale = store_scale(direction_scale(norm, dot, sq, self.rescale), self.norm_dtype)
        return Codes(qdata=pack(symbols, self.bits), norm=scale)

    def _decode_rotated(self, codes: Codes) -> Tensor:
        symbols = unpack(codes.qdata, self.bits, self.dim)
        levels = self._on(codes.device)["levels"] / math.sqrt(self.dim)
        return levels[trellis_states(symbols, self.bits)] * codes.norm.float()[..., None]


for _b in TRELLIS_BITS:
    register_name(f"tcq{_b}", lambda dim, _b=_b, **kw: TrellisMSE(dim=dim, bits=_b, **kw))
    register_name(f"tcq{_b}-unbiased",
                  lambda dim, _b=_b, **kw: TrellisMSE(dim=dim, bits=_b, **{"rescale": "unbiased", **kw}))
