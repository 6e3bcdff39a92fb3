"""The integer model's quantizer calls, without per-call overhead that changes no value.

``IntegerModel`` runs its network under ``NPUFloatOps`` (float_ops.py), a ``TorchFunctionMode``:
every torch call in the forward, a tensor attribute read included, passes through a Python
handler first (about a microsecond each; a frozen quantizer's call makes a dozen). A quantizer
computes ONNX Q/DQ with torch ops none of which the mode replaces, so :class:`IntegerQuantizer`
runs its forward with torch-function handling off: the same ops, the same values.

A weight's quantizer (its input an ``nn.Parameter``: an embedding table, a norm's weight)
computes the same output on every call: it is kept and returned while the parameter, the output
and the quantizer's own buffers (scale, zero point, state) are unchanged (their ``_version``
counters and storage).

A frozen per-tensor quantizer (integer or FP8) and a float16 / bfloat16 cast quantizer, on a plain
contiguous float32 CPU tensor, go straight to the C++ call ``FakeQuantizer.forward`` reaches for
it (dal.formats' ``dal_fq_forward_fixed`` / ``dal_fp_cast_round_trip``, the same arguments), its
constant arguments made once and re-made after any attribute set on the quantizer and when its
scale or zero point is written in place (``_direct``): the ~10 Python calls of checks that
``FakeQuantizer.forward`` makes on the way are per-call cost, no value.

In a graph captured by dal/convert/compiled.py the same C++ calls are operators (host_ops.py,
``_captured``), the other quantizers ``FakeQuantizer.forward`` (its compiled route).

The forms of float islands (attention.py ``MatMulForm`` / ``SoftmaxForm``, rmsnorm.py) turn the
handling off the same way (:func:`dispatch_off`), except while a forward is captured (dal.capture).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..capture import capturing
from ..formats import fp_cast, native
from ..formats.fused import kernel_mode
from ..quantizer import FakeQuantizer
from . import host_ops


def dispatch_off():
    """A context in which torch-function handling (NPUFloatOps' per-call dispatch) is off, for a
    form none of whose ops NPUFloatOps replaces; a no-op context while a forward is captured
    (``dal.capture.capturing``: the probe's, probe.py), whose mode must see the functions a form calls."""
    return contextlib.nullcontext() if capturing() else torch._C.DisableTorchFunction()


class IntegerQuantizer(FakeQuantizer):
    """A ``FakeQuantizer`` of the integer model (module doc): ``forward`` returns what
    ``FakeQuantizer.forward`` returns, bit for bit and with the same strides, computed with
    torch-function handling off, and kept across calls for an ``nn.Parameter`` input (no grad).
    Its name in printouts stays FakeQuantizer."""

    #: ``(key, output, output's version)`` of the last Parameter input (``_kept``): a plain
    #: attribute, not a buffer; the class default keeps its lookup off nn.Module.__getattr__
    _kept_output = None
    #: the direct C++ call's plan (``_make_direct``), a plain attribute
    _direct_plan = None

    def _get_name(self) -> str:
        return "FakeQuantizer"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._captured(x)
        with torch._C.DisableTorchFunction():
            if type(x) is torch.Tensor:
                y = self._direct(x)
                if y is not None:
                    return y
            elif isinstance(x, nn.Parameter) and not torch.is_grad_enabled():
                return self._kept(x)
            return super().forward(x)

    def __setattr__(self, name: str, value) -> None:
        # any attribute set (the state's mirror, training, format, a new scale or zero point tensor,
        # use_kernel) drops the direct call's plan; in-place writes are seen by _direct's versions
        object.__setattr__(self, "_direct_plan", None)
        super().__setattr__(name, value)

    def _make_direct(self) -> tuple:
        """The direct call's plan, ``(kind, constant arguments, scale, its version, zero point, its
        version)``: kind "fq" (arguments: scale ptr, zp ptr, qmin, qmax, FP8 max, mode) where
        ``FakeQuantizer.forward`` on a plain contiguous float32 CPU tensor without grad ends in
        ``fixed_fake_quantize`` of a per-tensor layout (its ``_kernel`` route, not tracking: the
        scale is fixed); "cast" (argument: the dtype code) where it ends in ``kernel_round_trip`` (a
        float16 / bfloat16 cast quantizer, while that kernel is switched on); None elsewhere (the
        whole forward runs)."""
        lib = native.library()
        s, z = self.scale, self.zero_point
        plan = (None, (), s, s._version, z, z._version)
        if lib is None or self.training:
            return plan
        if self._kernel and self.granularity.axis is None and s.dtype == torch.float32 and s.numel() == 1 \
                and s.is_contiguous() and s.is_cpu and z.dtype == torch.int32 and z.numel() == 1 \
                and z.is_contiguous() and z.is_cpu:
            fmt = self.fmt
            return ("fq", (s.data_ptr(), z.data_ptr(), float(self.qmin), float(self.qmax),
                           fmt.max_value if fmt.is_float8 else 0.0, kernel_mode(fmt))) + plan[2:]
        if self.casts and not self.fake_quantizes:
            code = fp_cast.DTYPE_CODES.get(self.fmt.torch_dtype())
            if code is not None:
                return ("cast", (code,)) + plan[2:]
        return plan

    def _captured(self, x: torch.Tensor) -> torch.Tensor:
        """This call in a graph captured by dal/convert/compiled.py: where the eager call ends in the C++
        call of ``_direct`` (a frozen per-tensor quantizer or a cast quantizer, float32 CPU input), that
        call as one operator (host_ops.py; values as eager, the output contiguous); for the parameter whose
        output the eager calls kept (``_kept``), that output, a constant of the graph (the frozen model of
        compiled.py: the capture keeps it from the eager forward before); else the forward."""
        kept = self._kept_output
        if kept is not None and isinstance(x, nn.Parameter) and kept[0][0] == id(x) and not torch.is_grad_enabled():
            return kept[1]
        with torch._C.DisableTorchFunction():
            if x.dtype == torch.float32 and x.is_cpu and not self.training and host_ops.available():
                s, z = self.scale, self.zero_point
                if self._kernel and self.granularity.axis is None and s.dtype == torch.float32 \
                        and s.numel() == 1 and s.is_cpu and z.dtype == torch.int32 and z.numel() == 1 and z.is_cpu:
                    fmt = self.fmt
                    return torch.ops.dal_convert.fake_quant_fixed(x, s, z, float(self.qmin),
                                                                  float(self.qmax),
                                                                  fmt.max_value if fmt.is_float8 else 0.0,
                                                                  kernel_mode(fmt))
                if self.casts and not self.fake_quantizes and fp_cast.kernel_enabled():
                    code = fp_cast.DTYPE_CODES.get(self.fmt.torch_dtype())
                    if code is not None:
                        return torch.ops.dal_convert.cast_round_trip(x, code)
            return super().forward(x)

    def _direct(self, x: torch.Tensor):
        """This call's output by the C++ call ``FakeQuantizer.forward`` would make (module doc), or
        None: the whole forward decides (another tensor or quantizer kind, tracing, compiling). The
        plan is re-made after any attribute set on the quantizer and when its scale or zero point
        tensor was written in place (their versions)."""
        if x.dtype != torch.float32 or x.requires_grad or not x.is_cpu or not x.is_contiguous() \
                or torch.compiler.is_compiling() or torch.jit.is_tracing():
            return None
        n = x.numel()
        plan = self._direct_plan
        if plan is None or plan[2]._version != plan[3] or plan[4]._version != plan[5]:
            plan = self._make_direct()
            object.__setattr__(self, "_direct_plan", plan)
        kind, args = plan[0], plan[1]
        if kind is None or n == 0:
            return None
        if kind == "fq":
            out = torch.empty_like(x)
            native.library().dal_fq_forward_fixed(x.data_ptr(), out.data_ptr(), None, 1, n, 1, 1, args[0], args[1],
                                                  args[2], args[3], args[4], args[5], torch.get_num_threads())
            return out
        if not fp_cast.kernel_enabled():  # switched off since the plan: torch's two casts (the forward)
            return None
        out = torch.empty_like(x)
        native.library().dal_fp_cast_round_trip(x.data_ptr(), out.data_ptr(), n, args[0], torch.get_num_threads())
        return out

    def _key(self, x: torch.Tensor) -> tuple:
        return (id(x), x.data_ptr(), x._version, self.state, self.scale._version, self.zero_point._version,
                self.scale.data_ptr(), self.zero_point.data_ptr())

    def _kept(self, x: torch.Tensor) -> torch.Tensor:
        kept = self._kept_output
        key = self._key(x)
        if kept is not None and kept[0] == key and kept[1]._version == kept[2]:
            return kept[1]
        y = super().forward(x)
        self._kept_output = (key, y, y._version)
        return y


def use_integer_quantizers(net: nn.Module) -> int:
    """Make every plain ``FakeQuantizer`` in ``net`` an :class:`IntegerQuantizer` (in place;
    subclasses are left as they are); returns how many."""
    n = 0
    for m in net.modules():
        if type(m) is FakeQuantizer:
            m.__class__ = IntegerQuantizer
            n += 1
    return n
