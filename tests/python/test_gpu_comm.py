"""The device fabric and collectives on CUDA, against Gloo's results, on real ranks sharing the
GPUs there are (several ranks on one GPU map each other's memory through CUDA IPC)."""

import os
import subprocess
import time

import pytest
import torch
import torch.distributed as dist
from test_faults import fail_one, start_ranks
from torch.testing import assert_close

import hyperparallel as hp
from hyperparallel.launch import run

pytestmark = pytest.mark.gpu

SIZES = [(1,), (7,), (1001,), (65537,), (5, 3), (2, 129), (3, 1000, 7)]


def _child_adds_one(queue, done):
    tensor, handle = queue.get()  # a CUDA tensor of the parent's, mapped over CUDA IPC
    event = torch.cuda.Event.from_ipc_handle(tensor.device, handle)
    torch.cuda.current_stream().wait_event(event)
    tensor.add_(1)
    torch.cuda.synchronize()
    done.put(tensor.sum().item())


def test_cuda_ipc_between_processes():
    """The machine's own CUDA IPC, through torch alone: if this fails, nothing below can work."""
    context = torch.multiprocessing.get_context("spawn")
    queue, done = context.Queue(), context.Queue()
    tensor = torch.arange(1000.0, device="cuda")
    event = torch.cuda.Event(interprocess=True)
    event.record()
    child = context.Process(target=_child_adds_one, args=(queue, done))
    child.start()
    queue.put((tensor, event.ipc_handle()))
    total = done.get(timeout=120)
    child.join(timeout=60)
    assert total == sum(range(1000)) + 1000
    torch.cuda.synchronize()
    assert tensor.sum().item() == total  # the child's writes landed in this process's memory


def _gloo_sum(x: torch.Tensor) -> torch.Tensor:
    """Gloo's sum over ranks, on the CPU. bf16: the exact gather summed in fp32, rounded once
    (Gloo rounds after every addition; we round once)."""
    gathered = [torch.empty_like(x.cpu()) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, x.cpu())
    return torch.stack([g.float() for g in gathered]).sum(0).to(x.dtype)


def _tolerance(dtype, any_order):
    if dtype == torch.bfloat16:
        return {"rtol": 1.6e-2, "atol": 1.6e-2}
    return {"rtol": 1e-6, "atol": 1e-6} if any_order else {"rtol": 0, "atol": 0}


