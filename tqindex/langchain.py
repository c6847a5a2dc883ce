"""A LangChain vector store over a tqindex index: ``TQVectorStore`` (needs ``pip install 'tqindex[langchain]'``).

    from tqindex.langchain import TQVectorStore

    store = TQVectorStore(embeddings, factory="tq4", metric="cosine")
    ids = store.add_texts(["a cat", "a dog"], metadatas=[{"kind": "cat"}, {"kind": "dog"}])
    store.similarity_search_with_score("kitten", k=1, filter={"kind": "cat"})
    store.save_local("my_store")                      # index.tqi (HDF5) + docstore.json
    store = TQVectorStore.load_local("my_store", embeddings)

The embeddings are compressed by the index's encoder (4 bits per coordinate with ``"tq4"``); texts and
metadata are kept in memory beside it and saved as JSON, so metadata must be JSON-serialisable (it is
stored as it reads back from JSON: tuples become lists, keys become strings). Metadata filters are
applied inside the index scan through its allowlist (``index.search(q, k, allow=ids)``).
"""

from __future__ import annotations

import copy
import json
import math
import os
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

try:
    from langchain_core.documents import Document
    from langchain_core.embeddings import Embeddings
    from langchain_core.vectorstores import VectorStore
except ModuleNotFoundError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tqindex.langchain needs langchain-core: pip install 'tqindex[langchain]'") from e

from .factory import index_factory
from .index import BaseIndex
from .io import atomic_path, load_index

INDEX_FILE = "index.tqi"
DOCSTORE_FILE = "docstore.json"
DOCSTORE_FORMAT = "tqindex-langchain-docstore"
DOCSTORE_VERSION = 1

Filter = dict[str, Any] | Callable[[dict[str, Any]], bool]
"""Metadata filter: ``{key: value, ...}`` (every key equal) or a predicate on a document's metadata."""


