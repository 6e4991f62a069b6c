"""hp.comm.shutdown(): threads joined, the rank gone from the job, use afterwards refused, init afresh."""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hyperparallel as hp
from hyperparallel.launch import run


def _threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as comm:
            names.append(comm.read().strip())
    return sorted(name for name in names if name.startswith("hp-"))


def shut_down_and_start_again() -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    hp.comm.init()
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    hp.fully_shard(model[0])
    hp.fully_shard(model)
    model(torch.randn(4, 8)).sum().backward()
    running = _threads()
    communicator = hp.comm.get()

    hp.comm.shutdown()
    hp.comm.shutdown()  # idempotent
    after = _threads()
    with pytest.raises(RuntimeError, match=r"call hp.comm.init\(\) again: hp.comm.shutdown\(\) ran"):
        hp.comm.all_reduce(torch.ones(2))

    hp.comm.init()  # afresh: a new fabric, usable at once
    total = torch.ones(3)
    hp.comm.all_reduce(total)
    again = hp.fully_shard(nn.Linear(8, 2))
    again(torch.randn(4, 8)).sum().backward()

    # What was made before the shutdown is refused, by name.
    errors = []
    for use in (lambda: communicator.all_reduce(torch.ones(2), hp._C.ReduceOp.SUM), lambda: model(torch.randn(4, 8))):
        try:
            use()
        except hp.FabricError as error:
            errors.append(str(error))
    return {"running": running, "after": after, "errors": errors, "total": total.tolist(),
            "grad": again.weight.grad is not None}


def test_shutdown_joins_threads_refuses_use_and_init_starts_afresh():
    for result in run(shut_down_and_start_again, nproc=2).values():
        assert result["running"] == ["hp-heartbeat", "hp-reducer"]
        assert result["after"] == []
        assert len(result["errors"]) == 2, result["errors"]
        assert all("after hp.comm.shutdown()" in e for e in result["errors"]), result["errors"]
        assert result["total"] == [2.0, 2.0, 2.0] and result["grad"]


def peer_left() -> str | None:
    hp.comm.init()
    hp.comm.barrier()
    message = None
    if dist.get_rank() == 1:
        hp.comm.shutdown()
    else:
        # Rank 1 is alive (it waits below) but gone: named now, not when its process ends.
        with pytest.raises(hp.FabricError) as raised:
            hp.comm.barrier()
        message = str(raised.value)
    dist.barrier()
    return message


def test_a_peer_that_shut_down_is_named_while_it_still_runs():
    message = run(peer_left, nproc=2)[0]
    assert "rank 1 (local rank 1" in message and "left the job" in message, message
