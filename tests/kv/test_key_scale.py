"""Key scales: per channel (keys held divided by s, queries multiplied by s) or per head a matrix M (keys held
times M⁻¹, queries times Mᵀ) in KVStore, attention, policies, TQCache and calibration."""

import pytest
import torch

import tqindex as tq
from tqindex.kv import KVPolicy, KVStore, LayerPolicy, TQCache, key_scales
from tqindex.kv.attention import compressed_attention, compressed_attention_ref, dense_attention
from tqindex.kv.calibrate import _rope_turns, _scale, _turned

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


def random_scale(kind: str, seed: int) -> torch.Tensor:
    """A per-channel scale [H, D] or an invertible matrix per head [H, D, D] (rotation times channel scales)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(H, D, generator=g) + 0.5
    if kind == "channels":
        return scale
    rotation = torch.linalg.qr(torch.randn(H, D, D, generator=g))[0]
    return rotation * scale[:, None, :]


@pytest.mark.parametrize("kind", ["channels", "matrices"])
def test_scaled_keys_leave_attention_unchanged_and_keys_decode_back(kind):
    keys, values, q = anisotropic(50, 0)
    scale = random_scale(kind, 1)
    store = filled(scale, keys, values, "tq8", residual=60)  # everything in the exact window
    k_view, v_view = store.view()
    if kind == "channels":
        assert torch.equal(k_view.query_scale[0, :, 0], scale)
    else:
        assert torch.equal(k_view.query_scale, scale.mT)
    want = dense_attention(q, keys, values, None, 0.125)
    for got in (compressed_attention(q, k_view, v_view, None, 0.125, backend="torch"),
                compressed_attention_ref(q, k_view, v_view, None, 0.125)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    store = filled(scale, keys, values, "tq8")  # now in codes: decoded keys come back unscaled
    decoded = store.materialize_keys()
    assert ((decoded - keys).norm() / keys.norm()) < 0.01
    k_view, v_view = store.view()
    exact = dense_attention(q, store.materialize_keys(torch.float32), store.materialize_values(torch.float32),
                            None, 0.125)
    for got in (compressed_attention(q, k_view, v_view, None, 0.125, backend="torch"),
                compressed_attention_ref(q, k_view, v_view, None, 0.125)):
        torch.testing.assert_close(got, exact, rtol=1e-3, atol=1e-4)  # attention reads the codes as decoded


def score_errors(keys, q, scales):
    """Relative error of the scores of q's two query heads per KV head over the keys as a tq3 store holds them."""
    errors = {}
    for name, s in scales.items():
        store = filled(s, keys, torch.zeros_like(keys))
        k_view, _ = store.view()
        qs = q.float() if s is None else tq.kv.attention._scaled_queries(q, k_view)
        scores = qs.reshape(1, H, 2, D) @ k_view.materialize().mT  # the stored keys as attention reads them
        exact = q.reshape(1, H, 2, D) @ (keys - store.key_offset).mT
        errors[name] = float((scores - exact).norm() / exact.norm())
    return errors


def moments(keys, q):
    """(queries' second moments, centered keys' covariance) per KV head, float64 [H, D, D]."""
    qh = q.double().reshape(H, -1, D)
    k = (keys - keys.mean(2, keepdim=True))[0].double()
    return qh.mT @ qh / qh.shape[1], k.mT @ k / k.shape[2]


def test_scales_shrink_the_score_error_where_keys_and_queries_are_anisotropic():
    keys, values, q = anisotropic(400, 2)
    q2 = q.reshape(1, H, 2, D).square().mean(2)
    k2 = (keys - keys.mean(2, keepdim=True)).square().mean(2)[0]
    scale = (k2 / q2[0]).pow(0.25)  # sqrt(rms k / rms q), per head and channel
    assert torch.allclose(_scale(*moments(keys, q), 1.0, True), scale / scale.log().mean(-1, keepdim=True).exp())
    errors = score_errors(keys, q, {"none": None, "scaled": scale})
    assert errors["scaled"] < 0.5 * errors["none"], errors


