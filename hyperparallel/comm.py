"""Collectives on the node's shared-memory fabric, with c10d across nodes.

Inside a node, ranks share memory: a tensor from :func:`shared_empty` exists
once per node, and :func:`all_gather_shared` on it copies nothing (every rank
writes its own rows in place, the call waits until all rows are there). A
gradient written into :func:`symmetric_empty` is reduce-scattered in one pass.
The copying functions (:func:`all_reduce`, :func:`all_gather_into_tensor`, ...)
take ordinary tensors, like their ``torch.distributed`` namesakes. Rows are
split over ranks with ``torch.chunk`` semantics on dim 0, as FSDP2 shards.

Example (run under ``torchrun --nproc-per-node 2``)::

    import torch, hyperparallel as hp
    hp.comm.init()
    full = hp.comm.shared_empty((10, 4))          # same memory on every rank
    mine = hp.comm.local_rows(full)               # this rank's rows, a view
    mine.fill_(hp.comm.rank())
    hp.comm.all_gather_shared(full)               # a wait: nothing is copied
    t = torch.ones(3)
    hp.comm.all_reduce(t)                         # t == world size everywhere
    hp.comm.shutdown()                            # optional: it runs at exit by itself
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

from hyperparallel import _C
from hyperparallel._log import log

Op = Literal["sum", "avg"]
_OPS = {"sum": _C.ReduceOp.SUM, "avg": _C.ReduceOp.AVG}
_communicator: _C.Communicator | None = None
_cross_node: dist.ProcessGroup | None = None
# What the layers above must stop before the fabric goes (see shutdown()), latest first.
_teardowns: list[Callable[[], None]] = []
_exit_registered = False
_was_shut_down = False
# How long the exit waits for torch's Gloo workers to finish a collective still in flight.
_GLOO_EXIT_WAIT_S = 5.0


def init() -> _C.Communicator:
    """Start the fabric for this process (idempotent) and return it.

    Uses torch.distributed's default process group, starting one with Gloo from
    torchrun's environment if none exists (a lone process without torchrun gets
    a one-rank job). Across nodes, one c10d group per local rank links each
    rank with its counterparts.
    """
    global _communicator, _cross_node
    if _communicator is not None:
        return _communicator
    _register_exit()
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    topology = _C.Topology.from_env()
    if topology.world_size != dist.get_world_size() or topology.rank != dist.get_rank():
        raise RuntimeError(
            f"hyperparallel: the environment says {topology} but torch.distributed has rank "
            f"{dist.get_rank()} of {dist.get_world_size()}; launch with torchrun so both agree"
        )
    per_node = topology.local_world_size
    if topology.num_nodes > 1:
        backend = _cross_node_backend(per_node)
        for local in range(per_node):  # every rank creates every group, in the same order
            group = dist.new_group([node * per_node + local for node in range(topology.num_nodes)], backend=backend)
            if local == topology.local_rank:
                _cross_node = group
    store = dist.distributed_c10d._get_default_store()
    _communicator = _C.Communicator(topology, store, _cross_node)
    log.debug("hp.comm.init: the fabric is up: %s", topology)
    return _communicator


def _cross_node_backend(per_node: int) -> str:
    """Gloo for CPU tensors; NCCL for CUDA tensors where every rank of a node has a GPU of its
    own (NCCL refuses two ranks on one GPU: ranks sharing GPUs use Gloo for both).
    ``HP_CROSS_NODE_BACKEND`` overrides (e.g. ``gloo``)."""
    chosen = os.environ.get("HP_CROSS_NODE_BACKEND")
    if chosen:
        return chosen
    if torch.cuda.is_available() and dist.is_nccl_available() and torch.cuda.device_count() >= per_node:
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def device() -> torch.device:
    """The device this rank computes on: ``cuda:LOCAL_RANK`` (modulo the node's GPUs, so that
    several ranks can share one) where CUDA is available, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local % torch.cuda.device_count())


def shutdown() -> None:
    """End this process's part in hyperparallel: stop its threads, release its shared memory.

    In order: pending asynchronous checkpoint saves finish, the FSDP reducer thread runs
    what it was given and is joined, and the fabric's heartbeat thread is joined, this
    rank marked gone (a peer still waiting for it raises at once, naming it) and any
    segment name it still owns unlinked. The package drops its own references: shared
    memory stays mapped only while a tensor or a module sharded before still views it, and
    those raise a clear error if used for collectives afterwards; :func:`init` starts afresh.

    Idempotent, and not collective. It runs by itself at interpreter exit (after a normal
    return, ``sys.exit(n)`` or an uncaught exception; with or without
    ``dist.destroy_process_group()``), where it also waits until torch's Gloo worker
    threads have let go of the last collective's tensors: a worker that does so during
    finalisation aborts the process (docs/reliability.md). A rank killed by a signal
    (torchrun's SIGTERM) leaves nothing behind either: every segment's name is unlinked
    as soon as all ranks have mapped it.

    Example::

        hp.comm.init()
        ...
        hp.comm.shutdown()
        hp.comm.shutdown()   # no-op
    """
    global _communicator, _cross_node, _was_shut_down
    error = None
    while _teardowns:
        try:
            _teardowns.pop()()
        except Exception as e:  # noqa: BLE001 -- the rest still runs; the first error is raised below
            error = error or e
    if _communicator is not None:
        _communicator.shutdown()
        _was_shut_down = True
        log.debug("hp.comm.shutdown: the fabric is closed")
    _communicator = None
    _cross_node = None
    if error is not None:
        raise error


