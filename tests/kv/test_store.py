import gc
import importlib
import math
import pickle
import sys

import pytest
import torch

import tqindex as tq
from tqindex.codes import Codes
from tqindex.kv.store import (
    DENSE_BYTES_PER_ELEMENT, GROWTH, MIN_CAPACITY, CodesBuffer, KVStore, encode_tokens, encoder_from_key, encoder_key,
)  # fmt: skip

torch.set_num_threads(1)
B, H, D = 2, 3, 32


def _tokens(t: int, seed: int = 0, dim: int = D) -> torch.Tensor:
    return torch.randn(B, H, t, dim, generator=torch.Generator().manual_seed(seed))


def _store(residual: int = 4, keys: str = "tq4", values: str = "tq4") -> KVStore:
    return KVStore(tq.make_encoder(keys, D), tq.make_encoder(values, D), residual)


def _filled(store: KVStore, chunks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Append chunks of the given sizes; return all keys and values appended."""
    ks, vs = [], []
    for i, t in enumerate(chunks):
        k, v = _tokens(t, 2 * i), _tokens(t, 2 * i + 1)
        store.append(k, v)
        ks.append(k)
        vs.append(v)
    return torch.cat(ks, 2), torch.cat(vs, 2)


def _decoded_then_window(encoder: tq.Encoder, x: torch.Tensor, tc: int) -> torch.Tensor:
    """The first ``tc`` tokens of x encoded and decoded, the others as given."""
    return torch.cat([encoder.decode(encoder.encode(x[:, :, :tc])), x[:, :, tc:]], 2)


def _expected(store: KVStore, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of the oldest tokens decoded, the window as given."""
    tc = store.compressed_length
    return _decoded_then_window(store.key_encoder, k, tc), _decoded_then_window(store.value_encoder, v, tc)


def test_window_keeps_residual_plus_current_chunk():
    store = _store(residual=4)
    store.append(_tokens(10), _tokens(10, 1))
    assert (store.compressed_length, store.window_length) == (0, 10)  # prefill stays full precision
    store.append(_tokens(1, 2), _tokens(1, 3))
    assert (store.compressed_length, store.window_length) == (6, 5)
    store.append(_tokens(3, 4), _tokens(3, 5))
    assert (store.compressed_length, store.window_length) == (7, 7)
    assert store.seq_length == 14


@pytest.mark.parametrize("keys,values", [("tq4", "tq4"), ("tq8", "tq2"), ("fp4", "tq3-prod")])
def test_materialize_is_decoded_codes_then_window(keys, values):
    store = _store(residual=3, keys=keys, values=values)
    k, v = _filled(store, [7, 1, 1, 5, 1, 2])
    mk, mv = store.materialize()
    ek, ev = _expected(store, k, v)
    torch.testing.assert_close(mk, ek)
    torch.testing.assert_close(mv, ev)
    ck, cv = store.view()
    assert ck.shape == cv.shape == (B, H, k.shape[2], D)


def test_settle_encodes_beyond_the_window_and_keeps_earlier_views():
    store = _store(residual=3)
    k, v = _filled(store, [6, 10])
    keys, values = store.view()  # what the step's attention reads: the whole chunk in full precision
    assert (keys.codes.shape[2], keys.window.shape[2]) == (3, 13)
    store.settle()
    assert (store.compressed_length, store.window_length) == (13, 3)
    assert (keys.codes.shape[2], keys.window.shape[2]) == (3, 13)  # the view taken before is unchanged
    torch.testing.assert_close(keys.materialize(torch.float32), _decoded_then_window(store.key_encoder, k, 3))
    mk, mv = store.materialize()
    ek, ev = _expected(store, k, v)
    torch.testing.assert_close(mk, ek)
    torch.testing.assert_close(mv, ev)
    store.settle()  # nothing beyond the window: a no-op
    assert (store.compressed_length, store.window_length) == (13, 3)
    lazy = _store(residual=3)  # the next append encodes the same tokens whether settled or not
    _filled(lazy, [6, 10, 2])
    store.append(_tokens(2, 4), _tokens(2, 5))
    assert torch.equal(store.keys.view().qdata, lazy.keys.view().qdata)
    assert torch.equal(store.view()[0].window, lazy.view()[0].window)


@pytest.mark.parametrize("stride", [2, 5])
def test_encode_stride_encodes_several_tokens_at_once_with_the_same_codes(stride):
    """With ``encode_stride`` n, one-token steps leave residual_length to residual_length + n - 1 tokens in the
    window and encode n tokens every n steps; every token is encoded as a stride-1 store encodes it."""
    one = KVStore(tq.make_encoder("tq4", D), tq.make_encoder("tq3", D), 3)
    store = KVStore(one.key_encoder, one.value_encoder, 3, encode_stride=stride)
    k, v = _tokens(6, 0), _tokens(6, 1)
    encodes = 0
    for s in (one, store):
        s.append(k, v)
        s.settle()
    for t in range(4 * stride):
        before = store.compressed_length
        for s in (one, store):
            s.append(_tokens(1, 10 + t), _tokens(1, 50 + t))
            s.settle()
        assert 3 <= store.window_length <= 3 + stride - 1
        encodes += store.compressed_length != before
        tc = store.compressed_length
        assert torch.equal(store.keys.view().qdata, one.keys.view().qdata[:, :, :tc])
        assert torch.equal(store.values.view().norm, one.values.view().norm[:, :, :tc])
        assert torch.equal(store.view()[0].window[:, :, one.compressed_length - tc:], one.view()[0].window)
    assert encodes == 4
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="encode_stride"):
            KVStore(one.key_encoder, one.value_encoder, 3, encode_stride=bad)


