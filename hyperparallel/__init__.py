"""hyperparallel: distributed training for PyTorch on a node-wide shared-memory fabric.

Example::

    import hyperparallel as hp
    comm = hp.comm.init()          # inside a torchrun-launched rank
    t = torch.ones(8)
    hp.comm.all_reduce(t)
"""

from hyperparallel import comm
from hyperparallel._C import FabricError

__all__ = ["FabricError", "comm"]
