"""Power-of-two models (hardware_models/pow2_int8.yaml: every scale 2^k, a shift-only
requantizer, export/SPEC.md §5): dal.convert == dal.npu on every element; the shift is checked
against Python integers, and a multiplier that is not a power of two is refused by name."""
import random
from fractions import Fraction

import pytest
import torch

import dal
from convert_common import assert_bit_exact, build, npu_fused_groups, random_batches
from dal.convert import ConvertError
from dal.convert.requant import FixedPoint, power_of_two_shift
from dal_examples.zoo import MnistCNN

torch.set_num_threads(1)


def _tv(arch):
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    return getattr(tv.models, arch)(weights=None)


CASES = [("mnist_cnn", MnistCNN, (1, 28, 28)), ("resnet18", lambda: _tv("resnet18"), (3, 32, 32))]


@pytest.mark.parametrize("name,make,shape", CASES, ids=[c[0] for c in CASES])
def test_pow2_bit_exact(name, make, shape):
    torch.manual_seed(0)
    qat, proto, sess = build(make(), torch.randn((2,) + shape), "pow2_int8", recipe="pow2_int8")
    im = dal.convert(qat)
    assert "power-of-two requantizer (shift, half_even)" in im.summary()
    assert_bit_exact(im, proto, sess, random_batches((2,) + shape, n=3), f"{name}/pow2_int8")
    n_int = sum(f == "integer" for f in im.layer_forms().values())
    assert n_int == npu_fused_groups(sess) and n_int >= 3, im.summary()


@pytest.mark.parametrize("rounding", ["half_even", "half_up", "half_away"])
def test_shift_matches_exact_fractions(rounding):
    rnd = random.Random(1)
    accs = [rnd.randint(-(1 << 30), 1 << 30) for _ in range(3000)] + [-6, -5, -3, 3, 5, 6, 0]
    for n in (1, 3, 9):
        fp = FixedPoint(torch.tensor([2.0 ** -n]), 1.0, 31, rounding, "layer", kind="power_of_two")
        got = fp(torch.tensor(accs, dtype=torch.float64), 0, 0, -(1 << 40), 1 << 40).tolist()
        want = []
        for a in accs:
            q = Fraction(a, 1 << n)
            lo = q.numerator // q.denominator
            frac = q - lo
            up = frac > Fraction(1, 2) or (frac == Fraction(1, 2) and (
                rounding == "half_up" or (rounding == "half_even" and lo % 2) or (rounding == "half_away" and a >= 0)))
            want.append(lo + int(up))
        assert got == want, (n, rounding)


def test_multiplier_not_a_power_of_two_is_refused():
    assert power_of_two_shift(2.0 ** -7, "x") == (1, 7)
    with pytest.raises(ConvertError, match=r"conv1: the power_of_two requantizer needs .*0\.3"):
        power_of_two_shift(0.3, "conv1")


def test_a_file_that_misstates_the_shift_rounding_is_caught():
    """The same pow2 model, its file claiming ties away from zero instead of ties to even: the
    integer model (from the hardware model) and dal.npu (from the file) then disagree."""
    import copy

    import dal.npu
    from convert_common import compare
    torch.manual_seed(0)
    qat, proto, _ = build(MnistCNN(), torch.randn(2, 1, 28, 28), "pow2_int8", recipe="pow2_int8")
    bad = copy.deepcopy(proto)
    for p in bad.metadata_props:
        if p.key == "dal.requantizer":
            assert '"half_even"' in p.value
            p.value = p.value.replace('"half_even"', '"half_away"')
    sess = dal.npu.load(bad, threads=1)
    im = dal.convert(qat)
    assert sum(compare(im, bad, sess, x)["code_diff"] for x in random_batches((2, 1, 28, 28), n=2)) > 0


def test_int16_input_codes_bit_exact():
    """pow2_int8's matrix engine takes int16 activations (its 16-bit mode): a conv with int16
    input codes sums up to 32767 * 127 * K, past the float32 chunks, in float64 (exact below
    2^53), as dal.npu's int64 accumulator model does."""
    import yaml

    root = dal.recipe.load.__file__.rsplit("/dal/", 1)[0]
    rec = yaml.safe_load(open(f"{root}/recipes/pow2_int8.yaml"))
    rec["name"] = "pow2_int8_int16_conv"
    rec["rules"].insert(0, {"match": "conv", "weight": rec["rules"][2]["weight"],
                            "input": {"format": "int16", "granularity": "per_tensor", "symmetric": True,
                                      "observer": "minmax", "observer_args": {"power_of_two": "cover"}}})
    torch.manual_seed(0)
    qat, proto, sess = build(MnistCNN(), torch.randn(2, 1, 28, 28), "pow2_int8", recipe=rec)
    assert qat.conv.input_quant.fmt.name == "int16"
    im = dal.convert(qat)
    assert_bit_exact(im, proto, sess, random_batches((2, 1, 28, 28), n=2), "mnist/pow2/int16")
    assert im.layer_forms()["conv"] == "integer", im.summary()
    assert sum(f == "integer" for f in im.layer_forms().values()) == npu_fused_groups(sess)