def test_amortized_appends_grow_capacity_by_steps_then_geometrically():
    store = _store(residual=0)
    steps = 900
    for t in range(steps):
        store.append(_tokens(1, t), _tokens(1, t))
    assert store.compressed_length == steps - 1
    assert (store.keys.capacity, store.keys.reallocations) == (1024, 4)  # 256, 512, 768, 1024 tokens
    assert store.values.reallocations == store.keys.reallocations
    codes = Codes(qdata=torch.zeros(1, 1, 0, 2, dtype=torch.uint8), norm=torch.zeros(1, 1, 0))
    buf = CodesBuffer(codes)
    for t in range(0, 100_000, 250):  # past 32 * MIN_CAPACITY tokens a buffer grows by a 32nd of itself
        buf.append(codes.empty_like(1, 1, 250))
        assert buf.length < buf.capacity <= max(GROWTH * buf.length, buf.length + MIN_CAPACITY) + 1
    assert buf.reallocations == 32 + math.ceil(math.log(100_000 / (32 * MIN_CAPACITY)) / math.log(GROWTH))


def test_codes_buffer_keeps_contents_across_growth():
    enc = tq.make_encoder("tq4", D)
    x = _tokens(700)
    codes = enc.encode(x)
    buf = CodesBuffer(codes.empty_like(B, H, 0))
    for t0 in range(0, 700, 7):
        buf.append(codes[:, :, t0 : t0 + 7])
        assert buf.length < buf.capacity  # a spare token: the valid view never spans the whole buffer
    assert (buf.length, buf.reallocations, buf.capacity) == (700, 3, 768)  # 256 tokens a step while short
    assert torch.equal(buf.view().qdata, codes.qdata) and torch.equal(buf.view().norm, codes.norm)
    wrapped = CodesBuffer(codes, 700)  # a full buffer of given codes
    assert wrapped.capacity == wrapped.length == 700
    wrapped.append(codes[:, :, :1])
    assert wrapped.capacity == 700 + MIN_CAPACITY and torch.equal(wrapped.view()[:, :, :700].qdata, codes.qdata)
    with pytest.raises(ValueError, match="length"):
        CodesBuffer(codes, 701)


