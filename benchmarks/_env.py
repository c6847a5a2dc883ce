"""The environment block every benchmark JSON carries: git state, hardware, library versions."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tqindex", "torch", "numpy", "faiss-cpu", "transformers", "optimum-quanto", "gguf",
            "accelerate", "triton", "turbovec")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (or platform.processor())."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment(threads: int | None = None) -> dict[str, Any]:
    """Where and with what a benchmark ran: git SHA (+ whether the tree differed from it outside the
    result files, and a digest of the tqindex Python and C sources), CPU, core count, threads used,
    load average at start, library versions."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    digest = hashlib.sha256()
    for path in sorted(p for p in (ROOT / "tqindex").rglob("*") if p.suffix in (".py", ".c")):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    env: dict[str, Any] = {
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_sha": _git("rev-parse", "HEAD") or "unknown",
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no", "--", ".",
                               ":(exclude)benchmarks/results")),
        "tqindex_sources_sha256": digest.hexdigest(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "nproc": os.cpu_count(),
        "threads": threads,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "versions": versions,
    }
    try:
        import torch

        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return env
