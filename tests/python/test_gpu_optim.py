"""hp.optim.Muon on CUDA against torch.optim.Muon on the same GPU, and 2 ranks sharing the GPU
(hp.fully_shard + hp.optim.Muon) against one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_muon_distributed import peer_bytes_per_step
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import hyperparallel as hp
import hyperparallel.optim as hpo
from hyperparallel.launch import run

pytestmark = pytest.mark.gpu

# Wide, tall, square, repeated shapes (one batch), and expert stacks; the last two are large enough
# for the symmetric halves (newton_schulz.cpp), the rest are not.
SHAPES = [(24, 40), (40, 24), (32, 32), (32, 32), (7, 12), (260, 300), (300, 260), (6, 48, 80), (2, 256, 320),
          (320, 256)]


def _params(seed: int, device) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter((torch.randn(shape, generator=generator) * 0.1).to(device)) for shape in SHAPES]


def _grads(step: int, device) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=generator).to(device) for shape in SHAPES]


def _as_matrices(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """torch.optim.Muon takes 2-D parameters: an expert stack is one matrix per expert."""
    out = []
    for p in params:
        out += list(p.unbind(0)) if p.dim() == 3 else [p]
    return out


@pytest.mark.parametrize("nesterov", [True, False])
def test_updates_follow_torch_muon_on_cuda(nesterov):
    device = torch.device("cuda", 0)
    ours = _params(0, device)
    theirs = [nn.Parameter(m.detach().clone()) for m in _as_matrices([p.detach() for p in _params(0, device)])]
    kwargs = {"lr": 2e-3, "weight_decay": 0.1, "nesterov": nesterov, "adjust_lr_fn": "match_rms_adamw"}
    optimizer, reference = hpo.Muon(ours, **kwargs), torch.optim.Muon(theirs, **kwargs)
    initial = [m.detach().clone() for m in theirs]
    worst = 0.0
    for step in range(10):
        grads = _grads(step, device)
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        # A gradient with other strides takes ATen's momentum instead of the one-pass kernel.
        ours[0].grad = grads[0].t().contiguous().t()
        for p, g in zip(theirs, _as_matrices(grads)):
            p.grad = g.clone()
        optimizer.step()
        reference.step()
        for got, expected in zip(_as_matrices([p.detach() for p in ours]), theirs):
            worst = max(worst, (got - expected).abs().max().item())
    # Batched cuBLAS products may round the last bits differently from torch's one matrix at
    # a time, and Newton-Schulz in bf16 carries that on; a wrong update (a transpose, a scale)
    # would be as large as the change itself.
    change = max((p.detach() - q).abs().max().item() for p, q in zip(theirs, initial))
    print(f"hp.optim.Muon on CUDA vs torch.optim.Muon, 10 steps: max |param diff| {worst:.3g} "
          f"(the parameters moved by up to {change:.3g})")
    assert worst <= 0.05 * change


def sharded_muon(steps: int, nodes: int = 1) -> tuple:
    """hp.fully_shard + hp.optim.Muon on the GPU: FSDP over one node's ranks, or HSDP (shards within
    a node, replicated across ``nodes``). Returns the full parameters, each rank's owned matrices,
    bytes pulled from peers and matrices orthogonalised."""
    hp.comm.init()
    device = hp.comm.device()
    torch.cuda.set_device(device)
    world = dist.get_world_size()
    topology = hp.comm.get().topology
    shards, shard = topology.local_world_size, topology.local_rank
    if nodes > 1:
        mesh = init_device_mesh("cuda", (nodes, shards), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cuda", (world,))
    model = nn.ParameterList(_params(0, device))
    hp.fully_shard(model, mesh=mesh)
    optimizer = hpo.Muon(list(model.parameters()), lr=2e-3, adjust_lr_fn="match_rms_adamw")
    hpo.reset_stats()
    for step in range(steps):
        # Every replica gets the same gradients, as HSDP's all-reduce leaves them.
        for p, g in zip(model.parameters(), _grads(step, device)):
            local = torch.chunk(g, shards)[shard]
            p.grad = DTensor.from_local(local.contiguous(), mesh, p.placements, shape=p.shape, stride=p.stride())
        optimizer.step()
    locals_ = [p.to_local().detach().cpu() for p in model.parameters()]
    owned, stats = optimizer.owned(), hpo.stats()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (locals_, owned, stats["muon_peer_bytes"], stats["ns_matrices"]))
    # The full parameters as each node holds them.
    full = [[torch.cat([everyone[node * shards + s][0][i] for s in range(shards)]) for i in range(len(SHAPES))]
            for node in range(nodes)]
    return full, {r: {"owned": o, "peer_bytes": moved, "ns_matrices": n} for r, (_, o, moved, n) in enumerate(everyone)}


def _one_process(steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The same steps in this process: (initial, final) parameters on the CPU."""
    device = torch.device("cuda", 0)
    ours = _params(0, device)
    initial = [p.detach().cpu().clone() for p in ours]
    optimizer = hpo.Muon(ours, lr=2e-3, adjust_lr_fn="match_rms_adamw")
    for step in range(steps):
        for p, g in zip(ours, _grads(step, device)):
            p.grad = g
        optimizer.step()
    return initial, [p.detach().cpu() for p in ours]


