"""The inline PTX that decodes 4-bit codes on GPUs, run by a small emulator of the instructions it uses
(so its bit logic is checked on every machine), against the codebook."""

import numpy as np
import pytest
import torch

import tqindex as tq
from tqindex.kernels import triton_importable

pytestmark = pytest.mark.skipif(not triton_importable(), reason="triton is not installed")
M32 = np.uint64(0xFFFFFFFF)


def prmt(a, b, c):
    """PTX prmt.b32 (default mode): byte i of the result is byte c[4i+2:4i] of {b, a}."""
    src = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    out = np.zeros_like(a, dtype=np.uint64)
    for i in range(4):
        sel = (c.astype(np.uint64) >> np.uint64(4 * i)) & np.uint64(0xF)
        assert (sel < 8).all(), "sign-replicating selectors are not expected"
        out |= ((src >> (np.uint64(8) * sel)) & np.uint64(0xFF)) << np.uint64(8 * i)
    return out & M32


def run_ptx(asm: str, operands: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Execute the asm (mov, not, shr, shl, and, or, xor, mul.lo, prmt on .b32) over arrays of words."""
    regs = {f"${k}": v.astype(np.uint64) for k, v in operands.items()}
    val = lambda tok: np.uint64(int(tok, 0)) if tok[0].isdigit() else regs[tok]  # noqa: E731
    for line in asm.strip().splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        x = [val(a) for a in src]
        if op == "mov.b32":
            r = x[0] + np.zeros_like(next(iter(regs.values())))
        elif op == "not.b32":
            r = ~x[0] & M32
        elif op == "shr.u32":
            r = x[0] >> x[1]
        elif op == "shl.b32":
            r = (x[0] << x[1]) & M32
        elif op == "and.b32":
            r = x[0] & x[1]
        elif op == "or.b32":
            r = x[0] | x[1]
        elif op == "xor.b32":
            r = x[0] ^ x[1]
        elif op == "mul.lo.u32":
            r = (x[0] * x[1]) & M32
        elif op == "prmt.b32":
            r = prmt(*[np.broadcast_to(v, regs["$4"].shape) for v in x])
        else:
            raise AssertionError(f"instruction {op} is not emulated")
        regs[d] = r & M32
    return regs


@pytest.mark.parametrize("bits_dim", [(4, 128), (4, 50)])
def test_prmt_decode_equals_the_codebook(bits_dim):
    from tqindex.kernels.planes import run_layouts
    from tqindex.kernels.scan_triton import PRMT_ASM, prmt_tables

    enc = tq.make_encoder("tq4", bits_dim[1])
    layouts, mags, _ = run_layouts(enc.code_runs())
    t = [np.uint64(w & 0xFFFFFFFF) for w in prmt_tables(mags, layouts)[:4]]
    rng = np.random.default_rng(0)
    words = np.concatenate([np.arange(256, dtype=np.uint64) * np.uint64(0x01010101),  # every byte everywhere
                            rng.integers(0, 2**32, 4096, dtype=np.uint64)])
    regs = run_ptx(PRMT_ASM.value, {4: words, 5: np.full_like(words, t[0]), 9: np.full_like(words, t[1]),
                              13: np.full_like(words, t[2]), 17: np.full_like(words, t[3])})
    levels = enc.code_runs()[0].centroids.half()  # [16] ascending, code -> level
    byte = lambda k: ((words >> np.uint64(8 * k)) & np.uint64(0xFF)).astype(np.int64)  # noqa: E731
    halves = lambda r: [(regs[r] & np.uint64(0xFFFF)).astype(np.int64), (regs[r] >> np.uint64(16)).astype(np.int64)]  # noqa: E731
    lo = halves("$0") + halves("$1")  # low nibbles of bytes 0..3
    hi = halves("$2") + halves("$3")
    bits = levels.view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    for k in range(4):
        np.testing.assert_array_equal(lo[k], bits[byte(k) & 15])
        np.testing.assert_array_equal(hi[k], bits[byte(k) >> 4])
