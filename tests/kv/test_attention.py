import pytest
import torch

import tqindex as tq
from tqindex.kv.attention import (causal_sdpa, compressed_attention, compressed_attention_ref, decoded_attention,
                                  dense_attention)
from tqindex.kv.store import KVStore

torch.set_num_threads(1)


def _kv(b: int, hkv: int, chunks: list[int], dim: int, keys: str, values: str, residual: int, seed: int = 0,
        sink: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """CompressedTokens (keys, values) of a store filled with random chunks."""
    g = torch.Generator().manual_seed(seed)
    store = KVStore(tq.make_encoder(keys, dim), tq.make_encoder(values, dim), residual, sink_length=sink)
    for t in chunks:
        store.append(torch.randn(b, hkv, t, dim, generator=g).to(device, dtype),
                     torch.randn(b, hkv, t, dim, generator=g).to(device, dtype))
    return store.view()


def _query(b: int, hq: int, nq: int, dim: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(b, hq, nq, dim, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("keys,values", [("tq4", "tq4"), ("tq8", "fp4"), ("tq3-prod", "tq2"), ("tcq2-unbiased", "tcq3")])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("nq", [1, 3])
def test_blocks_match_decode_then_attend(keys, values, hq, hkv, nq):
    k, v = _kv(2, hkv, [20, 1, 1, 1, nq], 32, keys, values, residual=3)
    q = _query(2, hq, nq, 32)
    mask = torch.rand(2, 1, nq, k.shape[2], generator=torch.Generator().manual_seed(2)) > 0.3
    mask[..., -1] = True
    for m in (None, mask, torch.where(mask, 0.0, -1e4)):
        out = compressed_attention(q, k, v, m, 0.2, block_tokens=7)
        torch.testing.assert_close(out, compressed_attention_ref(q, k, v, m, 0.2), rtol=1e-5, atol=1e-5)


def test_trellis_codes_attend_closer_than_scalar_codes():
    # Same bytes (2 bits per element and a scale per token): the trellis codes' smaller error reaches attention.
    g = torch.Generator().manual_seed(4)
    keys, values = torch.randn(2, 2, 300, 64, generator=g), torch.randn(2, 2, 300, 64, generator=g)
    q = _query(2, 4, 1, 64) * 2
    exact = dense_attention(q, keys, values, None, 0.125)
    errors = {}
    for family in ("tq", "tcq"):
        store = KVStore(tq.make_encoder(f"{family}2-unbiased", 64), tq.make_encoder(f"{family}2", 64), 0)
        store.append(keys, values)
        store.settle()
        k, v = store.view()
        assert k.codes.shape[2] == 300  # every token encoded
        out = compressed_attention(q, k, v, None, 0.125)
        torch.testing.assert_close(out, dense_attention(q, *store.materialize(), None, 0.125), rtol=1e-4, atol=1e-5)
        errors[family] = (out - exact).norm()
    assert errors["tcq"] < 0.9 * errors["tq"]  # measured: 0.84


def test_per_head_mask_softcap_and_no_causal():
    k, v = _kv(1, 2, [12, 1, 2], 16, "tq4", "tq4", residual=2)
    q = _query(1, 4, 2, 16)
    mask = torch.rand(1, 4, 2, k.shape[2], generator=torch.Generator().manual_seed(3)) > 0.5
    for kw in ({"softcap": 2.0}, {"causal": False}):
        for m in (None, mask):
            out = compressed_attention(q, k, v, m, 1.0, block_tokens=4, **kw)
            torch.testing.assert_close(out, compressed_attention_ref(q, k, v, m, 1.0, **kw), rtol=1e-5, atol=1e-5)


def test_none_mask_is_bottom_right_causal():
    k, v = _kv(1, 1, [6, 1, 4], 16, "tq8", "tq8", residual=1)
    total = k.shape[2]
    q = _query(1, 1, 4, 16)
    causal = torch.ones(4, total, dtype=torch.bool).tril(total - 4)[None, None]
    out = compressed_attention(q, k, v, None, 0.5, block_tokens=3)
    torch.testing.assert_close(out, compressed_attention(q, k, v, causal, 0.5, block_tokens=3))
    torch.testing.assert_close(out, compressed_attention_ref(q, k, v, causal, 0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("past", [1, 127, 129, 3017])
@pytest.mark.parametrize("hq,hkv", [(1, 1), (6, 2), (4, 1), (8, 1)])
@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), ("cpu", torch.bfloat16)]
                         + ([("cuda", torch.bfloat16)] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("residual,sink", [(5, 2), (0, 0)])
def test_decoded_attention_matches_decode_then_attend(past, hq, hkv, device, dtype, residual, sink):
    """The prefill path (codes decoded block by block, flash attention per block, log-sum-exp merge) against
    decoding everything: ragged pasts, GQA groups 1, 3, 4, 8, sinks, a window of the queries alone, blocks
    that split the codes."""
    nq = 70
    k, v = _kv(2, hkv, [past, nq], 64, "tq4", "tq3", residual=residual, sink=sink, dtype=dtype, device=device)
    q = _query(2, hq, nq, 64).to(device, dtype)
    out = decoded_attention(q, k, v, 0.3, block_elements=1000 * 2 * hkv * 64)  # blocks of 1000 codes
    ref = compressed_attention_ref(q, k, v, None, 0.3)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    # compressed_attention takes this path for a prefill
    torch.testing.assert_close(compressed_attention(q, k, v, None, 0.3).float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("nq,total", [(3, 10), (5, 5), (7, 300)])
@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_causal_sdpa_aligns_queries_to_the_last_key(nq, total, device):
    g = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(1, 8, nq, 64, generator=g).to(device, dtype)
    k, v = (torch.randn(1, 2, total, 64, generator=g).to(device, dtype) for _ in range(2))
    causal = torch.ones(nq, total, dtype=torch.bool, device=device).tril(total - nq)[None, None]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(causal_sdpa(q, k, v, 0.2).float(), dense_attention(q, k, v, causal, 0.2).float(),
                               rtol=tol, atol=tol)


def test_fully_masked_rows_give_zero_and_dtype_is_kept():
    k, v = _kv(2, 1, [8, 1], 16, "tq4", "tq4", residual=1)
    q = _query(2, 2, 1, 16).to(torch.bfloat16)
    mask = torch.ones(2, 1, 1, k.shape[2], dtype=torch.bool)
    mask[0] = False
    out = compressed_attention(q, k, v, mask, 0.25)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 2, 1, 16)
    assert torch.all(out[0] == 0) and torch.any(out[1] != 0)


def test_dense_attention_matches_sdpa():
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g), torch.randn(2, 2, 9, 8, generator=g)
    mask = torch.rand(2, 1, 5, 9, generator=g) > 0.2
    mask[..., 0] = True
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask, scale=0.3
    )
    torch.testing.assert_close(dense_attention(q, k, v, mask, 0.3), expected, rtol=1e-5, atol=1e-5)


def test_validation():
    k, v = _kv(1, 2, [5, 1], 16, "tq4", "tq4", residual=1)
    with pytest.raises(ValueError, match=r"q must have shape \[B, Hq, Q, 16\]"):
        compressed_attention(_query(1, 2, 1, 8), k, v, None, 1.0)
    with pytest.raises(ValueError, match="multiple of 2 KV heads"):
        compressed_attention(_query(1, 3, 1, 16), k, v, None, 1.0)
    with pytest.raises(ValueError, match="mask must cover the 6 key positions"):
        compressed_attention(_query(1, 2, 1, 16), k, v, torch.ones(1, 1, 1, 5, dtype=torch.bool), 1.0)
    with pytest.raises(ValueError, match="block_tokens"):
        compressed_attention(_query(1, 2, 1, 16), k, v, None, 1.0, block_tokens=0)
    with pytest.raises(TypeError, match="keys must be CompressedTokens"):
        compressed_attention(_query(1, 2, 1, 16), k.window, v, None, 1.0)
