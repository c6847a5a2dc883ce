import pytest
import torch

import tqindex as tq
from tqindex.codes import Codes


def test_slicing_concat_and_nbytes():
    enc = tq.TurboQuantProd(dim=64, bits=3)
    x = torch.randn(2, 5, 64)
    c = enc.encode(x)
    assert c.shape == (2, 5) and len(c) == 2
    assert c.nbytes == 10 * enc.code_size
    part = c[:, 1:3]
    assert part.shape == (2, 2)
    assert torch.equal(enc.decode(part), enc.decode(c)[:, 1:3])
    joined = Codes.cat([c[:, :2], c[:, 2:]], dim=1)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(joined.planes(), c.planes()))
    assert torch.equal(enc.decode(c[torch.tensor([1, 0])]), enc.decode(c).flip(0))


def test_buffers_reshape_and_device():
    enc = tq.make_encoder("fp4", 64)
    c = enc.encode(torch.randn(6, 64))
    buf = c.empty_like(10)
    buf.copy_(slice(2, 8), c)
    assert torch.equal(enc.decode(buf[2:8]), enc.decode(c))
    assert c.reshape(2, 3).shape == (2, 3)
    assert c.to("cpu").device.type == "cpu"


def test_bad_codes():
    enc = tq.TurboQuantMSE(dim=64, bits=4)
    c = enc.encode(torch.randn(3, 64))
    with pytest.raises(ValueError, match="leading shape"):
        Codes(qdata=c.qdata, norm=c.norm[:2])
    with pytest.raises(IndexError):
        c[..., 0]
    with pytest.raises(ValueError, match="different encoder"):
        Codes.cat([c, tq.make_encoder("fp4", 64).encode(torch.randn(1, 64))])
    with pytest.raises(ValueError, match="different encoder"):
        tq.TurboQuantMSE(dim=64, bits=2).decode(c)
    with pytest.raises(TypeError, match="Codes"):
        enc.decode(c.qdata)
