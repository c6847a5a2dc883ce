"""What an index holds: runs of codes with their ids (:class:`CodeList`) and immutable snapshots of all
of them (:class:`IndexState`).

Writers (add, remove) build a new :class:`IndexState` and publish it in one assignment; a search reads
the state once and sees it whole, however the index changes meanwhile. A new row is written past a
list's live size (where no published state looks) and becomes live only in the new state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor

from .codes import Codes

LIST_SHIFT = 32
"""A label of a list index is ``list_number << LIST_SHIFT | row``: a stored vector's place while a search runs."""


@dataclass(frozen=True, eq=False)
class CodeList:
    """One growing run of codes with their ids and optional kept vectors; rows [0, size) are live.

    ``ids`` None means row i has id i: no id array is held (an index filled with the default ids).
    Buffers grow by doubling. A new row is written past ``size`` and becomes live only in the
    ``CodeList`` returned by :meth:`appended`, so a failed or interrupted add changes nothing live.
    """

    codes: Codes | None = None  # Codes [capacity]
    ids: Tensor | None = None  # int64 [capacity], or None: the id of row i is i
    vectors: Tensor | None = None  # [capacity, dim] float16/32
    size: int = 0

    @cached_property
    def live_codes(self) -> Codes:
        return self.codes[: self.size]

    @cached_property
    def live_ids(self) -> Tensor:
        """int64 [size] (built on demand when the ids are implicit)."""
        if self.ids is None:
            return torch.arange(self.size, device=None if self.codes is None else self.codes.device)
        return self.ids[: self.size]

    @property
    def capacity(self) -> int:
        return 0 if self.codes is None else len(self.codes)

    @property
    def nbytes(self) -> int:
        vec = 0 if self.vectors is None else self.vectors.numel() * self.vectors.element_size()
        ids = 0 if self.ids is None else self.ids.numel() * 8
        return (0 if self.codes is None else self.codes.nbytes) + ids + vec

    def appended(self, codes: Codes, ids: Tensor, vectors: Tensor | None) -> "CodeList":
        """This list with rows appended (codes [m], ids int64 [m], vectors [m, dim] or None)."""
        size, need = self.size, self.size + len(ids)
        implicit = self.ids is None and bool(torch.equal(ids, torch.arange(size, need, device=ids.device)))
        grow = self.codes is None or need > self.capacity
        cap = max(need, 2 * self.capacity) if grow else self.capacity
        new_codes = codes.empty_like(cap) if grow else self.codes
        new_vectors = self.vectors
        if vectors is not None and grow:
            new_vectors = vectors.new_empty(cap, vectors.shape[1])
        if grow and size:
            new_codes.copy_(slice(0, size), self.live_codes)
            if vectors is not None:
                new_vectors[:size] = self.vectors[:size]
        new_ids = None if implicit else self.ids
        if not implicit and (grow or self.ids is None):  # a larger id array, or the first explicit one
            new_ids = ids.new_empty(cap)
            new_ids[:size] = self.live_ids
        new_codes.copy_(slice(size, need), codes)
        if new_ids is not None:
            new_ids[size:need] = ids
        if vectors is not None:
            new_vectors[size:need] = vectors
        return CodeList(new_codes, new_ids, new_vectors, need)

    def kept(self, keep: Tensor) -> "CodeList":
        """A compacted copy holding the live rows where ``keep`` (bool [size]) is true."""
        vectors = None if self.vectors is None else self.vectors[: self.size][keep]
        return CodeList(self.live_codes[keep].contiguous(), self.live_ids[keep], vectors, int(keep.sum()))

    def to(self, device: torch.device) -> "CodeList":
        """A copy of the live rows on ``device`` (capacity = size)."""
        if self.codes is None:
            return self
        move = lambda t: None if t is None else t[: self.size].to(device)  # noqa: E731
        return CodeList(self.live_codes.to(device), move(self.ids), move(self.vectors), self.size)


@dataclass(frozen=True, eq=False)
class IndexState:
    """An immutable snapshot of an index's lists, with data derived from them cached per snapshot."""

    lists: tuple[CodeList, ...]
    next_id: int = 0
    cache: dict = field(default_factory=dict)  # derived tensors, valid for this snapshot only

    @property
    def ntotal(self) -> int:
        return sum(c.size for c in self.lists)

    @property
    def rows_are_ids(self) -> bool:
        """One list whose row i has id i: labels are ids."""
        return len(self.lists) == 1 and self.lists[0].ids is None

    def all_ids(self) -> Tensor:
        """Every stored id, list after list: int64 [ntotal] (built on demand, not kept, when rows are ids)."""
        if self.rows_are_ids:
            return self.lists[0].live_ids
        return self._id_table()[0][:-1]

    def _id_table(self) -> tuple[Tensor, Tensor]:
        """(all ids list after list and then a -1, int64 [ntotal + 1]; start of each list int64 [nlists])."""
        if "ids" not in self.cache:
            sizes = torch.tensor([c.size for c in self.lists])
            device = next((c.codes.device for c in self.lists if c.codes is not None), torch.device("cpu"))
            ids = torch.cat([c.live_ids for c in self.lists] + [torch.full((1,), -1, device=device)])
            self.cache["ids"] = (ids, (sizes.cumsum(0) - sizes).to(device))
        return self.cache["ids"]

    def ids_of(self, labels: Tensor) -> Tensor:
        """Ids of labels (any shape; -1 stays -1)."""
        if self.rows_are_ids:
            return labels
        ids, starts = self._id_table()
        if len(starts) == 1:  # labels are rows; -1 picks the trailing -1
            return torch.take(ids, labels)
        pos = starts[labels >> LIST_SHIFT] + (labels & ((1 << LIST_SHIFT) - 1))
        return ids[torch.where(labels >= 0, pos, -1)]

    def vectors_of(self, labels: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
        """Kept vectors of labels [m, depth] -> [m, depth, dim] (zeros for label -1)."""
        flat = labels.reshape(-1)
        valid = torch.nonzero(flat >= 0).squeeze(1)
        lab = flat[valid]
        out = torch.zeros(len(flat), dim, dtype=dtype, device=labels.device)
        nos, rows = lab >> LIST_SHIFT, lab & ((1 << LIST_SHIFT) - 1)
        order = torch.argsort(nos)
        uniq, counts = torch.unique_consecutive(nos[order], return_counts=True)
        for no, part in zip(uniq.tolist(), torch.split(order, counts.tolist())):
            out[valid[part]] = self.lists[no].vectors[rows[part]]
        return out.reshape(*labels.shape, dim)

    @property
    def nbytes(self) -> int:
        """Bytes of the lists' buffers as allocated."""
        return sum(c.nbytes for c in self.lists)
