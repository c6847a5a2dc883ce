"""Many sessions' KV caches under one byte budget: :class:`SessionStore`.

An agent server keeps many multi-turn sessions whose histories grow to tens of thousands of tokens. While
a session's cache stays resident, its next turn prefills only the new tokens; once the cache was evicted,
the turn re-prefills the whole history first. A compressed cache keeps more sessions resident under the
same memory, so fewer turns pay that re-prefill: that is what this store measures and serves.

    store = SessionStore(model, lambda: TQCache.preset(model.config, "k4v4"), budget_bytes=48 * 10**9)
    store.open("alice")
    result = store.turn("alice", user_token_ids, max_new_tokens=256)
    result.output_ids, result.ttft_s, result.status       # the answer, seconds to its first token, "new"

A session is its token history (every token sent and answered, in order) and, while resident, one cache
(built by ``cache_factory``: ``DynamicCache``, :class:`~tqindex.kv.TQCache`, :class:`~tqindex.kv.FP8Cache`,
any transformers cache of a decoder-only model) holding the keys and values of a prefix of that history.
The last answer token of a turn is not run through the model at its turn (its logits are not needed); it is
prefilled with the next turn's tokens, as ``generate`` leaves it too.

Budget. After every :meth:`SessionStore.turn` and :meth:`SessionStore.extend` the resident caches hold at
most ``budget_bytes``, counted by :func:`allocated_bytes`: the bytes of the storages behind every tensor a
cache holds (a growing buffer's unused capacity counts; encoders shared by every cache do not). Before a
turn, least recently used sessions are evicted to leave room for the turn's estimated growth (its tokens
times the bytes per token the resident caches hold); after it, the measured bytes are enforced exactly, the
session of the turn kept. When that session alone exceeds the budget, the turn is undone (its tokens
leave the history, its cache is dropped) and ``ValueError`` says so.

Eviction, least recently used first: the cache is dropped (its next turn re-prefills the history), or with
``offload=True`` moved to host memory through its layers' ``offload()`` (and back with ``prefetch()`` at its
next turn), the transfer timed into the turn that needs it (``transfer_s``, part of ``ttft_s``). Offloaded
caches count against ``host_budget_bytes`` (no limit when None; beyond it the least recently used are
dropped). A model on the CPU has nothing to move: offloaded caches stay where they are but count against
the host budget instead of ``budget_bytes``.

Compaction (``compact=True``): after its turn, a cache registered as a torch pytree node whose storages
exceed the tensors it holds (a :class:`~tqindex.kv.TQCache` code buffer grows by a 32nd) is rebuilt from
copies of its leaves at their exact size, one copy of the cache.

Timing. ``ttft_s`` runs from the call to the first answer token on the host: restore, evictions made for
room (with their transfers), re-prefill, prefill. ``decode_s`` covers the one-token steps after it.

An exception inside a turn or an extend (an interrupt, an out-of-memory error) leaves the session's history as
it was and drops its cache, which may hold part of the turn: its next turn re-prefills.

Threads: every public method holds one lock, so calls from several threads are served one at a time (the
model runs one forward pass at a time); a turn blocks other calls until it ends.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from ..checks import check_bool, check_int
from ..encoder import Encoder

RESIDENT, OFFLOADED, EVICTED = "resident", "offloaded", "evicted"
"""Session states: cache on the model's device, cache in host memory, no cache."""


def allocated_bytes(cache: Any) -> int:
    """Bytes of the storages behind every tensor reachable from ``cache`` (its attributes, recursively),
    each storage counted once however many tensors view it: what the cache keeps allocated, unused capacity
    of growing buffers included. Encoders (shared by every cache of a model) are not counted."""
    storages: dict[tuple[str, int], int] = {}
    seen: set[int] = set()
    stack = [cache]
    while stack:
        obj = stack.pop()
        if isinstance(obj, Tensor):
            storage = obj.untyped_storage()
            storages[(str(obj.device), storage.data_ptr())] = storage.nbytes()
        elif isinstance(obj, (str, bytes, int, float, bool, torch.device, torch.dtype, Encoder)) or id(obj) in seen:
            continue
        else:
            seen.add(id(obj))
            if isinstance(obj, dict):
                stack.extend(obj.values())
            elif isinstance(obj, (list, tuple, set, frozenset)):
                stack.extend(obj)
            elif hasattr(obj, "__dict__"):
                stack.extend(vars(obj).values())
    return sum(storages.values())


