"""dal.convert == dal.npu on every element for transformers with dal.replace's operators:
torchvision's VisionTransformer and SwinTransformer (small configurations of the vit_b_16 /
swin_t classes, random weights) with ``npu_attention`` (QMatMul for Q@K^T and P@V, the
hardware's softmax: FP16 round trip on the a2000, the int8 exp-table softmax on the a1000),
``layernorm_fp16`` and ``lut_activation`` (GELU by table); outputs and every quantized tensor of
the file (integer and FP8 codes), several random batches each."""
import pytest
import torch
import yaml

import dal
from convert_common import assert_bit_exact, build, compare, random_batches

torch.set_num_threads(1)
RULES = ["npu_attention", "layernorm_fp16", "lut_activation"]
SHAPE = (3, 32, 32)


def recipe(base="int8_balanced", rules=RULES):
    rec = yaml.safe_load(open(dal.recipe.load.__file__.rsplit("/dal/", 1)[0] + f"/recipes/{base}.yaml"))
    rec["name"], rec["replace"] = f"{base}+attention", list(rules)
    return rec


def vit():
    tvt = pytest.importorskip("torchvision.models.vision_transformer")
    torch.manual_seed(0)
    m = tvt.VisionTransformer(image_size=32, patch_size=4, num_layers=2, num_heads=2, hidden_dim=64,
                              mlp_dim=256, num_classes=10)
    torch.nn.init.normal_(m.heads.head.weight, std=0.02)  # torchvision zero-inits it: outputs all 0
    return m


def swin():
    tvs = pytest.importorskip("torchvision.models.swin_transformer")
    torch.manual_seed(0)
    # swin_t's blocks, two stages, 4x4 windows: shifted windows with the -inf mask, relative
    # position bias, patch merging
    return tvs.SwinTransformer(patch_size=[2, 2], embed_dim=32, depths=[2, 2], num_heads=[2, 4],
                               window_size=[4, 4], num_classes=10)


def _kinds(model):
    return {type(m).__name__ for m in model.modules()}


_BUILT = {}


def _built(make, hardware, base="int8_balanced"):
    """(qat, proto, session) per model and hardware, built once per test session."""
    key = (make.__name__, hardware, base)
    if key not in _BUILT:
        _BUILT[key] = build(make(), torch.randn((2,) + SHAPE), hardware, recipe=recipe(base))
    return _BUILT[key]


@pytest.mark.parametrize("hardware", ["a2000", "a1000"])
@pytest.mark.parametrize("make", [vit, swin], ids=["vit", "swin"])
def test_transformer_bit_exact(make, hardware):
    qat, proto, sess = _built(make, hardware)
    # the a1000 runs layer norm in int8 vector code, not FP16: a float nn.LayerNorm there
    want = {"QMatMul", "NpuSoftmax", "QLutActivation", "Fp16LayerNorm" if hardware == "a2000" else "LayerNorm"}
    assert want <= _kinds(qat)
    modes = {m.mode for m in qat.modules() if type(m).__name__ == "NpuSoftmax"}
    assert modes == {"fp16" if hardware == "a2000" else "lut"}
    im = dal.convert(qat)
    assert_bit_exact(im, proto, sess, random_batches((2,) + SHAPE, n=3), f"{make.__name__}/{hardware}")
    # every replaced operator ran in its exported form (none left as its QAT module)
    assert im.forms and all(not f.startswith("QAT module") for f in im.forms.values()), im.summary()
    assert {"MatMulForm", "SoftmaxForm", "LayerNormForm", "LutForm"} == set(im.forms.values())
    # the Linears on rank-3 tokens whose output goes straight to a quantizer (MatMul + Add of the
    # int32 bias: export/SPEC.md §5a) are integer groups in both engines, not float islands
    forms = im.layer_forms()
    grouped = [p for p in forms if p.endswith(("out_proj", "mlp.0", "mlp.3"))]
    assert len(grouped) >= 6 and all(forms[p] == "integer" for p in grouped), im.summary()
    fused_matmuls = sum(1 for st in sess.steps if getattr(st, "kind", "") == "fused" and st.node.op_type == "MatMul")
    assert fused_matmuls >= len(grouped), (fused_matmuls, len(grouped))


