import pytest
import torch

from tqindex.kernels import native
from tqindex.packing import PACK_BITS, pack, pack_reference, packed_size, unpack, unpack_values


@pytest.mark.parametrize("bits", PACK_BITS)
@pytest.mark.parametrize("dim", [1, 3, 7, 8, 9, 50, 127, 128, 130])
def test_round_trip_any_dim(bits, dim):
    codes = torch.randint(0, 2**bits, (4, 3, dim), dtype=torch.uint8)
    p = pack(codes, bits)
    assert p.dtype == torch.uint8 and p.shape == (4, 3, packed_size(dim, bits))
    assert torch.equal(unpack(p, bits, dim), codes)


@pytest.mark.parametrize("bits", PACK_BITS)
def test_layout_is_a_little_endian_bit_stream(bits):
    dim = 13
    codes = torch.randint(0, 2**bits, (1, dim))
    stream = "".join(format(int(c), f"0{bits}b")[::-1] for c in codes[0])  # LSB first per code
    stream += "0" * (8 * packed_size(dim, bits) - len(stream))
    expect = [int(stream[8 * i : 8 * i + 8][::-1], 2) for i in range(packed_size(dim, bits))]
    assert pack(codes, bits)[0].tolist() == expect


@pytest.mark.skipif(not native.available(), reason="compiled kernels not built")
@pytest.mark.parametrize("bits", PACK_BITS)
@pytest.mark.parametrize("dim", [1, 5, 8, 13, 50, 384])
def test_compiled_packing_equals_reference(bits, dim):
    codes = torch.randint(0, 2**bits, (9000, dim), dtype=torch.uint8)  # rows in more than one job on 2+ threads
    assert torch.equal(pack(codes, bits), pack_reference(codes, bits))
    assert torch.equal(pack(codes[:, None, :3], bits), pack_reference(codes[:, None, :3], bits))  # a strided view


def test_nibble_order():
    assert pack(torch.tensor([[1, 2, 3]]), 4).tolist() == [[0x21, 0x03]]


def test_bad_bits_and_sizes():
    with pytest.raises(ValueError, match="bits"):
        pack(torch.zeros(2, 8), 5)
    with pytest.raises(ValueError, match="bytes"):
        unpack(torch.zeros(2, 3, dtype=torch.uint8), 4, 8)


@pytest.mark.parametrize("bits", PACK_BITS)
@pytest.mark.parametrize("shape", [(5, 50), (2, 3, 130), (0, 7), (1, 1)])
def test_unpack_values_equals_lookup_of_unpacked_codes(bits, shape):
    levels = torch.randn(2**bits)
    codes = torch.randint(0, 2**bits, shape, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert torch.equal(unpack_values(packed, bits, shape[-1], levels), levels[codes.long()])
