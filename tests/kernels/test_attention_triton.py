"""Attention from codes on GPUs (Triton; the CPU interpreter without a GPU) against the PyTorch reference."""

import pytest
import torch

import tqindex as tq
from devices import DEVICE, needs_cuda, needs_triton
from tqindex.kv.attention import compressed_attention_ref
from tqindex.kv.store import KVStore

pytestmark = needs_triton


def stores(kenc: str, venc: str, b: int, hkv: int, d: int, past: int, window: int, seed: int):
    """A store holding ``past`` compressed tokens then ``window`` full-precision ones (keys with a few large
    channels, as LLM keys have)."""
    g = torch.Generator().manual_seed(seed)
    store = KVStore(tq.make_encoder(kenc, d), tq.make_encoder(venc, d), residual_length=0)
    k = torch.randn(b, hkv, past + window, d, generator=g)
    k[..., :3] *= 6
    v = torch.randn(b, hkv, past + window, d, generator=g)
    if past:
        store.append(k[:, :, :past].to(DEVICE), v[:, :, :past].to(DEVICE))
        store.append(k[:, :, past:].to(DEVICE), v[:, :, past:].to(DEVICE))  # the first ``past`` are encoded
    else:
        store.append(k.to(DEVICE), v.to(DEVICE))
    return store


def check(kenc, venc, b, hq, hkv, d, past, window, nq, mask=None, softcap=None, causal=True, decode=None,
          strided=True, one_pass=None, cuda=False, q_scale=1.0):
    """The kernel against the reference; ``strided``: q [B, Hq, Q, D] a transposed view of [B, Q, Hq, D], as
    attention layers pass it (else contiguous); ``cuda``: the compressed splits by the CUDA C++ kernel; queries
    standard normal times ``q_scale``."""
    from tqindex.kernels.attention_triton import compressed_attention_triton

    store = stores(kenc, venc, b, hkv, d, past, window, seed=past + window + hq)
    keys, values = store.view()
    assert keys.codes.shape[2] == past and keys.window.shape[2] == window
    q = torch.randn(b, nq, hq, d, generator=torch.Generator().manual_seed(1)).mul(q_scale).to(DEVICE).half()
    q = q.transpose(1, 2)
    q = q if strided else q.contiguous()
    scaling = d ** -0.5
    ref = compressed_attention_ref(q.float(), keys, values, mask, scaling, softcap=softcap, causal=causal)
    out = compressed_attention_triton(q, keys, values, mask, scaling, softcap=softcap, causal=causal, decode=decode,
                                      one_pass=one_pass, cuda=cuda)
    assert out.dtype == q.dtype and out.shape == ref.shape
    err = (out.float() - ref).norm() / ref.norm()
    assert err < 2e-3, float(err)


@pytest.mark.parametrize("past", [1, 127, 129, 3017])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (3, 1), (8, 2), (16, 2)])  # G = 1, 3, 4, 8
def test_decode_step(past, hq, hkv):
    check("tq4", "tq4", 2, hq, hkv, 64, past, 5, 1)


@needs_cuda
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("past", [1, 127, 129, 3017])
@pytest.mark.parametrize("hq, hkv, nq", [(4, 4, 1), (3, 1, 1), (8, 2, 1), (16, 2, 1), (32, 8, 1), (24, 2, 1),
                                         (8, 2, 3)])  # G = 1, 3, 4, 8, 4, 12 (two row blocks); 3 queries
def test_cuda_decode_step(d, past, hq, hkv, nq):
    """The CUDA C++ kernel's compressed splits with the Triton window splits, against the reference."""
    from tqindex.kernels import attention_cuda

    assert attention_cuda.reads(tq.make_encoder("tq4-unbiased", d), tq.make_encoder("tq4", d))
    check("tq4-unbiased", "tq4", 2, hq, hkv, d, past, 5, nq, cuda=True)
    if past == 3017:
        check("tq4", "tq4", 1, hq, hkv, d, past, 0, 1, cuda=True)  # no window: no Triton attention launch


