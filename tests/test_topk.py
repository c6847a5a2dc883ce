"""The running top-k kept as tensors (any device) against faiss's heaps."""

import numpy as np
import torch

from tqindex.topk import HeapTopK, TensorTopK

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CUDA, short rows go through the Triton top-k


def test_tensor_topk_equals_the_heaps():
    """Blocks pushed and candidates merged (all rows or a subset, labels -1 for none, a first merge narrower
    or wider than k, of every row or of some) give the same sorted top-k as the heaps."""
    g = torch.Generator().manual_seed(0)
    for first_width, first_rows in ((3, None), (12, None), (12, torch.tensor([2, 0]))):
        tops = [TensorTopK(5, 8, DEVICE), HeapTopK(5, 8)]
        r = 5 if first_rows is None else len(first_rows)
        v = torch.randn(r, first_width, generator=g)
        lab = torch.randint(0, 1000, (r, first_width), generator=g)
        lab[0, 1] = -1
        steps = [("merge", v, lab, first_rows),
                 ("push", torch.randn(2, 6, generator=g), torch.arange(100, 106), torch.tensor([1, 3])),
                 ("merge", torch.randn(3, 4, generator=g), torch.randint(0, 1000, (3, 4), generator=g),
                  torch.tensor([4, 0, 2]))]
        for top in tops:
            dev = DEVICE if isinstance(top, TensorTopK) else "cpu"
            for op, values, labels, rows in steps:
                getattr(top, op)(values.to(dev), labels.to(dev), None if rows is None else rows.to(dev))
        (v0, l0), (v1, l1) = (tuple(t.cpu() for t in top.result()) for top in tops)
        np.testing.assert_array_equal(v0.numpy(), v1.numpy())
        assert ((l0 == l1) | (v0 == -np.inf)).all()


def test_tensor_topk_untouched_is_empty():
    """A top-k nothing was merged into answers -inf and label -1 everywhere."""
    v, lab = (t.cpu() for t in TensorTopK(3, 4, DEVICE).result())
    assert v.shape == (3, 4) and (v == -np.inf).all() and (lab == -1).all() and lab.dtype == torch.int64
