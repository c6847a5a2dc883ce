"""Centered keys (KVStore), per-layer policies (KVPolicy, choose, TQCache(policy=...)) and calibration."""

import importlib
import itertools
import json

import pytest
import torch
import transformers

import tqindex as tq
from tqindex.kv import (KVPolicy, KVStore, LayerPolicy, TQCache, calibrate, measure_sensitivity, policy_for_budget,
                        sensitivity_template)
from tqindex.kv.attention import compressed_attention, dense_attention
from tqindex.kv.hf import TQLayer
from tqindex.kv.policy import ENCODE_STRIDE, choose

from tiny import CACHE_KW, llama_config, prompt, seeded


def shifted_keys(b=2, h=3, t=70, d=64, shift=4.0, seed=0):
    """Keys with a large common component per head, as language models' keys have: [B, H, T, D]."""
    g = torch.Generator().manual_seed(seed)
    common = shift * torch.randn(b, h, 1, d, generator=g)
    return common + torch.randn(b, h, t, d, generator=g)


# -- centered keys -------------------------------------------------------------------------------
def test_centering_leaves_attention_unchanged_and_the_window_exact():
    keys, values = shifted_keys(), torch.randn(2, 3, 70, 64, generator=torch.Generator().manual_seed(1))
    enc = tq.make_encoder("tq8", 64)
    store = KVStore(enc, enc, residual_length=5, center_keys=True)
    store.append(keys[:, :, :40], values[:, :, :40])  # the offset: the mean of these 40 keys
    for i in range(40, 70):  # decode steps
        store.append(keys[:, :, i:i + 1], values[:, :, i:i + 1])
    assert torch.allclose(store.key_offset, keys[:, :, :40].mean(2, keepdim=True))
    k_all, v_all = store.materialize()
    w = store.window_length
    assert torch.equal(k_all[:, :, -w:], keys[:, :, -w:])  # the window keeps the keys as given
    q = torch.randn(2, 6, 1, 64, generator=torch.Generator().manual_seed(2))
    k_view, v_view = store.view()
    got = compressed_attention(q, k_view, v_view, None, 0.125, backend="torch")
    want = dense_attention(q, k_all, v_all, None, 0.125)  # un-centered keys: the same attention
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_centering_shrinks_the_key_error_of_shifted_keys():
    keys = shifted_keys(t=200)
    enc = tq.make_encoder("tq3", 64)
    errors = {}
    for center in (False, True):
        store = KVStore(enc, enc, residual_length=0, center_keys=center)
        store.append(keys, keys)
        store.append(keys[:, :, :1], keys[:, :, :1])  # moves the 200 tokens into codes
        decoded = store.materialize_keys()[:, :, :200]
        errors[center] = float(((decoded - keys) ** 2).sum() / (keys ** 2).sum())
    assert errors[True] < 0.25 * errors[False]


def test_centered_store_round_trips_through_its_tensors():
    keys = shifted_keys(t=30)
    enc = tq.make_encoder("tq4", 64)
    store = KVStore(enc, enc, residual_length=4, center_keys=True)
    store.append(keys[:, :, :20], keys[:, :, :20])
    store.append(keys[:, :, 20:], keys[:, :, 20:])
    tensors = store.tensors()
    copy = KVStore.from_tensors(enc, enc, 4, tensors, center_keys=True)
    assert torch.equal(copy.key_offset, store.key_offset)
    assert all(torch.equal(a, b) for a, b in zip(copy.materialize(), store.materialize()))
    assert store.nbytes() == sum(t.numel() * t.element_size() for t in tensors)
    with pytest.raises(ValueError, match="expected 6 tensors"):  # the offset, where none is expected
        KVStore.from_tensors(enc, enc, 4, tensors, center_keys=False)


# -- choose ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_choose_is_the_exact_optimum(seed):
    g = torch.Generator().manual_seed(seed)
    costs = (torch.rand(4, 3, generator=g) * 10).round(decimals=2).tolist()
    losses = torch.rand(4, 3, generator=g).tolist()
    budget = sum(min(c) for c in costs) + 6.0
    best = min((sum(losses[i][j] for i, j in enumerate(pick)), pick)
               for pick in itertools.product(range(3), repeat=4)
               if sum(costs[i][j] for i, j in enumerate(pick)) <= budget)
    pick = choose(costs, losses, budget)
    assert sum(costs[i][j] for i, j in enumerate(pick)) <= budget
    assert sum(losses[i][j] for i, j in enumerate(pick)) == pytest.approx(best[0])


def test_choose_rejects_a_budget_below_the_cheapest_choice():
    with pytest.raises(ValueError, match="below the cheapest"):
        choose([[2.0, 3.0], [1.0]], [[0.0, 0.0], [0.0]], 2.5)


