import numpy as np
import pytest

import tqindex as tq
from tqindex.factory import index_factory


def data(n, dim, seed=0):
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def test_flat_descriptions_build_the_named_encoder():
    index = index_factory(48, "tq4")
    assert type(index) is tq.FlatIndex and index.metric == "ip" and not index.keep_vectors
    assert index.encoder.to_dict() == tq.make_encoder("tq4", 48).to_dict()
    pca = index_factory(48, "tq2-pca", metric="l2")
    assert type(pca.encoder) is tq.TurboQuantPCA and pca.encoder.bits == 2 and not pca.is_trained
    for name in tq.encoder_names():
        assert index_factory(64, name).encoder.to_dict() == tq.make_encoder(name, 64).to_dict()


def test_ivf_description_and_options_pass_through():
    index = index_factory(32, " IVF16 , tq3 ", metric="cosine", nprobe=5, by_residual=True, niter=4,
                          keep_vectors=True, vectors_dtype="float16", rerank_factor=2)
    assert type(index) is tq.IVFIndex
    assert (index.nlist, index.nprobe, index.by_residual, index.niter) == (16, 5, True, 4)
    assert (index.metric, index.keep_vectors, index.vectors_dtype, index.rerank_factor) == (
        "cosine", True, "float16", 2)
    assert index.encoder.to_dict() == tq.make_encoder("tq3", 32).to_dict()
    x = data(500, 32)
    index.train(x)
    index.add(x)
    _, ids = index.search(x[:20], 3, nprobe=16)
    assert ids[:, 0].tolist() == list(range(20))  # exact re-ranking from the kept vectors


def test_rflat_suffix_keeps_vectors_and_reranks_exactly():
    x = data(300, 24, seed=1)
    index = index_factory(24, "tq1,RFlat", metric="l2", rerank_factor=8)
    assert index.keep_vectors
    index.add(x)
    dist, ids = index.search(x[:10], 1)
    assert ids[:, 0].tolist() == list(range(10))
    np.testing.assert_allclose(dist[:, 0], 0, atol=1e-4)  # exact distances to themselves
    assert index_factory(24, "IVF4,tq4,RFlat", keep_vectors=True).keep_vectors


@pytest.mark.parametrize("description, match", [
    ("tq9", "unknown encoder name 'tq9'"),
    ("IVF1024", "cannot parse"),
    ("IVF,tq4", "cannot parse"),
    ("IVF0,tq4", "nlist must be >= 1"),
    ("tq4,tq2", "cannot parse"),
    ("RFlat", "cannot parse"),
    ("", "unknown encoder name ''"),
    ("PQ8", "unknown encoder name 'PQ8'"),
    ("ivf8,tq4", "cannot parse"),
])
def test_bad_descriptions_list_the_grammar(description, match):
    with pytest.raises(ValueError, match=match) as err:
        index_factory(32, description)
    message = str(err.value)
    assert repr(description) in message
    assert "[IVF<nlist>,]<encoder>[,RFlat]" in message
    assert all(name in message for name in ("tq4", "tq2-pca", "tq3-prod", "fp4"))


def test_bad_arguments():
    with pytest.raises(TypeError, match="description must be a string.*got int"):
        index_factory(32, 4)
    with pytest.raises(TypeError, match=r"unknown options \['nprobe'\] for FlatIndex.*IVF<nlist>"):
        index_factory(32, "tq4", nprobe=4)
    with pytest.raises(TypeError, match=r"unknown options \['nprob'\] for IVFIndex.*nprobe"):
        index_factory(32, "IVF8,tq4", nprob=4)
    with pytest.raises(ValueError, match="RFlat.*keep_vectors=False"):
        index_factory(32, "tq4,RFlat", keep_vectors=False)
    with pytest.raises(ValueError, match="metric must be one of"):
        index_factory(32, "IVF8,tq4", metric="dot")
    with pytest.raises(ValueError, match="dim must be an integer >= 2"):
        index_factory(1, "tq4")
