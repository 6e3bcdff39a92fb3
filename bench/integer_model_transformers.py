"""Benchmark: dal.convert == dal.npu on the full-size vit_b_16 and swin_t architectures
(torchvision, random weights; 64x64 inputs to keep dal.npu's run short) with ``npu_attention``,
``layernorm_fp16`` and ``lut_activation``, on the a2000 (FP16 softmax) and the a1000 (int8
exp-table softmax): outputs and every quantized tensor of the file, two random batches of 2.
The peer, dal.npu, is timed in the same run. tests/convert/test_convert_attention.py checks
the same claim on small configurations of both classes.

    .venv/bin/python bench/integer_model_transformers.py [--models vit_b_16,swin_t] [--hardware a2000,a1000]

Writes bench/results/integer_model_transformers.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from cpu import cpu_flags  # bench/cpu.py
from results_file import write_result  # bench/results_file.py

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "convert"))
SHAPE = (3, 64, 64)


def model(name: str):
    import torchvision
    from torchvision.models.vision_transformer import VisionTransformer
    torch.manual_seed(0)
    if name == "vit_b_16":  # vit_b_16's configuration at 64x64 (16 patches + the class token)
        m = VisionTransformer(image_size=64, patch_size=16, num_layers=12, num_heads=12, hidden_dim=768,
                              mlp_dim=3072)
        head = m.heads.head
    else:
        m = torchvision.models.swin_t(weights=None)
        head = m.head
    torch.nn.init.normal_(head.weight, std=0.02)  # torchvision zero-inits ViT's head
    return m


def one(name: str, hardware: str) -> str:
    import dal
    from convert_common import build, compare, random_batches
    from test_convert_attention import recipe
    t = time.perf_counter()
    qat, proto, sess = build(model(name), torch.randn((1,) + SHAPE), hardware, recipe=recipe())
    t_build = time.perf_counter() - t
    im = dal.convert(qat)
    rows, t_int, t_npu = [], 0.0, 0.0
    for x in random_batches((2,) + SHAPE, n=2):
        rows.append(compare(im, proto, sess, x))
        t = time.perf_counter()
        with torch.no_grad():
            im(x)
        t_int += time.perf_counter() - t
        t = time.perf_counter()
        sess.run({sess.input_names[0]: x.numpy()})
        t_npu += time.perf_counter() - t
    code_diff = sum(r["code_diff"] for r in rows)
    codes = sum(r["codes"] for r in rows)
    out_diff = sum(r["out_diff"] for r in rows)
    outs = sum(r["out_elements"] for r in rows)
    left = [f for f in im.forms.values() if f.startswith("QAT module")]
    return (f"| {name} | {hardware} | {out_diff} / {outs} | {code_diff} / {codes} | "
            f"{len(im.forms) - len(left)} / {len(im.forms)} | {t_int / 2:.2f} | {t_npu / 2:.2f} | {t_build:.0f} |")


def main(models, hardware) -> str:
    torch.set_num_threads(1)
    rows = [one(m, h) for m in models for h in hardware]
    lines = ["# Integer model vs dal.npu on transformers (bench/integer_model_transformers.py)", "",
             f"torchvision architectures, random weights, 3x64x64, int8_balanced + npu_attention, "
             f"layernorm_fp16, lut_activation; two random batches of 2; one thread. CPU: {cpu_flags()}. "
             f"torch {torch.__version__}.", "",
             "| model | hardware | outputs differ | quantized codes differ | operators in exported form | "
             "integer model s / batch | dal.npu s / batch | build + export s |",
             "|---|---|---|---|---|---|---|---|", *rows, "",
             "- codes: every QuantizeLinear output of the file (integer codes; FP8 as bit patterns), "
             "matched by name to the integer model's quantizer calls.",
             "- the machine is shared by several jobs: times swing 1.5-2x between runs."]
    text = "\n".join(lines) + "\n"
    return write_result("integer_model_transformers.md", text)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="vit_b_16,swin_t")
    ap.add_argument("--hardware", default="a2000,a1000")
    a = ap.parse_args()
    print(main(a.models.split(","), a.hardware.split(",")))
