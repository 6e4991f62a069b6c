"""Sharded, async, reshardable checkpoints in torch.distributed.checkpoint's format.

Each rank writes only its own shards, with parallel C++ pwrites (fsynced,
CRC-32 per file); a checkpoint appears under its name atomically, only once
complete; loading reshards to any world size or mesh and verifies every
file first. ``torch.distributed.checkpoint.load`` reads our checkpoints and
we read its. See docs/checkpoint.md.

Example::

    import hyperparallel as hp
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 10}
    hp.checkpoint.save(state, "ckpt/step_10")
    hp.checkpoint.load(state, "ckpt/step_10")   # in place, like DCP
    model.load_state_dict(state["model"])
"""

from hyperparallel.checkpoint._api import AsyncSave, async_save, load, save, verify
from hyperparallel.checkpoint._storage import CheckpointError, CheckpointMismatchError
from hyperparallel.checkpoint.manager import CheckpointManager

__all__ = ["AsyncSave", "CheckpointError", "CheckpointManager", "CheckpointMismatchError", "async_save", "load", "save", "verify"]
