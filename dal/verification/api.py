"""dal.verify: run an exported ONNX file on the NPU reference, torch and onnxruntime; compare."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import torch

from .. import nest
from ..nn.modes import eval_mode
from ..quantizer import quantizer_states
from .codes import is_code, is_float8, ordinals
from .inputs import VerifyInputError, check_feed, load_onnx
from .integer_model import integer_vs_npu
from .metrics import agreement
from .onnx_tools import ort_run_all, output_lsb, producers, require_onnxruntime
from .report import LayerParity, ParityReport
from .layer_verdict import annotate_forced, annotate_float, graph_order
from .torch_layers import torch_layers_vs_file


def _as_tuple(inputs):
    return inputs if isinstance(inputs, (tuple, list)) else (inputs,)


def _torch_outputs(model, inputs, graph_outputs: list[str], where: str) -> list[np.ndarray]:
    """The tensor leaves of ``model(*inputs)`` in dal.nest's order (the order the exporter gave
    the file's outputs), as float numpy arrays; VerifyInputError when their count is not the
    file's."""
    with eval_mode(model), torch.no_grad():
        out = model(*inputs)
    named = nest.named_tensors(out)
    if len(named) != len(graph_outputs):
        raise VerifyInputError(f"verify: the torch model returns {len(named)} tensor(s) {[n for n, _ in named]} "
                               f"(dal.nest order) but {where} has {len(graph_outputs)} output(s) {graph_outputs}; "
                               "give the model the file was exported from")
    return [t.detach().float().cpu().numpy() for _, t in named]


def _float_outputs(model, inputs, graph_outputs: list[str], where: str) -> list[np.ndarray]:
    """``_torch_outputs`` of the float model: the same module with every quantizer off (restored after)."""
    with quantizer_states(model, "off"):
        return _torch_outputs(model, inputs, graph_outputs, where)


def verify(onnx_path, torch_model=None, inputs=(), *, onnxruntime: bool = True, threads=None) -> ParityReport:
    """Parity of an exported QDQ model: NPU reference vs the torch QAT model and vs onnxruntime.

    Args:
        onnx_path: the exported file (or an ``onnx.ModelProto``).
        torch_model: the QAT model it was exported from (eval mode is used), or None. It may
            return any nest of tensors (dict, dataclass, ``ModelOutput``, lists, ``None``
            leaves): its tensor leaves in ``dal.nest`` order are paired with the file's outputs
            in graph order, which is how dal.export_onnx wrote them; the report names each
            output by the file's name for it (dal.nest's ``output.logits``, ``output.aux.0``).
        inputs: a tensor or tuple of tensors (or numpy arrays), in graph-input order. A float8
            input (a decode graph's FP8 KV cache) is a ``torch.float8_e4m3fn`` / ``float8_e5m2``
            tensor or the ``ml_dtypes`` array of the same type; it reaches onnxruntime as an
            ``OrtValue`` of its bytes with the ONNX element type (onnx_tools.ort_run_all).
        onnxruntime: also run onnxruntime with graph optimizations disabled and compare every
            intermediate integer tensor with the NPU reference twice: end to end (``layers``,
            each engine on its own upstream values) and layer by layer (``layers_forced``: every
            layer run from onnxruntime's integer inputs, so drift cannot cascade).

    With ``torch_model`` the report also holds ``integer``: ``dal.convert(torch_model)`` against
    the NPU reference on every output element and every quantized tensor (both integer engines:
    they must be identical), and ``torch_layers``: every activation quantizer of the
    torch model against the NPU reference's codes at the same point, torch teacher-forced to the
    NPU's values as it runs (dal.verification.torch_layers): the trained model and the chip,
    layer by layer.

    Per output the report gives cosine, MSE, PSNR, max abs error and the count of elements that
    differ by one LSB of the output quantizer's scale and by more. Why both layer views: two
    engines that sum floats in different orders disagree on a near-tie now and then (one code,
    one LSB), and in a deep network such a flip feeds every later layer, so end to end a
    correct export can drift by a few LSB; the layer-by-layer view isolates each layer's own
    disagreement, which may only be near-ties. ``report.verdict()`` (the one verdict, ParityReport.verdict)
    is: integer model == NPU on every element, and every layer-by-layer difference a near-tie, tested
    code by code (near_tie.py). Vs the float model (quantizers off), not in the verdict: ``npu_vs_float``
    per output, ``float_cosine`` per layer row (beside its LSB counts). Requantizers: ``dal.requantizer`` metadata.

    Quantized tensors are compared as codes: integer codes in LSBs, float8 codes in steps of
    the format's grid (codes.ordinals: adjacent representable values are 1 apart).

    A decoder (dal.export_decoder's prefill and decode files) is verified in one call by
    :func:`dal.verify_decoder` ``((prefill, decode), model, prompt)``: each file as here, the decode
    step fed from the prefill's own outputs (its cache codes and next token), both sections
    printed, one verdict. One file of the pair is verified here with
    ``dal.export.decoder.decoder_step(model, path)`` as the torch model.

    A missing file raises FileNotFoundError; a truncated or invalid file, or inputs of the wrong
    number, type, rank or size, raise :class:`~dal.verification.inputs.VerifyInputError` (a
    ValueError) naming the file or the input; without onnxruntime installed (and
    ``onnxruntime=True``) an ImportError says ``pip install 'dal[ort]'``.
    """
    return verify_with_outputs(onnx_path, torch_model, inputs, onnxruntime, threads)[0]