def test_crop_into_window_and_into_codes():
    store = _store(residual=4)
    k, v = _filled(store, [9, 1, 1, 1])  # 7 compressed + 5 window (4 residual + 1 current)
    ek, ev = _expected(store, k, v)
    store.crop(10)
    assert (store.compressed_length, store.window_length) == (7, 3)
    torch.testing.assert_close(store.materialize()[0], ek[:, :, :10])
    store.crop(5)
    assert (store.compressed_length, store.window_length) == (5, 0)
    torch.testing.assert_close(store.materialize()[1], ev[:, :, :5])
    store.crop(100)
    assert store.seq_length == 5
    k2, v2 = _tokens(2, 50), _tokens(2, 51)
    store.append(k2, v2)  # appends continue after the cropped tokens
    assert store.seq_length == 7
    torch.testing.assert_close(store.materialize()[0][:, :, 5:], k2)


def test_reorder_and_repeat_interleave_batch_rows():
    store = _store(residual=2)
    _filled(store, [6, 1, 1])
    mk, mv = store.materialize()
    bytes_before = store.nbytes()
    store.select(torch.tensor([1, 1]))
    k1, v1 = store.materialize()
    torch.testing.assert_close(k1, mk[[1, 1]])
    torch.testing.assert_close(v1, mv[[1, 1]])
    assert store.nbytes() == bytes_before
    store = _store(residual=2)
    _filled(store, [6, 1, 1])
    store.repeat_interleave(3)
    k3, _ = store.materialize()
    torch.testing.assert_close(k3, mk.repeat_interleave(3, dim=0))
    store.select(torch.tensor([True, False, False, False, False, True]))
    torch.testing.assert_close(store.materialize()[0], mk)


def test_nbytes_counts_used_codes_and_window():
    store = _store(residual=4, keys="tq8", values="tq4")
    _filled(store, [20, 1])
    kenc, venc = store.key_encoder, store.value_encoder
    tc, w = store.compressed_length, store.window_length
    window = 2 * B * H * w * D * 4  # float32 keys and values
    assert store.nbytes() == B * H * tc * (kenc.code_size + venc.code_size) + window
    assert store.nbytes_compressed() == (B * H * tc * (kenc.code_size + venc.code_size), B * tc)
    assert store.nbytes_dense() == DENSE_BYTES_PER_ELEMENT * B * H * (tc + w) * 2 * D
    assert store.keys.capacity >= tc  # unused capacity is not counted


def test_empty_store_and_validation():
    store = _store()
    assert store.seq_length == 0 and store.nbytes() == 0 and store.nbytes_dense() == 0
    assert store.nbytes_compressed() == (0, 0)
    store.crop(3)
    store.select(torch.tensor([0]))
    with pytest.raises(ValueError, match="empty"):
        store.view()
    with pytest.raises(ValueError, match="residual_length"):
        KVStore(tq.make_encoder("tq4", D), tq.make_encoder("tq4", D), -1)
    with pytest.raises(TypeError, match="key_encoder"):
        KVStore("tq4", tq.make_encoder("tq4", D), 4)
    with pytest.raises(ValueError, match=r"key must have shape \[B, H, T, 32\]"):
        store.append(_tokens(2, dim=16), _tokens(2))
    with pytest.raises(TypeError, match="value must be a floating-point"):
        store.append(_tokens(2), torch.zeros(B, H, 2, D, dtype=torch.long))
    store.append(_tokens(2), _tokens(2))
    with pytest.raises(ValueError, match=r"\[B, H\]"):
        store.append(torch.randn(1, H, 1, D), torch.randn(1, H, 1, D))
    with pytest.raises(ValueError, match="length"):
        store.crop(-1)


def test_kv_package_imports_without_transformers(monkeypatch):
    import tqindex

    monkeypatch.setattr(tqindex, "kv", tqindex.kv)  # restored after the fresh import below
    for name in ("tqindex.kv", "tqindex.kv.hf"):  # store and attention stay: they never import transformers
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)  # importing transformers now fails
    kv = importlib.import_module("tqindex.kv")
    assert kv.KVStore.__module__ == "tqindex.kv.store"
    with pytest.raises(ImportError):
        kv.TQCache


