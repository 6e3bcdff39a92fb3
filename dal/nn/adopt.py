"""Swap a module's class without copying its parameters (from_float / to_float)."""
from __future__ import annotations

from torch import nn

# Attributes a QAT module adds on top of its float module; to_float drops them. ``float_cls``:
# the float class adopt made the module from (float_class_of reads it).
QAT_ATTRS = ("qat_name", "activation", "bias_mode", "float_cls", "bn_frozen_flag")
QAT_SUBMODULES = ("input_quant", "weight_quant", "output_quant", "input_quants", "bn")
# Buffers a QAT module adds: the 2:4 mask, a conv-BN's frozen flag; to_float drops them.
QAT_BUFFERS = ("weight_mask", "bn_frozen")


def adopt(cls, mod: nn.Module):
    """A new instance of ``cls`` holding ``mod``'s attributes, Parameter and buffer objects
    (the same objects: an optimizer built on the float model keeps working), and ``mod``'s class
    as its ``float_cls`` attribute."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    state = {k: v for k, v in mod.__dict__.items() if k != "training"}
    for key in ("_parameters", "_buffers", "_modules"):
        state[key] = dict(state[key])
    new.__dict__.update(state)
    new.training = mod.training
    new.float_cls = type(mod)
    return new


def float_class_of(mod: nn.Module):
    """The float class :func:`adopt` made ``mod`` from (a QAT module's or an FP16 island's float
    module class), or None for a module adopt did not make."""
    return mod.__dict__.get("float_cls")


def release(mod: nn.Module, float_cls=None, drop: tuple = ()) -> nn.Module:
    """The float module of a QAT module: the same Parameter objects; quantizers, the QAT attributes
    (``QAT_ATTRS``), submodules (``QAT_SUBMODULES``) and buffers (``QAT_BUFFERS``) removed, and
    so is every attribute, submodule, parameter or buffer named in ``drop`` (what a QAT class adds
    beyond those). ``float_cls`` defaults to :func:`float_class_of`."""
    cls = float_cls or float_class_of(mod)
    if cls is None:
        raise ValueError(f"{type(mod).__name__} does not know its float class; it was not built with from_float")
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    state = {k: v for k, v in mod.__dict__.items() if k not in QAT_ATTRS + tuple(drop) and k != "training"}
    for key in ("_parameters", "_buffers", "_modules"):
        state[key] = {k: v for k, v in state[key].items() if k not in QAT_SUBMODULES + QAT_BUFFERS + tuple(drop)}
    new.__dict__.update(state)
    new.training = mod.training
    return new
