"""dal.npu runs its steps with torch's intra-op pool at the session's ``threads`` (torch_threads.py).

A step that calls torch (here a float32 -> float16 Cast, which runs through torch's conversion)
sees ``torch.get_num_threads() == threads``; the caller's count comes back after the run, also
when the run raises; the outputs do not depend on it (float16 conversion is elementwise, the
oracle is numpy's astype)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

import dal.npu
from dal.npu.errors import NPUError
from dal.npu.torch_threads import torch_threads


def _cast_model() -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 3])
    g = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT16, name="c")], "g", [x], [y])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString()


@pytest.fixture
def caller_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(3)
    yield 3
    torch.set_num_threads(old)


def _record(sess, seen):
    """Wrap every planned step's ``run`` so that it records torch's thread count."""
    for step, _, _ in sess._fetch_plan(False):
        inner = step.run

        def run(*a, _inner=inner, **k):
            seen.append(torch.get_num_threads())
            return _inner(*a, **k)

        step.run = run


@pytest.mark.parametrize("threads", [1, 2])
def test_steps_see_session_threads_and_caller_count_restored(caller_threads, threads):
    sess = dal.npu.load(_cast_model(), threads=threads)
    seen = []
    _record(sess, seen)
    x = np.array([[1.0, 65520.0, -1e-8], [np.inf, np.nan, 0.1]], np.float32)
    (y,) = sess.run({"x": x})
    assert seen and set(seen) == {threads}
    assert torch.get_num_threads() == caller_threads
    with np.errstate(over="ignore"):  # 65520 rounds to inf, as IEEE says
        want = x.astype(np.float16)
    np.testing.assert_array_equal(y.view(np.uint16)[~np.isnan(y)], want.view(np.uint16)[~np.isnan(y)])
    assert np.isnan(y[1, 1])
    seen.clear()
    sess.profile({"x": x}, repeat=2)
    assert set(seen) == {threads} and torch.get_num_threads() == caller_threads


def test_count_restored_when_a_run_raises(caller_threads):
    sess = dal.npu.load(_cast_model(), threads=1)
    for step, _, _ in sess._fetch_plan(False):
        def boom(*a, **k):
            assert torch.get_num_threads() == 1
            raise NPUError("boom")
        step.run = boom
    with pytest.raises(NPUError, match="boom"):
        sess.run({"x": np.zeros((2, 3), np.float32)})
    assert torch.get_num_threads() == caller_threads


def test_context_manager_contract(caller_threads):
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == caller_threads
    with torch_threads(caller_threads):  # already that count: left alone
        assert torch.get_num_threads() == caller_threads
    with pytest.raises(ValueError, match="n must be >= 1"):
        with torch_threads(0):
            pass
    assert torch.get_num_threads() == caller_threads
