"""A KVStore's recent tier: the newest encoded tokens at more bits, transcoded to the older codes as they age."""

import copy

import pytest
import torch

import tqindex as tq
from tqindex.kv.attention import compressed_attention, compressed_attention_ref
from tqindex.kv.policy import KVPolicy, LayerPolicy
from tqindex.kv.store import KVStore, RecentTier

torch.set_num_threads(1)
B, H, D = 2, 2, 32
SINKS, RESIDUAL, TIER = 2, 3, 5
CHUNKS = [9, 1, 1, 4, 1, 12, 1, 1, 2]  # a prefill, one-token steps, chunks shorter and longer than the tier


def _tokens(t: int, seed: int) -> torch.Tensor:
    return torch.randn(B, H, t, D, generator=torch.Generator().manual_seed(seed))


def _store(old: str = "tq2", recent: str = "tq4", **kwargs) -> KVStore:
    tier = RecentTier(TIER, tq.make_encoder(recent, D), tq.make_encoder(recent, D))
    return KVStore(tq.make_encoder(old, D), tq.make_encoder(old, D), RESIDUAL, sink_length=SINKS, recent=tier,
                   **kwargs)


def _round_trip(encoder: tq.Encoder, x: torch.Tensor) -> torch.Tensor:
    return encoder.decode(encoder.encode(x))


def _expected(store: KVStore, x: torch.Tensor, chunks: list[int], side: int) -> torch.Tensor:
    """Tokens x [B, H, T, D] as the store must hold them after appending ``chunks`` and settling after each:
    a token that entered the tier is decoded from the old codes of its tier codes, one that left the window with
    more than the tier's length after it went straight to the old codes."""
    old = (store.key_encoder, store.value_encoder)[side]
    recent = (store.recent.key_encoder, store.recent.value_encoder)[side]
    held = x.clone()
    total = sum(chunks)
    tier_tokens: list[int] = []
    seen = 0
    for n in chunks:
        seen += n
        window_start = max(SINKS, seen - RESIDUAL)
        leaving = [t for t in range(SINKS, window_start) if t not in tier_tokens and not _old(held, x, t)]
        direct = leaving[: max(0, len(leaving) - TIER)]
        tier_tokens += leaving[len(direct):]
        keep = max(0, len(tier_tokens) - TIER)
        moved, tier_tokens = tier_tokens[:keep], tier_tokens[keep:]
        for t in moved:
            held[:, :, t] = _round_trip(old, _round_trip(recent, x[:, :, t : t + 1]))[:, :, 0]
        for t in direct:
            held[:, :, t] = _round_trip(old, x[:, :, t : t + 1])[:, :, 0]
    for t in tier_tokens:
        held[:, :, t] = _round_trip(recent, x[:, :, t : t + 1])[:, :, 0]
    assert len(tier_tokens) == min(TIER, max(0, total - SINKS - RESIDUAL))
    return held


def _old(held: torch.Tensor, x: torch.Tensor, t: int) -> bool:
    """Whether token t was already moved to the old codes (its held value no longer the token's own)."""
    return not torch.equal(held[:, :, t], x[:, :, t])


