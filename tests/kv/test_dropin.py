"""TQCache as a DynamicCache drop-in: the same calls on ``DynamicCache`` and ``TQCache`` (8-bit codes) give the
same shapes and the same results up to quantization error, on a tiny random Llama on CPU.

Each parity test runs once per kind of cache; the reference is always a DynamicCache fed the same tokens.
Where TQCache differs on purpose (read-only decoded ``keys``, head dims below 2, offloading on CPU), the test
says so.
"""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers")
from tiny import (  # noqa: E402
    CACHE_KW, CLEAR, VOCAB, assert_greedy_matches, attention_for, compressed_layers, exact_greedy, forward, generate,
    llama_config, make_cache, prompt, seeded,
)  # fmt: skip
from transformers import BartConfig, BartForConditionalGeneration, DynamicCache, EncoderDecoderCache  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.cache_utils import Cache, DynamicLayer  # noqa: E402

from tqindex.kv import TQCache  # noqa: E402
from tqindex.kv.hf import ATTN_IMPLEMENTATION, TQLayer, _decoding_warning  # noqa: E402
from tqindex.kv.store import KVStore  # noqa: E402

torch.set_num_threads(1)
KINDS = ("dynamic", "tq8")
PREFILL, STEPS = 12, 4
TQ8_REL_ERR = 2e-2
"""Relative error (Frobenius) of keys/values stored by TQCache(tq8) against a DynamicCache fed the same tokens:
8-bit codes of the older tokens, whose error also shifts the later layers' states a little."""


@pytest.fixture(scope="module")
def llama():
    return seeded(LlamaForCausalLM, llama_config())


def _filled(model, kind: str, batch: int = 1, steps: int = STEPS, **kw) -> tuple[DynamicCache, list[torch.Tensor]]:
    """A cache of ``kind`` after a prefill of PREFILL tokens and ``steps`` single tokens, all teacher-forced
    (every kind sees the same tokens); returns it with the logits of each call."""
    model.set_attn_implementation(attention_for(kind))
    cache = make_cache(kind, model, **kw)
    ids = prompt(batch=batch, length=PREFILL + steps)
    logits = [forward(model, ids[:, :PREFILL], cache).logits]
    logits += [forward(model, ids[:, t : t + 1], cache).logits for t in range(PREFILL, PREFILL + steps)]
    return cache, logits


def _tolerance(kind: str) -> float:
    """Relative error allowed against a DynamicCache fed the same tokens: none for a DynamicCache."""
    return 0.0 if kind == "dynamic" else TQ8_REL_ERR