def _assert_each_matrix_once(ranks: dict, steps: int) -> None:
    matrices = sum(shape[0] if len(shape) == 3 else 1 for shape in SHAPES)
    owned = [o for r in ranks.values() for o in r["owned"]]
    assert sorted(owned) == sorted(set(owned)) and len(owned) == matrices  # each matrix exactly once in the job
    assert sum(r["ns_matrices"] for r in ranks.values()) == steps * matrices


def _assert_close(label: str, full: list[torch.Tensor], initial: list, expected: list) -> None:
    worst = max((got - p).abs().max().item() for got, p in zip(full, expected))
    change = max((p - q).abs().max().item() for p, q in zip(expected, initial))
    print(f"hp.optim.Muon, {label} vs 1 process, 10 steps: max |param diff| {worst:.3g} "
          f"(the parameters moved by up to {change:.3g})")
    assert worst <= 0.05 * change


def test_private_batches_hold_no_memory_between_steps():
    # The bf16 copies Newton-Schulz works on live for the step only (the caching allocator's
    # memory, reused by the next forward). The first steps make what stays (the momentum,
    # cuBLAS's workspace); a later step holds nothing more after it.
    device = torch.device("cuda", 0)
    ours = _params(0, device)
    optimizer = hpo.Muon(ours, lr=2e-3, adjust_lr_fn="match_rms_adamw")
    for step in range(2):
        for p, g in zip(ours, _grads(step, device)):
            p.grad = g
        optimizer.step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    optimizer.step()
    torch.cuda.synchronize()
    copies = sum(p.numel() * 2 for p in ours)
    assert torch.cuda.max_memory_allocated(device) - before >= copies  # lent during the step
    assert torch.cuda.memory_allocated(device) == before  # and given back


def test_one_rank_fully_sharded_equals_one_process():
    # One rank's shards are whole parameters: the plan treats them as plain ones (no peer memory).
    (full,), ranks = run(sharded_muon, nproc=1, args=(10,))[0]
    initial, expected = _one_process(10)
    _assert_each_matrix_once(ranks, 10)
    assert ranks[0]["peer_bytes"] == 0
    _assert_close("1 rank, hp.fully_shard", full, initial, expected)


def test_two_ranks_sharing_the_gpu_equal_one_process():
    results = run(sharded_muon, nproc=2, args=(10,))
    initial, expected = _one_process(10)
    (full,), ranks = results[0]
    _assert_each_matrix_once(ranks, 10)
    # What the ranks pulled from each other: the rows owners lacked and the results' rows, no more.
    moved = sum(r["peer_bytes"] for r in ranks.values())
    assert moved == 10 * peer_bytes_per_step(ranks, 2, [torch.Size(s) for s in SHAPES]) > 0
    _assert_close("2 ranks sharing the GPU", full, initial, expected)


def test_hsdp_2x2_sharing_the_gpu_equals_one_process(monkeypatch):
    # Each matrix orthogonalised on one node; its results reach the other node's counterparts over
    # c10d: Gloo, since counterparts share a GPU here and NCCL refuses that (its stream-ordered
    # path runs where each rank has a GPU of its own). Both nodes end with the same bits.
    monkeypatch.setenv("HP_CROSS_NODE_BACKEND", "gloo")
    results = run(sharded_muon, nproc=2, nnodes=2, args=(10, 2))
    initial, expected = _one_process(10)
    (node0, node1), ranks = results[0]
    _assert_each_matrix_once(ranks, 10)
    assert {r // 2 for r, v in ranks.items() if v["owned"]} == {0, 1}  # both nodes orthogonalise
    assert all(torch.equal(a, b) for a, b in zip(node0, node1))
    _assert_close("HSDP 2 nodes x 2 ranks sharing the GPU", node0, initial, expected)
