"""The declared transformers range is tested: ``tests/kv`` again, under the oldest release the ``kv`` extra
allows, in the second environment ``.venv-floor`` that ``.ci/setup.sh`` creates (same torch, same package).

Skipped where ``.venv-floor`` does not exist, except under CI (the ``CI`` environment variable), where its
absence fails.
"""

from __future__ import annotations

import os
import subprocess
from importlib.metadata import requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
FLOOR_PYTHON = ROOT / ".venv-floor" / "bin" / "python"


def declared_floor() -> Version:
    """The lowest transformers version of the installed tqindex's ``kv`` extra (``transformers>=X``)."""
    for line in requires("tqindex") or []:
        req = Requirement(line)
        if req.name == "transformers" and req.marker is not None and req.marker.evaluate({"extra": "kv"}):
            (lower,) = [Version(s.version) for s in req.specifier if s.operator == ">="]
            return lower
    raise AssertionError("the kv extra of tqindex declares no transformers>=X")


def test_kv_tests_pass_at_the_lowest_supported_transformers():
    if not FLOOR_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{FLOOR_PYTHON.parent.parent} is missing under CI: .ci/setup.sh creates it")
        pytest.skip(".venv-floor does not exist (bash .ci/setup.sh creates it)")
    version = subprocess.run(
        [FLOOR_PYTHON, "-c", "import transformers; print(transformers.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    floor = declared_floor()
    assert Version(version) == floor, f".venv-floor has transformers {version}, the kv extra allows >= {floor}"
    itself = f"--ignore={Path(__file__).relative_to(ROOT)}"
    run = subprocess.run(
        [FLOOR_PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kv", itself],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert run.returncode == 0, f"tests/kv under transformers {version}:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
    assert " passed" in run.stdout.splitlines()[-1]
