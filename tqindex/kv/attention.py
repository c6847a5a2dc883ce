"""Attention over compressed keys/values: ``softmax(q kᵀ · scaling + mask) v`` straight from the codes.

:func:`compressed_attention` is the entry point (a fused GPU kernel plugs in here with the same
signature); its PyTorch body walks the compressed tokens block by block with an online softmax
(log-sum-exp merge), scores each block with the key encoder in the rotated domain
(``<R q, R k̂> = <q, k̂>``: queries are rotated once), accumulates values in the value encoder's rotated
domain and rotates the output back once, then adds the full-precision window. Query heads sharing a
KV head (GQA) are grouped, never repeated. :func:`compressed_attention_ref` (decode everything, then
:func:`dense_attention`) is the reference it is tested against. Prefills (many query tokens, causal, no mask,
on the CPU or in half precision on CUDA) take :func:`decoded_attention` instead: flash attention over blocks of
codes decoded in the rotated domain, merged by log-sum-exp.

Masks follow transformers' sdpa convention: bool ``[B|1, 1|Hq, Q, T]`` with True = attend, or an additive
float mask of that shape, or None = causal (when ``causal`` and Q > 1; queries are the last Q of the T
positions, so query i sees keys ``j <= T - Q + i``) / no mask. Positions are the sequence's; with sink
tokens (``CompressedTokens.sink``) the fast paths read the tokens as stored, codes first, and reorder the
mask's columns to match (a causal mask by position is the same in both orders while the window's newest
tokens hold the queries' own).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from .. import kernels
from ..kernels.planes import attention_reads
from .store import CompressedTokens

BLOCK_TOKENS = 1024
"""Compressed or window tokens scored per block: bounds the temporary memory of one attention call."""
PREFILL_QUERIES = 64
"""Query tokens per sequence from which a call on the CPU or in half precision on CUDA decodes the codes block
by block for flash attention (:func:`decoded_attention`) instead of reading them in the attention kernel or
the blockwise PyTorch body."""
DECODED_ELEMENTS = 1 << 25
"""Elements of keys (and as many of values) :func:`decoded_attention` decodes at a time, e.g. 32,768 tokens of 8
heads of 128 dims, 64 MiB in bfloat16: its transient full-precision copy."""
_HALF = (torch.float16, torch.bfloat16)


def compressed_attention(
    q: Tensor,
    keys: CompressedTokens,
    values: CompressedTokens,
    mask: Tensor | None,
    scaling: float,
    *,
    softcap: float | None = None,
    causal: bool = True,
    block_tokens: int = BLOCK_TOKENS,
    backend: str | None = None,
) -> Tensor:
    """Attention of queries over compressed K/V.

    q [B, Hq, Q, Dk] float; keys / values CompressedTokens [B, Hkv, T, Dk / Dv] with Hq a multiple of
    Hkv (query head h reads KV head h // (Hq / Hkv)); mask as in the module docstring; ``softcap``
    applies ``softcap · tanh(s / softcap)`` to the scaled scores. Fully masked rows give 0.
    ``backend`` (default: the key encoder's): "triton" runs the GPU kernel (``kernels/attention_triton.py``)
    where it reads the codes and the mask, "torch" the blockwise PyTorch body below (see ``kernels.select``).
    Keys / values with device ``lengths`` (buffers filled on the device) are read in place by the kernel
    when there is no mask; otherwise they are first cut to their valid tokens (a device synchronization).
    Returns [B, Hq, Q, Dv] in q's dtype (computed in float32).
    """
    _check(q, keys, values)
    if not isinstance(block_tokens, int) or block_tokens < 1:
        raise ValueError(f"block_tokens must be an integer >= 1, got {block_tokens!r}")
    prefill = (mask is None and causal and softcap is None and keys.lengths is None and q.shape[2] >= PREFILL_QUERIES
               and (q.device.type == "cpu" or (q.is_cuda and q.dtype in _HALF)))
    fused = _fused(q, keys, values, mask, backend, prefill)
    if keys.lengths is not None and (mask is not None or fused not in ("triton", "cuda")):
        keys, values = keys.valid(), values.valid()
    b, hq, nq, _ = q.shape
    hkv, total, tc = keys.shape[1], keys.shape[2], keys.codes.shape[2]
    dtype, q = q.dtype, _scaled_queries(q, keys)
    mask = _stored_order(mask, keys, nq, causal)
    if prefill and fused == "torch":
        return decoded_attention(q.to(dtype), keys, values, scaling)
    if fused in ("triton", "cuda"):
        from ..kernels.attention_triton import compressed_attention_triton  # imports triton

        # the kernels launch on the current device: make it the tensors' (models split over several GPUs)
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            return compressed_attention_triton(q, keys, values, mask, scaling, softcap, causal, lengths=keys.lengths,
                                               cuda=fused == "cuda").to(dtype)
    groups = hq // hkv
    qg = q.float().reshape(b, hkv, groups * nq, q.shape[-1])  # [B, Hkv, G*Q, Dk]
    state = _OnlineSoftmax(qg.shape[:3], values.shape[-1], q.device)

    def logits(scores: Tensor, t0: int, t1: int) -> Tensor:  # scores [B, Hkv, G*Q, n]
        return _logits(scores, scaling, softcap, _block_bias(mask, causal, nq, total, t0, t1, q.device), groups)

    qr = keys.encoder.rotate(qg)  # R q, [B, Hkv, G*Q, Dk] (q is checked: no second pass over it)
    for t0 in range(0, tc, block_tokens):
        t1 = min(t0 + block_tokens, tc)
        scores = keys.encoder.score_prepared(qr, keys.codes[:, :, t0:t1])
        state.add(logits(scores, t0, t1), values.encoder.decode_rotated(values.codes[:, :, t0:t1]))
    state.acc = values.encoder.rotate_back(state.acc)  # compressed values were summed in the rotated domain
    for w0 in range(0, total - tc, block_tokens):
        w1 = min(w0 + block_tokens, total - tc)
        k = keys.window[:, :, w0:w1].float()  # [B, Hkv, n, Dk]
        state.add(logits(qg @ k.mT, tc + w0, tc + w1), values.window[:, :, w0:w1].float())
    return state.result().reshape(b, hq, nq, -1).to(dtype)


def _stored_order(mask: Tensor | None, keys: CompressedTokens, nq: int, causal: bool) -> Tensor | None:
    """``mask``'s key columns in the order the tokens are stored (codes, then the window) when the keys hold
    sink tokens; ValueError where a causal mask by position would differ between the two orders."""
    sink, tc = keys.sink, keys.codes.shape[2]
    if not sink or not tc:
        return mask
    if mask is None:
        if causal and nq > keys.window.shape[2] - sink:
            raise ValueError(f"{nq} causal queries need their tokens in the window's {keys.window.shape[2] - sink} "
                             "newest tokens (pass an explicit mask)")
        return None
    return torch.cat([mask[..., sink : sink + tc], mask[..., :sink], mask[..., sink + tc :]], dim=-1)


def _fused(q: Tensor, keys: CompressedTokens, values: CompressedTokens, mask: Tensor | None,
           backend: str | None, prefill: bool = False) -> str:
    """The backend of one attention call: "triton" where the GPU kernel reads both encoders' codes and the
    mask, "cuda" where the CUDA C++ decode kernel also reads the codes (see ``kernels.select``; the step's
    compressed splits then run it where there is no mask and no soft cap), else "torch";
    "auto" takes "torch" for a ``prefill`` (many queries on the CPU or in half precision on CUDA:
    :func:`decoded_attention` is faster there)."""
    backend = keys.encoder.backend if backend is None else backend
    readable = attention_reads(keys.encoder, values.encoder, mask)
    if prefill and kernels.requested(backend) == "auto":
        readable = False
    gpu = ("triton", "cuda") if kernels.attention_cuda.reads(keys.encoder, values.encoder) else ("triton",)
    return kernels.select(q, backend, gpu if readable else (), "attention from these codes and this mask")


def decoded_attention(q: Tensor, keys: CompressedTokens, values: CompressedTokens, scaling: float,
                      block_elements: int = DECODED_ELEMENTS, backend: str | None = None) -> Tensor:
    """Causal attention of queries that are the newest tokens of the window (no mask, no soft cap) over
    compressed K/V by flash attention, in the encoders' rotated domains (``<R q, R k> = <q, k>``): the codes
    decoded there block by block to q's dtype, at most ``block_elements`` elements of keys (and of values) per
    block, the window rotated there and attended with the causal bias aligned to its last token (on CUDA in
    the last block's call, whose flash kernel aligns it so), the parts merged by their log-sum-exp and the
    value sum rotated back once. q [B, Hq, Q, Dk] already multiplied by the keys' ``query_scale`` -> [B, Hq, Q, Dv] in
    q's dtype. ``backend``: of the decoding ("triton": ``kernels/decode_triton.py``, see ``kernels.select``).
    Transient memory: one block's decoded keys and values."""
    readable = attention_reads(keys.encoder, values.encoder, None)
    chosen = kernels.select(q, keys.encoder.backend if backend is None else backend, ("triton",) if readable else (),
                            "decoding these codes")
    b, h, tc = keys.codes.shape
    if not tc:
        return _sdpa_lse(q, keys.window.to(q.dtype), values.window.to(q.dtype), scaling, causal=True)[0]
    block = max(1, block_elements // (b * h * max(keys.shape[-1], values.shape[-1])))
    qr = keys.encoder.rotate(q.float()).to(q.dtype)
    window = [side.encoder.rotate(side.window.float()).to(q.dtype) for side in (keys, values)]
    join = q.is_cuda  # CUDA's flash kernel aligns the causal bias to the last key; the CPU's would need a mask
    parts = []
    for t0 in range(0, tc, block):
        t1 = min(t0 + block, tc)
        k, v = (_decoded(side, t0, t1, q.dtype, chosen) for side in (keys, values))
        last = join and t1 == tc
        if last:
            k, v = torch.cat([k, window[0]], dim=2), torch.cat([v, window[1]], dim=2)
        parts.append(_sdpa_lse(qr, k, v, scaling, causal=last))
    if not join:
        parts.append(_sdpa_lse(qr, *window, scaling, causal=True))
    return values.encoder.rotate_back(_merged(parts)).to(q.dtype)


def _decoded(tokens: CompressedTokens, t0: int, t1: int, dtype: torch.dtype, backend: str) -> Tensor:
    """Codes t0..t1 of ``tokens`` decoded in the rotated domain: [B, H, t1 - t0, dim] in ``dtype``."""
    codes = tokens.codes[:, :, t0:t1]
    if backend == "triton":
        from ..kernels.decode_triton import decode_rotated_triton  # imports triton

        return decode_rotated_triton(tokens.encoder, codes, dtype)
    return tokens.encoder.decode_rotated(codes).to(dtype)


def _merged(parts: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Softmax parts (output [..., Q, D], log-sum-exp [..., Q]) over disjoint keys -> the whole's output,
    float32."""
    if len(parts) == 1:
        return parts[0][0].float()
    weights = torch.softmax(torch.stack([part[1] for part in parts]), dim=0)  # [parts, ..., Q]
    return sum(w[..., None] * out.float() for w, (out, _) in zip(weights, parts))


def _sdpa_lse(q: Tensor, k: Tensor, v: Tensor, scaling: float, causal: bool) -> tuple[Tensor, Tensor]:
    """Attention of q [B, Hq, Q, D] over k, v [B, Hkv, T, D] (``causal``: query i sees keys up to T - Q + i)
    -> (output [B, Hq, Q, D] in q's dtype, log-sum-exp of the scaled scores [B, Hq, Q] float32). Flash
    attention (GQA heads read in place) for CUDA half-precision tensors and for CPU ones (the causal bias as an
    additive mask where Q < T: the CPU kernel aligns it to the first key), float32 math otherwise."""
    if q.shape[-1] == v.shape[-1]:
        if q.is_cuda and q.dtype in _HALF and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scaling)[:2]
        if q.device.type == "cpu" and q.dtype in (torch.float32, *_HALF):
            aligned = q.shape[2] == k.shape[2]  # the first and the last key's alignments agree
            bias = None if aligned else _block_bias(None, causal, q.shape[2], k.shape[2], 0, k.shape[2], q.device)
            bias = None if bias is None else bias.to(q.dtype)
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal and aligned,
                                                                            attn_mask=bias, scale=scaling)[:2]
    groups = q.shape[1] // k.shape[1]
    s = q.float() @ k.float().repeat_interleave(groups, dim=1).mT * scaling  # [B, Hq, Q, T]
    bias = _block_bias(None, causal, q.shape[2], k.shape[2], 0, k.shape[2], q.device)
    s = s if bias is None else s + bias
    lse = torch.logsumexp(s, dim=-1)
    out = torch.exp(s - lse[..., None]) @ v.float().repeat_interleave(groups, dim=1)
    return out.to(q.dtype), lse


def causal_sdpa(q: Tensor, k: Tensor, v: Tensor, scaling: float) -> Tensor:
    """Causal attention of queries q [B, Hq, Q, D] that are the newest Q of the T keys k, v [B, Hkv, T, D]
    (query i sees keys up to T - Q + i): torch's SDPA with its lower-right causal bias, which runs flash
    attention on CUDA in half precision (GQA heads read in place). -> [B, Hq, Q, Dv] in q's dtype."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and q.is_cuda and q.dtype not in _HALF:  # the memory-efficient kernel reads no GQA heads
        k, v, groups = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                          scale=scaling, enable_gqa=groups > 1)


def compressed_attention_ref(
    q: Tensor,
    keys: CompressedTokens,
    values: CompressedTokens,
    mask: Tensor | None,
    scaling: float,
    *,
    softcap: float | None = None,
    causal: bool = True,
) -> Tensor:
    """Reference for :func:`compressed_attention`: decode all K/V, then :func:`dense_attention`."""
    _check(q, keys, values)
    k, v = keys.materialize(torch.float32), values.materialize(torch.float32)  # (valid tokens only)
    return dense_attention(_scaled_queries(q, keys), k, v, mask, scaling, softcap=softcap, causal=causal).to(q.dtype)


def _scaled_queries(q: Tensor, keys: CompressedTokens) -> Tensor:
    """q [B, Hq, Q, Dk] multiplied by the keys' ``query_scale`` (float32; query head h by KV head
    h // (Hq / Hkv)'s: channel by channel, or a matrix from the right), or q itself."""
    scale = keys.query_scale
    if scale is None:
        return q
    group = q.shape[1] // keys.shape[1]
    if scale.dim() == 4:
        return q.float() * scale.repeat_interleave(group, dim=1)
    return q.float() @ scale.repeat_interleave(group, dim=0)


def dense_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scaling: float,
    *,
    softcap: float | None = None,
    causal: bool = True,
) -> Tensor:
    """Plain attention: q [B, Hq, Q, Dk], k [B, Hkv, T, Dk], v [B, Hkv, T, Dv] -> [B, Hq, Q, Dv] in q's dtype.

    Float32 math, KV heads repeated for GQA, mask as in the module docstring, optional ``softcap``;
    fully masked rows give 0.
    """
    groups = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(groups, dim=1)
    v = v.float().repeat_interleave(groups, dim=1)
    s = q.float() @ k.mT * scaling  # [B, Hq, Q, T]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    bias = _block_bias(mask, causal, q.shape[2], k.shape[2], 0, k.shape[2], q.device)
    if bias is not None:
        s = s + bias
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # fully masked rows: 0
    return (p @ v).to(q.dtype)


class _OnlineSoftmax:
    """Running max ``m``, normalizer ``l`` and weighted value sum ``acc`` of a softmax over blocks."""

    def __init__(self, rows: torch.Size, dv: int, device: torch.device) -> None:
        self.m = torch.full((*rows, 1), -math.inf, device=device)
        self.l = torch.zeros((*rows, 1), device=device)
        self.acc = torch.zeros((*rows, dv), device=device)

    def add(self, s: Tensor, v: Tensor) -> None:
        """Merge one block: logits s [..., rows, n] and values v [..., n, Dv]."""
        m = torch.maximum(self.m, s.amax(-1, keepdim=True))
        shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rows masked so far: any finite shift
        alpha = torch.exp(self.m - shift)
        p = torch.exp(s - shift)  # [..., rows, n]
        self.l = self.l * alpha + p.sum(-1, keepdim=True)
        self.acc = self.acc * alpha + p @ v
        self.m = m

    def result(self) -> Tensor:
        """``acc / l`` [..., rows, Dv], 0 for rows with no visible key."""
        return torch.where(self.l > 0, self.acc / self.l.clamp_min(torch.finfo(torch.float32).tiny), 0.0)


def _logits(scores: Tensor, scaling: float, softcap: float | None, bias: Tensor | None, groups: int) -> Tensor:
    """Scaled, soft-capped, masked scores: [B, Hkv, G*Q, n] -> same shape."""
    s = scores * scaling
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is None:
        return s
    b, hkv, gq, n = s.shape
    s = s.view(b, hkv, groups, gq // groups, n)
    if bias.shape[1] == 1:  # one mask for all heads: [Bm, 1, Q, n] -> [Bm, 1, 1, Q, n]
        bias = bias[:, :, None]
    else:  # one mask per query head
        bias = bias.reshape(bias.shape[0], hkv, groups, *bias.shape[2:])
    return (s + bias).view(b, hkv, gq, n)


def _block_bias(
    mask: Tensor | None, causal: bool, nq: int, total: int, t0: int, t1: int, device: torch.device
) -> Tensor | None:
    """Additive float32 bias [Bm, Hm, Q, t1 - t0] for keys t0..t1 of T = ``total`` (-inf where masked), or None."""
    if mask is not None:
        if mask.shape[-1] != total:
            raise ValueError(f"mask must cover the {total} key positions, got shape {tuple(mask.shape)}")
        block = mask[..., t0:t1].to(device)
        if block.dtype == torch.bool:
            return torch.zeros(block.shape, device=device).masked_fill_(~block, -math.inf)
        return block.float()
    if not causal or nq == 1:
        return None
    last = torch.arange(nq, device=device)[:, None] + (total - nq)  # last visible key of each query
    visible = torch.arange(t0, t1, device=device)[None, :] <= last  # [Q, n]
    return torch.zeros(visible.shape, device=device).masked_fill_(~visible, -math.inf)[None, None]


def _check(q: Tensor, keys: CompressedTokens, values: CompressedTokens) -> None:
    """Validate shapes (ValueError / TypeError naming the problem)."""
    for name, kv in (("keys", keys), ("values", values)):
        if not isinstance(kv, CompressedTokens):
            raise TypeError(f"{name} must be CompressedTokens, got {type(kv).__name__}")
    if q.dim() != 4 or q.shape[-1] != keys.shape[-1]:
        raise ValueError(f"q must have shape [B, Hq, Q, {keys.shape[-1]}], got {tuple(q.shape)}")
    b, hkv = keys.shape[:2]
    if (values.shape[:3] != keys.shape[:3] or values.codes.shape != keys.codes.shape or values.sink != keys.sink
            or values.lengths is not keys.lengths):
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} hold different tokens")
    if q.shape[0] != b or q.shape[1] % hkv:
        raise ValueError(f"q [B, Hq] = {tuple(q.shape[:2])} must match batch {b} and a multiple of {hkv} KV heads")
