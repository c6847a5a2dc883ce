import json
import os

import h5py
import numpy as np
import pytest

import tqindex as tq
import tqindex.io as tqio
from test_index import data


def flat(metric="ip", name="tq4", n=400, **kw):
    index = tq.index_factory(50, name, metric=metric, **kw)
    index.add(data(n, 50), ids=np.arange(n) * 5 + 2)
    return index


def ivf(metric="ip", by_residual=True, n=600, **kw):
    index = tq.IVFIndex(tq.make_encoder("tq4", 50), 8, metric=metric, by_residual=by_residual, nprobe=3, **kw)
    index.train(data(n, 50))
    index.add(data(n, 50))
    return index


def assert_same_results(a, b, q, **kw):
    Da, Ia = a.search(q, 12, **kw)
    Db, Ib = b.search(q, 12, **kw)
    np.testing.assert_array_equal(Ia, Ib)
    np.testing.assert_array_equal(Da, Db)


@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
@pytest.mark.parametrize(
    "make",
    [
        lambda m: flat(m),
        lambda m: flat(m, "tq3-prod", keep_vectors=True, vectors_dtype="float16"),
        lambda m: flat(m, "fp4"),
        lambda m: ivf(m),
        lambda m: ivf(m, by_residual=False, keep_vectors=True),
    ],
    ids=["flat-tq4", "flat-prod-kept", "flat-fp4", "ivf-residual", "ivf-raw-kept"],
)
def test_round_trip_gives_identical_results(tmp_path, metric, make):
    index = make(metric)
    index.remove_ids(index.ids[::5])
    path = tmp_path / "index.h5"
    index.save(path)
    loaded = tq.load_index(path)
    assert type(loaded) is type(index) and loaded.ntotal == index.ntotal
    np.testing.assert_array_equal(loaded.ids, index.ids)
    q = data(9, 50, 7)
    assert_same_results(index, loaded, q)
    assert_same_results(index, loaded, q[:2], allow=index.ids[::3])
    assert loaded.memory_bytes() <= index.memory_bytes()
    x = data(3, 50, 8)  # the loaded index keeps growing with fresh ids
    index.add(x)
    loaded.add(x)
    np.testing.assert_array_equal(loaded.ids, index.ids)
    assert_same_results(index, loaded, q)
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_header_and_layout(tmp_path):
    index = ivf("cosine")
    path = tmp_path / "ivf.h5"
    index.save(path)
    h = tq.read_header(path)
    assert h["index_type"] == "IVFIndex" and h["metric"] == "cosine" and h["ntotal"] == 600 and h["dim"] == 50
    assert h["code_size"] == index.encoder.code_size and h["encoder"] == index.encoder.to_dict()
    assert h["ivf"]["nlist"] == 8 and h["ivf"]["by_residual"] is True and h["ivf"]["nprobe"] == 3
    with h5py.File(path, "r") as f:
        assert f.attrs["format"] == "tqindex" and f.attrs["format_version"] == 1
        assert {"codes/qdata", "codes/norm", "ids", "ivf/centroids", "ivf/list_offsets"} <= set(_datasets(f))
        assert any(name.startswith("encoder/") for name in _datasets(f))
    empty = tq.IVFIndex(tq.make_encoder("fp4", 50), 4)
    empty.save(tmp_path / "empty.h5")
    loaded = tq.load_index(tmp_path / "empty.h5")
    assert loaded.ntotal == 0 and not loaded.is_trained
    flat_empty = tq.FlatIndex(tq.make_encoder("tq2", 50))
    flat_empty.save(tmp_path / "flat_empty.h5")
    assert tq.load_index(tmp_path / "flat_empty.h5").search(data(1, 50), 2)[1].tolist() == [[-1, -1]]


def test_stored_encoder_tensors_are_used(tmp_path):
    path = tmp_path / "index.h5"
    flat().save(path)
    header, arrays = tqio.read_index_file(path)
    arrays["encoder/matrix"] = arrays["encoder/matrix"][::-1].copy()  # another orthogonal rotation
    tqio.write_index_file(path, header, arrays)
    loaded = tq.load_index(path)
    np.testing.assert_array_equal(loaded.encoder.tensors()["matrix"].numpy(), arrays["encoder/matrix"])


def _datasets(f: h5py.File) -> list[str]:
    names = []
    f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    return names


