"""``dal estimate`` on the command line: an exported file, a model factory + recipe, and the
one-line errors (no cost section, nothing to estimate)."""
import json

import torch
import yaml

import dal
from dal.cli import main
from dal_examples.zoo import MnistCNN


def test_estimate_onnx_file_and_json(tmp_path, capsys):
    x = torch.randn(2, 1, 28, 28)
    q = dal.prepare_qat(MnistCNN().eval(), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    dal.calibrate(q, [x], progress=False)
    path = str(tmp_path / "m.onnx")
    dal.export_onnx(q, (x,), path)
    assert main(["estimate", path]) == 0
    text = capsys.readouterr().out
    assert "dal.estimate on a2000" in text and "engine matrix" in text and "stem.0" in text
    assert main(["estimate", path, "--hardware", "generic_int8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"] == "generic_int8"
    assert data["total_ms"] == dal.estimate(path, "generic_int8").total_ms


def test_estimate_model_factory(capsys):
    assert main(["estimate", "--model", "dal_examples.zoo:MnistCNN", "--recipe", "w4a8_fp8_performance", "--hardware",
                 "a2000", "--input-shape", "1,1,28,28"]) == 0
    assert "wint4/aint8" in capsys.readouterr().out


def test_errors_are_one_line(tmp_path, capsys):
    d = dal.load_hardware("a2000").to_dict()
    d.pop("cost")
    d["name"] = "nocost"
    hw = tmp_path / "nocost.yaml"
    hw.write_text(yaml.safe_dump(d))
    assert main(["estimate", "--model", "dal_examples.zoo:MnistCNN", "--recipe", "int8_balanced", "--hardware", str(hw),
                 "--input-shape", "1,1,28,28"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dal estimate: error:") and "no 'cost' section" in err and "clock_mhz" in err
    assert main(["estimate"]) == 2
    assert "give either an .onnx file or --model" in capsys.readouterr().err
