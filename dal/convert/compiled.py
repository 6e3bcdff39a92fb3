"""Blocks of the integer model captured as graphs: ``torch.compile`` with an eager backend, so Python runs
once per block call instead of once per op, module, form and quantizer (issue 43's decode step).

    int_model = dal.convert(model)
    int_model(*inputs)                                     # the first forward plans the groups (probe)
    compile_blocks(int_model, "step.lm.model.layers")      # or an iterable of submodules of int_model.net
    int_model(*inputs)                                     # each block: one captured graph, the same bits

Contract:

* **The same bits.** The backend (:func:`eager_direct_host_calls`) is torch's ``eager`` one: it calls the
  torch ops dynamo recorded, in their order, without fusing or reordering any arithmetic (no inductor), except
  that a host operator's node calls its CPU implementation directly (host_ops.py ``direct_calls``: the
  function the dispatcher would reach, less its round trip through Python). NPUFloatOps (float_ops.py) is
  entered *inside* the captured function, so its choice of form for each call is traced into the graph and the
  graph then runs without per-call dispatch; the calls that leave torch in the eager model are operators of
  their own with the same calls inside (host_ops.py: dal.formats' C++ fake quantization and cast round trip,
  numpy's ``exp``, a float island's numpy float64 matmul such as ``lm_head``'s; the blocked linear is
  dal/kernels' ``dal::quantized_blocked_linear`` op, its input codes made inside, where the eager layer makes
  them in the kernel call, else ``dal::blocked_linear`` on the same codes).
  tests/convert/test_compiled_blocks.py compares every output, logits and KV codes, with the eager integer
  model and dal.npu over decode steps.
* **A frozen model.** The only guards kept are those on the tensors a block is called with (shape, dtype,
  strides, device: :func:`argument_tensor_guards`); every other guard dynamo writes (~1,700 per Llama layer:
  module attributes, globals, closures) is dropped, which is most of a captured call's cost. So the graph
  keeps what was true when it was captured: module states, formats, which plan a layer takes, process-wide
  switches (dal.formats' kernel switches), NPUFloatOps' table, and the output of each weight quantizer (an
  embedding table's, a norm weight's: the one its eager call kept, quant_calls.py); other module tensors are
  read at each call (an in-place change of an activation quantizer's scale is seen), a new tensor object
  assigned to a module is not. Change the model after ``compile_blocks`` and the outputs are wrong: convert
  again. Arguments of another shape or dtype capture a new graph.
* **A whole decoder step.** ``compile_blocks(int_model, "step")`` captures the DecoderStep (embedding,
  layers, final norm, ``lm_head``) as one graph, ``compile_blocks(int_model, "")`` the whole net (a
  decoder file's codes boundary too: codes_boundary.py reads its kept constants without the data
  pointer check while captured); a DecoderStep's KV quantizers' output hooks are registered once
  (``DecoderStep.keep_kv_hooks``, on the integer model's own copy) instead of on every call.
* **When a block runs eagerly.** Outside an integer-model forward (the probe, a direct call),
  inside ``run_with_codes`` (its taps are Python hooks), and where the model has fixed-point fan-out
  groups (their per-reader values are Python state of the forward): ``compile_blocks`` refuses such a
  model. NaN reaching a blocked linear is refused by its ``dal::quantized_blocked_linear`` or
  ``dal::blocked_linear`` op (a ValueError
  naming the element) instead of the layer's ConvertError; NaN model inputs are refused before any block.
* The integer model's torch-function mode must be the innermost one when a block is called (no other
  ``TorchFunctionMode`` entered inside the model's forward): the block leaves it for its call.
"""
from __future__ import annotations

import types
from typing import Callable, Iterable, Union

import torch
from torch import nn

from .errors import ConvertError
from .float_ops import NPUFloatOps
from .host_ops import available, direct_calls, register


def argument_tensor_guards(entries) -> list:
    """``torch.compile``'s ``guard_filter_fn``: keep the TENSOR_MATCH guards of the captured function's
    arguments (``args[...]``, ``kwargs[...]``: tensors a block is called with, nested in its arguments
    too), drop every other guard (module doc). Where no guard names an argument that way (another torch
    spelling), the guards on modules are the ones dropped (``skip_guard_on_all_nn_modules_unsafe``)."""
    keep = [e.guard_type == "TENSOR_MATCH" and e.name.split("[")[0].split(".")[0] in ("args", "kwargs")
            for e in entries]
    return keep if any(keep) else torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)