def test_matrices_shrink_the_score_error_where_the_anisotropy_is_not_along_channels():
    keys, values, q = anisotropic(400, 3)
    rotation = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(4)))[0]
    keys, q = keys @ rotation, q @ rotation  # scores unchanged, large key directions no longer channels
    a, c = moments(keys, q)
    scales = {"none": None, "channels": _scale(a, c, 1.0, True), "matrices": _scale(a, c, 1.0, False),
              "half": _scale(a, c, 0.5, False)}
    assert torch.allclose(torch.linalg.det(scales["matrices"].double()), torch.ones(H, dtype=torch.float64))
    torch.testing.assert_close(scales["half"] @ scales["half"], scales["matrices"], rtol=1e-3, atol=1e-4)
    errors = score_errors(keys, q, scales)
    assert errors["matrices"] < 0.5 * errors["none"] and errors["matrices"] < 0.6 * errors["channels"], errors
    assert errors["half"] < errors["none"], errors


def test_matrices_of_diagonal_moments_are_the_channel_scales():
    g = torch.Generator().manual_seed(5)
    a, c = (torch.diag_embed(torch.rand(H, D, generator=g, dtype=torch.float64) + 0.1) for _ in range(2))
    matrices, channels = _scale(a, c, 1.0, False), _scale(a, c, 1.0, True)
    torch.testing.assert_close(matrices, torch.diag_embed(channels), rtol=2e-3, atol=1e-6)  # up to the ridge


def test_store_and_policy_validate_scales(tmp_path):
    enc = tq.make_encoder("tq4", D)
    singular = torch.eye(D).repeat(H, 1, 1)
    singular[:, 0] = 0
    for bad in (torch.ones(H, D + 1), torch.zeros(H, D), torch.full((H, D), float("inf")), [[1.0] * D],
                torch.ones(H, D, D + 1), singular, torch.full((H, D, D), float("nan")), torch.ones(H, 2, D, D)):
        with pytest.raises(ValueError, match="key_scale"):
            KVStore(enc, enc, 0, key_scale=bad)
    for bad in ([[1.0, -1.0]], [[1.0], [1.0, 2.0]], [], [[True]], [[[1.0, 0.0]]], [[[1.0], [2.0, 3.0]]],
                [[[[1.0]]]], [[1.0], [[1.0]]]):
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
    matrices = KVPolicy.uniform(2, "tq4", "tq4").with_key_scales([random_scale("matrices", 6)] * 2)
    assert len(matrices.layers[0].key_scale[0]) == D and len(matrices.layers[0].key_scale[0][0]) == D
    matrices.save(tmp_path / "m.json")
    assert KVPolicy.load(tmp_path / "m.json") == matrices


