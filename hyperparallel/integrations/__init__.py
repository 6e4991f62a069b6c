"""hyperparallel under other libraries' training loops.

- :mod:`hyperparallel.integrations.transformers`: HuggingFace's ``Trainer`` training with
  ``hp.fully_shard``, hp's Muon and ``hp.checkpoint`` (``HPTrainer``, or ``HPTrainerMixin``
  on any ``Trainer`` subclass).
- :mod:`hyperparallel.integrations.llamafactory`: LlamaFactory's full-parameter SFT with that
  trainer in every rank (``torchrun ... -m hyperparallel.integrations.llamafactory CONFIG.yaml``).

Each is imported on its own (they import transformers, and LlamaFactory). See
docs/integrations.md.
"""
