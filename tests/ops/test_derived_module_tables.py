"""The module-type groupings dal.ptq, dal.sparsity and dal.nn.norm derive from dal.ops (issue 41)
are exactly torch's classes they name: the expected values are torch.nn's own types."""
import torch
import torch.nn.functional as F
from torch import nn

from dal.nn.norm import Fp16GroupNorm, Fp16InstanceNorm2d, batch_norm_types, fp16_norms
from dal.ptq import fold_bn
from dal.ptq.equalization import _relu_functions
from dal.sparsity import layout
from dal.sparsity.permute import find_sequential_pairs

CONVS = {nn.Conv1d, nn.Conv2d, nn.Conv3d}
TRANSPOSED = {nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d}


def test_weighted_types_are_torchs_linear_and_convolutions():
    assert set(layout.sparse_types()) == CONVS | TRANSPOSED | {nn.Linear}
    assert len(layout.sparse_types()) == 7  # LazyLinear (a Linear) is found by isinstance, not listed
    assert set(layout.SPARSE_TYPES) == set(layout.sparse_types())
    assert set(layout.weighted_types("conv_transpose")) == TRANSPOSED
    assert set(layout.weighted_types("conv")) == set(fold_bn.CONV_TYPES) == CONVS
    assert layout.weighted_types("linear") == (nn.Linear,)


def test_reduction_axis_and_op_class_per_module():
    for mod, axis, cls in [(nn.Linear(8, 4), 1, "linear"), (nn.Conv3d(8, 4, 1), 1, "conv"),
                           (nn.ConvTranspose3d(8, 4, 1), 0, "conv_transpose"),
                           (nn.ConvTranspose1d(8, 4, 1), 0, "conv_transpose")]:
        assert (layout.reduction_axis(mod), layout.op_class(mod)) == (axis, cls), type(mod).__name__


def test_batch_norms_and_fp16_norms():
    assert set(batch_norm_types()) == set(fold_bn.BN_TYPES) == {nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d}
    assert len(batch_norm_types()) == 3
    assert fp16_norms() == {nn.GroupNorm: Fp16GroupNorm, nn.InstanceNorm2d: Fp16InstanceNorm2d}


def test_equalization_matches_the_out_of_place_relu_functions():
    assert _relu_functions() == {torch.relu, F.relu}


def test_permutation_pairs_need_the_same_op_through_a_batch_norm_of_any_rank():
    seq = nn.Sequential(nn.Conv3d(4, 8, 1), nn.BatchNorm3d(8), nn.ReLU(), nn.Conv3d(8, 4, 1),
                        nn.Conv2d(4, 4, 1))
    assert find_sequential_pairs(seq) == [("0", ["1", "2"], "3")]  # Conv3d -> Conv2d is no pair
