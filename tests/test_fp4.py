import pytest
import torch

import tqindex as tq
from tqindex.packing import pack

# Relative MSE of FP4-UE8M0 on Gaussian data (groups of 32, no rotation), measured once and recorded
# in SPEC §3; benchmarks/encoders.py writes the full ablation.
SPEC_ABLATION = {("round", 0.156): 0.0178, ("round", 0.195): 0.0125, ("ceil", 0.156): 0.0129}


def test_seventeen_bytes_per_32_elements():
    enc = tq.FP4UE8M0(dim=128)
    codes = enc.encode(torch.randn(3, 128))
    assert enc.code_size == 4 * 17 and codes.qdata.shape == (3, 64) and codes.scale.shape == (3, 4)
    assert codes.nbytes == 3 * 68 and enc.bits_per_dim == 4.25


def test_hand_made_values_encode_to_documented_bits_and_decode_exactly():
    enc = tq.FP4UE8M0(dim=32, rotation="none")
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    row = torch.tensor(magnitudes + [-m for m in magnitudes] + magnitudes[::-1] + [-0.5] * 8)
    for exponent in (0, 3, -5):
        x = row * 2.0**exponent
        codes = enc.encode(x[None])
        # absmax 6·2^e: ceil(log2(0.156 · 6 · 2^e)) = e  ->  byte 127 + e
        assert codes.scale.tolist() == [[127 + exponent]]
        expect = list(range(8)) + [8 | i for i in range(8)] + list(range(7, -1, -1)) + [9] * 8
        assert codes.qdata[0].tolist() == pack(torch.tensor([expect]), 4)[0].tolist()
        assert codes.qdata[0, 0].item() == 0x10  # element 0 (code 0) low nibble, element 1 (code 1) high
        dec = enc.decode(codes)[0]
        assert torch.equal(dec[row != 0], x[row != 0])  # exact (the -0.0 code decodes to -0.0)
        assert torch.equal(dec.bfloat16().float(), dec)


def test_saturation_and_zero_groups():
    enc = tq.FP4UE8M0(dim=64, rotation="none", scale_rounding="round", scale_constant=0.05)
    x = torch.zeros(1, 64)
    x[0, :32] = torch.linspace(-1, 1, 32) * 10
    codes = enc.encode(x)
    assert codes.scale[0, 1].item() == 0  # all-zero group: smallest byte, zero codes
    dec = enc.decode(codes)
    assert torch.equal(dec[0, 32:], torch.zeros(32))
    # E = round(log2(0.05 · 10)) = -1: 10 / 2^-1 = 20 saturates at code value 6 -> 3.0
    assert codes.scale[0, 0].item() == 126 and dec.abs().max().item() == 3.0


@pytest.mark.parametrize("rounding,c", list(SPEC_ABLATION))
def test_scale_ablation_reproduces_spec(rounding, c):
    x = torch.randn(4096, 256, generator=torch.Generator().manual_seed(0))
    enc = tq.FP4UE8M0(dim=256, rotation="none", scale_constant=c, scale_rounding=rounding)
    rel = (((enc.decode(enc.encode(x)) - x) ** 2).sum() / (x**2).sum()).item()
    assert rel == pytest.approx(SPEC_ABLATION[(rounding, c)], rel=0.04)


def test_partial_last_group_and_rotation_round_trip():
    enc = tq.FP4UE8M0(dim=50)
    x = torch.randn(100, 50)
    codes = enc.encode(x)
    assert enc.code_size == 25 + 2 and codes.scale.shape == (100, 2)
    rel = (((enc.decode(codes) - x) ** 2).sum() / (x**2).sum()).item()
    assert rel < 0.02


def test_bad_options():
    with pytest.raises(ValueError, match="group_size"):
        tq.FP4UE8M0(dim=64, group_size=3)
    with pytest.raises(ValueError, match="scale_constant"):
        tq.FP4UE8M0(dim=64, scale_constant=-1.0)
    with pytest.raises(ValueError, match="scale_rounding"):
        tq.FP4UE8M0(dim=64, scale_rounding="nearest")


def test_level_run_decodes_every_e2m1_code():
    """The symmetric codebook the GPU kernels decode through: code c ^ 8 (c ^ 15 for negative codes) holds
    E2M1 code c's value, and its positive half is the E2M1 magnitudes."""
    from tqindex.codebooks import E2M1_VALUES

    run = tq.make_encoder("fp4", 64).level_run()
    assert run.width == 64 and run.bits == 4
    codes = torch.arange(16)
    symmetric = codes ^ 8 ^ ((codes >> 3) * 7)
    assert torch.equal(run.centroids[symmetric], E2M1_VALUES)
