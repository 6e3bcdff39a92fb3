"""The peers of bench/lowbit.py, run on the same float model and the same images: torch.ao
eager PTQ / QAT and Brevitas PTQ (min-max + bias correction, GPTQ + bias correction).

torch.ao needs QuantStub / DeQuantStub around the model and a list of Conv+BN+ReLU to fuse:
``ao_wrap(model)`` gives both for dal_examples.zoo.MnistCNN and dal_examples.zoo.MobileNetTiny (same layers, same
weights). Brevitas 0.13.4 installs here only with ``pip install --no-deps brevitas
dependencies==2.0.1 unfoldNd`` (its own requirements would downgrade setuptools; torch is left
alone); its learned-round (AdaRound) PTQ lives in brevitas_examples and needs ``accelerate``,
which is not installed, so GPTQ (brevitas.graph.gptq) is its rounding-optimising row.
aimet-torch 2.42 ships one py310-none-any wheel, which pip accepts on Python 3.11, but it
needs ~35 more packages (bokeh, cvxpy, holoviews, panel, pandas, tensorboard, ...); with
``--no-deps`` its import stops at bokeh. Not installed, not run.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from dal_examples.zoo import MnistCNN, MobileNetTiny


class AoNet(nn.Module):
    """MnistCNN with the stubs torch.ao's eager mode needs (same layers, same weights)."""

    def __init__(self, m: MnistCNN):
        super().__init__()
        from torch.ao.nn.quantized import FloatFunctional
        from torch.ao.quantization import DeQuantStub, QuantStub

        self.quant, self.dequant, self.skip = QuantStub(), DeQuantStub(), FloatFunctional()
        self.stem, self.down, self.conv, self.bn, self.relu = m.stem, m.down, m.conv, m.bn, m.relu
        self.down2, self.pool, self.head = m.down2, m.pool, m.head

    def forward(self, x):
        x = self.down(self.stem(self.quant(x)))
        x = self.relu(self.skip.add(x, self.bn(self.conv(x))))
        return self.dequant(self.head(self.pool(self.down2(x)).flatten(1)))


class AoStubs(nn.Module):
    """Any model whose forward has no functional op torch.ao eager cannot see: quant, model, dequant."""

    def __init__(self, body: nn.Module):
        super().__init__()
        from torch.ao.quantization import DeQuantStub, QuantStub

        self.quant, self.body, self.dequant = QuantStub(), body, DeQuantStub()

    def forward(self, x):
        return self.dequant(self.body(self.quant(x)))


def ao_wrap(fm: nn.Module) -> tuple[nn.Module, list]:
    """(torch.ao-ready copy of ``fm``, the Conv+BN(+ReLU) groups to fuse)."""
    fm = copy.deepcopy(fm)
    if isinstance(fm, MnistCNN):
        return AoNet(fm), [["stem.0", "stem.1", "stem.2"], ["down.0", "down.1", "down.2"], ["conv", "bn"],
                           ["down2.0", "down2.1", "down2.2"]]
    if isinstance(fm, MobileNetTiny):
        fuse = [["body.stem.0", "body.stem.1", "body.stem.2"]]
        for i in range(len(fm.blocks)):
            fuse += [[f"body.blocks.{i}.{j}" for j in (0, 1, 2)], [f"body.blocks.{i}.{j}" for j in (3, 4, 5)]]
        return AoStubs(fm), fuse
    raise TypeError(f"ao_wrap: no torch.ao wrapper for {type(fm).__name__}")


def ao_qconfig(bits: int, per_channel: bool = True):
    """torch.ao fake-quant qconfig: symmetric ``bits``-bit weights (per channel or per tensor),
    8-bit affine activations."""
    from torch.ao.quantization import FakeQuantize, MovingAverageMinMaxObserver, QConfig
    from torch.ao.quantization import MovingAveragePerChannelMinMaxObserver as PerChannel

    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if per_channel:
        w = FakeQuantize.with_args(observer=PerChannel, quant_min=lo, quant_max=hi, dtype=torch.qint8,
                                   qscheme=torch.per_channel_symmetric, ch_axis=0)
    else:
        w = FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, quant_min=lo, quant_max=hi,
                                   dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    a = FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255, dtype=torch.quint8,
                               qscheme=torch.per_tensor_affine, reduce_range=False)
    return QConfig(activation=a, weight=w)


def ao_ptq_int8(fm, calib):
    """torch.ao eager PTQ: fuse, observe, convert to the real int8 model (qnnpack engine)."""
    torch.backends.quantized.engine = "qnnpack"
    net, fuse = ao_wrap(fm)
    net.eval()
    torch.ao.quantization.fuse_modules(net, fuse, inplace=True)
    net.qconfig = torch.ao.quantization.get_default_qconfig("qnnpack")
    torch.ao.quantization.prepare(net, inplace=True)
    with torch.no_grad():
        for x, _ in calib:
            net(x)
    return torch.ao.quantization.convert(net)


def ao_fake(fm, calib, bits: int, per_channel: bool = True, train=None):
    """torch.ao eager fake-quant model: observers see ``calib`` (fake quant off), then frozen
    unless ``train(net)`` (the QAT steps) is given, which runs with fake quant and observers on."""
    net, fuse = ao_wrap(fm)
    net.train()
    torch.ao.quantization.fuse_modules_qat(net, fuse, inplace=True)
    net.qconfig = ao_qconfig(bits, per_channel)
    torch.ao.quantization.prepare_qat(net, inplace=True)
    net.apply(torch.ao.quantization.disable_fake_quant)
    net.eval()
    with torch.no_grad():
        for x, _ in calib:
            net(x)
    net.apply(torch.ao.quantization.enable_fake_quant)
    if train is not None:
        train(net)
    net.apply(torch.ao.quantization.disable_observer)
    return net.eval()


def brevitas_ptq(fm, calib, gptq: bool, per_channel: bool = False, first_last_bits: int = 4):
    """Brevitas W4A8 PTQ of ``fm``: trace + BN merge (``preprocess_for_quantize``), INT4
    symmetric weights from their max (``weight_param_method='stats'``), INT8 asymmetric
    activations (percentile 99.999, as its examples), the first and last layer at
    ``first_last_bits``; calibration, optionally GPTQ, then bias correction. Returns the
    model, or raises ImportError when brevitas is not installed."""
    import warnings

    from brevitas.graph.quantize import preprocess_for_quantize
    from brevitas_examples.imagenet_classification.ptq.ptq_common import (apply_bias_correction, apply_gptq,
                                                                          calibrate, quantize_model)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = quantize_model(preprocess_for_quantize(copy.deepcopy(fm).eval()), backend="fx", weight_bit_width=4,
                           act_bit_width=8, bias_bit_width=32,
                           weight_quant_granularity="per_channel" if per_channel else "per_tensor",
                           act_quant_percentile=99.999, act_quant_type="asym", scale_factor_type="float_scale",
                           quant_format="int", layerwise_first_last_bit_width=first_last_bits)
        calibrate(calib, m)
        with torch.no_grad():
            m(calib[0][0])  # GPTQ refuses weight quantizers that have not run once after calibration
        if gptq:
            apply_gptq(calib, m)
        apply_bias_correction(calib, m)
    return m.eval()
