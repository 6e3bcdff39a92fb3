"""Models whose output is a nest of tensors (dict, dataclass, Hugging Face ModelOutput, lists,
None and other non-tensor leaves): prepare -> calibrate -> export -> verify -> convert.

Oracles: dal.npu runs the file (it reads only the ONNX) and onnxruntime with optimizations off
runs it too; the integer model must equal dal.npu on every output element and every quantized
tensor (both integer engines), output by output paired by the file's output names, and return
the float model's nest (same types, same non-tensor leaves)."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from torch import nn

import dal
import dal.npu
from dal import nest
from dal.verification.integer_model import group_mismatches, npu_group_calls
from oracles import run_ort


@dataclasses.dataclass
class NestOut:
    logits: torch.Tensor
    maps: dict
    nothing: object = None
    step: int = 3


class NestNet(nn.Module):
    """Returns ``NestOut(logits, {"seg": s, "aux": [None, relu(s[:, :2]), "tag"]})``: a dataclass
    holding a dict holding a list with a None leaf and a string leaf."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.seg = nn.Conv2d(8, 4, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        s = self.seg(y)
        return NestOut(self.fc(y.mean((2, 3))), {"seg": s, "aux": [None, torch.relu(s[:, :2]), "tag"]})


class ListDictNet(nn.Module):
    """Returns ``[{"a": t1, "b": None}, (t2, 7)]``: a list of a dict and a tuple (detector-like)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3, padding=1)
        self.c2 = nn.Conv2d(6, 6, 1)

    def forward(self, x):
        y = torch.relu(self.c1(x))
        return [{"a": self.c2(y), "b": None}, (y.mean((2, 3)), 7)]


def _flow(model, example: tuple, batches: list, path) -> tuple:
    """(calibrated QAT model, exported proto, dal.verify report, dal.convert integer model)."""
    q = dal.prepare_qat(model, recipe="int8_balanced", hardware="a2000", example_inputs=example)
    dal.calibrate(q, batches, progress=False)
    q.eval()
    proto = dal.export_onnx(q, example, path)
    report = dal.verify(path, q, example)
    return q, proto, report, dal.convert(q)


def _check(q, proto, report, int_model, example: tuple) -> list[str]:
    """The claims every nest model must meet; returns the flattened names."""
    with torch.no_grad():
        want = q(*example)
    named = nest.named_tensors(want)
    names = [n for n, _ in named]
    # the file's outputs are the nest's tensor leaves, named and ordered by dal.nest
    assert [o.name for o in proto.graph.output] == names
    assert list(report.outputs) == names, list(report.outputs)
    # onnxruntime (optimizations off) pairs with torch's leaves output by output: each file
    # output has its leaf's shape and is nearer to it than to any other leaf of that shape
    feed = {i.name: a.numpy() for i, a in zip(proto.graph.input, example)}
    ort = run_ort(proto, feed)
    for k, ((name, t), o) in enumerate(zip(named, ort)):
        assert o.shape == tuple(t.shape), name
        errs = [np.abs(o - u.numpy()).max() if tuple(u.shape) == o.shape else np.inf for _, u in named]
        assert int(np.argmin(errs)) == k, (name, errs)
    # the integer model returns the float model's nest, and equals dal.npu on every element
    sess = dal.npu.load(proto, threads=1)
    npu_outs, values = sess.run(feed, return_intermediates=True)
    got, codes = int_model.run_with_codes(*example)
    assert type(got) is type(want)
    assert [(n, v) for n, v in nest.leaves(got) if not torch.is_tensor(v)] == \
        [(n, v) for n, v in nest.leaves(want) if not torch.is_tensor(v)]
    assert nest.names(got) == names
    for (name, t), ref in zip(nest.named_tensors(got), npu_outs):
        assert t.shape == ref.shape and np.array_equal(t.numpy(), ref), name
    q_outs = [n.output[0] for n in proto.graph.node if n.op_type == "QuantizeLinear"]
    mine = {f"{qn}.quantized" + (f"_{k}" if k else ""): c.numpy() for qn, calls in codes.items()
            for k, c in enumerate(calls)}
    assert q_outs and not [n for n in q_outs if n not in mine]
    differ = [n for n in q_outs if not np.array_equal(mine[n].astype(np.int64), values[n].astype(np.int64))]
    assert not differ, differ[:5]
    assert not group_mismatches(npu_group_calls(proto, sess.steps), int_model.group_calls())
    assert report.integer is not None and report.integer.identical, str(report.integer)
    return names


def test_dataclass_with_nested_dict_list_none_and_string_leaves(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(2, 3, 8, 8, generator=g) for _ in range(2)]
    q, proto, report, im = _flow(NestNet(), (x,), batches, tmp_path / "nest.onnx")
    names = _check(q, proto, report, im, (x,))
    assert names == ["output.logits", "output.maps.seg", "output.maps.aux.1"]
    out = im(x)
    assert out.step == 3 and out.nothing is None and out.maps["aux"][0] is None and out.maps["aux"][2] == "tag"


def test_list_of_dict_and_tuple(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(1, 3, 8, 8)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(1, 3, 8, 8, generator=g) for _ in range(2)]
    q, proto, report, im = _flow(ListDictNet(), (x,), batches, tmp_path / "ld.onnx")
    assert _check(q, proto, report, im, (x,)) == ["output.0.a", "output.1.0"]


def test_analysis_cosine_reads_every_tensor_of_a_dataclass_output():
    """dal.analysis's end-to-end metric over a nest: the cosine of all tensor leaves (quantizers
    on) against the same model with quantizers off, checked against torch's own cosine."""
    from dal.analysis.common import evaluating
    from dal.analysis.evaluator import Evaluator

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(2, 3, 8, 8, generator=g) for _ in range(2)]
    q = dal.prepare_qat(NestNet(), recipe="int8_balanced", hardware="a2000", example_inputs=(batches[0],))
    dal.calibrate(q, batches, progress=False)
    with evaluating(q):
        got = Evaluator(q, batches, "cosine")()
        mine = torch.cat([t.double().flatten() for b in batches for t in nest.tensors(q(b))])
        with dal.quantizer_states(q, "off"):
            ref = torch.cat([t.double().flatten() for b in batches for t in nest.tensors(q(b))])
    assert mine.numel() == 2 * 2 * (5 + 4 * 64 + 2 * 64)  # logits, seg and aux of both batches
    want = float(torch.nn.functional.cosine_similarity(mine, ref, dim=0))
    assert got == pytest.approx(want, abs=1e-9) and want < 1.0