@dataclass(frozen=True)
class TurnResult:
    """What one :meth:`SessionStore.turn` did and measured.

    status: ``"new"`` (the session's first turn), ``"hit"`` (its cache was resident), ``"restored"`` (brought
    back from host memory), ``"miss"`` (evicted: the history was re-prefilled).
    ttft_s: seconds from the call to the first answer token on the host (see the module notes).
    prefill_tokens: tokens run through the model before the first answer token (= reprefill_tokens +
    new_tokens). reprefill_tokens: history tokens among them (the whole history after an eviction; else the
    previous turn's last answer token and tokens added by :meth:`~SessionStore.extend` while not resident).
    transfer_s: seconds of cache moves between host and device in this turn (restore, offloads for room).
    output_ids: the answer appended to the history. predicted_ids: the model's greedy token at each answer
    position (equal to output_ids when generated; the comparison when ``answer_ids`` forced the answer).
    decode_tokens / decode_s: one-token forward passes after the first answer token, and their seconds.
    context_tokens: history length after the turn. cache_bytes: allocated bytes of this session's cache
    after the turn; resident_bytes: of all resident caches. evicted: sessions evicted during the turn.
    first_logits: float32 [vocab] logits of the first answer position, on the CPU.
    """

    session_id: Hashable
    turn: int
    status: str
    ttft_s: float
    prefill_tokens: int
    reprefill_tokens: int
    new_tokens: int
    transfer_s: float
    output_ids: list[int]
    predicted_ids: list[int]
    decode_tokens: int
    decode_s: float
    context_tokens: int
    cache_bytes: int
    resident_bytes: int
    evicted: tuple[Hashable, ...]
    first_logits: Tensor = field(repr=False)


@dataclass(frozen=True)
class ExtendResult:
    """What one :meth:`SessionStore.extend` did: tokens prefilled into a resident cache (0 when the session
    was not resident), their seconds, sessions evicted, the session's cache bytes afterwards."""

    prefill_tokens: int
    seconds: float
    evicted: tuple[Hashable, ...]
    cache_bytes: int


@dataclass
class _Session:
    history: list[int] = field(default_factory=list)
    cache: Any = None
    cached: int = 0  # history tokens held by the cache
    state: str = EVICTED
    bytes: int = 0  # allocated bytes of the cache when last measured
    turns: int = 0


class _OverBudget(Exception):
    """A session's cache alone holds more than the budget: ``nbytes`` for ``tokens`` tokens."""

    def __init__(self, nbytes: int, tokens: int) -> None:
        self.nbytes, self.tokens = nbytes, tokens


