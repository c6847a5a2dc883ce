"""DecodeGraph: decode steps over static stores (eagerly on CPU, replayed from CUDA graphs on a GPU) give the
logits of ordinary decoding over a growing cache."""

import pytest
import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from tiny import CACHE_KW, CLEAR, gemma2_config, llama_config, prompt, seeded
from tqindex import kernels
from tqindex.kv import DecodeGraph, TQCache, TQLayer, decode_graphs
from tqindex.kv.hf import KEEP_ALL, LAYER_GRAPHS
from tqindex.kernels.graphs import _Graph

torch.set_num_threads(1)
CUDA = torch.device("cuda")


def _model(device: torch.device = torch.device("cpu"), dtype: torch.dtype = torch.float32, **config):
    from transformers import LlamaForCausalLM

    model = seeded(LlamaForCausalLM, llama_config(**config)).to(device, dtype)
    model.set_attn_implementation("tqindex")
    return model


def _cache(model, backend: str | None = None, protected: int = 0, values: str = "tq3",
           layer_graphs: int = LAYER_GRAPHS) -> TQCache:
    return TQCache(model.config, "tq4", values, residual_length=4, protected_layers=protected, sink_length=2,
                   encode_stride=3, backend=backend, layer_graphs=layer_graphs)


def _decode(model, cache, ids: torch.Tensor, steps: int, graph: DecodeGraph | None) -> list[torch.Tensor]:
    """Prefill ``ids``, then ``steps`` greedy one-token steps (through ``graph`` if given) -> logits per step."""
    with torch.no_grad():
        logits = model(input_ids=ids, **{CACHE_KW: cache}, logits_to_keep=1).logits[:, -1]
        out = []
        for _ in range(steps):
            token = logits.argmax(-1, keepdim=True)
            logits = graph(token) if graph else model(input_ids=token, **{CACHE_KW: cache}).logits[:, -1]
            out.append(logits.float())
    return out


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_static_steps_give_the_logits_of_growing_steps(backend):
    if not kernels.can_run(backend, torch.device("cpu")):
        pytest.skip(f"{backend} cannot run here")
    dtype = torch.float16 if backend == "triton" else torch.float32  # the interpreter's dot: fp16
    model, ids = _model(dtype=dtype), prompt(2, 9)
    steps = 12 if backend == "torch" else 5
    want = _decode(model, _cache(model, backend), ids, steps, None)
    cache = _cache(model, backend)
    got = _decode(model, cache, ids, steps, DecodeGraph(model, cache, headroom=2))
    assert all(layer.store.static for layer in cache.layers)
    assert cache.get_seq_length() == ids.shape[1] + steps
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    cache.crop(-steps)  # edits return the stores to the growing mode
    assert not any(layer.store.static for layer in cache.layers)


def test_dense_layers_become_layers_that_keep_every_token():
    """A TQCache's protected layers become TQLayers whose window holds every token: the same values, the same
    bytes, the same logits (their buffers fill, and grow, every 3 steps here)."""
    model, ids = _model(), prompt(2, 9)
    growing = _cache(model, protected=1)
    want = _decode(model, growing, ids, 8, None)
    cache = _cache(model, protected=1)
    got = _decode(model, cache, ids, 8, DecodeGraph(model, cache, headroom=3))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for i in (0, 3):
        layer = cache.layers[i]
        assert isinstance(layer, TQLayer) and layer.store.compressed_length == 0
        torch.testing.assert_close(layer.keys, growing.layers[i].keys)  # (layer 3's: after float-rounded layers)
        torch.testing.assert_close(layer.values, growing.layers[i].values)
        assert layer.nbytes() == 2 * layer.keys.numel() * layer.keys.element_size()


