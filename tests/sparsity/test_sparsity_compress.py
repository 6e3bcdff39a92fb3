"""is_2to4 / compress_2to4 / decompress_2to4 against independent reshape/count checks."""
import pytest
import torch

from dal.sparsity import compress_2to4, decompress_2to4, is_2to4, is_nm, nm_mask


def test_is_2to4_matches_independent_count():
    torch.manual_seed(0)
    for _ in range(20):
        w = torch.randn(8, 16) * (torch.rand(8, 16) < 0.4)
        ref = bool(((w != 0).reshape(-1, 4).sum(1) <= 2).all())
        assert is_2to4(w, axis=1) == ref
    assert not is_2to4(torch.ones(4, 6), axis=1)          # not a multiple of 4: False
    assert is_nm(torch.tensor([[1., 0, 0, 0, 0, 2, 0, 0]]), 1, 4, axis=1)


@pytest.mark.parametrize("shape,axis", [((8, 16), 1), ((6, 8, 3, 3), 1), ((8, 6, 3), 0)])
def test_roundtrip_and_layout(shape, axis):
    torch.manual_seed(1)
    w = torch.randn(shape)
    w = w * nm_mask(w, 2, 4, axis=axis)
    w.view(-1)[::7] = 0                                   # some groups with < 2 non-zeros
    values, idx = compress_2to4(w, axis)
    assert idx.dtype == torch.uint8
    assert values.shape[axis] == w.shape[axis] // 2 and values.shape == idx.shape
    assert torch.equal(decompress_2to4(values, idx, axis), w)
    # independent layout check on the moved view: value k of group g sits at 4g + idx
    wv = w.movedim(axis, -1).reshape(-1, 4)
    vv = values.movedim(axis, -1).reshape(-1, 2)
    iv = idx.movedim(axis, -1).reshape(-1, 2).long()
    assert (iv[:, 0] < iv[:, 1]).all()
    assert torch.equal(torch.gather(wv, 1, iv), vv)


def test_compress_example_and_errors():
    v, i = compress_2to4(torch.tensor([[0., 5., 0., 7., 3., 0., 0., 0.]]), axis=1)
    assert v.tolist() == [[5., 7., 3., 0.]] and i.tolist() == [[1, 3, 0, 1]]
    with pytest.raises(ValueError, match="not 2:4"):
        compress_2to4(torch.ones(2, 8), axis=1)
    with pytest.raises(ValueError, match="indices"):
        decompress_2to4(torch.ones(1, 2), torch.tensor([[2, 1]], dtype=torch.uint8), axis=1)