class SessionStore:
    """The caches of many sessions of one model under a byte budget (see the module notes).

    model: a causal LM (transformers ``PreTrainedModel``, decoder-only), used as it is (its attention
    implementation included); caches are built on its device. cache_factory: a callable with no arguments
    returning a new, empty transformers cache. budget_bytes: bytes the resident caches may hold after a
    turn. offload: move evicted caches to host memory instead of dropping them. host_budget_bytes: bytes
    offloaded caches may hold (None: no limit; only with ``offload``). compact: copy a grown pytree cache to
    its exact size after its turn. prefill_chunk: tokens per forward pass of a prefill (None: one pass).
    prefill_attention: the model's attention implementation during prefills and extends (e.g. ``"sdpa"``,
    where a TQCache hands out its history decoded, against ``"tqindex"`` attending from the codes), the
    model's own restored for the one-token steps; None: the model's own throughout. decode_graph: run each
    answer's one-token steps through a :class:`~tqindex.kv.decode_graph.DecodeGraph` (recorded at the answer's
    second step, replayed after; a cache it cannot replay raises its ValueError at the first answer).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cache_factory: Callable[[], Any],
        budget_bytes: int,
        *,
        offload: bool = False,
        host_budget_bytes: int | None = None,
        compact: bool = True,
        prefill_chunk: int | None = None,
        prefill_attention: str | None = None,
        decode_graph: bool = False,
    ) -> None:
        if not callable(cache_factory):
            raise TypeError(
                f"cache_factory must be a callable returning a new cache, got {type(cache_factory).__name__}"
            )
        self.model = model
        self.cache_factory = cache_factory
        self.budget_bytes = check_int(budget_bytes, "budget_bytes", 1)
        self.offload = check_bool(offload, "offload")
        if host_budget_bytes is not None:
            if not offload:
                raise ValueError("host_budget_bytes limits offloaded caches: it needs offload=True")
            host_budget_bytes = check_int(host_budget_bytes, "host_budget_bytes", 0)
        self.host_budget_bytes = host_budget_bytes
        self.compact = check_bool(compact, "compact")
        self.prefill_chunk = None if prefill_chunk is None else check_int(prefill_chunk, "prefill_chunk", 1)
        if prefill_attention is not None and not isinstance(prefill_attention, str):
            raise TypeError(f"prefill_attention must be an attention implementation name or None, got "
                            f"{type(prefill_attention).__name__}")
        self.prefill_attention = prefill_attention
        self.decode_graph = check_bool(decode_graph, "decode_graph")
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_input_embeddings().num_embeddings
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # "cache" since transformers 5.24
        self._sessions: dict[Hashable, _Session] = {}
        self._resident: OrderedDict[Hashable, None] = OrderedDict()  # least recently used first
        self._offloaded: OrderedDict[Hashable, None] = OrderedDict()
        self._lock = threading.RLock()
        self.counters = {"turns": 0, "new": 0, "hit": 0, "restored": 0, "miss": 0, "dropped": 0, "offloaded": 0,
                         "host_dropped": 0, "compacted": 0, "reprefill_tokens": 0}
        self.peak_resident_bytes = 0
        self.peak_host_bytes = 0

    # -- sessions ----------------------------------------------------------------------------------
    def open(self, session_id: Hashable) -> None:
        """Start an empty session named ``session_id`` (any hashable)."""
        with self._lock:
            hash(session_id)  # TypeError for unhashable ids
            if session_id in self._sessions:
                raise ValueError(f"session_id {session_id!r} is open already")
            self._sessions[session_id] = _Session()

    def close(self, session_id: Hashable) -> None:
        """End a session: its history and cache are freed."""
        with self._lock:
            self._session(session_id)
            self._forget(session_id)
            del self._sessions[session_id]

    @property
    def sessions(self) -> list[Hashable]:
        """Open session ids, in opening order."""
        with self._lock:
            return list(self._sessions)

    def history(self, session_id: Hashable) -> list[int]:
        """A copy of the session's token history."""
        with self._lock:
            return list(self._session(session_id).history)

    def state(self, session_id: Hashable) -> str:
        """``"resident"``, ``"offloaded"`` or ``"evicted"`` (no cache: a new session or a dropped one)."""
        with self._lock:
            return self._session(session_id).state

    def cache(self, session_id: Hashable) -> Any:
        """The session's cache (None when it has none), to inspect; changing it behind the store's back
        breaks the store's accounting."""
        with self._lock:
            return self._session(session_id).cache

    def evict(self, session_id: Hashable) -> None:
        """Evict a resident session now, as the budget would: drop its cache, or offload it with ``offload``."""
        with self._lock:
            if self._session(session_id).state != RESIDENT:
                raise ValueError(f"session_id {session_id!r} is not resident (it is {self.state(session_id)})")
            self._evict(session_id)

    @property
    def resident_bytes(self) -> int:
        """Allocated bytes of the resident caches, as last measured."""
        with self._lock:
            return sum(self._sessions[i].bytes for i in self._resident)

    @property
    def host_bytes(self) -> int:
        """Allocated bytes of the offloaded caches."""
        with self._lock:
            return sum(self._sessions[i].bytes for i in self._offloaded)

    def stats(self) -> dict[str, Any]:
        """Counters (turns by status, evictions, tokens re-prefilled, ...), bytes and peaks, session counts."""
        with self._lock:
            return {**self.counters, "sessions": len(self._sessions), "resident_sessions": len(self._resident),
                    "offloaded_sessions": len(self._offloaded), "resident_bytes": self.resident_bytes,
                    "host_bytes": self.host_bytes, "peak_resident_bytes": self.peak_resident_bytes,
                    "peak_host_bytes": self.peak_host_bytes, "budget_bytes": self.budget_bytes}

    # -- turns -------------------------------------------------------------------------------------
    def turn(
        self,
        session_id: Hashable,
        new_token_ids: Sequence[int] | Tensor,
        max_new_tokens: int | None = None,
        *,
        answer_ids: Sequence[int] | Tensor | None = None,
        eos_token_id: int | Sequence[int] | None = None,
    ) -> TurnResult:
        """One turn: prefill ``new_token_ids`` (1-D, at least one id) over the session's cache (or its whole
        history first when the cache was evicted), answer, append both to the history.

        The answer is generated greedily, ``max_new_tokens`` tokens (fewer when a token of ``eos_token_id``
        comes, which is kept), or forced: ``answer_ids`` (1-D, non-empty) are fed one token per step as if
        generated, the model's own greedy choices recorded in ``predicted_ids``. Give exactly one of the two.
        """
        with self._lock, torch.inference_mode():
            s = self._session(session_id)
            new = self._ids(new_token_ids, "new_token_ids")
            if answer_ids is not None:
                if max_new_tokens is not None:
                    raise ValueError("give max_new_tokens (generate) or answer_ids (forced answer), not both")
                forced = self._ids(answer_ids, "answer_ids")
                n_answer = len(forced)
            else:
                forced = None
                n_answer = check_int(max_new_tokens, "max_new_tokens", 1)
            eos = self._eos(eos_token_id)
            before = len(s.history)
            evicted: list[Hashable] = []

            _sync(self.device)
            t0 = time.perf_counter()
            transfer, status = 0.0, {RESIDENT: "hit", OFFLOADED: "restored"}.get(s.state, "miss" if before else "new")
            growth = before + len(new) + n_answer - 1 - s.cached  # tokens this turn adds to the cache
            try:
                if s.state == OFFLOADED:
                    del self._offloaded[session_id]  # leaves the host: never dropped to make room for itself
                    transfer += self._make_room(session_id, s.bytes, growth, evicted)
                    transfer += self._restore(session_id)
                else:
                    transfer += self._make_room(session_id, 0, growth, evicted)
                    if s.state == EVICTED:
                        self._new_cache(session_id)
                prefill = s.history[s.cached:] + new
                logits = self._prefill(s.cache, prefill)
                first = int(logits.argmax())
                ttft = time.perf_counter() - t0
                first_logits = logits.float().cpu()

                t1 = time.perf_counter()
                answer, predicted = self._answer(s.cache, first, forced, n_answer, eos)
                _sync(self.device)
                decode_s = time.perf_counter() - t1
            except BaseException:  # the cache may hold part of this turn: drop it, the history is as it was
                self._forget(session_id)
                raise

            s.history += new + answer
            s.cached = len(s.history) - 1  # the last answer token enters with the next prefill
            s.turns += 1
            try:
                cache_bytes = self._settle(session_id, evicted)
            except _OverBudget as over:
                del s.history[before:]
                s.turns -= 1
                self._forget(session_id)
                raise ValueError(
                    f"budget_bytes={self.budget_bytes} is smaller than session {session_id!r}'s cache after this "
                    f"turn ({over.nbytes} bytes for {over.tokens} tokens): the turn is undone and the session's "
                    "cache dropped; raise budget_bytes"
                ) from None
            self.counters["turns"] += 1
            self.counters[status] += 1
            self.counters["reprefill_tokens"] += len(prefill) - len(new)
            return TurnResult(
                session_id=session_id, turn=s.turns - 1, status=status, ttft_s=ttft, prefill_tokens=len(prefill),
                reprefill_tokens=len(prefill) - len(new), new_tokens=len(new), transfer_s=transfer,
                output_ids=answer, predicted_ids=predicted, decode_tokens=len(answer) - 1, decode_s=decode_s,
                context_tokens=len(s.history), cache_bytes=cache_bytes, resident_bytes=self.resident_bytes,
                evicted=tuple(evicted), first_logits=first_logits,
            )

    def extend(self, session_id: Hashable, token_ids: Sequence[int] | Tensor) -> ExtendResult:
        """Append ``token_ids`` (1-D, at least one id) to the session's history without answering: the rest of
        an answer produced elsewhere, a document the next turn refers to. A resident cache prefills them now
        (with the previous turn's last answer token); otherwise the next turn does."""
        with self._lock, torch.inference_mode():
            s = self._session(session_id)
            ids = self._ids(token_ids, "token_ids")
            before = len(s.history)
            s.history += ids
            evicted: list[Hashable] = []
            if s.state != RESIDENT:
                return ExtendResult(0, 0.0, (), s.bytes)
            tokens = s.history[s.cached:]
            _sync(self.device)
            t0 = time.perf_counter()
            try:
                self._make_room(session_id, 0, len(tokens), evicted)
                self._prefill(s.cache, tokens)
                _sync(self.device)
            except BaseException:  # the cache may hold part of the tokens: drop it, the history is as it was
                del s.history[before:]
                self._forget(session_id)
                raise
            seconds = time.perf_counter() - t0
            s.cached = len(s.history)
            try:
                cache_bytes = self._settle(session_id, evicted)
            except _OverBudget as over:
                del s.history[before:]
                self._forget(session_id)
                raise ValueError(
                    f"budget_bytes={self.budget_bytes} is smaller than session {session_id!r}'s cache after "
                    f"extending it ({over.nbytes} bytes for {over.tokens} tokens): the tokens are "
                    "not added and the session's cache dropped; raise budget_bytes"
                ) from None
            return ExtendResult(len(tokens), seconds, tuple(evicted), cache_bytes)

    # -- model -------------------------------------------------------------------------------------
    def _forward(self, cache: Any, ids: Tensor) -> Tensor:
        """Run ids [1, n] (on the model's device) through the model over ``cache`` -> logits [vocab] of the
        last position."""
        out = self.model(input_ids=ids, **{self._cache_kw: cache}, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    def _prefill(self, cache: Any, tokens: list[int]) -> Tensor:
        """Run ``tokens`` through the model in chunks of ``prefill_chunk``, under ``prefill_attention`` ->
        logits [vocab] after the last."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        step = self.prefill_chunk or len(tokens)
        own = self.model.config._attn_implementation
        if self.prefill_attention is not None:
            self.model.set_attn_implementation(self.prefill_attention)
        try:
            for start in range(0, len(tokens), step):
                logits = self._forward(cache, ids[:, start:start + step])
        finally:
            if self.prefill_attention is not None:
                self.model.set_attn_implementation(own)
        return logits

    def _answer(self, cache: Any, first: int, forced: list[int] | None, n: int,
                eos: set[int]) -> tuple[list[int], list[int]]:
        """Decode after the first answer token ``first``: (answer ids, greedy predictions), each up to n long.
        Every answer token but the last is run through the model."""
        step = self._step(cache)
        if forced is not None:
            steps = [step(torch.tensor([[t]], device=self.device)).argmax() for t in forced[:-1]]
            return forced, [first, *(torch.stack(steps).tolist() if steps else [])]
        token = torch.tensor([[first]], device=self.device)
        tokens = [token]
        for _ in range(n - 1):
            if eos and int(token) in eos:  # reads the token on the host only when a stop token is given
                break
            token = step(token).argmax().view(1, 1)
            tokens.append(token)
        answer = torch.cat(tokens).view(-1).tolist()
        return answer, list(answer)

    def _step(self, cache: Any) -> Callable[[Tensor], Tensor]:
        """The one-token step over ``cache``: ids [1, 1] -> logits [vocab] (through a DecodeGraph with
        ``decode_graph``)."""
        if not self.decode_graph:
            return lambda ids: self._forward(cache, ids)
        from .decode_graph import DecodeGraph  # imports transformers

        graph = DecodeGraph(self.model, cache)
        return lambda ids: graph(ids)[0]

    # -- memory ------------------------------------------------------------------------------------
    def _new_cache(self, session_id: Hashable) -> None:
        cache = self.cache_factory()
        if not hasattr(cache, "layers") or not hasattr(cache, "get_seq_length"):
            raise TypeError(f"cache_factory must return a transformers Cache, got {type(cache).__name__}")
        s = self._sessions[session_id]
        s.cache, s.cached, s.bytes, s.state = cache, 0, 0, RESIDENT
        self._resident[session_id] = None

    def _make_room(self, session_id: Hashable, extra: int, tokens: int, evicted: list[Hashable]) -> float:
        """Evict least recently used sessions other than ``session_id`` until ``extra`` bytes plus ``tokens``
        tokens (at the bytes per token the resident caches hold) fit beside the resident caches. -> seconds
        of transfers."""
        s = self._sessions[session_id]
        held = [self._sessions[i] for i in self._resident if self._sessions[i].cached > 0]
        if s.state == RESIDENT and s.cached > 0:
            per_token = s.bytes / s.cached
        elif held:
            per_token = sum(x.bytes for x in held) / sum(x.cached for x in held)
        else:
            per_token = 0.0
        need = extra + tokens * per_token
        return self._evict_until(lambda: self.resident_bytes + need <= self.budget_bytes, session_id, evicted)

    def _evict_until(self, done: Callable[[], bool], keep: Hashable, evicted: list[Hashable]) -> float:
        """Evict least recently used resident sessions other than ``keep`` until ``done()``. -> seconds of
        transfers."""
        seconds = 0.0
        while not done():
            victim = next((i for i in self._resident if i != keep), None)
            if victim is None:
                break
            seconds += self._evict(victim)
            evicted.append(victim)
        return seconds

    def _evict(self, session_id: Hashable) -> float:
        """Drop or offload a resident session's cache. -> seconds of the transfer."""
        s = self._sessions[session_id]
        del self._resident[session_id]
        if not self.offload:
            s.cache, s.cached, s.bytes, s.state = None, 0, 0, EVICTED
            self.counters["dropped"] += 1
            return 0.0
        t0 = time.perf_counter()
        for layer in s.cache.layers:
            layer.offload()
        _sync(self.device)
        seconds = time.perf_counter() - t0
        s.bytes = allocated_bytes(s.cache)
        s.state = OFFLOADED
        self._offloaded[session_id] = None
        self.counters["offloaded"] += 1
        while self.host_budget_bytes is not None and self.host_bytes > self.host_budget_bytes:
            oldest = next(iter(self._offloaded))
            del self._offloaded[oldest]
            victim = self._sessions[oldest]
            victim.cache, victim.cached, victim.bytes, victim.state = None, 0, 0, EVICTED
            self.counters["host_dropped"] += 1
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        return seconds

    def _restore(self, session_id: Hashable) -> float:
        """Bring an offloaded cache (already out of the host list) back to the device. -> seconds of the
        transfer."""
        s = self._sessions[session_id]
        t0 = time.perf_counter()
        for layer in s.cache.layers:
            layer.prefetch()
        _sync(self.device)
        s.state = RESIDENT
        self._resident[session_id] = None
        return time.perf_counter() - t0

    def _forget(self, session_id: Hashable) -> None:
        """Drop the session's cache, wherever it is."""
        self._resident.pop(session_id, None)
        self._offloaded.pop(session_id, None)
        s = self._sessions[session_id]
        s.cache, s.cached, s.bytes, s.state = None, 0, 0, EVICTED

    def _settle(self, session_id: Hashable, evicted: list[Hashable]) -> int:
        """After a turn: compact the session's cache, measure it, mark it most recently used and evict others
        until the budget holds. -> its bytes. Raises _OverBudget when it alone exceeds the budget."""
        s = self._sessions[session_id]
        if self.compact:
            s.cache = self._compacted(s.cache)
        s.bytes = allocated_bytes(s.cache)
        self._resident.move_to_end(session_id)
        if s.bytes > self.budget_bytes:
            raise _OverBudget(s.bytes, s.cached)
        self._evict_until(lambda: self.resident_bytes <= self.budget_bytes, session_id, evicted)
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
        return s.bytes

    def _compacted(self, cache: Any) -> Any:
        """``cache``, or a copy of its pytree leaves at their exact size when its storages exceed them."""
        leaves, spec = pytree.tree_flatten(cache)
        if spec.is_leaf() or not all(isinstance(t, Tensor) for t in leaves):
            return cache
        if allocated_bytes(cache) <= sum(t.numel() * t.element_size() for t in leaves):
            return cache
        self.counters["compacted"] += 1
        return pytree.tree_unflatten([t.clone() for t in leaves], spec)

    # -- checks ------------------------------------------------------------------------------------
    def _session(self, session_id: Hashable) -> _Session:
        try:
            return self._sessions[session_id]
        except (KeyError, TypeError):
            raise ValueError(f"unknown session_id {session_id!r}: open it first with store.open({session_id!r}) "
                             f"({len(self._sessions)} sessions open)") from None

    def _ids(self, ids: Sequence[int] | Tensor, name: str) -> list[int]:
        """Token ids as a list of ints: 1-D, non-empty, in [0, vocab size)."""
        t = torch.as_tensor(ids) if not isinstance(ids, Tensor) else ids
        if t.numel() == 0:
            raise ValueError(f"{name} is empty: give at least one token id")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer token ids, got dtype {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D (one sequence of token ids), got shape {tuple(t.shape)}")
        low, high = int(t.min()), int(t.max())
        if low < 0 or high >= self.vocab_size:
            raise ValueError(f"{name} must lie in [0, {self.vocab_size}) (the model's vocabulary), got ids in "
                             f"[{low}, {high}]")
        return t.tolist()

    @staticmethod
    def _eos(eos_token_id: int | Sequence[int] | None) -> set[int]:
        if eos_token_id is None:
            return set()
        ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TypeError(f"eos_token_id must be an int or a sequence of ints, got {eos_token_id!r}")
        return set(ids)


def _sync(device: torch.device) -> None:
    """Wait for the device (CUDA) to finish queued work, so that host timers measure it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