@pytest.mark.parametrize("name", ["tq4", "tq8", "fp4", "tq3-prod"])
def test_encode_tokens_is_encode_without_checks(name):
    enc = tq.make_encoder(name, D)
    x = _tokens(5).to(torch.bfloat16)
    got, expected = encode_tokens(enc, x), enc.encode(x)
    assert got.shape == (B, H, 5)
    assert [n for n, _ in got.planes()] == [n for n, _ in expected.planes()]
    assert all(torch.equal(t, getattr(expected, n)) for n, t in got.planes())
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    encode_tokens(enc, bad)  # no check of the values: nothing waits for them


def test_append_compiles_into_one_graph():
    """The encode operator is opaque to torch.compile: an append (window overflow encoded, buffers grown)
    traces in one graph, without reading the data on the host, and stores what eager code stores."""
    eager, compiled = _store(residual=2), _store(residual=2)
    for s in (eager, compiled):
        s.append(_tokens(5), _tokens(5, 1))
    step = torch.compile(lambda k, v: compiled.append(k, v), fullgraph=True, backend="eager")
    for t in range(3):
        eager.append(_tokens(1, 10 + t), _tokens(1, 20 + t))
        step(_tokens(1, 10 + t), _tokens(1, 20 + t))
    assert compiled.compressed_length == eager.compressed_length == 5
    for a, b in zip(compiled.tensors(), eager.tensors()):
        assert torch.equal(a, b)


def test_tensors_round_trip_and_device_moves():
    store = _store(residual=3, keys="tq8", values="fp4")
    _filled(store, [7, 1, 1])
    tensors = store.tensors()
    assert len(tensors) == 2 + 2 + 2  # qdata + norm, qdata + scale, two windows
    copy = KVStore.from_tensors(store.key_encoder, store.value_encoder, 3, tensors)
    assert (copy.compressed_length, copy.window_length) == (store.compressed_length, store.window_length)
    for a, b in zip(copy.materialize(), store.materialize()):
        assert torch.equal(a, b)
    copy.append(_tokens(1, 9), _tokens(1, 9))  # a full buffer of given codes grows on the next append
    assert copy.seq_length == store.seq_length + 1
    assert KVStore.from_tensors(store.key_encoder, store.value_encoder, 3, []).seq_length == 0
    with pytest.raises(ValueError, match="expected 6 tensors"):
        KVStore.from_tensors(store.key_encoder, store.value_encoder, 3, tensors[:-1])
    shapes = [t.shape for t in tensors]
    store.to("meta")  # codes and windows move as they are: nothing decoded
    assert [t.shape for t in store.tensors()] == shapes and store.device.type == "meta"


def test_pickled_store_and_encoder_keys():
    store = _store(residual=2, keys="tq8")
    _filled(store, [6, 1])
    clone = pickle.loads(pickle.dumps(store))
    assert all(torch.equal(a, b) for a, b in zip(clone.tensors(), store.tensors()))
    clone.append(_tokens(1, 7), _tokens(1, 8))
    assert clone.compressed_length == store.compressed_length + 1
    key = encoder_key(store.key_encoder)
    assert encoder_key(tq.make_encoder("tq8", D)) == key  # same configuration and tensors, same key
    assert encoder_key(encoder_from_key(key)) == key  # a live encoder of that key (any: they are interchangeable)
    other = tq.make_encoder("tq8", D, seed=3)
    other_key = encoder_key(other)
    del other
    gc.collect()
    rebuilt = encoder_from_key(other_key)  # no live encoder: rebuilt from its configuration
    assert rebuilt.seed == 3 and encoder_key(rebuilt) == other_key
    with pytest.raises(ValueError, match="no live encoder"):
        encoder_from_key(key.replace('"seed": 0', '"seed": 4'))  # the digest names other tensors
