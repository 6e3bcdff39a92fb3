"""dal.convert(model) == dal.npu on every element: the classifier zoo, float and fixed-point
requantizers, several random batches each (outputs and every quantized tensor of the file)."""
import json

import pytest
import torch

import dal
from convert_common import assert_bit_exact, build, npu_fused_groups, random_batches
from dal_examples.zoo import MnistCNN

torch.set_num_threads(1)


def _torchvision(arch):
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    return getattr(tv.models, arch)(weights=None)


CASES = [("mnist_cnn", lambda: MnistCNN(), (1, 28, 28)),
         ("resnet18", lambda: _torchvision("resnet18"), (3, 32, 32)),
         ("mobilenet_v2", lambda: _torchvision("mobilenet_v2"), (3, 32, 32))]


@pytest.mark.parametrize("hardware", ["a2000", "a1000"])
@pytest.mark.parametrize("name,make,shape", CASES, ids=[c[0] for c in CASES])
def test_zoo_bit_exact(name, make, shape, hardware):
    torch.manual_seed(0)
    qat, proto, sess = build(make(), torch.randn((2,) + shape), hardware)
    im = dal.convert(qat)
    assert_bit_exact(im, proto, sess, random_batches((3,) + shape, n=3), f"{name}/{hardware}")
    # both engines formed the same integer groups (the rest runs in float on both)
    forms = im.layer_forms()
    assert sum(f == "integer" for f in forms.values()) == npu_fused_groups(sess), im.summary()
    assert sum(f == "integer" for f in forms.values()) >= len(forms) // 2, im.summary()
    want = "fixed-point" if hardware == "a1000" else "float requantizer"
    assert want in im.summary()


def test_same_signature_no_autograd_model_unchanged():
    torch.manual_seed(0)
    x = torch.randn(2, 1, 28, 28)
    qat, proto, sess = build(MnistCNN(), x, "a2000")
    before = {k: v.clone() for k, v in qat.state_dict().items()}
    im = dal.convert(qat, example_inputs=(x,))
    y = im(x.clone().requires_grad_(True))
    assert y.shape == qat(x).shape and not y.requires_grad and y.grad_fn is None
    assert all(torch.equal(before[k], v) for k, v in qat.state_dict().items())
    # the QAT model (float32 sums) is close to the integer model, not equal by construction
    with torch.no_grad():
        assert float((im(x) - qat(x)).abs().max()) < 0.5


@pytest.mark.parametrize("recipe", ["int8_sparse24", "w4a8_fp8_performance"])
@pytest.mark.parametrize("name,make,shape", CASES[:2], ids=[c[0] for c in CASES[:2]])
def test_sparse_and_w4a8_recipes_bit_exact(name, make, shape, recipe):
    """2:4 sparse weights (dal.npu's compressed kernel; the integer model multiplies the masked
    weight) and int4 weights with int8 activations."""
    torch.manual_seed(0)
    qat, proto, sess = build(make(), torch.randn((2,) + shape), "a2000", recipe=recipe)
    if recipe == "int8_sparse24":
        assert len(json.loads(next(p.value for p in proto.metadata_props if p.key == "dal.sparse_24"))) >= 3
    im = dal.convert(qat)
    assert_bit_exact(im, proto, sess, random_batches((2,) + shape, n=2), f"{name}/{recipe}")
    assert sum(f == "integer" for f in im.layer_forms().values()) == npu_fused_groups(sess)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (not required)")
@pytest.mark.parametrize("hardware", ["a2000", "a1000"])
@pytest.mark.parametrize("name,make,shape", CASES[:2], ids=[c[0] for c in CASES[:2]])
def test_cuda_bit_exact(name, make, shape, hardware):
    """On CUDA the integer groups accumulate in float64 (accumulate.py): the same codes."""
    torch.manual_seed(0)
    qat, proto, sess = build(make(), torch.randn((2,) + shape), hardware)
    im = dal.convert(qat).to("cuda")
    for x in random_batches((3,) + shape, n=2):
        y = im(x.cuda()).cpu().numpy()
        assert (y == sess.run({sess.input_names[0]: x.numpy()})[0]).all()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mobilenet_v3_small", "efficientnet_b0", "shufflenet_v2_x0_5"])
def test_more_torchvision_classifiers_bit_exact(arch):
    """Hardswish / SiLU / channel shuffle: the float islands of export/SPEC.md §5a (float64
    pooling sums and Sigmoid rounded once) agree element for element. One batch each."""
    torch.manual_seed(0)
    qat, proto, sess = build(_torchvision(arch), torch.randn(1, 3, 32, 32), "a2000")
    im = dal.convert(qat)
    assert_bit_exact(im, proto, sess, random_batches((2, 3, 32, 32), n=1), arch)
    assert sum(f == "integer" for f in im.layer_forms().values()) == npu_fused_groups(sess)
