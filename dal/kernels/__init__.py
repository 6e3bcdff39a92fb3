"""dal's numerics as registered torch ops (``torch.library``, namespace ``dal``): the layer under
``torch.compile`` and ``torch.export``.

Importing this package registers the ops (a decorator at each definition, like every registry of
dal); ``import dal`` does not import it. Each op has

* a device-generic implementation in plain torch (CUDA, bfloat16, channels-last, any strides),
* a CPU implementation that calls the C++ kernel of ``dal.formats.native`` where that kernel applies
  (float32, contiguous or a dense layout it reads in memory order, a layout it has, the kernel
  built) and the generic one elsewhere; both give
  the same bits (tests/kernels),
* a fake (meta) implementation (``register_fake``) so that dynamo / AOTAutograd trace it without
  running it, and
* its backward registered once (``register_autograd``).

No op reads a tensor's value on the host (no ``.item()``, no Python branch on values): a compiled
training step traces through them without graph breaks. Why opaque ops and not plain torch under
``torch.compile``: inductor compiles plain torch with its own C++ and fast-math flags, and a
division by the scale may become a multiplication by its reciprocal (the one-LSB difference
torch's own fake-quant ops have with ONNX, FACTS.md); an opaque op runs the same code compiled or
not, so a compiled step gives the eager step's bits.

Ops: :mod:`.fake_quant` (``dal::fake_quantize``, its backward ``dal::mask_grad``), :mod:`.observer_update` (``dal::observe_minmax_``),
:mod:`.qparams` (``dal::minmax_qparams``), :mod:`.cast` (``dal::fp_round_trip``), :mod:`.fold_factor`
(``dal::fold_factor``, QConvBn2d's BN fold factor), :mod:`.lsq` (``dal::fake_quantize_lsq``, a learnable
scale and zero point: LSQ / LSQ+, its backward ``dal::fake_quantize_lsq_backward``; CPU backward kernel
:mod:`.lsq_kernel`), :mod:`.observe_fake_quant` (``dal::observe_fake_quantize_``, a min-max
quantizer's QAT step: observer update, scale, fake quantization in one op; its mutation of the
buffers is declared, its gradient carried by an autograd.Function, since torch registers none on a
mutating op).
"""
from .fake_quant import fake_quantize
from .fold_factor import fold_factor
from .lsq import fake_quantize_lsq, lsq_grad_scale
from .cast import fp_round_trip
from .observer_update import observe_minmax_
from .observe_fake_quant import observe_fake_quantize
from .qparams import minmax_qparams

__all__ = ["fake_quantize", "fake_quantize_lsq", "lsq_grad_scale", "fold_factor", "fp_round_trip", "observe_minmax_", "minmax_qparams",
           "observe_fake_quantize"]
