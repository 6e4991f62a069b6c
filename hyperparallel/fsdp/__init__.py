"""FSDP on the node's shared-memory fabric: ``hp.fully_shard`` (see docs/fsdp.md)."""

from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from hyperparallel.fsdp._fully_shard import (
    FSDPModule,
    comm_wait_seconds,
    fully_shard,
    register_fsdp_forward_method,
)

__all__ = [
    "CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "comm_wait_seconds", "fully_shard",
    "register_fsdp_forward_method",
]
