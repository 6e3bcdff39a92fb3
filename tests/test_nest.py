"""dal.nest: the order and names of a nest's tensor leaves, checked against torch's own pytree
(an implementation dal did not write) and against the TorchScript ONNX exporter's own flattening,
and the nest rebuilt with its types."""
from __future__ import annotations

import collections
import dataclasses
import io

import numpy as np
import onnx
import pytest
import torch
from torch.utils._pytree import tree_flatten

from dal import nest


@dataclasses.dataclass
class Pair:
    first: torch.Tensor
    second: object = None
    note: str = "kept"


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: torch.Tensor
    b: tuple


Point = collections.namedtuple("Point", ["x", "y"])


def _t(*shape):
    return torch.arange(float(np.prod(shape))).reshape(shape)


def test_order_and_names_follow_insertion_fields_and_position_depth_first():
    a, b, c, d, e = _t(1), _t(2), _t(3), _t(4), _t(5)
    value = {"z": a, "aux": [None, b, {"deep": c}], "pair": Pair(d, None), "last": (e, 7)}
    assert nest.names(value) == ["output.z", "output.aux.1", "output.aux.2.deep", "output.pair.first",
                                 "output.last.0"]
    assert [t.shape[0] for t in nest.tensors(value)] == [1, 2, 3, 4, 5]
    assert [n for n, _ in nest.leaves(value)] == [
        "output.z", "output.aux.0", "output.aux.1", "output.aux.2.deep", "output.pair.first", "output.pair.second",
        "output.pair.note", "output.last.0", "output.last.1"]
    assert nest.names(a) == ["output"] and nest.names((a,)) == ["output.0"]
    assert nest.names([]) == [] and nest.names(None) == []


def test_order_agrees_with_torch_pytree_on_dicts_lists_tuples():
    """torch's pytree (dict insertion order, then position) is the oracle for what it covers."""
    g = torch.Generator().manual_seed(0)
    value = collections.OrderedDict(b=torch.randn(2, generator=g),
                                    a=[torch.randn(3, generator=g), (torch.randn(4, generator=g), None)],
                                    c={"y": torch.randn(5, generator=g), "x": torch.randn(6, generator=g)})
    theirs = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    mine = nest.tensors(value)
    assert len(mine) == len(theirs) == 5 and all(m is t for m, t in zip(mine, theirs))


def test_unflatten_rebuilds_types_and_keeps_other_leaves():
    value = collections.OrderedDict(p=Pair(_t(2)), f=Frozen(_t(3), (None, _t(4))), pt=Point(_t(5), "s"))
    new = [torch.full((k,), -1.0) for k in (2, 3, 4, 5)]
    out = nest.unflatten(value, new)
    assert type(out) is collections.OrderedDict and list(out) == ["p", "f", "pt"]
    assert type(out["p"]) is Pair and out["p"].note == "kept" and out["p"].second is None
    assert type(out["f"]) is Frozen and out["f"].b[0] is None and type(out["pt"]) is Point and out["pt"].y == "s"
    assert all(a is b for a, b in zip(nest.tensors(out), new))
    assert all(torch.equal(a, b) for a, b in zip(nest.tensors(value), [_t(2), _t(3), _t(4), _t(5)]))  # untouched
    doubled = nest.map_tensors(lambda t: 2 * t, value)
    assert torch.equal(doubled["f"].b[1], 2 * _t(4))
    with pytest.raises(ValueError, match="holds 4 tensor"):
        nest.unflatten(value, new[:3])


class _DictNet(torch.nn.Module):
    def forward(self, x):
        return {"seg": x * 2, "aux": [x + 1, {"deep": x.sum(1)}], "logits": x.mean(1)}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torchscript_exporter_flattens_a_dict_output_in_the_same_order():
    """torch.onnx.export (TorchScript), without dal, on a dict/list nest: its graph outputs are
    dal.nest's tensor leaves in dal.nest's order (shapes and values from onnx.reference)."""
    from onnx.reference import ReferenceEvaluator

    x = torch.randn(2, 3, 4)
    buf = io.BytesIO()
    torch.onnx.export(_DictNet(), (x,), buf, dynamo=False, opset_version=17, input_names=["x"])
    proto = onnx.load_from_string(buf.getvalue())
    got = ReferenceEvaluator(proto).run(None, {"x": x.numpy()})
    want = nest.tensors(_DictNet()(x))
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-6, atol=1e-6)


def test_a_hugging_face_model_output_is_walked_as_its_dict_and_rebuilt_as_itself():
    """A ModelOutput is an OrderedDict and a dataclass: its None fields are not in the dict."""
    outputs = pytest.importorskip("transformers.modeling_outputs")
    value = outputs.BaseModelOutputWithPooling(last_hidden_state=_t(2, 3), pooler_output=_t(2))
    assert nest.names(value) == ["output.last_hidden_state", "output.pooler_output"]
    assert [n for n, _ in nest.leaves(value)] == ["output.last_hidden_state", "output.pooler_output"]
    out = nest.map_tensors(lambda t: -t, value)
    assert type(out) is type(value) and list(out.keys()) == ["last_hidden_state", "pooler_output"]
    assert torch.equal(out.pooler_output, -_t(2)) and torch.equal(out["last_hidden_state"], -_t(2, 3))
    assert out.hidden_states is None and torch.equal(value.pooler_output, _t(2))
