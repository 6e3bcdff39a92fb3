"""dal: train PyTorch models against an NPU's constraints and prove on-target parity.

    import dal
    model = dal.prepare_qat(model, recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    dal.calibrate(model, calib_loader)
    train(model)
    dal.export_onnx(model, (x,), "model.onnx")
    print(dal.verify("model.onnx", model, (x,)))

``import dal`` is cheap: every public name is resolved on first use (PEP 562), so importing
the package neither imports Lightning nor builds the C++ reference library.
"""
from __future__ import annotations

import importlib


# public name -> (module, attribute)
_LAZY = {
    "QFormat": ("dal.formats", "QFormat"),
    "get_format": ("dal.formats", "get_format"),
    "quantize": ("dal.formats", "quantize"),
    "dequantize": ("dal.formats", "dequantize"),
    "fake_quantize": ("dal.formats", "fake_quantize"),
    "choose_qparams": ("dal.formats", "choose_qparams"),
    "FakeQuantizer": ("dal.quantizer", "FakeQuantizer"),
    "QState": ("dal.quantizer", "QState"),
    "quantizer_states": ("dal.quantizer", "quantizer_states"),
    "prepared": ("dal.prepare", "prepared"),
    "prepare_qat": ("dal.prepare", "prepare_qat"),
    "npu_part": ("dal.prepare.boundary", "npu_part"),
    "register_qat_module": ("dal.nn.registry", "register_qat_module"),
    "calibrate": ("dal.calibration", "calibrate"),
    "export_onnx": ("dal.export", "export_onnx"),
    "export_decoder": ("dal.export.decoder", "export_decoder"),
    "verify": ("dal.verification", "verify"),
    "verify_decoder": ("dal.verification.decoder", "verify_decoder"),
    "generate_check": ("dal.verification.generate_check", "generate_check"),
    "prepare_sparse": ("dal.sparsity", "prepare_sparse"),
    "load_recipe": ("dal.recipe", "load_recipe"),
    "load_hardware": ("dal.hardware", "load_hardware"),
    "save_checkpoint": ("dal.checkpoint", "save_checkpoint"),
    "load_checkpoint": ("dal.checkpoint", "load_checkpoint"),
    "to_float": ("dal.prepare", "to_float"),
    "convert": ("dal.convert", "convert"),
    "set_quantizer_state": ("dal.prepare", "set_quantizer_state"),
    "freeze_bn": ("dal.prepare", "freeze_bn"),
    "report": ("dal.analysis.report", "build_report"),
    "estimate": ("dal.cost", "estimate"),
    "search_precision": ("dal.cost", "search_precision"),
    "auto_quantize": ("dal.ptq", "auto_quantize"),
}

_SUBMODULES = {"formats", "observers", "quantizer", "hardware", "recipe", "nn", "sparsity", "replace",
               "prepare", "calibration", "export", "npu", "ops", "verification", "analysis", "distill", "preprocess",
               "cost", "ptq"}


def _version() -> str:
    """The installed distribution's version (its package metadata: pyproject.toml's ``version``);
    ``"0+unknown"`` when dal is imported from a source tree that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dal")
    except PackageNotFoundError:
        return "0+unknown"


def __getattr__(name: str):
    if name == "__version__":  # read on first use: no metadata lookup at import time
        globals()["__version__"] = value = _version()
        return value
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"dal.{name}")
    raise AttributeError(f"module 'dal' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES | {"__version__"})
