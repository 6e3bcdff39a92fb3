"""End of fit: QDQ ONNX export and the parity figures, from rank 0, to the trainer's logger."""
from __future__ import annotations

import copy
import os
from typing import Optional

import torch
from torch import nn


def export_and_verify(model: nn.Module, example_inputs: tuple, path, verify: bool = True,
                      export_kwargs: Optional[dict] = None):
    """Export ``model`` (left untouched: a CPU copy is exported when it lives elsewhere) and,
    with ``verify``, compare NPU reference / torch / onnxruntime. Returns (path, report, metrics)."""
    from ..export import export_onnx

    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    target = model if on_cpu else copy.deepcopy(model).cpu()
    args = tuple(a.cpu() if torch.is_tensor(a) else a for a in example_inputs)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    export_onnx(target, args, path, **(export_kwargs or {}))
    if not verify:
        return path, None, {}
    from ..verification import verify as run_verify

    report = run_verify(path, target, args)
    return path, report, parity_metrics(report)


def parity_metrics(report) -> dict:
    """Flatten a ParityReport into scalars: per output and pair, the fraction within 1 LSB,
    the largest error in LSBs, the count beyond 1 LSB and the cosine."""
    out = {}
    for k, (name, pairs) in enumerate(report.outputs.items()):
        tag = f"o{k}" if len(report.outputs) > 1 else "out"
        for pair, a in pairs.items():
            base = f"dal/parity/{tag}/{pair}"
            out[f"{base}/within_1lsb"] = float(a.within_one_lsb_fraction)
            out[f"{base}/off_by_more"] = float(a.off_by_more)
            out[f"{base}/cosine"] = float(a.cosine)
            if a.max_lsb is not None:
                out[f"{base}/max_lsb"] = float(a.max_lsb)
    out["dal/parity/layers_differing"] = float(sum(1 for row in report.layers if row.differ))
    return out
