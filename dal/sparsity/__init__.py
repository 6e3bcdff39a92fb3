"""N:M (2:4) structured sparsity for training: masks, channel permutation, schedules.

    import dal.sparsity as sp
    model = sp.prepare_sparse(model, "2:4", schedule=sp.Gradual(steps=1000))
    ctl = sp.controller_of(model)
    for x, y in loader:
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        ctl.step()                      # advances the schedule (pruned weights stay 0 anyway)
    print(sp.report(model))

Groups of M run along the reduction (input-channel) axis: see ``layout.py``. The module
protocol consumed by dal's QAT modules (``weight_mask`` buffer) is in ``controller.py``.
"""
from .compress import compress_2to4, decompress_2to4, is_2to4, is_nm
from .controller import SparsityController, controller_of
from .layout import reduction_axis
from .mask import nm_mask, nm_mask_partial
from .pattern import NMPattern, parse_pattern
from .permute import retained_with_permutation, search_permutation
from .prepare import dense_reason, prepare_sparse
from .report import SparsityReport, report
from .schedule import Gradual, OneShot, RecomputeThenFreeze, SparsitySchedule

__all__ = [
    "prepare_sparse", "report", "SparsityReport", "SparsityController", "controller_of",
    "OneShot", "Gradual", "RecomputeThenFreeze", "SparsitySchedule",
    "nm_mask", "nm_mask_partial", "is_2to4", "is_nm", "compress_2to4", "decompress_2to4",
    "search_permutation", "retained_with_permutation", "reduction_axis", "dense_reason",
    "NMPattern", "parse_pattern",
]
