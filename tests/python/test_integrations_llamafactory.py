"""LlamaFactory 0.9.5 SFT with hyperparallel underneath: real torchrun, 2 ranks, CPU, in .venv-llamafactory.

The run is the one docs/integrations.md shows: examples/llamafactory/qwen3_moe_sft.yaml on the
tiny Qwen3-MoE that examples/llamafactory/tiny_model.py makes here, with the 50 alpaca
examples of tests/data. The model is built on the meta device and each rank reads only its
rows of the weights. It trains 20 steps with hp's fused modules and Muon, the loss
falls, and its output directory loads in transformers; with AdamW its first 5 steps'
losses are LlamaFactory's own single-process run's (``llamafactory-cli train``, the same
config without our section) within 1e-4. Configs hyperparallel does not train are refused
with the option named.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
ENV = ROOT / ".venv-llamafactory" / "bin"
EXAMPLE = ROOT / "examples" / "llamafactory" / "qwen3_moe_sft.yaml"
WORLD = 2

pytestmark = pytest.mark.skipif(
    not (ENV / "llamafactory-cli").exists(),
    reason="needs .venv-llamafactory: bash scripts/setup.sh --with-llamafactory",
)


def _run(command: list[str], timeout: int = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}, **(env or {})}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    return subprocess.run(command, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lf") / "tiny-qwen3-moe"
    _ok(_run([str(ENV / "python"), "examples/llamafactory/tiny_model.py", str(out)]))
    return out


@pytest.fixture(scope="module")
def hub_cache(tiny_model, tmp_path_factory) -> Path:
    """An HF cache holding tiny_model as hub repo ``hp-test/tiny-qwen3-moe`` (huggingface_hub's
    layout: refs/main names the snapshot), for a config naming the model as on the hub."""
    cache = tmp_path_factory.mktemp("hub")
    repo, commit = cache / "models--hp-test--tiny-qwen3-moe", "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(tiny_model, repo / "snapshots" / commit)
    return cache


def write_config(path: Path, model: Path | str, out: Path, *, hyperparallel: dict | None = None, **overrides) -> Path:
    """The example config with this test's model and output; our section replaced (or dropped: None)."""
    config = yaml.safe_load(EXAMPLE.read_text())
    config.update(model_name_or_path=str(model), output_dir=str(out), **overrides)
    config.pop("hyperparallel")
    if hyperparallel is not None:
        config["hyperparallel"] = hyperparallel
    path.write_text(yaml.safe_dump(config))
    return path


def hp_train(config: Path) -> subprocess.CompletedProcess:
    return _run([str(ENV / "torchrun"), "--nproc-per-node", str(WORLD), "-m",
                 "hyperparallel.integrations.llamafactory", str(config)], env={"HP_LOG": "info"})


def loaded_by_rows(result: subprocess.CompletedProcess) -> bool:
    """Whether each rank read only its rows of the weights (the model was built on the meta device)."""
    return result.stderr.count("built on the meta device: sharded, then each rank reads its rows") == WORLD


def losses(out: Path) -> list[float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


def test_sft_trains_and_saves_a_loadable_model(tiny_model, hub_cache, tmp_path):
    """The model named as on the hub, from the HF cache (offline)."""
    out = tmp_path / "hp"
    config = write_config(tmp_path / "hp.yaml", "hp-test/tiny-qwen3-moe", out, cache_dir=str(hub_cache),
                          hyperparallel=yaml.safe_load(EXAMPLE.read_text())["hyperparallel"])
    assert loaded_by_rows(_ok(hp_train(config)))
    got = losses(out)
    assert len(got) == 20
    assert got[-1] < got[0] - 1.0, got
    # The output directory loads in LlamaFactory's transformers (5.6) and in ours, every weight trained.
    probe = "import sys; from transformers import AutoModelForCausalLM as M; M.from_pretrained(sys.argv[1])"
    _ok(_run([str(ENV / "python"), "-c", probe, str(out)]))
    trained, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    initial = AutoModelForCausalLM.from_pretrained(tiny_model)
    unchanged = [name for name, p in initial.named_parameters()
                 if torch.equal(p, trained.get_parameter(name))]
    assert not unchanged, unchanged
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(trained(input_ids=ids).logits).all()


def test_first_steps_match_llamafactory_alone(tiny_model, tmp_path):
    """AdamW (``optim`` as configured): hp on 2 ranks x 2 micro-batches of 2 per step, LlamaFactory's
    own run in one process with 4 micro-batches of 2 (the same 8 examples per step)."""
    steps = {"max_steps": 5}
    hp_out, alone_out = tmp_path / "hp", tmp_path / "alone"
    assert loaded_by_rows(_ok(hp_train(write_config(tmp_path / "hp.yaml", tiny_model, hp_out,
                                                    hyperparallel={"patch": True, "optimizer": "hf"}, **steps))))
    alone = write_config(tmp_path / "alone.yaml", tiny_model, alone_out, **steps,
                         gradient_accumulation_steps=WORLD * 2)
    _ok(_run([str(ENV / "llamafactory-cli"), "train", str(alone)]))
    got, expected = losses(hp_out), losses(alone_out)
    assert len(got) == len(expected) == 5
    worst = max(abs(a - b) for a, b in zip(got, expected))
    assert worst <= 1e-4, f"largest loss difference {worst:.3g}: {got} vs {expected}"


def _gpt2(tmp_path: Path) -> Path:
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2}))
    return model


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"deepspeed": "examples/deepspeed/ds_z3_config.json"}, "deepspeed:"),
        ({"fsdp": "full_shard"}, "fsdp:"),
        ({"finetuning_type": "lora"}, "finetuning_type: lora"),
        ({"model_name_or_path": "gpt2"}, "model_name_or_path: "),
    ],
)
def test_configs_hyperparallel_does_not_train_are_refused(tiny_model, tmp_path, overrides, named):
    if overrides.get("model_name_or_path") == "gpt2":
        overrides = {"model_name_or_path": str(_gpt2(tmp_path))}
    model = overrides.pop("model_name_or_path", tiny_model)
    config = write_config(tmp_path / "bad.yaml", model, tmp_path / "out", hyperparallel={"patch": True}, **overrides)
    result = hp_train(config)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("hyperparallel.integrations.llamafactory: ")]
    assert len(lines) == 1 and named in lines[0], result.stderr[-3000:]
    assert not (tmp_path / "out").exists()  # refused before LlamaFactory started
