"""bench/model.py's counts against hp's real owner assignment and hand counts (fast, no timing)."""

import argparse
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import hyperparallel as hp
from hyperparallel.launch import run

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import model

# Small enough to run in a second; 6 experts do not divide over 4 ranks, so homes and splits both occur.
TINY = model.Shape(layers=2, hidden=16, heads=2, kv_heads=1, head_dim=8, experts=6, topk=2, moe_inter=8,
                   vocab=32)
COMP = model.Components(1e10, 2e10, 5e9, 6e9, 8e9, 9e9, 2e10, 4e10, 1e10, 1e-4, 1e9, 1e-6)
ARGS = argparse.Namespace(precision="fp32", node_ranks=4, net_gbps=100.0, net_latency_us=10.0)


class Layer(nn.Module):
    """TINY's Muon matrices of one decoder layer, in the model's parameter order."""

    def __init__(self) -> None:
        super().__init__()
        self.mats = nn.ParameterList(
            [nn.Parameter(torch.randn(m.count // TINY.layers, m.rows, m.cols) if m.expert else
                          torch.randn(m.rows, m.cols))
             for m in TINY.matrices for _ in range(m.count // TINY.layers if not m.expert else 1)])


def owned_counts() -> int:
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    layers = nn.ModuleList([Layer() for _ in range(TINY.layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in layers:
        hp.fully_shard(layer, mesh=mesh)
    hp.fully_shard(layers, mesh=mesh)
    for p in layers.parameters():
        p.grad = torch.ones_like(p)
    opt = hp.optim.Muon(layers.parameters(), lr=1e-3)
    opt.step()
    return len(opt.owned())


@pytest.mark.parametrize("world", [4])
def test_hp_ns_matrices_match_the_real_assignment(world):
    results = run(owned_counts, nproc=world)
    counts, _ = model.ns_per_rank(TINY, world, "hp")
    assert [results[r] for r in range(world)] == counts


def test_ns_matrices_by_system():
    total = sum(m.count for m in TINY.matrices)
    assert total == TINY.layers * (4 + 1 + 2 * TINY.experts)
    assert model.ns_per_rank(TINY, 4, "gathered")[0] == [total] * 4
    for system in ("hp", "owner"):
        assert sum(model.ns_per_rank(TINY, 4, system)[0]) == total  # each matrix exactly once
    # 6 experts over 3 ranks divide: the owner peer keeps 2 per stack on each rank.
    counts, _ = model.ns_per_rank(TINY, 3, "owner")
    assert min(counts) >= TINY.layers * 2 * 2


def test_bytes_by_hand():
    P, Pm, N = TINY.params, TINY.muon_params, 4
    # Sent + received: twice the inbound bytes of all-gathers (fwd, bwd), reduce-scatter, full_tensor.
    hand = {"gathered": 2 * (P * 3 / 4 * (2 * 4 + 4) + Pm * 4 * 3 / 4)}
    g = model.predict(TINY, 64, 16, N, "gathered", COMP, ARGS, reshard=True)
    assert g.gloo_bytes == pytest.approx(hand["gathered"])
    h = model.predict(TINY, 64, 16, N, "hp", COMP, ARGS)
    assert (h.gloo_bytes, h.fabric_bytes) == (0, pytest.approx(P * 4))  # every rank's rows read once
    assert model.predict(TINY, 64, 16, 8, "hp", COMP, ARGS).gloo_bytes > 0  # two nodes: HSDP
    # Without resharding the backward all-gather goes: one fewer parameter pass.
    kept = model.predict(TINY, 64, 16, N, "gathered", COMP, ARGS, reshard=False)
    assert g.gloo_bytes - kept.gloo_bytes == pytest.approx(2 * P * 3 / 4 * 4)


def test_sanity():
    for system in ("hp", "gathered", "owner"):
        steps = [model.predict(TINY, 64, 16, N, system, COMP, ARGS).step for N in model.WORLDS]
        assert all(s > 0 for s in steps)
    one = {s: model.predict(TINY, 64, 16, 1, s, COMP, ARGS) for s in ("gathered", "owner")}
    assert one["gathered"].step == one["owner"].step  # the two torch systems agree alone
    # hp's optimizer share shrinks with ranks; the gathered baseline's does not.
    opt = lambda s, N: model.predict(TINY, 64, 16, N, s, COMP, ARGS).optimizer
    assert opt("hp", 4) < opt("hp", 2)
    assert model.ns_per_rank(TINY, 4, "gathered")[1] == model.ns_per_rank(TINY, 2, "gathered")[1][:1] * 4


def test_assignment_prefers_homes():
    # hp's own assignment, as the model calls it. Equal costs: each goes home while its home is among
    # the least loaded (turns interleave the homes).
    assert hp._C.assign_owners([5, 5, 5, 5], [[1], [1], [0], [0]], 2) == [1, 1, 0, 0]
    assert hp._C.assign_owners([9, 4, 4], [[], [], []], 2) == [0, 1, 1]
