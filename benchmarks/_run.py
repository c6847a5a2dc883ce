"""What every benchmark run shares: its folder, a results file that survives interrupts and resumes,
Ctrl-C without a traceback, and one progress bar whose estimate covers the whole run.

A run writes into a fresh folder ``benchmarks/runs/<name>-<UTC time>/`` (ignored by git) unless
``--out`` names one; committed reference results (``benchmarks/results/``) are written only when
``--out`` names that folder, and only from a clean tree (``_env.require_clean``). The results file
is rewritten atomically after every step, so an interrupted run leaves what it measured; a re-run
with the same ``--out`` and arguments at the same code continues it.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

from tqdm.auto import tqdm

import _env

NOT_CONFIGURATION = ("out", "restart", "no_plot")
"""Arguments that do not change what a run measures (a resumed run may differ in these)."""
SAME_CODE = ("git_sha", "tqindex_sources_sha256", "benchmarks_sources_sha256")
"""Environment fields that must match for a run to be resumed."""


def run_folder(out: str | os.PathLike | None, name: str, env: dict[str, Any]) -> Path:
    """The folder a run writes to: ``out`` (created if missing; refused for the reference folder from a
    tree that differs from its commit), else a new ``benchmarks/runs/<name>-<UTC date-time>/``."""
    if out is not None:
        path = Path(out)
        _env.require_clean(path, env)
        path.mkdir(parents=True, exist_ok=True)
        return path
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    for i in range(1, 1000):
        path = _env.RUNS / (f"{name}-{stamp}" + (f"-{i}" if i > 1 else ""))
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run folder name for {name}-{stamp} in {_env.RUNS}")


def write_atomic(path: Path, text: str) -> None:
    """Write text to path through a temporary file and a rename: an interrupt leaves the old file or
    the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def configuration(args: dict[str, Any]) -> dict[str, Any]:
    """The arguments that define what a run measures, as they read back from JSON."""
    return json.loads(json.dumps({k: v for k, v in args.items() if k not in NOT_CONFIGURATION}))


class Results:
    """The JSON results file of one run, ``data`` (``env``, ``args``, ``complete`` and the benchmark's
    own keys), rewritten atomically by :meth:`save`.

    Where ``path`` holds the file of an earlier run with the same configuration at the same code, that
    run continues (``resumed`` is True; ``data`` is its content, its ``env`` gains a ``resumed`` entry
    unless it was complete): the caller skips what is measured already. A file of other arguments or other code is refused
    (SystemExit), so one file never mixes two configurations; ``restart`` starts afresh instead.
    """

    def __init__(self, path: Path, data: dict[str, Any], restart: bool = False) -> None:
        self.path = path
        self.resumed = path.exists() and not restart
        if self.resumed:
            old = json.loads(path.read_text())
            self._check(old, data)
            if not old.get("complete"):
                old["env"].setdefault("resumed", []).append(
                    {k: data["env"][k] for k in ("date_utc", "load_average_at_start")})
            data = old
        self.data = data
        self.save()

    def _check(self, old: dict[str, Any], new: dict[str, Any]) -> None:
        hint = "pass --restart to measure afresh, or leave out --out for a new run folder"
        was, now = configuration(old.get("args", {})), configuration(new["args"])
        if was != now:
            diff = ", ".join(f"--{k.replace('_', '-')} {was.get(k)!r} -> {now.get(k)!r}"
                             for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k))
            raise SystemExit(f"{self.path} holds a run with other arguments ({diff}): {hint}")
        changed = [k for k in SAME_CODE if old["env"].get(k) != new["env"].get(k)]
        if changed:
            raise SystemExit(f"{self.path} was measured at other code (commit "
                             f"{str(old['env'].get('git_sha'))[:10]}, differing: {', '.join(changed)}); "
                             f"resuming would mix two versions: {hint}")

    def save(self) -> None:
        write_atomic(self.path, json.dumps(self.data, indent=1) + "\n")


def resume_command(script: str, argv: list[str], out: Path) -> str:
    """The command line that resumes a run: its arguments with ``--out`` set to its folder (and no
    ``--restart``)."""
    keep, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not (a.startswith("--out=") or a == "--restart"):
            keep.append(a)
    return shlex.join(["python", script, *keep, "--out", str(out)])


@contextmanager
def interruptible(message: Callable[[], str]) -> Iterator[None]:
    """Turn Ctrl-C into a message (``message()``, e.g. where the partial results are and how to resume)
    and exit status 130, without a traceback. Results already saved stay as they are."""
    try:
        yield
    except KeyboardInterrupt:
        print(f"\ninterrupted: {message()}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


class Progress:
    """One progress bar for a whole run, counted in seconds of work.

    Each :meth:`step` adds the wall seconds since the previous one and sets the total to that plus
    the caller's estimate of what remains (every phase still to come), so the bar's "left" is the
    current estimate, revised after each step; :meth:`doing` names the step under way.
    """

    def __init__(self, desc: str, estimate: float, doing: str = "") -> None:
        self.bar = tqdm(total=max(estimate, 1e-3), desc=desc, dynamic_ncols=True,
                        bar_format="{desc}: {percentage:3.0f}%|{bar:24}| {elapsed} elapsed{postfix}")
        self._last = time.perf_counter()
        self._left, self._doing = estimate, doing
        self._show()

    def _show(self) -> None:
        left = tqdm.format_interval(round(max(self._left, 0.0)))
        self.bar.set_postfix_str(f"about {left} left" + (f", {self._doing}" if self._doing else ""))

    def doing(self, what: str) -> None:
        """Show what runs now."""
        self._doing = what
        self._show()

    def step(self, remaining: float) -> None:
        """A step is done; ``remaining``: the estimated seconds still to run."""
        now = time.perf_counter()
        self.bar.update(now - self._last)
        self._last = now
        self.bar.total = self.bar.n + max(remaining, 0.0)
        self._left = remaining
        self._show()

    def write(self, text: str) -> None:
        """Print a line above the bar."""
        self.bar.write(text)

    def close(self) -> None:
        self.bar.close()