class TQVectorStore(VectorStore):
    """LangChain ``VectorStore`` whose embeddings live compressed in a tqindex index.

    embedding: the LangChain ``Embeddings`` that turns texts into vectors. index: an empty
    :class:`~tqindex.FlatIndex` / :class:`~tqindex.IVFIndex` to use (trained already where it
    needs training, e.g. IVF); when None, one is made at the first add by
    ``index_factory(dim, factory, metric=metric, **index_options)``.

    Scores returned with documents are the index's: cosine similarity or inner product (larger is
    closer) for "cosine"/"ip", squared L2 distance (smaller is closer) for "l2". Relevance scores
    (``similarity_search_with_relevance_scores``) map them to [0, 1] assuming unit-length embeddings.
    """

    def __init__(self, embedding: Embeddings, index: BaseIndex | None = None, *, factory: str = "tq4",
                 metric: str = "cosine", **index_options: Any) -> None:
        if not isinstance(embedding, Embeddings):
            raise TypeError(f"embedding must be a langchain_core Embeddings, got {type(embedding).__name__}")
        if index is not None:
            if not isinstance(index, BaseIndex):
                raise TypeError(f"index must be a tqindex FlatIndex or IVFIndex (or None), got {type(index).__name__}")
            if index.ntotal:
                raise ValueError(f"index must be empty (its documents are unknown), it holds {index.ntotal} vectors")
            if index_options:
                raise TypeError(f"index options {sorted(index_options)} apply to an index the store makes; "
                                "set them on the index passed as index=")
            factory, metric, index_options = None, index.metric, {}
        else:  # check the description and options now, not after the first texts are embedded
            index_factory(2, factory, metric=metric, **index_options)
        self.embedding = embedding
        self.index = index
        self.factory, self.metric, self.index_options = factory, metric, index_options
        self._docs: dict[int, tuple[str, str, dict]] = {}  # index id -> (document id, text, metadata)
        self._keys: dict[str, int] = {}  # document id -> index id
        self._next_key = 0
        self._lock = threading.RLock()

    @property
    def embeddings(self) -> Embeddings:
        """The embedding model."""
        return self.embedding

    def __len__(self) -> int:
        return len(self._docs)

    # -- add / delete / get ---------------------------------------------------------------------------
    def add_texts(self, texts: Iterable[str], metadatas: list[dict] | None = None, *,
                  ids: list[str | None] | None = None, **kwargs: Any) -> list[str]:
        """Embed ``texts`` and store them with ``metadatas`` (JSON-serialisable dicts) under ``ids``
        (new UUIDs where None); a text whose id is already stored replaces it. -> the ids, in order."""
        if kwargs:
            raise TypeError(f"add_texts got unexpected arguments {sorted(kwargs)}")
        texts = list(texts)
        n = len(texts)
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("texts must be strings")
        metadatas = [{} for _ in texts] if metadatas is None else list(metadatas)
        ids = [None] * n if ids is None else list(ids)
        if len(metadatas) != n or len(ids) != n:
            raise ValueError(f"metadatas and ids must have one entry per text ({n}), "
                             f"got {len(metadatas)} and {len(ids)}")
        ids = [str(uuid.uuid4()) if i is None else i for i in ids]
        if not all(isinstance(i, str) for i in ids):
            raise TypeError(f"ids must be strings (or None), got {[type(i).__name__ for i in ids][:5]}")
        if len(set(ids)) != n:
            repeats = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"ids must be distinct within one call, got repeats {repeats[:5]}")
        metadatas = [_json_metadata(m, j) for j, m in enumerate(metadatas)]
        if not n:
            return []
        vectors = np.asarray(self.embedding.embed_documents(texts), dtype=np.float32)  # [n, dim]
        with self._lock:
            index = self._index_for(vectors)
            keys = np.arange(self._next_key, self._next_key + n, dtype=np.int64)
            index.add(vectors, ids=keys)
            self._next_key += n
            self._remove([i for i in ids if i in self._keys])
            for key, doc_id, text, metadata in zip(keys.tolist(), ids, texts, metadatas):
                self._docs[key] = (doc_id, text, metadata)
                self._keys[doc_id] = key
        return ids

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool:
        """Delete the documents with these ids (unknown ids are ignored); every document when ids is None."""
        if kwargs:
            raise TypeError(f"delete got unexpected arguments {sorted(kwargs)}")
        with self._lock:
            self._remove(list(self._keys) if ids is None else [i for i in ids if i in self._keys])
        return True

    def get_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        """The stored documents with these ids, in the order asked (missing ids are skipped)."""
        with self._lock:
            return [self._document(self._keys[i]) for i in ids if i in self._keys]

    # -- search ---------------------------------------------------------------------------------------
    def similarity_search(self, query: str, k: int = 4, filter: Filter | None = None, **kwargs: Any) -> list[Document]:
        """The k documents closest to ``query`` (see :meth:`similarity_search_with_score`)."""
        return [doc for doc, _ in self.similarity_search_with_score(query, k, filter, **kwargs)]

    def similarity_search_with_score(self, query: str, k: int = 4, filter: Filter | None = None,
                                     **kwargs: Any) -> list[tuple[Document, float]]:
        """(document, score) of the k documents closest to ``query``, best first; only documents whose
        metadata passes ``filter`` (a dict of required values or a predicate). nprobe=: IVF lists searched."""
        return self.similarity_search_with_score_by_vector(self.embedding.embed_query(query), k, filter, **kwargs)

    def similarity_search_by_vector(self, embedding: list[float], k: int = 4, filter: Filter | None = None,
                                    **kwargs: Any) -> list[Document]:
        """The k documents closest to an embedding vector [dim]."""
        return [doc for doc, _ in self.similarity_search_with_score_by_vector(embedding, k, filter, **kwargs)]

    def similarity_search_with_score_by_vector(self, embedding: Sequence[float], k: int = 4,
                                               filter: Filter | None = None,
                                               nprobe: int | None = None) -> list[tuple[Document, float]]:
        """(document, score) of the k documents closest to an embedding vector [dim], best first."""
        if filter is not None and not (isinstance(filter, dict) or callable(filter)):
            raise TypeError(f"filter must be a dict of metadata values or a callable, got {type(filter).__name__}")
        with self._lock:
            if self.index is None or not self._docs:
                return []
            allow = None
            if filter is not None:
                allow = [key for key, (_, _, metadata) in self._docs.items() if _matches(metadata, filter)]
                if not allow:
                    return []
            q = np.asarray(embedding, dtype=np.float32)[None]  # [1, dim]
            options = {} if nprobe is None else {"nprobe": nprobe}
            scores, keys = self.index.search(q, k, allow=allow, **options)
            return [(self._document(key), float(score))
                    for key, score in zip(keys[0].tolist(), scores[0].tolist()) if key >= 0]

    def _select_relevance_score_fn(self) -> Callable[[float], float]:
        """Score -> relevance in [0, 1] for unit-length embeddings: (1 + s) / 2 for similarities,
        1 - sqrt(d) / 2 for squared L2 distances."""
        if self.metric == "l2":
            return lambda d: 1.0 - math.sqrt(max(d, 0.0)) / 2
        return lambda s: (1.0 + s) / 2

    # -- construction and files -------------------------------------------------------------------------
    @classmethod
    def from_texts(cls, texts: list[str], embedding: Embeddings, metadatas: list[dict] | None = None, *,
                   ids: list[str] | None = None, **kwargs: Any) -> "TQVectorStore":
        """A new store (``kwargs`` go to the constructor: index, factory, metric, index options) holding ``texts``."""
        store = cls(embedding, **kwargs)
        store.add_texts(texts, metadatas, ids=ids)
        return store

    def save_local(self, folder_path: str | os.PathLike) -> None:
        """Save to a folder: ``index.tqi`` (the index file) and ``docstore.json`` (texts, metadata, ids and
        settings), each written atomically. No pickle: loading never runs code."""
        folder = Path(folder_path)
        folder.mkdir(parents=True, exist_ok=True)
        with self._lock:
            state = {
                "format": DOCSTORE_FORMAT, "version": DOCSTORE_VERSION,
                "factory": self.factory, "metric": self.metric, "index_options": self.index_options,
                "next_key": self._next_key,
                "documents": [{"key": key, "id": doc_id, "text": text, "metadata": metadata}
                              for key, (doc_id, text, metadata) in self._docs.items()],
            }
            text = json.dumps(state, ensure_ascii=False)
            if self.index is not None:
                self.index.save(folder / INDEX_FILE)
            elif (folder / INDEX_FILE).exists():
                (folder / INDEX_FILE).unlink()
            with atomic_path(folder / DOCSTORE_FILE) as tmp:
                tmp.write_text(text, encoding="utf-8")

    @classmethod
    def load_local(cls, folder_path: str | os.PathLike, embedding: Embeddings) -> "TQVectorStore":
        """A store saved by :meth:`save_local`, with ``embedding`` for new texts and queries.
        Raises FileNotFoundError, or ValueError for a damaged or inconsistent folder."""
        folder = Path(folder_path)
        path = folder / DOCSTORE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"no {DOCSTORE_FILE} in {folder}: not a saved TQVectorStore folder")
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from None
        _check_state(state, path)
        index = load_index(folder / INDEX_FILE) if (folder / INDEX_FILE).exists() else None
        keys = [d["key"] for d in state["documents"]]
        stored = set() if index is None else set(index.ids.tolist())
        if stored != set(keys) or len(keys) != len(stored):
            raise ValueError(f"{folder}: {INDEX_FILE} holds {len(stored)} vectors that do not match the "
                             f"{len(keys)} documents of {DOCSTORE_FILE} (an incomplete save?)")
        store = cls(embedding, factory=state["factory"], metric=state["metric"], **state["index_options"])
        store.index = index
        store._next_key = state["next_key"]
        for d in state["documents"]:
            store._docs[d["key"]] = (d["id"], d["text"], d["metadata"])
            store._keys[d["id"]] = d["key"]
        return store

    # -- helpers --------------------------------------------------------------------------------------
    def _index_for(self, vectors: np.ndarray) -> BaseIndex:
        """The index, made for vectors [n, dim] if there is none yet; ValueError when it needs training."""
        if vectors.ndim != 2:
            raise ValueError(f"the embedding returned an array of shape {vectors.shape}, expected [n, dim]")
        if self.index is None:
            self.index = index_factory(vectors.shape[1], self.factory, metric=self.metric, **self.index_options)
        if not self.index.is_trained:
            raise ValueError(f"the index {self.factory or type(self.index).__name__!r} needs training: pass "
                             "TQVectorStore(embedding, index=...) an index trained on sample embeddings "
                             "(index.train(vectors))")
        return self.index

    def _remove(self, doc_ids: list[str]) -> None:
        """Remove stored documents by id (all known)."""
        if not doc_ids:
            return
        keys = [self._keys.pop(i) for i in doc_ids]
        self.index.remove_ids(keys)
        for key in keys:
            del self._docs[key]

    def _document(self, key: int) -> Document:
        doc_id, text, metadata = self._docs[key]
        return Document(page_content=text, metadata=copy.deepcopy(metadata), id=doc_id)