def _on_shutdown(teardown: Callable[[], None]) -> None:
    """Have :func:`shutdown` call ``teardown`` (once) before the fabric goes; latest first."""
    _register_exit()
    _teardowns.append(teardown)


def _register_exit() -> None:
    global _exit_registered
    if not _exit_registered:
        atexit.register(_at_exit)
        _exit_registered = True


def _at_exit() -> None:
    try:
        shutdown()
    except Exception as error:  # noqa: BLE001 -- at exit there is no caller left to raise to
        log.warning("exit: %s: %s", type(error).__name__, error)
    finally:
        if not _C.wait_gloo_workers_idle(_GLOO_EXIT_WAIT_S):
            log.debug("exit: a Gloo collective was still in flight after %.0f s", _GLOO_EXIT_WAIT_S)


def cross_node_group() -> dist.ProcessGroup | None:
    """This rank's c10d group with its counterparts (same local rank) on every node, ordered by
    node; None in a one-node job. Made by :func:`init`, which must have run."""
    get()
    return _cross_node


def get() -> _C.Communicator:
    """The communicator :func:`init` made; raises if it has not run."""
    if _communicator is None:
        again = " again: hp.comm.shutdown() ran" if _was_shut_down else " first"
        raise RuntimeError(f"hyperparallel.comm: call hp.comm.init(){again}")
    return _communicator


def rank() -> int:
    return get().topology.rank


def world_size() -> int:
    return get().topology.world_size


def barrier() -> None:
    get().barrier()


def broadcast(tensor: torch.Tensor, src: int = 0) -> None:
    """In place: every rank gets ``src``'s tensor."""
    get().broadcast(tensor, src)


def all_reduce(tensor: torch.Tensor, op: Op = "sum") -> None:
    """In place sum (or average) over all ranks."""
    get().all_reduce(tensor, _OPS[op])


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor) -> None:
    """``output`` (the full tensor) from every rank's ``input`` (its torch.chunk rows)."""
    get().all_gather(output, input)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Op = "sum") -> None:
    """``output`` = this rank's torch.chunk rows of the sum of every rank's ``input``."""
    get().reduce_scatter(output, input, _OPS[op])


def shared_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor that exists once per node; collective over the node's ranks."""
    return get().shared_empty(list(shape), dtype)


def symmetric_empty(
    shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """This rank's tensor in a window where every rank of the node has one; collective. On a
    GPU (``device="cuda"``) it is this rank's device memory, which every rank of the node maps."""
    return get().symmetric_empty(list(shape), dtype, torch.device("cpu" if device is None else device))


def local_rows(full: torch.Tensor) -> torch.Tensor:
    """This rank's torch.chunk rows of ``full`` (a view)."""
    topology = get().topology
    rows = full.shape[0]
    per = -(-rows // topology.world_size)
    begin = min(rows, per * topology.rank)
    return full.narrow(0, begin, min(rows, begin + per) - begin)


def acquire(tensor: torch.Tensor) -> None:
    """Wait until every rank is done reading ``tensor``'s last round before writing it again."""
    get().acquire(tensor)


def all_gather_shared(full: torch.Tensor) -> None:
    """Zero-copy all-gather of a :func:`shared_empty` tensor whose rows each rank wrote."""
    get().all_gather_shared(full)


def reduce_scatter_symmetric(output: torch.Tensor, input: torch.Tensor, op: Op = "sum") -> None:
    """One-pass reduce-scatter of every rank's :func:`symmetric_empty` ``input``."""
    get().reduce_scatter_symmetric(output, input, _OPS[op])


def stats() -> dict[str, int]:
    """Bytes this rank copied (memcpy) and read while reducing, since the last reset."""
    return get().stats()


def reset_stats() -> None:
    get().reset_stats()


def device_bytes() -> int:
    """Device memory this process holds in hyperparallel's peer-mapped buffers now (FSDP's
    shards and gradient windows, Muon's buffers, ``symmetric_empty`` tensors): what it holds
    beside torch's caching allocator, so that ``torch.cuda.max_memory_reserved() +
    device_bytes()`` is this rank's own device memory but for the CUDA context (and, across
    nodes, NCCL's buffers). 0 without GPUs."""
    return _C.device_held_bytes()
