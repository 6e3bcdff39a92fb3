"""Reading a tensor's autograd graph in tests (import as ``from autograd_graph import graph_has``)."""
import torch


def graph_has(t: torch.Tensor, name: str) -> bool:
    """Whether a node whose class name starts with ``name`` is in ``t``'s autograd graph (which
    route a quantizer took: the C++ kernel's ``KernelOutput`` node, a folded ``FoldedFakeQuantize``)."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if type(fn).__name__.startswith(name):
            return True
        todo += [nxt for nxt, _ in fn.next_functions]
    return False
