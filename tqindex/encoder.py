"""Encoder base class (input validation, shapes, devices, serialisation) and the encoder registry.

Subclasses are dataclasses whose fields are their configuration; they implement ``_build`` (the
tensors derived from the configuration: rotation, codebook, ...), ``_encode``, ``_decode_rotated``
and ``code_size``. Everything else (validation, batching over leading dims, devices, ``score``) is here.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from . import kernels
from .checks import as_float_tensor, check_norms, row_norms
from .codes import Codes
from .scorer import DecodeScorer
from .rotation import Rotation

ENCODE_BLOCK_ELEMENTS = 1 << 20
"""Encode works through blocks of about this many float elements."""
WIDE_NORMS = (2.0**-100, 2.0**100)
"""Nonzero input norms an encoder with float32 side data (or power-of-two scales) holds faithfully."""


class Encoder(ABC):
    """Base of every encoder: ``encode`` / ``decode`` / ``score`` over the last dimension.

    ``score(q, codes) == q @ decode(codes).mT`` is the definition; subclasses compute it in the rotated
    domain (``<q, x̂> = <R q, R x̂>``) without rotating the database back.

    Encoders return torch whatever their input: ``encode`` gives :class:`Codes` of torch tensors (on the
    input's device; the CPU for numpy input), ``decode`` / ``score`` float32 tensors on the codes' device.
    Indexes, by contrast, return numpy for numpy queries. ``backend`` picks the kernels (see
    ``tqindex.kernels``); it is a choice of this process, not part of the codes' configuration.
    """

    dim: int
    seed: int
    rotation: str
    backend: str | None
    encodes_in_blocks: ClassVar[bool] = True
    """Whether :meth:`encode_valid` hands ``_encode`` blocks of about ENCODE_BLOCK_ELEMENTS elements
    (False: ``_encode`` bounds its own temporary memory)."""

    # -- configuration -----------------------------------------------------------------------------
    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 2:
            raise ValueError(f"dim must be an integer >= 2, got {self.dim!r}")
        kernels.check_backend(self.backend)
        if not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        self._validate()
        self._state: dict[str, Tensor] = self._build()
        self._per_device: dict[torch.device, dict[str, Tensor]] = {}
        self._rotations: dict[torch.device, Rotation] = {}
        self._derived: dict[tuple[torch.device, str], Any] = {}

    def _validate(self) -> None:
        """Check subclass fields (raise ValueError naming the field)."""

    def _build(self) -> dict[str, Tensor]:
        """Tensors derived from the configuration (CPU). Keys become file dataset names."""
        return Rotation.create(self.dim, self.seed, self.rotation).tensors()

    def tensors(self) -> dict[str, Tensor]:
        """All derived tensors (rotation, codebook, ...) as stored in index files."""
        return dict(self._state)

    def load_tensors(self, tensors: dict[str, Tensor]) -> None:
        """Replace the derived tensors by stored ones (same names, shapes and dtypes required)."""
        if set(tensors) != set(self._state):
            raise ValueError(f"encoder tensors {sorted(tensors)} do not match expected {sorted(self._state)}")
        for k, v in tensors.items():
            ref = self._state[k]
            if tuple(v.shape) != tuple(ref.shape) or v.dtype != ref.dtype:
                raise ValueError(f"encoder tensor {k!r}: got {tuple(v.shape)} {v.dtype}, "
                                 f"expected {tuple(ref.shape)} {ref.dtype}")
        self._state = {k: v.detach().cpu().clone() for k, v in tensors.items()}
        self._tensors_changed()

    def _tensors_changed(self) -> None:
        """Drop everything derived from the tensors (per-device copies, rotations, kernel tables)."""
        self._per_device.clear()
        self._rotations.clear()
        self._derived.clear()

    def derived(self, device: torch.device | str, key: str, build: Callable[[], Any]) -> Any:
        """What ``build()`` derives from the encoder's tensors for ``device`` (kernel tables, ...), built once
        per device and key, dropped when the tensors change."""
        slot = (torch.device(device), key)
        if slot not in self._derived:
            self._derived[slot] = build()
        return self._derived[slot]

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable configuration of the codes: ``{"type": class name, field: value, ...}`` (the
        ``backend`` is a choice of this process, not of the codes, and is left out)."""
        return {"type": type(self).__name__, **{f.name: getattr(self, f.name) for f in self._config_fields()}}

    def _config_fields(self) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(self) if f.name != "backend"]

    def _backend(self, backend: str | None) -> str | None:
        """The backend of one call: ``backend``, else the encoder's (None: ``$TQINDEX_BACKEND``, else auto)."""
        return self.backend if backend is None else kernels.check_backend(backend)

    def _on(self, device: torch.device) -> dict[str, Tensor]:
        """Derived tensors on ``device`` (cached)."""
        if device not in self._per_device:
            self._per_device[device] = {k: v.to(device) for k, v in self._state.items()}
        return self._per_device[device]

    def _rotation(self, device: torch.device) -> Rotation:
        """The rotation with its tensors on ``device`` (cached with them)."""
        if device not in self._rotations:
            s = self._on(device)
            kind = "hadamard" if "signs" in s else "dense" if "matrix" in s else "none"
            self._rotations[device] = Rotation(self.dim, kind, s.get("signs"), s.get("matrix"))
        return self._rotations[device]

    @property
    def is_trained(self) -> bool:
        """False while the encoder still needs :meth:`train` (only learned encoders do)."""
        return True

    def train(self, x: Any) -> None:
        """Fit the encoder to vectors x [n, dim]; data-oblivious encoders need nothing and ignore it."""

    @property
    @abstractmethod
    def code_size(self) -> int:
        """Exact bytes per encoded vector (codes + side data)."""

    @property
    def norm_limits(self) -> tuple[float, float]:
        """(low, high): the nonzero input norms whose codes this encoder stores faithfully (its side data's
        range); :meth:`encode` refuses vectors outside it."""
        return WIDE_NORMS

    @property
    def bits_per_dim(self) -> float:
        """Stored bits per coordinate, side data included."""
        return 8.0 * self.code_size / self.dim

    # -- public operations -------------------------------------------------------------------------
    def encode(self, x: Any, backend: str | None = None) -> Codes:
        """Encode vectors ``x`` [..., dim] (numpy or torch; float16/bfloat16/float32/float64) -> Codes [...]
        of torch tensors on x's device (numpy input: the CPU).

        ValueError for vectors whose norm is outside :attr:`norm_limits` (zero vectors are fine).
        ``backend``: for this call (default: the encoder's; see ``tqindex.kernels``)."""
        t = as_float_tensor(x, self.dim)
        self.check_norms(row_norms(t), "x")
        return self.encode_valid(t.reshape(-1, self.dim), backend).reshape(*t.shape[:-1])

    def check_norms(self, norms: Tensor, name: str) -> None:
        """ValueError naming the vectors whose norms (float32 [n]) are outside :attr:`norm_limits`."""
        check_norms(norms, *self.norm_limits, name, f"{type(self).__name__}'s side data",
                    "store float32 side data (norm_dtype='float32') or rescale the vectors")

    def encode_valid(self, t: Tensor, backend: str | None = None) -> Codes:
        """:meth:`encode` without the input checks, for rows already validated by :func:`as_float_tensor`
        (and :meth:`check_norms`): float32 t [N, dim] -> Codes [N]. Side data beyond its storage type's range
        saturates at its largest finite value."""
        backend = self._backend(backend)
        if not self.encodes_in_blocks:
            return self._encode(t, backend)
        rows = max(1, ENCODE_BLOCK_ELEMENTS // self.dim)  # bounded temporary memory
        parts = [self._encode(t[i : i + rows], backend) for i in range(0, t.shape[0], rows)]
        return parts[0] if len(parts) == 1 else Codes.cat(parts)

    def decode(self, codes: Codes) -> Tensor:
        """Codes [...] -> reconstructed vectors [..., dim], float32 torch on the codes' device."""
        return self.rotate_back(self.decode_rotated(codes))

    def decode_rotated(self, codes: Codes) -> Tensor:
        """Codes [...] -> ``R x̂`` [..., dim] float32: the reconstruction in the rotated domain."""
        self._check_codes(codes)
        return self._decode_rotated(codes)

    def prepare_queries(self, q: Any, device: torch.device | str | None = None) -> Tensor:
        """Validate and rotate queries: q [..., m, dim] -> ``R q`` [..., m, dim] float32 on ``device``."""
        qt = as_float_tensor(q, self.dim, "q")
        if device is not None:
            qt = qt.to(device)
        return self.rotate(qt)

    def rotate(self, x: Tensor) -> Tensor:
        """``R x`` for float32 x [..., dim] already validated (:meth:`prepare_queries` without the checks)."""
        return self._rotation(x.device).apply(x)

    def rotate_back(self, y: Tensor) -> Tensor:
        """``Rᵀ y`` for y [..., dim] float in the rotated domain (e.g. attention outputs summed there)."""
        return self._rotation(y.device).inverse(y)

    def score_prepared(self, qr: Tensor, codes: Codes) -> Tensor:
        """:meth:`score` for queries already rotated by :meth:`prepare_queries`: -> [..., m, n] float32."""
        return qr @ self.decode_rotated(codes).mT

    def scorer(self, qs: Tensor, l2: bool, backend: str | None = None, shifted: bool = False, bar: Any = None):
        """A :class:`~tqindex.scorer.Scorer` of this encoder's codes for prepared queries qs [m, dim] (rotated,
        doubled for "l2": see :mod:`tqindex.scorer`): scores of code blocks and their fused top-k. Here
        decode-and-GEMM (torch, any device); encoders with faster scans override this. ``shifted``: pushes
        may shift the queries (residual IVF lists); ``bar``: a progress bar counting scores."""
        kernels.select(qs, self._backend(backend), (), f"scans of {type(self).__name__} codes")
        return DecodeScorer(self, qs, l2, bar)

    def score(self, q: Any, codes: Codes) -> Tensor:
        """Inner-product estimates ``q @ decode(codes).mT``: q [..., m, dim], codes [..., n] -> [..., m, n].

        Float32 torch on the codes' device. TurboQuantProd's estimate is unbiased for ``<q, x>``.
        """
        return self.score_prepared(self.prepare_queries(q, codes.device), codes)

    def _check_codes(self, codes: Codes) -> None:
        if not isinstance(codes, Codes):
            raise TypeError(f"codes must be a tqindex Codes object, got {type(codes).__name__}")
        expected = self._expected_qdata_bytes()
        if codes.qdata.shape[-1] != expected:
            raise ValueError(
                f"codes have {codes.qdata.shape[-1]} code bytes per vector, this encoder writes {expected}: "
                "they come from a different encoder"
            )

    # -- subclass hooks ----------------------------------------------------------------------------
    @abstractmethod
    def _expected_qdata_bytes(self) -> int:
        """Bytes of the ``qdata`` plane per vector."""

    @abstractmethod
    def _encode(self, x: Tensor, backend: str | None = None) -> Codes:
        """x [N, dim] float32 -> Codes [N] (``backend``: for ``kernels.select``)."""

    @abstractmethod
    def _decode_rotated(self, codes: Codes) -> Tensor:
        """Codes [...] -> R x̂ [..., dim] float32 (the reconstruction in the rotated domain)."""

    def __repr__(self) -> str:
        args = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in self._config_fields())
        return f"{type(self).__name__}({args})"