@needs_cuda
@pytest.mark.parametrize("past", [129, 3017, 40000])
@pytest.mark.parametrize("hq, hkv", [(4, 1), (24, 2)])
@pytest.mark.parametrize("merged_by", ["cuda", "triton"])
def test_cuda_decode_step_merges(monkeypatch, past, hq, hkv, merged_by):
    """The CUDA kernel merges the splits of steps with few (batch row x KV head) pairs, at most MAX_SPLITS of them
    (40k tokens at batch 1 would take more); the Triton merge kernel those of the other steps."""
    from tqindex.kernels import attention_cuda

    if merged_by == "triton":
        monkeypatch.setattr(attention_cuda, "MERGE_SLOTS", 0)
    assert attention_cuda.merges(1 * hkv, hq // hkv) == (merged_by == "cuda")
    check("tq4", "tq4", 1, hq, hkv, 64, past, 5, 1, cuda=True)


@needs_cuda
@pytest.mark.parametrize("kenc, venc", [("fp4", "fp4"), ("tq8", "tq4"), ("fp4", "tq4"), ("tq4", "fp4"),
                                        ("tq8", "fp4")])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("past", [1, 129, 3017])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (3, 1), (8, 2), (16, 2)])  # G = 1, 3, 4, 8
def test_cuda_decode_step_other_codes(kenc, venc, d, past, hq, hkv):
    """FP4 keys and values, 8-bit keys: the CUDA C++ kernel's splits against the reference."""
    check(kenc, venc, 2, hq, hkv, d, past, 5, 1, cuda=True)


def test_the_cuda_kernel_reads_4bit_8bit_and_fp4_codes():
    from tqindex.kernels.attention_cuda import reads

    enc = tq.make_encoder
    assert reads(enc("tq4-unbiased", 128), enc("tq4", 128)) and reads(enc("tq4", 64), enc("tq4-norm", 64))
    assert reads(enc("tq4", 256), enc("tq4", 256)) and reads(enc("fp4", 128), enc("fp4", 128))
    assert reads(enc("tq8", 64), enc("tq4", 64)) and reads(enc("fp4", 256), enc("tq4", 256))
    for k, v in [(enc("tq3", 128), enc("tq4", 128)), (enc("tq4", 128), enc("tq8", 128)), (enc("tq4", 96),) * 2,
                 (enc("tq4", 64), enc("tq4", 128)), (enc("tq4", 128, norm_dtype="float32"), enc("tq4", 128)),
                 (enc("fp4", 128, group_size=16), enc("tq4", 128))]:
        assert not reads(k, v)


def test_a_failed_cuda_build_warns_once_and_leaves_the_splits_to_triton(monkeypatch):
    import torch.utils.cpp_extension as cpp

    from tqindex.kernels import attention_cuda

    def broken(*args, **kwargs):
        raise RuntimeError("nvcc exited with 1")

    monkeypatch.setattr(cpp, "load_inline", broken)
    attention_cuda._module.cache_clear()
    combo = (128, attention_cuda.TQ4, attention_cuda.TQ4, *attention_cuda.ring(128, attention_cuda.TQ4))
    try:
        with pytest.warns(RuntimeWarning, match="could not be built.*nvcc exited"):
            assert attention_cuda._module(*combo) is None
        assert attention_cuda._module(*combo) is None  # cached: no warning
    finally:
        attention_cuda._module.cache_clear()


def test_the_cuda_kernel_reads_codes_in_place_only():
    """Rows (batch x KV head) at one stride, dense tokens, aligned starts; else the Triton kernel runs the splits."""
    from tqindex.kernels.attention_cuda import _in_place

    codes = torch.zeros(2, 3, 10, 64, dtype=torch.uint8)
    assert _in_place(codes, 16) and _in_place(codes[:1, 1:], 16) and _in_place(codes[:, :, 2:], 16)
    assert not _in_place(codes[:, 1:], 16)  # batch rows no longer one head stride apart
    assert not _in_place(codes[..., 1:], 16) and not _in_place(codes[..., :32], 16)  # misaligned, sparse tokens
    assert not _in_place(codes.transpose(1, 2), 16)
    scales = torch.zeros(2, 3, 10, 4, dtype=torch.uint8)
    assert _in_place(scales, 4) and not _in_place(scales[:, :, :, 1:], 3)


