"""Codes decoded in the rotated domain on GPUs (Triton; the CPU interpreter without a GPU) against
``encoder.decode_rotated``, and the prefill attention that reads them."""

import pytest
import torch

import tqindex as tq
from devices import DEVICE, needs_triton
from tqindex.kv.attention import compressed_attention_ref, decoded_attention
from tqindex.kv.store import KVStore

pytestmark = needs_triton


@pytest.mark.parametrize("name", ["tq1", "tq2", "tq3", "tq4", "tq8", "tq4-norm", "fp4"])
@pytest.mark.parametrize("dim", [50, 60, 64, 128, 256])
@pytest.mark.parametrize("n", [1, 127, 129])
def test_decode_matches_the_reference(name, dim, n):
    from tqindex.kernels.decode_triton import decode_rotated_triton

    enc = tq.make_encoder(name, dim)
    g = torch.Generator().manual_seed(dim + n)
    codes = enc.encode(torch.randn(2 * 3 * (n + 9), dim, generator=g).to(DEVICE)).reshape(2, 3, n + 9)
    part = codes[:, :, 4 : 4 + n]  # a token slice of a buffer, as attention reads a cache's codes
    want = enc.decode_rotated(part)
    got = decode_rotated_triton(enc, part, torch.float16)
    assert got.shape == (2, 3, n, dim) and got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2.0**-10 * float(want.abs().max()))


@pytest.mark.parametrize("keys,values", [("tq4", "tq4"), ("tq3", "fp4"), ("tq8", "tq2")])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])
def test_prefill_from_decoded_blocks_matches_the_reference(keys, values, hq, hkv):
    g = torch.Generator().manual_seed(hq)
    store = KVStore(tq.make_encoder(keys, 64), tq.make_encoder(values, 64), residual_length=3, sink_length=2)
    for t in (129, 40):
        store.append(*(torch.randn(2, hkv, t, 64, generator=g).to(DEVICE).half() for _ in range(2)))
    k, v = store.view()
    q = torch.randn(2, hq, 40, 64, generator=g).to(DEVICE).half()
    got = decoded_attention(q, k, v, 0.2, block_elements=50 * 2 * hkv * 64, backend="triton")  # blocks of 50
    torch.testing.assert_close(got.float(), compressed_attention_ref(q, k, v, None, 0.2).float(), rtol=2e-3,
                               atol=2e-3)
