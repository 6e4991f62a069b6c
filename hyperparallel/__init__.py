"""hyperparallel: distributed training for PyTorch on a node-wide shared-memory fabric.

Example::

    import hyperparallel as hp
    comm = hp.comm.init()          # inside a torchrun-launched rank
    t = torch.ones(8)
    hp.comm.all_reduce(t)
"""

from hyperparallel import comm, fsdp
from hyperparallel._C import FabricError
from hyperparallel.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

__all__ = ["FSDPModule", "FabricError", "MixedPrecisionPolicy", "OffloadPolicy", "comm", "fsdp", "fully_shard"]
