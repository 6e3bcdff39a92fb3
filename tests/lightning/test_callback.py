"""QATCallback in a real Lightning fit on MNIST: train, checkpoint, resume, test, export."""
from __future__ import annotations

import csv
import subprocess
import sys

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

from lit_common import LitMnist, mnist_subset, trainer  # noqa: E402
from oracles import lsb_diff, ort_session, output_scale  # noqa: E402

import dal  # noqa: E402
from dal.lightning import QATCallback, restore_qat_checkpoint  # noqa: E402
from dal.prepare.state import quantizers  # noqa: E402

# One worker runs the module: the shared fit (a fixture) is then made once.
pytestmark = pytest.mark.xdist_group("lightning_fit")


def _callback(**kw):
    args = dict(recipe="int8_balanced", hardware="a2000", calibrate_batches=2, freeze_observers_at_epoch=1,
                freeze_bn_at_epoch=1, example_inputs=torch.zeros(1, 1, 28, 28), quantize_outputs=True)
    args.update(kw)
    return QATCallback(**args)


def _metrics(logger) -> list[dict]:
    with open(f"{logger.log_dir}/metrics.csv") as f:
        return list(csv.DictReader(f))


def _assert_same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.fixture(scope="session")  # once per xdist worker, even when the group interleaves modules
def run(tmp_path_factory):
    """One 2-epoch fit with checkpoints after each epoch and an export at the end."""
    tmp = tmp_path_factory.mktemp("lit")
    torch.manual_seed(0)
    train, test = mnist_subset()
    module = LitMnist()
    cb = _callback(export_path=str(tmp / "model.onnx"))
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=str(tmp / "ckpt"), save_top_k=-1, filename="{epoch}")
    t = trainer(tmp, "fit", callbacks=[cb, ckpt])
    t.fit(module, train)
    return dict(tmp=tmp, module=module, cb=cb, trainer=t, train=train, test=test)


def test_fit_prepares_calibrates_freezes_and_logs(run):
    module, cb = run["module"], run["cb"]
    qs = dict(quantizers(module.model))
    assert qs and all(q.state == "frozen" for q in qs.values())  # frozen from epoch 1
    assert all(bool(m.bn_frozen) for m in module.model.modules() if hasattr(m, "bn_frozen"))
    rows = _metrics(run["trainer"].logger)
    cols = set().union(*[r.keys() for r in rows])
    for key in ("dal/quantizers_frozen", "dal/bn_frozen", "dal/weight_sparsity", "train_loss"):
        assert key in cols, key
    frozen = [float(r["dal/quantizers_frozen"]) for r in rows if r.get("dal/quantizers_frozen")]
    assert frozen == [0.0, 1.0]  # epoch 0 quantizing, epoch 1 frozen
    ckpt = torch.load(run["tmp"] / "ckpt" / "epoch=1.ckpt", weights_only=False)
    assert ckpt["dal"]["recipe"]["name"] == "int8_balanced" and ckpt["dal"]["hardware"]["name"]
    assert ckpt["dal"]["version"] == dal.__version__
    assert cb.parity_report is not None


def test_resume_reproduces_the_run_exactly(run):
    """Resume from the epoch-0 checkpoint: the second epoch ends in the very same state."""
    tmp = run["tmp"]
    torch.manual_seed(123)  # a different (untrained) init: everything must come from the checkpoint
    module = LitMnist(pretrained=False)
    t = trainer(tmp, "resume", callbacks=[_callback()])
    t.fit(module, run["train"], ckpt_path=str(tmp / "ckpt" / "epoch=0.ckpt"))
    _assert_same_state(run["module"].state_dict(), module.state_dict())


def test_test_from_checkpoint_matches(run):
    tmp = run["tmp"]
    ref = trainer(tmp, "test_ref").test(run["module"], run["test"], verbose=False)[0]["test_acc"]
    module = LitMnist()
    res = trainer(tmp, "test_ckpt", callbacks=[_callback()]).test(
        module, run["test"], ckpt_path=str(tmp / "ckpt" / "epoch=1.ckpt"), verbose=False)[0]["test_acc"]
    assert res == ref and ref > 0.8
    saved = torch.load(tmp / "ckpt" / "epoch=1.ckpt", weights_only=False)["state_dict"]
    _assert_same_state(saved, module.state_dict())
    # Without a Trainer: the checkpoint's recipe and hardware rebuild the same model.
    bare = restore_qat_checkpoint(LitMnist(), tmp / "ckpt" / "epoch=1.ckpt")
    _assert_same_state(saved, bare.state_dict())


def test_checkpoint_of_another_recipe_is_refused(run):
    """Same module tree (the weights would load), other recipe: refused, naming both recipes."""
    other = dal.load_recipe("int8_balanced").to_dict()
    other["name"] = "int8_balanced_copy"
    module = LitMnist()
    t = trainer(run["tmp"], "wrong", callbacks=[_callback(recipe=other)])
    with pytest.raises(ValueError, match="int8_balanced.*int8_balanced_copy"):
        t.test(module, run["test"], ckpt_path=str(run["tmp"] / "ckpt" / "epoch=1.ckpt"), verbose=False)


def test_export_at_fit_end_runs_within_one_lsb(run):
    pytest.importorskip("onnxruntime")
    path = run["tmp"] / "model.onnx"
    assert path.exists()
    rows = _metrics(run["trainer"].logger)
    parity = {k: float(v) for r in rows for k, v in r.items() if k.startswith("dal/parity") and v}
    assert parity["dal/parity/out/npu_vs_ort/off_by_more"] == 0.0
    model = run["module"].model.eval()
    x = next(iter(run["test"]))[0][:1]
    sess = ort_session(path)
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        want = model(x).numpy()
    assert lsb_diff(got, want, output_scale(path)).max() <= 1  # LSB of the file's output DequantizeLinear
    assert (got.argmax(1) == want.argmax(1)).all()
    # never converted in place: still a QAT model with its quantizers
    assert any(True for _ in quantizers(model))


def test_import_dal_does_not_import_lightning():
    code = "import sys, dal, dal.distill; print('pytorch_lightning' in sys.modules or 'lightning' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_learnable_recipe_under_ddp_is_refused_before_training():
    """A 2-process DDP Trainer (constructed, not launched) with a learnable recipe: setup says why
    instead of letting backward fail on a DDP-registered 0-size scale."""
    rec = dal.load_recipe("int8_balanced").to_dict()
    rec["name"] = "lsq"
    for rule in rec["rules"]:
        if isinstance(rule.get("weight"), dict):
            rule["weight"]["learnable"] = True
    ddp = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False)
    assert ddp.world_size == 2
    cb = _callback(recipe=rec)
    with pytest.raises(RuntimeError, match=r"learnable.*2 processes.*dal.calibrate"):
        cb.setup(ddp, LitMnist(), "fit")
    single = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    _callback(recipe=rec).setup(single, LitMnist(), "fit")  # one process: fine
