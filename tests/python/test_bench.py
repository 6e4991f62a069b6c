"""bench/: every system of the side-by-side benchmark splits the model between Muon and AdamW
exactly as the package's ``hp.optim.muon_param_split`` does, and that split is the protocol's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from transformers import Qwen3MoeConfig

import hyperparallel as hp
import hyperparallel.optim

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # bench/ is scripts, not a package

from _optim import OptimHparams, optimizers
from _reference import MatrixMuon
from _spec import build_model
from _timing import StepTimer
from baseline_torch import GatheredMuon

HPARAMS = OptimHparams()
SYSTEMS = {
    "torch-fsdp2-muon": lambda params: GatheredMuon(params, HPARAMS, StepTimer()),
    "reference-single-process": lambda params: MatrixMuon(params, HPARAMS),
    "hyperparallel": lambda params: hp.optim.Muon(params, **HPARAMS.muon_defaults()),
}


@pytest.mark.parametrize("system", SYSTEMS)
def test_the_baseline_splits_as_the_package(tmp_path, system):
    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=3, num_experts_per_tok=2,
    )
    config.to_json_file(tmp_path / "config.json")
    model = build_model(tmp_path / "config.json", seed=0)
    muon, adamw = optimizers(model, HPARAMS, SYSTEMS[system])

    def ids(optimizer):
        return [id(p) for group in optimizer.param_groups for p in group["params"]]

    package_muon, package_adamw = hp.optim.muon_param_split(model)
    assert ids(muon) == [id(p) for p in package_muon]
    assert ids(adamw) == [id(p) for p in package_adamw]
    # The protocol's rule (../shared/bench/README.md): Muon for every weight matrix but the
    # embedding and the output head, AdamW for those and the vectors.
    names = {id(p): name for name, p in model.named_parameters()}
    protocol = [n for n, p in model.named_parameters() if p.ndim >= 2 and not any(s in n for s in ("embed", "lm_head"))]
    assert [names[i] for i in ids(muon)] == protocol
    assert len(ids(muon)) + len(ids(adamw)) == len(names)
