"""Float patterns dal.convert reads that no dal.ops entry holds yet (issue 41: to move into the
family files), declared as :class:`~dal.ops.Op` values that are NOT registered.

Each would change prepare if it were registered: prepare lists every call of a ``float`` op and
refuses the ones a hardware model cannot run (``x - y``; ``Tensor.cos`` in a rotary embedding),
and it would quantize ``torch.multiply(a, b)`` as a ``mul``. Whether and how prepare lists them
is prepare's decision; until it is made, dal.convert reads them from here, merged by name with the
registry's ops (op_forms.py): an entry named like a registered op adds its patterns to that op
(an alias: ``torch.multiply`` of ``mul``), another is an op of its own. Once dal.ops holds a
pattern, its line here is redundant and is deleted.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import Op


def pending_ops() -> tuple[Op, ...]:
    """The unregistered ops and aliases (module doc), made on each call (no work at import)."""
    return (
        Op(name="mul", op_class="mul", handling="functional",
           functions=(torch.multiply,), methods=("multiply",)),
        Op(name="dropout", op_class="custom", handling="passthrough",
           functions=(F.dropout1d, F.dropout2d)),
        Op(name="sub", op_class="add", handling="float",
           functions=(torch.sub, torch.subtract), methods=("sub", "subtract", "__sub__", "__rsub__", "sub_", "__isub__")),
        Op(name="sum", op_class="pool", handling="float",
           functions=(torch.sum,), methods=("sum",), integer_form="dal.convert.float_ops:sum_f64"),
        Op(name="sin", op_class="activation", handling="float",
           functions=(torch.sin,), methods=("sin",), integer_form="dal.convert.float_ops:sin_f64"),
        Op(name="cos", op_class="activation", handling="float",
           functions=(torch.cos,), methods=("cos",), integer_form="dal.convert.float_ops:cos_f64"),
        Op(name="scaled_dot_product_attention", op_class="matmul", handling="float",
           functions=(F.scaled_dot_product_attention,), integer_form="dal.convert.float_ops:sdpa_form"),
    )
