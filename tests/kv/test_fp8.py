"""FP8Cache, the FP8 baseline: the format (E4M3 codes, one scale per token and head), its bytes, and the
DynamicCache calls (shapes, crop, reorder, batch selection, generate) against a DynamicCache fed the same tokens,
on a tiny random Llama on CPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from tiny import CACHE_KW, forward, gemma2_config, generate, llama_config, prompt, seeded  # noqa: E402
from transformers import DynamicCache, Gemma2ForCausalLM, LlamaForCausalLM  # noqa: E402
from transformers.cache_utils import DynamicSlidingWindowLayer  # noqa: E402

from tqindex.kv import FP8Cache, FP8Layer  # noqa: E402
from tqindex.kv.fp8 import FP8_MAX, dequantize_fp8, quantize_fp8  # noqa: E402
from tqindex.kv.sessions import allocated_bytes  # noqa: E402

torch.set_num_threads(1)
PREFILL, STEPS = 24, 8
E4M3_REL = 2.0**-4
"""Largest relative rounding error of a normal E4M3 value (3 mantissa bits, round to nearest)."""
E4M3_SUBNORMAL_STEP = 2.0**-9
"""Spacing of E4M3 subnormals: the absolute error below the normal range is at most half of it, times the scale."""


@pytest.fixture(scope="module")
def llama():
    return seeded(LlamaForCausalLM, llama_config())


def _teacher_forced(model, cache, batch: int = 1) -> torch.Tensor:
    """Logits [B, PREFILL + STEPS, vocab]: a prefill, then STEPS single tokens, all of prompt(...)."""
    model.set_attn_implementation("sdpa")
    ids = prompt(batch=batch, length=PREFILL + STEPS)
    logits = [forward(model, ids[:, :PREFILL], cache).logits]
    logits += [forward(model, ids[:, t : t + 1], cache).logits for t in range(PREFILL, PREFILL + STEPS)]
    return torch.cat(logits, dim=1)


def test_quantize_rounds_each_head_vector_to_e4m3_with_its_own_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 50, 64, generator=g) * torch.logspace(-3, 3, 50)[:, None]  # magnitudes over 6 decades
    x[0, 0, 0] = 0.0
    codes, scales = quantize_fp8(x)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (3, 2, 50, 1)
    amax = x.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(scales[amax > 0], (amax / FP8_MAX)[amax > 0])
    assert codes.float().abs().amax(-1).max() == FP8_MAX  # each vector's largest element maps to 448
    y = dequantize_fp8(codes, scales, torch.float32)
    bound = torch.maximum(E4M3_REL * x.abs(), E4M3_SUBNORMAL_STEP / 2 * scales) * (1 + 1e-5)
    assert ((y - x).abs() <= bound).all()
    assert torch.equal(y[0, 0, 0], torch.zeros(64))  # a zero vector decodes to zeros


def test_dequantize_is_exact_in_the_model_dtype():
    x = torch.randn(4, 1, 9, 32, generator=torch.Generator().manual_seed(1))
    codes, scales = quantize_fp8(x)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = dequantize_fp8(codes, scales, dtype)
        assert got.dtype == dtype
        assert torch.equal(got, (codes.to(dtype) * scales.to(dtype)))


def test_layers_and_bytes(llama):
    cache = FP8Cache(llama.config)
    assert isinstance(cache, DynamicCache) and len(cache.layers) == 4
    assert all(type(layer) is FP8Layer for layer in cache.layers)
    _teacher_forced(llama, cache, batch=2)
    tokens = PREFILL + STEPS
    assert cache.get_seq_length() == tokens
    per_layer = 2 * 2 * 2 * tokens * (32 + 4)  # K and V, batch 2, 2 heads, head_dim 32 codes + a float32 scale
    assert cache.nbytes() == 4 * per_layer == allocated_bytes(cache)
    assert cache.nbytes_dense() == 4 * 2 * 2 * 2 * tokens * 32 * 2
    layer = cache.layers[1]
    assert layer.keys.shape == (2, 2, tokens, 32) and layer.keys.dtype == torch.float32
    with pytest.raises(AttributeError, match="decoded"):
        layer.keys = torch.zeros(1)


def test_stored_states_are_the_dynamic_cache_states_rounded(llama):
    """Layer 0's states depend on the tokens only: the FP8 layer holds exactly their rounding."""
    dense, fp8 = DynamicCache(config=llama.config), FP8Cache(llama.config)
    _teacher_forced(llama, dense)
    _teacher_forced(llama, fp8)
    for name in ("keys", "values"):
        expected = dequantize_fp8(*quantize_fp8(getattr(dense.layers[0], name)), torch.float32)
        assert torch.equal(getattr(fp8.layers[0], name), expected)
        later, ref = getattr(fp8.layers[3], name), getattr(dense.layers[3], name)
        assert later.shape == ref.shape
        assert float((later - ref).norm()) <= 0.05 * float(ref.norm())


