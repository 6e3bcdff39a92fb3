"""Exceptions of the NPU reference. All are ValueError subclasses so callers can catch one type."""
from __future__ import annotations


class NPUError(ValueError):
    """A model the reference cannot run as given (bad file, bad attribute, bad shape...)."""


class UnsupportedNode(NPUError):
    """A node whose op type / element types the reference does not implement.

    The message names the node, its op type and the element types of its inputs.
    """

    def __init__(self, node, in_types=(), why: str = ""):
        name = getattr(node, "name", "") or "<unnamed>"
        op = getattr(node, "op_type", "?")
        domain = getattr(node, "domain", "") or "ai.onnx"
        msg = f"node {name!r} ({domain}::{op}) with input types {list(in_types)} is not supported"
        super().__init__(msg + (f": {why}" if why else ""))
        self.node_name, self.op_type, self.input_types = name, op, list(in_types)