def _json_metadata(metadata: Any, position: int) -> dict:
    """metadata as it reads back from JSON; TypeError naming the text when it is not a JSON-serialisable dict."""
    if not isinstance(metadata, dict):
        raise TypeError(f"metadatas[{position}] must be a dict, got {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(metadata))
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadatas[{position}] must be JSON-serialisable (it is saved as JSON): {e}") from None


def _matches(metadata: dict, filter: Filter) -> bool:
    if callable(filter):
        return bool(filter(metadata))
    return all(key in metadata and metadata[key] == value for key, value in filter.items())


def _check_state(state: Any, path: Path) -> None:
    """Validate the structure of a docstore.json; ValueError naming what is wrong."""
    if not isinstance(state, dict) or state.get("format") != DOCSTORE_FORMAT:
        raise ValueError(f"{path} is not a TQVectorStore docstore (format {DOCSTORE_FORMAT!r} expected)")
    if state.get("version") != DOCSTORE_VERSION:
        raise ValueError(f"{path}: docstore version {state.get('version')!r} is not supported "
                         f"(this tqindex reads version {DOCSTORE_VERSION})")
    docs = state.get("documents")
    valid = (isinstance(docs, list) and isinstance(state.get("next_key"), int)
             and isinstance(state.get("index_options"), dict) and isinstance(state.get("metric"), str)
             and isinstance(state.get("factory"), (str, type(None)))
             and all(isinstance(d, dict) and isinstance(d.get("key"), int) and isinstance(d.get("id"), str)
                     and isinstance(d.get("text"), str) and isinstance(d.get("metadata"), dict) for d in docs))
    if not valid:
        raise ValueError(f"{path}: damaged docstore (missing or mistyped fields)")
    if len({d["id"] for d in docs}) != len(docs):
        raise ValueError(f"{path}: damaged docstore (repeated document ids)")
