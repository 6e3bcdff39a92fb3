"""A 2:4 + INT8 QAT model through export: the ONNX file's sparse weights, its metadata, and
two runtimes that read only the file (onnxruntime with optimizations off; dal's NPU
reference with its compressed 2:4 kernel), each against the torch QAT model in output LSBs.

2:4 validity of the initializers is counted here with a numpy reshape along the axis the
ONNX operator reduces over (Conv W axis 1, Gemm transB=1 axis 1, MatMul B axis 0).
"""
import json

import numpy as np
import pytest
import torch

import dal
import dal.sparsity as sp
from dal_examples.zoo import MnistCNN
from oracles import lsb_diff, output_scale, run_ort
from sparsity_qat_helpers import (calibrated_frozen, initializers, max_nonzeros_per_group, mnist_batches,
                                  npu_sparse_kernel_weights, teacher_forced_max_lsb, weight_codes)


def _check_file(model, proto):
    """Every masked layer's codes are 2:4 along the reduction axis, dal.sparse_24 lists exactly
    those (with that axis), and no other weight happens to be 2:4."""
    listed = json.loads({p.key: p.value for p in proto.metadata_props}["dal.sparse_24"])
    inits, axes = initializers(proto), weight_codes(proto)
    n_sparse = len(sp.controller_of(model).layers)
    assert len(listed) == n_sparse > 0
    for name, axis in axes.items():
        nz = max_nonzeros_per_group(inits[name], axis) if inits[name].shape[axis] % 4 == 0 else 4
        if name in listed:
            assert listed[name] == axis, (name, listed[name], axis)
            assert nz <= 2, name
            assert (inits[name] != 0).mean() > 0.45, name     # not a zeroed-out weight
        else:
            assert nz > 2, f"{name} is 2:4 but not listed in dal.sparse_24"
    assert set(listed) <= set(axes)
    return listed


def _npu_session(proto):
    import dal.npu

    return dal.npu.load(proto, threads=1)


def test_mnist_cnn_export_ort_and_npu_within_one_lsb():
    torch.manual_seed(0)
    batches = [x for x, _ in mnist_batches(256, 64)]
    model = calibrated_frozen(MnistCNN(), batches)
    x = batches[0][:32]
    proto = dal.export_onnx(model, (x,))
    listed = _check_file(model, proto)
    with torch.no_grad():
        ref = model(x).numpy()
    scale = output_scale(proto)
    ort_lsb = lsb_diff(run_ort(proto, {"input": x.numpy()})[0], ref, scale)
    assert ort_lsb.max() <= 1, np.unique(ort_lsb, return_counts=True)
    sess = _npu_session(proto)
    npu_lsb = lsb_diff(sess.run({"input": x.numpy()})[0], ref, scale)
    assert npu_lsb.max() <= 1, np.unique(npu_lsb, return_counts=True)
    sparse_kernel, fused = npu_sparse_kernel_weights(sess)
    # every listed weight the NPU runs as an integer group goes through the sparse kernel. In
    # MnistCNN, down.0 (its ReLU output feeds two QuantizeLinear) and down2.0 (MaxPool before
    # the next Q) form no DQ->Conv->Q group and run node by node: see the report of issue 6.
    assert sparse_kernel == set(listed) & fused
    assert len(sparse_kernel) >= 2


@pytest.mark.slow
def test_resnet18_export_ort_and_npu_within_one_lsb():
    """ResNet-18 (random weights, 64x64): every conv/linear but conv1 (3 input channels) is 2:4
    and runs on the NPU's sparse kernel. Parity is judged at every activation quantizer with
    the runtime's upstream values (teacher forced): with random weights a 1-LSB float-order
    flip cascades to a few LSB end to end (tests/export/test_export_parity.py); end to end is
    bounded loosely."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(2, 3, 64, 64, generator=g) for _ in range(2)]
    model = calibrated_frozen(torchvision.models.resnet18(weights=None), batches)
    assert sp.report(model).skipped == {"conv1": "input channels = 3 is not a multiple of 4"}
    x = torch.randn(2, 3, 64, 64, generator=g)
    proto = dal.export_onnx(model, (x,))
    listed = _check_file(model, proto)
    assert len(listed) == 20
    sess = _npu_session(proto)
    sparse_kernel, _ = npu_sparse_kernel_weights(sess)
    assert sparse_kernel == set(listed)
    for label, run in (("onnxruntime", run_ort), ("npu", lambda p, f: _npu_session(p).run(f))):
        forced = teacher_forced_max_lsb(model, proto, x, run)
        assert len(forced) >= 20, label
        assert max(forced.values()) <= 1, (label, {k: v for k, v in forced.items() if v > 1})
    with torch.no_grad():
        ref = model(x).numpy()
    e2e = lsb_diff(sess.run({"input": x.numpy()})[0], ref, output_scale(proto))
    assert np.mean(e2e <= 1) > 0.8 and e2e.max() <= 8, np.unique(e2e, return_counts=True)
