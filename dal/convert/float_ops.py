"""Float ops between integer groups, with the float semantics of export/SPEC.md ("Float
islands"), applied to the integer model's forward by a ``TorchFunctionMode``.

torch's float32 kernels do not promise one rounding: its pooling sums in float32 in its own
order, its transcendental functions are vectorised approximations. The contract the NPU
reference implements instead (written once in export/SPEC.md), and which these follow:

* GlobalAveragePool / ReduceMean / AveragePool (float32 or float16): the sum in float64 divided
  by the element count in float64 (AveragePool: ceil_mode included), rounded once to the input's
  type;
* ReduceSum (``torch.sum`` / ``Tensor.sum``: ResNeSt's split attention): the sum in float64,
  rounded once to the input's type (torch's float32 sum rounds every partial sum);
* Sigmoid (and SiLU, exported as ``x * Sigmoid(x)``): ``1 / (1 + exp(-x))`` in float64, rounded
  once to float32 (the Mul in float32); Tanh, Sin, Cos: float64, rounded once;
* CumSum (``torch.cumsum`` / ``Tensor.cumsum``: DETR-family sine position embeddings): the running
  sum in float64, each element rounded once to the input's type;
* TopK (``torch.topk``: RT-DETR's query selection): equal values by ascending index (ONNX's order);
* HardSigmoid / HardSwish: ``clip(x * float32(1/6) + 0.5, 0, 1)`` in float32 (times x in float32);
* Resize linear and cubic (``F.interpolate`` bilinear, bicubic): separable in float64, rounded
  once to float32;
* GridSample (a float ``F.grid_sample`` a recipe does not quantize; a quantized one is
  ``QGridSample``, forms.py): export/SPEC.md §5b in float64, rounded once (grid_sample.py);
* BatchNormalization (a BN a recipe's skip rule leaves in float; unfolded, it is otherwise a
  QBatchNorm2d, an integer layer):
  ``(x - mean) / sqrt(var + float32(eps)) * scale + B`` in float64, rounded once (torch's float32
  kernel rounds its per-channel terms to float32 in its own order: an ulp off on 5090 of 18432
  elements of one of timm densenet121's BNs, which flipped a code of the next quantizer);
* GroupNorm / InstanceNorm (``F.group_norm``, ``F.instance_norm``: an FP16 island's
  ``Fp16GroupNorm`` calls them): ``InstanceNormalization`` in float64 rounded once, GroupNorm's
  Mul and Add in float32 (instancenorm.py; torch's float32 kernel is an ulp off on about half of
  its outputs); an instance norm on running statistics as BatchNormalization above;
* functional ``F.gelu``, ``F.softmax`` / ``torch.softmax`` / ``Tensor.softmax`` and
  ``F.layer_norm`` (not only their modules, which forms.py swaps) and
  ``F.scaled_dot_product_attention``: as their exported nodes, at the export's opset (lut.py
  ``gelu_onnx``, attention.py ``softmax_f32``, layernorm.py ``layer_norm_onnx``, sdpa.py ``sdpa_onnx``);
* everything else (Relu, Clip, Add, Mul, MaxPool, Flatten, Reshape, Concat, ...) is exact or
  one IEEE float32 operation, in torch as in numpy.

A float op used by the model but absent from this list runs as torch computes it. Which torch
callables get which of these forms is the op registry's (dal.ops: each op's ``integer_form``,
read through op_forms.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..export.plan import TRACE_MAX_OPSET
from .fp16_region import float32_value, to_dtype_once
from .op_forms import float_forms, form_factory, opset_forms
from .probe import picked_calls
from .instancenorm import instance_norm_onnx


def mean_f64(x: torch.Tensor, dims, keepdim: bool) -> torch.Tensor:
    """``T(sum_float64(x over dims) / float64(count))``, T = x's type, one rounding
    (export/SPEC.md §5a: ReduceMean, GlobalAveragePool)."""
    dims = tuple(sorted({d % x.ndim for d in dims}))
    n = 1
    for d in dims:
        n *= x.shape[d]
    return to_dtype_once(x.double().sum(dim=dims, keepdim=keepdim) / float(n), x.dtype)


def sum_f64(x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype=None):
    """ONNX ReduceSum of a float32 / float16 tensor (export/SPEC.md §5a): ``T(sum float64(x))``
    over ``dim`` (all dims when None), one rounding. Other types or a ``dtype``: None (torch's op)."""
    if x.dtype not in (torch.float32, torch.float16) or dtype is not None:
        return None
    s = x.double().sum() if dim is None else x.double().sum(dim=dim, keepdim=keepdim)
    return to_dtype_once(s, x.dtype)


def _spatial(output_size) -> bool:
    if isinstance(output_size, int):
        return output_size == 1
    return all(v == 1 for v in output_size)


def adaptive_avg_pool_f64(x, output_size):
    """``F.adaptive_avg_pool2d`` to 1 x 1 of a float32 / float16 tensor: ONNX GlobalAveragePool
    (:func:`mean_f64` over the spatial dims); another output size: None (torch's op)."""
    if x.dtype in (torch.float32, torch.float16) and _spatial(output_size):
        return mean_f64(x, range(2, x.ndim), True)
    return None


def reduce_mean_f64(x, dim=None, keepdim=False, *, dtype=None):
    """``torch.mean`` / ``Tensor.mean`` over explicit dims of a float32 / float16 tensor: ONNX
    ReduceMean (:func:`mean_f64`); no dim, ``dim=()`` or a ``dtype``: None (torch's op)."""
    if x.dtype not in (torch.float32, torch.float16) or dtype is not None or dim is None:
        return None
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if not dims:  # torch: dim=() reduces every dim; leave it to torch's op
        return None
    return mean_f64(x, dims, keepdim)


def avg_pool2d_f64(x, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    """ONNX AveragePool (export/SPEC.md §5a): float64 window sums divided in float64 by the count,
    rounded once to x's type (float32 / float16); the count: the window's input elements
    (count_include_pad False), else its elements inside the padded input (``k*k`` unless ceil_mode lets the last window run past
    the padding: the overhang is not counted, as torch and onnxruntime divide)."""
    if x.dtype not in (torch.float32, torch.float16) or divisor_override is not None:
        return None
    k = (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)
    st = k if stride is None or (not isinstance(stride, int) and len(stride) == 0) else stride
    st = (st, st) if isinstance(st, int) else tuple(st)
    p = (padding, padding) if isinstance(padding, int) else tuple(padding)
    s = F.avg_pool2d(x.double(), k, st, p, ceil_mode, True, 1)
    over = ceil_mode and any((s.shape[2 + i] - 1) * st[i] + k[i] > x.shape[2 + i] + 2 * p[i] for i in range(2))
    if count_include_pad and not over:
        return to_dtype_once(s / float(k[0] * k[1]), x.dtype)
    ones = torch.ones((1, 1) + tuple(x.shape[2:]), dtype=torch.float64, device=x.device)
    if count_include_pad:  # the padded input's ones (explicit pads: crop to the pooled size)
        ones = F.pad(ones, (p[1], p[1], p[0], p[0]), value=1.0)
        cnt = F.avg_pool2d(ones, k, st, 0, True, True, 1)[:, :, :s.shape[2], :s.shape[3]]
    else:
        cnt = F.avg_pool2d(ones, k, st, p, ceil_mode, False, 1)
    return to_dtype_once(s / cnt, x.dtype)


def batch_norm_f64(x, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
                   eps=1e-5):
    """ONNX BatchNormalization in inference form (export/SPEC.md §5a), per channel (axis 1):
    ``T((x - mean) / sqrt(var + float32(eps)) * scale + B)``, every operation in float64 from the
    float32 / float16 operands, rounded once to ``T`` (x's type). ``eps`` is taken as the float32
    the file's ``epsilon`` attribute holds; no weight / bias: scale 1, B 0, as the export writes.
    Training mode or missing running statistics: None (torch's own op)."""
    if training or running_mean is None or running_var is None or x.dtype not in (torch.float32, torch.float16):
        return None
    shape = (1, -1) + (1,) * (x.ndim - 2)

    def per_channel(v, default):
        v = torch.full((x.shape[1],), default, dtype=torch.float64, device=x.device) if v is None else v.double()
        return v.reshape(shape)
    std = torch.sqrt(per_channel(running_var, 0.0) + float32_value(eps))
    y = (x.double() - per_channel(running_mean, 0.0)) / std
    return to_dtype_once(y * per_channel(weight, 1.0) + per_channel(bias, 0.0), x.dtype)


def instance_norm_form(x, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True,
                   momentum=0.1, eps=1e-5, cudnn_enabled=False):
    """``F.instance_norm``: InstanceNormalization (instancenorm.py) with input statistics; on
    running statistics torch exports the per-channel BatchNormalization (inference form) of the
    ``(1, N*C, ...)`` view, which is ``batch_norm_f64`` channel by channel."""
    if not use_input_stats and running_mean is not None and running_var is not None:
        return batch_norm_f64(x, running_mean, running_var, weight, bias, False, momentum, eps)
    return instance_norm_onnx(x, running_mean, running_var, weight, bias, use_input_stats, momentum, eps)


def sigmoid_f64(x):
    """float32(1 / (1 + exp(-x))) computed in float64."""
    if x.dtype != torch.float32:
        return None
    return torch.reciprocal(1.0 + torch.exp(-x.double())).float()


def tanh_f64(x):
    """float32(tanh(x)) computed in float64 (ONNX Tanh, export/SPEC.md §5a)."""
    if x.dtype != torch.float32:
        return None
    return torch.tanh(x.double()).float()


def sin_f64(x):
    """float32(sin(x)) computed in float64 (ONNX Sin, export/SPEC.md §5a)."""
    return torch.sin(x.double()).float() if x.dtype == torch.float32 else None


def cos_f64(x):
    """float32(cos(x)) computed in float64 (ONNX Cos, export/SPEC.md §5a)."""
    return torch.cos(x.double()).float() if x.dtype == torch.float32 else None


def cumsum_f64(x, dim, *, dtype=None):
    """ONNX CumSum of a float32 / float16 tensor (export/SPEC.md §5a): the running sum along ``dim``
    in float64, each element rounded once to x's type. Other types or a ``dtype``: None (torch's op)."""
    if x.dtype not in (torch.float32, torch.float16) or dtype is not None:
        return None
    return to_dtype_once(torch.cumsum(x.double(), dim), x.dtype)


def topk_onnx(x, k, dim=-1, largest=True, sorted=True):
    """ONNX TopK's order (export/SPEC.md §5a): the k largest (smallest) along ``dim``, equal values
    by ascending index, as a stable sort gives them (torch.topk promises no order among ties).
    NaN in x: None (torch's op; dal.npu refuses it)."""
    if x.dtype.is_floating_point and bool(torch.isnan(x).any()):
        return None
    v, i = torch.sort(x, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((v.narrow(dim, 0, k), i.narrow(dim, 0, k)))


def silu_f64(x, inplace=False):
    """``F.silu`` of float32 x as exported, ``x * Sigmoid(x)``: ``x * sigmoid_f64(x)``, the Mul in
    float32 (export/SPEC.md §5a); other types: None."""
    s = sigmoid_f64(x)
    return None if s is None else x * s


def hardsigmoid_f32(x, inplace=False):
    """ONNX HardSigmoid as torch exports ``F.hardsigmoid`` (alpha 1/6, beta 0.5), in float32:
    ``clip(x * float32(1/6) + 0.5, 0, 1)``; other types: None."""
    if x.dtype != torch.float32:
        return None
    return torch.clamp(x * torch.tensor(1 / 6, dtype=torch.float32) + 0.5, 0.0, 1.0)


def hardswish_f32(x, inplace=False):
    """ONNX HardSwish: ``x * hardsigmoid_f32(x)`` in float32; other types: None."""
    h = hardsigmoid_f32(x)
    return None if h is None else x * h


def _source_coord(n_in: int, n_out: int, scale: float, align_corners: bool, device) -> torch.Tensor:
    """ONNX Resize's source coordinate in float64 (the ``half_pixel`` / ``align_corners`` modes
    torch exports), in dal.npu's operation order."""
    o = torch.arange(n_out, dtype=torch.float64, device=device)
    if align_corners:
        return o * (n_in - 1) / (n_out - 1) if n_out > 1 else o * 0.0
    return (o + 0.5) / scale - 0.5


def _source_index(n_in: int, n_out: int, scale: float, align_corners: bool, device) -> torch.Tensor:
    """``_source_coord`` clamped to [0, n_in - 1], as linear Resize reads it."""
    return _source_coord(n_in, n_out, scale, align_corners, device).clamp(0, n_in - 1)


def linear_resize_f64(x: torch.Tensor, sizes: list, scales: list, align_corners: bool) -> torch.Tensor:
    """ONNX Resize ``linear`` (export/SPEC.md §5a: separable, each axis in float64 in turn,
    ``x[lo] * (1 - w) + x[hi] * w``, the result rounded once to float32)."""
    out = x.double()
    for ax in range(2, x.ndim):
        n_in, n_out = out.shape[ax], sizes[ax - 2]
        if n_out == n_in and scales[ax - 2] == 1:
            continue
        src = _source_index(n_in, n_out, scales[ax - 2], align_corners, x.device)
        lo = torch.floor(src).long()
        hi = torch.clamp(lo + 1, max=n_in - 1)
        w = (src - lo).reshape([-1 if i == ax else 1 for i in range(x.ndim)])
        out = out.index_select(ax, lo) * (1.0 - w) + out.index_select(ax, hi) * w
    return out.float()


#: torch's bicubic kernel constant, which its export writes as Resize's ``cubic_coeff_a``
CUBIC_A = -0.75


def cubic_resize_f64(x: torch.Tensor, sizes: list, scales: list, align_corners: bool) -> torch.Tensor:
    """ONNX Resize ``cubic`` with ``cubic_coeff_a = -0.75`` and ``exclude_outside = 0`` (torch's
    bicubic export) as dal.npu computes it (export/SPEC.md §5a): per axis in float64, the taps
    ``floor(src) - 1 .. floor(src) + 2`` (clamped to the edge) weighted by the Keys kernel at
    distances ``1 + t, t, 1 - t, 2 - t``, summed left to right; the result rounded once to float32."""
    out, A = x.double(), CUBIC_A
    offsets = torch.tensor([1.0, 0.0, -1.0, -2.0], dtype=torch.float64, device=x.device)
    for ax in range(2, x.ndim):
        n_in, n_out = out.shape[ax], sizes[ax - 2]
        if n_out == n_in and scales[ax - 2] == 1:
            continue
        src = _source_coord(n_in, n_out, scales[ax - 2], align_corners, x.device)  # not clamped
        base = torch.floor(src)
        d = (offsets + (src - base)[:, None]).abs()
        w = torch.where(d <= 1, ((A + 2) * d - (A + 3)) * d * d + 1, ((A * d - 5 * A) * d + 8 * A) * d - 4 * A)
        taps = (base.long()[:, None] + torch.arange(-1, 3, device=x.device)).clamp(0, n_in - 1)
        shape = [-1 if i == ax else 1 for i in range(x.ndim)]
        y = out.index_select(ax, taps[:, 0]) * w[:, 0].reshape(shape)
        for k in range(1, 4):
            y = y + out.index_select(ax, taps[:, k]) * w[:, k].reshape(shape)
        out = y
    return out.float()


def interpolate_f64(input, size=None, scale_factor=None, mode="nearest", align_corners=None,
                 recompute_scale_factor=None, antialias=False):
    """F.interpolate's (bi)linear and bicubic modes as the exported Resize computes them: ``size``
    gives ``sizes`` (scale = out / in in float64); ``scale_factor`` gives float32 ``scales`` and
    ``floor(in * scale)`` outputs, unless ``recompute_scale_factor`` makes them sizes."""
    if mode not in ("linear", "bilinear", "trilinear", "bicubic") or input.dtype != torch.float32 or antialias:
        return None
    spatial = list(input.shape[2:])
    n = len(spatial)
    if size is not None:
        sizes = [int(v) for v in (size if isinstance(size, (list, tuple)) else [size] * n)]
        scales = [o / i for o, i in zip(sizes, spatial)]
    elif scale_factor is not None:
        factors = scale_factor if isinstance(scale_factor, (list, tuple)) else [scale_factor] * n
        scales = [float(torch.tensor(f, dtype=torch.float32)) for f in factors]
        sizes = [int(math.floor(i * s)) for i, s in zip(spatial, scales)]
        if recompute_scale_factor:
            scales = [o / i for o, i in zip(sizes, spatial)]
    else:
        return None
    resize = cubic_resize_f64 if mode == "bicubic" else linear_resize_f64
    return resize(input, sizes, scales, bool(align_corners))


@form_factory(needs_opset=False)
def average_pool_form(func, opset):
    """The ``avg_pool`` op's form for a call of ``func``: ONNX AveragePool for ``F.avg_pool2d``
    (:func:`avg_pool2d_f64`), GlobalAveragePool for ``F.adaptive_avg_pool2d``
    (:func:`adaptive_avg_pool_f64`, to 1 x 1); None (torch's op) for the op's other callables."""
    if func is F.avg_pool2d:
        return avg_pool2d_f64
    return adaptive_avg_pool_f64 if func is F.adaptive_avg_pool2d else None


@form_factory(needs_opset=True)
def gelu_form(func, opset: int):
    """F.gelu (``approximate`` "none" / "tanh", float32) as the exported nodes at ``opset``
    compute it (lut.py ``gelu_onnx``: the Gelu node from opset 20, its Erf / Tanh spelling before)."""
    from .lut import gelu_onnx

    def gelu(x, approximate="none"):
        ok = x.dtype == torch.float32 and approximate in ("none", "tanh")
        return gelu_onnx(x, opset, approximate) if ok else None
    return gelu


@form_factory(needs_opset=True)
def softmax_form(func, opset: int):
    """F.softmax / torch.softmax / Tensor.softmax of a float32 tensor over an explicit ``dim`` (no
    ``dtype``): attention.py ``softmax_f32`` at every opset; like the other functional islands,
    applied where the export's opset is known."""
    from .attention import softmax_f32

    def softmax(x, dim=None, _stacklevel=3, dtype=None):
        return softmax_f32(x, dim) if x.dtype == torch.float32 and dtype is None and dim is not None else None
    return softmax


@form_factory(needs_opset=True)
def layer_norm_form(func, opset: int):
    """F.layer_norm of a float32 tensor as the exported nodes at ``opset`` compute it (layernorm.py
    ``layer_norm_onnx``: LayerNormalization from opset 17, its ReduceMean spelling before)."""
    from .layernorm import layer_norm_onnx

    def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
        if x.dtype != torch.float32:
            return None
        n = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
        return layer_norm_onnx(x, weight, bias, n, eps, opset)
    return layer_norm


@form_factory(needs_opset=True)
def sdpa_form(func, opset: int):
    """F.scaled_dot_product_attention as its exported decomposition (sdpa.py ``sdpa_onnx``) from
    ``SDPA_OPSET`` on; None below it (torch exports no such node there: torch's op runs)."""
    from .sdpa import SDPA_OPSET, sdpa_onnx

    return sdpa_onnx if opset >= SDPA_OPSET else None


def _opset_impl(opset: int) -> dict:
    """The functional forms whose exported spelling depends on the (traced) opset
    (op_forms.py ``opset_forms``)."""
    return opset_forms(opset)


class NPUFloatOps(TorchFunctionMode):
    """Replaces every call of an op whose registry entry has an ``integer_form`` by that form
    (op_forms.py ``float_forms``: the functions above, with their SPEC.md semantics); a form that
    returns None, or raises TypeError on an argument form it does not take, leaves torch's own op
    to run, as does any other call. ``opset``: the export's; None leaves out the forms spelled by
    the opset (the ``needs_opset`` factories: GELU, softmax, layer norm, SDPA).

    ``fan``: the model's fixed-point fan-out values (layers.py ``fan_values``): a max pool or
    nearest interpolate of such a group's output applies to every reader's value too, so each
    reader still quantizes its own codes, pooled (probe.py ``pass_through``)."""

    def __init__(self, fan: dict | None = None, opset: int | None = None):
        super().__init__()
        self.fan = fan
        forms = float_forms()
        self.impl = {**forms, **_opset_impl(min(int(opset), TRACE_MAX_OPSET))} if opset is not None else forms
        self.picks = picked_calls()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        got = self.fan.get(id(args[0])) if self.fan and args and func in self.picks else None
        if got is not None and got[0] is args[0]:
            out = func(*args, **(kwargs or {}))
            self.fan[id(out)] = (out, {k: func(v, *args[1:], **(kwargs or {})) for k, v in got[1].items()})
            return out
        impl = self.impl.get(func)
        if impl is not None:
            try:
                out = impl(*args, **(kwargs or {}))
            except TypeError:  # an argument form not handled here: torch's own op
                out = None
            if out is not None:
                return out
        return func(*args, **(kwargs or {}))
