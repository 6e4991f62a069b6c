"""The trainer's checkpoint: model and optimizer state plus a ``trainer`` entry, through hp.checkpoint.

The state dict is torch's (``torch.distributed.checkpoint.state_dict``: model and
optimizer state keyed by parameter name, DTensor shards as they are) plus::

    "trainer": {"step": int, "loader": {...}, "rng": [per-rank RNG states], "config": {...}}

so a checkpoint is readable by ``torch.distributed.checkpoint`` and resumes at the
exact sample with the same random state on every rank: torch's CPU generator and, on a
GPU, the rank's CUDA generator. A CPU run's checkpoint resumed on GPUs leaves their
generators as seeded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hyperparallel.checkpoint import CheckpointManager


def trainer_state(step: int, loader, config: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The non-tensor part: step, loader position, every rank's RNG states (the same value on all ranks)."""
    return {"step": step, "loader": loader.state_dict(), "rng": rng_states(device), "config": config}


def rng_states(device: torch.device) -> list[dict[str, bytes]]:
    """Every rank's generator states, in rank order (a collective): ``{"cpu": ..., "cuda": ...}``,
    the CUDA generator's where the rank trains on ``device`` of type cuda."""
    mine = {"cpu": torch.get_rng_state().numpy().tobytes()}
    if device.type == "cuda":
        mine["cuda"] = torch.cuda.get_rng_state(device).numpy().tobytes()
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states


def restore_rng(saved, device: torch.device) -> None:
    """Set this rank's generators from its entry of a checkpoint's ``rng``: ``{"cpu": ..., "cuda": ...}``,
    or the CPU state's bytes alone (checkpoints written before the GPU's was kept)."""
    if isinstance(saved, bytes):
        saved = {"cpu": saved}
    torch.set_rng_state(torch.frombuffer(bytearray(saved["cpu"]), dtype=torch.uint8))
    if device.type == "cuda" and "cuda" in saved:
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(saved["cuda"]), dtype=torch.uint8), device)


def full_state(model: nn.Module, optimizers: dict, trainer: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint holds (tensors are the live shards: loading writes them in place)."""
    model_sd, optim_sd = get_state_dict(model, list(optimizers.values()))
    return {"model": model_sd, "optim": optim_sd, "trainer": trainer}


def apply_state(model: nn.Module, optimizers: dict, state: dict[str, Any], loader, device: torch.device) -> int:
    """Put a loaded ``state`` into the model, optimizers, loader and RNG; return its step."""
    set_state_dict(model, list(optimizers.values()), model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    trainer = state["trainer"]
    loader.load_state_dict(trainer["loader"])
    rng = trainer["rng"]
    if len(rng) == dist.get_world_size():  # a different world size starts its ranks' RNG afresh
        restore_rng(rng[dist.get_rank()], device)
    return int(trainer["step"])


def manager(root: str | os.PathLike, keep_last: int) -> CheckpointManager:
    """The run's checkpoints: ``root/step_<N>``, the newest ``keep_last`` kept (hp.checkpoint)."""
    return CheckpointManager(root, keep_last=keep_last)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root``, or None (checked without starting ranks)."""
    return CheckpointManager(root).latest()
