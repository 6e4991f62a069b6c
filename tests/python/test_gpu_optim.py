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

# Wide, tall, square, repeated shapes (one batch), and an expert stack.
SHAPES = [(24, 40), (40, 24), (32, 32), (32, 32), (7, 12), (260, 300), (300, 260), (6, 48, 80)]


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


def sharded_muon(steps: int) -> tuple:
    hp.comm.init()
    device = hp.comm.device()
    torch.cuda.set_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    model = nn.ParameterList(_params(0, device))
    hp.fully_shard(model, mesh=mesh)
    optimizer = hpo.Muon(list(model.parameters()), lr=2e-3, adjust_lr_fn="match_rms_adamw")
    hpo.reset_stats()
    for step in range(steps):
        for p, g in zip(model.parameters(), _grads(step, device)):
            local = torch.chunk(g, world)[rank]
            p.grad = DTensor.from_local(local.contiguous(), mesh, p.placements, shape=p.shape, stride=p.stride())
        optimizer.step()
    locals_ = [p.to_local().detach().cpu() for p in model.parameters()]
    owned = optimizer.owned()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (locals_, owned, hpo.stats()["muon_peer_bytes"]))
    full = [torch.cat([parts[0][i] for parts in everyone]) for i in range(len(SHAPES))]
    return full, {rank: {"owned": owned_by, "peer_bytes": moved} for rank, (_, owned_by, moved) in enumerate(everyone)}


def test_two_ranks_sharing_the_gpu_equal_one_process():
    results = run(sharded_muon, nproc=2, args=(10,))
    device = torch.device("cuda", 0)
    ours = _params(0, device)
    initial = [p.detach().cpu().clone() for p in ours]
    optimizer = hpo.Muon(ours, lr=2e-3, adjust_lr_fn="match_rms_adamw")
    for step in range(10):
        for p, g in zip(ours, _grads(step, device)):
            p.grad = g
        optimizer.step()
    full, ranks = results[0]
    owned = [o for r in ranks.values() for o in r["owned"]]
    matrices = sum(shape[0] if len(shape) == 3 else 1 for shape in SHAPES)
    assert sorted(owned) == sorted(set(owned)) and len(owned) == matrices  # each matrix exactly once
    # What the ranks pulled from each other: the rows owners lacked and the results' rows, no more.
    moved = sum(r["peer_bytes"] for r in ranks.values())
    assert moved == 10 * peer_bytes_per_step(ranks, 2, [torch.Size(s) for s in SHAPES]) > 0
    worst = max((got - p.detach().cpu()).abs().max().item() for got, p in zip(full, ours))
    change = max((p.detach().cpu() - q).abs().max().item() for p, q in zip(ours, initial))
    print(f"hp.optim.Muon, 2 ranks sharing the GPU vs 1 process, 10 steps: max |param diff| {worst:.3g} "
          f"(the parameters moved by up to {change:.3g})")
    assert worst <= 0.05 * change
