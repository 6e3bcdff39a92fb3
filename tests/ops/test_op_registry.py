"""dal.ops's registry: a float pattern belongs to one op (a second claim is refused, naming both
ops, and leaves the registry as it was), a user's op is found by its patterns, and every
functional op's QAT module is a dal.nn QATModule of the entry's op class."""
import operator

import pytest
import torch

import dal
from dal.nn import QATModule
from dal.ops import Op


@pytest.fixture
def registered():
    """The names of the ops a test registers: unregistered after it (dal.ops.unregister)."""
    names = []
    yield names
    for name in names:
        dal.ops.unregister(name)


def _user_fn(a, b):
    return a * 2 + b


@pytest.mark.parametrize("claim, what", [
    ({"functions": (_user_fn, torch.add)}, "function"),
    ({"functions": (_user_fn, operator.iadd)}, "function"),
    ({"functions": (_user_fn,), "methods": ("__radd__",)}, "Tensor method '__radd__'"),
])
def test_second_claim_is_refused_naming_both_ops(claim, what):
    before = dal.ops.all_ops()
    with pytest.raises(ValueError) as err:
        dal.ops.register(Op(name="user_add", op_class="add", handling="functional", **claim))
    msg = str(err.value)
    assert "'user_add'" in msg and "'add'" in msg and what in msg
    # nothing of the refused op stays: its name and its other pattern are free
    assert dal.ops.all_ops() == before
    with pytest.raises(KeyError, match="user_add"):
        dal.ops.get("user_add")
    assert dal.ops.by_function(_user_fn) is None
    assert dal.ops.by_function(torch.add).name == "add"


def test_second_claim_of_a_module_type_is_refused(registered):
    class Custom(torch.nn.Module):
        pass

    dal.ops.register(Op(name="user_custom", op_class="custom", handling="host", modules=(Custom,)))
    registered.append("user_custom")
    with pytest.raises(ValueError, match=r"'user_other'.*module type .*Custom.*'user_custom'"):
        dal.ops.register(Op(name="user_other", op_class="custom", handling="host", modules=(Custom,)))
    assert dal.ops.by_module(Custom).name == "user_custom"


def test_user_op_is_found_by_its_function_and_method(registered):
    assert dal.ops.by_function(_user_fn) is None and dal.ops.by_method("user_twice_plus") is None
    op = dal.ops.register(Op(name="user_twice_plus", op_class="custom", handling="float", functions=(_user_fn,),
                             methods=("user_twice_plus",)))
    registered.append("user_twice_plus")
    assert dal.ops.by_function(_user_fn) is op
    assert dal.ops.by_method("user_twice_plus") is op
    assert dal.ops.get("user_twice_plus") is op
    assert op in dal.ops.select(handling="float") and op not in dal.ops.select(handling="functional")


def test_every_functional_op_builds_a_qat_module_of_its_op_class():
    functional = dal.ops.select(handling="functional")
    # the ops prepare quantizes as calls (at least these; a family may add more)
    assert {"add", "mul", "matmul", "cat", "grid_sample", "scatter_add", "gather"} <= {op.name for op in functional}
    for op in functional:
        cls = op.resolve("qat_module")
        assert isinstance(cls, type) and issubclass(cls, QATModule), (op.name, cls)
        assert cls.op_class == op.op_class, (op.name, cls.__name__, cls.op_class, op.op_class)
        assert op.functions or op.methods, op.name  # something in a model matches it


class _Square(torch.nn.Module):
    def forward(self, x):
        return x * x


def test_a_misspelt_op_class_is_refused_when_prepare_meets_it(registered):
    @dal.ops.register(_Square, name="user_square", op_class="activaton")
    class QSquare(QATModule, _Square):
        def forward(self, x):
            return self.finish(x * x)
    registered.append("user_square")
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), _Square())
    with pytest.raises(ValueError, match=r"op 'user_square' \(float type _Square\).*'activaton'.*did you mean 'activation'"):
        dal.prepare_qat(model, recipe="int8_balanced", hardware="a2000")
