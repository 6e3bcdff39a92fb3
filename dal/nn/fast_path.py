"""No fused path past the quantizers: torch's TransformerEncoderLayer fast path.

In eval, a stock ``nn.TransformerEncoderLayer`` may run ``torch._transformer_encoder_layer_fwd``,
which reads its Linear and LayerNorm parameters directly and never calls the modules dal swapped
in: their quantizers see nothing (calibration turns them off) and the result is not the QAT
model's. torch takes that path only when no submodule of the layer has a forward hook or pre-hook,
so each such layer that holds a QAT module gets a pre-hook that does nothing
(:func:`stay_on_module_path`). ``nn.TransformerEncoder`` turns a padded batch into a nested tensor
for that path; its ``use_nested_tensor`` is set False. Both are per module, never the process-wide
``torch.backends.mha.set_fastpath_enabled``.
"""
from __future__ import annotations

from torch import nn

#: the torch classes with a fused eval path that reads their submodules' parameters directly
FUSED_LAYERS = (nn.TransformerEncoderLayer,)


def module_path_only(module: nn.Module, args) -> None:
    """The pre-hook: changes nothing; its presence turns torch's fused path off (module doc)."""
    return None


def stay_on_module_path(model: nn.Module) -> list[str]:
    """Give every fused-path layer of ``model`` that holds a QAT module the no-op pre-hook (once),
    and every ``nn.TransformerEncoder`` above one ``use_nested_tensor = False``. Returns the
    paths of the layers hooked now."""
    from .base import QATModule

    hooked = []
    for path, mod in model.named_modules():
        if isinstance(mod, nn.TransformerEncoder) and any(isinstance(m, QATModule) for m in mod.modules()):
            mod.use_nested_tensor = False
        if not isinstance(mod, FUSED_LAYERS) or not any(isinstance(m, QATModule) for m in mod.modules()):
            continue
        if module_path_only not in mod._forward_pre_hooks.values():
            mod.register_forward_pre_hook(module_path_only)
            hooked.append(path)
    return hooked
