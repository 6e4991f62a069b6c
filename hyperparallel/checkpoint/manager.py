"""CheckpointManager: numbered checkpoints under one root, newest-complete lookup, keep-last-k."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hyperparallel.checkpoint._api import (
    MANIFEST,
    METADATA,
    AsyncSave,
    _async_save,
    _group,
    _remove_if_abandoned,
    load,
    save,
)
from hyperparallel.checkpoint._storage import CheckpointError

_STEP = re.compile(r"^step_(\d{8,})$")
_STAGING = re.compile(r"^\.step_(\d{8,})\.partial$")


class CheckpointManager:
    """Checkpoints ``root/step_{step:08d}``, keeping the newest ``keep_last`` complete ones.

    A checkpoint is complete once its directory exists under its final name
    (saves publish it atomically, after fsyncing every file and recording
    their checksums); older ones are removed only after a newer one is
    complete. A save that fails removes its hidden ``.step_….partial``
    directory; one interrupted by a crash or a kill leaves it, and the next
    manager on this root removes it when it starts (unless a live save still
    holds it).

    Example::

        manager = hp.checkpoint.CheckpointManager("runs/ckpt", keep_last=3)
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 0}
        start = manager.load_latest(state) or 0
        for step in range(start, steps):
            ...
            if step % 100 == 0:
                manager.save(step, {**state, "step": step}, async_=True)
        manager.wait()
    """

    def __init__(self, root: str | os.PathLike, *, keep_last: int = 3, process_group=None) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.root = Path(root).absolute()
        self.keep_last = keep_last
        self.process_group = process_group
        self._pending: AsyncSave | None = None
        self._sweep()

    def _sweep(self) -> None:
        """Remove what killed saves left under root (staging directories no live save holds)."""
        if self.root.is_dir():
            for entry in self.root.iterdir():
                if _STAGING.match(entry.name):
                    _remove_if_abandoned(entry)

    def path(self, step: int) -> Path:
        """Where checkpoint ``step`` lives: ``root/step_{step:08d}``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.root / f"step_{step:08d}"

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints under root, ascending."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            match = _STEP.match(entry.name)
            if match and (entry / METADATA).is_file() and (entry / MANIFEST).is_file():
                found.append(int(match.group(1)))
        return sorted(found)

    def save(self, step: int, state_dict: dict[str, Any], *, async_: bool = False) -> Path:
        """Save ``state_dict`` as checkpoint ``step`` (collective); returns its path.

        With ``async_=True`` the state is copied and written in the background
        (a previous pending save is waited for first); :meth:`wait` or the next
        save waits for it.
        """
        self.wait()
        path = self.path(step)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise CheckpointError(f"cannot make the checkpoint directory {self.root}: {error}; "
                                  "set it to a writable directory") from None
        if async_:
            self._pending = _async_save(state_dict, path, self.process_group, self._retain)
        else:
            save(state_dict, path, process_group=self.process_group)
            self._retain_on_rank0()
        return path

    def wait(self) -> None:
        """Wait for a pending async save (raising its error, if any)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        steps = self.steps()
        return self.path(steps[-1]) if steps else None

    def load_latest(self, state_dict: dict[str, Any]) -> int | None:
        """Load the newest complete checkpoint into ``state_dict`` in place; its step, or None if there is none.

        Every rank loads the same one (rank 0 chooses).
        """
        self.wait()
        steps = self.steps()
        step = steps[-1] if steps else None
        group, _, _ = _group(self.process_group)
        if group is not None:
            box = [step]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
            step = box[0]
        if step is None:
            return None
        load(state_dict, self.path(step), process_group=self.process_group)
        return step

    def _retain_on_rank0(self) -> None:
        _, rank, _ = _group(self.process_group)
        if rank == 0:
            self._retain(None)

    def _retain(self, _published: Path | None) -> None:
        """Remove all but the newest keep_last complete checkpoints (runs on the coordinator only)."""
        steps = self.steps()
        for step in steps[: max(0, len(steps) - self.keep_last)]:
            shutil.rmtree(self.path(step), ignore_errors=True)
