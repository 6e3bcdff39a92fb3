"""Integrations with other training frameworks, each imported explicitly and never by ``import dal``:

* :mod:`dal.integrations.hf_trainer` — ``prepare_for_trainer`` and ``QATTrainerCallback`` for the
  Hugging Face ``transformers.Trainer``.

(PyTorch Lightning's callback lives in :mod:`dal.lightning`.)
"""
