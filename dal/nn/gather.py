"""``torch.gather``, ``index_select`` and ``take_along_dim`` on integer codes (export/SPEC.md §5d):
the input quantized by the recipe's input spec, the indices kept integer, the output the picked
codes on the input's own scale and zero point (no observer, no requantization).

    y = Q_x(op(Q_x(x), index))

Picking elements changes no value, so ``Q_x`` applied again is exact (the QAT model skips it;
the exported file has a second ``QuantizeLinear -> DequantizeLinear`` of the same quantizer after
the Gather / GatherElements, so the NPU reads and writes codes). Embedding tables are
``dal.nn.QEmbedding`` (a Gather of the table's weight codes).
"""
from __future__ import annotations

import torch

from .base import QATModule
from .scatter_add import check_index, spelling_of
from .spec import make_quantizer, role_specs

KINDS = ("gather", "index_select", "take_along_dim")


def gather_call(kind: str, x: torch.Tensor, index: torch.Tensor, dim, path: str = "",
                values: bool = True) -> torch.Tensor:
    """``torch.gather(x, dim, index)`` / ``x.index_select(dim, index)`` /
    ``torch.take_along_dim(x, index, dim)`` with the index checked (integer, in range: ValueError
    naming ``path``; the values only with ``values``). ``take_along_dim`` is written as a ``gather`` of broadcast operands (its
    exported form, GatherElements); ``dim=None`` (flattened) is refused."""
    where = path or f"QGather({kind})"
    if kind not in KINDS:
        raise ValueError(f"{where}: kind {kind!r} is not one of {KINDS}")
    if dim is None:
        raise ValueError(f"{where}: {kind} without dim (on the flattened tensor) is not supported; pass dim")
    nd = x.dim()
    if not -max(nd, 1) <= dim < max(nd, 1):
        raise ValueError(f"{where}: dim {dim} out of range for an input of shape {list(x.shape)}")
    dim = dim % max(nd, 1)
    check_index(path, index, x.shape[dim] if nd else 1, f"{kind} index", negative_ok=kind == "take_along_dim",
                values=values)
    if kind == "index_select":
        if index.dim() > 1:
            raise ValueError(f"{where}: index_select needs a 0-D or 1-D index, got shape {list(index.shape)}")
        return x.index_select(dim, index)
    if kind == "take_along_dim":
        if index.dim() != nd:
            raise ValueError(f"{where}: take_along_dim needs an index of the input's rank {nd}, got shape "
                             f"{list(index.shape)}")
        index = torch.where(index < 0, index + x.shape[dim], index)
        shape = [max(a, b) for a, b in zip(x.shape, index.shape)]
        xs, ix = list(shape), list(shape)
        xs[dim], ix[dim] = x.shape[dim], index.shape[dim]
        x = x.expand(xs) if list(x.shape) != xs else x  # no Expand node where nothing broadcasts
        index = index.expand(ix) if list(index.shape) != ix else index
    if index.dim() != nd:
        raise ValueError(f"{where}: gather needs an index of the input's rank {nd}, got shape {list(index.shape)}")
    return torch.gather(x, dim, index)


class QGather(QATModule):
    """``gather`` / ``index_select`` / ``take_along_dim`` (``kind``) along ``dim`` on the codes of
    the input quantizer (module doc). Called as ``module(x, index)``; an index of a float type
    is a ValueError naming the path, out-of-range values too while calibrating or training."""

    op_class = "gather"
    swappable = False

    def __init__(self, spec=None, name: str = "", kind: str = "gather", dim: int = 0):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"{name or 'QGather'}: kind {kind!r} is not one of {KINDS}")
        self.qat_name, self.kind, self.dim = name, kind, dim
        in_spec, _, _ = role_specs(spec)
        self.input_quant = make_quantizer(in_spec, None, f"{name}.input_quant", force_per_tensor=True)

    @classmethod
    def from_spec(cls, spec=None, name: str = "", **kwargs):
        return cls(spec, name, **kwargs)

    def quantizers(self) -> dict:
        return {"input_quant": self.input_quant} if self.input_quant is not None else {}

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        q = self.input_quant if x.is_floating_point() else None  # integer tensors (positions): as they are
        xq = q(x) if q is not None else x
        values = self.training or (q is not None and q.state == "observe")  # not in eval (export)
        y = gather_call(self.kind, xq, index, self.dim, self.qat_name, values)
        if q is not None and q.state.quantizes and torch.onnx.is_in_onnx_export():
            return q(y)  # the same Q/DQ after the Gather: codes in, codes out (exact, no observer)
        return y

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, dim={self.dim}"


def gather_call_args(target, args: tuple, kwargs: dict, method: bool = False):
    """``(kind, dim, x, index)`` of a call of ``torch.gather(x, dim, index)``,
    ``index_select(x, dim, index)`` or ``take_along_dim(x, index, dim)`` (``target`` a torch
    function, or with ``method`` a Tensor method name), or None: another call, ``take_along_dim``
    without ``dim``, ``sparse_grad`` or ``out``. The values may be fx Nodes."""
    kind = spelling_of(target, method, "gather")  # one of KINDS: the op's functions and methods (dal.ops)
    if kind is None or kwargs.get("sparse_grad") or kwargs.get("out") is not None:
        return None

    def arg(i, name):
        return args[i] if len(args) > i else kwargs.get(name)

    x = args[0] if args else kwargs.get("input")
    if kind == "take_along_dim":
        index, dim = arg(1, "indices"), arg(2, "dim")
    else:
        dim, index = arg(1, "dim"), arg(2, "index")
    return (kind, dim, x, index) if isinstance(dim, int) else None
