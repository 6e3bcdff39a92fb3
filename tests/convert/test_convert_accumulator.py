"""A hardware accumulator narrower than the exact sum (``accumulator_bits`` with
``accumulator_overflow: saturate | wrap``, export/SPEC.md §5): the integer model limits the exact
sum (bias included) as dal.npu does, bit for bit, on a model whose sums do overflow; the limit
itself is checked against Python integers."""
import random
import warnings

import pytest
import torch
import yaml

import dal
from convert_common import assert_bit_exact, build, compare, random_batches
from dal.convert.accumulate import limit
from dal_examples.zoo import MnistCNN

torch.set_num_threads(1)
SHAPE = (1, 28, 28)
ROOT = dal.recipe.load.__file__.rsplit("/dal/", 1)[0]


def _oracle(a: int, bits: int, overflow: str) -> int:
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if overflow == "saturate":
        return min(max(a, lo), hi)
    a %= 1 << bits  # Python's % is floor modulo: the B-bit two's complement by its definition
    return a - (1 << bits) if a > hi else a


@pytest.mark.parametrize("overflow", ["saturate", "wrap"])
@pytest.mark.parametrize("bits", [8, 16, 24, 32])
def test_limit_matches_python_integers(bits, overflow):
    rnd = random.Random(bits)
    vals = [rnd.randint(-(1 << 40), 1 << 40) for _ in range(2000)] + [(1 << (bits - 1)) - 1, 1 << (bits - 1),
                                                                       -(1 << (bits - 1)), -(1 << (bits - 1)) - 1, 0]
    got = limit(torch.tensor(vals, dtype=torch.float64), bits, overflow).tolist()
    assert got == [float(_oracle(v, bits, overflow)) for v in vals]


def _narrow(base: str, bits: int, overflow: str) -> dict:
    hw = yaml.safe_load(open(f"{ROOT}/hardware_models/{base}.yaml"))
    hw["name"] = f"{base}_acc{bits}_{overflow}"
    hw["accumulator_bits"], hw["accumulator_overflow"] = bits, overflow
    return hw


@pytest.mark.parametrize("overflow", ["saturate", "wrap"])
@pytest.mark.parametrize("base", ["a2000", "a1000"])
def test_narrow_accumulator_bit_exact(base, overflow):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # prepare / export warn that these sums overflow: they do
        qat, proto, sess = build(MnistCNN(), torch.randn((2,) + SHAPE), _narrow(base, 16, overflow))
    assert '"bits": 16' in next(p.value for p in proto.metadata_props if p.key == "dal.accumulator")
    im = dal.convert(qat)
    assert "16-bit accumulator" in im.summary()
    batches = random_batches((2,) + SHAPE, n=2, scale=3.0)
    assert_bit_exact(im, proto, sess, batches, f"{base}/acc16/{overflow}")
    # the sums did overflow: the same integer model with an exact accumulator disagrees
    im.requantizer.accumulator_bits = None
    assert sum(compare(im, proto, sess, x)["code_diff"] for x in batches) > 0
