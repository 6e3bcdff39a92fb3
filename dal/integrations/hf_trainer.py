"""Quantization-aware training inside the Hugging Face ``transformers.Trainer``.

Contract::

    from dal.integrations.hf_trainer import QATTrainerCallback, prepare_for_trainer
    model = prepare_for_trainer(model, recipe="int8_balanced", hardware="a2000")   # 1. before Trainer(...)
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[QATTrainerCallback(calibrate_batches=8, quantize_after_steps=0,
                                                    freeze_at_step=1000, export_path="model.onnx")])
    trainer.train()                       # or trainer.train(resume_from_checkpoint=...)

1. The model is prepared *before* ``Trainer(...)``: the Trainer holds the model object it was given
   and builds its optimizer from ``model.parameters()`` before any callback runs, so a callback
   cannot swap modules or add learnable scales. The callback refuses, at ``Trainer(...)`` already
   (``on_init_end``) and again at ``train()``, a model that holds no dal quantizer, naming
   ``prepare_for_trainer`` as the fix. ``prepare_for_trainer`` leaves every quantizer ``off``: the
   model computes in float until calibration. peft's LoRA must be applied before it
   (``get_peft_model`` then ``prepare_for_trainer``; the other order is refused, ``dal.nn.lora``).
2. ``on_train_begin`` — unless the model is calibrated already (by hand, or a resumed run), ``dal.calibrate``
   runs on the first ``calibrate_batches`` batches of the Trainer's own train dataloader (dict
   batches ``input_ids`` / ``attention_mask`` / ``labels`` are passed as keyword arguments).
3. Schedule, applied before each optimizer step from ``state.global_step`` (optimizer steps done,
   so gradient accumulation counts once per update), with ``>=`` so a resumed run lands in the same
   state: quantizers ``off`` (float) while ``global_step < quantize_after_steps``, then
   ``quantize``, then ``frozen`` (scales stop moving) once ``global_step >= freeze_at_step``.
4. Checkpoints: ``on_save`` writes ``dal_qat.pt`` into the Trainer's checkpoint folder
   (``<output_dir>/checkpoint-<global_step>``): the recipe, the hardware model and every quantizer's
   state_dict (scale, zero point, state, observer statistics). A peft model's Trainer checkpoint holds
   the adapter weights only, so the file is what brings the scales back. On resume (``global_step > 0``
   at ``on_train_begin``) the callback loads it from ``args.resume_from_checkpoint`` when that is a
   folder, else from ``<output_dir>/checkpoint-<global_step>``; scales and states then equal the
   interrupted run's exactly. Resuming a run of another recipe or hardware is refused.
5. ``on_train_end`` — with ``export_path``, ``dal.export_onnx`` writes QDQ ONNX from
   ``example_inputs`` (default: ``input_ids`` and ``attention_mask`` of the first calibration sample).

Gradient checkpointing and gradient accumulation need nothing from the callback. Checkpointing
may recompute a checkpointed forward during backward, and a quantizer whose scale tracks its input
(``quantize`` state, moving-average observer) may then update twice per step; frozen quantizers
(``freeze_at_step``) do not depend on the checkpointing setting.
"""
from __future__ import annotations

import os
from itertools import islice
from typing import Optional

import torch
from torch import nn
from transformers import TrainerCallback

#: the file ``on_save`` writes into each Trainer checkpoint folder
CHECKPOINT_FILE = "dal_qat.pt"


def prepare_for_trainer(model: nn.Module, recipe="int8_balanced", hardware=None, example_inputs=None,
                        **prepare_kwargs) -> nn.Module:
    """``dal.prepare_qat(model, recipe, hardware, example_inputs, **prepare_kwargs)`` with every
    quantizer ``off`` (float until :class:`QATTrainerCallback` calibrates); pass the returned model
    to ``Trainer(model=...)``. A model prepared already is returned as it is. A peft LoRA layer
    wrapped around a QAT layer (peft applied after dal) raises ``ValueError``."""
    from ..prepare import prepare_qat, set_quantizer_state
    from ..prepare.handle import find_prepared

    _refuse_peft_after_dal(model)
    if find_prepared(model) is not None:
        return model
    prepared = prepare_qat(model, recipe=recipe, hardware=hardware, example_inputs=example_inputs, **prepare_kwargs)
    return set_quantizer_state(prepared, "off")


def quantizer_state_dict(model: nn.Module) -> dict:
    """``{key: tensor}`` of the entries of ``model.state_dict()`` that belong to its FakeQuantizers
    (CPU copies): what ``load_state_dict(..., strict=False)`` needs to restore scales and states."""
    from ..quantizer import quantizers

    out = {}
    for path, q in quantizers(model):
        for key, value in q.state_dict().items():
            out[f"{path}.{key}" if path else key] = value.detach().cpu().clone()
    return out