def test_8bit_key_levels_are_the_codebook():
    """The CUDA kernel's table of 8-bit key levels (code c -> level) is the encoder's codebook in f16."""
    from tqindex.kernels.attention_cuda import _levels8
    from tqindex.kernels.scan_triton import _scan_tables

    enc = tq.make_encoder("tq8", 64)
    _, mags, _, _ = _scan_tables(enc, torch.device("cpu"))
    assert torch.equal(_levels8(mags), enc.code_runs()[0].centroids.half())


@pytest.mark.parametrize("kenc, venc, d", [("tq4", "tq4", 128), ("tq3", "tq4", 64), ("tq8", "tq4", 64),
                                          ("tq2", "tq2", 64), ("tq4", "tq8", 96), ("tq1", "tq1", 64),
                                          ("tq3", "tq3", 128), ("tq3", "tq3", 40), ("fp4", "fp4", 64),
                                          ("fp4", "tq4", 128), ("tq4", "fp4", 96), ("tq4", "tq4", 256)])
def test_encoders_and_dims(kenc, venc, d):
    check(kenc, venc, 1, 4, 2, d, 200, 3, 1, strided=False)


@pytest.mark.parametrize("q_scale", [1e-5, 1e4])
def test_queries_of_any_scale(q_scale):
    """Tiny and huge queries (their rotation is held in float16, each row divided by a power of two from its
    norm) attend as the reference does."""
    check("tq4", "tq4", 1, 4, 2, 128, 200, 3, 1, q_scale=q_scale)


