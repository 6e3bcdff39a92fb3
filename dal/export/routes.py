"""Which tracer export_onnx uses: ``route="torchscript" | "dynamo" | "auto"``.

* ``"torchscript"`` (the default): ``torch.onnx.export(dynamo=False)``, dal/export/trace.py.
* ``"dynamo"``: ``torch.export`` + the dynamo ONNX exporter, dal/export/dynamo_trace.py; a model
  it cannot capture is an ExportError (:class:`~dal.export.dynamo_trace.CaptureError`).
* ``"auto"``: the dynamo route, and the TorchScript route for a model it cannot capture
  (torchvision detectors' data-dependent post-processing, value-dependent control flow, a missing
  onnxscript).

Either way the file records the route in ``metadata_props``: ``dal.export_route`` is the route
that traced it, and ``dal.export_route_reason`` why: ``"asked"``, or the one-line capture failure
that sent ``"auto"`` to TorchScript.
"""
from __future__ import annotations

from typing import Optional

from .errors import ExportError

ROUTES = ("torchscript", "dynamo", "auto")
#: export_onnx's default route
DEFAULT_ROUTE = "torchscript"


def check_route(route: str) -> str:
    """``route`` itself when it is one of :data:`ROUTES`, else ExportError naming it."""
    if route not in ROUTES:
        raise ExportError(f"route={route!r}: expected one of {list(ROUTES)}")
    return route


def try_dynamo(route: str, model, args, plan, opset, input_names, output_names, dynamic_batch):
    """``((proto, sites, leaf names), route record)`` from the dynamo route when ``route`` asks for
    it and it captures the model; ``(None, route record)`` when the TorchScript route must trace.

    The route record is ``{"dal.export_route": ..., "dal.export_route_reason": ...}`` (module
    docstring); ``route="dynamo"`` re-raises a capture failure instead of falling back.
    """
    check_route(route)
    if route == "torchscript":
        return None, _record("torchscript", "asked")
    from .dynamo_trace import CaptureError, trace_dynamo

    try:
        traced = trace_dynamo(model, args, plan, opset, input_names, output_names, dynamic_batch)
    except CaptureError as err:
        if route == "dynamo":
            raise
        return None, _record("torchscript", f"dynamo capture failed: {err.reason}")
    return traced, _record("dynamo", "asked" if route == "dynamo" else "auto")


def _record(route: str, reason: Optional[str]) -> dict:
    return {"dal.export_route": route, "dal.export_route_reason": reason or ""}
