"""dal.report for a person: the summary first (verdict, worst layers, parity in one table), histograms of
every layer worst first, no blank band above a chart. Expected values are computed here independently
(dal.analysis.layerwise, dal.verify), never read back from the report."""
import copy
import io
import re
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from mnist_helpers import prepared
from torch import nn

import dal
from dal.analysis import layerwise
from dal.prepare import set_quantizer_state


class _Page(HTMLParser):
    """h2 headings in order; tables (class, rows of cell text); histogram rows; images (alt, src)."""

    def __init__(self):
        super().__init__()
        self.h2, self.tables, self.hist_rows, self.imgs = [], [], [], []
        self._text = None
        self._cell = None
        self.events = []  # ("h2", text) / ("table", class) in document order

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "h2":
            self._text = []
        elif tag == "table":
            self.tables.append((a.get("class", ""), []))
            self.events.append(("table", a.get("class", "")))
        elif tag == "tr" and self.tables:
            self.tables[-1][1].append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "div" and a.get("class") == "info":
            self.hist_rows.append(a.get("id"))
        elif tag == "div" and "verdict" in (a.get("class") or ""):
            self.events.append(("verdict", a.get("class")))
        elif tag == "img":
            self.imgs.append((a.get("alt"), a.get("src")))

    def handle_data(self, data):
        if self._text is not None:
            self._text.append(data)
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag):
        if tag == "h2":
            text = "".join(self._text)
            self.h2.append(text)
            self.events.append(("h2", text))
            self._text = None
        elif tag in ("td", "th") and self._cell is not None:
            self.tables[-1][1][-1].append("".join(self._cell).strip())
            self._cell = None

    def table(self, cls):
        found = [rows for c, rows in self.tables if c == cls]
        return found[0] if found else None


def _parse(path):
    page = _Page()
    page.feed(path.read_text())
    page.text = path.read_text()
    return page


def _anchor(layer):
    from dal.analysis.report_html import anchor

    return anchor(layer)


def _worst_first(rows):
    return [r["layer"] for r in sorted(rows, key=lambda r: r["cosine"])]


@pytest.fixture(scope="module")
def mnist_report(mnist, tmp_path_factory):
    net, calib, _ = mnist
    q = prepared(net)
    dal.calibrate(q, calib, progress=False)
    frozen = copy.deepcopy(q)
    set_quantizer_state(frozen, "frozen")
    data = calib[:2]
    tmp = tmp_path_factory.mktemp("report")
    onnx_path = tmp / "m.onnx"
    dal.export_onnx(frozen, (data[0][0],), onnx_path)
    out = dal.report(frozen, data, net, onnx_path, tmp / "report.html", num_batches=2, progress=False)
    return net, frozen, data, onnx_path, _parse(out)


def test_the_summary_comes_first_and_names_the_worst_layers(mnist_report):
    net, frozen, data, _, page = mnist_report
    assert page.h2[0] == "Summary"
    first_h2 = [i for i, e in enumerate(page.events) if e[0] == "h2"]
    summary = page.events[first_h2[0]:first_h2[1]]
    assert [e for e in summary if e[0] != "h2"][:3] == [("verdict", summary[1][1]), ("table", "worst"),
                                                        ("table", "parity")]
    lw = layerwise(net, frozen, data, num_batches=2, progress=False)  # the same measure, computed here
    expected = _worst_first(lw.rows)[:5]
    worst = page.table("worst")
    column = worst[0].index("layer")
    assert [row[column] for row in worst[1:]] == expected
    cosines = {r["layer"]: r["cosine"] for r in lw.rows}
    col_cos = worst[0].index("cosine")
    for row in worst[1:]:
        assert float(row[col_cos]) == pytest.approx(cosines[row[column]], abs=1e-6)


def test_histograms_of_every_layer_worst_first(mnist_report):
    net, frozen, data, _, page = mnist_report
    lw = layerwise(net, frozen, data, num_batches=2, progress=False)
    assert page.hist_rows == [_anchor(n) for n in _worst_first(lw.rows)]
    assert any("weight" in alt for alt, _ in page.imgs) and any("input_quant" in alt for alt, _ in page.imgs)


