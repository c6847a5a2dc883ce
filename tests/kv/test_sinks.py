"""Sink tokens: the first tokens of a sequence are never encoded (KVStore, attention, TQCache)."""

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

import tqindex as tq
from tqindex.kv import KVStore, TQCache
from tqindex.kv.attention import compressed_attention, compressed_attention_ref
from tqindex.kv.hf import ATTN_IMPLEMENTATION

from tiny import CACHE_KW, llama_config, prompt, seeded

D, H = 32, 2
CHUNKS = (3, 1, 5, 1, 1, 9, 1, 2, 1, 1)  # 25 tokens: chunks smaller and larger than the sinks and the window


@pytest.fixture(scope="module")
def llama():
    return seeded(LlamaForCausalLM, llama_config())


def tokens(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, H, t, D, generator=g), torch.randn(2, H, t, D, generator=g)


def filled(sink: int, residual: int, k: torch.Tensor, v: torch.Tensor) -> KVStore:
    store = KVStore(tq.make_encoder("tq4", D), tq.make_encoder("tq4", D), residual, sink_length=sink)
    t = 0
    for n in CHUNKS:
        store.append(k[:, :, t : t + n], v[:, :, t : t + n])
        t += n
    return store


@pytest.mark.parametrize("residual", [0, 3])
def test_the_first_tokens_stay_exact_and_the_rest_is_encoded_as_without_sinks(residual):
    k, v = tokens(sum(CHUNKS))
    plain, store = filled(0, residual, k, v), filled(4, residual, k, v)
    assert store.sink_held == 4 and store.seq_length == 25
    window = residual + CHUNKS[-1]
    assert store.compressed_length == 25 - 4 - window
    keys, values = store.materialize()
    assert torch.equal(keys[:, :, :4], k[:, :, :4]) and torch.equal(values[:, :, :4], v[:, :, :4])
    assert torch.equal(keys[:, :, -window:], k[:, :, -window:])
    # tokens are encoded one by one: the codes between sinks and window are the sink-free store's
    torch.testing.assert_close(keys[:, :, 4:-window], plain.materialize_keys()[:, :, 4:-window], rtol=0, atol=0)
    assert ((keys - k).norm() / k.norm()) < 0.15
    assert store.nbytes() > plain.nbytes()  # the sinks are held in full precision


@pytest.mark.parametrize("length", [2, 4, 9, 24, 30])  # in the sinks, the codes, the window; past the end
def test_crop_keeps_the_first_tokens_in_order(length):
    k, v = tokens(sum(CHUNKS), 1)
    store = filled(4, 0, k, v)
    before = store.materialize()
    store.crop(length)
    kept = min(length, 25)
    assert store.seq_length == kept and store.sink_held == min(4, kept)
    for got, want in zip(store.materialize(), before):
        assert torch.equal(got, want[:, :, :kept])
    store.append(k[:, :, :2], v[:, :, :2])  # appending goes on after a crop
    assert store.seq_length == kept + 2 and torch.equal(store.materialize_keys()[:, :, -2:], k[:, :, :2])


def test_attention_reads_the_tokens_in_the_sequence_order():
    """The blockwise attention reads the tokens as stored (codes, then sinks and window) and reorders the
    mask; the reference decodes them in the sequence's order: same result, with and without a mask."""
    k, v = tokens(sum(CHUNKS), 2)
    store = filled(4, 2, k, v)
    keys, values = store.view()
    assert keys.sink == 4 and keys.codes.shape[2] > 0
    g = torch.Generator().manual_seed(3)
    total = store.seq_length
    for nq in (1, 3):
        q = torch.randn(2, 2 * H, nq, D, generator=g)
        mask = torch.ones(2, 1, nq, total, dtype=torch.bool).tril(total - nq)
        mask[0, ..., 1:3] = False  # in the sinks
        mask[1, ..., 6:9] = False  # in the codes
        for m in (None, mask):
            ref = compressed_attention_ref(q, keys, values, m, D ** -0.5)
            got = compressed_attention(q, keys, values, m, D ** -0.5, backend="torch")
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="causal queries"):  # more causal queries than the window's newest tokens
        compressed_attention(torch.randn(2, 2 * H, 5, D), keys, values, None, D ** -0.5, backend="torch")


def test_bad_sink_length():
    enc = tq.make_encoder("tq4", D)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="sink_length"):
            KVStore(enc, enc, 0, sink_length=bad)
        with pytest.raises((TypeError, ValueError), match="sink_length"):
            TQCache(None, sink_length=bad)


@pytest.mark.parametrize("residual,stride", [(0, 1), (3, 1), (3, 4)])
def test_cache_with_sinks_attends_from_codes_as_decoded_sdpa(llama, residual, stride):
    """Logits of the "tqindex" attention (codes, stored order) equal decoded keys/values with sdpa (sequence
    order) on identical cache contents, through a prefill, decode steps and chunks, for a left-padded batch;
    the window keeps its sinks and residual_length to residual_length + encode_stride - 1 tokens."""
    ids = prompt(batch=2, length=30, seed=2)
    ids[0, :3] = 0
    mask = (ids != 0).long()
    cache = TQCache(llama.config, "tq4", "tq3", residual_length=residual, protected_layers=0, sink_length=4,
                    encode_stride=stride)
    for t0, t1 in [(0, 8)] + [(t, t + 1) for t in range(8, 20)] + [(20, 24), (24, 25), (25, 30)]:
        logits = {}
        for impl, c in (("sdpa", copy.deepcopy(cache)), (ATTN_IMPLEMENTATION, cache)):
            llama.set_attn_implementation(impl)
            with torch.no_grad():
                logits[impl] = llama(input_ids=ids[:, t0:t1], attention_mask=mask[:, :t1], use_cache=True,
                                     **{CACHE_KW: c}).logits
        torch.testing.assert_close(logits[ATTN_IMPLEMENTATION], logits["sdpa"], rtol=1e-5, atol=1e-5)
    store = cache.layers[0].store
    assert store.sink_held == 4 and residual <= store.window_length - 4 < residual + stride
    assert store.compressed_length + store.window_length == 30
    flat, spec = torch.utils._pytree.tree_flatten(cache)
    again = torch.utils._pytree.tree_unflatten(flat, spec)
    assert (again.layers[0].store.sink_length, again.layers[0].store.encode_stride) == (4, stride)
    assert torch.equal(again.layers[0].store.materialize_keys(), store.materialize_keys())
    cache.layers[0].reset()
    assert (cache.layers[0].store.sink_length, cache.layers[0].store.encode_stride) == (4, stride)
