"""What dal.verify is given, checked before anything runs: the ONNX file and the inputs.

A truncated or foreign file, or an input of the wrong batch size, shape or type, fails here with
a :class:`VerifyInputError` naming the file or the input and what would work, instead of a
protobuf, onnxruntime or C++ error from deep inside one of the three engines.
"""
from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import helper

from .codes import as_numpy, is_float8


class VerifyInputError(ValueError):
    """dal.verify was given a file or an input it cannot check; the message says what would work."""


def load_onnx(path) -> onnx.ModelProto:
    """``onnx.load(path)`` plus the ONNX checker; a missing, truncated or non-ONNX file is reported by name.

    Raises FileNotFoundError (no such file) or VerifyInputError (unreadable or invalid model).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file (give the .onnx file dal.export_onnx wrote)")
    try:
        model = onnx.load(path)
    except Exception as err:  # noqa: BLE001 - protobuf's DecodeError and friends: the file is at fault
        raise VerifyInputError(f"{path} is not a readable ONNX file (truncated, or not ONNX: "
                               f"{type(err).__name__}: {err}); export it again with dal.export_onnx") from None
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise VerifyInputError(f"{path} is not a valid ONNX model (truncated or edited? the ONNX checker "
                               f"says: {first}); export it again with dal.export_onnx") from None
    return model


def _expected_shape(value_info) -> list:
    """Graph input dims: an int where fixed, the symbolic name (or None) where not."""
    dims = value_info.type.tensor_type.shape.dim
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in dims]


def _as_array(t) -> np.ndarray:
    return as_numpy(t)  # a torch float8 tensor: the ml_dtypes array of the same bits


def _check_one(k: int, vi, arr: np.ndarray, where: str) -> None:
    name = f"input {k} ({vi.name!r})"
    elem = vi.type.tensor_type.elem_type
    if elem:
        want = helper.tensor_dtype_to_np_dtype(elem)
        if arr.dtype != want:
            how = (f"x.to(torch.{want}) or np.asarray(x, np.{want})" if not is_float8(np.dtype(want)) else
                   f"a torch.{want} tensor or an ml_dtypes.{want} array: a {want} cache comes from the "
                   f"file's own present outputs / the {want} KV-cache quantizer")
            raise VerifyInputError(f"verify: {name} is {arr.dtype}, but {where} takes {want}; convert it (e.g. {how})")
    if not vi.type.tensor_type.HasField("shape"):
        return
    dims = _expected_shape(vi)
    shown = "(" + ", ".join(str(d) if d is not None else "?" for d in dims) + ")"
    if arr.ndim != len(dims):
        raise VerifyInputError(f"verify: {name} has shape {tuple(arr.shape)} ({arr.ndim}-D), but {where} takes "
                               f"{len(dims)}-D inputs of shape {shown}")
    bad = [j for j, (have, want) in enumerate(zip(arr.shape, dims)) if isinstance(want, int) and have != want]
    if bad:
        hint = (" (the batch size is fixed at export: export with dynamic_batch=True to verify other batch sizes)"
                if bad == [0] else "")
        raise VerifyInputError(f"verify: {name} has shape {tuple(arr.shape)}, but {where} takes {shown}: "
                               f"dimension {bad[0]} must be {dims[bad[0]]}{hint}")


def check_feed(model: onnx.ModelProto, inputs: tuple, where: str = "the model") -> dict:
    """``{graph input name: numpy array}`` for ``inputs`` (tensors or arrays, in graph-input order).

    Each input must match its graph input's element type, rank and every fixed dimension
    (symbolic ones, e.g. a dynamic batch, take any size); else VerifyInputError names the input,
    what it is and what the file takes.
    """
    inits = {t.name for t in model.graph.initializer}
    graph_inputs = [vi for vi in model.graph.input if vi.name not in inits]
    if len(inputs) != len(graph_inputs):
        names = [vi.name for vi in graph_inputs]
        raise VerifyInputError(f"verify: {where} takes {len(graph_inputs)} input(s) {names}, got {len(inputs)}; "
                               "pass a tensor or a tuple of tensors in graph-input order")
    feed = {}
    for k, (vi, t) in enumerate(zip(graph_inputs, inputs)):
        arr = _as_array(t)
        _check_one(k, vi, arr, where)
        feed[vi.name] = arr
    return feed