def test_cuda_kernel_splits():
    """The CUDA kernel's splits: at least SPLIT_TOKENS tokens each, unless that leaves multiprocessors idle, then
    down to FILL_TOKENS (at most one block per multiprocessor); merged steps aim at fewer blocks. Where the
    multiprocessors get more than one block each, the count between half and twice the aim that shares them most
    evenly."""
    from tqindex.kernels.attention_cuda import FILL_TOKENS, SPLIT_TOKENS, splits

    sms = 132
    for tokens in (1, 100, 256, 4096, 16384, 65536, 131072):
        for pairs in (1, 3, 8, 16, 24, 64, 256, 1024):
            for merged in (True, False):
                n = splits(tokens, pairs, sms, merged)
                per = -(-tokens // n)
                assert n >= 1 and (per >= min(tokens, FILL_TOKENS))
                assert per >= min(tokens, SPLIT_TOKENS) or n * pairs <= sms + pairs
    # 16k tokens, 8 pairs: filling 132 multiprocessors takes 17 splits, two blocks on four of them; 16 fit once
    assert [splits(4096, 8, sms, True), splits(16384, 8, sms, True), splits(65536, 8, sms, True)] == [16, 16, 33]
    assert [splits(4096, 64, sms, False), splits(16384, 64, sms, False)] == [4, 16]
    # 64 pairs x the aim's 17 splits: 8 or 9 blocks per multiprocessor; 33 splits: 16 on every one
    assert splits(65536, 64, sms, False) == splits(131072, 64, sms, False) == 33
    assert splits(16384, 256, sms, False) == 5  # no count in 2..10 shares 256 pairs more evenly: the aim


def test_prefill_chunk_over_a_compressed_past_is_causal():
    check("tq4", "tq4", 1, 4, 2, 64, 300, 70, 70)  # the chunk is the window: 70 queries, causal
    check("tq4", "tq4", 1, 4, 2, 64, 300, 70, 70, strided=False)


@pytest.mark.parametrize("kenc, venc, d, past", [("tq4", "tq4", 64, 300), ("tq3", "fp4", 96, 129),
                                                 ("tq4", "tq4", 64, 0)])
def test_prefill_chunk_in_one_pass_per_row_block(kenc, venc, d, past):
    """Each program takes all tokens of its rows and writes the output (no partials, no merge): what prefill
    chunks whose row blocks fill the card run."""
    from tqindex.kernels import multiprocessors
    from tqindex.kernels.attention_triton import PROGRAMS_PER_SM

    nq = 70
    check(kenc, venc, 2, 8, 4, d, past, nq, nq, one_pass=True)
    mask = torch.ones(2, 1, nq, past + nq, dtype=torch.bool).tril(past)
    mask[0, ..., :20] = False  # left padding of the first row
    check(kenc, venc, 2, 8, 4, d, past, nq, nq, mask=mask.to(DEVICE), softcap=20.0, one_pass=True)
    b = PROGRAMS_PER_SM * multiprocessors(DEVICE) // (4 * 3) + 1  # 4 KV heads x 3 row blocks (G x Q = 140 rows)
    check(kenc, venc, b, 8, 4, d, past, nq, nq)  # enough row blocks: one pass by default


def test_no_window_softcap_padding_mask_and_no_past():
    mask = torch.ones(2, 1, 1, 260, dtype=torch.bool)
    mask[0, ..., :40] = False  # left padding of the first row
    check("tq4", "tq4", 2, 4, 2, 64, 259, 1, 1, mask=mask.to(DEVICE), softcap=30.0)
    check("tq4", "tq4", 1, 4, 2, 64, 0, 9, 9)  # nothing compressed yet


def test_fp4_groups_of_very_different_scales():
    """FP4 levels are scaled per group relative to the token's largest group exponent, the rest per token:
    groups 2^12 apart and a token 2^-20 smaller than the others stay exact (against the reference)."""
    from tqindex.kernels.attention_triton import compressed_attention_triton

    g = torch.Generator().manual_seed(5)
    enc_k, enc_v = tq.make_encoder("fp4", 64, rotation="none"), tq.make_encoder("fp4", 64, rotation="none")
    store = KVStore(enc_k, enc_v, residual_length=0)
    k, v = torch.randn(1, 2, 150, 64, generator=g), torch.randn(1, 2, 150, 64, generator=g)
    k[..., 32:] *= 2.0**12
    v[..., :32] *= 2.0**-12
    k[:, :, 7] *= 2.0**-20
    store.append(k.to(DEVICE), v.to(DEVICE))
    store.append(k[:, :, :1].to(DEVICE), v[:, :, :1].to(DEVICE))
    keys, values = store.view()
    q = torch.randn(1, 4, 1, 64, generator=g).to(DEVICE).half() * 2.0**-10
    ref = compressed_attention_ref(q.float(), keys, values, None, 0.125)
    for cuda in (False, True) if DEVICE.type == "cuda" else (False,):
        out = compressed_attention_triton(q, keys, values, None, 0.125, cuda=cuda)
        assert float((out.float() - ref).norm() / ref.norm()) < 2e-3


def test_attention_reads_fp4_of_32_element_groups_only():
    from tqindex.kernels.planes import attention_reads

    assert attention_reads(tq.make_encoder("fp4", 128), tq.make_encoder("tq4", 128), None)
    assert not attention_reads(tq.make_encoder("fp4", 128, group_size=16), tq.make_encoder("tq4", 128), None)
    assert not attention_reads(tq.make_encoder("tq4", 16), tq.make_encoder("fp4", 16), None)


@pytest.mark.parametrize("kenc, venc", [("tq4", "tq4"), ("fp4", "fp4")])
def test_prmt_decode_on_cuda(kenc, venc):
    if DEVICE.type != "cuda":
        pytest.skip("inline PTX runs on CUDA only")
    check(kenc, venc, 2, 8, 2, 128, 1000, 4, 1, decode=2)


def test_prefill_with_a_padding_mask():
    """A chunk of 6 queries over 100 compressed tokens and the 6-token window, the first row left-padded."""
    b, total, nq = 2, 106, 6
    causal = torch.ones(nq, total, dtype=torch.bool).tril(total - nq)
    mask = causal[None, None].repeat(b, 1, 1, 1)
    mask[0, ..., :30] = False
    check("tq4", "tq4", b, 4, 2, 64, 100, nq, nq, mask=mask.to(DEVICE))
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    check("tq4", "tq4", b, 4, 2, 64, 100, nq, nq, mask=additive.to(DEVICE))


def test_generate_with_the_kernel_equals_the_reference_cache():
    """Greedy decoding of a tiny Llama with 8-bit codes: the kernel's cache gives the PyTorch cache's tokens."""
    transformers = pytest.importorskip("transformers")
    from tqindex.kv import TQCache

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().to(DEVICE)
    model.set_attn_implementation("tqindex")
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    kw = "cache" if "cache" in __import__("inspect").signature(model.forward).parameters else "past_key_values"
    out = []
    for backend in ("triton", "torch"):
        cache = TQCache(model.config, "tq8", "tq8", residual_length=4, protected_layers=0, backend=backend)
        out.append(model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, **{kw: cache}))
    assert torch.equal(out[0], out[1])


