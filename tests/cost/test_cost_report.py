"""The HTML report's latency section: the plot, the engine table, the search's Pareto front."""
import torch

import dal
from dal.analysis.report import build_report
from dal.cost import estimate, search_precision
from dal_examples.zoo import MnistCNN


def test_report_has_latency_section(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(8, 1, 28, 28)
    net = MnistCNN().eval()
    calib = [(x, torch.randint(0, 10, (8,)))]
    res = search_precision(net, calib, "a2000", latency_budget="0.8x")
    q = dal.prepare_qat(net, recipe=res.recipe, hardware="a2000", example_inputs=(x,))
    dal.calibrate(q, [x], progress=False)
    est = estimate(q, example_inputs=(x,))
    path = build_report(q, [x], out=tmp_path / "r.html", sensitivity=False, num_batches=1, progress=False,
                        estimate=est, search=res)
    html = path.read_text()
    assert '<h2 id="latency">Estimated latency</h2>' in html and 'href="#latency"' in html
    assert f"{est.total_ms:.4f} ms on a2000" in html
    assert 'class="latency-engines"' in html and 'class="pareto"' in html
    assert 'alt="estimated cycles per layer" src="data:image/png;base64,' in html
    assert html.count("<tr>", html.index('class="pareto"')) >= len(res.front)
