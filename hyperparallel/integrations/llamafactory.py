"""LlamaFactory's full-parameter SFT with hyperparallel underneath.

Run it under torchrun, in an environment with LlamaFactory (``scripts/setup.sh
--with-llamafactory`` makes ``.venv-llamafactory``)::

    torchrun --nproc-per-node 2 -m hyperparallel.integrations.llamafactory CONFIG.yaml [key=value ...]

CONFIG.yaml is an ordinary LlamaFactory training config, the one ``llamafactory-cli train``
reads (``key=value`` arguments override it, as there), plus a ``hyperparallel:`` section
with :class:`~hyperparallel.integrations.transformers.HPArguments`' fields::

    finetuning_type: full
    hyperparallel:
      patch: true          # hp's fused Qwen3 / Qwen3-MoE modules
      optimizer: muon      # hp's Muon + AdamW; "hf" keeps the config's `optim`

Every rank runs LlamaFactory's own training entry (``llamafactory.train.tuner.run_exp``:
its arguments, data pipeline, chat templates, callbacks, loss plot and output directory)
with its SFT trainer, ``CustomSeq2SeqTrainer``, swapped for a subclass that also has
:class:`~hyperparallel.integrations.transformers.HPTrainerMixin`: the model is sharded by
``hp.fully_shard`` instead of wrapped in DDP, the optimizer is hp's, ``save_model`` writes
the HF directory from the shards. Its ``load_model`` builds the model on the meta device
(:func:`meta_load_model`): each rank reads only its rows of the weights, where LlamaFactory
loads the whole model on every rank. LlamaFactory has no plugin point for a distributed
backend and its CLI re-executes itself under torchrun, so the swaps happen here, in every
rank, before LlamaFactory loads the model.

Refused before LlamaFactory starts, naming the option: ``stage`` other than ``sft``,
``finetuning_type`` other than ``full`` (LoRA, freeze: hp trains every parameter),
``deepspeed``, ``fsdp`` (hp shards the model itself), ``fp16`` (hp's mixed precision is
``bf16``), another training backend (``use_ray``, ``use_mca``, ``use_hyper_parallel``), and
a ``model_name_or_path`` whose model hp cannot shard (no ``model.layers``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hyperparallel._log import log
from hyperparallel.checkpoint import hf
from hyperparallel.integrations.transformers import HPArguments, HPTrainerMixin, from_pretrained_meta

USAGE = "usage: torchrun --nproc-per-node N -m hyperparallel.integrations.llamafactory CONFIG.yaml [key=value ...]"
SECTION = "hyperparallel"
# LlamaFactory switches that route training away from its SFT trainer.
OTHER_BACKENDS = ("use_ray", "use_mca", "use_hyper_parallel")


class ConfigError(ValueError):
    """A config hyperparallel refuses; the message names the option and the fix."""


def read_config(path: str | os.PathLike, overrides: list[str]) -> tuple[dict[str, Any], HPArguments]:
    """The LlamaFactory config (as ``llamafactory-cli train`` merges file and ``key=value``
    overrides) without our section, and :class:`HPArguments` from that section."""
    from omegaconf import OmegaConf

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; pass a LlamaFactory training config (YAML or JSON)")
    merged = OmegaConf.merge(OmegaConf.load(path.absolute()), OmegaConf.from_cli(overrides))
    config = OmegaConf.to_container(merged)
    section = config.pop(SECTION, None) or {}
    fields = [field.name for field in dataclasses.fields(HPArguments)]
    if not isinstance(section, dict) or set(section) - set(fields):
        unknown = sorted(set(section) - set(fields)) if isinstance(section, dict) else section
        raise ConfigError(f"{SECTION}: unknown keys {unknown}; the keys are {', '.join(fields)}")
    try:
        return config, HPArguments(**section)
    except ValueError as error:
        raise ConfigError(f"{SECTION}: {error}") from None


def check_config(config: dict[str, Any]) -> None:
    """Refuse what hyperparallel does not train (see the module docstring)."""
    stage = config.get("stage", "sft")
    if stage != "sft":
        raise ConfigError(f"stage: {stage}: hyperparallel runs LlamaFactory's supervised fine-tuning: set stage: sft")
    finetuning = config.get("finetuning_type", "lora")  # LlamaFactory's default
    if finetuning != "full":
        raise ConfigError(
            f"finetuning_type: {finetuning}{'' if 'finetuning_type' in config else ' (LlamaFactory default)'}: "
            "hyperparallel trains every parameter (no LoRA or frozen layers): set finetuning_type: full"
        )
    if config.get("deepspeed"):
        raise ConfigError("deepspeed: hyperparallel shards the model itself (hp.fully_shard): remove deepspeed")
    if config.get("fsdp") or config.get("fsdp_config") or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        raise ConfigError("fsdp: hyperparallel shards the model itself (hp.fully_shard): remove fsdp and fsdp_config")
    if config.get("fp16"):
        raise ConfigError(
            "fp16: hyperparallel's mixed precision is bf16 (bf16 compute, fp32 gradient reduction): "
            "set bf16: true instead, or neither for fp32"
        )
    for key in OTHER_BACKENDS:
        if config.get(key):
            raise ConfigError(f"{key}: another training backend; hyperparallel replaces LlamaFactory's SFT trainer")


def check_model(config: dict[str, Any]) -> None:
    """Refuse a ``model_name_or_path`` hyperparallel cannot shard, from its config alone (a
    shapeless copy of the model on the meta device) before any weight or data is read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hyperparallel.trainer.model import decoder_layers

    path = config.get("model_name_or_path")
    if not path:
        raise ConfigError("model_name_or_path: missing; name the HF model (hub name or directory) to fine-tune")
    trust = bool(config.get("trust_remote_code", False))
    hub = {"cache_dir": config.get("cache_dir"), "revision": config.get("model_revision", "main"),
           "token": config.get("hf_hub_token")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, trust_remote_code=trust, **hub),
                                                 trust_remote_code=trust)
    try:
        decoder_layers(model)
    except TypeError:
        raise ConfigError(
            f"model_name_or_path: {path} is a {type(model).__name__}, which hyperparallel cannot shard: it shards "
            "HF decoder-only models whose decoder layers are model.layers (Qwen3, Qwen3-MoE, Llama, ...)"
        ) from None


