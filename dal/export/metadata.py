"""Model metadata_props: what dal trained with, for the NPU reference and deployment tools.

Keys (values are strings; JSON where structured):

* ``dal.version``     the dal version that wrote the file;
* ``dal.recipe``      the recipe's name (or JSON of it) the model was prepared with, "" if none;
* ``dal.hardware``    the hardware model's name (or JSON), "" if none;
* ``dal.requantizer`` JSON, the hardware's requantizer: ``{"kind": "float"}`` (ONNX semantics, the
  default) or e.g. ``{"kind": "fixed_point", "multiplier_bits": 31, "rounding": "half_up"}``;
* ``dal.accumulator`` JSON, the hardware's accumulator ``{"bits": B, "overflow": "saturate" | "wrap"}``;
  absent when the model was prepared without a hardware model (exact accumulation);
* ``dal.sparse_24``   JSON object ``{codes initializer name: reduction axis}`` for weights trained
  with a 2:4 mask whose stored codes are 2:4 along that axis (at most 2 non-zero codes in every
  group of 4 consecutive elements).

export_onnx adds ``dal.export_route`` / ``dal.export_route_reason`` (dal/export/routes.py).
"""
from __future__ import annotations

import dataclasses
import json
import warnings
from typing import Optional

import numpy as np
import onnx

from .qdq import DQInfo


def _describe(obj) -> str:
    if obj is None:
        return ""
    if isinstance(obj, str):
        return obj
    name = getattr(obj, "name", None)
    if isinstance(name, str) and name:
        return name
    return json.dumps(_jsonable(obj), sort_keys=True)


def _jsonable(obj):
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        return _jsonable(to_dict())
    return str(obj)


def requantizer_json(hardware) -> str:
    """The hardware model's requantizer as JSON, ``{"kind": "float"}`` when it declares none."""
    req = getattr(hardware, "requantizer", None)
    if req is None:
        return json.dumps({"kind": "float"})
    value = _jsonable(req)
    if isinstance(value, str):
        value = {"kind": value}
    if not isinstance(value, dict):
        value = {"kind": str(value)}
    value.setdefault("kind", "float")
    # Only the keys that mean something: a float requantizer has no multiplier or rounding.
    value = {k: v for k, v in value.items() if v is not None}
    if value["kind"] == "float":
        value = {"kind": "float"}
    return json.dumps(value, sort_keys=True)


def accumulator_json(hardware) -> Optional[str]:
    """``{"bits": accumulator_bits, "overflow": accumulator_overflow}`` of the hardware model, or None."""
    bits = getattr(hardware, "accumulator_bits", None)
    if bits is None:
        return None
    return json.dumps({"bits": int(bits), "overflow": getattr(hardware, "accumulator_overflow", "saturate")},
                      sort_keys=True)


def is_24_sparse(codes: np.ndarray, zero_point: np.ndarray, axis: int, zp_axis: Optional[int]) -> bool:
    """At most 2 of every 4 consecutive codes along ``axis`` differ from the zero point."""
    if codes.shape[axis] % 4:
        return False
    values = codes.astype(np.float32)
    zp = zero_point.astype(np.float32)
    if zp.ndim == 1 and zp_axis is not None:  # per-channel zero point along another axis
        view = [1] * values.ndim
        view[zp_axis] = -1
        zp = zp.reshape(view)
    elif zp.ndim and zp.shape != values.shape:  # blocked: expand along the blocked axis
        zp = np.repeat(zp, values.shape[zp_axis] // zp.shape[zp_axis], axis=zp_axis)
    nonzero = np.moveaxis(np.broadcast_to(values != zp, values.shape), axis, -1)
    return bool((nonzero.reshape(-1, 4).sum(axis=1) <= 2).all())


def sparse_24(infos: dict[str, DQInfo]) -> dict[str, int]:
    """{codes initializer: reduction axis} for masked weights that are 2:4 as stored."""
    found, not_24 = {}, []
    for info in infos.values():
        owner = info.site.entry.owner
        if info.weight is None or getattr(owner, "weight_mask", None) is None:
            continue
        if info.site.entry.quantizer is not getattr(owner, "weight_quant", None):
            continue
        reduction = int(getattr(owner, "weight_reduction_axis", 1))
        axis = info.perm.index(reduction) if info.perm is not None else reduction
        if is_24_sparse(info.codes, info.qparams.zero_point, axis, info.qparams.axis):
            found[info.weight] = axis
        else:
            not_24.append(info.site.entry.owner_name)
    if not_24:
        warnings.warn(f"modules with a weight_mask whose exported weight is not 2:4 (not listed in "
                      f"dal.sparse_24): {', '.join(sorted(set(not_24)))}", stacklevel=3)
    return found


def write_metadata(model: onnx.ModelProto, torch_model, infos: dict[str, DQInfo], extra: Optional[dict]) -> None:
    from .. import __version__

    from ..prepare.handle import find_prepared

    handle = find_prepared(torch_model)
    hardware = handle.hardware if handle is not None else None
    props = {
        "dal.version": __version__,
        "dal.recipe": _describe(handle.recipe if handle is not None else None),
        "dal.hardware": _describe(hardware),
        "dal.requantizer": requantizer_json(hardware),
        "dal.sparse_24": json.dumps(sparse_24(infos), sort_keys=True),
    }
    if accumulator_json(hardware) is not None:
        props["dal.accumulator"] = accumulator_json(hardware)
        from ..prepare.accumulator_width import check_accumulators
        check_accumulators(torch_model, hardware)  # warns, naming each layer, with the trained codes
    for key, value in (extra or {}).items():
        props[str(key)] = value if isinstance(value, str) else json.dumps(_jsonable(value), sort_keys=True)
    del model.metadata_props[:]
    for key, value in props.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
