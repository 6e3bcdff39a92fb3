"""The classes of operator a hardware model and a recipe talk about.

An op class groups the operators a chip runs the same way: ``conv`` covers Conv1d/2d/3d,
``pool`` covers max and average pooling, ``activation`` covers element-wise non-linear
functions. Each op class has *roles*, the tensors that can carry a format:

- ``weight``: a parameter tensor (conv, conv_transpose, linear, embedding);
- ``input``: the activation inputs (everything except embedding, whose input is indices);
- ``output``: the result.

``kv_cache`` is the keys (after the rotary embedding) and values of an attention as they enter
its KV cache, where the matrix engine reads them for ``Q @ K^T`` and ``P @ V``; its one role,
``input``, is the format they are stored in (``dal.nn.kv_cache``). A hardware model that does not
list it under ``ops:`` stores no quantized cache: a recipe rule ``type: kv_cache`` is refused there.
"""
from __future__ import annotations

import functools

ROLES = ("weight", "input", "output")

#: op class -> roles it has, in the order the hardware schema lists them.
OP_CLASS_ROLES: dict[str, tuple[str, ...]] = {
    "conv": ("weight", "input", "output"),
    "conv_transpose": ("weight", "input", "output"),
    "linear": ("weight", "input", "output"),
    "matmul": ("input", "output"),
    "embedding": ("weight", "output"),
    "add": ("input", "output"),
    "mul": ("input", "output"),
    "cat": ("input", "output"),
    "pool": ("input", "output"),
    "activation": ("input", "output"),
    "softmax": ("input", "output"),
    "layernorm": ("input", "output"),
    "resize": ("input", "output"),
    "kv_cache": ("input",),
}
#: The op classes a hardware model describes (its NPU's operators; the bundled a1000, a2000 and
#: generic_int8 describe all, pow2_int8 all but kv_cache).
OP_CLASSES: tuple[str, ...] = tuple(OP_CLASS_ROLES)

#: Op classes of operators a typical NPU has no engine for: ``nonzero`` (an output whose shape
#: depends on the values: nonzero, argwhere, masked_select, unique), ``compare`` (compares of
#: integer or bool tensors: a mask built from positions), ``gather`` (elements picked by a tensor
#: of indices: GatherElements), ``scan`` (running sums and products: CumSum), ``sort`` (sort,
#: argsort, topk: TopK), ``conv3d``
#: (3-D convolution), ``grid_sample`` (``F.grid_sample``: the input's formats; its grid is int16
#: with a fixed scale, export/SPEC.md §5b), ``scatter_add`` (BEV pooling: ``index_put_`` with
#: accumulate, ``scatter_add``, ``index_add``, summed in int32 on the codes and requantized,
#: §5c); ``gather`` quantized is ``torch.gather`` / ``index_select`` / ``take_along_dim`` on codes
#: with the input's scale (§5d). A hardware model runs one only if it lists it under
#: ``ops:``; otherwise prepare lists each with its source line as "host" (run on the host CPU), and
#: ``strict=True`` refuses them (a recipe rule that quantizes a ``grid_sample`` there is refused by
#: path: dal.prepare.check).
HOST_OP_CLASS_ROLES: dict[str, tuple[str, ...]] = {
    "nonzero": ("input", "output"),
    "compare": ("input", "output"),
    "gather": ("input", "output"),
    "scan": ("input", "output"),
    "sort": ("input", "output"),
    "conv3d": ("weight", "input", "output"),
    "grid_sample": ("input", "output"),
    "deformable_attention": ("input", "output"),  # its sampling arithmetic and weighted sum (SPEC §5g)
    "scatter_add": ("input", "output"),
}
HOST_OP_CLASSES: tuple[str, ...] = tuple(HOST_OP_CLASS_ROLES)

#: Op classes whose multiplication may skip N:M sparse zeros: those with weights, and matmul
#: (one of its operands). Sparsity asked for any other op class is meaningless and dropped.
SPARSIFIABLE: tuple[str, ...] = tuple(c for c, r in OP_CLASS_ROLES.items() if "weight" in r) + ("matmul",)

OP_CLASS_ROLES.update(HOST_OP_CLASS_ROLES)  # a hardware model may list them under ops:
#: every op class a hardware model or a recipe may name
ALL_OP_CLASSES: tuple[str, ...] = tuple(OP_CLASS_ROLES)

RESIZE_MODES: tuple[str, ...] = ("nearest", "linear", "bilinear", "bicubic", "trilinear")


