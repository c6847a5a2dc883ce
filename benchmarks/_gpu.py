"""Timing on GPUs, shared by the GPU benchmarks: CUDA-event medians and the card's measured roofline."""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch
import triton
import triton.language as tl


def bench(fn: Callable[[], Any], budget_s: float = 1.0, min_runs: int = 5, max_runs: int = 100,
          back_to_back: bool = False) -> float:
    """Median milliseconds of ``fn()`` on the GPU: two warm-up calls, then as many calls as fit in ``budget_s`` by
    the warm-up's time (at least ``min_runs``), each between CUDA events. Each call is timed alone (the next
    waits for its end), or with ``back_to_back`` the calls are issued without waiting, as a caller's loop issues
    them: host work then shows where the GPU waits for it (where it exceeds the GPU's, and where ``fn`` itself
    waits for the device)."""
    start = time.perf_counter()
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    each = (time.perf_counter() - start) / 2
    runs = int(min(max_runs, max(min_runs, budget_s / max(each, 1e-6))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
    for a, b in events:
        a.record()
        fn()
        b.record()
        if not back_to_back:
            b.synchronize()
    torch.cuda.synchronize()
    return float(np.median([a.elapsed_time(b) for a, b in events]))


def gpu_time(fn: Callable[[], Any], runs: int = 50) -> float:
    """Median milliseconds of ``fn()`` on the GPU alone: the call captured once as a CUDA graph, then replayed
    ``runs`` times, each replay between CUDA events with the L2 cache flushed before it (a 256 MiB write), so
    neither the host's launch time nor a warm cache shows."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (compiles, cached tables)
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
    for a, b in events:
        flush.zero_()
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    return float(np.median([a.elapsed_time(b) for a, b in events]))


@triton.jit
def _read_kernel(X, OUT, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.int32)
    for i in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        acc += tl.load(X + i + tl.arange(0, BLOCK), mask=i + tl.arange(0, BLOCK) < n, other=0)
    tl.store(OUT + pid, tl.sum(acc, 0))


def roofline(device: torch.device) -> dict[str, float]:
    """Streaming-read bandwidth (a Triton kernel reading 4 GiB of int32) and device-to-device copy rate
    (bytes read + written), TB/s."""
    n = 1 << 30
    x = torch.ones(n, dtype=torch.int32, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    out = torch.empty(sms * 8, dtype=torch.int32, device=device)
    ms = bench(lambda: _read_kernel[(sms * 8,)](x, out, n, BLOCK=4096, num_warps=8))
    y = torch.empty_like(x)
    copy_ms = bench(lambda: y.copy_(x))
    del x, y
    return {"read_TBps": 4 * n / ms / 1e9, "copy_TBps": 8 * n / copy_ms / 1e9}
