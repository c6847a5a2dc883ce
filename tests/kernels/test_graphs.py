"""CUDA graphs of repeated searches (tqindex.kernels.graphs): replays equal eager searches, follow the index's
writes, redo searches whose deferred checks fire, fall back where a search cannot be recorded, and stay
correct under concurrent searches. CUDA only."""

import inspect
import threading

import pytest
import torch

import tqindex as tq
from tqindex.kernels import graphs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
DEV = torch.device("cuda")


def unit(n, d, seed):
    x = torch.randn(n, d, device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed))
    return x / x.norm(dim=1, keepdim=True)


def flat(x, **kw):
    index = tq.FlatIndex(tq.make_encoder("tq4", x.shape[1], seed=3), device=DEV, **kw)
    index.add(x)
    return index


def recorded(index):
    return [k for k, g in index._graphs._graphs.items() if isinstance(g, graphs._Graph)]


def assert_same(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    assert torch.equal(a[1], b[1])


def assert_checks_hold(index, cos, q):
    """Queries q [>= 2, 64]: one with a NaN, or all with norms beyond an "ip" index's range, raise; "cosine" queries
    that need the exact-rescaling path get their unit rows' results."""
    bad = q.clone()
    bad[1, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        index.search(bad, 5)
    with pytest.raises(ValueError, match="norms outside"):
        index.search(q * 2.0**70, 5)
    assert_same(cos.search(q * 2.0**50, 5), cos.search(q, 5))


@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
def test_replay_equals_eager(metric):
    x = unit(70_001, 60, 1) * (2.0 if metric == "l2" else 1.0)
    index = flat(x, metric=metric)
    queries = [unit(5, 60, s) for s in (10, 11, 12, 13)]
    expected = [flat(x, metric=metric).search(q, 10) for q in queries]  # first sight: eager
    for q, e in zip(queries, expected):  # eager, eager, recorded and replayed, replayed
        assert_same(index.search(q, 10), e)
    assert recorded(index) == [((5, 60), torch.float32, 10)]
    assert_same(index.search(queries[0], 10), expected[0])
    checks = index._graphs._graphs[((5, 60), torch.float32, 10)].checks  # the queries' validation
    external = "external" in inspect.signature(torch.cuda.Event.__new__).parameters  # torch >= 2.8
    assert checks and all((c.ready is not None) == external for c in checks)  # replays return after the checks


def test_graphs_follow_writes():
    x, q = unit(50_000, 64, 1), unit(3, 64, 2)
    index = flat(x)
    for _ in range(3):
        index.search(q, 5)
    index.add(q, ids=torch.arange(10**6, 10**6 + 3))  # drops the graphs: the state changed
    for _ in range(3):
        D, I = index.search(q, 5)
        assert torch.equal(I[:, 0].cpu(), torch.arange(10**6, 10**6 + 3))
    index.remove_ids([10**6 + 1])
    D, I = index.search(q, 5)
    assert 10**6 + 1 not in I.tolist()[1] and I[0, 0] == 10**6


def test_overflowing_filter_searches_again():
    """Every row reaches the sampled bound (all rows equal): the filtering scan overflows, and the replay itself
    scans those queries again with a running top-k."""
    x = unit(1, 64, 1).expand(200_000, 64).contiguous()
    index = flat(x)
    q = unit(2, 64, 5)
    first = index.search(q, 10)
    for _ in range(3):
        D, I = index.search(q, 10)
        assert_same((D, I), first)
    key = ((2, 64), torch.float32, 10)
    assert recorded(index) == [key]


@pytest.mark.parametrize("kind", ["keep_vectors", "ivf"])
def test_unrecordable_searches_run_eagerly(kind):
    """Searches that read device values on the host (re-ranking, IVF probe plans) are remembered as not
    recordable; flat searches afterwards still record and replay."""
    x, q = unit(30_000, 64, 1), unit(4, 64, 2)
    if kind == "ivf":
        index = tq.IVFIndex(tq.make_encoder("tq4", 64, seed=3), nlist=16, device=DEV)
        index.train(x)
        index.add(x)
    else:
        index = flat(x, keep_vectors=True)
    results = [index.search(q, 10) for _ in range(3)]
    for r in results[1:]:
        assert_same(r, results[0])
    assert recorded(index) == []
    plain = flat(x)
    reference = flat(x).search(q, 10)
    for _ in range(3):
        assert_same(plain.search(q, 10), reference)


def test_concurrent_replays():
    x = unit(100_000, 64, 1)
    index = flat(x)
    queries = [unit(4, 64, 100 + i) for i in range(8)]
    expected = [flat(x).search(q, 10) for q in queries]
    for _ in range(graphs.RECORD_AT):  # recorded at the last
        index.search(queries[0], 10)
    failures = []

    def worker(t):
        with torch.cuda.stream(torch.cuda.Stream() if t % 2 else torch.cuda.current_stream()):
            search_many(t)

    def search_many(t):
        for r in range(20):
            i = (t + r) % len(queries)
            D, I = index.search(queries[i], 10)
            if not torch.equal(I, expected[i][1]):
                failures.append((t, r))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def test_replays_validate_their_queries():
    """Checks of the queries run inside the graph: a bad query found after a replay raises as an eager
    search does, a query that needs the rare exact-rescaling path is searched again eagerly."""
    x, q = unit(20_000, 64, 1), unit(3, 64, 2)
    index, cos = flat(x), flat(x, metric="cosine")
    for i in (index, cos):
        for _ in range(graphs.RECORD_AT):
            i.search(q, 5)
    assert recorded(index) == recorded(cos) == [((3, 64), torch.float32, 5)]
    assert_checks_hold(index, cos, q)
    D, I = index.search(q.cpu().numpy(), 5)  # numpy in, numpy out, through the graph of the same shape
    assert torch.equal(torch.from_numpy(I), index.search(q, 5)[1].cpu())


def test_cuda_graphs_limits_what_is_recorded():
    """cuda_graphs = 0 drops the recorded shapes and records none; more than MAX_QUERIES queries are never
    recorded; at most cuda_graphs shapes are kept, the least recently used dropped."""
    index = flat(unit(20_000, 64, 1))
    qs = {n: unit(n, 64, n) for n in (1, 2, 3, graphs.MAX_QUERIES + 1)}
    first = {}
    for n, q in qs.items():
        results = [index.search(q, 5) for _ in range(graphs.RECORD_AT + 1)]
        first[n] = results[0]
        assert_same(results[-1], results[0])
    assert recorded(index) == [((n, 64), torch.float32, 5) for n in (1, 2, 3)]
    index.cuda_graphs = 2
    assert recorded(index) == [((n, 64), torch.float32, 5) for n in (2, 3)]
    index.cuda_graphs = 0
    assert not index._graphs._graphs
    for _ in range(graphs.RECORD_AT + 1):
        assert_same(index.search(qs[1], 5), first[1])
    assert not index._graphs._graphs


def test_eager_searches_defer_their_checks():
    """A search too large to record launches all its work before it looks at its checks, and waits for nothing
    else on the device: a bad query still raises as before, a query that needs the exact-rescaling path is
    searched again with checks that look at once."""
    x, q = unit(20_000, 64, 1), unit(graphs.MAX_QUERIES + 1, 64, 2)
    index, cos = flat(x), flat(x, metric="cosine")
    expected = index.search(q, 5)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a device read on the host raises (and the search is run again)
    try:
        results = [index.search(q, 5) for _ in range(2)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for r in results:
        assert_same(r, expected)
    assert_checks_hold(index, cos, q)
    assert not index._graphs._graphs
