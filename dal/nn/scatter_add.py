"""BEV pooling as scatter-add, trained as the NPU runs it (export/SPEC.md §5c): the features
quantized by the recipe's input spec, the indices kept integer, the sum accumulated exactly on
the integer codes, then requantized to an observed output quantizer.

    acc[e] = (d[e] - z) + sum_{i -> e} (u[i] - z)         (integers; d, u the codes of Q_x)
    y      = Q_y(float32(acc * s))

``Q_x`` (scale ``s``, zero point ``z``) quantizes the updates (observed) and the destination (the
same scale and zero point, not observed: BEV pooling starts from zeros, which every affine or
symmetric integer format holds exactly); every contribution is on that one scale, so the zero
point is subtracted once per contribution and the destination's once. ``Q_y`` is the output
quantizer (the recipe's output spec, else a second quantizer of the input's spec, observed).
Three torch spellings, one computation (a ``scatter_add`` along ``dim`` with the index
broadcast to the updates' shape, which is also the exported ScatterElements):

* ``index_put``: ``x.index_put_((idx,), v, accumulate=True)``, one index tensor on dim 0,
  negative indices counted from the end;
* ``scatter_add``: ``torch.scatter_add(x, dim, index, src)`` / ``x.scatter_add_(dim, index, src)``;
* ``index_add``: ``torch.index_add(x, dim, index, source)`` / ``x.index_add_(...)`` (alpha 1).

Exactness: with ``K`` the most contributions one destination element can receive (the index's
extent along ``dim``; ``index_put``: its element count) and ``W = qmax - qmin`` of the input
format, ``|acc| <= (K + 1) * W``. The QAT model sums the codes in float32 while
``(K + 1) * W <= 2^24`` (exact), in float64 beyond (exact); the chip's int32 accumulator needs
``(K + 1) * W < 2^31`` (int8 / uint8: ``K <= 8,421,502``): beyond it the module refuses with a
ValueError naming the layer.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..formats import fake_quantize
from ..ops import by_function, by_method
from ..quantizer import FakeQuantizer
from .base import QATModule
from .spec import make_quantizer, role_specs

KINDS = ("index_put", "scatter_add", "index_add")
#: the accumulator of the chip: |acc| must stay below 2^31
ACC_LIMIT = 2 ** 31
#: float32 holds every integer up to 2^24 exactly
FLOAT32_EXACT = 2 ** 24


def check_index(path: str, index: torch.Tensor, size: int, what: str, negative_ok: bool = False,
                values: bool = True) -> None:
    """ValueError naming ``path`` unless ``index`` is an integer tensor whose values lie in
    ``[0, size)`` (``[-size, size)`` with ``negative_ok``). The values are read (a host sync)
    only with ``values`` and never while torch.compile or a tracer builds a graph; the dtype always."""
    where = path or "scatter/gather"
    if index.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise ValueError(f"{where}: {what} must be an integer tensor (int64 / int32), got {index.dtype}; "
                         "indices of a float type are not indices (cast them with .long() where they are built)")
    if not values or index.numel() == 0 or torch.compiler.is_compiling() or torch.jit.is_tracing():
        return
    lo, hi = int(index.min()), int(index.max())
    low = -size if negative_ok else 0
    if lo < low or hi >= size:
        raise ValueError(f"{where}: {what} out of range: values in [{lo}, {hi}] for a dimension of size {size} "
                         f"(allowed [{low}, {size - 1}])")


def scatter_operands(kind: str, x: torch.Tensor, index: torch.Tensor, src: torch.Tensor, dim: int,
                     path: str = "", values: bool = True) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(dim, index_e, src_e)`` such that ``torch.scatter_add(x, dim, index_e, src_e)`` computes
    the call of ``kind`` (module doc): ``index_e`` has ``src_e``'s shape. Shapes are checked
    (ValueError naming ``path``), index values too with ``values`` (:func:`check_index`)."""
    where = path or f"QScatterAdd({kind})"
    if x.dtype != src.dtype:
        raise ValueError(f"{where}: destination {x.dtype} and updates {src.dtype} must have one dtype")
    if kind == "index_put":
        check_index(path, index, x.shape[0] if x.dim() else 0, "index_put index", negative_ok=True, values=values)
        want = tuple(index.shape) + tuple(x.shape[1:])
        if x.dim() == 0 or tuple(src.shape) != want:
            raise ValueError(f"{where}: index_put updates must have shape index.shape + x.shape[1:] = {list(want)}, "
                             f"got {list(src.shape)} (x {list(x.shape)}, index {list(index.shape)})")
        k = index.numel()
        idx = index.reshape(k).long()
        idx = torch.where(idx < 0, idx + x.shape[0], idx)
        rest = tuple(x.shape[1:])
        idx = idx.reshape((k,) + (1,) * len(rest)).expand((k,) + rest)
        return 0, idx, src.reshape((k,) + rest)
    nd = x.dim()
    if not -nd <= dim < nd:
        raise ValueError(f"{where}: dim {dim} out of range for a destination of shape {list(x.shape)}")
    dim = dim % nd
    if kind == "index_add":
        if index.dim() != 1 or src.dim() != nd or src.shape[dim] != index.shape[0] or \
                any(src.shape[d] != x.shape[d] for d in range(nd) if d != dim):
            raise ValueError(f"{where}: index_add needs a 1-D index and source of x's shape with index.numel() rows "
                             f"along dim {dim}; got x {list(x.shape)}, index {list(index.shape)}, source "
                             f"{list(src.shape)}")
        check_index(path, index, x.shape[dim], "index_add index", values=values)
        shape = [1] * nd
        shape[dim] = index.shape[0]
        return dim, index.long().reshape(shape).expand(src.shape), src
    if kind != "scatter_add":
        raise ValueError(f"{where}: kind {kind!r} is not one of {KINDS}")
    if index.dim() != nd or src.dim() != nd or any(index.shape[d] > src.shape[d] for d in range(nd)) or \
            any(index.shape[d] > x.shape[d] for d in range(nd) if d != dim):
        raise ValueError(f"{where}: scatter_add needs index and src of x's rank with index.size(d) <= src.size(d) "
                         f"and <= x.size(d) for d != dim; got x {list(x.shape)}, index {list(index.shape)}, src "
                         f"{list(src.shape)}")
    check_index(path, index, x.shape[dim], "scatter_add index", values=values)
    if tuple(src.shape) != tuple(index.shape):  # torch reads src only where index is
        src = src[tuple(slice(0, n) for n in index.shape)]
    return dim, index.long(), src


