"""The SDPA backends a KV-cache benchmark lets transformers' ``sdpa`` attention use (``--sdpa``)."""

from __future__ import annotations

import contextlib
from typing import Any

from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION], "default": None}
"""``--sdpa`` choices. "flash": flash attention, memory-efficient attention where a mask needs it (prefill
chunks over a past); "default": torch's own choice (on an H200 with torch 2.11 that choice was about 2.8x
slower a decode step over token counts it had not attended before, as in real decoding)."""


def backends(name: str) -> Any:
    """A context in which SDPA uses the backends ``BACKENDS[name]`` (nothing changes for "default")."""
    chosen = BACKENDS[name]
    return contextlib.nullcontext() if chosen is None else sdpa_kernel(chosen)
