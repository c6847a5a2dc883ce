"""Smoke test of the sharded benchmark CLI: ``benchmarks/sharded.py --quick`` runs 1 and 2 gloo ranks and
writes its reports, with exact byte accounting and the projection."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import tqindex as tq

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "sharded.py"


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_sharded_quick(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    files = list(tmp_path.glob("sharded_*.json"))
    assert len(files) == 1 and files[0].with_suffix(".md").is_file()
    result = json.loads(files[0].read_text())
    a = result["args"]
    assert result["env"]["git_sha"] and result["env"]["versions"]["torch"]
    rows = {(r["ranks"], r["nq"]): r for r in result["rows"]}
    assert set(rows) == {(1, 1), (1, 200), (2, 1), (2, 200)}
    header = 15 * 8  # one agreement round: int64 [3 + 12] per rank
    for (ranks, nq), r in rows.items():
        assert r["qps"] > 0 and r["build_s"] > 0 and 0 <= r["exchange_merge_share_median"] <= 1
        assert sum(r["rows_per_rank"]) == a["n"] and max(r["rows_per_rank"]) - min(r["rows_per_rank"]) <= 1
        results = 4 * (3 * nq * a["k"] + 1)  # int64 ids + float32 scores as int32 words, and a status word
        assert r["bytes_sent_by_rank"][0] == header + nq * a["dim"] * 4 + results  # rank 0 broadcasts the queries
        assert r["bytes_received_by_rank"][0] == (ranks - 1) * (header + results)
    assert rows[(2, 200)]["ids_equal_to_1_rank"] >= 0.99  # the same neighbours (up to ties) on 1 and 2 ranks
    assert "local_index_alone_qps" in rows[(1, 200)]
    assert result["target"] is not None and result["target"]["met"] == (result["target"]["share"] < 0.10)
    projection = {(p["gpus"], p["nq"], p["k"]): p for p in result["projection"]}
    assert set(projection) == {(g, nq, k) for g in (8, 64) for nq in (1, 4096) for k in (10, 100)}
    code_size = tq.make_encoder("tq4", 768).code_size
    for (gpus, nq, k), p in projection.items():
        assert p["shard_gb"] == pytest.approx(math.ceil(1e9 / gpus) * (code_size + 8) / 1e9, abs=0.01)
        assert p["gather_bytes_per_gpu"] == (gpus - 1) * nq * k * 12 and p["query_broadcast_bytes"] == nq * 768 * 4
        assert p["scan_ms"] > 0 and p["fits"]
        assert p["comm_ms"]["100 Gb/s"] > p["comm_ms"]["400 Gb/s"] > p["comm_ms"]["NVLink 4 (within a node)"]
    assert projection[(64, 4096, 10)]["scan_ms"] < projection[(8, 4096, 10)]["scan_ms"]
