"""dal.integrations.hf_trainer with the real transformers Trainer on a tiny LlamaForCausalLM.

Oracles: an uninterrupted Trainer run (a resumed run must equal it bit for bit: quantizer
buffers, parameters, the losses of the steps after the resume), the quantizers' own states read
by an independent callback at each step, a count of torch's checkpoint calls, and onnx's
checker for the export.
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import math  # noqa: E402
import shutil  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import dal  # noqa: E402
from dal.quantizer import quantizers  # noqa: E402

T = pytest.importorskip("transformers")
hf = pytest.importorskip("dal.integrations.hf_trainer")

SEQ = 16


def tiny_llama():
    torch.manual_seed(0)
    cfg = T.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, vocab_size=256, max_position_embeddings=128, use_cache=False)
    return T.LlamaForCausalLM(cfg)


def lora_llama():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                             task_type="CAUSAL_LM")
    return peft.get_peft_model(tiny_llama(), config)


class Tokens(torch.utils.data.Dataset):
    """16 random token sequences as the dict batches a causal-LM Trainer gets."""

    def __init__(self):
        self.ids = torch.randint(0, 256, (16, SEQ), generator=torch.Generator().manual_seed(3))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": self.ids[i]}


class StateProbe(T.TrainerCallback):
    """Records, at each step's start (after QATTrainerCallback ran), the states of the model's quantizers."""

    def __init__(self):
        self.states = {}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.states[state.global_step] = sorted({str(q.state) for _, q in quantizers(model)})


def train(model, out, resume=None, probe=None, export_path=None, example_inputs=None, **extra):
    args = T.TrainingArguments(output_dir=str(out), max_steps=4, per_device_train_batch_size=2, report_to=[],
                               use_cpu=True, save_steps=2, logging_steps=1, learning_rate=1e-2, seed=0,
                               disable_tqdm=True, **extra)
    cb = hf.QATTrainerCallback(calibrate_batches=2, quantize_after_steps=1, freeze_at_step=3,
                               export_path=export_path, example_inputs=example_inputs)
    trainer = T.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb] + ([probe] if probe else []))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def losses(trainer):
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


@pytest.fixture(scope="module", params=["llama", "llama+lora"])
def uninterrupted(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param.replace("+", "_"))
    build = tiny_llama if request.param == "llama" else lora_llama
    model = hf.prepare_for_trainer(build(), recipe="int8_balanced", hardware="a2000")
    probe = StateProbe()
    seen = []  # (training?, input_ids) of every forward, read at the embedding
    model.get_input_embeddings().register_forward_pre_hook(lambda m, args: seen.append((m.training, args[0].clone())))
    trainer = train(model, out / "a", probe=probe)
    probe.seen = seen
    return build, out, model, trainer, probe


def test_calibration_sees_the_trainers_own_batches(uninterrupted):
    _, _, _, _, probe = uninterrupted
    calib = [ids for training, ids in probe.seen if not training]
    trained = [ids for training, ids in probe.seen if training]
    assert len(calib) == 2 and len(trained) == 4  # calibrate_batches=2, max_steps=4
    # calibration draws from the train dataloader before the epoch starts: the epoch's first batches
    assert all(torch.equal(c, t) for c, t in zip(calib, trained[:2]))
    rows = {tuple(r.tolist()) for r in Tokens().ids}
    assert all(tuple(r.tolist()) in rows for c in calib for r in c)


def test_schedule_calibrates_then_quantizes_then_freezes(uninterrupted):
    _, _, model, trainer, probe = uninterrupted
    assert trainer.state.global_step == 4
    # step 0 in float (quantize_after_steps=1) but calibrated; from 1 quantizing; from 3 frozen
    assert probe.states == {0: ["off"], 1: ["quantize"], 2: ["quantize"], 3: ["frozen"]}
    scaled = [q for _, q in quantizers(model) if q.fmt.is_scaled]  # int8; FP16 casts have no scale
    assert scaled and all(q.initialized for q in scaled)


def test_resume_restores_scales_and_next_steps_exactly(uninterrupted):
    build, out, model, trainer, _ = uninterrupted
    # resume=True takes the newest checkpoint of output_dir: the uninterrupted run's checkpoint-2
    shutil.copytree(out / "a" / "checkpoint-2", out / "b" / "checkpoint-2")
    assert os.path.isfile(out / "b" / "checkpoint-2" / hf.CHECKPOINT_FILE)
    resumed_model = hf.prepare_for_trainer(build(), recipe="int8_balanced", hardware="a2000")
    resumed = train(resumed_model, out / "b", resume=True)
    want, got = hf.quantizer_state_dict(model), hf.quantizer_state_dict(resumed_model)
    assert want.keys() == got.keys() and want
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed_model.parameters()))
    a, b = losses(trainer), losses(resumed)
    assert a[3] == b[3] and a[4] == b[4]


def test_resume_without_the_dal_file_is_refused(uninterrupted, tmp_path):
    build, out, _, _, _ = uninterrupted
    shutil.copytree(out / "a" / "checkpoint-2", tmp_path / "checkpoint-2")
    os.remove(tmp_path / "checkpoint-2" / hf.CHECKPOINT_FILE)
    model = hf.prepare_for_trainer(build(), recipe="int8_balanced", hardware="a2000")
    with pytest.raises(FileNotFoundError, match=r"resumes at step 2.*dal_qat\.pt"):
        train(model, tmp_path, resume=True)


def test_unprepared_model_is_refused_when_the_trainer_is_built(tmp_path):
    args = T.TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM\) was never prepared by dal.*prepare_for_trainer"):
        T.Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(), callbacks=[hf.QATTrainerCallback()])


def test_other_recipe_than_the_models_is_refused(tmp_path):
    model = hf.prepare_for_trainer(tiny_llama(), recipe="int8_balanced", hardware="a2000")
    args = T.TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match=r"recipe='w4a8_lsq'.*prepared with recipe 'int8_balanced'"):
        T.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[hf.QATTrainerCallback("w4a8_lsq")])


def test_peft_after_prepare_is_refused_by_prepare_for_trainer_and_the_callback(tmp_path):
    peft = pytest.importorskip("peft")
    prepared = dal.prepare_qat(tiny_llama(), recipe="int8_balanced", hardware="a2000")
    wrapped = peft.get_peft_model(prepared, peft.LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.0))
    with pytest.raises(ValueError, match=r"applied after dal\.prepare_qat.*Apply peft first"):
        hf.prepare_for_trainer(wrapped)
    args = T.TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match=r"applied after dal\.prepare_qat.*Apply peft first"):
        T.Trainer(model=wrapped, args=args, train_dataset=Tokens(), callbacks=[hf.QATTrainerCallback()])


def test_gradient_checkpointing_and_accumulation_run(tmp_path, monkeypatch):
    import transformers.modeling_utils as mu

    checkpointed = []

    def counting_checkpoint(function, *args, **kwargs):  # torch's checkpoint, counted
        checkpointed.append(1)
        return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(mu, "checkpoint", counting_checkpoint)  # read when the Trainer enables checkpointing
    model = hf.prepare_for_trainer(tiny_llama(), recipe="int8_balanced", hardware="a2000")
    trainer = train(model, tmp_path, gradient_checkpointing=True, gradient_accumulation_steps=2)
    assert model.is_gradient_checkpointing
    assert trainer.state.global_step == 4 and trainer.state.epoch == 1.0  # 8 micro-batches of 2: all 16 rows
    assert len(checkpointed) == 2 * 8  # both decoder layers of each training micro-batch (calibration: eval, none)
    assert all(math.isfinite(v) for v in losses(trainer).values())
    assert {str(q.state) for _, q in quantizers(model)} == {"frozen"}


class TinyLM(nn.Module):
    """A model dal exports (the tiny Llama's mask code does not export today); not a PreTrainedModel,
    so the Trainer saves its plain state dict."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.fc1, self.fc2 = nn.Embedding(256, 32), nn.Linear(32, 64), nn.Linear(64, 256)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.fc2(F.relu(self.fc1(self.emb(input_ids))))
        return logits if labels is None else (F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits)


def test_export_at_the_end_of_training(tmp_path):
    onnx = pytest.importorskip("onnx")
    model = hf.prepare_for_trainer(TinyLM(), recipe="int8_balanced", hardware="a2000")
    path = tmp_path / "tiny.onnx"
    train(model, tmp_path, export_path=str(path), example_inputs=Tokens().ids[:1])
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)
    ops = {n.op_type for n in proto.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "MatMul"} <= ops or {"QuantizeLinear", "Gemm"} <= ops, ops
