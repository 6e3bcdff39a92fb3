"""QATCallback: prepare_qat, calibration, freezing, checkpoints, export — as a Lightning callback.

Lifecycle (hook: what happens, and why there)

* ``setup`` — the network is replaced by ``prepare_qat(...)`` output. Setup runs before
  ``configure_optimizers`` (so optimizers hold the QAT model's parameters, which are the same
  Parameter objects anyway), before DDP wraps the model, and before a checkpoint is restored
  (so ``fit(ckpt_path=...)`` / ``test(ckpt_path=...)`` load scales into a model that already has
  its quantizers). Quantizers are then switched ``off`` until calibration: the sanity-check
  validation runs the float model and no observer sees validation data.
* ``on_train_start`` — unless the model is already calibrated (resumed from a checkpoint),
  ``dal.calibrate`` runs on the first ``calibrate_batches`` training batches (eval mode, no
  gradient, the rank's own shard under DDP; observers all-reduce, so all ranks get the same
  scales), then every quantizer quantizes.
* ``on_train_epoch_start`` — from ``freeze_observers_at_epoch`` on, quantizers keep their scales
  (``frozen``); from ``freeze_bn_at_epoch`` on, fused Conv+BN stop updating BN statistics.
  Epoch comparisons use ``>=``, so a resumed run lands in the same state.
* ``on_train_batch_end`` — steps the 2:4 sparsity schedule, when the recipe asks for sparsity.
* ``on_train_epoch_end`` — logs ``dal/quantizers_frozen``, ``dal/quantizers_active``,
  ``dal/bn_frozen``, ``dal/weight_sparsity``.
* ``on_save_checkpoint`` / ``on_load_checkpoint`` — ``checkpoint["dal"]`` holds dal's version,
  the recipe, the hardware model, the network's attribute name and one example input; loading a
  checkpoint of another recipe or hardware is refused.
* ``on_fit_end`` — the model is never converted in place. With ``export_path``, rank 0 exports
  QDQ ONNX and (``verify=True``) logs ``dal.verify``'s parity figures to the trainer's logger.

Multi-process (DDP): observers all-reduce their per-batch statistics, so scales and zero points
are identical on every rank at every step, in calibration and during QAT (moving-average
observers). DDP's default buffer broadcast (rank 0's buffers at each forward) is compatible:
quantizer buffers are equal already, and broadcasting BN running statistics keeps the folded
weights — hence the weight quantizers' inputs — equal across ranks too. Recipes with learnable
(LSQ) scales are refused under multi-process fits: their scales get a shape at calibration,
which this callback runs after Lightning wrapped the model (calibrate with ``dal.calibrate``
first, then fit under DDP).
"""
from __future__ import annotations

import warnings
from typing import Callable, Mapping, Optional

from torch import nn

from ..nn.tree import instance_attributes
from ._pl import Callback
from .checkpoint import KEY, check_payload, make_payload
from .target import as_tuple, first_sample, get_target, resolve_model_attr, set_target