class QATTrainerCallback(TrainerCallback):
    """Calibrate, schedule, checkpoint and export a prepared model inside ``transformers.Trainer``;
    the lifecycle and the contract are in the module docstring.

    Args:
        recipe, hardware: None (default): those the model was prepared with; given, they must be
            those (a name or a Recipe / HardwareModel), else ``ValueError``.
        calibrate_batches: train-dataloader batches ``dal.calibrate`` sees (>= 1).
        quantize_after_steps: optimizer steps trained in float (quantizers ``off``) after calibration.
        freeze_at_step: from this many optimizer steps on, quantizers are ``frozen``; None: never.
        export_path: QDQ ONNX written at the end of training; None: no export.
        example_inputs: a tensor or tuple for the export; default: the first calibration sample's
            ``input_ids`` and ``attention_mask``.
        export_kwargs: extra keyword arguments for ``dal.export_onnx``.
    """

    def __init__(self, recipe=None, hardware=None, calibrate_batches: int = 8, quantize_after_steps: int = 0,
                 freeze_at_step: Optional[int] = None, export_path=None, example_inputs=None,
                 export_kwargs: Optional[dict] = None):
        if int(calibrate_batches) < 1:
            raise ValueError(f"QATTrainerCallback: calibrate_batches={calibrate_batches} must be >= 1")
        if int(quantize_after_steps) < 0:
            raise ValueError(f"QATTrainerCallback: quantize_after_steps={quantize_after_steps} must be >= 0")
        if freeze_at_step is not None and int(freeze_at_step) < int(quantize_after_steps):
            raise ValueError(f"QATTrainerCallback: freeze_at_step={freeze_at_step} comes before "
                             f"quantize_after_steps={quantize_after_steps}; freeze at or after it")
        self.recipe, self.hardware = recipe, hardware
        self.calibrate_batches = int(calibrate_batches)
        self.quantize_after_steps = int(quantize_after_steps)
        self.freeze_at_step = None if freeze_at_step is None else int(freeze_at_step)
        self.export_path = export_path
        self.example_inputs = (example_inputs,) if torch.is_tensor(example_inputs) else example_inputs
        self.export_kwargs = dict(export_kwargs or {})
        self._export_example = None

    # ---- the model ---------------------------------------------------------------------------
    def _check(self, model) -> None:
        """Refuse a model dal never prepared, or one prepared with another recipe / hardware."""
        from ..prepare.handle import find_prepared

        handle = find_prepared(model) if model is not None else None
        if handle is None:
            raise ValueError(
                f"QATTrainerCallback: the Trainer's model ({type(model).__name__}) was never prepared by dal: it holds "
                "no fake quantizer. The Trainer builds its optimizer from the model it was given before any callback "
                "runs, so the callback cannot prepare it. Prepare it first and give the Trainer that model: "
                "model = dal.integrations.hf_trainer.prepare_for_trainer(model, recipe=..., hardware=...); "
                "Trainer(model=model, ..., callbacks=[QATTrainerCallback(...)])")
        _refuse_peft_after_dal(model)
        _same("recipe", self.recipe, handle.recipe)
        _same("hardware", self.hardware, handle.hardware)

    def target_state(self, step: int) -> str:
        """The quantizer state after ``step`` optimizer steps: off, quantize or frozen (module docstring)."""
        if self.freeze_at_step is not None and step >= self.freeze_at_step:
            return "frozen"
        return "quantize" if step >= self.quantize_after_steps else "off"

    def _schedule(self, model, step: int) -> None:
        from ..quantizer import quantizers

        state = self.target_state(step)
        for _, q in quantizers(model):
            if q.state != state and not (q.fmt.is_scaled and not q.initialized):  # never calibrated: left as is
                q.set_state(state)

    # ---- Trainer events ------------------------------------------------------------------------
    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._check(model)

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        self._check(model)
        if state.global_step > 0:
            self._restore(args, state, model)
        elif not _calibrated(model):
            self._calibrate(model, train_dataloader)
        self._schedule(model, state.global_step)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._schedule(model, state.global_step)

    def on_save(self, args, state, control, model=None, **kwargs):
        if not args.should_save:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        torch.save(self._payload(model), os.path.join(folder, CHECKPOINT_FILE))

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.export_path is None or not args.should_save:
            return
        from ..export import export_onnx

        example = self.example_inputs or self._export_example
        if example is None or not _calibrated(model):
            raise RuntimeError(f"QATTrainerCallback: cannot export to {self.export_path}: "
                               + ("no example input (pass example_inputs=...)" if example is None
                                  else "the model was never calibrated"))
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            export_onnx(model, tuple(t.to(device) for t in example), self.export_path, **self.export_kwargs)
        finally:
            model.train(was_training)

    # ---- calibration and checkpoints ---------------------------------------------------------------
    def _calibrate(self, model, loader) -> None:
        from ..calibration import calibrate, model_inputs

        if loader is None:
            raise RuntimeError("QATTrainerCallback: the Trainer gave no train dataloader to calibrate on")

        def batches():  # streamed; the first one also gives the export example
            for i, batch in enumerate(islice(iter(loader), self.calibrate_batches)):
                if i == 0:
                    self._export_example = _export_example(*model_inputs(batch, 0))
                yield batch

        calibrate(model, batches(), num_batches=self.calibrate_batches, progress=False)
        if not _calibrated(model):
            raise RuntimeError("QATTrainerCallback: calibration saw no batch (is the train dataloader empty?)")

    def _payload(self, model) -> dict:
        import dal

        from ..prepare.handle import find_prepared

        handle = find_prepared(model)
        return {"dal_version": dal.__version__, "recipe": handle.recipe.to_dict(),
                "hardware": handle.hardware.to_dict() if handle.hardware is not None else None,
                "quantizers": quantizer_state_dict(model), "export_example": self._export_example}

    def _restore(self, args, state, model) -> None:
        from ..prepare.handle import find_prepared

        given = args.resume_from_checkpoint
        folder = given if isinstance(given, str) and os.path.isdir(given) else \
            os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        path = os.path.join(folder, CHECKPOINT_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"QATTrainerCallback: training resumes at step {state.global_step} but {path} does not exist, so the "
                "quantizer scales cannot be restored; resume from a checkpoint written with this callback, and when "
                "it lies outside output_dir, name it in TrainingArguments(resume_from_checkpoint=...)")
        payload = torch.load(path, map_location="cpu", weights_only=False)
        handle = find_prepared(model)
        mine = handle.hardware.to_dict() if handle.hardware is not None else None
        if payload.get("recipe") != handle.recipe.to_dict() or payload.get("hardware") != mine:
            raise ValueError(f"{path} was written by a run with recipe {payload.get('recipe', {}).get('name')!r} and "
                             f"hardware {(payload.get('hardware') or {}).get('name')!r}; this model was prepared with "
                             f"{handle.recipe.name!r} / {getattr(handle.hardware, 'name', None)!r}")
        result = model.load_state_dict(payload["quantizers"], strict=False)
        if result.unexpected_keys:
            raise ValueError(f"{path}: quantizers {sorted(result.unexpected_keys)[:4]} are not in this model; "
                             "prepare it as the interrupted run did (same recipe, hardware, example_inputs)")
        self._export_example = self._export_example or payload.get("export_example")


