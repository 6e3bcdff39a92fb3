"""Session.run_teacher_forced: the reference's quantized tensors replace the session's own as
it runs, so each layer is computed from the reference's inputs (dal.verify's layer-by-layer
view). Expected codes are computed here in numpy from the ONNX formulas, not by dal.npu."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from graphs import Builder


def _q(x: np.ndarray, s: np.float32, zp: int) -> np.ndarray:
    # ONNX QuantizeLinear to uint8: saturate(round_half_even(x / s) + zp), in float32
    return np.clip(np.rint(x.astype(np.float32) / s) + zp, 0, 255).astype(np.uint8)


def test_forced_codes_feed_the_next_layer(npu_lib):
    import dal.npu as npu

    b = Builder(seed=3, act="u8")
    s1, s2, zp = np.float32(0.02), np.float32(0.05), 128
    dq1, _ = b.qdq("x", s1)
    y = b.node("Mul", [dq1, b.init(np.float32(3.0), "three")])
    dq2, _ = b.qdq(y, s2)
    model = b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])], dq2)
    q1 = next(n for n in model.graph.node if n.op_type == "QuantizeLinear").output[0]
    q2 = [n for n in model.graph.node if n.op_type == "QuantizeLinear"][1].output[0]

    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    own_q1 = _q(x, s1, zp)
    forced_q1 = np.clip(own_q1.astype(np.int32) + 5, 0, 255).astype(np.uint8)  # the "reference" disagrees

    own = npu.load(model).run_teacher_forced({"x": x}, {q1: forced_q1})
    np.testing.assert_array_equal(own[q1], own_q1)  # what the session itself computed
    dq_forced = ((forced_q1.astype(np.float32) - zp) * s1).astype(np.float32)
    np.testing.assert_array_equal(own[q2], _q(dq_forced * np.float32(3.0), s2, zp))  # from the forced codes
    # without forcing, the next layer follows the session's own codes
    free = npu.load(model).run_teacher_forced({"x": x}, {})
    dq_own = ((own_q1.astype(np.float32) - zp) * s1).astype(np.float32)
    np.testing.assert_array_equal(free[q2], _q(dq_own * np.float32(3.0), s2, zp))
    assert not np.array_equal(free[q2], own[q2])
