"""Load HuggingFace safetensors checkpoints from a local directory into a (patched) model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hyperparallel.checkpoint import hf

# Config fields that fix parameter shapes: a checkpoint must agree on them.
_SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "moe_intermediate_size",
    "tie_word_embeddings",
)


class LoadResult(NamedTuple):
    """What :func:`load_pretrained` could not match: model parameters and checkpoint tensors."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _check_config(model: nn.Module, directory: Path) -> None:
    path = directory / "config.json"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: a HF checkpoint directory has config.json beside its weights"
        )
    saved = json.loads(path.read_text())
    config = model.config
    if saved.get("model_type") != config.model_type:
        raise ValueError(f"{path} is a {saved.get('model_type')!r} model; the model is {config.model_type!r}")
    for field in _SHAPE_FIELDS:
        if field in saved and getattr(config, field, saved[field]) != saved[field]:
            raise ValueError(f"{path} has {field}={saved[field]}, the model {getattr(config, field)}")


def _rows(name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """What a load writes into for model tensor ``tensor``, and the first row of the whole it holds:
    the tensor itself from row 0, or a DTensor's local shard and its offset along dim 0."""
    if not isinstance(tensor, DTensor):
        return tensor, 0
    local = tensor.to_local()
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(shape[1:]) != tuple(tensor.shape[1:]):
        raise ValueError(
            f"load_pretrained: {name} is sharded as {tensor.placements}; it fills shards split along dim 0 "
            "(hp.fully_shard's and FSDP2's default), or whole tensors"
        )
    return local, offset[0]


class _Target:
    """The model's tensors by name, and which of them (or which expert rows) the checkpoint covered.

    Coverage is kept per tensor object, so tied weights are filled through either name. A
    sharded parameter (a DTensor split along dim 0, as ``hp.fully_shard`` and FSDP2 keep them)
    counts as covered when the checkpoint has it whole; only this rank's rows are read and copied.
    """

    def __init__(self, model: nn.Module):
        persistent = set(model.state_dict().keys())
        named = [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]
        self.tensors = {name: t for name, t in named if name in persistent}
        self.filled: dict[int, set] = {id(t): set() for t in self.tensors.values()}

    def name(self, key: str) -> str | None:
        """The model's name for checkpoint key ``key`` (a base model drops the ``model.`` prefix)."""
        if key in self.tensors:
            return key
        stripped = key.removeprefix("model.")
        return stripped if stripped in self.tensors else None

    def assign(self, key: str, shard: hf.SafetensorsFile) -> bool:
        expert = hf.expert_key(key)
        name = self.name(expert.stacked if expert else key)
        if name is None:
            return False
        tensor = self.tensors[name]
        local, first = _rows(name, tensor)
        if expert is None:
            if shard.shape(key) != tuple(tensor.shape):
                raise ValueError(f"{key} is {shard.shape(key)}; the model's {name} is {tuple(tensor.shape)}")
            if local is tensor:
                local.copy_(shard.read([key])[key])
            elif local.shape[0]:
                local.copy_(shard.read_rows(key, first, first + local.shape[0]))
            self.filled[id(tensor)].add(None)
            return True
        if expert.index >= tensor.shape[0]:
            raise ValueError(f"{key}: expert {expert.index} does not exist; the model has {tensor.shape[0]}")
        expected = tuple(hf.expert_rows(torch.empty(tensor.shape, device="meta"), expert).shape)
        if shard.shape(key) != expected:
            raise ValueError(f"{key} is {shard.shape(key)}; expected {expected} for {name}[{expert.index}]")
        if first <= expert.index < first + local.shape[0]:  # an expert of this rank's rows
            hf.expert_rows(local, expert._replace(index=expert.index - first)).copy_(shard.read([key])[key])
        self.filled[id(tensor)].add((expert.index, expert.part))
        return True

    def missing(self) -> list[str]:
        missing = []
        for name, tensor in self.tensors.items():
            got = self.filled[id(tensor)]
            if None in got:
                continue
            parts = hf.STACKED_PARTS.get(name.rsplit(".", 1)[-1])
            if parts and tensor.dim() == 3 and all((e, p) in got for e in range(tensor.shape[0]) for p in parts):
                continue
            missing.append(name)
        return missing


def load_pretrained(model: nn.Module, directory: str | os.PathLike, *, strict: bool = True) -> LoadResult:
    """Copy HF weights from a local checkpoint directory into ``model`` in place.

    Reads ``config.json`` (its model type and shape fields must match
    ``model.config``) and ``model.safetensors`` or the shards listed in
    ``model.safetensors.index.json``. Per-expert tensors
    (``...experts.<e>.{gate,up,down}_proj.weight``, what ``save_pretrained``
    writes) land in the stacked ``gate_up_proj`` / ``down_proj`` parameters of
    transformers 5.x; stacked tensors load as they are. Values are copied
    into the existing parameters (converting dtype), so a patched model, or one
    whose parameters were swapped for views into shared memory, keeps its
    tensors. Tied weights are filled through either name. In a sharded model
    (``hp.fully_shard`` or FSDP2, e.g. built on the meta device) each rank
    reads and copies only its own rows of every parameter: the whole model is
    never in one rank's memory.

    Args:
        model: a (patched or not) Qwen3 / Qwen3-MoE model, or any HF model with
            matching parameter names; whole, or sharded along dim 0.
        directory: the checkpoint directory.
        strict: raise if a parameter is left unfilled or a checkpoint tensor
            has no parameter.

    Returns:
        The unfilled parameter names and unused checkpoint keys.

    Example::

        import hyperparallel.nn as hpnn
        from transformers import AutoConfig, AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("ckpt/"))
        hpnn.patch(model)
        hpnn.load_pretrained(model, "ckpt/")
    """
    directory = Path(directory)
    _check_config(model, directory)
    target = _Target(model)
    unexpected = []
    with torch.no_grad():
        for path in hf.shard_files(directory):
            shard = hf.SafetensorsFile(path)
            for key in shard.names:
                if not target.assign(key, shard):
                    unexpected.append(key)
    result = LoadResult(target.missing(), unexpected)
    if strict and (result.missing_keys or result.unexpected_keys):
        raise KeyError(
            f"load_pretrained({directory}): missing {result.missing_keys[:8]} "
            f"({len(result.missing_keys)}), unexpected {result.unexpected_keys[:8]} ({len(result.unexpected_keys)})"
        )
    return result