def test_fp8_attention_bit_exact():
    """w4a8_fp8_performance: FP8 E4M3 Q@K^T and P@V operands (their codes compared bit for bit),
    int4 per-group linear weights (float on both engines), int8 elsewhere."""
    qat, proto, sess = _built(vit, "a2000", "w4a8_fp8_performance")
    fp8 = [n for n in proto.graph.node if n.op_type == "QuantizeLinear"
           and any(t.name == n.input[2] and t.data_type == 17 for t in proto.graph.initializer)]
    assert len(fp8) >= 8, "the attention products should have FP8 E4M3 inputs"
    im = dal.convert(qat)
    _, codes = im.run_with_codes(random_batches((2,) + SHAPE, n=1)[0], fp8_bits=True)
    assert sum(c[0].dtype == torch.uint8 and "matmul" in k for k, c in codes.items()) >= 8
    assert_bit_exact(im, proto, sess, random_batches((2,) + SHAPE, n=2, seed=7), "vit/w4a8_fp8")


def test_the_qat_modules_would_differ():
    """The forms matter: the QAT modules' own float32 attention matmuls, softmax and layer norm
    (what the integer model ran before) compute other values than the forms, which are bit-exact
    with the NPU. Compared on each form's own input, at the form's output: whether a difference
    there also flips a code downstream depends on the CPU's float32 kernels (on an Intel host 2
    batches flipped codes, on an AMD EPYC none), the values do not."""
    qat, proto, sess = _built(vit, "a2000")
    im = dal.convert(qat)
    xs = random_batches((2,) + SHAPE, n=2, seed=3)
    assert sum(compare(im, proto, sess, x)["code_diff"] for x in xs) == 0
    seen = {}

    def keep(path):
        return lambda mod, args, out: seen.setdefault(path, (args, out)) and None

    hooks = [im.net.get_submodule(p).register_forward_hook(keep(p)) for p in im.forms]
    with torch.no_grad():
        im(xs[0])
    for h in hooks:
        h.remove()
    differ = {}
    for path, (args, out) in seen.items():
        with torch.no_grad():
            theirs = im.net.get_submodule(path).qat(*args)
        kind = im.forms[path]
        differ[kind] = differ.get(kind, 0) + int((theirs != out).sum())
    assert differ["MatMulForm"] > 0 and differ["SoftmaxForm"] > 0 and differ["LayerNormForm"] > 0, differ


def test_float_gelu_in_its_exported_form():
    """Without ``lut_activation`` GELU stays a float nn.GELU: the integer model computes the
    exported Erf decomposition (Div, Erf in float64 rounded once, Add, Mul, Mul), not torch's
    float32 GELU kernel."""
    qat, proto, sess = build(vit(), torch.randn((2,) + SHAPE), "a2000",
                             recipe=recipe(rules=["npu_attention", "layernorm_fp16"]))
    # an FP16 island on the a2000 (its vector engine has compute: fp16): Fp16GELU, still a float GELU
    assert "Fp16GELU" in _kinds(qat) and "QLutActivation" not in _kinds(qat)
    im = dal.convert(qat)
    assert_bit_exact(im, proto, sess, random_batches((2,) + SHAPE, n=2, seed=11), "vit/float gelu")
    assert "GeluForm" in set(im.forms.values()), im.forms


def test_fp16_matmul_region_bit_exact():
    """Q@K^T and P@V kept in FP16 (``fallback: fp16`` for matmuls): the file runs each MatMul on
    float16 operands (Cast(FLOAT16) inputs), rounding once to float16; the integer model computes
    that too, not the QAT module's float32 product (which differs from the NPU on some codes)."""
    rec = recipe()
    rec["rules"].insert(0, {"type": "matmul", "fallback": "fp16"})
    qat, proto, sess = build(vit(), torch.randn((2,) + SHAPE), "a2000", recipe=rec)
    made = {o: n for n in proto.graph.node for o in n.output}
    core = [n for n in proto.graph.node if n.op_type == "MatMul" and "/core/" in n.name]
    assert len(core) == 4 and all(made[i].op_type == "Cast" for n in core for i in n.input)
    im = dal.convert(qat)
    assert_bit_exact(im, proto, sess, random_batches((2,) + SHAPE, n=2), "vit/fp16 matmul")
    assert "QAT module" not in im.summary(), im.summary()