def contributions(kind: str, index: torch.Tensor, dim: int) -> int:
    """The most updates one destination element can receive (``K`` of the module doc)."""
    return int(index.numel()) if kind == "index_put" else int(index.shape[dim]) if index.dim() else 1


def _round_ste(v: torch.Tensor) -> torch.Tensor:
    """``round(v)`` forward, identity backward (``v`` is an integer up to float rounding)."""
    return v + (torch.round(v) - v).detach()


class QScatterAdd(QATModule):
    """``index_put_(accumulate=True)`` / ``scatter_add`` / ``index_add`` with an integer
    accumulator (module doc). Called as ``module(x, index, src)``: the destination, the index
    (integer, else ValueError naming the module's path), the updates (an integer destination and
    updates are summed by torch, unquantized). Index values out of range are
    a ValueError naming the path while calibrating (the input quantizer observing) and in training
    mode; in eval mode (export, dal.convert) torch's own check applies. ``dim`` is ignored for
    ``index_put`` (dim 0)."""

    op_class = "scatter_add"
    swappable = False
    #: ScatterElements with reduction="add" (export/SPEC.md §5c)
    min_opset = 16

    def __init__(self, spec=None, name: str = "", kind: str = "scatter_add", dim: int = 0):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"{name or 'QScatterAdd'}: kind {kind!r} is not one of {KINDS}")
        self.qat_name, self.kind, self.dim = name, kind, int(dim)
        in_spec, _, out_spec = role_specs(spec)
        for role, s in (("input", in_spec), ("output", out_spec)):
            if s is not None and not s.format.is_scaled:
                raise ValueError(f"{name or 'QScatterAdd'}: scatter-add accumulates integer codes; the {role} format "
                                 f"{s.format.name} is not an integer format (use int8 / uint8, or a skip rule to keep "
                                 "it in float)")
        self.input_quant = make_quantizer(in_spec, None, f"{name}.input_quant", force_per_tensor=True)
        out = out_spec if out_spec is not None else in_spec
        self.output_quant = make_quantizer(out, None, f"{name}.output_quant", force_per_tensor=True)

    @classmethod
    def from_spec(cls, spec=None, name: str = "", **kwargs):
        return cls(spec, name, **kwargs)

    def quantizers(self) -> dict:
        return {k: q for k in ("input_quant", "output_quant") if (q := getattr(self, k)) is not None}

    def _destination(self, q: FakeQuantizer, x: torch.Tensor) -> torch.Tensor:
        """``x`` on the input quantizer's scale and zero point, without observing it."""
        if torch.onnx.is_in_onnx_export():
            return q(x)  # the exporter's Q/DQ of the input quantizer
        scale, zero_point = q.effective_qparams()
        return fake_quantize(x, q.fmt, scale, zero_point, q.granularity, q.narrow_range, check=False)

    def accumulator_bound(self, k: int) -> int:
        """``(K + 1) * (qmax - qmin)``: the largest ``|acc|`` for ``k`` contributions (module doc)."""
        q = self.input_quant
        width = int(q.qmax - q.qmin) if q is not None and q.fmt.is_scaled else 255
        return (k + 1) * width

    def forward(self, x: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        q = self.input_quant
        values = self.training or (q is not None and q.state == "observe")
        dim, idx, upd = scatter_operands(self.kind, x, index, src, self.dim, self.qat_name, values)
        if not x.is_floating_point():  # integer tensors (positions, counts): torch's exact sum, no quantizer
            return torch.scatter_add(x, dim, idx, upd)
        if q is None or not q.state.quantizes:  # float, or calibrating: observe, sum in float
            u = q(upd) if q is not None else upd
            return self._out(torch.scatter_add(x, dim, idx, u))
        k = contributions(self.kind, idx, dim)
        bound = self.accumulator_bound(k)
        if bound >= ACC_LIMIT:
            raise ValueError(f"{self.qat_name or 'QScatterAdd'}: up to {k} contributions per element can reach "
                             f"|acc| = {bound} >= 2^31: the int32 accumulator would overflow (at most "
                             f"{ACC_LIMIT // (bound // (k + 1)) - 2} contributions); split the scatter")
        u, d = q(upd), self._destination(q, x)
        if torch.onnx.is_in_onnx_export():
            return self._out(torch.scatter_add(d, dim, idx, u))  # DQ -> ScatterElements(add) -> Q
        scale = q.effective_qparams()[0].reshape(())
        wide = torch.float32 if bound <= FLOAT32_EXACT else torch.float64
        nd = _round_ste(d / scale).to(wide)
        nu = _round_ste(u / scale).to(wide)
        acc = torch.scatter_add(nd, dim, idx, nu)  # integers: exact in `wide`
        y = (acc * scale.to(wide)).to(x.dtype) if wide is torch.float64 else acc * scale
        return self._out(y)

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        return self.output_quant(y) if self.output_quant is not None else y

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, dim={self.dim}"


def spelling_of(target, method: bool, op_name: str) -> Optional[str]:
    """The spelling of a call of the op named ``op_name`` (``dal.ops``: ``target`` one of its
    functions, or with ``method`` one of its Tensor method names): the function's or method's name
    without an in-place ``_`` (``torch.index_put_`` -> ``"index_put"``), or None for a call of
    another op."""
    op = by_method(target) if method else by_function(target)
    if op is None or op.name != op_name:
        return None
    return (target if method else target.__name__).removesuffix("_")


def scatter_call(target, args: tuple, kwargs: dict, method: bool = False):
    """``(kind, dim, x, index, src, in_place)`` of a call of a scatter-add spelling (``target`` a
    torch function, or with ``method`` a Tensor method name; ``args`` start with the tensor), or
    None when it is not one: ``index_put`` without ``accumulate=True`` or with several index
    tensors, ``index_add`` with ``alpha`` other than 1. The values may be fx Nodes."""
    kind = spelling_of(target, method, "scatter_add")  # one of KINDS: the op's functions and methods
    if kind is None:
        return None
    in_place = method and str(target).endswith("_") or target is torch.index_put_

    def arg(i, name, default=None):
        return args[i] if len(args) > i else kwargs.get(name, default)

    x = arg(0, "self" if method else "input", kwargs.get("input"))
    if kind == "index_put":
        indices, values, accumulate = arg(1, "indices"), arg(2, "values"), arg(3, "accumulate", False)
        if accumulate is not True or not isinstance(indices, (tuple, list)) or len(indices) != 1:
            return None
        return kind, 0, x, indices[0], values, in_place
    dim, index = arg(1, "dim"), arg(2, "index")
    src = arg(3, "src" if kind == "scatter_add" else "source")
    if not isinstance(dim, int) or kind == "index_add" and kwargs.get("alpha", 1) != 1 or len(args) > 4:
        return None
    return kind, dim, x, index, src, in_place