def test_edits_between_steps_are_followed():
    """reorder_cache and crop between DecodeGraph steps (beam search, speculative decoding) return the stores to
    the growing mode; the next step makes them static again. After a reorder the logits are those of
    growing-cache decoding; after a crop the static stores may hold in full precision up to encode_stride
    tokens that the growing ones had encoded (a static store encodes before the step that needs the room,
    a growing one after each step): near, not equal."""
    model, ids = _model(), prompt(2, 9)
    caches = [_cache(model, protected=1), _cache(model, protected=1)]
    graph = DecodeGraph(model, caches[1], headroom=2)
    logits = []
    with torch.no_grad():
        for cache in caches:
            logits.append(model(input_ids=ids, **{CACHE_KW: cache}, logits_to_keep=1).logits[:, -1])
        for step in range(9):
            token = logits[0].argmax(-1, keepdim=True)
            if step == 3:
                for cache in caches:
                    cache.reorder_cache(torch.tensor([1, 0]))
            if step == 6:
                for cache in caches:
                    cache.crop(-2)
            logits = [model(input_ids=token, **{CACHE_KW: caches[0]}).logits[:, -1], graph(token)]
            assert caches[1].get_seq_length() == caches[0].get_seq_length()
            if step < 6:
                torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
            else:
                assert float((logits[1] - logits[0]).norm() / logits[0].norm()) < 0.05


def test_bad_caches_and_input_are_refused():
    model = _model()
    ids = prompt(1, 5)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, **{CACHE_KW: cache})
    with pytest.raises(ValueError, match="layer 0 is a DynamicLayer"):
        DecodeGraph(model, cache)(ids[:, :1])
    cache = _cache(model, protected=1)
    with torch.no_grad():
        model(input_ids=ids, **{CACHE_KW: cache})
    cache.layers[1] = DynamicSlidingWindowLayer(4)
    with pytest.raises(ValueError, match="layer 1 is a DynamicSlidingWindowLayer"):
        DecodeGraph(model, cache)(ids[:, :1])
    assert type(cache.layers[0]) is DynamicLayer  # left as it was
    offloaded = TQCache(model.config, protected_layers=0, offloading=True)
    with torch.no_grad():
        model(input_ids=ids, **{CACHE_KW: offloaded})
    with pytest.raises(ValueError, match="offloading"):
        DecodeGraph(model, offloaded)(ids[:, :1])
    for protected in (0, 1):
        with pytest.raises(ValueError, match="prefill"):
            DecodeGraph(model, _cache(model, protected=protected))(ids[:, :1])
    cache = _cache(model)
    graph = DecodeGraph(model, cache)
    with torch.no_grad():
        model(input_ids=ids, **{CACHE_KW: cache})
    for bad in (ids, ids[:, :1].int(), ids[0, :1]):
        with pytest.raises(ValueError, match=r"long tensor \[B, 1\]"):
            graph(bad)
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="'tqindex' attention"):
        graph(ids[:, :1])
    with pytest.raises(ValueError, match="headroom"):
        DecodeGraph(model, cache, headroom=-1)


def _sliding_model():
    """Tiny Gemma2 with the "tqindex" attention: sliding-window layers (8 tokens) between full ones."""
    from transformers import Gemma2ForCausalLM

    model = seeded(Gemma2ForCausalLM, gemma2_config())
    model.set_attn_implementation("tqindex")
    return model