# -- KVPolicy --------------------------------------------------------------------------------------
def test_policy_file_round_trip_and_validation(tmp_path):
    policy = KVPolicy.uniform(4, "tq4", "tq2", residual_length=8, protected_layers=1)
    assert [layer.dense for layer in policy.layers] == [True, False, False, True]
    path = tmp_path / "policy.json"
    policy.save(path)
    assert KVPolicy.load(path) == policy
    data = json.loads(path.read_text())
    with pytest.raises(ValueError, match="version"):
        KVPolicy.from_dict({**data, "version": 99})
    with pytest.raises(ValueError, match="unknown"):
        KVPolicy.from_dict({**data, "extra": 1})
    with pytest.raises(ValueError, match="not a KV policy"):
        KVPolicy.from_dict({"layers": []})
    with pytest.raises(ValueError, match="unknown encoder name"):
        LayerPolicy("tq9", "tq4")
    with pytest.raises(ValueError, match="no encoders"):
        LayerPolicy("tq4", "tq4", dense=True)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not a JSON KV policy"):
        KVPolicy.load(tmp_path / "bad.json")


def test_tqcache_builds_the_layers_a_policy_describes(tmp_path):
    config = llama_config()
    policy = KVPolicy([LayerPolicy(dense=True), LayerPolicy("tq4", "tq2", 3), LayerPolicy("tq3", "tq3"),
                       LayerPolicy(dense=True)])
    policy.save(tmp_path / "p.json")
    for given in (policy, policy.to_dict(), tmp_path / "p.json", str(tmp_path / "p.json")):
        cache = TQCache(config, policy=given)
        kinds = [type(layer).__name__ for layer in cache.layers]
        assert kinds == ["DynamicLayer", "TQLayer", "TQLayer", "DynamicLayer"]
        stores = [cache.layers[i].store for i in (1, 2)]
        assert [(s.key_encoder.bits, s.value_encoder.bits, s.residual_length) for s in stores] == [(4, 2, 3),
                                                                                                  (3, 3, 0)]
    with pytest.raises(ValueError, match="either a policy"):
        TQCache(config, "tq3", policy=policy)
    with pytest.raises(TypeError, match="config"):
        TQCache(policy=policy)
    with pytest.raises(ValueError, match="layers"):
        TQCache(config, policy=KVPolicy.uniform(3, "tq4", "tq4"))


def test_policy_bits_match_the_bytes_a_cache_holds():
    config = llama_config()
    model = seeded(transformers.LlamaForCausalLM, config)
    policy = KVPolicy([LayerPolicy(dense=True), LayerPolicy("tq4", "tq2", 3), LayerPolicy("tq3", "tq8"),
                       LayerPolicy("tq2", "tq2", 1, recent_length=5, recent_key_encoder="tq4",
                                   recent_value_encoder="tq8")])
    cache = TQCache(config, policy=policy)
    stride = cache.encode_stride
    ids = prompt(length=30 + stride - 1)
    with torch.no_grad():
        model(input_ids=ids[:, :30], **{CACHE_KW: cache})  # the window keeps residual_length tokens of these
        for i in range(30, ids.shape[1]):  # decode steps: the window fills up to residual_length + stride - 1
            model(input_ids=ids[:, i:i + 1], **{CACHE_KW: cache})
    assert [layer.store.window_length for layer in cache.layers[1:]] == [r + stride - 1 + 4 for r in (3, 0, 1)]
    assert cache.layers[3].store.recent_length == 5  # the last layer's tier is full
    elements = ids.shape[1] * 4 * 2 * (32 + 32)  # tokens x layers x KV heads x (Dk + Dv)
    held = 8 * cache.nbytes() / elements
    predicted = policy.bits_per_element(2, 32, 32, ids.shape[1], 4, cache.sink_length, stride)  # float32 model
    codes_in_window = sum(8 * layer.store.window_length * 2 * (layer.store.key_encoder.code_size
                                                               + layer.store.value_encoder.code_size)
                          for layer in cache.layers if isinstance(layer, TQLayer)) / elements
    assert held <= predicted <= held + codes_in_window + 1e-9  # the formula counts window tokens' codes too