def _close(got: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Same shape and dtype; equal (rel = 0) or within relative error ``rel`` (Frobenius)."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    if rel == 0:
        assert torch.equal(got, expected)
    else:
        assert float((got - expected).norm()) <= rel * float(expected.norm())


def _assert_same_contents(cache: DynamicCache, reference: DynamicCache, rel: float) -> None:
    assert len(cache.layers) == len(reference.layers)
    assert cache.get_seq_length() == reference.get_seq_length()
    for layer, ref in zip(cache.layers, reference.layers):
        _close(layer.keys, ref.keys, rel)
        _close(layer.values, ref.values, rel)


@pytest.mark.parametrize("kind", KINDS)
def test_is_a_dynamic_cache_with_its_layer_structure(llama, kind):
    cache = make_cache(kind, llama)
    assert isinstance(cache, DynamicCache) and isinstance(cache, Cache)
    assert len(cache) == 4 and cache.is_sliding == [False] * 4
    max_length = getattr(cache, "get_max_length", None) or cache.get_max_cache_shape  # its name in older 5.x
    assert cache.get_seq_length() == 0 and not cache.is_initialized and max_length() == -1
    assert all(layer.keys is None and layer.values is None for layer in cache.layers)
    cache, logits = _filled(llama, kind, batch=2)
    reference, ref_logits = _filled(llama, "dynamic", batch=2)
    assert cache.is_initialized and cache.get_seq_length() == PREFILL + STEPS
    query = 3 if "query_length" in inspect.signature(Cache.get_mask_sizes).parameters else torch.arange(16, 19)
    assert [cache.get_mask_sizes(query, i) for i in range(4)] == [reference.get_mask_sizes(query, i) for i in range(4)]
    for got, expected in zip(logits, ref_logits):
        _close(got, expected, _tolerance(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_layer_keys_and_values(llama, kind):
    """``layers[i].keys`` / ``.values``: [B, H, T, D] in the model's dtype; on compressed layers decoded on
    demand (codes, then the full-precision window)."""
    cache, _ = _filled(llama, kind)
    reference, _ = _filled(llama, "dynamic")
    _assert_same_contents(cache, reference, _tolerance(kind))
    assert cache.layers[1].keys.shape == (1, 2, PREFILL + STEPS, 32)
    if kind == "tq8":
        layer = cache.layers[1]
        assert isinstance(layer, TQLayer) and layer.store.compressed_length > 0
        assert layer.keys.data_ptr() != layer.keys.data_ptr()  # decoded afresh at every access
        with pytest.raises(AttributeError, match="decoded from the codes on demand"):
            layer.keys = reference.layers[1].keys


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tokens", [-3, -10, 0, 5, 100])
def test_crop_as_dynamic_cache_crops(llama, kind, tokens):
    """Same result, or same error, as DynamicCache.crop of the installed transformers (the meaning of 0 and
    of positive counts changed within 5.x); crops reach into the codes (window: 4 tokens + the last step)."""
    cache, _ = _filled(llama, kind)
    reference, _ = _filled(llama, "dynamic")
    outcomes = []
    for c in (cache, reference):
        try:
            c.crop(tokens)
            outcomes.append(c.get_seq_length())
        except Exception as err:  # noqa: BLE001 - compared below
            outcomes.append(type(err))
    assert outcomes[0] == outcomes[1]
    if isinstance(outcomes[0], int):
        _assert_same_contents(cache, reference, _tolerance(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_batch_operations(llama, kind):
    cache, _ = _filled(llama, kind, batch=2)
    reference, _ = _filled(llama, "dynamic", batch=2)
    for c in (cache, reference):
        c.batch_repeat_interleave(2)  # rows 0 0 1 1
        c.reorder_cache(torch.tensor([3, 0, 1, 2]))  # rows 1 0 0 1
        c.batch_select_indices(torch.tensor([0, 2]))  # rows 1 0
    _assert_same_contents(cache, reference, _tolerance(kind))
    alone, _ = _filled(llama, kind, batch=2)
    assert torch.equal(cache.layers[1].keys[0], alone.layers[1].keys[1])  # exact row moves
    step = prompt(batch=2, length=1)
    for k, c in ((kind, cache), ("dynamic", reference)):  # and decoding goes on from the reordered rows
        llama.set_attn_implementation(attention_for(k))
        forward(llama, step, c)
    _assert_same_contents(cache, reference, _tolerance(kind))


@pytest.mark.parametrize("strategy", ["prompt_lookup", "assistant"])
def test_speculative_decoding_crops_like_dynamic_cache(strategy):
    """Prompt-lookup and assisted decoding crop rejected draft tokens with the installed transformers'
    crop convention: TQCache decodes the same tokens as DynamicCache."""
    model = seeded(LlamaForCausalLM, llama_config(eos_token_id=VOCAB - 1))  # 5.0's prompt lookup needs an eos id
    ids = prompt(length=16)
    ids[:, 8:] = ids[:, :8]  # repeats, for prompt lookup to draft from
    if strategy == "prompt_lookup":
        kw = {"prompt_lookup_num_tokens": 3}
    else:
        kw = {"assistant_model": seeded(LlamaForCausalLM, llama_config(num_hidden_layers=2, eos_token_id=VOCAB - 1))}
    expected = generate(model, DynamicCache(config=model.config), "sdpa", input_ids=ids, **kw)
    assert torch.equal(generate(model, make_cache("tq8", model), input_ids=ids, **kw), expected)


@pytest.mark.parametrize("kind", KINDS)
def test_pickle_and_deepcopy(llama, kind):
    cache, _ = _filled(llama, kind)
    for clone in (pickle.loads(pickle.dumps(cache)), copy.deepcopy(cache)):
        assert type(clone) is type(cache)
        _assert_same_contents(clone, cache, 0.0)  # exact copies


@pytest.mark.parametrize("kind", KINDS)
def test_cache_built_without_config(llama, kind):
    """``TQCache()`` as ``DynamicCache()``: layers added at their first update; the protected last layer is
    found at the second forward pass, before anything in it was compressed."""
    ids = prompt(seed=CLEAR)
    expected, clear = exact_greedy(llama, ids)
    cache = make_cache(kind)
    assert len(cache) == 0
    assert_greedy_matches(generate(llama, cache, "sdpa", input_ids=ids), expected, clear, ids.shape[1])
    assert len(cache) == 4 and cache.get_seq_length() == expected.shape[1] - 1
    if kind == "tq8":
        assert [type(layer) for layer in cache.layers] == [DynamicLayer, TQLayer, TQLayer, DynamicLayer]
        assert all(layer.store.compressed_length > 0 for layer in compressed_layers(cache))


@pytest.mark.parametrize("kind", KINDS)
def test_ddp_cache_data(llama, kind):
    """``cls(ddp_cache_data)``: positional (as DataParallel's gather calls it) or by keyword; a cache gathered
    from two one-row caches continues like the two-row cache it came from."""
    reference, _ = _filled(llama, "dynamic", batch=2)
    cls = type(make_cache(kind))
    data = [(layer.keys, layer.values) for layer in reference.layers]
    for cache in (cls(data), cls(ddp_cache_data=iter(data)), cls(config=llama.config, ddp_cache_data=data)):
        assert isinstance(cache, cls) and len(cache) == 4
        _assert_same_contents(cache, reference, 0.0)  # given tensors are held exactly
    rows = []
    for row in (0, 1):
        part, _ = _filled(llama, kind, batch=2)
        part.batch_select_indices(torch.tensor([row]))
        rows.append(part)
    gathered = cls(
        tuple(None if parts[0] is None else torch.cat(parts) for parts in zip(*layers)) for layers in zip(*rows)
    )
    full, _ = _filled(llama, kind, batch=2)
    _assert_same_contents(gathered, full, 0.0)  # exact: decoded tensors in full precision
    step = prompt(batch=2, length=1, seed=5)
    llama.set_attn_implementation(attention_for(kind))
    _close(forward(llama, step, gathered).logits, forward(llama, step, reference).logits, _tolerance(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_encoder_decoder_cache(kind):
    """A TQCache as the self-attention cache of an EncoderDecoderCache: crop, batch_repeat_interleave and
    batch_select_indices (DynamicCache-only methods) work, and BART's greedy and beam search decode as with
    DynamicCache."""
    config = BartConfig(
        vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=1, bos_token_id=0, eos_token_id=None, decoder_start_token_id=2, forced_eos_token_id=None,
    )  # fmt: skip
    bart = seeded(BartForConditionalGeneration, config)
    ids = prompt(batch=2, length=10)
    outputs = []
    for k in ("dynamic", kind):
        for beams in (1, 2):
            cache = EncoderDecoderCache(make_cache(k, config), DynamicCache(config=config))
            outputs.append(generate(bart, cache, attention_for(k), input_ids=ids, num_beams=beams, max_new_tokens=12))
            assert cache.get_seq_length() == outputs[-1].shape[1] - 1
    assert all(torch.equal(a, b) for a, b in zip(outputs[:2], outputs[2:]))
    if kind == "tq8":
        assert compressed_layers(cache.self_attention_cache)
    length = cache.get_seq_length()
    cache.crop(-2)
    cache.batch_repeat_interleave(2)
    cache.batch_select_indices(torch.tensor([1, 2]))
    assert cache.get_seq_length() == length - 2
    self_attention, cross_attention = cache.self_attention_cache.layers[0], cache.cross_attention_cache.layers[0]
    assert self_attention.keys.shape[0] == cross_attention.keys.shape[0] == 2


def test_head_dims_below_two_stay_dense(caplog):
    """GPT-2 with one-dimensional heads: TQCache keeps such layers as DynamicLayer (encoders need dim >= 2), so
    it decodes exactly as DynamicCache; config-less caches decide from the first states they see."""
    config = GPT2Config(vocab_size=128, n_embd=4, n_layer=3, n_head=4, n_positions=64, eos_token_id=None)
    gpt2 = seeded(GPT2LMHeadModel, config)
    ids = prompt(length=8)
    expected = generate(gpt2, DynamicCache(config=config), "sdpa", input_ids=ids)
    for cache in (TQCache(config, "tq8", "tq8", protected_layers=0), TQCache(key_encoder="tq8", protected_layers=0)):
        assert torch.equal(generate(gpt2, cache, ATTN_IMPLEMENTATION, input_ids=ids), expected)
        assert [type(layer) for layer in cache.layers] == [DynamicLayer] * 3


def test_decoding_warning_names_the_reason():
    bare = LlamaConfig()
    assert bare._attn_implementation is None
    loaded = seeded(LlamaForCausalLM, llama_config()).config
    messages = [_decoding_warning(None), _decoding_warning(bare), _decoding_warning(loaded)]
    assert "without a config" in messages[0]
    assert "names no attention implementation" in messages[1]
    assert "under 'sdpa' attention" in messages[2] or "under 'eager' attention" in messages[2]
    assert all("None" not in m and "set_attn_implementation('tqindex')" in m for m in messages)


def test_offloading_moves_codes(llama, monkeypatch):
    """``TQCache(..., offloading=True)``: decoding is unchanged (on CPU nothing moves, where DynamicCache's
    offloading needs CUDA); a layer offloads and prefetches its codes and window, never decoded tensors."""
    ids = prompt()
    expected = generate(llama, make_cache("tq8", llama), input_ids=ids)
    cache = make_cache("tq8", llama, offloading=True)
    assert torch.equal(generate(llama, cache, input_ids=ids), expected)
    layer = compressed_layers(cache)[0]
    moves = []
    monkeypatch.setattr(KVStore, "to", lambda self, device, non_blocking=False: moves.append((device, non_blocking)))
    layer.offload()
    layer.prefetch()  # already on its device: nothing to do
    assert moves == [("cpu", True)]
    monkeypatch.undo()
    planes = [t.shape for t in layer.store.tensors()]
    layer.device = torch.device("meta")  # stands for an accelerator: prefetch moves everything there
    layer.prefetch()
    assert [t.shape for t in layer.store.tensors()] == planes
    assert {t.device.type for t in layer.store.tensors()} == {"meta"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloading_on_cuda_keeps_codes_on_the_host(llama):
    model = copy.deepcopy(llama).cuda()
    ids = prompt().cuda()
    expected = generate(model, make_cache("tq8", model), input_ids=ids)
    cache = make_cache("tq8", model, offloading=True)
    assert torch.equal(generate(model, cache, input_ids=ids), expected)
    devices = [layer.store.device.type for layer in compressed_layers(cache)]
    assert devices.count("cpu") >= len(devices) - 1  # all offloaded but the one prefetched for the next step


def _decode_steps(model, cache, step, n: int, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` steps of ``step(tokens, cache)`` each beside an eager step on a copy of the same cache:
    [(logits, eager logits)]."""
    pairs, tok = [], prompt(length=1, seed=seed)
    for _ in range(n):
        twin = copy.deepcopy(cache)
        eager = forward(model, tok, twin).logits
        with torch.no_grad():
            logits = step(tok, cache)
        pairs.append((logits, eager))
        tok = logits[:, -1:].argmax(-1)
    return pairs


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("kind,impl", [("dynamic", "sdpa"), ("tq8", "sdpa"), ("tq8", ATTN_IMPLEMENTATION)])
def test_compiled_decode_step(llama, kind, impl):
    """``torch.compile(decode_step, fullgraph=True)``: one graph, matching eager; after the first steps the
    growing cache compiles nothing new."""
    cache, _ = _filled(llama, kind)
    llama.set_attn_implementation(impl)
    torch._dynamo.reset()

    def decode_step(tok: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        return llama(tok, **{CACHE_KW: cache}, use_cache=True).logits

    compiled = torch.compile(decode_step, fullgraph=True)
    pairs = _decode_steps(llama, cache, compiled, 2)  # compiles, then once more with dynamic lengths
    with torch.compiler.set_stance("fail_on_recompile"):
        pairs += _decode_steps(llama, cache, compiled, 3, seed=8)
    for logits, eager in pairs:
        torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() == PREFILL + STEPS + 5


@pytest.mark.parametrize("kind", KINDS)
def test_exported_decode_step(llama, kind):
    """``torch.export`` of a decode step taking and returning the cache; the exported program gives the
    eager logits and cache."""
    if kind == "dynamic":
        from transformers.integrations.executorch import register_dynamic_cache_export_support

        register_dynamic_cache_export_support()
    cache, _ = _filled(llama, kind)
    llama.set_attn_implementation(attention_for(kind))

    class DecodeStep(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = llama

        def forward(self, tok: torch.Tensor, cache: DynamicCache) -> tuple[torch.Tensor, DynamicCache]:
            return self.model(tok, **{CACHE_KW: cache}, use_cache=True).logits, cache

    tok = prompt(length=1, seed=3)
    with torch.no_grad():
        program = torch.export.export(DecodeStep(), (tok, copy.deepcopy(cache)))
        logits, updated = program.module()(tok, copy.deepcopy(cache))
    expected = forward(llama, tok, cache).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert type(updated) is type(cache)
    _assert_same_contents(updated, cache, 1e-6)  # float rounding only
    if kind == "tq8":
        assert [type(layer) for layer in updated.layers] == [type(layer) for layer in cache.layers]
        flat, spec = torch.utils._pytree.tree_flatten(cache)
        assert all(isinstance(t, torch.Tensor) for t in flat)
        assert spec == torch.utils._pytree.tree_structure(copy.deepcopy(cache))
        _assert_same_contents(torch.utils._pytree.tree_unflatten(flat, spec), cache, 0.0)
