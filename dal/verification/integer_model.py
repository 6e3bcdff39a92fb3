"""The "integer model vs NPU" row of dal.verify: dal.convert(torch model) against dal.npu.

Both are integer engines (exact sums, the hardware's requantizer), derived independently: the
integer model from the trained torch model, the NPU reference from the ONNX file. They must
agree on every element of every output and of every quantized tensor the file holds; a
difference is a bug in the trainer, the exporter or the reference, never a near-tie.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import onnx


@dataclass
class IntegerParity:
    """Integer model vs NPU reference: outputs and quantized tensors (``codes``) compared,
    how many elements differ, the first differing quantized tensor in graph order (its
    producing QuantizeLinear node); ``error`` when the integer model could not be built."""

    elements: int = 0
    differ: int = 0
    codes: int = 0
    codes_differ: int = 0
    tensors: int = 0
    first: Optional[str] = None
    error: Optional[str] = None

    @property
    def identical(self) -> bool:
        return self.error is None and self.differ == 0 and self.codes_differ == 0 and self.elements > 0

    def __str__(self) -> str:
        if self.error:
            return f"integer model vs NPU: not run ({self.error})"
        state = "IDENTICAL" if self.identical else "DIFFER"
        text = (f"integer model vs NPU: {state}: outputs {self.differ}/{self.elements} elements differ, "
                f"{self.tensors} quantized tensors {self.codes_differ}/{self.codes} codes differ")
        return text + (f"; first difference at {self.first}" if self.first else "")


def integer_vs_npu(torch_model, model: onnx.ModelProto, inputs: tuple, npu_outs: list,
                   npu_values: dict) -> IntegerParity:
    """Convert ``torch_model`` (dal.convert) and compare it with the NPU reference's run."""
    from ..convert import ConvertError, convert
    try:
        # the file's own opset: LayerNorm / GELU are spelled differently across opsets (convert's doc)
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
        int_model = convert(torch_model, opset=opset)
        out, codes = int_model.run_with_codes(*inputs)
    except (ConvertError, ValueError, RuntimeError) as e:
        return IntegerParity(error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
    outs = [out] if not isinstance(out, (tuple, list)) else list(out)
    row = IntegerParity()
    for mine, ref in zip(outs, npu_outs):
        mine = mine.detach().cpu().numpy()
        row.elements += int(np.size(ref))
        row.differ += int((mine.reshape(np.shape(ref)) != ref).sum()) if mine.size == np.size(ref) else int(np.size(ref))
    mine_codes = {}
    for qname, calls in codes.items():
        for k, c in enumerate(calls):
            mine_codes[f"{qname}.quantized" + (f"_{k}" if k else "")] = c.cpu().numpy()
    for node in model.graph.node:
        name = node.output[0] if node.op_type == "QuantizeLinear" else None
        if name is None or name not in npu_values or name not in mine_codes:
            continue
        ref, mine = np.asarray(npu_values[name]).astype(np.int64), mine_codes[name].astype(np.int64)
        d = int((mine != ref).sum()) if mine.shape == ref.shape else int(ref.size)
        row.tensors += 1
        row.codes += int(ref.size)
        row.codes_differ += d
        if d and row.first is None:
            row.first = f"{node.name} -> {name} ({d}/{ref.size} codes)"
    return row