def verify_with_outputs(onnx_path, torch_model=None, inputs=(), onnxruntime: bool = True,
                        threads=None) -> tuple[ParityReport, list]:
    """:func:`verify` (same arguments, same checks), returning ``(report, outputs)``: the
    ParityReport and the NPU reference's outputs (numpy, in graph-output order), which
    verify_decoder feeds to the decode step."""
    import dal.npu

    if isinstance(onnx_path, (tuple, list)):
        raise VerifyInputError(f"verify: onnx_path is a {type(onnx_path).__name__} of {len(onnx_path)}; give one "
                               "file (for a decoder's (prefill, decode) pair use dal.verify_decoder(paths, model, "
                               "prompt))")
    if onnxruntime:
        require_onnxruntime()  # before minutes of NPU reference runs, not after
    model = onnx_path if isinstance(onnx_path, onnx.ModelProto) else load_onnx(onnx_path)
    inputs = _as_tuple(inputs)
    where = "the model" if isinstance(onnx_path, onnx.ModelProto) else str(onnx_path)
    feed = check_feed(model, inputs, where)
    meta = {p.key: p.value for p in model.metadata_props}
    requant = json.loads(meta.get("dal.requantizer", '{"kind": "float"}'))
    report = ParityReport(model=str(onnx_path) if not isinstance(onnx_path, onnx.ModelProto) else model.graph.name,
                          requantizer=requant.get("kind", "float"), order=graph_order(model))
    sess = dal.npu.load(model, threads=threads)
    npu_outs, npu_values = sess.run(feed, return_intermediates=True)
    out_names = [o.name for o in model.graph.output]
    torch_outs = _torch_outputs(torch_model, inputs, out_names, where) if torch_model is not None else None
    float_outs = _float_outputs(torch_model, inputs, out_names, where) if torch_model is not None else None
    ort_outs, ort_values = ort_run_all(model, feed) if onnxruntime else (None, {})
    for i, out in enumerate(model.graph.output):
        lsb = output_lsb(model, out.name)
        pairs = {}
        if torch_outs is not None:
            pairs["npu_vs_torch"] = _output_pair(npu_outs[i], torch_outs[i].reshape(np.shape(npu_outs[i])), lsb)
            pairs["npu_vs_float"] = _output_pair(npu_outs[i], float_outs[i].reshape(np.shape(npu_outs[i])), lsb)
        if ort_outs is not None:
            pairs["npu_vs_ort"] = _output_pair(npu_outs[i], ort_outs[i], lsb)
        report.outputs[out.name] = pairs
    made_by = producers(model)
    report.layers, report.first_divergence = _compare_integer_tensors(npu_values, ort_values, made_by)
    if ort_values:
        # Layer by layer: onnxruntime's integer tensors replace the NPU's own as it runs, so a
        # one-LSB near-tie upstream cannot cascade; what differs is each layer's own arithmetic.
        codes = {k: v for k, v in ort_values.items() if is_code(v)}  # integer and float8 codes
        forced = sess.run_teacher_forced(feed, codes)
        report.layers_forced, report.first_forced_divergence = _compare_integer_tensors(forced, ort_values, made_by)
        annotate_forced(report.layers_forced, model, forced, ort_values, feed, requant)  # near-ties, code by code
    if torch_model is not None:
        report.torch_layers = torch_layers_vs_file(torch_model, model, inputs, npu_values, feed, requant)
        annotate_float(report.layers_forced + report.torch_layers, torch_model, inputs, npu_values, model)
        # the two integer engines, derived independently (torch model / file): must be identical
        report.integer = integer_vs_npu(torch_model, model, inputs, npu_outs, npu_values, sess.steps)
    return report, npu_outs


def _output_pair(npu, other, lsb):
    """``agreement`` of one output. An output that is codes (a decoder's ``present_*`` KV cache:
    integer or float8) is compared in its own units, LSB = 1 code (float8: one grid step,
    codes.ordinals), ``other`` taken to the same codes (float8: ``astype``, exact on the grid;
    integer: ``rint``); cosine, MSE and PSNR are of the code values."""
    if not is_code(npu):
        return agreement(npu, other, lsb)
    npu = np.asarray(npu)
    theirs = np.asarray(other).astype(npu.dtype) if is_float8(npu) else np.rint(np.asarray(other, np.float64))
    steps = agreement(ordinals(npu), ordinals(theirs), 1.0)
    return dataclasses.replace(agreement(npu, theirs), identical=steps.identical, off_by_one=steps.off_by_one,
                               off_by_more=steps.off_by_more, max_lsb=steps.max_lsb, lsb=1.0)


def _compare_integer_tensors(mine_values: dict, ort_values: dict, made_by: dict):
    """LayerParity rows for every integer tensor both runs hold, in graph order, and the first
    node whose output differs (None when all agree)."""
    rows, first = [], None
    for name, ref in ort_values.items():
        # Quantized tensors (QuantizeLinear outputs: integer or float8 codes) are what the hardware
        # holds between layers; float intermediates differ in the last bits by design (exact int32
        # vs float32 sums). Codes are compared by grid position (codes.ordinals: LSBs, float8 steps).
        if name not in mine_values or not is_code(ref):
            continue
        mine = np.asarray(mine_values[name])
        if mine.shape != np.shape(ref):
            continue
        a = agreement(ordinals(mine).astype(np.float64), ordinals(ref).astype(np.float64))
        node = made_by.get(name)
        row = LayerParity(name, node.name if node else "", node.op_type if node else "", a.elements,
                          a.elements - a.identical, a.max_abs)
        rows.append(row)
        if row.differ and first is None:
            first = f"{row.node} ({row.op_type}) -> {name}"
    return rows, first
