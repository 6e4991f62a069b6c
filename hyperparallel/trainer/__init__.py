"""``hyperparallel train``: a YAML-driven trainer over hp.fully_shard, hp.nn and hp.optim.

Modules, one idea each: ``config`` (the keys and their checks), ``data`` (the
token file format, its checks, the loader), ``tokenize`` (text -> token file),
``model`` (build, patch, checkpoint activations, shard), ``optim`` (optimizers,
LR schedule, clipping), ``state`` (checkpoints), ``loop`` (the Trainer: setup,
train_step, train), ``report`` (phase timing, progress, metrics, plot, summary),
``estimate`` (the dry-run memory estimate), ``run`` (the CLI).

Example::

    hyperparallel train examples/default.yaml --nproc 2 train.steps=50
"""

from hyperparallel.trainer.config import Config, ConfigError, load_config

__all__ = ["Config", "ConfigError", "load_config"]
