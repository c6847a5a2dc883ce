"""The Triton top-k of a few rows (long ones in rounds of pieces) against torch.topk."""

import pytest
import torch

from devices import DEVICE, needs_triton

pytestmark = needs_triton


@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (3, 127, 10), (2, 129, 32), (1, 8192, 17), (1, 8193, 5),
                                     (2, 2500, 100), (1, 4500, 256), (16, 300, 64)])
def test_top_columns_equal_torch_topk(m, n, k):
    """Values equal torch.topk's; columns hold those values and are distinct; ties (repeated values, -inf, +-0)
    come earlier column first (across pieces and rounds too, never a padding column)."""
    from tqindex.kernels.topk_triton import top_columns_triton

    g = torch.Generator().manual_seed(n)
    x = torch.randn(m, n, generator=g)
    x[:, ::3] = torch.round(x[:, ::3])  # many equal values
    x[0, : n // 2] = float("-inf")
    if n > 2:
        x[-1, 1], x[-1, 2] = 0.0, -0.0
    x = x.to(DEVICE)
    v, c = top_columns_triton(x, k)
    ref = torch.topk(x, k, dim=1).values
    assert torch.equal(v, ref) and c.dtype == torch.int64
    assert ((0 <= c) & (c < n)).all() and torch.equal(x.gather(1, c), v)
    assert all(len(set(r.tolist())) == k for r in c)
    ties = (v[:, 1:] == v[:, :-1]) & (v[:, 1:] > float("-inf"))
    assert (c[:, 1:] > c[:, :-1])[ties].all()


def test_strided_rows_and_bad_k():
    """Rows and columns of any stride (tile maxima come transposed); k outside [1, min(n, MAX_K)] or more than
    MAX_ROWS rows raise."""
    from tqindex.kernels.topk_triton import MAX_K, MAX_ROWS, top_columns_triton

    x = torch.randn(8, 300, device=DEVICE)
    v, c = top_columns_triton(x[::2, 10:], 5)
    assert torch.equal(v, torch.topk(x[::2, 10:], 5, dim=1).values)
    t = torch.randn(1500, 3, device=DEVICE).T
    v, c = top_columns_triton(t, 40)
    assert torch.equal(v, torch.topk(t, 40, dim=1).values) and torch.equal(t.gather(1, c), v)
    for k in (0, 291):
        with pytest.raises(ValueError, match="top_columns_triton takes"):
            top_columns_triton(x[:, 10:], k)
    with pytest.raises(ValueError, match="top_columns_triton takes"):
        top_columns_triton(torch.randn(2, MAX_K + 10, device=DEVICE), MAX_K + 1)
    with pytest.raises(ValueError, match="top_columns_triton takes"):
        top_columns_triton(torch.randn(MAX_ROWS + 1, 10, device=DEVICE), 3)


@pytest.mark.parametrize("m, n, k", [(1, 40, 7), (2, 1500, 100), (2, 300, 64)])
def test_labels_equal_the_torch_path(m, n, k):
    """With labels: entries of a negative label count as -inf and the winners' labels come out (-1 for -inf), as
    ``tqindex.topk.top_columns``'s torch path gives them; labels of any stride (a row broadcast)."""
    from tqindex.kernels.topk_triton import top_columns_triton
    from tqindex.topk import top_columns

    g = torch.Generator().manual_seed(n)
    x = torch.randn(m, n, generator=g).to(DEVICE)
    labels = torch.randint(-1, 1000, (m, n), generator=g).to(DEVICE)
    labels[0, : n - k // 2] = -1  # row 0: fewer than k entries left
    for lab in (labels, labels[:1].expand(m, n)):
        v, got = top_columns_triton(x, k, lab)
        rv, ref = top_columns(x, k, "torch", lab)
        assert torch.equal(v, rv) and torch.equal(got, ref)
        assert (got[0, k // 2 + 1 :] == -1).all() and (v[0, k // 2 + 1 :] == float("-inf")).all()
