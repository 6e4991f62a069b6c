"""hp.optim.Muon on sharded models: the same parameters as one process, each matrix orthogonalised once.

The sharding comes from SHARD_FNS, functions with fully_shard's signature:
hp.fully_shard and torch's FSDP2 (same DTensor contract).

The single-process reference is torch.optim.Muon (one matrix per expert),
fed the sharded run's own gradients. It could not compute them itself:
Newton–Schulz multiplies a last-bit change of its input, along the small
singular values, by up to a^steps (about 480), and data-parallel gradient
averaging changes last bits with the summation order, so any distributed Muon
(the redundant FSDP2 recipe too) drifts from a single process by more than
1e-5 within a few steps. With the same gradients, the optimizer alone is
compared.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

import hyperparallel as hp
import hyperparallel.optim as hpo
from hyperparallel.launch import run

SHARD_FNS = {"hp": hp.fully_shard, "torch_fsdp2": torch_fully_shard}
STEPS = 10
BATCH = 64  # more samples than any matrix dimension: full-rank, well-conditioned gradients


class Block(nn.Module):
    """Attention-like projections and a stack of experts, with rows that do not split evenly."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16, bias=False)
        self.k = nn.Linear(16, 7, bias=False)  # 7 rows: 2, 2, 2, 1 over four ranks
        self.w_in = nn.Parameter(torch.randn(5, 10, 7) * 0.3)  # 5 experts: 2, 2, 1, 0 over four ranks
        self.w_out = nn.Parameter(torch.randn(5, 16, 10) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.k(self.q(x)))
        e = torch.einsum("bd,ehd->beh", h, self.w_in).tanh()
        return x + torch.einsum("beh,edh->bd", e, self.w_out) / 5


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 16, bias=False)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])  # same shapes twice: batched Newton–Schulz
        self.out = nn.Linear(16, 6, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


MATRICES = 2 + 2 * (2 + 5 + 5)  # inp, out; per block q, k and ten experts


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 12, generator=generator), torch.randn(BATCH, 6, generator=generator))
        for _ in range(STEPS + 1)
    ]


def _as_matrices(tensors):
    """2-D tensors as they are, 3-D ones as one matrix per expert."""
    return [m for t in tensors for m in ([t] if t.ndim == 2 else list(t))]


def _train(model, optimizer, reference, batches, rows):
    """Steps of `optimizer` on the sharded model, and of the torch.optim.Muon `reference` on its gradients."""
    params = [q for group in reference.param_groups for q in group["params"]]
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        for q, grad in zip(params, _as_matrices([p.grad.full_tensor() for p in model.parameters()])):
            q.grad = grad
        optimizer.step()
        reference.step()


def sharded_muon_matches_one_process(shard_fn: str, mesh_shape: tuple[int, ...]) -> dict:
    torch.set_num_threads(1)
    hp.comm.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Tiny()
    reference = torch.optim.Muon(
        [nn.Parameter(m.detach().clone()) for m in _as_matrices(list(model.parameters()))], lr=2e-3
    )
    names = ("replicate", "shard")[-len(mesh_shape) :]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for block in model.blocks:
        SHARD_FNS[shard_fn](block, mesh=mesh)
    SHARD_FNS[shard_fn](model, mesh=mesh)
    optimizer = hpo.Muon(model.parameters(), lr=2e-3)
    per_rank = BATCH // world  # data parallel over every rank, replicas included
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    batches = _batches()
    hpo.reset_stats()
    _train(model, optimizer, reference, batches[:STEPS], rows)
    ns = hpo.stats()
    owned = optimizer.owned()

    # Momentum stays sharded like its parameter; a new optimizer resumes from the state dict.
    momentum = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    sharded = all(
        isinstance(m, DTensor) and m.placements == p.placements and m.to_local().shape == p.to_local().shape
        for m, p in zip(momentum, model.parameters())
    )
    resumed = hpo.Muon(model.parameters(), lr=2e-3)
    resumed.load_state_dict(optimizer.state_dict())
    _train(model, resumed, reference, batches[STEPS:], rows)

    # A parameter sharded on another dimension gets an error that names the contract.
    placements = [Shard(1)] if mesh.ndim == 1 else [Replicate(), Shard(1)]
    wrong = nn.Parameter(DTensor.from_local(torch.zeros(4, 2), mesh, placements))
    wrong.grad = torch.zeros_like(wrong)
    try:
        hpo.Muon([wrong]).step()
        placement_error = ""
    except ValueError as error:
        placement_error = str(error)

    ours = _as_matrices([p.full_tensor() for p in model.parameters()])
    theirs = reference.param_groups[0]["params"]
    return {
        "diff": max((p - q).abs().max().item() for p, q in zip(ours, theirs)),
        "ns": ns,
        "owned": owned,
        "balance": optimizer.balance,
        "sharded_momentum": sharded,
        "placement_error": placement_error,
    }