def _export_example(args: tuple, kwargs: dict) -> Optional[tuple]:
    """One sample of a batch, as positional export inputs: the positional inputs, or ``input_ids``
    and ``attention_mask`` of a dict batch (without the mask, HF causal LMs call ``torch.diff``,
    which the ONNX exporter cannot write)."""
    if not args:
        args = tuple(kwargs[k] for k in ("input_ids", "attention_mask") if torch.is_tensor(kwargs.get(k)))
        if "input_ids" not in kwargs:
            return None
    return tuple(a[:1].detach().cpu().clone() for a in args if torch.is_tensor(a)) or None


def _refuse_peft_after_dal(model: nn.Module) -> None:
    """``dal.nn.lora.refuse_lora_around_qat`` for a model holding peft layers (peft is imported then)."""
    if any(type(m).__module__.startswith("peft.") for m in model.modules()):
        from ..nn.lora import refuse_lora_around_qat

        refuse_lora_around_qat(model)


def _calibrated(model) -> bool:
    from ..quantizer import quantizers

    return any(q.initialized for _, q in quantizers(model))


def _same(what: str, wanted, actual) -> None:
    """Raise ``ValueError`` when the callback was given a recipe / hardware that is not the model's."""
    if wanted is None:
        return
    name = wanted if isinstance(wanted, str) else getattr(wanted, "name", repr(wanted))
    have = getattr(actual, "name", None)
    if name != have:
        raise ValueError(f"QATTrainerCallback({what}={name!r}): the model was prepared with {what} {have!r}; "
                         f"pass {what}=None (the model's) or prepare it with {name!r}")