def test_output_names_of_the_wrong_count_are_refused(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(1, 3, 8, 8)
    q = dal.prepare_qat(ListDictNet(), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    dal.calibrate(q, [x], progress=False)
    from dal.export.errors import ExportError

    with pytest.raises(ExportError, match=r"output_names: 1 name.*2 tensor output.*output\.0\.a"):
        dal.export_onnx(q.eval(), (x,), output_names=["only_one"])


def test_verify_names_a_torch_model_whose_outputs_are_not_the_files(tmp_path):
    from dal.verification.inputs import VerifyInputError

    torch.manual_seed(0)
    x = torch.randn(1, 3, 8, 8)
    q = dal.prepare_qat(ListDictNet(), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    dal.calibrate(q, [x], progress=False)
    path = tmp_path / "ld.onnx"
    dal.export_onnx(q.eval(), (x,), path)

    class FirstOnly(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x)[0]

    with pytest.raises(VerifyInputError, match=r"returns 1 tensor.*'output.a'.*has 2 output"):
        dal.verify(path, FirstOnly(q), (x,), onnxruntime=False)


def _settle_batchnorm(model, x):
    """Running BN statistics from one batch (cumulative average): with the constructor's mean 0 /
    var 1, random-weight nets shrink their activations to ~0 in eval and calibration degenerates."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
            m.momentum = None
    with torch.no_grad():
        model.train()(x)
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("arch,names", [("lraspp_mobilenet_v3_large", ["output.out"]),
                                        ("fcn_resnet50", ["output.out", "output.aux"])])
def test_torchvision_segmenter_dict_output(arch, names, tmp_path):
    seg = pytest.importorskip("torchvision.models.segmentation")
    torch.manual_seed(0)
    kw = {"aux_loss": True} if arch.startswith("fcn") else {}
    model = getattr(seg, arch)(weights=None, weights_backbone=None, num_classes=3, **kw)
    g = torch.Generator().manual_seed(1)
    model = _settle_batchnorm(model, torch.randn(2, 3, 32, 32, generator=g))
    x = torch.randn(1, 3, 32, 32, generator=g)
    batches = [torch.randn(1, 3, 32, 32, generator=g) for _ in range(2)]
    q, proto, report, im = _flow(model, (x,), batches, tmp_path / f"{arch}.onnx")
    assert _check(q, proto, report, im, (x,)) == names


class _BertIds(nn.Module):
    """BertModel called by keyword (``input_ids``, ``token_type_ids``): it returns a ModelOutput.
    Both ids are graph inputs: with an attention mask the file holds int64 GreaterOrEqual nodes,
    and without token_type_ids a GatherElements on int64 ids, which dal.npu does not run yet."""

    def __init__(self, config):
        super().__init__()
        from transformers import BertModel

        self.bert = BertModel(config)

    def forward(self, ids, token_types):
        return self.bert(input_ids=ids, token_type_ids=token_types)


@pytest.mark.slow
def test_hugging_face_model_output(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32)
    model = _BertIds(config).eval()
    g = torch.Generator().manual_seed(1)
    types = torch.zeros(2, 8, dtype=torch.long)
    x = (torch.randint(0, 64, (2, 8), generator=g), types)
    batches = [{"ids": torch.randint(0, 64, (2, 8), generator=g), "token_types": types} for _ in range(2)]
    q, proto, report, im = _flow(model, x, batches, tmp_path / "bert.onnx")
    assert isinstance(q(*x), transformers.utils.ModelOutput)
    assert _check(q, proto, report, im, x) == ["output.last_hidden_state", "output.pooler_output"]