def _captured_forward(mode: NPUFloatOps, block: nn.Module, tag: int):
    """``torch.compile`` of ``block``'s class forward run under ``mode`` (module doc), with a code object
    of its own: dynamo caches graphs per code object, and with module guards skipped two blocks sharing
    one would share one graph."""
    forward = type(block).forward

    def run(*args, **kwargs):
        with mode:
            return forward(block, *args, **kwargs)
    run = types.FunctionType(run.__code__.replace(co_name=f"integer_block_{tag}"), run.__globals__, run.__name__,
                             run.__defaults__, run.__closure__)
    return torch.compile(run, backend=eager_direct_host_calls,
                         options={"guard_filter_fn": argument_tensor_guards})


def eager_direct_host_calls(gm: torch.fx.GraphModule, example_inputs) -> Callable:
    """The ``eager`` backend (the captured ops called in their order, no arithmetic changed) with each
    host operator's node calling its CPU implementation directly (host_ops.py ``direct_calls``): the same
    function the dispatcher would reach, without its round trip through Python."""
    direct = direct_calls()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in direct:
            node.target = direct[node.target]
    gm.recompile()
    return gm.forward


def _blocks(net: nn.Module, blocks) -> list:
    if isinstance(blocks, str):
        try:
            found = net.get_submodule(blocks)
        except AttributeError:
            raise ConvertError(f"compile_blocks: the integer model's net has no submodule {blocks!r}") from None
        return list(found) if isinstance(found, (nn.ModuleList, nn.Sequential)) else [found]
    found = list(blocks)
    inside = {id(m) for m in net.modules()}
    for b in found:
        if not isinstance(b, nn.Module) or id(b) not in inside:
            raise ConvertError(f"compile_blocks: {type(b).__name__} is not a submodule of the integer model's net")
    return found


def compile_blocks(model, blocks: Union[str, Iterable[nn.Module]]) -> int:
    """``model.compile_blocks(blocks)`` (api.py ``IntegerModel.compile_blocks``): run each block (a
    submodule path of ``model.net`` naming a module or a ModuleList, or an iterable of its submodules;
    ``""``: the whole net) of the integer model ``model`` as a graph captured by
    ``torch.compile`` (:func:`eager_direct_host_calls`), from its next forward on (module doc: the same
    outputs, bit for bit, for a model not changed afterwards). Returns how many blocks. Raises
    ConvertError before the first forward (the probe plans the groups), for a model with fixed-point
    fan-out groups, and for a block that is not in ``model.net``; RuntimeError where dal.formats' C++
    kernel is not built."""
    return model.compile_blocks(blocks)


def capture_blocks(net: nn.Module, blocks, make_mode, current_mode) -> int:
    """The work of :func:`compile_blocks` once the model is checked: each block of ``net`` gets a forward
    that runs the captured graph (built with ``make_mode()``, the model's NPUFloatOps) when
    ``current_mode()`` returns the mode of a forward in progress, and its eager forward when None."""
    register()
    if not available():
        raise RuntimeError("compile_blocks: dal.formats' C++ kernel is not built (dal.formats.native.status())")
    found = _blocks(net, blocks)
    for i, block in enumerate(found):
        for m in block.modules():  # a DecoderStep: no hook registered in its graph
            keep = getattr(m, "keep_kv_hooks", None)
            if keep is not None:
                keep()
        compiled = _captured_forward(make_mode(), block, i)
        forward = type(block).forward

        def eager_or_captured(*args, _block=block, _compiled=compiled, _forward=forward, **kwargs):
            mode = current_mode()
            if mode is None:
                return _forward(_block, *args, **kwargs)
            mode.__exit__(None, None, None)  # the captured function enters its own (module doc)
            try:
                return _compiled(*args, **kwargs)
            finally:
                mode.__enter__()
        block.forward = eager_or_captured
    return len(found)
