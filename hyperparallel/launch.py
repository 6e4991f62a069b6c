"""Run a function on N real ranks through torch's own launcher.

Every multi-process test and benchmark starts its ranks here::

    from hyperparallel.launch import run

    def work(scale):             # module-level: ranks import it by name
        hp.comm.init()
        ...
        return result            # comes back to the caller, per global rank

    results = run(work, nproc=2, args=(3.0,))             # {0: ..., 1: ...}
    results = run(work, nproc=2, nnodes=2, args=(3.0,))   # 4 ranks as 2 nodes x 2

``nnodes > 1`` starts one torch elastic agent per simulated node on this
machine, each with its own LOCAL_RANK/GROUP_RANK numbering, so the fabric
sees separate nodes and links them over c10d exactly as it would across
machines.
"""

from __future__ import annotations

import multiprocessing
import pickle
import socket
import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def free_port() -> int:
    """A TCP port on localhost that is free now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _config(nproc: int, nnodes: int, node_rank: int, port: int, run_id: str) -> LaunchConfig:
    return LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_configs={"rank": node_rank, "timeout": 120},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )


def _node_agent(fn, args, nproc, nnodes, node_rank, port, run_id, queue) -> None:
    try:
        results = elastic_launch(_config(nproc, nnodes, node_rank, port, run_id), fn)(*args)
        # Plain pickle: tensors travel by value, not as shared-memory handles
        # that die with this agent.
        queue.put((node_rank, pickle.dumps(dict(results)), None))  # keyed by global rank
    except BaseException as error:  # noqa: BLE001 -- reported to the caller, who raises
        queue.put((node_rank, pickle.dumps({}), repr(error)))


def run(fn: Callable[..., Any], nproc: int, args: tuple = (), nnodes: int = 1) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nproc * nnodes`` ranks; return {global rank: result}.

    Raises ``torch.distributed.elastic.multiprocessing.errors.ChildFailedError``
    (or RuntimeError for a simulated multi-node run) if any rank fails.
    """
    port, run_id = free_port(), uuid.uuid4().hex
    if nnodes == 1:
        return dict(elastic_launch(_config(nproc, 1, 0, port, run_id), fn)(*args))
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    agents = [
        context.Process(target=_node_agent, args=(fn, args, nproc, nnodes, node, port, run_id, queue))
        for node in range(nnodes)
    ]
    for agent in agents:
        agent.start()
    results: dict[int, Any] = {}
    errors = []
    for _ in agents:
        node, values, error = queue.get()
        results.update(pickle.loads(values))
        if error:
            errors.append(f"node {node}: {error}")
    for agent in agents:
        agent.join()
    if errors:
        raise RuntimeError("hyperparallel.launch: " + "; ".join(errors))
    return dict(sorted(results.items()))
