"""Decode attention over 4-bit and 8-bit codes by a CUDA C++ kernel (``csrc/attention_decode.cu``, whose notes
describe it), built at first use by ``torch.utils.cpp_extension`` (nvcc; once per head dim and pair of code kinds,
cached by torch between processes).

It computes the compressed splits of :func:`tqindex.kernels.attention_triton.compressed_attention_triton`'s
split-K decode step and writes their partial softmaxes where the Triton kernel would; where a step has few batch
rows x KV heads (:func:`merges`), the last block of each batch row x KV head x row block also merges them with the
window's (computed before by the Triton kernel) into the output. The query rotation (which also zeroes the merge's
counters), the window's splits and the other steps' merge stay Triton. It reads keys that are one 4-bit or 8-bit
run of direction codes over every coordinate with float16 norms (``tq4``, ``tq8`` and their variants) or FP4-UE8M0
codes (``fp4``), and values that are ``tq4`` or ``fp4`` codes, at head dims 64, 128 and 256, with no mask and no
soft cap. The PyTorch reference is :func:`tqindex.kv.attention.compressed_attention_ref`.
"""

from __future__ import annotations

import math
import warnings
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

DIMS = (64, 128, 256)
"""Head dims the kernel is built for."""
ROWS = 8
"""Query rows per block of the kernel."""
MAX_SPLITS = 128
"""Splits (compressed and window) a step the kernel merges may have: the merge's weights live in shared memory."""
MERGE_SLOTS = 16
"""Batch rows x KV heads x row blocks up to which the kernel also merges the splits (:func:`merges`)."""
MAX_ROWS = 16
"""Query rows per KV head (query heads x positions) up to which a step runs the kernel: it takes blocks of 8 rows,
each reading all codes, where the Triton kernel's blocks of 64 read them fewer times."""
SPLIT_TOKENS = 1024
"""Least compressed tokens per split (block) of the kernel, unless fewer splits would leave multiprocessors idle:
then down to FILL_TOKENS, one block per multiprocessor. Each split costs the merge a partial to read and each block
a fixed start and end, which shorter splits spent more on: on an H100 (tq4, 32 query / 8 KV heads, d128, GPU
time) batch 8 x 4k took 45.1 us in splits of 1024 tokens against 52.4 in splits of 256, batch 1 x 16k 36.4 against
40.9, 9 / 3 heads d64 batch 8 x 16k 35.5 against 42.0; batch 1 x 4k needs the 16 splits of 256 (26.8 us; 4 splits
of 1024: 34.5)."""
FILL_TOKENS = 256
PROGRAMS_PER_SM = 8
"""Blocks per multiprocessor a step's splits aim at where a separate merge kernel combines them (batch 8 x 64k:
297 us in 17 splits, 352 in 5)."""
MERGING_PROGRAMS_PER_SM = 2
"""The same where the kernel merges (:func:`merges`): one block per (batch row x KV head) reads every split's
partial, a serial tail (batch 1 x 64k: 65.7 us in 33 splits, 73.3 in 128)."""
TQ4, FP4, TQ8 = 0, 1, 2
"""Code kinds (the kernel's ``Kind``): one 4-bit run of direction codes with float16 norms, FP4-UE8M0 codes of
32-element groups, one 8-bit run of direction codes with float16 norms. Values are TQ4 or FP4."""
SOURCE = Path(__file__).parent / "csrc" / "attention_decode.cu"
_DECLARATION = """
void decode_launch(int64_t qp, int64_t qsc, int64_t kc, int64_t ks, int64_t vc, int64_t vs, int64_t klevels,
                   int64_t out, int64_t m_out, int64_t l_out, int64_t lengths, int64_t bh, int64_t rows, int64_t tc,
                   int64_t splits_c, int64_t nsplit, int64_t tokens_per_split, int64_t kc_stride, int64_t vc_stride,
                   int64_t ks_stride, int64_t vs_stride, int64_t pw, int64_t gp, double scale_log2,
                   const std::vector<int64_t>& ktab, const std::vector<int64_t>& vtab, int64_t mv, int64_t res,
                   bool res_bf16, int64_t counters, int64_t hkv, int64_t hq, int64_t nq, int64_t stream);
"""


def ring(dim: int, keys: int) -> tuple[int, int]:
    """(tiles of 16 tokens in each warp's shared-memory ring, tiles per online-softmax step) of the kernel for head
    dim ``dim`` and key kind ``keys``; ring - step tiles are in flight. Two tiles per step give each warp more
    independent work between the softmax's shuffles. On an H100 (tq4, 32 query / 8 KV heads, d128, GPU time, each
    timed twice, alternating with one tile per step in rings of 4): batch 8 x 131k 0.490 ms against 0.502-0.505,
    batch 32 x 16k 0.266-0.269 against 0.276, batch 1 x 16k 0.0308-0.0309 against 0.0323-0.0327; batch 8 x 16k
    (8 tiles per warp) 0.0941-0.0945 against 0.0913. Where a stage is large (d256) or the 8-bit level table takes
    32 KiB of the block's shared memory (8-bit keys), a ring of 6 would leave room for one block fewer per
    multiprocessor: those keep one tile per step in rings of 4 and 3."""
    if keys == TQ8:
        return 3, 1
    return (4, 1) if dim > 128 else (6, 2)


