"""Concatenation and the reshape-likes: ops that move codes without changing them."""
from __future__ import annotations

import torch

from .op import Op

CAT = Op(
    name="cat",
    op_class="cat",
    handling="functional",
    functions=(torch.cat, torch.concat, torch.concatenate),
    methods=(),
    qat_module="dal.nn.functional:QCat",
    onnx=("Concat",),
    spec="§5a",
    integer_form=None,
    cost="vector",
    fp16_region=("compute",),
)

OPS: tuple[Op, ...] = (CAT,)