def _fill(store: KVStore, chunks: list[int], check=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Append chunks of the given sizes as a cache layer does (``check(store, n)`` on what the step attends, then
    settle); return all keys and values appended."""
    ks, vs = [], []
    for i, n in enumerate(chunks):
        k, v = _tokens(n, 2 * i), _tokens(n, 2 * i + 1)
        store.append(k, v)
        ks.append(k)
        vs.append(v)
        if check is not None:
            check(store, n)
        store.settle()
    return torch.cat(ks, 2), torch.cat(vs, 2)


def test_tier_holds_the_newest_encoded_tokens_and_transcodes_the_older_ones():
    store = _store()
    k, v = _fill(store, CHUNKS)
    total = sum(CHUNKS)
    assert store.recent_length == TIER and store.window_length == SINKS + RESIDUAL
    assert store.keys.length == total - SINKS - RESIDUAL - TIER and store.seq_length == total
    assert store.compressed_length == total - SINKS - RESIDUAL
    # exact layouts: which tokens were transcoded, which went straight to the old codes
    torch.testing.assert_close(store.materialize_keys(), _expected(store, k, CHUNKS, 0), rtol=0, atol=1e-6)
    torch.testing.assert_close(store.materialize_values(), _expected(store, v, CHUNKS, 1), rtol=0, atol=1e-6)
    # the tier is what makes recent tokens accurate: 4-bit error on them, 2-bit on the older ones
    err = (store.materialize_keys() - k).pow(2).sum(-1) / k.pow(2).sum(-1)
    tier = slice(total - RESIDUAL - TIER, total - RESIDUAL)
    assert err[:, :, tier].mean() < 0.02 < 0.08 < err[:, :, SINKS : tier.start].mean() < 0.2
    assert err[:, :, :SINKS].max() == 0 and err[:, :, total - RESIDUAL :].max() == 0


@pytest.mark.parametrize("center", [False, True])
def test_attention_reads_the_tier_as_the_reference_does(center):
    """Every step's attention (decode steps, chunks, a prefill of 64 queries through the decoded path) over a
    store with sinks, a window, a tier and older codes, centered keys and a key scale matrix, against decoding
    everything."""
    scale = torch.linalg.qr(torch.randn(H, D, D, generator=torch.Generator().manual_seed(5)))[0] * 1.5
    store = _store("tcq2-unbiased", "tcq4-unbiased", center_keys=center, key_scale=scale)

    def check(store: KVStore, n: int) -> None:
        keys, values = store.view()
        q = torch.randn(B, 2 * H, n, D, generator=torch.Generator().manual_seed(n))
        got = compressed_attention(q, keys, values, None, D**-0.5)
        torch.testing.assert_close(got, compressed_attention_ref(q, keys, values, None, D**-0.5), rtol=1e-4, atol=1e-5)

    k, _ = _fill(store, [*CHUNKS, 64], check)
    assert store.recent_length == TIER
    decoded = store.materialize_keys()
    assert (decoded - k).abs().max() < 5  # held in the key space (offset and scale undone)
    assert torch.equal(decoded[:, :, :SINKS], k[:, :, :SINKS])


def test_crop_select_tensors_and_bytes_with_a_tier():
    store = _store()
    _fill(store, CHUNKS)
    total = store.seq_length
    full_k, full_v = store.materialize()
    again = KVStore.from_tensors(store.key_encoder, store.value_encoder, RESIDUAL, store.tensors(),
                                 sink_length=SINKS, recent=store.recent)
    assert torch.equal(again.materialize_keys(), full_k) and again.recent_length == TIER
    codes = sum(c.nbytes for c in (store.keys, store.values, store.recent_keys, store.recent_values))
    assert store.nbytes_compressed() == (codes, B * (total - SINKS - RESIDUAL))
    assert store.nbytes() == codes + 2 * B * H * (SINKS + RESIDUAL) * D * 4
    with pytest.raises(ValueError, match="tensors"):
        KVStore.from_tensors(store.key_encoder, store.value_encoder, RESIDUAL, store.tensors(), sink_length=SINKS)
    rows = torch.tensor([1, 0, 1])
    copied = copy.deepcopy(store)
    copied.select(rows)
    assert torch.equal(copied.materialize_values(), full_v[rows])
    for length in (total - 1, total - RESIDUAL - 2, total - RESIDUAL - TIER - 1, SINKS + 1, 1):  # window, tier, old
        cropped = copy.deepcopy(store)
        cropped.crop(length)
        assert cropped.seq_length == length
        assert torch.equal(cropped.materialize_keys(), full_k[:, :, :length])
    store.crop(total - RESIDUAL - 2)  # into the tier, then append again: the tier refills before moving tokens
    held = []
    for n in (RESIDUAL + 2, 1):
        store.append(_tokens(n, 99), _tokens(n, 98))
        store.settle()
        held.append((store.recent_length, store.keys.length))
    old = total - SINKS - RESIDUAL - TIER
    assert held == [(TIER, old), (TIER, old + 1)]


def test_tier_validation_and_no_static_mode():
    with pytest.raises(ValueError, match="recent length"):
        RecentTier(0, tq.make_encoder("tq4", D), tq.make_encoder("tq4", D))
    with pytest.raises(TypeError, match="value_encoder"):
        RecentTier(4, tq.make_encoder("tq4", D), "tq4")
    with pytest.raises(ValueError, match="dims"):
        KVStore(tq.make_encoder("tq2", D), tq.make_encoder("tq2", D), 0,
                recent=RecentTier(4, tq.make_encoder("tq4", D + 1), tq.make_encoder("tq4", D)))
    store = _store()
    _fill(store, CHUNKS[:2])
    with pytest.raises(ValueError, match="no static mode"):
        store.make_static()


def test_policy_with_a_tier_round_trips_and_counts_its_bytes():
    policy = KVPolicy.uniform(3, "tcq2-unbiased", "tcq2", protected_layers=1).with_recent(128, "tcq4-unbiased", "tcq4")
    assert KVPolicy.from_dict(policy.to_dict()) == policy
    assert [layer.recent_length for layer in policy.layers] == [0, 128, 0]
    assert "the newest 128 encoded by tcq4-unbiased / tcq4" in policy.describe()
    layer, plain = policy.layers[1], LayerPolicy("tcq2-unbiased", "tcq2")
    d = 64
    step = tq.make_encoder("tcq4", d).code_size - tq.make_encoder("tcq2", d).code_size
    extra = 2 * 2 * step * 128 / 2048  # 2 heads, keys and values
    assert layer.bytes_per_token(2, d, d, 2048, 2) == pytest.approx(plain.bytes_per_token(2, d, d, 2048, 2) + extra)
    for bad in ({"recent_length": 4}, {"recent_key_encoder": "tq4", "recent_value_encoder": "tq4"},
                {"recent_length": -1, "recent_key_encoder": "tq4", "recent_value_encoder": "tq4"}):
        with pytest.raises(ValueError, match="recent"):
            LayerPolicy("tq2", "tq2", **bad)
    with pytest.raises(ValueError, match="recent tier"):
        LayerPolicy(dense=True, recent_length=4)


def test_tqcache_with_a_tier_attends_as_decoding_does_and_flattens():
    """A policy's tier in a TQCache: each step's logits from the codes equal decoded K/V with sdpa on identical
    contents; the cache survives deepcopy, torch's pytree and reset."""
    pytest.importorskip("transformers")
    import transformers
    from tiny import forward, llama_config, prompt, seeded

    from tqindex.kv import TQCache
    from tqindex.kv.hf import ATTN_IMPLEMENTATION

    model = seeded(transformers.LlamaForCausalLM, llama_config())
    layers = len(transformers.DynamicCache(config=model.config).layers)
    policy = KVPolicy.uniform(layers, "tcq2-unbiased", "tcq2", residual_length=1).with_recent(4, "tcq4-unbiased",
                                                                                              "tcq4")
    cache = TQCache(model.config, policy=policy, encode_stride=1)
    tokens = prompt(length=24, seed=3)
    for t0, t1 in [(0, 9)] + [(t, t + 1) for t in range(9, 20)] + [(20, 24)]:
        logits = {}
        for impl, c in (("sdpa", copy.deepcopy(cache)), (ATTN_IMPLEMENTATION, cache)):
            model.set_attn_implementation(impl)
            with torch.no_grad():
                logits[impl] = forward(model, tokens[:, t0:t1], c).logits
        torch.testing.assert_close(logits[ATTN_IMPLEMENTATION], logits["sdpa"], rtol=1e-5, atol=1e-5)
    store = cache.layers[0].store
    assert (store.recent_length, store.keys.length) == (4, 24 - cache.sink_length - 1 - 4)
    flat, spec = torch.utils._pytree.tree_flatten(cache)
    again = torch.utils._pytree.tree_unflatten(flat, spec).layers[0].store
    assert again.recent.length == 4 and torch.equal(again.materialize_keys(), store.materialize_keys())
    cache.layers[0].reset()
    assert cache.layers[0].store.recent is store.recent and cache.layers[0].store.seq_length == 0

    # the same tier from TQCache's arguments: the same attention, token for token
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    caches = [TQCache(model.config, policy=policy, encode_stride=1),
              TQCache(model.config, "tcq2-unbiased", "tcq2", 1, 0, recent=(4, "tcq4-unbiased", "tcq4"),
                      encode_stride=1)]
    with torch.no_grad():
        logits = [forward(model, tokens[:, :9], c).logits for c in caches]
        for t in range(9, 14):
            logits = [forward(model, tokens[:, t : t + 1], c).logits for c in caches]
            assert torch.equal(logits[0], logits[1])
    assert caches[1].layers[0].store.recent_length == 4
    with pytest.raises(ValueError, match="either a policy or recent"):
        TQCache(model.config, policy=policy, recent=(4, "tq4", "tq4"))
    with pytest.raises(ValueError, match="recent length"):
        TQCache(model.config, recent=(0, "tq4", "tq4"))
    with pytest.raises(ValueError, match="recent key_encoder"):
        TQCache(model.config, recent=(4, "tq9", "tq4"))
