"""Static stores (fixed-capacity windows, lengths on the device) against growing ones, and the attention
kernel reading the lengths on the device."""

import copy
import pickle

import pytest
import torch

import tqindex as tq
from tqindex.kv.attention import compressed_attention, compressed_attention_ref
from tqindex.kv.hf import _call_key
from tqindex.kv.store import KVStore

torch.set_num_threads(1)
D = 32


def _store(residual: int = 5, sink: int = 2, stride: int = 3, scale: bool | str = True, dim: int = D,
           keys: str = "tq4", values: str = "tq3") -> KVStore:
    """A store with a key scale per channel (scale True), a scale matrix per head ("matrix") or none (False)."""
    g = torch.Generator().manual_seed(9)
    key_scale = torch.rand(2, dim, generator=g) + 0.5 if scale else None
    if scale == "matrix":
        key_scale = torch.eye(dim) + 0.1 * torch.randn(2, dim, dim, generator=g)
    return KVStore(tq.make_encoder(keys, dim), tq.make_encoder(values, dim), residual, center_keys=True,
                   key_scale=key_scale, sink_length=sink, encode_stride=stride)


def _tokens(t: int, seed: int, b: int = 2, dim: int = D) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, t, dim, generator=g), torch.randn(b, 2, t, dim, generator=g)


def _static_and_growing(prefill: int, headroom: int = 1024, scale: bool | str = True) -> tuple[KVStore, KVStore]:
    """Two stores holding the same ``prefill`` tokens, settled; the first made static."""
    static, growing = _store(scale=scale), _store(scale=scale)
    for store in (static, growing):
        store.append(*_tokens(prefill, seed=0))
        store.settle()
    static.make_static(headroom=headroom)
    return static, growing


def _same_tokens(static, growing, exact: bool = True) -> None:
    """CompressedTokens ``static`` (with lengths) hold exactly ``growing``'s tokens (not ``exact``: the window up to
    float32 rounding: keys times a scale matrix, which the static store multiplies token by token)."""
    valid = static.valid()
    assert valid.sink == growing.sink
    for (name, a), (_, b) in zip(valid.codes.planes(), growing.codes.planes()):
        assert torch.equal(a, b), name
    if exact:
        assert torch.equal(valid.window, growing.window)
    torch.testing.assert_close(valid.window, growing.window, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("prefill, scale", [(3, True), (40, True), (40, "matrix"), (40, False)])
def test_static_store_holds_what_a_growing_one_holds_at_every_step(prefill, scale):
    """One token per step after a prefill: the same codes and window tokens (keys as the codes hold them) at
    every step (the growing store settles after each step's view, the static one before the step that would
    overflow its window)."""
    static, growing = _static_and_growing(prefill, headroom=4, scale=scale)
    assert static.static and static.seq_length == growing.seq_length
    q = torch.randn(2, 4, 1, D, generator=torch.Generator().manual_seed(1))
    for step in range(30):
        k, v = _tokens(1, seed=step + 1)
        static.make_static(headroom=4)  # before each step, as DecodeGraph does: a larger buffer when full
        for store in (growing, static):
            store.append(k, v)
        held = growing.view()
        assert static.static and static.seq_length == growing.seq_length
        if step % 7 == 0:  # what a cache layer hands out between its update and the growing store's settle
            torch.testing.assert_close(static.materialize(), growing.materialize())
            assert static.nbytes() == growing.nbytes()
            for a, b in zip(static.tensors(), growing.tensors()):
                assert torch.equal(a, b)
        growing.settle()
        view = static.view()
        for a, b in zip(view, held):
            _same_tokens(a, b, exact=scale != "matrix")
        out = compressed_attention(q, *view, None, 0.2, backend="torch")
        torch.testing.assert_close(out, compressed_attention(q, *held, None, 0.2, backend="torch"))


def test_static_views_keep_their_tensors_until_the_codes_grow():
    """A static store hands out the same buffers at every step, the lengths advancing on the device (a recorded
    attention call replays over them); the code buffers grow by the headroom when full (another call)."""
    store = _store(residual=4, sink=0, stride=2, scale=False)
    store.append(*_tokens(10, seed=0))
    store.make_static(headroom=3, graphs=2)
    first = store.view()
    q = torch.randn(2, 4, 1, D)
    call = _call_key(q, *first, 0.2, None, True)
    capacity = store.keys.capacity
    for step in range(3):
        store.append(*_tokens(1, seed=step + 1))
        keys, values = store.view()
        assert keys.lengths is first[0].lengths and keys.graphs is first[0].graphs
        assert [t.window.data_ptr() for t in (keys, values)] == [t.window.data_ptr() for t in first]  # held keys too
        assert keys.codes.qdata.data_ptr() == first[0].codes.qdata.data_ptr()
        assert keys.lengths.tolist() == [store.compressed_length, store.window_length]
        assert _call_key(q, keys, values, 0.2, None, True) == call
    k, v = _tokens(1, seed=4)
    while store.compressed_length + 2 < capacity:
        store.append(k, v)
    assert store.keys.capacity == capacity
    store.append(k, v)
    store.append(k, v)
    assert store.keys.capacity > capacity and store.keys.capacity - store.compressed_length >= 3
    assert store.view()[0].lengths.tolist() == [store.compressed_length, store.window_length]
    assert _call_key(q, *store.view(), 0.2, None, True) != call
    for copied in (copy.deepcopy(store), pickle.loads(pickle.dumps(store))):  # recorded graphs are not copied
        assert copied.static and copied.view()[0].graphs.limit == 2
        torch.testing.assert_close(copied.materialize(), store.materialize())


def test_edits_and_long_appends_return_to_the_growing_mode():
    store, growing = _static_and_growing(20)
    store.make_static()  # idempotent
    chunk = _tokens(12, seed=1)  # more than the window's room
    store.append(*chunk)
    growing.append(*chunk)
    assert not store.static
    for a, b in zip(store.view(), growing.view()):
        _same_tokens(a, b)
    store.make_static()
    store.crop(15)
    growing.crop(15)
    assert not store.static and store.seq_length == 15
    torch.testing.assert_close(store.materialize(), growing.materialize())
    store.make_static()
    store.select(torch.tensor([1, 1, 0]))
    growing.select(torch.tensor([1, 1, 0]))
    assert not store.static
    torch.testing.assert_close(store.materialize(), growing.materialize())
    with pytest.raises(ValueError, match="empty"):
        _store().make_static()
    for call in (store.prepare, store.advance):
        with pytest.raises(ValueError, match="make_static first"):
            call()
    with pytest.raises(ValueError, match="headroom"):
        store.make_static(headroom=-1)


def test_attention_with_a_mask_reads_the_valid_tokens():
    store, growing = _static_and_growing(30)
    k, v = _tokens(1, seed=1)
    store.append(k, v)
    growing.append(k, v)
    mask = torch.rand(2, 1, 1, store.seq_length, generator=torch.Generator().manual_seed(2)) > 0.3
    q = torch.randn(2, 4, 1, D, generator=torch.Generator().manual_seed(3))
    want = compressed_attention_ref(q, *growing.view(), mask, 0.3)
    torch.testing.assert_close(compressed_attention(q, *store.view(), mask, 0.3), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compressed_attention_ref(q, *store.view(), mask, 0.3), want)