def test_scaled_keys():
    """Keys held divided by per-channel scales: the kernel reads them with the queries scaled."""
    from tqindex.kv.attention import compressed_attention

    g = torch.Generator().manual_seed(5)
    scale = torch.rand(2, 64, generator=g) + 0.5
    store = KVStore(tq.make_encoder("tq4", 64), tq.make_encoder("tq4", 64), 0, True, scale)
    k, v = torch.randn(1, 2, 301, 64, generator=g), torch.randn(1, 2, 301, 64, generator=g)
    store.append(k[:, :, :300].to(DEVICE), v[:, :, :300].to(DEVICE))
    store.append(k[:, :, 300:].to(DEVICE), v[:, :, 300:].to(DEVICE))
    keys, values = store.view()
    q = torch.randn(1, 4, 1, 64, generator=g).to(DEVICE).half()
    want = compressed_attention_ref(q.float(), keys, values, None, 0.125)
    got = compressed_attention(q, keys, values, None, 0.125, backend="triton")
    assert got.dtype == torch.float16
    assert float((got.float() - want).norm() / want.norm()) < 2e-3


def test_sink_tokens_with_a_padding_mask():
    """Sinks held before the codes in the sequence, after them in the kernel's window: the mask is reordered."""
    from tqindex.kv.attention import compressed_attention

    g = torch.Generator().manual_seed(5)
    store = KVStore(tq.make_encoder("tq4", 64), tq.make_encoder("tq4", 64), residual_length=0, sink_length=4)
    k, v = torch.randn(2, 2, 140, 64, generator=g), torch.randn(2, 2, 140, 64, generator=g)
    store.append(k[:, :, :137].to(DEVICE), v[:, :, :137].to(DEVICE))
    store.append(k[:, :, 137:].to(DEVICE), v[:, :, 137:].to(DEVICE))
    keys, values = store.view()
    assert keys.sink == 4 and keys.codes.shape[2] == 133
    q = torch.randn(2, 4, 3, 64, generator=g).to(DEVICE).half()
    mask = torch.ones(2, 1, 3, 140, dtype=torch.bool).tril(137)
    mask[0, ..., 1:3] = False
    mask[1, ..., 50:60] = False
    for m in (None, mask.to(DEVICE)):
        ref = compressed_attention_ref(q.float(), keys, values, m, 0.125)
        out = compressed_attention(q, keys, values, m, 0.125, backend="triton")
        assert ((out.float() - ref).norm() / ref.norm()) < 2e-3


@pytest.mark.parametrize("venc", ["tq3", "tq4"])
@pytest.mark.parametrize("hq, hkv, past", [(3, 1, 129), (8, 2, 1), (4, 4, 3017)])
def test_decode_step_reads_lengths_on_the_device(hq, hkv, past, venc):
    """A static store's buffers (capacity beyond the valid tokens, filled with NaN there): the kernel reads the
    valid lengths on the device and matches the reference over the valid tokens."""
    from tqindex.kv.attention import compressed_attention

    g = torch.Generator().manual_seed(past)
    store = KVStore(tq.make_encoder("tq4", 64), tq.make_encoder(venc, 64), residual_length=6, encode_stride=4)
    store.append(*(torch.randn(2, hkv, past + 6, 64, generator=g).to(DEVICE) for _ in range(2)))
    store.make_static(headroom=70)
    for _ in range(2):
        store.append(*(torch.randn(2, hkv, 1, 64, generator=g).to(DEVICE) for _ in range(2)))
    keys, values = store.view()
    tc, tw = keys.lengths.tolist()
    assert keys.codes.shape[2] > tc and keys.window.shape[2] > tw
    for side in (keys, values):
        side.window[:, :, tw:] = float("nan")
        side.codes.norm[:, :, tc:] = float("nan")
    q = torch.randn(2, hq, 1, 64, generator=g).to(DEVICE).half()
    ref = compressed_attention_ref(q.float(), keys, values, None, 0.125)
    for backend in ("triton", "cuda") if DEVICE.type == "cuda" else ("triton",):
        out = compressed_attention(q, keys, values, None, 0.125, backend=backend)
        assert float((out.float() - ref).norm() / ref.norm()) < 2e-3