def _check(results: dict, world: int) -> None:
    assert sorted(results) == list(range(world))
    for result in results.values():
        assert result["diff"] <= 1e-5, result["diff"]
        assert result["sharded_momentum"]
        assert "expected FSDP's (Shard(0),)" in result["placement_error"]
    # Each matrix orthogonalised exactly once per step in the whole job:
    # counted by the C++ kernel on every rank, and by the plan's owners.
    assert sum(r["ns"]["ns_matrices"] for r in results.values()) == MATRICES * STEPS
    owned = [matrix for r in results.values() for matrix in r["owned"]]
    assert len(owned) == len(set(owned)) == MATRICES
    # Same-shape matrices of an owner share one call: at most one per shape per step.
    assert all(r["ns"]["ns_calls"] <= 6 * STEPS for r in results.values())
    assert len({r["balance"] for r in results.values()}) == 1  # every rank computed the same plan


def _shard_rows(size: int, world: int, rank: int) -> list[int]:
    """Shard(0)'s split: chunks of ceil(size / world), the last ones short or empty."""
    chunks = torch.arange(size).chunk(world)
    return chunks[rank].tolist() if rank < len(chunks) else []


def peer_bytes_per_step(results: dict, world: int, shapes: list | None = None) -> int:
    """What Muon's rows cost in a step, within one node: an owner reads the rows of its matrices that
    other ranks hold, and those ranks read their rows of the result (bf16: 2 bytes an element).
    Shard(0) splits a 2-D matrix's rows and a 3-D stack's experts; an expert is usually
    orthogonalised where it lives, but balance may send it elsewhere. ``shapes``: the parameters'
    (Tiny's by default); ``results[rank]["owned"]``: that rank's ``opt.owned()``."""
    shapes = shapes or [p.shape for p in Tiny().parameters()]
    total = 0
    for owner, result in results.items():
        for param, expert in result["owned"]:
            shape = shapes[param]
            rows, cols = shape[-2:]
            mine = _shard_rows(shape[0], world, owner)  # rows, or experts
            held = len(mine) if len(shape) == 2 else rows * (expert in mine)
            total += 2 * (rows - held) * cols * 2
    return total


@pytest.mark.parametrize("shard_fn", sorted(SHARD_FNS))
@pytest.mark.parametrize("nproc", [2, 4])
def test_fsdp_equals_one_process(shard_fn, nproc):
    results = run(sharded_muon_matches_one_process, nproc=nproc, args=(shard_fn, (nproc,)))
    _check(results, nproc)
    moved = sum(r["ns"]["muon_peer_bytes"] for r in results.values())
    assert moved == STEPS * peer_bytes_per_step(results, nproc) > 0


@pytest.mark.parametrize("shard_fn", sorted(SHARD_FNS))
@pytest.mark.parametrize("nnodes", [1, 2], ids=["replicas_in_one_node", "replica_per_node"])
def test_hsdp_2x2_equals_one_process(shard_fn, nnodes):
    if shard_fn == "hp" and nnodes == 1:
        pytest.skip("hp.fully_shard shards within a node and replicates across nodes only")
    results = run(sharded_muon_matches_one_process, nproc=4 // nnodes, nnodes=nnodes, args=(shard_fn, (2, 2)))
    _check(results, 4)


@pytest.mark.parametrize("shard_fn", sorted(SHARD_FNS))
def test_fsdp_across_two_nodes_equals_one_process(shard_fn):
    if shard_fn == "hp":
        pytest.skip("hp.fully_shard shards within a node; across nodes it is HSDP (tested above)")
    # Rows a matrix's owner lacks come from the other node, and results go back, over c10d.
    _check(run(sharded_muon_matches_one_process, nproc=2, nnodes=2, args=(shard_fn, (4,))), 4)