class QATCallback(Callback):
    """Quantization-aware training for a LightningModule; see the module docstring for the lifecycle.

    Args:
        recipe, hardware: as for ``dal.prepare_qat``.
        calibrate_batches: training batches ``dal.calibrate`` sees before QAT starts.
        freeze_observers_at_epoch: epoch from which scales stop moving (None: never).
        freeze_bn_at_epoch: epoch from which BN statistics stop updating (None: never).
        export_path: write QDQ ONNX here at the end of fit (rank 0); None: no export.
        verify: with ``export_path``, run ``dal.verify`` and log the parity figures.
        teacher: a float model to distill from: the loss returned by ``training_step`` becomes
            ``(1 - alpha) * loss + alpha * T^2 * KL(teacher || student)``; logs
            ``dal/kd_task_loss`` and ``dal/kd_loss`` (see ``dal.lightning.distill_step``).
        distill: options for the teacher: ``T`` (4), ``alpha`` (0.5), ``features``
            ({student_module: teacher_module}, names after prepare_qat), ``feature_weight``,
            ``projection`` (learnable projections, registered on the LightningModule as
            ``dal_feature_proj`` so ``self.parameters()`` covers them).
        example_inputs: a tensor or tuple for ``prepare_qat`` and export; default: the
            LightningModule's ``example_input_array``, else (export only) one sample of the first
            calibration batch.
        quantize_outputs: as for ``prepare_qat`` (needs ``example_inputs``): output quantizers on
            the model's outputs; None: the recipe's ``quantize_outputs`` (default False: the
            outputs feed the loss and stay float).
        model_attr: which attribute of the LightningModule holds the network. Default: ``"model"``
            if present, else the first child module with parameters (the teacher excluded),
            else the LightningModule itself (``""`` forces that). When the network's forward
            has functional ops (``+``, ``cat``), prepare returns a new module, so the network
            must live in an attribute.
        calibrate_input_fn: ``batch -> (args, kwargs)`` for batches that are not
            ``(inputs, targets)`` / a tensor / a dict (as ``dal.calibrate``'s ``input_fn``).
        export_kwargs: extra keyword arguments for ``dal.export_onnx`` (``dynamic_batch``, ``opset``...).

    Example::

        from dal.lightning import QATCallback
        trainer = pl.Trainer(max_epochs=3, callbacks=[QATCallback("int8_balanced", "a2000",
                             calibrate_batches=16, freeze_bn_at_epoch=2, export_path="model.onnx")])
        trainer.fit(lit_module, train_loader)
    """

    def __init__(self, recipe="int8_balanced", hardware=None, calibrate_batches: int = 32,
                 freeze_observers_at_epoch: Optional[int] = None, freeze_bn_at_epoch: Optional[int] = None,
                 export_path=None, verify: bool = True, teacher: Optional[nn.Module] = None,
                 example_inputs=None, model_attr: Optional[str] = None, distill: Optional[Mapping] = None,
                 calibrate_input_fn: Optional[Callable] = None, export_kwargs: Optional[dict] = None,
                 quantize_outputs: Optional[bool] = None):
        super().__init__()
        from ..hardware import load_hardware
        from ..recipe import load_recipe

        if calibrate_batches < 1:
            raise ValueError(f"QATCallback: calibrate_batches={calibrate_batches} must be >= 1")
        self.recipe = load_recipe(recipe)
        hw = hardware if hardware is not None else self.recipe.hardware
        self.hardware = load_hardware(hw) if hw is not None else None
        self.calibrate_batches = int(calibrate_batches)
        self.freeze_observers_at_epoch = freeze_observers_at_epoch
        self.freeze_bn_at_epoch = freeze_bn_at_epoch
        self.export_path = export_path
        self.verify = verify
        self.example_inputs = as_tuple(example_inputs)
        self.quantize_outputs = quantize_outputs
        self.model_attr = model_attr
        self.calibrate_input_fn = calibrate_input_fn
        self.export_kwargs = dict(export_kwargs or {})
        self.teacher = teacher
        self.distill_step = None
        if teacher is not None:
            from .distill_step import DistillStep

            self.distill_step = DistillStep(teacher, **dict(distill or {}))
        elif distill:
            raise ValueError("QATCallback(distill=...) needs teacher=... (the float model)")
        self._attr: Optional[str] = None
        self._export_example: Optional[tuple] = None
        self.parity_report = None  # the dal.verify report of the end-of-fit export (rank 0)

    # ---- preparation -------------------------------------------------------------------------
    def network(self, pl_module) -> nn.Module:
        """The (prepared) network inside ``pl_module``."""
        return get_target(pl_module, self._attr)

    def setup(self, trainer, pl_module, stage: str) -> None:
        from ..prepare import prepare_qat, set_quantizer_state
        from ..prepare.state import quantizers

        self._attr = resolve_model_attr(pl_module, self.model_attr, exclude=(self.teacher,))
        net = get_target(pl_module, self._attr)
        if self.example_inputs is None:
            self.example_inputs = as_tuple(getattr(pl_module, "example_input_array", None))
        if not any(True for _ in quantizers(net)):  # a second fit / test on the same module: already prepared
            prepared = prepare_qat(net, recipe=self.recipe, hardware=self.hardware,
                                   example_inputs=self.example_inputs, quantize_outputs=self.quantize_outputs)
            set_target(pl_module, self._attr, prepared)
            if stage == "fit":  # only a fit calibrates (and trains) under the wrapper
                _refuse_learnable_under_ddp(trainer, prepared)
            # Float until calibrated: the sanity check validates the float model and no observer
            # sees validation data. A restored checkpoint overwrites these states right after.
            set_quantizer_state(prepared, "off")
        if stage == "fit" and self.distill_step is not None:
            example = self.example_inputs
            self.distill_step.attach(pl_module, self.network(pl_module), example)

    # ---- calibration and schedule ------------------------------------------------------------
    def _calibrated(self, net) -> bool:
        from ..prepare.state import quantizers

        return any(q.state in ("quantize", "frozen") for _, q in quantizers(net))

    def on_train_start(self, trainer, pl_module) -> None:
        from ..calibration import calibrate, model_inputs

        net = self.network(pl_module)
        if self._calibrated(net):
            return
        loader = trainer.train_dataloader
        if isinstance(loader, Mapping):
            loader = next(iter(loader.values()))
        elif isinstance(loader, (list, tuple)):
            loader = loader[0]
        unpack = self.calibrate_input_fn or (lambda b: model_inputs(b, 0))
        n = self.calibrate_batches
        seen = []

        def batches():
            for i, batch in enumerate(loader):
                if i >= n:
                    break
                batch = trainer.strategy.batch_to_device(batch)
                if not seen:
                    seen.append(first_sample(unpack(batch)[0]))
                yield batch

        calibrate(net, batches(), num_batches=n, input_fn=unpack, progress=False)
        self._export_example = seen[0] if seen else None

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        from ..prepare.state import freeze_bn, quantizers

        net = self.network(pl_module)
        epoch = trainer.current_epoch
        if self.freeze_observers_at_epoch is not None and epoch >= self.freeze_observers_at_epoch:
            for _, q in quantizers(net):
                if q.state == "quantize":
                    q.set_state("frozen")
        if self.freeze_bn_at_epoch is not None and epoch >= self.freeze_bn_at_epoch:
            freeze_bn(net, True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # 2:4 masks (recipe sparsity) follow their schedule once per optimizer step, as
        # dal.sparsity asks of a training loop; the step count lives in buffers, so it resumes.
        from ..sparsity.controller import CONTROLLER_ATTR

        ctl = instance_attributes(self.network(pl_module)).get(CONTROLLER_ATTR)
        if ctl is not None and (batch_idx + 1) % max(trainer.accumulate_grad_batches, 1) == 0:
            ctl.step()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        from .monitor import quant_state_metrics

        pl_module.log_dict(quant_state_metrics(self.network(pl_module)), on_step=False, on_epoch=True)

    # ---- checkpoints ---------------------------------------------------------------------------
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        # example_inputs must be exactly what prepare_qat saw (they decide the output quantizers);
        # the export example is kept apart so an export after resuming has an input too.
        checkpoint[KEY] = make_payload(self.recipe, self.hardware, self._attr,
                                       first_sample(self.example_inputs) if self.example_inputs else None,
                                       self.quantize_outputs)
        checkpoint[KEY]["export_example"] = self._export_example

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        check_payload(checkpoint.get(KEY), self.recipe, self.hardware, "the checkpoint")
        if self._export_example is None:
            self._export_example = checkpoint[KEY].get("export_example")

    # ---- end of fit ----------------------------------------------------------------------------
    def on_fit_end(self, trainer, pl_module) -> None:
        if self.export_path is None or not trainer.is_global_zero:
            return
        net = self.network(pl_module)
        example = self.example_inputs or self._export_example
        if example is None:
            warnings.warn("QATCallback: export_path is set but no example input is known; pass example_inputs=... "
                          "or set example_input_array on the LightningModule", stacklevel=2)
            return
        if not self._calibrated(net):
            warnings.warn("QATCallback: the model was never calibrated (no training step ran); not exporting",
                          stacklevel=2)
            return
        from .export_step import export_and_verify

        _, self.parity_report, metrics = export_and_verify(net, example, self.export_path, self.verify,
                                                           self.export_kwargs)
        for logger in trainer.loggers:
            if metrics:
                logger.log_metrics(metrics, step=trainer.global_step)
            logger.save()


def _refuse_learnable_under_ddp(trainer, net) -> None:
    """Learnable (LSQ) scales get their shape at calibration, and this callback calibrates in
    ``on_train_start``, after the strategy wrapped the model in DDP, which fixed every
    Parameter's size (0) when it wrapped: backward would fail with an opaque shape error."""
    from ..prepare.state import quantizers

    if getattr(trainer, "world_size", 1) <= 1:
        return
    learnable = [name for name, q in quantizers(net) if q.learnable]
    if learnable:
        shown = ", ".join(learnable[:5]) + (f" (+{len(learnable) - 5} more)" if len(learnable) > 5 else "")
        raise RuntimeError(
            f"QATCallback: the recipe makes {len(learnable)} quantizer(s) learnable ({shown}), which get "
            f"their shape at calibration, after Lightning wrapped the model for {trainer.world_size} "
            "processes; calibrate first without the callback (dal.prepare_qat + dal.calibrate, then fit "
            "the prepared model under DDP), or use a recipe without learnable: true")
