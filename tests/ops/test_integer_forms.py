"""The registry's integer forms (dal.ops ``integer_form``, what dal.convert runs for a float op).

Every entry's ``integer_form`` resolves to a callable (a form factory: a callable or None for
each of the op's calls, at every opset dal exports); the sigmoid, tanh and SiLU forms equal the ONNX formula computed in
float64 by torch and rounded once to float32 (SiLU: ``x * Sigmoid(x)``, the Mul in float32), bit
for bit, on random inputs with +-inf, NaN, +-0 and subnormals (0 LSB).
"""
import pytest
import torch
import torch.nn.functional as F

import dal
from dal.convert.op_forms import calls_of, float_forms, is_form_factory
from dal.convert.pending_ops import pending_ops

OPSETS = range(13, 22)


def _with_forms():
    """Every registered entry with an integer_form, and dal.convert's not yet registered ones."""
    return [op for op in dal.ops.all_ops() + pending_ops() if op.integer_form is not None]


def test_some_ops_have_integer_forms():
    names = {op.name for op in _with_forms()}
    assert {dal.ops.by_function(f).name for f in (torch.sigmoid, torch.tanh, F.silu)} <= names


@pytest.mark.parametrize("op", _with_forms(), ids=lambda op: op.name)
def test_integer_form_resolves_to_a_callable(op):
    form = op.resolve("integer_form")
    assert callable(form), f"{op.name}: integer_form {op.integer_form!r} is not callable"
    if is_form_factory(form):  # factory(func, opset) -> form or None, for each of the op's calls
        opsets = OPSETS if form.needs_opset else [None]
        made = [form(f, opset) for f in calls_of(op) for opset in opsets]
        assert all(m is None or callable(m) for m in made), op.name
        assert any(m is not None for m in made), f"{op.name}: no call and opset gives a form"


def test_method_calls_map_through_the_registry():
    """A call-site ``torch.Tensor.sigmoid`` gets the form of ``dal.ops.by_method("sigmoid")``."""
    forms = float_forms()
    op = dal.ops.by_method("sigmoid")
    assert op is not None and forms[torch.Tensor.sigmoid] is op.resolve("integer_form")


def _inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    normal = torch.cat([torch.randn(4000, generator=g) * s for s in (1.0, 4.0, 40.0)])
    bits = torch.randint(1, 1 << 23, (1000,), generator=g, dtype=torch.int32)  # subnormal magnitudes
    sub = bits.view(torch.float32) * torch.where(torch.rand(1000, generator=g) < 0.5, -1.0, 1.0)
    f32 = torch.finfo(torch.float32)
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, f32.max, -f32.max,
                            f32.tiny, -f32.tiny, f32.smallest_normal / 2, 88.72283, -88.72283, 103.9, -103.9,
                            1e-8, -1e-8, 9.0, -9.0, 17.5, -17.5], dtype=torch.float32)
    return torch.cat([normal, sub, special]).float()


def _sigmoid64(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x.double()))  # ONNX Sigmoid: 1 / (1 + exp(-x))


ORACLES = {
    torch.sigmoid: lambda x: _sigmoid64(x).float(),
    torch.tanh: lambda x: torch.tanh(x.double()).float(),
    F.silu: lambda x: x * _sigmoid64(x).float(),  # exported as x * Sigmoid(x): Mul in float32
}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = torch.isnan(a)
    return bool(torch.equal(nan, torch.isnan(b))) and bool(torch.equal(a[~nan].view(torch.int32),
                                                                       b[~nan].view(torch.int32)))


@pytest.mark.parametrize("fn", list(ORACLES), ids=lambda f: f.__name__)
def test_form_is_the_onnx_formula_in_float64_rounded_once(fn):
    x = _inputs()
    form = dal.ops.by_function(fn).resolve("integer_form")
    got, want = form(x), ORACLES[fn](x)
    assert got.dtype == torch.float32 and _same_bits(got, want), \
        f"{fn.__name__}: {int((got != want).sum())} elements differ from the float64 oracle"

def test_inputs_hold_the_special_values():
    x = _inputs()
    tiny = torch.finfo(torch.float32).smallest_normal
    assert torch.isnan(x).any() and (x == float("inf")).any() and (x == -float("inf")).any()
    assert ((x != 0) & (x.abs() < tiny) & (x > 0)).sum() > 100 and ((x.abs() < tiny) & (x < 0)).sum() > 100


def _erfc_f64(x):
    """ONNX-style float island for the test's op: erfc in float64, rounded once to float32."""
    return torch.special.erfc(x.double()).float() if x.dtype == torch.float32 else None


def test_a_users_op_gets_its_integer_form_in_the_integer_models_mode():
    """``dal.ops.register`` of an op with an ``integer_form`` is all NPUFloatOps needs; after
    ``unregister`` torch's own op runs again (the derived tables follow the registry)."""
    from dal.convert.float_ops import NPUFloatOps

    assert dal.ops.by_function(torch.erfc) is None and dal.ops.by_method("erfc") is None
    x = _inputs()
    dal.ops.register(dal.ops.Op(name="test_erfc", op_class="activation", handling="float",
                                functions=(torch.erfc,), methods=("erfc", "erfc_"), integer_form=_erfc_f64))
    try:
        with NPUFloatOps():
            got, got_method = torch.erfc(x), x.erfc()
        assert _same_bits(got, _erfc_f64(x)) and _same_bits(got_method, _erfc_f64(x))
        assert torch.erfc in float_forms() and torch.Tensor.erfc in float_forms()
        assert torch.Tensor.erfc_ not in float_forms()  # a form returns a new tensor: in place keeps torch's op
    finally:
        dal.ops.unregister("test_erfc")
    assert torch.erfc not in float_forms()
    plain = torch.erfc(x)  # torch's own kernel, outside the mode
    with NPUFloatOps():
        assert _same_bits(torch.erfc(x), plain)
