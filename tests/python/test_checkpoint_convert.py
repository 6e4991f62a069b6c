"""hyperparallel convert: checkpoint -> HF directory that transformers loads with the same
logits, and HF directory (ours, or hub-style per-expert weights) -> checkpoint."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file
from torch.multiprocessing.reductions import StorageWeakRef
from transformers import (
    AutoModelForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import hyperparallel.checkpoint as ckpt
from hyperparallel import _C
from hyperparallel.checkpoint import _storage, hf
from hyperparallel.checkpoint.convert import main, read_safetensors

CONFIG = {
    "vocab_size": 101, "hidden_size": 48, "intermediate_size": 40, "moe_intermediate_size": 24,
    "num_hidden_layers": 2, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16,
    "num_experts": 3, "num_experts_per_tok": 2, "max_position_embeddings": 64,
}


def tiny_model(seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG)).eval()


def test_to_hf_loads_in_transformers_with_same_logits(tmp_path):
    model = tiny_model()
    ckpt.save({"model": model.state_dict(), "step": 7}, tmp_path / "ckpt")
    model.config.to_json_file(tmp_path / "config.json")
    assert main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--config", str(tmp_path / "config.json"),
                 "--max-shard-size", "40KB"]) == 0
    index = json.loads((tmp_path / "hf/model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)

    # And back: HF directory -> checkpoint -> the same weights.
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    state = {"model": tiny_model(1).state_dict()}
    ckpt.load(state, tmp_path / "back")
    for key, value in model.state_dict().items():
        assert torch.equal(state["model"][key], value), key


def test_to_hf_into_an_hf_directory_replaces_its_weights(tmp_path):
    """Writing into a directory that already holds a model (even the config's own directory):
    transformers then loads the new weights, not the old single file it would prefer."""
    old, new = tiny_model(0), tiny_model(1)
    old.save_pretrained(tmp_path / "hf")  # model.safetensors and config.json
    (tmp_path / "hf/README.md").write_text("a model card")
    ckpt.save({"model": new.state_dict()}, tmp_path / "ckpt")
    assert main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--config",
                 str(tmp_path / "hf/config.json"), "--max-shard-size", "40KB"]) == 0
    assert not (tmp_path / "hf/model.safetensors").exists()
    assert (tmp_path / "hf/README.md").read_text() == "a model card"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for key, value in new.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_from_hf_fuses_hub_style_experts(tmp_path):
    model = tiny_model()
    hub = {}
    for key, value in model.state_dict().items():
        if key.endswith("experts.gate_up_proj"):
            stack = key[: -len(".gate_up_proj")]
            for e in range(value.shape[0]):
                gate, up = value[e].chunk(2)
                hub[f"{stack}.{e}.gate_proj.weight"] = gate.clone()
                hub[f"{stack}.{e}.up_proj.weight"] = up.clone()
        elif key.endswith("experts.down_proj"):
            stack = key[: -len(".down_proj")]
            for e in range(value.shape[0]):
                hub[f"{stack}.{e}.down_proj.weight"] = value[e].clone()
        else:
            hub[key] = value.clone()
    (tmp_path / "hub").mkdir()
    save_file(hub, tmp_path / "hub/model.safetensors")
    assert read_safetensors(tmp_path / "hub/model.safetensors").keys() == hub.keys()
    assert main(["from-hf", str(tmp_path / "hub"), str(tmp_path / "ckpt")]) == 0
    state = {"model": tiny_model(1).state_dict()}
    ckpt.load(state, tmp_path / "ckpt")
    for key, value in model.state_dict().items():
        assert torch.equal(state["model"][key], value), key


def test_from_hf_reads_each_tensor_as_the_writer_comes_to_it(tmp_path, monkeypatch):
    """from-hf never holds the model whole: when it reads a tensor, what it still holds of those
    read before is at most one STAGE_BYTES batch (the tensors' storages, watched by weak
    references), and the checkpoint holds every weight."""
    model = tiny_model()
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")  # per-expert, as on the hub
    monkeypatch.setattr(_storage, "STAGE_BYTES", 1 << 10)  # a batch a weight, but the norms'
    held: list = []  # (weak reference to a read tensor's storage, its bytes)
    most, appends = 0, []
    read = hf.DirectoryReader.read

    def reading(self, name):
        nonlocal most
        tensor = read(self, name)
        alive = sum(nbytes for ref, nbytes in held if not ref.expired())
        most = max(most, alive + tensor.nbytes)
        held.append((StorageWeakRef(tensor.untyped_storage()), tensor.nbytes))
        return tensor

    class Appending(_C.CkptFileWriter):
        def append(self, items):
            appends.append(len(items))
            return super().append(items)

    monkeypatch.setattr(hf.DirectoryReader, "read", reading)
    monkeypatch.setattr(_C, "CkptFileWriter", Appending)
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    sizes = [nbytes for _, nbytes in held]
    assert sum(sizes) == sum(t.nbytes for t in model.state_dict().values())
    assert len(appends) > 3
    # An open batch holds less than STAGE_BYTES (it is written as soon as it reaches them), and
    # nothing of a written one may stay.
    assert most < (1 << 10) + max(sizes), most
    state = {"model": tiny_model(1).state_dict()}
    ckpt.load(state, tmp_path / "ckpt")
    for key, value in model.state_dict().items():
        assert torch.equal(state["model"][key], value), key


def test_from_hf_of_tied_embeddings_loads_into_the_model(tmp_path):
    """save_pretrained leaves out a head tied to the embedding; the model's state_dict has it."""
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "hf")
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    torch.manual_seed(1)
    model = Qwen3ForCausalLM(config)
    state = {"model": model.state_dict()}
    ckpt.load(state, tmp_path / "ckpt")
    model.load_state_dict(state["model"])
    assert torch.equal(model.lm_head.weight, AutoModelForCausalLM.from_pretrained(tmp_path / "hf").lm_head.weight)


