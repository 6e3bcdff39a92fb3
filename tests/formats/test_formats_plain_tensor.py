"""fused.plain_tensor: the C++ kernels take a raw pointer only from a plain tensor with storage.

Under torch.func's transforms (vmap, grad, jacrev) and functionalization a tensor keeps
``type(x) is torch.Tensor`` but is a wrapper without storage of its own; a raw pointer into it
would read garbage or crash (functionalize's wrapper reports data pointer 0). The check uses
public API only (``data_ptr()``); the transforms are torch's own.
"""
import pytest
import torch

from dal.formats import native
from dal.formats.fused import plain_tensor
from dal.quantizer import FakeQuantizer

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no fused kernel: {native.status()}")

TRANSFORMS = {
    "vmap": lambda f, x: torch.func.vmap(f)(x),
    "grad": lambda f, x: torch.func.grad(lambda t: f(t).sum())(x),
    "jacrev": lambda f, x: torch.func.jacrev(f)(x[0]),
    "functionalize": lambda f, x: torch.func.functionalize(f)(x),
}


class Subclass(torch.Tensor):
    pass


def test_plain_tensors_and_parameters_are_plain():
    x = torch.randn(3, 4)
    assert plain_tensor(x) and plain_tensor(torch.nn.Parameter(x)) and plain_tensor(torch.empty(0))
    assert plain_tensor(x.t()) and plain_tensor(x[1:])  # views have storage: layout is checked elsewhere
    assert not plain_tensor(x.as_subclass(Subclass))


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_a_transformed_tensor_is_not_plain(transform):
    seen = []

    def f(t):
        seen.append(plain_tensor(t))
        return t * 1
    TRANSFORMS[transform](f, torch.randn(2, 5))
    assert seen == [False]


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("state", ["frozen", "quantize"])
def test_a_quantizer_under_a_transform_takes_the_torch_path(transform, state, monkeypatch):
    """Under a transform the kernel is never entered (its calls are counted); the quantizer then
    behaves exactly as with the kernel switched off (use_kernel(False)): here torch's own refusal
    of an autograd.Function without setup_context, the same error either way."""
    q = FakeQuantizer("int8").train()
    q(torch.randn(64) * 3)
    q.end_observation(state)
    slow = FakeQuantizer("int8").train()
    slow.load_state_dict(q.state_dict())
    slow.use_kernel(False)
    lib = native.library()
    entered = []
    for name in ("dal_fq_forward", "dal_fq_forward_fixed", "dal_track_fq_forward", "dal_track_qparams"):
        real = getattr(lib, name)
        monkeypatch.setattr(lib, name, lambda *a, _r=real, _n=name: entered.append(_n) or _r(*a))
    x = torch.randn(2, 16) * 3
    errors = []
    for quant in (q, slow):
        try:
            errors.append(("ok", TRANSFORMS[transform](quant, x)))
        except RuntimeError as e:
            errors.append(("raised", str(e).split(".")[0]))
    assert entered == []
    assert errors[0][0] == errors[1][0]
    if errors[0][0] == "raised":
        assert errors[0][1] == errors[1][1]
    else:
        assert torch.equal(errors[0][1], errors[1][1])
    q.eval()
    assert q(x) is not None and entered  # outside a transform the same quantizer takes the kernel