@cache
def _module(dim: int, keys: int, values: int, depth: int, per: int) -> Any:
    """The extension for head dim ``dim``, these code kinds, rings of ``depth`` tiles and ``per`` tiles per step
    (:func:`ring`), or None where it does not build (warned once; the Triton kernel then computes the splits).
    Built on the first call of the process; torch reuses a build of the same source and flags."""
    from torch.utils.cpp_extension import load_inline

    flags = ["-O3", "-std=c++17"] + [f"-DTQ_{k}={v}" for k, v in
                                     (("D", dim), ("KEYS", keys), ("VALUES", values), ("RING", depth), ("PER", per))]
    try:
        name = f"tqindex_attention_decode_d{dim}_k{keys}_v{values}_r{depth}_p{per}"
        return load_inline(name, cpp_sources=_DECLARATION, cuda_sources=SOURCE.read_text(), functions=["decode_launch"],
                           extra_cuda_cflags=flags, extra_include_paths=[str(SOURCE.parent)])
    except Exception as e:  # a compiler or toolkit problem: the Triton kernel still runs
        warnings.warn(f"the CUDA attention kernel could not be built ({e}); attention runs the Triton kernel",
                      RuntimeWarning, stacklevel=3)
        return None


@cache
def available() -> bool:
    """Whether the kernel can be built here: a CUDA device, a CUDA build of torch and nvcc (a build that fails all
    the same warns once and leaves the splits to the Triton kernel)."""
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.cuda.is_available() and torch.version.cuda is not None and CUDA_HOME is not None


def reads(key_encoder: Any, value_encoder: Any) -> bool:
    """Whether the kernel reads these encoders' codes: keys of a code kind (:data:`TQ4`, :data:`FP4`,
    :data:`TQ8`), values TQ4 or FP4, one dim in DIMS."""
    kinds = _kinds(key_encoder, value_encoder)
    return key_encoder.dim == value_encoder.dim and kinds[0] is not None and kinds[1] in (TQ4, FP4)


def _kinds(key_encoder: Any, value_encoder: Any) -> list[int | None]:
    """The code kinds of the keys' and the values' encoders (:func:`_kind`, computed once per encoder)."""
    return [enc.derived("cpu", "cuda-attention-kind", lambda e=enc: _kind(e)) for enc in (key_encoder, value_encoder)]


def _kind(enc: Any) -> int | None:
    """The code kind of ``enc``'s codes (None: none the kernel reads)."""
    if enc.dim not in DIMS:
        return None
    if hasattr(enc, "level_run"):
        return FP4 if enc.group_size == 32 else None
    if getattr(enc, "norm_dtype", None) != "float16" or not hasattr(enc, "code_runs") or not enc.is_trained:
        return None
    runs = enc.code_runs()
    if len(runs) != 1 or runs[0].width != enc.dim:
        return None
    return {4: TQ4, 8: TQ8}.get(runs[0].bits)


def _in_place(t: Tensor, align: int) -> bool:
    """Whether the kernel reads ``t`` [B, Hkv, T(, n)] in place: rows (B x Hkv) at one stride, tokens dense, its
    start and row stride multiples of ``align`` bytes."""
    dense = t.stride(-1) == 1 and (t.dim() == 3 or t.stride(2) == t.shape[3])
    rows = t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1)
    return dense and rows and t.data_ptr() % align == 0 and t.stride(1) * t.element_size() % align == 0


def _side(codes: Any) -> tuple[Tensor, int]:
    """A side's per-token data (float16 norms, or FP4's uint8 group exponents) and the alignment it needs."""
    return (codes.norm, 2) if codes.norm is not None else (codes.scale, codes.scale.shape[-1])


def _levels8(mags: Tensor) -> Tensor:
    """The 256 f16 levels of 8-bit direction codes (code c < 128: -mags[127 - c], else mags[c - 128])."""
    return torch.cat([-mags[:128].flip(0), mags[:128]]).half()


def plan(keys: Any, values: Any, rows: int, window_splits: int) -> Any:
    """The extension for a decode step over these CompressedTokens (of encoders the kernel ``reads``) with
    ``rows`` query rows per KV head and ``window_splits`` splits of the window; None where the step has more
    than MAX_ROWS rows or MAX_SPLITS / 2 window splits, the codes are not laid out to be read in place or the
    kernel does not build (then the Triton kernels compute the step)."""
    kind = _kinds(keys.encoder, values.encoder)
    (kside, kalign), (vside, valign) = _side(keys.codes), _side(values.codes)
    kq, vq = keys.codes.qdata, values.codes.qdata
    if rows > MAX_ROWS or window_splits > MAX_SPLITS // 2:
        return None
    if not all(_in_place(*x) for x in ((kq, 16), (vq, 16), (kside, kalign), (vside, valign))):
        return None
    return _module(keys.encoder.dim, *kind, *ring(keys.encoder.dim, kind[0]))