# --------------------------------------------------------------------------------------------------
# registry

_CLASSES: dict[str, type[Encoder]] = {}
_NAMES: dict[str, Callable[..., Encoder]] = {}


def register_class(cls: type[Encoder]) -> type[Encoder]:
    """Make ``cls`` loadable by :func:`encoder_from_dict`."""
    _CLASSES[cls.__name__] = cls
    return cls


def register_name(name: str, factory: Callable[..., Encoder]) -> None:
    """Make ``make_encoder(name, dim, **kw)`` call ``factory(dim=dim, **kw)``."""
    _NAMES[name] = factory


def encoder_names() -> list[str]:
    """Every name :func:`make_encoder` accepts."""
    return sorted(_NAMES)


def make_encoder(name: str, dim: int, **overrides: Any) -> Encoder:
    """Encoder by registry name ("tq1".."tq4", "tq8", "tq3-prod", "tq4-norm", "fp4", ...) for ``dim``."""
    if not isinstance(name, str) or name not in _NAMES:
        raise ValueError(f"unknown encoder name {name!r}; known names: {', '.join(encoder_names())}")
    return _NAMES[name](dim=dim, **overrides)


def encoder_from_dict(config: dict[str, Any], tensors: dict[str, Tensor] | None = None) -> Encoder:
    """Rebuild an encoder from :meth:`Encoder.to_dict` output (and, optionally, stored tensors)."""
    if not isinstance(config, dict) or config.get("type") not in _CLASSES:
        got = config.get("type") if isinstance(config, dict) else type(config).__name__
        raise ValueError(f"unknown encoder type {got!r}; known: {sorted(_CLASSES)}")
    cls = _CLASSES[config["type"]]
    names = {f.name for f in dataclasses.fields(cls)} - {"backend"}
    unknown = set(config) - names - {"type"}
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}")
    enc = cls(**{k: v for k, v in config.items() if k != "type"})
    if tensors is not None:
        enc.load_tensors(tensors)
    return enc
