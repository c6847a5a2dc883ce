import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from tiny import (  # noqa: E402
    CACHE_KW, CLEAR, assert_greedy_matches, clear_steps, compressed_layers, exact_greedy, forward, gemma2_config,
    generate, llama_config, prompt, seeded, tq8,
)  # fmt: skip
from transformers import DynamicCache, Gemma2ForCausalLM, LlamaForCausalLM  # noqa: E402
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer  # noqa: E402

import tqindex as tq  # noqa: E402
from tqindex.kv import CompressedTokens, TQCache  # noqa: E402
from tqindex.kv.hf import ATTN_IMPLEMENTATION, TQLayer  # noqa: E402

torch.set_num_threads(1)
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def llama():
    """Tiny random Llama with GQA (4 query heads, 2 KV heads, head_dim 32)."""
    return seeded(LlamaForCausalLM, llama_config())


@pytest.fixture(scope="module")
def gemma2():
    """Tiny random Gemma2: alternating sliding-window (8 tokens) and full layers, soft-capped scores."""
    return seeded(Gemma2ForCausalLM, gemma2_config(num_hidden_layers=6))


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize("impl", [ATTN_IMPLEMENTATION, "sdpa"])
def test_greedy_matches_dynamic_cache(llama, impl):
    ids = prompt(seed=CLEAR)
    expected, clear = exact_greedy(llama, ids)
    cache = tq8(llama)
    out = generate(llama, cache, impl, input_ids=ids)
    assert_greedy_matches(out, expected, clear, ids.shape[1])
    if CACHE_KW == "cache":  # the older name still works
        legacy = llama.generate(input_ids=ids, past_key_values=tq8(llama), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert_greedy_matches(legacy, expected, clear, ids.shape[1])
    assert [type(layer) for layer in cache.layers] == [DynamicLayer, TQLayer, TQLayer, DynamicLayer]
    assert all(layer.store.compressed_length > 0 for layer in compressed_layers(cache))
    assert cache.get_seq_length() == out.shape[1] - 1


def test_update_returns_codes_only_for_tqindex_attention(llama):
    cache = tq8(llama, protected_layers=0)
    k = torch.randn(1, 2, 3, 32)
    llama.set_attn_implementation(ATTN_IMPLEMENTATION)
    keys, values = cache.update(k, k, 0)
    assert isinstance(keys, CompressedTokens) and isinstance(values, CompressedTokens)
    llama.set_attn_implementation("sdpa")
    keys, values = cache.update(k, k, 1)
    assert isinstance(keys, torch.Tensor) and torch.equal(keys, k)


@pytest.mark.parametrize("residual", [0, 3])
@pytest.mark.parametrize("encoders", [("tq8", "tq8"), ("tq4", "tq3"), ("fp4", "fp4"), ("tq3-prod", "tq2"),
                                      ("tcq2-unbiased", "tcq3")])
def test_compressed_attention_logits_equal_decode_then_sdpa(llama, encoders, residual):
    """Each step twice on identical cache contents: attention from the codes vs decoded K/V with sdpa.

    Identical contents matter: two independent runs can drift apart, as float-rounding differences between
    the attention paths flip quantization decisions of the keys/values written later."""
    tokens = prompt(length=30, seed=2)
    cache = TQCache(llama.config, *encoders, residual_length=residual, protected_layers=0, encode_stride=1)
    chunks = [(0, 8)] + [(t, t + 1) for t in range(8, 20)] + [(20, 24), (24, 25), (25, 30)]
    for t0, t1 in chunks:
        logits = {}
        for impl, c in (("sdpa", copy.deepcopy(cache)), (ATTN_IMPLEMENTATION, cache)):
            llama.set_attn_implementation(impl)
            with torch.no_grad():
                logits[impl] = forward(llama, tokens[:, t0:t1], c).logits
        torch.testing.assert_close(logits[ATTN_IMPLEMENTATION], logits["sdpa"], rtol=1e-5, atol=1e-5)
    assert cache.layers[0].store.compressed_length == 30 - residual - cache.sink_length  # the last chunk encoded


def test_deepcopy_shares_encoders_and_config(llama):
    cache = tq8(llama)
    generate(llama, cache, input_ids=prompt(), max_new_tokens=3)
    clone = copy.deepcopy(cache)
    layer, cloned = compressed_layers(cache)[0], compressed_layers(clone)[0]
    assert cloned.config is llama.config and cloned.store.key_encoder is layer.store.key_encoder
    assert cloned.store is not layer.store and clone.get_seq_length() == cache.get_seq_length()
    assert torch.equal(cloned.store.materialize()[0], layer.store.materialize()[0])


def test_sampling_with_seed_and_num_return_sequences(llama):
    kw = {"input_ids": prompt(), "do_sample": True, "num_return_sequences": 3}
    out = generate(llama, tq8(llama), seed=5, **kw)
    assert out.shape == (3, 12 + NEW_TOKENS)
    assert torch.equal(out, generate(llama, tq8(llama), seed=5, **kw))
    assert not torch.equal(out, generate(llama, tq8(llama), seed=6, **kw))
    # the first new token comes from the full-precision prefill: the same draw as with DynamicCache
    expected = generate(llama, DynamicCache(config=llama.config), "sdpa", seed=5, **kw)
    assert torch.equal(out[:, : 12 + 1], expected[:, : 12 + 1])


@pytest.mark.parametrize("sample", [False, True])
def test_beam_search_and_num_return_sequences(llama, sample):
    ids = prompt(batch=2)
    kw = {"input_ids": ids, "num_beams": 3, "num_return_sequences": 2, "do_sample": sample, "max_new_tokens": 12}
    expected = generate(llama, DynamicCache(config=llama.config), "sdpa", seed=3, **kw)
    cache = tq8(llama)
    out = generate(llama, cache, seed=3, **kw)
    assert out.shape == (4, 24) and torch.equal(out, expected)


def test_batch_with_left_padding(llama):
    ids = prompt(batch=2)
    ids[0, :5] = 0
    mask = (ids != 0).long()
    expected = generate(llama, DynamicCache(config=llama.config), "sdpa", input_ids=ids, attention_mask=mask)
    cache = tq8(llama)
    out = generate(llama, cache, input_ids=ids, attention_mask=mask)
    assert torch.equal(out, expected)
    alone = generate(llama, tq8(llama), input_ids=ids[:1, 5:])  # the padded row, without padding
    assert torch.equal(out[0, 12:], alone[0, 7:])
    keys, _ = compressed_layers(cache)[0].store.materialize()
    cache.batch_select_indices(torch.tensor([1]))
    assert torch.equal(compressed_layers(cache)[0].store.materialize()[0], keys[1:])


def _forward_loop(model, cache, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy decoding by hand; returns the tokens and the logits of every step."""
    tokens, all_logits, step_input = ids, [], ids
    for _ in range(steps):
        logits = forward(model, step_input, cache).logits[:, -1]
        all_logits.append(logits)
        step_input = logits.argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, step_input], dim=1)
        assert cache.get_seq_length() == tokens.shape[1] - 1
    return tokens, all_logits


def test_forward_loop(llama):
    ids = prompt(seed=CLEAR)
    llama.set_attn_implementation("sdpa")
    expected, expected_logits = _forward_loop(llama, DynamicCache(config=llama.config), ids, NEW_TOKENS)
    llama.set_attn_implementation(ATTN_IMPLEMENTATION)
    tokens, logits = _forward_loop(llama, tq8(llama), ids, NEW_TOKENS)
    clear = clear_steps(expected_logits)
    assert_greedy_matches(tokens, expected, clear, ids.shape[1])
    n = min(clear + 1, NEW_TOKENS)  # the logits of the steps that follow the same tokens
    torch.testing.assert_close(torch.stack(logits[:n]), torch.stack(expected_logits[:n]), rtol=0, atol=2e-2)


def test_crop_then_continue(llama):
    ids = prompt(seed=CLEAR)
    out, clear = exact_greedy(llama, ids)
    assert clear == NEW_TOKENS  # both caches then hold the same tokens
    dense, cache = DynamicCache(config=llama.config), tq8(llama)
    assert torch.equal(generate(llama, dense, "sdpa", input_ids=ids), out)
    assert torch.equal(generate(llama, cache, input_ids=ids), out)
    for c in (dense, cache):
        c.crop(-9)  # beyond the full-precision window: into the codes
        assert c.get_seq_length() == out.shape[1] - 10
    assert compressed_layers(cache)[0].store.window_length == cache.sink_length  # the sinks only
    resumed = out[:, : out.shape[1] - 9]
    exact = generate(llama, dense, "sdpa", input_ids=resumed, output_scores=True, return_dict_in_generate=True)
    got = generate(llama, cache, input_ids=resumed)
    assert_greedy_matches(got, exact.sequences, clear_steps(list(exact.scores)), resumed.shape[1], least=4)


def test_second_generate_on_same_cache(llama):
    """Multi-turn: generate, append user tokens, generate again with the same cache object. The second
    turn follows the exact model's greedy tokens up to the first near tie (top-2 logits within MARGIN), where
    8-bit codes may pick either."""
    outputs = []
    for cache, impl in ((DynamicCache(config=llama.config), "sdpa"), (tq8(llama), ATTN_IMPLEMENTATION)):
        first = generate(llama, cache, impl, input_ids=prompt(seed=CLEAR))  # no near tie in the first turn
        second_prompt = torch.cat([first, prompt(length=6, seed=19)], dim=1)  # answered with 12 clear steps
        second = generate(llama, cache, impl, input_ids=second_prompt, output_scores=True, return_dict_in_generate=True)
        assert cache.get_seq_length() == second.sequences.shape[1] - 1
        outputs.append((second_prompt, second))
    (exact_prompt, exact), (second_prompt, got) = outputs
    assert torch.equal(second_prompt, exact_prompt)
    assert_greedy_matches(got.sequences, exact.sequences, clear_steps(list(exact.scores)), second_prompt.shape[1])


def test_sliding_window_layers_stay_dense(gemma2):
    ids = prompt()
    expected = generate(gemma2, DynamicCache(config=gemma2.config), "eager", input_ids=ids)
    cache = TQCache(gemma2.config, "tq8", "tq8", residual_length=4, protected_layers=1)
    assert [type(layer) for layer in cache.layers] == [
        DynamicSlidingWindowLayer, TQLayer, DynamicSlidingWindowLayer, TQLayer, DynamicSlidingWindowLayer, DynamicLayer,
    ]  # fmt: skip
    out = generate(gemma2, cache, input_ids=ids)
    assert torch.equal(out, expected)
    assert cache.get_seq_length() == out.shape[1] - 1
    assert cache.layers[0].keys.shape[2] < cache.get_seq_length()  # sliding layers keep their window only


def test_memory_accounting(llama):
    model = llama.to(torch.bfloat16)
    try:
        cache = TQCache(model.config, "tq8", "tq4", residual_length=4, protected_layers=1)
        generate(model, cache, input_ids=prompt(batch=2))
    finally:
        llama.to(torch.float32)
    k_size, v_size = tq.make_encoder("tq8", 32).code_size, tq.make_encoder("tq4", 32).code_size
    dense_protected = 0
    for layer in cache.layers:
        if isinstance(layer, TQLayer):
            store = layer.store
            window = 2 * 2 * 2 * store.window_length * 32 * 2  # K and V, B=2, Hkv=2, bf16
            assert store.key_offset.shape == (2, 2, 1, 32) and store.key_offset.dtype == torch.float32
            codes = layer.nbytes() - window - 2 * 2 * 32 * 4  # minus the key offset
            dense_codes = 2 * 2 * 2 * store.compressed_length * 32 * 2
            assert codes / dense_codes == pytest.approx((k_size + v_size) / (2 * 2 * 32))
            assert layer.nbytes_dense() == 2 * 2 * 2 * store.seq_length * 32 * 2
        else:
            dense_protected += 2 * (layer.keys.numel() + layer.values.numel())
    tq_layers = compressed_layers(cache)
    codes, tokens = cache.nbytes_compressed()
    assert tokens == 2 * sum(layer.store.compressed_length for layer in tq_layers) > 0  # B = 2
    assert codes == tokens * 2 * (k_size + v_size)  # 2 KV heads
    assert cache.nbytes() == dense_protected + sum(layer.nbytes() for layer in tq_layers)
    assert cache.nbytes_dense() == dense_protected + sum(layer.nbytes_dense() for layer in tq_layers)
    assert cache.nbytes() < cache.nbytes_dense()


def test_presets_and_validation(llama):
    cache = TQCache.preset(llama.config, "k8v4", residual_length=16, protected_layers=1)
    layer = compressed_layers(cache)[0]
    assert layer.store.key_encoder.bits == 8 and layer.store.value_encoder.bits == 4
    assert layer.store.key_encoder.rescale == "unbiased" and layer.store.value_encoder.rescale == "cos"
    assert layer.store.residual_length == 16 and layer.store.sink_length == 4
    default = compressed_layers(TQCache(llama.config, protected_layers=0))[0].store
    assert (default.key_encoder.to_dict(), default.value_encoder.to_dict()) == (
        tq.make_encoder("tq4", 32, rescale="unbiased").to_dict(), tq.make_encoder("tq4", 32).to_dict())
    fp4 = TQCache.preset(llama.config, "fp4", protected_layers=1)
    assert isinstance(compressed_layers(fp4)[0].store.key_encoder, tq.FP4UE8M0)
    assert compressed_layers(TQCache.preset(llama.config, "k2v2", protected_layers=0))[0].store.value_encoder.bits == 2
    assert not compressed_layers(TQCache(llama.config, protected_layers=2))  # 4 layers: all protected
    assert len(compressed_layers(TQCache(llama.config, tq.make_encoder("tq4", 32), "tq2", protected_layers=0))) == 4
    for bad in ("k5v4", "q4", 4):
        with pytest.raises(ValueError, match="preset must be"):
            TQCache.preset(llama.config, bad)
    with pytest.raises(ValueError, match="head dim is 32"):
        TQCache(llama.config, tq.make_encoder("tq4", 64))
    with pytest.raises(TypeError, match="value_encoder"):
        TQCache(llama.config, "tq4", 4)
    with pytest.raises(ValueError, match="unknown encoder name"):
        TQCache(llama.config, "tq9")
    with pytest.raises(ValueError, match="protected_layers"):
        TQCache(llama.config, protected_layers=-1)
    with pytest.raises(TypeError, match="config"):
        TQCache({"num_hidden_layers": 4})
    with pytest.raises(ValueError, match="residual_length"):
        TQCache(llama.config, residual_length=-1)
    with pytest.raises(ValueError, match="encode_stride"):
        TQCache(llama.config, encode_stride=0)
    with pytest.raises(TypeError, match="offloading"):
        TQCache(llama.config, offloading=1)
    with pytest.raises(TypeError, match=r"ddp_cache_data\[0\]"):
        TQCache([(torch.zeros(1, 2, 3, 32),)])  # keys without values
    with pytest.raises(TypeError, match="config"):
        TQCache([], ddp_cache_data=[])  # ddp data twice


def test_chunks_over_a_cache_attend_without_a_mask_and_match_sdpa(llama):
    """A chunk of several tokens over a cache gets no mask from the "tqindex" mask function (the causal bias
    aligned to the last key instead, so that flash attention can run), with the same logits as sdpa's mask."""
    import inspect

    from transformers.masking_utils import causal_mask_function, sdpa_mask

    from tqindex.kv.hf import tq_attention_mask

    if "q_offset" in inspect.signature(sdpa_mask).parameters:  # releases that pass q_offset
        kw = dict(batch_size=1, q_length=5, kv_length=17, kv_offset=0, mask_function=causal_mask_function)
        assert tq_attention_mask(q_offset=12, **kw) is None
        assert tq_attention_mask(q_offset=10, **kw) is not None  # keys beyond the queries (a static cache)
        padding = torch.ones(1, 17, dtype=torch.bool)
        padding[0, 3] = False
        assert tq_attention_mask(q_offset=12, attention_mask=padding, **kw) is not None
        assert tq_attention_mask(q_offset=12, attention_mask=torch.ones(1, 17, dtype=torch.bool), **kw) is None
    ids = prompt(length=20)
    logits = {}
    for impl in (ATTN_IMPLEMENTATION, "sdpa"):
        llama.set_attn_implementation(impl)
        cache = DynamicCache(config=llama.config)
        forward(llama, ids[:, :12], cache)
        logits[impl] = forward(llama, ids[:, 12:], cache).logits
    torch.testing.assert_close(logits[ATTN_IMPLEMENTATION], logits["sdpa"], rtol=1e-5, atol=1e-5)
