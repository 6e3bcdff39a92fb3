"""A QAT quantizer's bound call (dal.quantizer_bound, dal.formats.track_call) against the torch
path, bit for bit, across everything that must drop or refresh the binding.

The torch path (``use_kernel(False)``: observer module, choose_qparams, set_qparams,
fake_quantize) is the spec. Each case applies the same change to a bound quantizer and to its
torch-path copy, then runs QAT steps on both and compares outputs, input gradients and every
buffer. A binding that outlived its change would write the old buffers (or use the old
constants), so the states would part.
"""
import copy
import io

import pytest
import torch

from dal.formats import native, per_channel
from dal.formats.track_call import TrackCall
from dal.observers import MovingAverageMinMaxObserver
from dal.quantizer import FakeQuantizer
from dal.quantizer_bound import BoundCall
from test_quantizer_fast_path import _same, step_both

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no fused kernel: {native.status()}")


def _pair(observer="moving_average", **kw):
    fast = FakeQuantizer("uint8", symmetric=False, observer=observer, **kw).train()
    fast(torch.randn(4, 32) * 2)
    fast.end_observation("quantize")
    slow = copy.deepcopy(fast).use_kernel(False)
    return fast, slow


def _steps(fast, slow, gen, tag, n=3):
    for i in range(n):
        step_both(fast, slow, torch.randn(4, 32, generator=gen) * (1 + i), gen, f"{tag} step {i}")


@pytest.fixture
def bound_calls(monkeypatch):
    count = [0]
    real = TrackCall.__call__

    def call(self, x, stats):
        y = real(self, x, stats)
        count[0] += y is not None
        return y
    monkeypatch.setattr(TrackCall, "__call__", call)
    return count


def test_a_qat_call_binds_and_the_bound_calls_give_the_torch_paths_bits(bound_calls):
    fast, slow = _pair()
    gen = torch.Generator().manual_seed(0)
    _steps(fast, slow, gen, "first", n=1)
    assert isinstance(fast.__dict__.get("_bound"), BoundCall)
    _steps(fast, slow, gen, "bound", n=4)
    assert bound_calls[0] == 4


def _swap_observer(q):
    old = q.observer
    new = MovingAverageMinMaxObserver(old.fmt, symmetric=old.symmetric, narrow_range=old.narrow_range,
                                      averaging_constant=0.5)
    new.load_state_dict(old.state_dict(), strict=False)
    q.observer = new


def _new_buffer_objects(q):
    q._apply(lambda t: t.clone())


def _load_assign(q):
    q.load_state_dict(copy.deepcopy(q.state_dict()), assign=True)


def _constant(q):
    q.observer.averaging_constant = 0.25


def _replace_scale(q):
    q.scale = q.scale.clone() * 2


def _eval_then_train(q):
    q.eval()
    q(torch.linspace(-3, 3, 128).reshape(4, 32))  # frozen-in-eval call, no observer step
    q.train()


def _frozen_then_quantize(q):
    q.set_state("frozen")
    q(torch.linspace(-3, 3, 128).reshape(4, 32))
    q.set_state("quantize")


def _power_of_two(q):
    q.constrain_power_of_two("nearest")


CHANGES = {"observer swapped": _swap_observer, "buffers replaced (_apply)": _new_buffer_objects,
           "load_state_dict(assign=True)": _load_assign, "moving-average constant": _constant,
           "scale replaced": _replace_scale, "eval and back": _eval_then_train,
           "frozen and back": _frozen_then_quantize, "power of two": _power_of_two}


@pytest.mark.parametrize("change", CHANGES)
def test_a_change_after_binding_gives_the_torch_paths_bits(change):
    fast, slow = _pair()
    gen = torch.Generator().manual_seed(1)
    _steps(fast, slow, gen, "before")
    assert isinstance(fast.__dict__.get("_bound"), BoundCall)
    CHANGES[change](fast)
    CHANGES[change](slow)
    _steps(fast, slow, gen, change)


def test_a_running_minmax_quantizer_binds_too(bound_calls):
    fast, slow = _pair("minmax")
    gen = torch.Generator().manual_seed(2)
    _steps(fast, slow, gen, "minmax", n=4)
    assert bound_calls[0] == 3


def test_copies_and_pickles_of_a_bound_quantizer_write_their_own_buffers():
    fast, slow = _pair()
    gen = torch.Generator().manual_seed(3)
    _steps(fast, slow, gen, "before")
    twin, twin_slow = copy.deepcopy(fast), copy.deepcopy(slow)
    buf = io.BytesIO()
    torch.save(fast, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    loaded_slow = copy.deepcopy(slow)
    _steps(twin, twin_slow, gen, "deepcopy")
    _steps(loaded, loaded_slow, gen, "pickled")
    _steps(fast, slow, gen, "original after its copies stepped")


def test_per_channel_and_non_tensor_inputs_are_never_bound():
    q = FakeQuantizer("int8", granularity=per_channel(1), observer="moving_average").train()
    q(torch.randn(4, 8))
    q.end_observation("quantize")
    q(torch.randn(4, 8))
    assert not q.__dict__.get("_bound")
    fast, slow = _pair()
    gen = torch.Generator().manual_seed(4)
    _steps(fast, slow, gen, "bind")
    x = torch.randn(32, 4, generator=gen).t()  # not contiguous: the bound call declines, the chain decides
    _same(fast(x), slow(x), "non-contiguous input")
    _steps(fast, slow, gen, "after the declined call")


def test_a_deep_copied_observer_binds_again(bound_calls):
    # its format is an equal copy, not the quantizer's object: the binding compares formats by value
    fast, slow = _pair()
    gen = torch.Generator().manual_seed(5)
    _steps(fast, slow, gen, "before")
    for q in (fast, slow):
        q.observer = copy.deepcopy(q.observer)
    assert fast.observer.fmt is not fast.fmt
    _steps(fast, slow, gen, "copied observer")
    assert isinstance(fast.__dict__.get("_bound"), BoundCall) and fast._bound.observer is fast.observer
