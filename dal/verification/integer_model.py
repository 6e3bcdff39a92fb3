"""The "integer model vs NPU" row of dal.verify: dal.convert(torch model) against dal.npu.

Both are integer engines (exact sums, the hardware's requantizer), derived independently: the
integer model from the trained torch model, the NPU reference from the ONNX file. They must
agree on every element of every output and of every quantized tensor the file holds; a
difference is a bug in the trainer, the exporter or the reference, never a near-tie.

They must also agree on which layers run as one integer group (``DQ -> Conv/Gemm/MatMul ->
[Relu/Clip] -> Q`` on one exact accumulator): a layer one side fuses and the other runs in float
(two roundings) agrees on most inputs and lands a code apart at a near-tie, so the codes alone
would catch it only by chance. Layers are matched by their weight (``<quantizer>.codes`` in the
file, ``IntegerModel.group_calls`` in torch) and counted per call.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import numpy as np
import onnx

from ..nest import tensors
from .codes import as_numpy, is_code, is_float8, ordinals

#: a weight's codes in the file: ``<quantizer>.codes``, ``<quantizer>.codes_<k>`` for call k
_CODES = re.compile(r"^(.*)\.codes(?:_\d+)?$")


@dataclass
class IntegerParity:
    """Integer model vs NPU reference: outputs and quantized tensors (``codes``: integer and float8,
    compared by grid position, codes.ordinals) compared,
    how many elements differ, the first differing quantized tensor in graph order (its
    producing QuantizeLinear node); ``error`` when the integer model could not be built."""

    elements: int = 0
    differ: int = 0
    codes: int = 0
    codes_differ: int = 0
    tensors: int = 0
    first: Optional[str] = None
    error: Optional[str] = None
    groups_differ: tuple = ()  # "<weight quantizer>: NPU fuses a of n calls, integer model b of m"

    @property
    def identical(self) -> bool:
        return (self.error is None and self.differ == 0 and self.codes_differ == 0 and self.elements > 0
                and not self.groups_differ)

    def __str__(self) -> str:
        if self.error:
            return f"integer model vs NPU: not run ({self.error})"
        state = "IDENTICAL" if self.identical else "DIFFER"
        text = (f"integer model vs NPU: {state}: outputs {self.differ}/{self.elements} elements differ, "
                f"{self.tensors} quantized tensors {self.codes_differ}/{self.codes} codes differ")
        text += f"; first difference at {self.first}" if self.first else ""
        if self.groups_differ:
            text += (f"; {len(self.groups_differ)} layer(s) an integer group on one side only: "
                     + "; ".join(self.groups_differ[:3]))
        return text


def integer_vs_npu(torch_model, model: onnx.ModelProto, inputs: tuple, npu_outs: list,
                   npu_values: dict, npu_steps: Optional[list] = None) -> IntegerParity:
    """Convert ``torch_model`` (dal.convert) and compare it with the NPU reference's run (its
    outputs, intermediate values and, given its ``steps``, its integer groups; module doc)."""
    from ..convert import ConvertError, convert
    try:
        # the file's own opset: LayerNorm / GELU are spelled differently across opsets (convert's doc)
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
        int_model = convert(torch_model, opset=opset)
        out, codes = int_model.run_with_codes(*inputs, fp8_bits=True)  # float8 tensors as their bit patterns
    except (ConvertError, ValueError, RuntimeError) as e:
        return IntegerParity(error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
    outs = tensors(out)  # any nest of tensors, in the order the exporter wrote the file's outputs
    row = IntegerParity()
    for k, ref in enumerate(npu_outs):
        row.elements += int(np.size(ref))
        mine = as_numpy(outs[k]) if k < len(outs) else None  # an output missing: all differ
        if mine is not None and is_code(ref):  # integer or float8 codes (a KV cache): by grid position
            mine, ref = ordinals(mine), ordinals(ref)
        row.differ += (int((mine.reshape(np.shape(ref)) != ref).sum()) if mine is not None and mine.size == np.size(ref)
                       else int(np.size(ref)))
    mine_codes = {}
    for qname, calls in codes.items():
        for k, c in enumerate(calls):
            mine_codes[f"{qname}.quantized" + (f"_{k}" if k else "")] = as_numpy(c)
    for node in model.graph.node:
        name = node.output[0] if node.op_type == "QuantizeLinear" else None
        if name is None or name not in npu_values or name not in mine_codes:
            continue
        ref, mine = np.asarray(npu_values[name]), mine_codes[name]
        if is_float8(ref) and mine.dtype == np.uint8:  # the integer model's float8 bits, as the same type
            mine = np.ascontiguousarray(mine).view(ref.dtype)
        ref, mine = ordinals(ref), ordinals(mine)
        d = int((mine != ref).sum()) if mine.shape == ref.shape else int(ref.size)
        row.tensors += 1
        row.codes += int(ref.size)
        row.codes_differ += d
        if d and row.first is None:
            row.first = f"{node.name} -> {name} ({d}/{ref.size} codes)"
    if npu_steps is not None:
        row.groups_differ = group_mismatches(npu_group_calls(model, npu_steps), int_model.group_calls())
    return row


def npu_group_calls(model: onnx.ModelProto, steps: list) -> dict[str, tuple[int, int]]:
    """{weight quantizer name: (nodes the NPU reference runs as a fused group, nodes)} over the
    file's Conv / Gemm / MatMul nodes whose weight is a DequantizeLinear of ``<name>.codes``
    (``<name>.codes_<k>`` for call k >= 1 of a layer called more than once)."""
    fused = {id(s.node) for s in steps if getattr(s, "kind", "") == "fused"}
    made_by = {o: n for n in model.graph.node for o in n.output}
    out: dict[str, list] = {}
    for n in model.graph.node:
        w = made_by.get(n.input[1]) if n.op_type in ("Conv", "Gemm", "MatMul") and len(n.input) > 1 else None
        name = _CODES.match(w.input[0]) if w is not None and w.op_type == "DequantizeLinear" else None
        if name is None:
            continue
        counts = out.setdefault(name.group(1), [0, 0])
        counts[0] += id(n) in fused
        counts[1] += 1
    return {k: (a, b) for k, (a, b) in out.items()}


def group_mismatches(npu: dict, integer: dict) -> tuple:
    """One line per weight that the two engines run as an integer group a different number of
    times (a layer neither fuses, an FP16 one say, may be counted on one side only)."""
    lines = []
    for name in sorted(set(npu) | set(integer)):
        a, b = npu.get(name, (0, 0)), integer.get(name, (0, 0))
        if a[0] != b[0]:
            lines.append(f"{name}: NPU fuses {a[0]} of {a[1]} calls, integer model {b[0]} of {b[1]}")
    return tuple(lines)
