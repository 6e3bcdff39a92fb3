"""The registry and the hardware vocabulary agree: every op's class is one a hardware model or a
recipe may name (or ``custom``), every name a bundled hardware model lists in ``fp16_ops`` /
``lut_ops`` is an op of dal.ops, and the module types and QAT modules the ops name are the
torch.nn / dal.nn classes they say (read from the YAML files and from torch, not from dal's
derived tables)."""
import importlib

import pytest
import yaml
from torch import nn

from dal.config.bundled import bundled_dirs
from dal.hardware.load import FOLDER
from dal.hardware.op_classes import ALL_OP_CLASSES, OP_CLASSES
from dal.nn import QATModule
from dal.ops import all_ops, registry

_YAMLS = sorted(p for d in bundled_dirs(FOLDER) for p in d.glob("*.yaml"))


def _family_ops():
    """dal's own ops (the family files), not ops other tests register."""
    return tuple(op for family in registry.FAMILIES for op in importlib.import_module(f"dal.ops.{family}").OPS)


def test_every_op_class_is_a_hardware_op_class_or_custom():
    wrong = {op.name: op.op_class for op in all_ops() if op.op_class not in ALL_OP_CLASSES + ("custom",)}
    assert not wrong, f"ops whose op_class no hardware model or recipe can name: {wrong}"


def test_the_bundled_hardware_models_are_read():
    assert {p.stem for p in _YAMLS} >= {"a1000", "a2000", "generic_int8", "pow2_int8"}


@pytest.mark.parametrize("path", _YAMLS, ids=lambda p: p.stem)
def test_fp16_and_lut_names_of_a_hardware_model_are_ops(path):
    """A name in ``fp16_ops`` / ``lut_ops`` that is no op class is an activation function: the
    ``function`` of an op of class ``activation``; an op-class name (``softmax``,
    ``layernorm``) has a float op of that class."""
    raw = yaml.safe_load(path.read_text())
    functions = {op.function for op in all_ops() if op.op_class == "activation" and op.function}
    float_classes = {op.op_class for op in all_ops() if op.handling == "float"}
    missing = []
    for key in ("fp16_ops", "lut_ops"):
        for name in raw.get(key) or ():
            declared = name in float_classes if name in OP_CLASSES and key == "fp16_ops" else name in functions
            if not declared:
                missing.append(f"{key}: {name}")
    assert not missing, f"{path.name} names what no op of dal.ops declares: {missing}"


def test_module_types_are_torch_nn_classes_and_qat_modules_derive_from_them():
    """Each op's float module types are torch.nn's own (by name in torch.nn); each QAT module an
    op names is a dal.nn QATModule subclass of the float type it replaces, or of the
    normalisation it stands for (dal.nn.norm's FP16 norms, QBatchNorm2d)."""
    for op in _family_ops():
        for t in op.modules:
            assert issubclass(t, nn.Module) and getattr(nn, t.__name__, None) is t, (op.name, t)
        if op.qat_module is None or not op.modules:
            continue
        cls = op.resolve("qat_module")
        assert issubclass(cls, QATModule), (op.name, cls)
        assert any(issubclass(cls, t) for t in op.modules), f"{op.name}: {cls.__name__} is no {op.modules}"


@pytest.mark.parametrize("module_type", [t for op in _family_ops() if op.op_class == "activation" for t in op.modules],
                         ids=lambda t: t.__name__)
def test_an_activation_module_computes_the_function_its_op_names(module_type):
    """The function hardware models call an activation type (``CELU`` -> ``elu``) is what the
    module computes: torch's functional of that name, on [-6, 6] (default arguments)."""
    import torch
    import torch.nn.functional as F

    (op,) = [op for op in _family_ops() if module_type in op.modules]
    fn = op.function or op.name
    mod = module_type()
    x = torch.linspace(-6, 6, 241, dtype=torch.float64)
    want = F.prelu(x, mod.weight.double()) if fn == "prelu" else getattr(F, fn)(x)
    torch.testing.assert_close(mod.double()(x), want, rtol=0, atol=0)
