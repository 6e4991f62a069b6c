"""hyperparallel: distributed training for PyTorch on a node-wide shared-memory fabric.

Example::

    import hyperparallel as hp
    comm = hp.comm.init()          # inside a torchrun-launched rank
    t = torch.ones(8)
    hp.comm.all_reduce(t)
"""

import importlib as _importlib

from hyperparallel import comm, fsdp
from hyperparallel._C import FabricError
from hyperparallel.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

# Imported on first use: hp.nn pulls in transformers, which takes seconds.
_LAZY = ("checkpoint", "nn", "optim")

__all__ = [
    "FSDPModule", "FabricError", "MixedPrecisionPolicy", "OffloadPolicy",
    "checkpoint", "comm", "fsdp", "fully_shard", "nn", "optim",
]


def __getattr__(name: str):
    if name in _LAZY:
        return _importlib.import_module(f"hyperparallel.{name}")
    raise AttributeError(f"module 'hyperparallel' has no attribute {name!r}")
