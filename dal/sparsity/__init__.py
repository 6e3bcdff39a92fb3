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

Jointly with QAT, the recipe asks for it (``sparsity: "2:4"`` in a rule, e.g. the bundled
``int8_sparse24``); ``prepare_qat`` computes one-shot masks from the float weights and lists
the layers left dense, with why, in its report:

    model = dal.prepare_qat(model, recipe="int8_sparse24", hardware="a2000", example_inputs=(x,))
    dal.calibrate(model, calib_loader)
    ctl = sp.controller_of(model)       # or ctl.attach(opt, auto_step=True) once, no ctl.step()
    for x, y in loader:
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        ctl.step()                      # a no-op for one-shot masks; harmless
    dal.export_onnx(model, (x,), "m.onnx")   # metadata dal.sparse_24 lists the 2:4 weights

The mask multiplies the weight before the weight fake quantizer, so the quantized weights
are exactly 2:4. Another schedule, or a channel permutation: call ``prepare_sparse(model,
schedule=..., permute=..., hardware=...)`` on the float model *before* ``prepare_qat``; the
QAT modules take the masks over and ``prepare_qat`` keeps them. A checkpoint is the
``state_dict``: ``prepare_qat`` (and the same ``prepare_sparse`` call, if any) on a fresh
model, then ``load_state_dict``, restores masks, schedule step and weights exactly.
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
