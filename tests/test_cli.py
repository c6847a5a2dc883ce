import json
import subprocess
import sys
from importlib.metadata import entry_points

import h5py
import numpy as np
import pytest

import tqindex as tq
from tqindex import cli


def vectors(n, dim, seed=0):
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def run(capsys, *argv):
    """main(argv) -> (exit status, stdout, stderr)."""
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_build_search_info_on_npy(tmp_path, capsys):
    x = vectors(700, 40)
    np.save(tmp_path / "x.npy", x)
    index_path, results = tmp_path / "x.tqi", tmp_path / "r.npz"
    rc, _, err = run(capsys, "build", tmp_path / "x.npy", index_path, "--metric", "cosine")
    assert rc == 0 and "700 vectors x 40" in err and "add: 100%" in err  # summary and progress bar
    index = tq.load_index(index_path)
    assert type(index) is tq.FlatIndex and index.metric == "cosine" and index.ntotal == 700
    assert index.ids.tolist() == list(range(700))
    assert run(capsys, "search", index_path, tmp_path / "x.npy", results, "-k", 7, "-q") == (0, "", "")
    with np.load(results) as r:
        ids, scores = r["ids"], r["scores"]
    assert ids.dtype == np.int64 and scores.dtype == np.float32 and ids.shape == scores.shape == (700, 7)
    expected_scores, expected_ids = index.search(x, 7)
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_array_equal(scores, expected_scores)
    assert (ids[:, 0] == np.arange(700)).mean() > 0.99  # each vector finds itself first

    rc, out, _ = run(capsys, "info", index_path, "--json")
    assert rc == 0 and json.loads(out) == tq.read_header(index_path)
    rc, out, _ = run(capsys, "info", index_path)
    assert rc == 0
    assert "FlatIndex, metric cosine" in out and "700 x 40" in out and "TurboQuantMSE(bits=4" in out
    assert f"{index.encoder.code_size} bytes/vector" in out


def test_ivf_build_from_ann_benchmarks_hdf5(tmp_path, capsys):
    train, test = vectors(1200, 24), vectors(30, 24, seed=1)
    path = tmp_path / "ann.hdf5"
    with h5py.File(path, "w") as f:
        f.attrs["distance"] = "euclidean"
        f["train"], f["test"] = train, test
    rc, _, err = run(capsys, "build", path, tmp_path / "ivf.tqi", "-f", "IVF8,tq4,RFlat", "--nprobe", 3,
                     "--train-size", 500)
    assert rc == 0 and "training IVF8,tq4,RFlat on 500 of 1,200 vectors" in err
    index = tq.load_index(tmp_path / "ivf.tqi")
    assert type(index) is tq.IVFIndex and index.metric == "l2"  # from the distance attribute
    assert (index.nlist, index.nprobe, index.keep_vectors, index.ntotal) == (8, 3, True, 1200)
    assert run(capsys, "search", tmp_path / "ivf.tqi", path, tmp_path / "r.h5", "-k", 4, "--nprobe", 8)[0] == 0
    with h5py.File(tmp_path / "r.h5") as f:
        ids, scores = f["ids"][()], f["scores"][()]
    expected_scores, expected_ids = index.search(test, 4, nprobe=8)
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_array_equal(scores, expected_scores)
    exact = ((test[:, None] - train[None]) ** 2).sum(-1).argmin(1)
    assert (ids[:, 0] == exact).all()  # all lists probed, kept vectors re-ranked exactly
    rc, out, _ = run(capsys, "info", tmp_path / "ivf.tqi")
    assert "IVFIndex, metric l2" in out and "nlist=8, nprobe=3" in out


def test_hdf5_key_and_parquet_column(tmp_path, capsys):
    x = vectors(300, 16)
    with h5py.File(tmp_path / "two.h5", "w") as f:
        f["a"], f["b"] = x, x[:10]
        f["labels"] = np.arange(300)  # 1-D: never taken for vectors
    rc, _, err = run(capsys, "build", tmp_path / "two.h5", tmp_path / "two.tqi")
    assert rc == 1 and "pass --key, one of the 2-D datasets ['a', 'b']" in err
    assert run(capsys, "build", tmp_path / "two.h5", tmp_path / "two.tqi", "--key", "a", "-q")[0] == 0
    assert tq.load_index(tmp_path / "two.tqi").ntotal == 300
    rc, _, err = run(capsys, "build", tmp_path / "two.h5", tmp_path / "two.tqi", "--key", "labels")
    assert rc == 1 and "--key must name a 2-D dataset" in err

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [str(i) for i in range(300)], "emb": list(x)}), tmp_path / "x.parquet")
    assert run(capsys, "build", tmp_path / "x.parquet", tmp_path / "p.tqi", "-f", "tq2", "-q")[0] == 0
    index = tq.load_index(tmp_path / "p.tqi")
    assert index.ntotal == 300 and index.encoder.bits == 2
    assert run(capsys, "search", tmp_path / "p.tqi", tmp_path / "x.parquet", tmp_path / "p.npz", "-q")[0] == 0
    with np.load(tmp_path / "p.npz") as r:
        np.testing.assert_array_equal(r["ids"], index.search(x, 10)[1])