def trainer_class(base: type, hp_args: HPArguments) -> type:
    """``base`` (LlamaFactory's CustomSeq2SeqTrainer) with :class:`HPTrainerMixin`, given ``hp_args``."""

    def __init__(self, *args, **kwargs):
        HPTrainerMixin.__init__(self, *args, hp_args=hp_args, **kwargs)

    return type(f"HP{base.__name__}", (HPTrainerMixin, base), {"__init__": __init__})


def meta_load_model(load_model: Callable) -> Callable:
    """LlamaFactory's ``load_model`` with the model built on the meta device
    (:func:`~hyperparallel.integrations.transformers.from_pretrained_meta`) where its weights are
    local safetensors: LlamaFactory changes it as it would the loaded one (config, gradient
    checkpointing, dtypes), then the trainer shards it and each rank reads only its rows. Loaded
    whole on every rank instead, as LlamaFactory does: a vocabulary it resizes (``resize_vocab``,
    added tokens), a model it does not train, weights that are not safetensors. A hub name's
    files are fetched into the HF cache first, as ``from_pretrained`` would."""

    def load(tokenizer, model_args, finetuning_args, is_trainable=False, add_valuehead=False):
        from llamafactory.model import loader

        if not is_trainable or add_valuehead or model_args.resize_vocab:
            if model_args.resize_vocab:
                log.info("resize_vocab: the model is loaded whole on every rank to grow its embeddings")
            return load_model(tokenizer, model_args, finetuning_args, is_trainable, add_valuehead)
        auto = loader.AutoModelForCausalLM
        loader.AutoModelForCausalLM = _meta_auto_class(auto)
        try:
            return load_model(tokenizer, model_args, finetuning_args, is_trainable, add_valuehead)
        finally:
            loader.AutoModelForCausalLM = auto

    return load


