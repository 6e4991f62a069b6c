"""bench/'s strong PyTorch peer (FSDP2 + OwnerMuon) is the baseline's numerics with each matrix
orthogonalised once: equal losses to GatheredMuon, and per rank exactly the Newton-Schulz matrices
its owner assignment gives it."""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import Qwen3MoeConfig

import hyperparallel.optim

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # bench/ is scripts, not a package

from _spec import RunSpec, build_model
from baseline_torch import ns_cost, owner_assignment, run_baseline

WORLD = 2


def _tiny_config(path: Path) -> Path:
    # 4 experts: whole experts per rank at 2 ranks (orthogonalised locally); the dense
    # attention matrices and the router go to owners.
    Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
    ).to_json_file(path)
    return path


def _expected_ns_per_rank(config_path: Path) -> list[int]:
    muon_params, _ = hyperparallel.optim.muon_param_split(build_model(config_path, seed=0))
    counts = [0] * WORLD
    shared = []
    for param in muon_params:
        if param.ndim == 3 and param.shape[0] % WORLD == 0:
            for rank in range(WORLD):
                counts[rank] += param.shape[0] // WORLD
        else:
            shared.append(param)
    for param, owner in zip(shared, owner_assignment([ns_cost(p.shape) for p in shared], WORLD), strict=True):
        counts[owner] += param.shape[0] if param.ndim == 3 else 1
    return counts


def test_owner_assignment_balances_and_is_deterministic():
    costs = [8, 7, 6, 5, 4, 3, 2, 1]
    owners = owner_assignment(costs, 2)
    assert owners == owner_assignment(costs, 2)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(2)]
    assert loads == [18, 18]


def test_strong_peer_equals_the_gathered_baseline(tmp_path):
    spec = RunSpec(config_path=_tiny_config(tmp_path / "config.json"), steps=4, nproc=WORLD, micro_batch=2, seq_len=32)
    gathered = run_baseline(spec, reshard_after_forward=False, muon="gathered")
    strong = run_baseline(spec, reshard_after_forward=False, muon="owner")
    # Newton-Schulz of the same full matrix is deterministic and the bf16 result is broadcast
    # unchanged, so the two are bitwise equal, not merely close.
    assert strong["losses"] == gathered["losses"]
    assert strong["work_per_rank"]["ns_matrices_by_rank"] == _expected_ns_per_rank(spec.config_path)
    # The baseline orthogonalises every matrix on every rank.
    total = sum(_expected_ns_per_rank(spec.config_path))
    assert gathered["work_per_rank"]["ns_matrices_by_rank"] == [total] * WORLD