def test_the_parity_table_is_verify_s_numbers_end_to_end_and_layer_by_layer(mnist_report):
    _, frozen, data, onnx_path, page = mnist_report
    x = data[0][0]
    assert len(x) == 32  # the file was exported with this batch, so the report feeds it all 32
    rep = dal.verify(str(onnx_path), frozen, (x,))  # what the report checks, run here
    table = page.table("parity")
    head, rows = table[0], table[1:]
    cell = {h: i for i, h in enumerate(head)}
    by_view = {}
    for row in rows:
        by_view.setdefault((row[cell["view"]], row[cell["compared"]]), []).append(row)
    for name, pairs in rep.outputs.items():
        for pair, a in pairs.items():
            compared = {"npu_vs_torch": "NPU reference vs torch QAT", "npu_vs_ort": "NPU reference vs onnxruntime",
                        "npu_vs_float": "NPU reference vs torch float model"}[pair]
            (row,) = [r for r in by_view[("end to end", compared)] if r[cell["what"]] == name]
            assert row[cell["codes differing"]] == f"{a.elements - a.identical}/{a.elements}"
            assert row[cell["max LSB"]] == f"{a.max_lsb:.3g}"  # (the float model's drift reaches 10+ LSB)
            assert float(row[cell["cosine"]]) == pytest.approx(a.cosine, abs=1e-6)
            assert row[cell["status"]] == "info"  # end-to-end drift is reported, it does not decide
    for compared, layer_rows in (("NPU reference from onnxruntime's inputs", rep.layers_forced),
                                 ("torch QAT from the NPU reference's values", rep.torch_layers)):
        assert layer_rows, compared
        (row,) = by_view[("layer by layer", compared)]
        assert row[cell["codes differing"]] == (f"{sum(r.differ for r in layer_rows)}/"
                                                f"{sum(r.elements for r in layer_rows)}")
        assert float(row[cell["max LSB"]]) == max(r.max_abs for r in layer_rows)
        assert row[cell["near-ties"]] == str(sum(r.near_ties for r in layer_rows))
        assert row[cell["status"]] == ("pass" if all(r.near_ties == r.differ for r in layer_rows) else "fail")
    # one verdict: the box says what rep.verdict() says, and nothing that contradicts it
    verdict = re.search(r'<div class="verdict[^"]*">(.*?)</div>', page.text).group(1)
    assert ("VERDICT: PASS" in verdict) == rep.verdict() and ("VERDICT: FAIL" in verdict) == (not rep.verdict())
    assert "PASSES" not in verdict and "FAILS" not in verdict
    assert "Parity" in page.h2[1]  # its detail follows the summary


class _Deep(nn.Module):
    def __init__(self, n=30):
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(n)])
        self.head = nn.Linear(16, 4)
        for block in self.body:  # keeps the signal alive through 30 ReLUs: distinct per-layer errors
            nn.init.orthogonal_(block[0].weight, gain=1.5)

    def forward(self, x):
        return self.head(self.body(x))


def _blank_band(src):
    """Longest run of all-white pixel rows of a PNG data URI, in pixels."""
    import base64

    import matplotlib.image

    rgb = matplotlib.image.imread(io.BytesIO(base64.b64decode(src.split(",", 1)[1])), format="png")[..., :3]
    white = (rgb >= 0.99).all(axis=(1, 2))
    best = run = 0
    for w in white:
        run = run + 1 if w else 0
        best = max(best, run)
    return best, len(white)


def test_a_deep_model_has_every_layer_worst_first_no_blank_band_and_no_parity_without_onnx(tmp_path):
    torch.manual_seed(0)
    net = _Deep().eval()
    x = torch.randn(64, 16)
    model = dal.prepare_qat(copy.deepcopy(net), recipe="int8_balanced", hardware="a2000", example_inputs=(x[:8],))
    data = [x[:32], x[32:]]
    dal.calibrate(model, data, progress=False)
    out = dal.report(model, data, net, None, tmp_path / "deep.html", num_batches=2, sensitivity_layers=3,
                     progress=False)
    page = _parse(out)
    lw = layerwise(net, model, data, num_batches=2, progress=False)
    assert len(lw.rows) == 31
    assert page.hist_rows == [_anchor(n) for n in _worst_first(lw.rows)]  # all 31, not the first 24
    assert page.table("parity") is None and "Parity" not in page.h2
    assert page.h2[:2] == ["Summary", "Sensitivity"]
    sens = page.table("sensitivity")  # of the 3 worst layers only
    assert {row[0] for row in sens[1:]} == set(_worst_first(lw.rows)[:3])
    assert np.isfinite([float(row[sens[0].index("gain")]) for row in sens[1:]]).all()
    charts = [src for alt, src in page.imgs if alt in ("per-layer error", "sensitivity")]
    assert len(charts) == 2
    for src in charts:
        band, height = _blank_band(src)
        assert band <= 12, f"a blank band of {band} px in a chart {height} px tall"


def test_a_truncated_onnx_file_is_named_not_buried_in_the_report(mnist_report, tmp_path):
    from dal.verification.inputs import VerifyInputError

    net, frozen, data, onnx_path, _ = mnist_report
    bad = tmp_path / "cut.onnx"
    bad.write_bytes(onnx_path.read_bytes()[:1000])
    with pytest.raises(VerifyInputError, match=r"cut\.onnx is not a readable ONNX file"):
        dal.report(frozen, data, net, bad, tmp_path / "r.html", num_batches=1, sensitivity=False, progress=False)