# -- calibration -----------------------------------------------------------------------------------
def test_calibration_spends_the_budget_where_it_matters():
    config = llama_config(num_hidden_layers=3)
    model = seeded(transformers.LlamaForCausalLM, config)
    ids = prompt(length=56, seed=5)
    previous = model.config._attn_implementation
    sens = measure_sensitivity(model, ids, bits=(2, 4), prefix=40, scored=16)
    assert model.config._attn_implementation == previous  # restored
    assert set(sens.key_kl) == {"tq2-unbiased", "tq4-unbiased"} and len(sens.key_kl["tq2-unbiased"]) == 3
    assert set(sens.value_kl) == {"tq2", "tq4"}  # keys as TQCache's default stores them, values plain
    assert all(x >= 0 for side in (sens.key_kl, sens.value_kl) for v in side.values() for x in v)
    assert sum(sens.key_kl["tq4-unbiased"]) < sum(sens.key_kl["tq2-unbiased"])  # 4-bit keys disturb less
    assert sum(sens.value_kl["tq4"]) < sum(sens.value_kl["tq2"])
    for budget in (3.0, 3.6, 4.8):  # tq2 / tq4 keys and values: 2.5 / 4.5 bits at head dim 32
        policy = policy_for_budget(sens, budget, allow_dense=False, context_tokens=2048)
        assert policy.calibration["bits"] <= budget
        assert all(not layer.dense and layer.key_encoder.endswith("-unbiased") for layer in policy.layers)
    no_sinks = policy.bits_per_element(sens.heads, sens.key_dim, sens.value_dim, 2048, sens.dense_bytes)
    window = 4 + ENCODE_STRIDE - 1  # the sinks and the tokens waiting for the next encode
    assert policy.calibration["bits"] - no_sinks == pytest.approx(8 * window * sens.dense_bytes / 2048)
    tier = (256, "tq4-unbiased", "tq4")  # the newest 256 of 2048 tokens at 4 bits: its bytes count
    tiered = policy_for_budget(sens, 3.6, allow_dense=False, context_tokens=2048, recent=tier)
    assert all((layer.recent_length, layer.recent_key_encoder, layer.recent_value_encoder) == tier
               for layer in tiered.layers) and tiered.calibration["recent"] == list(tier)
    plain = policy_for_budget(sens, 3.6, allow_dense=False, context_tokens=2048)
    assert tiered.calibration["bits"] <= 3.6 and tiered.calibration["predicted_kl"] > plain.calibration["predicted_kl"]
    assert tiered.calibration["bits"] == pytest.approx(tiered.bits_per_element(
        sens.heads, sens.key_dim, sens.value_dim, 2048, sens.dense_bytes, 4, ENCODE_STRIDE))
    roomy = policy_for_budget(sens, 40.0, context_tokens=2048)  # float32 full precision fits: zero loss
    assert all(layer.dense for layer in roomy.layers) and roomy.calibration["predicted_kl"] == 0.0
    with pytest.raises(ValueError, match="below the cheapest"):
        policy_for_budget(sens, 1.0)
    one_call = calibrate(model, ids, 3.5, bits=(2, 4), prefix=40, scored=16, allow_dense=False, context_tokens=2048)
    assert one_call.layers == policy_for_budget(sens, 3.5, allow_dense=False, context_tokens=2048).layers
    chunked = measure_sensitivity(model, ids, bits=(2,), prefix=40, scored=16, chunk=16)  # the scored tokens
    assert sum(chunked.key_kl["tq2-unbiased"]) < sum(sens.key_kl["tq2-unbiased"])  # exact to each other: less loss
    windowed = measure_sensitivity(model, ids, bits=(2,), prefix=40, scored=16, residual_length=8)
    assert sum(windowed.key_kl["tq2-unbiased"]) < sum(sens.key_kl["tq2-unbiased"])  # the newest 8 tokens exact
    kept = policy_for_budget(windowed, 3.0, allow_dense=False, context_tokens=2048)
    assert all(layer.residual_length == 8 for layer in kept.layers) and kept.calibration["bits"] <= 3.0
    unbiased = measure_sensitivity(model, ids, bits=(2,), prefix=40, scored=16, unbiased_values=True)
    assert set(unbiased.value_kl) == {"tq2-unbiased"}
    assert set(unbiased.key_kl) == {"tq2-unbiased"}  # keys measured as before (in other batches: rounding apart)
    assert unbiased.key_kl["tq2-unbiased"] == pytest.approx(sens.key_kl["tq2-unbiased"], rel=1e-3)
    chosen = policy_for_budget(unbiased, 3.0, allow_dense=False, context_tokens=2048)
    assert all(layer.value_encoder == "tq2-unbiased" for layer in chosen.layers)
    assert TQCache(model.config, policy=chosen).policy.layers == chosen.layers
    with pytest.raises(ValueError, match="prefix \\+ scored"):
        measure_sensitivity(model, ids[:, :20], prefix=40, scored=16)


