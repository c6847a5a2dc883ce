"""index_factory: an index from a faiss-style description string.

Grammar (components separated by commas, no spaces needed)::

    description := [ "IVF" nlist "," ] encoder [ ",RFlat" ]
    encoder     := tq1 | tq2 | tq3 | tq4 | tq8          TurboQuant codes (the default rescaling)
                 | tq{b}-norm | tq{b}-prod              the paper's Q_mse / Q_prod with QJL
                 | tq{b}-pca                            trained: call index.train(x) first
                 | fp4                                  FP4-UE8M0, 4.25 bits per coordinate

``"tq4"`` is a :class:`~tqindex.index.FlatIndex` over 4-bit codes, ``"IVF1024,tq4"`` an
:class:`~tqindex.ivf.IVFIndex` with 1024 lists (train it first), ``",RFlat"`` keeps the original
vectors and re-ranks candidates exactly (``keep_vectors=True``), as faiss's refine suffix.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from .encoder import encoder_names, make_encoder
from .index import BaseIndex, FlatIndex
from .ivf import IVFIndex

GRAMMAR = ('[IVF<nlist>,]<encoder>[,RFlat] with <encoder> one of {names}; '
           'e.g. "tq4", "tq2-pca", "IVF1024,tq4", "IVF256,tq4,RFlat"')
_IVF = re.compile(r"IVF([0-9]+)")


def _options(cls: type[BaseIndex], skip: tuple[str, ...]) -> list[str]:
    """Keyword options of ``cls``'s constructor, without ``skip``."""
    return [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", *skip)]


def index_factory(dim: int, description: str, metric: str = "ip", **options: Any) -> FlatIndex | IVFIndex:
    """An empty index for vectors of ``dim`` coordinates, described faiss-style.

    description: ``[IVF<nlist>,]<encoder>[,RFlat]`` (see the module docstring), e.g. ``"tq4"``,
    ``"tq2-pca"``, ``"IVF1024,tq4"``. metric: "ip", "cosine" or "l2". options go to the index
    constructor: ``keep_vectors``, ``vectors_dtype``, ``rerank_factor`` for every index and
    ``nprobe``, ``by_residual``, ``seed``, ``niter`` for IVF ones.

    Returns a :class:`~tqindex.index.FlatIndex`, or an :class:`~tqindex.ivf.IVFIndex` when the
    description starts with ``IVF<nlist>``. Raises ValueError for a description outside the grammar
    (the message lists it) and TypeError for an option the index does not take.
    """
    if not isinstance(description, str):
        raise TypeError(f"description must be a string {_grammar()}, got {type(description).__name__}")
    parts = [p.strip() for p in description.split(",")]
    nlist = None
    match = _IVF.fullmatch(parts[0])
    if match:
        nlist = int(match.group(1))
        if nlist < 1:
            raise ValueError(f"nlist must be >= 1 in index description {description!r}: expected {_grammar()}")
        parts = parts[1:]
    if parts and parts[-1] == "RFlat":
        if options.get("keep_vectors") is False:
            raise ValueError(f"{description!r} keeps vectors (RFlat) but keep_vectors=False was passed")
        options["keep_vectors"] = True
        parts = parts[:-1]
    if len(parts) != 1:
        raise ValueError(f"cannot parse index description {description!r}: expected {_grammar()}")
    name = parts[0]
    if name not in encoder_names():
        raise ValueError(f"unknown encoder name {name!r} in index description {description!r}: expected {_grammar()}")
    cls = FlatIndex if nlist is None else IVFIndex
    allowed = _options(cls, ("encoder", "nlist", "metric"))
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        hint = ""
        if nlist is None and set(unknown) & set(_options(IVFIndex, ())):
            hint = " (IVF options need an 'IVF<nlist>,' prefix in the description)"
        raise TypeError(f"index_factory got unknown options {unknown} for {cls.__name__}{hint}; "
                        f"it takes {', '.join(allowed)}")
    encoder = make_encoder(name, dim)
    if nlist is None:
        return FlatIndex(encoder, metric=metric, **options)
    return IVFIndex(encoder, nlist, metric=metric, **options)


def _grammar() -> str:
    return GRAMMAR.format(names=", ".join(encoder_names()))
