"""QLoraLinear: peft's LoRA ``Linear`` trained in its merged, fake-quantized form.

What deploys after LoRA is the merged layer ``W' = W + scaling * B @ A`` (peft's
``merge_and_unload``), quantized once. So the QAT forward is that layer, not peft's two paths::

    y = fq_out(F.linear(fq_in(x), fq_w(W + (B @ A) * scaling), fq_bias(b)))

``(B @ A) * scaling`` is computed as peft's ``get_delta_weight`` computes it and added to ``W`` as
its merge adds it, so the weight the quantizer sees equals, bit for bit, the weight of the
``nn.Linear`` that ``merge_and_unload`` leaves (:func:`merged_qlinear` builds that layer's QLinear
with the same quantizers; :func:`merge_lora` is ``merge_and_unload`` for a prepared model, whose own
``merge_and_unload`` is refused: it would drop the quantizers). Gradients reach ``A``, ``B`` and learnable quantizer parameters; ``W``
and ``b`` train only if the user left them trainable (peft freezes them).

Supported: peft applied first (``get_peft_model``), then ``dal.prepare_qat``, which swaps each
``peft.tuners.lora.layer.Linear`` whole (its ``base_layer``, ``lora_A`` and ``lora_B`` are not
quantized separately). The other order leaves a QLinear inside peft's layer, with the LoRA path in
float beside it; :func:`refuse_lora_around_qat` names such layers. Refused (``ValueError`` naming
the layer): ``lora_dropout > 0`` (dropout on the LoRA path has no merged form; the merged forward
is exact for ``lora_dropout=0`` only), more than one active adapter, LoRA variants (DoRA, ...),
``lora_bias=True`` and ``fan_in_fan_out=True``.

Deploy the merged model: :func:`merge_lora` before ``dal.export_onnx`` (the unmerged layer exports
too, with the ``B @ A`` product in the graph) and before ``dal.convert`` (which refuses it).

This file imports peft; dal imports it only when a model holds a peft LoRA layer
(``dal.nn.registry.registry_type``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn

from .base import QATModule
from .linear import QLinear
from .registry import register_qat_module


@register_qat_module(LoraLinear, op_class="linear")
class QLoraLinear(QATModule, LoraLinear):
    """peft's LoRA Linear whose forward is one fake-quantized linear with the merged weight (module docstring)."""

    weight_channel_axis, weight_reduction_axis = 0, 1

    @classmethod
    def from_float(cls, mod: LoraLinear, spec=None, name: str = "", activation=None) -> "QLoraLinear":
        check_mergeable(mod, name)
        return super().from_float(mod, spec, name, activation)

    def lora_delta(self) -> torch.Tensor | None:
        """``(B @ A) * scaling`` of the active adapter, as peft's ``get_delta_weight``; None when
        the adapters are disabled, merged into ``W`` already, or absent."""
        if self.disable_adapters or self.merged:
            return None
        names = [a for a in self.active_adapters if a in self.lora_A.keys()]
        if not names:
            return None
        check_mergeable(self, self.qat_name)
        a = names[0]
        return (self.lora_B[a].weight @ self.lora_A[a].weight) * self.scaling[a]

    def merged_weight(self) -> torch.Tensor:
        """``W + (B @ A) * scaling``, the float weight ``merge_and_unload`` would leave."""
        base = self.get_base_layer().weight
        delta = self.lora_delta()
        return base if delta is None else base + delta.to(base.dtype)

    def forward(self, x, *args, **kwargs):
        if args or kwargs:
            raise TypeError(f"{self.qat_name or 'QLoraLinear'}: peft's extra forward arguments "
                            f"({len(args)} positional, keywords {sorted(kwargs)}) have no merged form")
        if self.input_quant is not None:
            x = self.input_quant(x)
        bias = self.get_base_layer().bias
        return self.finish(F.linear(x, self.quantized_weight(self.merged_weight()), self.quantized_bias(bias)))

    def merge(self, *args, **kwargs):
        """Refused: peft's in-place merge (``merge_and_unload``, ``merge_adapter``) would leave a float
        ``nn.Linear`` without this layer's quantizers; :func:`merge_lora` keeps them."""
        raise RuntimeError(f"{self.qat_name or 'QLoraLinear'}: peft's merge would drop dal's quantizers; merge with "
                           "dal.nn.lora.merge_lora(model), which gives each LoRA layer's QLinear with the same quantizers")

    def extra_repr(self):
        return self.qat_extra_repr()