def test_bad_input_gives_clear_errors(tmp_path, capsys):
    np.save(tmp_path / "x.npy", vectors(50, 8))
    np.save(tmp_path / "q.npy", vectors(5, 9))
    np.save(tmp_path / "words.npy", np.array([["a", "b"], ["c", "d"]]))
    assert run(capsys, "build", tmp_path / "x.npy", tmp_path / "x.tqi", "-q")[0] == 0
    cases = [
        (("build", tmp_path / "missing.npy", tmp_path / "y.tqi"), "no such file"),
        (("build", tmp_path / "x.csv", tmp_path / "y.tqi"), "vector file must end in one of"),
        (("build", tmp_path / "words.npy", tmp_path / "y.tqi"), "must hold numbers"),
        (("build", tmp_path / "x.npy", tmp_path / "y.tqi", "-f", "IVF8,tq9"), "unknown encoder name 'tq9'"),
        (("build", tmp_path / "x.npy", tmp_path / "y.tqi", "--nprobe", 2), "IVF<nlist>"),
        (("build", tmp_path / "x.npy", tmp_path / "y.tqi", "-f", "IVF64,tq4"), "at least nlist=64"),
        (("search", tmp_path / "x.tqi", tmp_path / "q.npy", tmp_path / "r.npz"), "queries have dim 9"),
        (("search", tmp_path / "x.tqi", tmp_path / "x.npy", tmp_path / "r.npz", "--nprobe", 2), "IVF indexes"),
        (("search", tmp_path / "x.tqi", tmp_path / "x.npy", tmp_path / "r.csv"), "output must end in one of"),
        (("info", tmp_path / "x.npy"), "not a readable HDF5 index file"),
    ]
    for argv, message in cases:
        rc, _, err = run(capsys, *argv)
        assert rc == 1 and message in err and f"tqindex {argv[0]}: error: " in err, (argv, err)
    assert not (tmp_path / "y.tqi").exists() and not (tmp_path / "r.npz").exists()
    with pytest.raises(SystemExit) as exit_:
        cli.main(["search", str(tmp_path / "x.tqi"), str(tmp_path / "x.npy"), "r.npz", "-k", "0"])
    assert exit_.value.code == 2 and "must be an integer >= 1" in capsys.readouterr().err


def test_bench_passes_arguments_through(tmp_path, capsys, monkeypatch):
    assert cli.BENCH_SCRIPT.is_file()  # benchmarks/ann.py of this checkout
    script = tmp_path / "ann.py"
    script.write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\nsys.exit(3)\n")
    monkeypatch.setattr(cli, "BENCH_SCRIPT", script)
    assert cli.main(["bench", "--quick", "--out", "x", "--help"]) == 3
    assert capsys.readouterr().out == ""  # the child's output is not captured by capsys
    done = subprocess.run([sys.executable, "-c", f"import sys; from tqindex import cli; from pathlib import Path; "
                           f"cli.BENCH_SCRIPT = Path({str(script)!r}); sys.exit(cli.main(['bench', '--quick', '--k', '5']))"],
                          capture_output=True, text=True)
    assert done.returncode == 3 and json.loads(done.stdout) == ["--quick", "--k", "5"]
    monkeypatch.setattr(cli, "BENCH_SCRIPT", tmp_path / "absent" / "ann.py")
    assert cli.main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "source checkout" in err and str(tmp_path / "absent" / "ann.py") in err and "pip install -e" in err


def test_python_m_and_console_script(tmp_path):
    (script,) = entry_points(group="console_scripts", name="tqindex")
    assert script.value == "tqindex.cli:main"
    np.save(tmp_path / "x.npy", vectors(100, 12))
    done = subprocess.run([sys.executable, "-m", "tqindex", "build", "x.npy", "x.tqi", "-f", "tq3"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "100 vectors x 12" in done.stderr and tq.load_index(tmp_path / "x.tqi").encoder.bits == 3
