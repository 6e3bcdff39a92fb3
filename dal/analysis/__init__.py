"""Analysis of a calibrated / trained QAT model: where the error comes from and what to do.

* ``layerwise(float_model, qat_model, data)``: per-layer output error (cosine, MSE, PSNR, ...);
* ``sensitivity(model, data, metric=...)``: layers ranked by how much quantizing them costs;
* ``auto_fallback(model, data, target=...)``: the fewest FP16 layers reaching a target, as a recipe;
* ``dal.analysis.report.build_report(...)``: all of it in one self-contained HTML file
  (imports matplotlib, so it is not imported here).
"""
from .fallback import FallbackResult, auto_fallback, fp16_fallback
from .layerwise import LayerwiseReport, layerwise
from .metrics import ErrorStats
from .sensitivity import SensitivityReport, sensitivity


__all__ = ["layerwise", "LayerwiseReport", "sensitivity", "SensitivityReport", "auto_fallback", "FallbackResult",
           "fp16_fallback", "ErrorStats"]