def test_logits_are_near_those_of_a_dynamic_cache(llama):
    expected = _teacher_forced(llama, DynamicCache(config=llama.config), batch=2)
    got = _teacher_forced(llama, FP8Cache(llama.config), batch=2)
    assert torch.equal(got[:, :PREFILL], expected[:, :PREFILL])  # the prefill attends its own chunk as computed
    decode = slice(PREFILL, None)
    assert float((got[:, decode] - expected[:, decode]).norm()) <= 0.04 * float(expected[:, decode].norm())
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_generate_and_a_lazy_cache(llama):
    ids = prompt(batch=2)
    expected = generate(llama, DynamicCache(config=llama.config), "sdpa", input_ids=ids)
    for cache in (FP8Cache(llama.config), FP8Cache()):
        out = generate(llama, cache, "sdpa", input_ids=ids)
        assert out.shape == expected.shape
        assert torch.equal(out[:, : ids.shape[1]], ids)
        assert (out == expected).float().mean() >= 0.8
        assert cache.get_seq_length() == out.shape[1] - 1
        assert len(cache.layers) == 4 and all(type(layer) is FP8Layer for layer in cache.layers)


def test_crop_keeps_the_first_tokens_exactly(llama):
    cache = FP8Cache(llama.config)
    _teacher_forced(llama, cache)
    before = [(layer.keys, layer.values) for layer in cache.layers]
    cache.crop(-5)
    assert cache.get_seq_length() == PREFILL + STEPS - 5
    for layer, (k, v) in zip(cache.layers, before):
        assert torch.equal(layer.keys, k[:, :, :-5]) and torch.equal(layer.values, v[:, :, :-5])
    logits = forward(llama, prompt(length=3, seed=7), cache).logits  # usable after the crop
    assert logits.shape == (1, 3, 128) and cache.get_seq_length() == PREFILL + STEPS - 2


def test_reorder_select_and_repeat_batch_rows(llama):
    cache = FP8Cache(llama.config)
    _teacher_forced(llama, cache, batch=2)
    keys = [layer.keys for layer in cache.layers]
    cache.reorder_cache(torch.tensor([1, 0]))
    assert all(torch.equal(layer.keys, k[[1, 0]]) for layer, k in zip(cache.layers, keys))
    cache.batch_repeat_interleave(2)
    assert all(torch.equal(layer.keys, k[[1, 1, 0, 0]]) for layer, k in zip(cache.layers, keys))
    cache.batch_select_indices(torch.tensor([2]))
    assert all(torch.equal(layer.keys, k[[0]]) for layer, k in zip(cache.layers, keys))
    assert cache.layers[0].key_scales.shape == (1, 2, PREFILL + STEPS, 1)


def test_offload_prefetch_and_reset(llama):
    cache = FP8Cache(llama.config)
    _teacher_forced(llama, cache)
    keys = cache.layers[2].keys
    for layer in cache.layers:
        layer.offload()
        layer.prefetch()
    assert torch.equal(cache.layers[2].keys, keys)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.layers[0].keys is None and cache.nbytes() == 0


def test_from_ddp_cache_data():
    g = torch.Generator().manual_seed(3)
    data = [tuple(torch.randn(2, 1, 2, 5, 16, generator=g)) for _ in range(3)]
    cache = FP8Cache(ddp_cache_data=data)
    assert len(cache.layers) == 3 and cache.get_seq_length() == 5
    for layer, (k, v) in zip(cache.layers, data):
        assert torch.equal(layer.keys, dequantize_fp8(*quantize_fp8(k), k.dtype))
        assert torch.equal(layer.values, dequantize_fp8(*quantize_fp8(v), v.dtype))


def test_sliding_window_layers_keep_their_class():
    config = gemma2_config()
    model = seeded(Gemma2ForCausalLM, config)
    cache = FP8Cache(config)
    assert [type(layer) for layer in cache.layers] == [DynamicSlidingWindowLayer, FP8Layer] * 2
    out = generate(model, cache, "eager", input_ids=prompt())
    assert cache.get_seq_length() == out.shape[1] - 1
    assert cache.layers[0].keys.shape[2] < cache.get_seq_length() == cache.layers[1].keys.shape[2]


def test_bad_config_is_refused():
    with pytest.raises(TypeError, match="PreTrainedConfig"):
        FP8Cache({"num_hidden_layers": 2})
    assert FP8Cache().layer_class_to_replicate is FP8Layer


def test_a_forward_pass_with_gradients(llama):
    """The codes carry no gradient; the current chunk, attended as computed, does."""
    cache = FP8Cache(llama.config)
    llama(prompt(length=6), **{CACHE_KW: cache}, use_cache=True)
    out = llama(prompt(length=3, seed=2), **{CACHE_KW: cache}, use_cache=True)
    out.logits.sum().backward()
    assert llama.model.layers[0].self_attn.k_proj.weight.grad.abs().sum() > 0
    assert not cache.layers[0].key_codes.requires_grad
    llama.zero_grad(set_to_none=True)
