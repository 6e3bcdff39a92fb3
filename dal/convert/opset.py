"""The export's opset, as the integer model resolves it without an ONNX file.

``dal.export_onnx`` with no ``opset`` writes the lowest opset that carries every quantizer (13
for INT8), but when torch's exporter has no symbolic for a function at that opset it retries
once at the opset torch names (export/SPEC.md §1, "Opset"): a model calling
``F.scaled_dot_product_attention`` is written at opset 14, the first with that decomposition.
The integer model spells its float islands by the file's opset (float_ops.py: SDPA only from
14 on, GELU / LayerNorm from 20 / 17), so it must reach the same number: with the formats' 13
it ran torch's fused float32 attention instead of the exported nodes, and a timm-style
attention block's next quantizer differed from dal.npu on a few near-tie codes per batch.

The functions are read from the probe forward (probe.py's top-level ``func`` events), the same
calls ``NPUFloatOps`` later replaces; which op each belongs to is the op registry's (op_forms.py).
"""
from __future__ import annotations

from .errors import ConvertError
from .op_forms import Derived, calls_of, per_registry
from .sdpa import SDPA_OPSET

#: ops (by dal.ops name) torch's TorchScript exporter writes only from an opset on (no older
#: symbolic), so a default export moves up to it. Each is below 17, the lowest opset that respells
#: a form (LayerNorm), so raising the opset after forms.py's swap changes no swapped form.
FLOOR_OF_OP = {"scaled_dot_product_attention": SDPA_OPSET}


@per_registry
def _floor_table(ops) -> dict:
    return {f: FLOOR_OF_OP[op.name] for op in ops if op.name in FLOOR_OF_OP for f in calls_of(op)}


#: the calls of the ``FLOOR_OF_OP`` ops (op_forms.py ``calls_of``) -> their floor
FLOOR = Derived(_floor_table)


def _name(func) -> str:
    return f"F.{getattr(func, '__name__', func)}"


def export_opset(opset: int, explicit: bool, funcs) -> int:
    """The opset ``dal.export_onnx`` writes for a model whose forward calls ``funcs``:
    ``max(opset, FLOOR[f] for f in funcs)`` when ``opset`` is the formats' default; an
    ``explicit`` one below a floor is refused (ConvertError), as the exporter refuses it.

    >>> export_opset(13, False, [F.scaled_dot_product_attention])
    14
    """
    need: dict = {f: FLOOR[f] for f in funcs if f in FLOOR}
    if not need:
        return opset
    if explicit:
        short = {f: n for f, n in need.items() if n > opset}
        if short:
            lines = ", ".join(f"{_name(f)} (opset >= {n})" for f, n in short.items())
            raise ConvertError(f"dal.convert: opset={opset} cannot hold {lines}: torch exports no such "
                               f"node below that opset; pass opset>={max(short.values())} or opset=None")
        return opset
    return max(opset, *need.values())


def called_functions(events: list) -> list:
    """The torch functions called at the top level of a probe forward (probe.py ``Event``)."""
    return [e.obj for e in events if e.kind == "func"]

