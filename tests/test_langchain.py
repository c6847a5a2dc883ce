import json
import socket

import numpy as np
import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_tests")
import pytest_socket  # noqa: E402  (installed with langchain-tests)
from langchain_core.documents import Document  # noqa: E402
from langchain_core.embeddings import DeterministicFakeEmbedding  # noqa: E402
from langchain_tests.integration_tests import VectorStoreIntegrationTests  # noqa: E402

import tqindex as tq  # noqa: E402
from tqindex.langchain import TQVectorStore  # noqa: E402


@pytest.fixture(autouse=True)
def offline():
    """No network socket can be opened (local ones stay allowed for the asyncio event loop)."""
    pytest_socket.disable_socket(allow_unix_socket=True)
    yield
    pytest_socket.enable_socket()


class TestStandardSuite(VectorStoreIntegrationTests):
    """langchain-tests' standard vector-store suite (6-d deterministic fake embeddings)."""

    @pytest.fixture()
    def vectorstore(self):
        yield TQVectorStore(self.get_embeddings())


WORDS = [f"word {i}" for i in range(60)]


def store_with_words(**kw):
    store = TQVectorStore(DeterministicFakeEmbedding(size=32), **kw)
    store.add_texts(WORDS, metadatas=[{"i": i, "parity": i % 2, "tens": i // 10} for i in range(60)],
                    ids=[f"id{i}" for i in range(60)])
    return store


@pytest.mark.filterwarnings("ignore:A test tried to use socket.socket")
def test_network_is_off():
    with pytest.raises(pytest_socket.SocketBlockedError):
        socket.socket(socket.AF_INET, socket.SOCK_STREAM)


def test_scores_are_the_index_scores():
    store = store_with_words()
    assert len(store) == 60 and store.index.ntotal == 60 and store.index.metric == "cosine"
    hits = store.similarity_search_with_score("word 7", k=5)
    assert hits[0][0] == Document(page_content="word 7", metadata={"i": 7, "parity": 1, "tens": 0}, id="id7")
    q = np.asarray(store.embeddings.embed_query("word 7"), dtype=np.float32)[None]
    scores, keys = store.index.search(q, 5)
    assert [s for _, s in hits] == pytest.approx(scores[0].tolist())
    assert [d.id for d, _ in hits] == [store._docs[k][0] for k in keys[0].tolist()]
    assert hits[0][1] > 0.95 and all(a[1] >= b[1] for a, b in zip(hits, hits[1:]))
    relevance = store.similarity_search_with_relevance_scores("word 7", k=5)
    assert [r for _, r in relevance] == pytest.approx([(1 + s) / 2 for _, s in hits])
    assert [d.id for d in store.similarity_search_by_vector(q[0].tolist(), k=5)] == [d.id for d, _ in hits]
    # l2 scores are squared distances, smallest first
    l2 = store_with_words(metric="l2").similarity_search_with_score("word 7", k=3)
    assert l2[0][0].id == "id7" and l2[0][1] < l2[1][1] <= l2[2][1]


def test_metadata_filter_searches_only_matching_documents(monkeypatch):
    store = store_with_words()
    allowed = []
    search = store.index.search
    monkeypatch.setattr(store.index, "search",
                        lambda q, k, allow=None, **kw: (allowed.append(allow), search(q, k, allow=allow, **kw))[1])
    hits = store.similarity_search_with_score("word 7", k=60, filter={"parity": 0, "tens": 2})
    assert sorted(d.metadata["i"] for d, _ in hits) == [20, 22, 24, 26, 28]  # k larger than the matches
    assert sorted(allowed[-1]) == sorted(store._keys[f"id{i}"] for i in (20, 22, 24, 26, 28))  # index allowlist
    everything = store.similarity_search_with_score("word 7", k=60)
    order = [d.id for d, _ in everything if d.metadata["parity"] == 0 and d.metadata["tens"] == 2]
    assert [d.id for d, _ in hits] == order  # the same ranking, restricted
    top = store.similarity_search("word 7", k=3, filter=lambda m: m["i"] >= 50)
    assert len(top) == 3 and all(d.metadata["i"] >= 50 for d in top)
    assert store.similarity_search("word 7", k=3, filter={"parity": 5}) == []
    assert store.similarity_search("word 7", k=3, filter={"missing": None}) == []
    with pytest.raises(TypeError, match="filter must be a dict"):
        store.similarity_search("word 7", filter=["parity"])


def test_delete_upsert_and_get():
    store = store_with_words()
    store.delete(["id3", "id4", "nope"])
    assert len(store) == 58 and store.index.ntotal == 58
    assert store.get_by_ids(["id5", "id3", "id6"]) == [
        Document(page_content="word 5", metadata={"i": 5, "parity": 1, "tens": 0}, id="id5"),
        Document(page_content="word 6", metadata={"i": 6, "parity": 0, "tens": 0}, id="id6")]
    store.add_texts(["word 5"], metadatas=[{"new": True}], ids=["id5"])
    assert len(store) == 58 and store.get_by_ids(["id5"])[0].metadata == {"new": True}
    store.get_by_ids(["id5"])[0].metadata["new"] = False  # documents handed out are copies
    assert store.get_by_ids(["id5"])[0].metadata == {"new": True}
    store.delete()
    assert len(store) == 0 and store.index.ntotal == 0 and store.similarity_search("word 5") == []


def test_save_and_load_local(tmp_path):
    store = store_with_words(factory="tq2", keep_vectors=True)
    store.delete(["id0"])
    store.save_local(tmp_path / "store")
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["docstore.json", "index.tqi"]
    state = json.loads((tmp_path / "store" / "docstore.json").read_text())
    assert state["factory"] == "tq2" and len(state["documents"]) == 59
    loaded = TQVectorStore.load_local(tmp_path / "store", DeterministicFakeEmbedding(size=32))
    assert loaded.index.keep_vectors and loaded.index.encoder.bits == 2
    for query in ("word 7", "word 33"):
        assert loaded.similarity_search_with_score(query, k=8) == store.similarity_search_with_score(query, k=8)
    assert loaded.similarity_search("word 7", k=4, filter={"tens": 1}) == store.similarity_search(
        "word 7", k=4, filter={"tens": 1})
    ids = loaded.add_texts(["fresh"])  # new documents get new keys after loading
    assert len(loaded) == 60 and loaded.similarity_search("fresh", k=1)[0].id == ids[0]
    empty = TQVectorStore(DeterministicFakeEmbedding(size=8), factory="tq3")
    empty.save_local(tmp_path / "empty")
    again = TQVectorStore.load_local(tmp_path / "empty", DeterministicFakeEmbedding(size=8))
    assert again.index is None and again.factory == "tq3"
    again.add_texts(["a", "b"])
    assert again.index.encoder.bits == 3 and len(again) == 2


def test_load_refuses_damaged_or_mismatched_folders(tmp_path):
    emb = DeterministicFakeEmbedding(size=16)
    store = TQVectorStore.from_texts(["a", "b", "c"], emb, ids=["1", "2", "3"])
    folder = tmp_path / "store"
    store.save_local(folder)
    docstore = folder / "docstore.json"
    good = docstore.read_text()
    with pytest.raises(FileNotFoundError, match="docstore.json"):
        TQVectorStore.load_local(tmp_path / "nothing", emb)
    for text, match in [("{not json", "not valid JSON"),
                        ('{"format": "other"}', "not a TQVectorStore docstore"),
                        (good.replace('"version": 1', '"version": 9'), "version 9"),
                        (good.replace('"text": "a"', '"text": 5'), "damaged docstore")]:
        docstore.write_text(text)
        with pytest.raises(ValueError, match=match):
            TQVectorStore.load_local(folder, emb)
    docstore.write_text(good)
    store.delete(["2"])
    store.index.save(folder / "index.tqi")  # the index changed, the docstore did not
    with pytest.raises(ValueError, match="do not match"):
        TQVectorStore.load_local(folder, emb)


def test_indexes_and_bad_arguments():
    emb = DeterministicFakeEmbedding(size=16)
    with pytest.raises(ValueError, match="unknown encoder name 'tq7'"):
        TQVectorStore(emb, factory="tq7")
    with pytest.raises(TypeError, match="embedding must be"):
        TQVectorStore("not an embedding")
    untrained = TQVectorStore(emb, factory="IVF4,tq4")
    with pytest.raises(ValueError, match="needs training"):
        untrained.add_texts(["a"])
    assert len(untrained) == 0
    index = tq.index_factory(16, "IVF4,tq4", metric="cosine", nprobe=4)
    index.train(np.asarray(emb.embed_documents([f"t{i}" for i in range(64)]), dtype=np.float32))
    store = TQVectorStore(emb, index=index)
    store.add_texts([f"t{i}" for i in range(20)])
    assert store.similarity_search("t3", k=1, nprobe=4)[0].page_content == "t3"
    with pytest.raises(TypeError, match="unexpected keyword argument 'fetch'"):
        store.similarity_search("t3", fetch=3)
    with pytest.raises(ValueError, match="must be empty"):
        TQVectorStore(emb, index=index)
    with pytest.raises(TypeError, match=r"index options \['nprobe'\]"):
        TQVectorStore(emb, index=tq.index_factory(16, "tq4"), nprobe=2)
    with pytest.raises(TypeError, match=r"metadatas\[1\] must be JSON-serialisable"):
        store.add_texts(["x", "y"], metadatas=[{}, {"when": object()}])
    with pytest.raises(ValueError, match="distinct"):
        store.add_texts(["x", "y"], ids=["same", "same"])
    with pytest.raises(ValueError, match="one entry per text"):
        store.add_texts(["x", "y"], metadatas=[{}])
    assert len(store) == 20  # failed adds changed nothing
    assert store.add_texts(["x"], metadatas=[{"t": (1, 2)}])  # stored as JSON reads it back: a list
    assert store.similarity_search("x", k=1)[0].metadata == {"t": [1, 2]}