def check_mergeable(mod: LoraLinear, name: str = "") -> None:
    """Raise ``ValueError`` naming ``name`` unless ``mod``'s LoRA has a merged form: one active
    adapter, no dropout on the LoRA path, no variant (DoRA...), no LoRA bias, no fan_in_fan_out."""
    where = name or type(mod).__name__
    active = [a for a in mod.active_adapters if a in mod.lora_A.keys()]
    problems = []
    if len(active) > 1:
        problems.append(f"{len(active)} active adapters {active} (activate one: model.set_adapter(name))")
    for a in active:
        drop = mod.lora_dropout[a]
        if not isinstance(drop, nn.Identity) and getattr(drop, "p", 0.0) > 0:
            problems.append(f"lora_dropout={drop.p} on adapter {a!r} (dropout on the LoRA path has no merged form: "
                            "LoraConfig(lora_dropout=0.0))")
        if a in getattr(mod, "lora_variant", {}):
            problems.append(f"adapter {a!r} is a LoRA variant ({type(mod.lora_variant[a]).__name__}, e.g. DoRA): "
                            "only plain LoRA merges into W + scaling * B @ A")
        if getattr(mod, "lora_bias", {}).get(a, False):
            problems.append(f"adapter {a!r} has lora_bias=True (LoraConfig(lora_bias=False))")
    if getattr(mod, "fan_in_fan_out", False):
        problems.append("fan_in_fan_out=True (a Conv1D base layer; only nn.Linear bases are supported)")
    if not isinstance(mod.get_base_layer(), nn.Linear) or isinstance(mod.get_base_layer(), QATModule):
        base = type(mod.get_base_layer()).__name__
        problems.append(f"its base layer is a {base}, not a float nn.Linear (apply peft before dal.prepare_qat)")
    if problems:
        raise ValueError(f"{where}: this LoRA layer cannot be trained in merged QAT form: " + "; ".join(problems))


def merged_qlinear(mod: QLoraLinear) -> QLinear:
    """The QLinear that deploys: an ``nn.Linear`` holding ``merged_weight()`` (detached, a new
    Parameter) and the base bias, with ``mod``'s quantizer objects and QAT attributes. Its
    ``quantized_weight(weight)`` equals ``mod.quantized_weight(mod.merged_weight())`` bit for bit."""
    base = mod.get_base_layer()
    lin = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None,
                    device=base.weight.device, dtype=base.weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(mod.merged_weight())
        if base.bias is not None:
            lin.bias.copy_(base.bias)
    q = QLinear.from_float(lin, None, mod.qat_name)
    q.input_quant, q.weight_quant, q.output_quant = mod.input_quant, mod.weight_quant, mod.output_quant
    q.activation, q.bias_mode = mod.activation, mod.bias_mode
    return q


def refuse_lora_around_qat(model: nn.Module) -> None:
    """Raise ``ValueError`` listing every peft LoRA layer of ``model`` whose base layer is already
    a dal QAT module (peft applied after ``dal.prepare_qat``): there the LoRA path runs in float
    beside the quantized base, so what trains is not the merged layer that deploys."""
    bad = [n for n, m in model.named_modules()
           if isinstance(m, LoraLinear) and not isinstance(m, QATModule) and isinstance(m.get_base_layer(), QATModule)]
    if bad:
        more = f" (and {len(bad) - 4} more)" if len(bad) > 4 else ""
        raise ValueError(f"peft's LoRA was applied after dal.prepare_qat: {', '.join(bad[:4])}{more} wrap a QAT layer "
                         "and add a float LoRA path beside it. Apply peft first (get_peft_model(float_model, config)), "
                         "then dal.prepare_qat(peft_model, ...): each LoRA Linear then trains as one fake-quantized "
                         "linear with the merged weight W + scaling * B @ A")


def merge_lora(model: nn.Module) -> nn.Module:
    """peft's ``merge_and_unload`` for a prepared model: every :class:`QLoraLinear` becomes its
    :func:`merged_qlinear` (in place, every slot it holds), and a peft wrapper is unwrapped
    (``get_base_model()``). In eval with quantizers frozen, the merged model computes the same
    outputs as the LoRA model bit for bit; it holds no peft layer, so it exports like any model."""
    from .tree import replace_everywhere, slots_of

    slots = slots_of(model)
    for mod in [m for m in model.modules() if isinstance(m, QLoraLinear)]:
        replace_everywhere(slots, mod, merged_qlinear(mod))
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model
