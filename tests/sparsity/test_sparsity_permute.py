"""Channel permutation: same function, never less retained magnitude."""
import itertools

import numpy as np
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import dal.sparsity as sp
from dal.sparsity.permute import find_sequential_pairs


def kept_l1(w, axis):
    """Independent: sum of the 2 largest |w| of each group of 4 along axis."""
    g = w.detach().abs().double().movedim(axis, -1).reshape(-1, 4)
    return float(g.topk(2, dim=1).values.sum())


def mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 24), nn.GELU(),
                         nn.Dropout(0.1), nn.Linear(24, 5))


def cnn(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Sequential(nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32),
                      nn.ReLU6()),
        nn.Conv2d(32, 8, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    model.train()
    with torch.no_grad():                      # non-trivial running statistics
        for _ in range(3):
            model(torch.randn(4, 3, 8, 8) * 2 + 0.5)
        for bn in (model[1], model[3][1]):
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.2, 0.2)
    return model.eval()


def _check_permutation_only(make, x, axis_of):
    model = make()
    ref = model(x)
    sparse_names = {n for n, m in model.named_modules()
                    if isinstance(m, (nn.Linear, nn.Conv2d)) and m.weight.shape[1] % 4 == 0}
    before = {n: kept_l1(model.get_submodule(n).weight, 1) for n in sparse_names}
    from dal.sparsity.permute import permute_sequential_pairs
    notes = permute_sequential_pairs(model, sparse_names)
    out = model(x)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6), (out - ref).abs().max()
    gained = 0
    for n in sparse_names:
        after = kept_l1(model.get_submodule(n).weight, 1)
        assert after >= before[n] - 1e-9 * before[n], (n, notes[n])
        gained += after > before[n] * (1 + 1e-9)
    return notes, gained


def test_permutation_preserves_function_mlp():
    for seed in range(3):
        notes, gained = _check_permutation_only(lambda: mlp(seed).eval(), torch.randn(16, 12),
                                                1)
        assert gained >= 1, notes


def test_permutation_preserves_function_cnn_with_bn():
    for seed in range(3):
        notes, gained = _check_permutation_only(lambda: cnn(seed), torch.randn(2, 3, 8, 8), 1)
        assert gained >= 1, notes
        assert "permuted with producer 0" in notes["3.0"]   # Conv->BN->ReLU->Conv
        assert "permuted with producer 3.0" in notes["4"]   # through a nested Sequential
        assert "no producer" in notes["7"]                  # Flatten in between


def test_prepare_sparse_with_permute_matches_masked_oracle():
    from dal.sparsity.permute import permute_sequential_pairs
    x = torch.randn(2, 3, 8, 8)
    plain, oracle = cnn(0), cnn(0)
    model = sp.prepare_sparse(cnn(0), permute=True)
    sp.prepare_sparse(plain)                      # same model, no permutation
    rep, rep_plain = sp.report(model), sp.report(plain)
    assert rep.all_valid
    # oracle: permute a dense copy (deterministic search), multiply by the masks, run
    names = {r["name"] for r in rep.sparse}
    permute_sequential_pairs(oracle, names)
    with torch.no_grad():
        for n in names:
            oracle.get_submodule(n).weight.mul_(model.get_submodule(n).weight_mask)
    assert torch.allclose(model(x), oracle(x), rtol=1e-5, atol=1e-6)
    for row, row_plain in zip(rep.rows, rep_plain.rows):
        if row["status"] == "sparse":
            assert row["retained"] >= row_plain["retained"] - 1e-6, row["name"]
    assert any(r["retained"] > p["retained"] + 1e-4 for r, p in zip(rep.sparse,
                                                                      rep_plain.sparse))


def test_pairs_scope():
    model = nn.Sequential(nn.Conv2d(4, 8, 3, groups=2), nn.ReLU(), nn.Conv2d(8, 8, 3),
                          nn.Conv2d(8, 8, 3), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3),
                          nn.Linear(8, 8))
    pairs = find_sequential_pairs(model)
    assert pairs == [("2", [], "3")]     # grouped producer and MaxPool break chains


def _kept_l1_np(w: np.ndarray) -> float:
    """numpy, float64: for each group of 4 input channels (axis 1) keep the 2 largest |w|; sum."""
    g = np.abs(w.astype(np.float64)).reshape(w.shape[0], -1, 4)
    return float(np.sort(g, axis=2)[:, :, 2:].sum())


def _brute_force_optimum(w: np.ndarray) -> float:
    """Best kept L1 over every permutation of the input channels. Only the partition into groups
    of 4 matters, so each partition is visited once: the group holding the smallest remaining
    channel, with every choice of its 3 partners, recursively (35 partitions of 8 channels)."""
    def partitions(chans):
        if not chans:
            yield []
            return
        first, rest = chans[0], chans[1:]
        for partners in itertools.combinations(rest, 3):
            left = [c for c in rest if c not in partners]
            for tail in partitions(left):
                yield [first, *partners, *tail]
    return max(_kept_l1_np(w[:, perm]) for perm in partitions(list(range(w.shape[1]))))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), out=st.integers(1, 6), groups=st.integers(2, 6),
       k=st.sampled_from([1, 3]))
def test_search_never_lowers_retained(seed, out, groups, k):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, 4 * groups, k, k, generator=g)
    perm = sp.search_permutation(w, axis=1)
    assert sorted(perm.tolist()) == list(range(4 * groups))
    base = kept_l1(w, 1)
    assert kept_l1(w[:, perm], 1) >= base


def test_search_reaches_the_brute_force_optimum_on_8_channels():
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        w = torch.randn(3, 8, generator=g)
        perm = sp.search_permutation(w, axis=1)
        assert sorted(perm.tolist()) == list(range(8))
        got = _kept_l1_np(w[:, perm].numpy())
        best = _brute_force_optimum(w.numpy())
        assert abs(got - kept_l1(w[:, perm], 1)) <= 1e-12 * best  # the two independent sums agree
        assert got >= best - 1e-9, (got, best)


def test_subclass_layers_are_not_permuted_and_say_why():
    class QLinear(nn.Linear):
        pass
    model = nn.Sequential(QLinear(8, 8), nn.ReLU(), QLinear(8, 8))
    sp.prepare_sparse(model, permute=True)
    notes = sp.controller_of(model).permuted
    assert "not a plain torch" in notes["2"] and "before prepare_qat" in notes["2"]