def test_convert_errors_name_the_fix(tmp_path, capsys):
    assert main(["to-hf", str(tmp_path / "missing"), str(tmp_path / "hf"), "--config", str(tmp_path / "c.json")]) == 1
    assert "config.json with --config" in capsys.readouterr().out
    ckpt.save({"weights": {"w": torch.zeros(2)}}, tmp_path / "ckpt")
    (tmp_path / "c.json").write_text("{}")
    assert main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--config", str(tmp_path / "c.json")]) == 1
    assert "--prefix" in capsys.readouterr().out
    # A file named .safetensors that is not one (a torch.save pickle, text), and an HF directory
    # given as the checkpoint to write.
    (tmp_path / "bad").mkdir()
    torch.save({"w": torch.zeros(2)}, tmp_path / "bad/model.safetensors")
    assert main(["from-hf", str(tmp_path / "bad"), str(tmp_path / "out")]) == 1
    assert "bad/model.safetensors is not a safetensors file" in capsys.readouterr().out
    tiny_model().save_pretrained(tmp_path / "hf_model")
    assert main(["from-hf", str(tmp_path / "hf_model"), str(tmp_path / "hf_model")]) == 1
    assert "is a directory that is not a checkpoint" in capsys.readouterr().out
    assert (tmp_path / "hf_model/model.safetensors").exists()
    # A truncated download: named from its header, before anything is written.
    weights = tmp_path / "hf_model/model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert main(["from-hf", str(tmp_path / "hf_model"), str(tmp_path / "out")]) == 1
    assert "model.safetensors is truncated" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_to_hf_casts_and_reads_a_shard_at_a_time(tmp_path):
    """--dtype: the shards are planned at the cast size (a plan at the stored size would refuse the
    first shard), and each holds the cast weights; a corrupted checkpoint is still refused first."""
    model = tiny_model()
    ckpt.save({"model": model.state_dict()}, tmp_path / "ckpt")
    model.config.to_json_file(tmp_path / "config.json")
    assert main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--config", str(tmp_path / "config.json"),
                 "--max-shard-size", "20KB", "--dtype", "bfloat16"]) == 0
    index = json.loads((tmp_path / "hf/model.safetensors.index.json").read_text())
    expected = {name: tensor.to(torch.bfloat16) for name, tensor in model.state_dict().items()}
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in expected.values())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2
    written = {}
    for file in files:
        written.update(read_safetensors(tmp_path / "hf" / file))
    assert written.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name
    data = next(p for p in (tmp_path / "ckpt").iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf2"), "--config", str(tmp_path / "config.json")]) == 1
    assert not (tmp_path / "hf2").exists()