def _meta_auto_class(auto: type) -> type:
    """``auto`` (transformers' AutoModelForCausalLM, as LlamaFactory's loader calls it) whose
    ``from_pretrained`` builds on the meta device when the weights are local safetensors."""

    def from_pretrained(pretrained_model_name_or_path, *args, config=None, torch_dtype="auto", **kwargs):
        directory = None
        if not args and config is not None and kwargs.get("quantization_config") is None:
            directory = _safetensors_directory(pretrained_model_name_or_path, kwargs)
        if directory is None:
            return auto.from_pretrained(pretrained_model_name_or_path, *args, config=config, torch_dtype=torch_dtype,
                                        **kwargs)
        return from_pretrained_meta(directory, config=config, dtype=_dtype(config, torch_dtype),
                                    trust_remote_code=kwargs.get("trust_remote_code", False))

    return type(auto.__name__, (), {"from_pretrained": staticmethod(from_pretrained),
                                    "from_config": staticmethod(auto.from_config)})


def _safetensors_directory(name: str | os.PathLike, kwargs: dict[str, Any]) -> Path | None:
    """The local directory of model ``name``'s safetensors: ``name`` itself, or for a hub name its
    snapshot in the HF cache (its JSON and safetensors files fetched there as from_pretrained
    would, every rank sharing the one download); None when the weights are not safetensors."""
    directory = Path(name)
    if not directory.is_dir():
        from huggingface_hub import snapshot_download

        def fetch(patterns: list[str]) -> Path:
            return Path(snapshot_download(str(name), revision=kwargs.get("revision"), cache_dir=kwargs.get(
                "cache_dir"), token=kwargs.get("token"), allow_patterns=patterns))

        # The JSON files, then the weight files the index names (or the single file): what
        # from_pretrained fetches, not every safetensors file of the repo (consolidated.* ...).
        directory = fetch(["*.json"])
        fetch([path.name for path in hf.shard_files(directory)] if (directory / hf.INDEX).is_file() else [hf.SINGLE])
    if hf.has_safetensors(directory):
        return directory
    log.warning("%s has no safetensors: the model is loaded whole on every rank", name)
    return None


def _dtype(config, torch_dtype):
    """The parameters' dtype ``from_pretrained(torch_dtype=...)`` gives: ``"auto"`` is the config's."""
    import torch

    dtype = getattr(config, "dtype", None) if torch_dtype == "auto" else torch_dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype or torch.float32


def train(config: dict[str, Any], hp_args: HPArguments) -> None:
    """This rank's part of LlamaFactory's training run ``config``, with hyperparallel's trainer."""
    from llamafactory.train import tuner
    from llamafactory.train.sft import workflow

    workflow.CustomSeq2SeqTrainer = trainer_class(workflow.CustomSeq2SeqTrainer, hp_args)
    workflow.load_model = meta_load_model(workflow.load_model)
    tuner.run_exp(args=config)


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__.split("\n\n", 1)[1], file=sys.stderr)
        return 0 if argv else 2
    try:
        config, hp_args = read_config(argv[0], argv[1:])
        check_config(config)
        check_model(config)
    except ConfigError as error:
        # One message per node, from its local rank 0, which also fails the job. The other ranks
        # leave quietly with status 0: a failed rank makes torchrun stop the rest, which could
        # stop local rank 0 before it has said why.
        if os.environ.get("LOCAL_RANK", "0") != "0":
            return 0
        print(f"hyperparallel.integrations.llamafactory: {error}", file=sys.stderr, flush=True)
        return 2
    train(config, hp_args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