def _generate(model, cache, ids: torch.Tensor, tokens: int, **kw) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy ``model.generate`` -> (the ids [B, T + tokens], the logits of each new token)."""
    out = model.generate(ids, max_new_tokens=tokens, do_sample=False, return_dict_in_generate=True, output_logits=True,
                         **{CACHE_KW: cache}, **kw)
    return out.sequences, [x.float() for x in out.logits]


def test_generate_under_decode_graphs_gives_the_tokens_of_eager_generate():
    """model.generate within decode_graphs: the prefill eager, every later step through one DecodeGraph (static
    stores; replayed on CUDA, below), the same tokens and logits; model.forward itself again after the block."""
    model, ids = _model(), prompt(2, 9, seed=CLEAR)
    want, want_logits = _generate(model, _cache(model, protected=1), ids, 10)
    cache = _cache(model, protected=1)
    with decode_graphs(model) as steps:
        got, logits = _generate(model, cache, ids, 10)
    assert "forward" not in model.__dict__
    assert (steps.eager, steps.replayed) == (1, 9)
    assert all(type(layer) is TQLayer and layer.store.static for layer in cache.layers)
    assert torch.equal(got, want)
    for a, b in zip(logits, want_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_decode_graphs_leaves_other_calls_to_the_model():
    """Padding (a zero in the mask), caches other than TQCache, another attention, sliding-window layers: the model's
    own forward; an error inside the block still restores model.forward."""
    model, ids = _model(), prompt(2, 9, seed=CLEAR)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    want, _ = _generate(model, _cache(model), ids, 4, attention_mask=mask)
    with decode_graphs(model) as steps:
        got, _ = _generate(model, _cache(model), ids, 4, attention_mask=mask)
        _generate(model, DynamicCache(config=model.config), ids, 4)
        model.set_attn_implementation("sdpa")
        _generate(model, _cache(model), ids, 4)
    assert torch.equal(got, want)
    assert (steps.eager, steps.replayed) == (12, 0)
    gemma2 = _sliding_model()
    want, _ = _generate(gemma2, TQCache(gemma2.config, "tq8", "tq8", residual_length=4), ids, 4)
    with decode_graphs(gemma2) as steps:
        got, _ = _generate(gemma2, TQCache(gemma2.config, "tq8", "tq8", residual_length=4), ids, 4)
    assert torch.equal(got, want) and (steps.eager, steps.replayed) == (4, 0)
    with pytest.raises(RuntimeError, match="inside"):
        with decode_graphs(model):
            raise RuntimeError("inside")
    assert "forward" not in model.__dict__
    with pytest.raises(ValueError, match="headroom"):
        with decode_graphs(model, headroom=0):
            pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_replayed_graphs_give_the_logits_of_growing_steps_on_cuda():
    model = _model(CUDA, torch.float16)
    ids = prompt(2, 250).to(CUDA)  # about 245 codes: their buffers (256 tokens) grow within 40 steps
    want = _decode(model, _cache(model), ids, 40, None)
    cache = _cache(model)
    graph = DecodeGraph(model, cache, headroom=8)
    got = _decode(model, cache, ids, 40, graph)
    assert graph.recordings == 2  # recorded at the second step, again once the code buffers grew
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_layer_graphs_are_for_cuda_steps():
    model = _model()
    cache = _cache(model)
    assert LAYER_GRAPHS and all(layer.layer_graphs == LAYER_GRAPHS for layer in cache.layers)  # on by default
    _decode(model, cache, prompt(2, 20), 3, None)
    assert not any(layer.store.static for layer in cache.layers)  # on the CPU the stores keep growing
    with pytest.raises(ValueError, match="layer_graphs"):
        _cache(model, layer_graphs=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("values, dim", [("tq3", 32), ("tq4", 64)])  # Triton kernels alone; the CUDA kernel too
def test_eager_steps_on_cuda_replay_each_layers_attention(values, dim):
    """Compressed layers (1, 2) and dense ones (0, 3: turned into layers that keep every token at the first step)."""
    model = _model(CUDA, torch.float16, head_dim=dim)
    ids = prompt(2, 250).to(CUDA)
    growing = _cache(model, values=values, protected=1, layer_graphs=0)
    want = _decode(model, growing, ids, 40, None)
    cache = _cache(model, values=values, protected=1)
    got = _decode(model, cache, ids, 40, None)
    assert [type(layer) for layer in growing.layers] == [DynamicLayer, TQLayer, TQLayer, DynamicLayer]
    assert all(type(layer) is TQLayer for layer in cache.layers)
    assert [layer.store.residual_length == KEEP_ALL for layer in cache.layers] == [True, False, False, True]
    stores = [layer.store for layer in cache.layers]
    assert all(store.static for store in stores) and not any(layer.store.static for layer in growing.layers[1:3])
    for store in stores:  # recorded once at its third call, replayed since (one shape, the same buffers)
        assert [type(g) for g in store._static.graphs._graphs.values()] == [_Graph]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    cache.crop(-5)  # edits return to growing stores; the second step after one goes static again
    assert not any(store.static for store in stores)
    _decode(model, cache, ids[:, -1:], 0, None)
    assert not any(store.static for store in stores)
    _decode(model, cache, ids[:, -1:], 1, None)
    assert all(store.static for store in stores)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_steps_with_edits_between_them_keep_growing_stores():
    """Beam search reorders the cache between steps: a static store would go back to growing at each reorder, its
    buffers copied to fixed ones at each step for nothing."""
    model = _model(CUDA, torch.float16)
    cache = _cache(model)
    _decode(model, cache, prompt(2, 20).to(CUDA), 0, None)
    token = torch.ones(2, 1, dtype=torch.long, device=CUDA)
    with torch.no_grad():
        for _ in range(4):
            model(input_ids=token, **{CACHE_KW: cache})
            assert not any(layer.store.static for layer in cache.layers)
            cache.reorder_cache(torch.tensor([1, 0], device=CUDA))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_generate_under_decode_graphs_replays_its_steps_on_cuda():
    model = _model(CUDA, torch.float16)
    ids = prompt(2, 250).to(CUDA)
    want, want_logits = _generate(model, _cache(model, protected=1), ids, 30)
    with decode_graphs(model) as steps:
        got, logits = _generate(model, _cache(model, protected=1), ids, 30)
        assert steps._graph.recordings == 1  # at the second step (buffers with room for 1024 tokens more)
    assert (steps.eager, steps.replayed) == (1, 29)
    assert torch.equal(got[:, :ids.shape[1] + 5], want[:, :ids.shape[1] + 5])  # (later near ties may flip in fp16)
    for a, b in zip(logits[:5], want_logits[:5]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_decode_graphs_gives_up_on_a_cache_edited_between_steps():
    """A reorder between steps (beam search) makes every step a new recording: from the second in a row on, the
    cache's steps run eagerly."""
    model = _model(CUDA, torch.float16)
    cache = _cache(model)
    token = torch.ones(2, 1, dtype=torch.long, device=CUDA)
    with torch.no_grad(), decode_graphs(model) as steps:
        model(input_ids=prompt(2, 20).to(CUDA), **{CACHE_KW: cache})
        for _ in range(5):
            model(input_ids=token, **{CACHE_KW: cache})
            cache.reorder_cache(torch.tensor([1, 0], device=CUDA))
    assert (steps.eager, steps.replayed) == (3, 3)  # the prefill, then eager steps 4 and 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_replayed_static_cache_gives_the_logits_of_a_dynamic_cache():
    model = _model(CUDA, torch.float16)
    model.set_attn_implementation("sdpa")
    ids = prompt(2, 20).to(CUDA)
    want = _decode(model, DynamicCache(config=model.config), ids, 10, None)
    cache = StaticCache(config=model.config, max_cache_len=64)
    got = _decode(model, cache, ids, 10, DecodeGraph(model, cache))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_failed_recording_leaves_the_cache_length(monkeypatch):
    model = _model(CUDA, torch.float16)
    cache = _cache(model)
    graph = DecodeGraph(model, cache)
    logits = _decode(model, cache, prompt(2, 20).to(CUDA), 1, graph)  # the prefill and the eager first step
    length = cache.get_seq_length()
    forward = model.forward

    def failing(*args, **kwargs):
        forward(*args, **kwargs)
        raise RuntimeError("recording failed")

    monkeypatch.setattr(model, "forward", failing)
    with pytest.raises(RuntimeError):
        graph(logits[-1].argmax(-1, keepdim=True))
    assert cache.get_seq_length() == length