#: the names derived from dal's op registry (:mod:`dal.ops`) on first use; see :func:`__getattr__`
_DERIVED = ("ACTIVATION_FUNCTIONS", "ACTIVATION_OF_TYPE", "MODULE_OP_CLASSES")


@functools.cache
def dal_ops() -> tuple:
    """The ops dal's own family files declare (:data:`dal.ops.registry.FAMILIES`), in order: the
    vocabulary below is theirs, not a user's later ``dal.ops.register``, so that a recipe's
    ``type:`` and a hardware model's names mean the same in every process."""
    import importlib

    from dal.ops.registry import FAMILIES

    return tuple(op for family in FAMILIES for op in importlib.import_module(f"dal.ops.{family}").OPS)


@functools.cache
def activation_functions() -> tuple[str, ...]:
    """Element-wise non-linear functions a vector engine may run in fp16 or through a table, as
    hardware models name them in ``fp16_ops`` / ``lut_ops``: the ``function`` of every op of
    op class ``activation`` that sets one (relu, silu, ..., exp, log, sqrt, rsqrt, reciprocal;
    not hardtanh)."""
    return tuple(dict.fromkeys(op.function for op in dal_ops() if op.op_class == "activation" and op.function))


@functools.cache
def activation_of_type() -> dict[str, str]:
    """torch.nn activation class name -> the function it computes, as hardware models spell it
    in ``fp16_ops`` / ``lut_ops`` (``"CELU": "elu"``, ``"Hardtanh": "hardtanh"``): every module
    type of an op of op class ``activation``, mapped to the op's ``function`` (else its name)."""
    return {t.__name__: op.function or op.name for op in dal_ops() if op.op_class == "activation"
            for t in op.modules}


@functools.cache
def module_op_classes() -> dict[str, str]:
    """torch.nn class name -> op class: the default mapping for recipe rules written with
    ``type: Conv2d``; every module type of an op whose op class is not ``custom``. A recipe
    names the 3-D convolutions (which prepare runs on the host: op class ``conv3d``) ``conv`` /
    ``conv_transpose`` like the others. The prepare step may know more types (its own QAT
    modules, functions)."""
    out = {}
    for op in dal_ops():
        for t in op.modules:
            if op.op_class == "conv3d":
                out[t.__name__] = "conv_transpose" if "Transpose" in t.__name__ else "conv"
            elif op.op_class != "custom":
                out[t.__name__] = op.op_class
    return out


def __getattr__(name: str):
    """``ACTIVATION_FUNCTIONS``, ``ACTIVATION_OF_TYPE``, ``MODULE_OP_CLASSES``: the values of
    :func:`activation_functions`, :func:`activation_of_type`, :func:`module_op_classes`,
    derived from :mod:`dal.ops` when first read (loading the hardware vocabulary imports no op
    family)."""
    if name in _DERIVED:
        return {"ACTIVATION_FUNCTIONS": activation_functions, "ACTIVATION_OF_TYPE": activation_of_type,
                "MODULE_OP_CLASSES": module_op_classes}[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def op_class_of_type(type_name: str) -> str | None:
    """The op class of a torch.nn class name, or None when it is not known.

    A leading ``Q`` of a QAT module (``QConv2d``) is ignored, and fused names such as
    ``ConvBn2d`` / ``QConvBnReLU2d`` map to ``conv``.

    >>> op_class_of_type("Conv2d"), op_class_of_type("QLinear"), op_class_of_type("Foo")
    ('conv', 'linear', None)
    """
    classes = module_op_classes()
    if type_name in classes:
        return classes[type_name]
    if type_name.startswith("Q") and type_name[1:] in classes:
        return classes[type_name[1:]]
    bare = type_name[1:] if type_name.startswith("Q") else type_name
    if bare.startswith("ConvBn") or bare.startswith("ConvReLU"):
        return "conv"
    if bare.startswith("LinearReLU") or bare.startswith("LinearBn"):
        return "linear"
    return None


def check_op_class(op_class: str) -> str:
    """Return ``op_class`` or raise ValueError listing the known op classes."""
    if op_class not in OP_CLASS_ROLES:
        from dal.config.fields import did_you_mean

        raise ValueError(f"op_class={op_class!r} is not a known op class{did_you_mean(op_class, ALL_OP_CLASSES)} "
                         f"(known: {', '.join(ALL_OP_CLASSES)})")
    return op_class