@pytest.mark.parametrize("dataset", ["ids", "codes/qdata", "codes/norm", "ivf/centroids"])
def test_flipped_data_bytes_fail_the_checksum(tmp_path, dataset):
    path = tmp_path / "index.h5"
    ivf().save(path)
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + 3)
        byte = fh.read(1)
        fh.seek(offset + 3)
        fh.write(bytes([byte[0] ^ 0x5A]))
    with pytest.raises(ValueError, match="checksum"):
        tq.load_index(path)


@pytest.mark.parametrize("keep", [0.3, 0.9, 0.999])
def test_truncated_file(tmp_path, keep):
    path = tmp_path / "index.h5"
    flat().save(path)
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(int(size * keep))
    with pytest.raises(ValueError, match="index.h5"):
        tq.load_index(path)


def test_damaged_superblock(tmp_path):
    path = tmp_path / "index.h5"
    flat().save(path)
    with open(path, "r+b") as fh:
        fh.seek(0)
        fh.write(b"\x00" * 16)
    with pytest.raises(ValueError, match="not a readable HDF5"):
        tq.read_header(path)


def test_foreign_and_newer_files(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello, not an index\n" * 50)
    with pytest.raises(ValueError, match="not a readable HDF5"):
        tq.load_index(text)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["train"] = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError, match="not a tqindex file"):
        tq.load_index(other)
    with pytest.raises(ValueError, match="not a tqindex file"):
        tq.read_header(other)
    newer = tmp_path / "newer.h5"
    flat().save(newer)
    with h5py.File(newer, "r+") as f:
        f.attrs["format_version"] = tqio.FORMAT_VERSION + 1
    with pytest.raises(ValueError, match="format_version 2 is not supported"):
        tq.load_index(newer)
    with pytest.raises(FileNotFoundError):
        tq.load_index(tmp_path / "missing.h5")


def test_consistent_checksum_but_bad_content(tmp_path):
    """A file whose checksum matches but whose content is inconsistent still gives ValueError."""
    path = tmp_path / "index.h5"
    index = flat()
    header = {"index_type": "FlatIndex", "metric": "ip", "dim": 50, "ntotal": 5, "code_size": index.encoder.code_size,
              "encoder": index.encoder.to_dict(), "options": {"keep_vectors": False, "vectors_dtype": "float32",
                                                              "rerank_factor": 4, "next_id": 5}}
    arrays = {f"encoder/{k}": v.numpy() for k, v in index.encoder.tensors().items()}
    arrays["ids"] = np.arange(4, dtype=np.int64)
    tqio.write_index_file(path, header, arrays)
    with pytest.raises(ValueError, match="ntotal"):
        tq.load_index(path)
    tqio.write_index_file(path, {**header, "index_type": "HNSW"}, arrays)
    with pytest.raises(ValueError, match="unknown index_type"):
        tq.load_index(path)
    tqio.write_index_file(path, {**header, "encoder": {"type": "Pickle"}}, arrays)
    with pytest.raises(ValueError, match="unknown encoder type"):
        tq.load_index(path)
    del header["options"]
    tqio.write_index_file(path, header, arrays)
    with pytest.raises(ValueError, match="inconsistent"):
        tq.load_index(path)
    with h5py.File(path, "r+") as f:
        f.attrs["header"] = "{not json"
    with pytest.raises(ValueError, match="JSON"):
        tq.read_header(path)


def test_failed_save_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "index.h5"
    index = flat()
    index.save(path)
    before = path.read_bytes()

    def boom(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(tqio, "_checksum", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        flat(n=50).save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["index.h5"]
    json.dumps(tq.read_header(path))


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_saved_files_get_the_umask_permissions(tmp_path, umask):
    path = tmp_path / "index.h5"
    old = os.umask(umask)
    try:
        flat(n=20).save(path)
        flat(n=30).save(path)  # replacing a file gives the new one the same normal permissions
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask
    assert os.listdir(tmp_path) == ["index.h5"]
    assert tq.load_index(path).ntotal == 30


def test_atomic_path_removes_its_temporary_file_on_error(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with tqio.atomic_path(path) as tmp:
            assert tmp.parent == tmp_path and tmp.name.startswith("out.json.tmp-")
            tmp.write_text("new")
            raise KeyboardInterrupt
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["out.json"]
    with tqio.atomic_path(path) as tmp:
        tmp.write_text("new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["out.json"]