def test_calibration_among_trellis_codes(tmp_path):
    model = seeded(transformers.LlamaForCausalLM, llama_config(num_hidden_layers=2))
    ids = prompt(length=48, seed=6)
    sens = measure_sensitivity(model, ids, bits=(2, 4), prefix=40, scored=8, codes="tcq")
    assert set(sens.key_kl) == {"tcq2-unbiased", "tcq4-unbiased"} and set(sens.value_kl) == {"tcq2", "tcq4"}
    assert sum(sens.key_kl["tcq4-unbiased"]) < sum(sens.key_kl["tcq2-unbiased"])
    policy = policy_for_budget(sens, 3.6, allow_dense=False, context_tokens=2048)
    assert all(layer.key_encoder.startswith("tcq") and layer.value_encoder.startswith("tcq") for layer in policy.layers)
    policy.save(tmp_path / "p.json")
    cache = TQCache(model.config, policy=KVPolicy.load(tmp_path / "p.json"))
    assert [type(layer.store.key_encoder).__name__ for layer in cache.layers] == ["TrellisMSE"] * 2
    with pytest.raises(ValueError, match="widths among"):
        sensitivity_template(model, bits=(8,), codes="tcq")
    with pytest.raises(ValueError, match="codes"):
        sensitivity_template(model, codes="pq")


@pytest.mark.parametrize("side, layer, batch", [("keys", 1, 16), ("values", 2, 1)])
def test_a_batched_trial_measures_what_its_own_cache_gives(side, layer, batch):
    """A trial measured among the batch rows of the others equals the same trial run alone: a TQCache with that
    layer at 2 bits (the other side at 8) read by the "tqindex" attention over its codes, prefilled, then fed the
    scored tokens one at a time, against a full-precision cache."""
    from tqindex.kv.calibrate import NEAR_EXACT

    model = seeded(transformers.LlamaForCausalLM, llama_config(num_hidden_layers=3))
    ids = prompt(length=56, seed=5)
    sens = measure_sensitivity(model, ids, bits=(2,), prefix=40, scored=16, residual_length=3, batch=batch)
    entries = [LayerPolicy(dense=True)] * 3
    keys, values = ("tq2-unbiased", NEAR_EXACT) if side == "keys" else (NEAR_EXACT, "tq2")
    entries[layer] = LayerPolicy(keys, values, 3)

    def logp(cache):
        with torch.inference_mode():
            model(input_ids=ids[:, :40], **{CACHE_KW: cache}, use_cache=True)
            out = [model(input_ids=ids[:, i : i + 1], **{CACHE_KW: cache}, use_cache=True).logits[0]
                   for i in range(40, 56)]
        return torch.log_softmax(torch.cat(out).float(), -1)

    reference = logp(transformers.DynamicCache(config=model.config))
    previous = model.config._attn_implementation
    model.set_attn_implementation("tqindex")
    try:
        alone = logp(TQCache(model.config, policy=KVPolicy(entries, True), encode_stride=1))
    finally:
        model.set_attn_implementation(previous)
    kl = float((reference.exp() * (reference - alone)).sum(-1).mean())
    measured = (sens.key_kl["tq2-unbiased"] if side == "keys" else sens.value_kl["tq2"])[layer]
    assert kl > 0 and measured == pytest.approx(kl, rel=1e-3)


def test_a_budget_below_the_cheapest_choice_fails_before_the_measurement(monkeypatch):
    """The template of a measurement has its names, dims and window, every KL 0; calibrate checks the budget on it
    first (a window of 128 float32 tokens alone costs more than 3 bits per element at 2,048 tokens)."""
    cal = importlib.import_module("tqindex.kv.calibrate")  # the module (tqindex.kv.calibrate is the function)
    model = seeded(transformers.LlamaForCausalLM, llama_config(num_hidden_layers=3))
    ids = prompt(length=56, seed=5)
    template = sensitivity_template(model, bits=(2, 4), residual_length=128, unbiased_values=True)
    assert set(template.key_kl) == {"tq2-unbiased", "tq4-unbiased"} and set(template.value_kl) == {"tq2-unbiased",
                                                                                                     "tq4-unbiased"}
    assert (template.layers, template.heads, template.key_dim, template.dense_bytes) == (3, 2, 32, 4)
    assert template.residual_length == 128 and all(x == 0 for v in template.key_kl.values() for x in v)
    monkeypatch.setattr(cal, "measure_sensitivity", lambda *a, **kw: pytest.fail("measured before the check"))
    with pytest.raises(ValueError, match="below the cheapest"):
        calibrate(model, ids, 3.0, bits=(2, 4), prefix=40, scored=16, allow_dense=False, residual_length=128)
    with pytest.raises(ValueError, match="bits must be widths"):
        calibrate(model, ids, 3.0, bits=(5,), prefix=40, scored=16)