def collectives_match_gloo(seed: int) -> dict:
    hp.comm.init()
    device = hp.comm.device()
    torch.cuda.set_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    hierarchical = hp.comm.get().topology.num_nodes > 1
    checked = 0
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SIZES:
            generator = torch.Generator().manual_seed(seed + 7919 * rank + sum(shape))
            x = torch.randn(shape, generator=generator).to(dtype)
            on_gpu = x.to(device)
            rows = shape[0]
            # The sum in rank order is Gloo's own for fp32 up to the order of additions.
            theirs = _gloo_sum(x)
            tol = _tolerance(dtype, hierarchical or world > 2)

            ours = on_gpu.clone()
            hp.comm.all_reduce(ours)
            assert_close(ours.cpu(), theirs, **tol)
            ours = on_gpu.clone()
            hp.comm.all_reduce(ours, op="avg")
            assert_close(ours.cpu(), (theirs.float() / world).to(dtype), **_tolerance(dtype, True))

            ours, reference = on_gpu.clone(), x.clone()
            hp.comm.broadcast(ours, src=world - 1)
            dist.broadcast(reference, src=world - 1)
            assert torch.equal(ours.cpu(), reference)

            per = -(-rows // world)
            begin, end = min(rows, per * rank), min(rows, per * (rank + 1))
            full = torch.full(shape, float("nan"), dtype=dtype, device=device)
            hp.comm.all_gather_into_tensor(full, on_gpu[begin:end].clone())
            gathered = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(gathered, x)
            expected = torch.cat([g[min(rows, per * r):min(rows, per * (r + 1))] for r, g in enumerate(gathered)])
            assert torch.equal(full.cpu(), expected)

            shard = torch.empty((end - begin, *shape[1:]), dtype=dtype, device=device)
            hp.comm.reduce_scatter_tensor(shard, on_gpu)
            assert_close(shard.cpu(), theirs[begin:end], **tol)
            hp.comm.reduce_scatter_tensor(shard, on_gpu, op="avg")
            assert_close(shard.cpu(), (theirs.float() / world).to(dtype)[begin:end], **_tolerance(dtype, True))
            checked += 1
    torch.cuda.synchronize()
    hp.comm.barrier()
    return {"checked": checked, "hierarchical": hierarchical, "device": str(device)}


@pytest.mark.parametrize("nproc", [2, 4])
def test_collectives_match_gloo(nproc):
    results = run(collectives_match_gloo, nproc=nproc, args=(1234,))
    assert sorted(results) == list(range(nproc))
    assert all(result["checked"] == 2 * len(SIZES) for result in results.values())


def test_collectives_match_gloo_across_two_nodes():
    results = run(collectives_match_gloo, nproc=2, nnodes=2, args=(99,))
    assert sorted(results) == [0, 1, 2, 3]
    assert all(result["hierarchical"] for result in results.values())


def symmetric_freed_while_a_peer_lags(rounds: int) -> dict[str, list[bool]]:
    """Each rank drops its symmetric gradient right after the reduce-scatter is enqueued, while the
    last rank is still sleeping before its own; the memory others then allocate and overwrite may
    be the freed slot. The last rank's sums must still be every rank's values. hp.comm.device_bytes
    counts the gradient while it lives, and not after."""
    hp.comm.init()
    device = hp.comm.device()
    torch.cuda.set_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows, cols = 2 * world, 1 << 18
    correct, counted = [], []
    for step in range(rounds):
        held = hp.comm.device_bytes()
        grad = hp.comm.symmetric_empty((rows, cols), torch.float32, device=device)
        grew = hp.comm.device_bytes() - held == grad.nbytes
        grad.fill_(rank + 1 + step)
        out = torch.empty(rows // world, cols, device=device)
        if rank == world - 1:
            time.sleep(0.5)
        hp.comm.reduce_scatter_symmetric(out, grad)
        del grad  # freed only once every peer's reduce has read it
        counted.append(grew and hp.comm.device_bytes() == held)
        junk = [torch.full((rows, cols), -1e9, device=device) for _ in range(4)]
        expected = sum(r + 1 + step for r in range(world))
        correct.append(bool((out == expected).all().item()))
        del junk
    hp.comm.barrier()
    return {"correct": correct, "counted": counted}


def test_symmetric_tensor_freed_while_a_peer_still_reads_it():
    results = run(symmetric_freed_while_a_peer_lags, nproc=2, args=(3,))
    assert all(all(r["correct"]) and all(r["counted"]) for r in results.values()), results


# A rank killed mid-collective: the survivors raise FabricError naming it; nothing is left
# in /dev/shm, and no process of the job holds GPU memory afterwards.
RANK_PROGRAM = """
import os, torch, hyperparallel as hp
hp.comm.init()
device = hp.comm.device()
torch.cuda.set_device(device)
x = torch.ones(1 << 22, device=device)
print("looping", flush=True)
while True:
    hp.comm.all_reduce(x, op="avg")
    hp.comm.reduce_scatter_tensor(torch.empty_like(hp.comm.local_rows(x)), x)
    torch.cuda.synchronize()
"""


def _gpu_pids() -> set[int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True, check=False).stdout
    return {int(line) for line in out.split() if line.strip().isdigit()}


def test_killed_rank_is_named_within_30s_and_nothing_is_left():
    world, victim = 3, 1
    ranks = start_ranks(world, heartbeat_timeout=5.0, program=RANK_PROGRAM)
    pids = {process.pid for process in ranks}
    fail_one(ranks, victim, "killed")
    # The job's own segments (named by the rank that made them): other jobs may share the machine.
    prefixes = tuple(f"hp-{os.getuid()}-{pid}-" for pid in pids)
    assert [name for name in os.listdir("/dev/shm") if name.startswith(prefixes)] == []
    deadline = time.monotonic() + 10
    while pids & _gpu_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pids & _gpu_pids(), "a rank of the killed job still holds GPU memory"
