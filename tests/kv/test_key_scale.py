"""Per-channel key scales: keys held divided by s, queries multiplied by s (KVStore, attention, policies,
TQCache, calibration)."""

import pytest
import torch

import tqindex as tq
from tqindex.kv import KVPolicy, KVStore, LayerPolicy, TQCache, key_scales
from tqindex.kv.attention import compressed_attention, compressed_attention_ref, dense_attention

from tiny import CACHE_KW, llama_config, prompt, seeded

D, H = 64, 2


def anisotropic(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys large where queries are small and the reverse (channel scales 8 and 1/8), values, queries."""
    g = torch.Generator().manual_seed(seed)
    profile = torch.where(torch.arange(D) < 8, 8.0, 1.0)
    keys = torch.randn(1, H, t, D, generator=g) * profile
    values = torch.randn(1, H, t, D, generator=g)
    queries = torch.randn(1, 2 * H, 1, D, generator=g) / profile
    return keys, values, queries


def filled(scale, keys, values, encoder="tq3", residual=0):
    store = KVStore(tq.make_encoder(encoder, D), tq.make_encoder(encoder, D), residual, True, scale)
    store.append(keys[:, :, :-1], values[:, :, :-1])
    store.append(keys[:, :, -1:], values[:, :, -1:])  # all but the last token leave the window
    return store


def test_scaled_keys_leave_attention_unchanged_and_keys_decode_back():
    keys, values, q = anisotropic(50, 0)
    scale = torch.rand(H, D, generator=torch.Generator().manual_seed(1)) + 0.5
    store = filled(scale, keys, values, "tq8", residual=60)  # everything in the exact window
    k_view, v_view = store.view()
    assert torch.equal(k_view.query_scale[0, :, 0], scale)
    want = dense_attention(q, keys, values, None, 0.125)
    for got in (compressed_attention(q, k_view, v_view, None, 0.125, backend="torch"),
                compressed_attention_ref(q, k_view, v_view, None, 0.125)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    store = filled(scale, keys, values, "tq8")  # now in codes: decoded keys come back unscaled
    decoded = store.materialize_keys()
    assert ((decoded - keys).norm() / keys.norm()) < 0.01


def test_scales_shrink_the_score_error_where_keys_and_queries_are_anisotropic():
    keys, values, q = anisotropic(400, 2)
    q2 = q.reshape(1, H, 2, D).square().mean(2)
    k2 = (keys - keys.mean(2, keepdim=True)).square().mean(2)[0]
    scale = (k2 / q2[0]).pow(0.25)  # sqrt(rms k / rms q), per head and channel
    errors = {}
    for name, s in (("none", None), ("scaled", scale)):
        store = filled(s, keys, values)
        k_view, _ = store.view()
        qs = q.float() if s is None else q * s.repeat_interleave(2, 0)[None, :, None]
        scores = qs.reshape(1, H, 2, D) @ k_view.materialize().mT  # the stored keys as attention reads them
        exact = q.reshape(1, H, 2, D) @ (keys - store.key_offset).mT
        errors[name] = float((scores - exact).norm() / exact.norm())
    assert errors["scaled"] < 0.5 * errors["none"], errors


def test_store_and_policy_validate_scales(tmp_path):
    enc = tq.make_encoder("tq4", D)
    for bad in (torch.ones(H, D + 1), torch.zeros(H, D), torch.full((H, D), float("inf")), [[1.0] * D]):
        with pytest.raises(ValueError, match="key_scale"):
            KVStore(enc, enc, 0, key_scale=bad)
    for bad in ([[1.0, -1.0]], [[1.0], [1.0, 2.0]], [], [[True]]):
        with pytest.raises(ValueError, match="key_scale"):
            LayerPolicy("tq4", "tq4", key_scale=bad)
    with pytest.raises(ValueError, match="dense"):
        LayerPolicy(dense=True, key_scale=[[1.0]])
    policy = KVPolicy.uniform(4, "tq4", "tq4", protected_layers=1).with_key_scales([torch.full((2, 32), 2.0)] * 4)
    assert [layer.key_scale is not None for layer in policy.layers] == [False, True, True, False]
    policy.save(tmp_path / "p.json")
    assert KVPolicy.load(tmp_path / "p.json") == policy
    assert "tq4 keys (scaled)" in policy.describe()
    with pytest.raises(ValueError, match="4 layers"):
        policy.with_key_scales([None])


def test_calibrated_scales_in_a_cache_generate_and_flatten():
    model = seeded(transformers_llama(), llama_config())
    ids = prompt(length=40)
    scales = key_scales(model, ids)
    assert len(scales) == 4 and all(s.shape == (2, 32) for s in scales)
    assert all(torch.allclose(s.log().mean(-1), torch.zeros(2), atol=1e-5) for s in scales)  # geometric mean 1
    with pytest.raises(ValueError, match="ids"):
        key_scales(model, torch.zeros(2, 3, dtype=torch.long))
    half = key_scales(model, ids, strength=0.5)
    assert all(torch.allclose(h, s.sqrt(), rtol=1e-5) for h, s in zip(half, scales))  # the power of the scales
    assert all(torch.equal(s, torch.ones(2, 32)) for s in key_scales(model, ids, strength=0))
    with pytest.raises(ValueError, match="strength"):
        key_scales(model, ids, strength=2)
    model.set_attn_implementation("tqindex")
    policy = KVPolicy.uniform(4, "tq8", "tq8", residual_length=2).with_key_scales(scales)
    out = {}
    for name, cache in (("scaled", TQCache(model.config, policy=policy)),
                        ("plain", TQCache(model.config, policy=KVPolicy.uniform(4, "tq8", "tq8", residual_length=2)))):
        out[name] = model.generate(ids[:, :12], **{CACHE_KW: cache}, max_new_tokens=8, do_sample=False)
        if name == "scaled":
            assert torch.equal(cache.layers[1].store.key_scale, scales[1])
            flat, spec = torch.utils._pytree.tree_flatten(cache)
            again = torch.utils._pytree.tree_unflatten(flat, spec)
            assert torch.equal(again.layers[1].store.key_scale, scales[1])
    assert torch.equal(out["scaled"], out["plain"])  # 8-bit codes: the same greedy tokens


def transformers_llama():
    import transformers

    return transformers.LlamaForCausalLM


def test_calibration_with_key_scales_keeps_them_in_the_policy():
    from tqindex.kv import calibrate

    model = seeded(transformers_llama(), llama_config(num_hidden_layers=3))
    ids = prompt(length=56, seed=5)
    policy = calibrate(model, ids, 3.6, bits=(2, 4), prefix=40, scored=16, allow_dense=False,
                       context_tokens=2048, scale_keys=True)
    scales = key_scales(model, ids)
    assert policy.calibration["sensitivity"]["key_scales"] == [s.tolist() for s in scales]
    assert all(layer.key_scale == tuple(map(tuple, s.tolist())) for layer, s in zip(policy.layers, scales))
    assert policy.calibration["bits"] <= 3.6
