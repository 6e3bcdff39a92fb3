"""quantize_ptq: a recipe's whole PTQ, in the order practice uses; scales_only: QAT that trains
only the quantizers.

Float-model steps (``fold_bn``, ``equalize``, ``smooth_quant``) run on a copy of the float model
before ``prepare_qat``; then ``dal.calibrate`` with the recipe's method; then the quantized-model
steps (``adaround``, ``bias_correction``, ``bn_reestimate``, ``gptq``, ``sparsegpt``) in the order the
recipe lists them.
"""
from __future__ import annotations

import copy
from typing import Callable, Iterable, Optional, Sequence

from torch import nn

FLOAT_STEPS = ("fold_bn", "equalize", "smooth_quant")
QUANT_STEPS = ("adaround", "bias_correction", "bn_reestimate", "gptq", "sparsegpt")


def run_float_steps(model: nn.Module, steps: Sequence[str], calib: Iterable, num_batches: Optional[int] = None,
                    input_fn: Optional[Callable] = None, progress: bool = False) -> dict:
    """Apply the float-model steps of ``steps`` to ``model`` in place (eval mode); returns what each did.
    ``equalize`` implies ``fold_bn`` (equalization needs the BN scales in the weights)."""
    from .equalization import equalize
    from .fold_bn import fold_batchnorm
    from .smoothquant import smooth_quant

    done: dict = {}
    model.eval()
    if "fold_bn" in steps or "equalize" in steps:
        done["fold_bn"] = fold_batchnorm(model)
    if "smooth_quant" in steps:
        done["smooth_quant"] = list(smooth_quant(model, calib, num_batches, input_fn=input_fn, progress=progress))
    if "equalize" in steps:
        # relu6="skip": a ChannelClip is not a standard operator, and this flow must export.
        done["equalize"] = equalize(model, relu6="skip")
    return done


def run_quant_steps(qmodel: nn.Module, steps: Sequence[str], calib: Iterable, num_batches: Optional[int] = None,
                    input_fn: Optional[Callable] = None, progress: bool = False,
                    adaround_args: Optional[dict] = None) -> dict:
    """Apply the quantized-model steps of ``steps`` (in their order) to a calibrated model."""
    from .rounding import adaround
    from .bias import bias_correction
    from .bn_reestimate import reestimate_bn

    done: dict = {}
    for step in steps:
        if step == "adaround":
            done[step] = adaround(qmodel, calib, num_batches, input_fn=input_fn, progress=progress,
                                  **(adaround_args or {}))
        elif step == "bias_correction":
            done[step] = list(bias_correction(qmodel, calib, num_batches, input_fn=input_fn, progress=progress))
        elif step == "bn_reestimate":
            done[step] = reestimate_bn(qmodel, calib, num_batches, input_fn=input_fn, progress=progress)
        elif step in ("gptq", "sparsegpt"):
            from .gptq import gptq
            from .sparsegpt import sparsegpt

            done[step] = (gptq if step == "gptq" else sparsegpt)(qmodel, calib, num_batches, input_fn=input_fn,
                                                                 progress=progress)
    return done


def quantize_ptq(model: nn.Module, recipe, calib: Iterable, *, hardware=None, example_inputs=None,
                 steps: Optional[Sequence[str]] = None, method: Optional[str] = None,
                 num_batches: Optional[int] = None, input_fn: Optional[Callable] = None, progress: bool = False,
                 adaround_args: Optional[dict] = None) -> nn.Module:
    """The PTQ model of float ``model`` (not modified): float steps, ``prepare_qat``,
    ``dal.calibrate`` (``method``, default the recipe's), quantized steps; ``steps`` defaults to
    the recipe's ``ptq:`` list. Every quantizer ends ``frozen``: the model is ready to export.

    Example:
        >>> q = dal.ptq.quantize_ptq(net, "w4a8_fp8_performance", calib, example_inputs=(x,),
        ...                          steps=["equalize", "adaround", "bias_correction"])  # doctest: +SKIP
    """
    from ..calibration import calibrate
    from ..prepare import prepare_qat, set_quantizer_state
    from ..recipe import load_recipe
    from ..recipe.recipe import PTQ_STEPS

    rec = load_recipe(recipe)
    steps = tuple(rec.ptq if steps is None else steps)
    unknown = [s for s in steps if s not in PTQ_STEPS]
    if unknown:
        raise ValueError(f"quantize_ptq: unknown PTQ step(s) {unknown}; known: {', '.join(PTQ_STEPS)}")
    if example_inputs is None:
        from ..calibration.batches import iter_inputs

        example_inputs = next(iter(iter_inputs(calib, 1, input_fn=input_fn)))[0]
    work = copy.deepcopy(model).eval()
    run_float_steps(work, steps, calib, num_batches, input_fn, progress)
    q = prepare_qat(work, recipe=rec, hardware=hardware, example_inputs=example_inputs)
    calibrate(q, calib, num_batches, input_fn=input_fn, progress=progress, **({"method": method} if method else {}))
    run_quant_steps(q, [s for s in steps if s in QUANT_STEPS], calib, num_batches, input_fn, progress, adaround_args)
    set_quantizer_state(q, "frozen")
    return q.eval()


def scales_only(model: nn.Module) -> list[nn.Parameter]:
    """Scale-only QAT: freeze every weight and bias (``requires_grad=False``) of a prepared model
    with learnable quantizers and return the quantizers' scale / zero-point Parameters, the only
    ones to hand to the optimizer. BatchNorm statistics are frozen too (``dal.freeze_bn``). The
    recipe key ``train: scales_only`` makes ``prepare_qat`` do the same (recipes/README.md).

    Example:
        >>> opt = torch.optim.Adam(dal.ptq.scales_only(qmodel), lr=1e-3)   # doctest: +SKIP
    """
    from ..prepare.scales_only import freeze_all_but_quantizers
    from ..quantizer import quantizers

    if not any(p.requires_grad for _, q in quantizers(model) for p in q.parameters(recurse=False)):
        raise ValueError("scales_only: the model has no learnable quantizer; use a recipe with learnable: true "
                         "(e.g. w4a8_lsq) and calibrate first")
    return freeze_all_but_quantizers(model)
