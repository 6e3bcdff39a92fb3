"""dal.ops: the op registry (one file per op family; see :mod:`dal.ops.registry`).

    import dal
    dal.ops.get("add").qat_module          # "dal.nn.functional:QAdd"

    @dal.ops.register(ClampScale, op_class="activation", onnx=("Clip", "Mul"), cost="vector")
    class QClampScale(dal.nn.QATModule, ClampScale): ...
"""
from .op import COST_CLASSES, HANDLINGS, Op, resolve_ref
from .registry import (all_ops, by_call, by_function, by_method, by_module, functions_of, get, methods_of, modules_of,
                       register, select, unregister, version)

__all__ = ["COST_CLASSES", "HANDLINGS", "Op", "all_ops", "by_call", "by_function", "by_method", "by_module", "functions_of",
           "get", "methods_of", "modules_of", "register", "resolve_ref", "select", "unregister", "version"]