def merges(slots: int, rows: int) -> bool:
    """Whether the kernel also merges a step's splits: where ``slots`` (batch rows x KV heads) times the row
    blocks of ``rows`` are at most MERGE_SLOTS. There the merge is a serial tail that a launch of its own only
    lengthens; with more pairs the separate merge kernel measured faster on an H200 (batch 8 x 8 KV heads)."""
    return slots * -(-rows // ROWS) <= MERGE_SLOTS


def splits(tokens: int, pairs: int, sms: int, merged: bool) -> int:
    """Compressed splits of a decode step over ``tokens`` compressed tokens with ``pairs`` (batch rows x KV heads x
    row blocks of ROWS) on ``sms`` multiprocessors, merged by the kernel itself or not (:data:`SPLIT_TOKENS`).
    Where that aim gives the multiprocessors more than one block each, the count between half and twice it
    (splits no shorter than SPLIT_TOKENS unless the aim's are) that shares the blocks most evenly: the step takes
    about as long as the multiprocessor with the most blocks, each in proportion to its tokens (the aim on a tie).
    On an H100, tq4 32 query / 8 KV heads d128 GPU time: batch 8 x 131k took 514 us in 33 splits (16 blocks on
    every multiprocessor) against 537 in the aim's 17 (8 or 9)."""
    aim = -(-(MERGING_PROGRAMS_PER_SM if merged else PROGRAMS_PER_SM) * sms // pairs)
    fill = -(-sms // pairs)
    n = max(min(aim, -(-tokens // SPLIT_TOKENS)), min(fill, -(-tokens // FILL_TOKENS)))
    if pairs * n <= sms:
        return n
    most = min(2 * n, max(n, -(-tokens // SPLIT_TOKENS)))
    return min(range(max(1, n // 2), most + 1), key=lambda s: (-(-pairs * s // sms) / s, abs(s - n)))


def decode_step(module: Any, qp: Tensor, qsc: Tensor, counters: Tensor | None, keys: Any, values: Any, out: Tensor,
                m: Tensor, l_: Tensor, lengths: Tensor | None, rows: int, splits_c: int, tokens_per_split: int,
                scaling: float, key_layout: tuple, key_mags: Tensor, key_table: list[int], value_table: list[int],
                mv: Tensor, res: Tensor) -> None:
    """Compute the compressed splits 0 .. splits_c - 1 of a split-K decode step by the extension :func:`plan`
    gave; given ``counters``, also merge them with the window's (written by an earlier launch on this stream) into
    ``res`` (else a later launch merges them).

    qp f16 [B Hkv rows, planes x padded groups]: the planar, scaled queries, qsc float32 [B Hkv rows] their scales,
    counters None or int32 [B Hkv x row blocks of ROWS], zero (the Triton query kernel's outputs); keys / values
    CompressedTokens [B, Hkv, T, D]; out float32 [B Hkv, splits, rows, D], m / l_ float32 [B Hkv, splits, rows]: the
    partials (splits >= splits_c are the window's); ``lengths``: None, or int64 [2] on the device (the valid codes
    are then read there); ``tokens_per_split`` a multiple of 64; ``key_layout`` the keys' RunLayout tuple,
    ``key_mags`` their magnitudes on the device; the tables: the prmt words of the keys' and values' 4-bit
    magnitudes; mv float32 [D, D]: the value rotation's inverse (row k: the rotated domain's coordinate k);
    res [B, Q, Hq, D] bf16 or f16: the output. The launch goes to qp's device (the caller makes it current)."""
    (kside, _), (vside, _) = _side(keys.codes), _side(values.codes)
    kq, vq = keys.codes.qdata, values.codes.qdata
    levels = 0
    if _kinds(keys.encoder, values.encoder)[0] == TQ8:
        levels = keys.encoder.derived(qp.device, "cuda-attention-levels", lambda: _levels8(key_mags)).data_ptr()
    bsz, nq, hq, _ = res.shape
    module.decode_launch(
        qp.data_ptr(), qsc.data_ptr(), kq.data_ptr(), kside.data_ptr(), vq.data_ptr(), vside.data_ptr(), levels,
        out.data_ptr(), m.data_ptr(), l_.data_ptr(), 0 if lengths is None else lengths.data_ptr(), qsc.shape[0] // rows,
        rows, kq.shape[2], splits_c, out.shape[1], tokens_per_split, kq.stride(1), vq.stride(1),
        kside.stride(1) * kside.element_size(), vside.stride(1) * vside.element_size(), qp.shape[1], key_layout[4],
        scaling * math.log2(math.e), key_table, value_table, mv.data_ptr(), res.data_ptr(),
        res.dtype == torch.bfloat16, 0 if counters is None else counters.data_ptr(), qsc.shape[0] // rows // bsz, hq,
        nq, torch.cuda.current_stream(qp.device).cuda_stream)
