"""N:M masks against an independent oracle (stable sort per group, plain torch)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dal.sparsity import nm_mask, nm_mask_partial


def oracle_mask(w, n, m, axis):
    """Keep the n largest |w| of each group of m along axis; ties -> lower index."""
    moved = w.detach().abs().double().movedim(axis, -1)
    g = moved.reshape(-1, m)
    order = torch.sort(-g, dim=1, stable=True).indices
    keep = torch.zeros_like(g, dtype=torch.bool)
    keep.scatter_(1, order[:, :n], True)
    return keep.reshape(moved.shape).movedim(-1, axis)


def counts(mask, axis, m):
    return mask.movedim(axis, -1).reshape(-1, m).sum(dim=1)


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8), (3, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_linear_mask_matches_oracle_with_ties(n, m, dtype):
    torch.manual_seed(0)
    w = torch.randint(-3, 4, (64, 32)).to(dtype)   # many ties, zeros, both signs
    mask = nm_mask(w, n, m, axis=1)
    assert mask.dtype == torch.bool and mask.shape == w.shape and mask.is_contiguous()
    assert torch.equal(mask, oracle_mask(w, n, m, 1))
    assert (counts(mask, 1, m) == n).all()


def test_conv_mask_groups_input_channels_at_each_position():
    torch.manual_seed(1)
    w = torch.randn(8, 16, 3, 3)
    mask = nm_mask(w, 2, 4, axis=1)
    # independent layout check: [out, kh, kw, in] -> groups of 4 consecutive input channels
    g = mask.permute(0, 2, 3, 1).reshape(-1, 4)
    assert (g.sum(dim=1) == 2).all()
    assert torch.equal(mask, oracle_mask(w, 2, 4, 1))
    # the kept pair at out=3, kh=1, kw=2, in-group 1 are the 2 largest of those 4 channels
    vals = w[3, 4:8, 1, 2].abs()
    assert set(mask[3, 4:8, 1, 2].nonzero().flatten().tolist()) == \
        set(vals.topk(2).indices.tolist())


def test_conv_transpose_axis0_and_large_multi_chunk():
    w = torch.randn(16, 8, 3, 3)
    assert torch.equal(nm_mask(w, 2, 4, axis=0), oracle_mask(w, 2, 4, 0))
    big = torch.randn(300, 4096)            # > one chunk of 65536 groups, ragged last chunk
    assert torch.equal(nm_mask(big, 2, 4, axis=1), oracle_mask(big, 2, 4, 1))


def test_nan_and_inf_still_give_valid_masks():
    w = torch.randn(16, 16)
    w[0, 0] = float("nan")
    w[1, :4] = float("nan")
    w[2, 1] = float("inf")
    mask = nm_mask(w, 2, 4, axis=1)
    assert (counts(mask, 1, 4) == 2).all()
    assert mask[0, 0] and mask[2, 1]


def test_prior_keeps_pruned_positions_pruned():
    w = torch.randn(8, 16)
    prior = nm_mask(w, 2, 4, axis=1)
    w2 = w.clone()
    w2[~prior] = 100.0                      # would win on magnitude alone
    assert torch.equal(nm_mask(w2, 2, 4, axis=1, prior=prior), prior)


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 4"):
        nm_mask(torch.randn(4, 6), axis=1)
    with pytest.raises(TypeError):
        nm_mask(torch.ones(4, 8, dtype=torch.int32), axis=1)


def test_partial_masks_are_monotone_and_end_at_full():
    torch.manual_seed(2)
    w = torch.randn(32, 64)
    prior, dens = None, []
    for f in [0.0, 0.1, 0.35, 0.35, 0.6, 0.9, 1.0]:
        mask = nm_mask_partial(w, f, 2, 4, axis=1, prior=prior)
        if prior is not None:
            assert not (mask & ~prior).any()    # nothing grows back
        g = counts(mask, 1, 4)
        assert set(g.unique().tolist()) <= {2, 4}
        assert int((g == 2).sum()) == max(round(f * g.numel()), 0)
        dens.append(float(mask.float().mean()))
        prior = mask
    assert dens == sorted(dens, reverse=True) and dens[0] == 1.0 and dens[-1] == 0.5
    assert torch.equal(nm_mask_partial(w, 1.0, axis=1), nm_mask(w, axis=1))


def test_partial_prunes_cheapest_groups_first():
    w = torch.tensor([[9., 9., 9., 9., 1., 1., 5., 5.]])
    mask = nm_mask_partial(w, 0.5, 2, 4, axis=1)
    assert mask.tolist() == [[True] * 4 + [False, False, True, True]]


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), groups=st.integers(1, 9), seed=st.integers(0, 2**31 - 1),
       nm=st.sampled_from([(2, 4), (1, 4), (4, 8), (1, 2)]))
def test_property_mask_is_optimal_and_valid(rows, groups, seed, nm):
    n, m = nm
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, groups * m, generator=g).round(decimals=1)
    mask = nm_mask(w, n, m, axis=1)
    assert (counts(mask, 1, m) == n).all()
    kept = (w.abs() * mask).reshape(-1, m).sum(1)
    best = w.abs().reshape(-1, m).topk(n, dim=1).values.sum(1)
    assert torch.allclose(kept, best)
    assert torch.equal(mask, oracle_mask(w, n, m, 1))