def test_calibrated_scales_in_a_cache_generate_and_flatten():
    model = seeded(transformers_llama(), llama_config())
    ids = prompt(length=40)
    scales = key_scales(model, ids, strength=1.0)  # a matrix per KV head, determinant 1
    assert len(scales) == 4 and all(s.shape == (2, 32, 32) for s in scales)
    assert all(torch.allclose(torch.linalg.det(s.double()), torch.ones(2, dtype=torch.float64), atol=1e-4)
               for s in scales)
    half = key_scales(model, ids, strength=0.5)
    assert all(torch.allclose(h @ h, s, rtol=1e-3, atol=1e-4) for h, s in zip(half, scales))  # the power
    assert all(torch.equal(h, d) for h, d in zip(half, key_scales(model, ids)))  # the default strength
    assert all(torch.allclose(s, torch.eye(32).expand(2, 32, 32)) for s in key_scales(model, ids, strength=0))
    channels = key_scales(model, ids, per_channel=True)
    assert len(channels) == 4 and all(s.shape == (2, 32) for s in channels)
    assert all(torch.allclose(s.log().mean(-1), torch.zeros(2), atol=1e-5) for s in channels)  # geometric mean 1
    half = key_scales(model, ids, strength=0.5, per_channel=True)
    assert all(torch.allclose(h, s.sqrt(), rtol=1e-5) for h, s in zip(half, channels))  # the power of the scales
    assert all(torch.equal(s, torch.ones(2, 32)) for s in key_scales(model, ids, strength=0, per_channel=True))
    with pytest.raises(ValueError, match="ids"):
        key_scales(model, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="strength"):
        key_scales(model, ids, strength=2)
    model.set_attn_implementation("tqindex")
    plain = KVPolicy.uniform(4, "tq8", "tq8", residual_length=2)
    out = {}
    for name, cache in (("plain", TQCache(model.config, policy=plain)),
                        ("channels", TQCache(model.config, policy=plain.with_key_scales(channels))),
                        ("matrices", TQCache(model.config, policy=plain.with_key_scales(scales)))):
        out[name] = model.generate(ids[:, :12], **{CACHE_KW: cache}, max_new_tokens=8, do_sample=False)
        if name != "plain":
            want = (channels if name == "channels" else scales)[1]
            assert torch.equal(cache.layers[1].store.key_scale, want)
            flat, spec = torch.utils._pytree.tree_flatten(cache)
            again = torch.utils._pytree.tree_unflatten(flat, spec)
            assert torch.equal(again.layers[1].store.key_scale, want)
        assert torch.equal(out[name], out["plain"])  # 8-bit codes: the same greedy tokens


def transformers_llama():
    import transformers

    return transformers.LlamaForCausalLM


def test_calibration_with_key_scales_keeps_them_in_the_policy():
    from tqindex.kv import calibrate

    model = seeded(transformers_llama(), llama_config(num_hidden_layers=3))
    ids = prompt(length=56, seed=5)
    policy = calibrate(model, ids, 3.6, bits=(2, 4), prefix=40, scored=16, allow_dense=False,
                       context_tokens=2048, scale_keys=True)
    scales = key_scales(model, ids, context_tokens=2048)  # positions spread over the policy's context
    assert policy.calibration["sensitivity"]["key_scales"] == [s.tolist() for s in scales]
    assert all(torch.equal(torch.tensor(layer.key_scale), s) for layer, s in zip(policy.layers, scales))
    assert policy.calibration["bits"] <= 3.6


def test_keys_and_queries_are_turned_to_positions_over_the_context():
    model = seeded(transformers_llama(), llama_config())
    t, d = 10, 32
    turns = _rope_turns(model, t, 4096, torch.device("cpu"))
    assert len(turns) == 9 and all(c.shape == (t, d) for c, _ in turns)
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(4, t, d, generator=g, dtype=torch.float64), torch.randn(2, t, d, generator=g, dtype=torch.float64)
    turned = list(_turned(q, k, turns))
    assert len(turned) == 8
    for tq_, tk in turned:  # rotations: every token keeps its norm, each query-key product moves
        torch.testing.assert_close(tq_.norm(dim=-1), q.norm(dim=-1))
        torch.testing.assert_close(tk.norm(dim=-1), k.norm(dim=-1))
    back = next(_turned(q, k, [turns[0], turns[0]]))  # to the positions they came from: unchanged
    torch.testing.assert_close(back[0], q)
    torch.testing.assert_close(back[1], k)
    positions = torch.arange(t)
    cos, sin = model.model.rotary_emb(torch.zeros(1), positions[None])
    same = next(_turned(q, k, [turns[0], (cos[0].double(), sin[0].double())]))
    torch.testing.assert_close(same[1], k)  # the module's own angles at the calibration positions
    assert next(_turned(q, k, []))[1] is k and next(_turned(q[..., :8], k[..., :8], turns))[1].shape[-1] == 8
