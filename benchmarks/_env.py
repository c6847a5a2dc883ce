"""The environment block every benchmark JSON carries: git state, hardware, library versions.

A result names the commit it ran at (``git_sha``) and whether the tree differed from it
(``git_dirty``, with the differing paths in ``git_changes``): modified tracked files anywhere outside
the result folders, and files git does not track yet in the package or the benchmarks (an
untracked module the code imports changes what runs as much as an edit does). Reference results in
``benchmarks/results/`` come from a clean tree only (:func:`require_clean`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
"""Committed reference results."""
RUNS = ROOT / "benchmarks" / "runs"
"""Run folders of benchmark runs (ignored by git)."""
CODE_PATHS = ("tqindex", "benchmarks", "setup.py", "pyproject.toml")
"""Where an untracked file makes the tree dirty."""
PACKAGES = ("tqindex", "torch", "numpy", "faiss-cpu", "transformers", "optimum-quanto", "gguf",
            "accelerate", "triton", "turbovec")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def git_changes() -> list[str]:
    """Paths where the working tree differs from HEAD (``git status --porcelain`` lines): tracked files
    outside the result folders, untracked files under :data:`CODE_PATHS`."""
    outside = ("--", ".", ":(exclude)benchmarks/results", ":(exclude)benchmarks/runs")
    tracked = _git("status", "--porcelain", "--untracked-files=no", *outside).splitlines()
    untracked = [line for line in _git("status", "--porcelain", "--untracked-files=all", "--",
                                       *CODE_PATHS, ":(exclude)benchmarks/results",
                                       ":(exclude)benchmarks/runs").splitlines() if line.startswith("??")]
    return tracked + untracked


def require_clean(out: Path, env: dict[str, Any]) -> None:
    """Refuse (SystemExit) to write results into :data:`RESULTS` from a tree that differs from its
    commit: a reference result must name the code it ran."""
    inside = out.resolve() == RESULTS.resolve() or RESULTS.resolve() in out.resolve().parents
    if inside and env["git_sha"] == "unknown":
        raise SystemExit(f"{RESULTS} holds reference results, measured at a known commit only: git "
                         "found none here")
    if inside and env["git_dirty"]:
        changes = "\n  ".join(env["git_changes"][:20])
        raise SystemExit(f"{RESULTS} holds reference results, measured at a clean commit only; the tree "
                         f"differs from {env['git_sha'][:10]} in:\n  {changes}\ncommit first, or write "
                         "to a run folder (leave out --out)")


def sources_digest(folder: Path, pattern: str) -> str:
    """SHA-256 of the Python, C and CUDA sources matching ``pattern`` under folder (paths and contents)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.glob(pattern) if p.suffix in (".py", ".c", ".h", ".cu", ".cuh")):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


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
    """Where and with what a benchmark ran: git SHA (+ whether and where the tree differed from it, see
    the module notes, and digests of the tqindex and benchmark sources), where tqindex was imported
    from, CPU, core count, threads used, load average at start, library versions."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    changes = git_changes()
    spec = importlib.util.find_spec("tqindex")
    env: dict[str, Any] = {
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_sha": _git("rev-parse", "HEAD") or "unknown",
        "git_dirty": bool(changes),
        "git_changes": changes,
        "tqindex_sources_sha256": sources_digest(ROOT / "tqindex", "**/*"),
        "benchmarks_sources_sha256": sources_digest(ROOT / "benchmarks", "*.py"),
        "tqindex_path": str(Path(spec.origin).parent) if spec and spec.origin else None,
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


def named_commit(env: dict[str, Any]) -> dict[str, Any]:
    """``env`` of a run in a copy of the tree whose git data is not its own (a GPU machine): the commit named
    by ``$TQINDEX_GIT_SHA``, clean when ``$TQINDEX_SOURCES_SHA256`` / ``$TQINDEX_BENCHMARKS_SHA256`` (the
    source digests taken at that commit) equal the ones read here. Unchanged without the variables."""
    if os.environ.get("TQINDEX_GIT_SHA"):
        expected = (os.environ.get("TQINDEX_SOURCES_SHA256"), os.environ.get("TQINDEX_BENCHMARKS_SHA256"))
        env["git_sha"] = os.environ["TQINDEX_GIT_SHA"]
        env["git_dirty"] = expected != (env["tqindex_sources_sha256"], env["benchmarks_sources_sha256"])
        env["git_changes"] = ["sources differ from the named commit"] if env["git_dirty"] else []
    return env
