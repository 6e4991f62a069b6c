"""The trainer's checkpoint: model and optimizer state plus a ``trainer`` entry, through hp.checkpoint.

The state dict is torch's (``torch.distributed.checkpoint.state_dict``: model and
optimizer state keyed by parameter name, DTensor shards as they are) plus::

    "trainer": {"step": int, "loader": {...}, "rng": [per-rank torch RNG states], "config": {...}}

so a checkpoint is readable by ``torch.distributed.checkpoint`` and resumes at the
exact sample with the same random state on every rank.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

try:  # layer 6; until it is merged, a plain DCP manager with the same interface (below)
    from hyperparallel.checkpoint import CheckpointManager
except ImportError:  # pragma: no cover - depends on the checkout
    CheckpointManager = None


def trainer_state(step: int, loader, config: dict[str, Any]) -> dict[str, Any]:
    """The non-tensor part: step, loader position, every rank's RNG state (same value on all ranks)."""
    rng = [None] * dist.get_world_size()
    dist.all_gather_object(rng, torch.get_rng_state().numpy().tobytes())
    return {"step": step, "loader": loader.state_dict(), "rng": rng, "config": config}


def full_state(model: nn.Module, optimizers: dict, trainer: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint holds (tensors are the live shards: loading writes them in place)."""
    model_sd, optim_sd = get_state_dict(model, list(optimizers.values()))
    return {"model": model_sd, "optim": optim_sd, "trainer": trainer}


def apply_state(model: nn.Module, optimizers: dict, state: dict[str, Any], loader) -> int:
    """Put a loaded ``state`` into the model, optimizers, loader and RNG; return its step."""
    set_state_dict(model, list(optimizers.values()), model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    trainer = state["trainer"]
    loader.load_state_dict(trainer["loader"])
    rng = trainer["rng"]
    if len(rng) == dist.get_world_size():  # a different world size starts its ranks' RNG afresh
        torch.set_rng_state(torch.frombuffer(bytearray(rng[dist.get_rank()]), dtype=torch.uint8))
    return int(trainer["step"])


class _DCPManager:
    """``hp.checkpoint.CheckpointManager``'s interface over torch DCP, for checkouts without layer 6.

    Each checkpoint is ``root/step_<N>``, written to a temporary directory and renamed
    when every rank has finished; the oldest beyond ``keep_last`` are removed.
    """

    def __init__(self, root: str | os.PathLike, *, keep_last: int = 3) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def _steps(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = [(int(m[1]), p) for p in self.root.iterdir() if (m := re.fullmatch(r"step_(\d+)", p.name))]
        return sorted(found)

    def save(self, step: int, state_dict: dict[str, Any], *, async_: bool = False) -> Path:
        import torch.distributed.checkpoint as dcp

        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".tmp_step_{step:08d}"
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        dcp.save(state_dict, checkpoint_id=str(tmp))
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for _, old in self._steps()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return final

    def latest(self) -> Path | None:
        steps = self._steps()
        return steps[-1][1] if steps else None

    def load_latest(self, state_dict: dict[str, Any]) -> int | None:
        import torch.distributed.checkpoint as dcp

        steps = self._steps()
        if not steps:
            return None
        dcp.load(state_dict, checkpoint_id=str(steps[-1][1]))
        return steps[-1][0]

    def wait(self) -> None:
        pass


def manager(root: str | os.PathLike, keep_last: int):
    """hp.checkpoint's CheckpointManager (or the DCP stand-in when hp.checkpoint is absent)."""
    if CheckpointManager is not None:
        return CheckpointManager(root, keep_last=keep_last)
    return _DCPManager(root, keep_last=keep_last)


def has_checkpoint(root: str | os.PathLike) -> bool:
    """Whether ``root`` holds a checkpoint, without starting ranks (for the launcher)."""
    root = Path(root)
    return root.is_dir() and any(p.is_dir() and not p.name.startswith(".") for p in root.iterdir())
