"""hyperparallel.checkpoint.hf, the one home of HF directory I/O: what it stacks is what load_pretrained fills."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import hyperparallel.nn as hpnn
from hyperparallel.checkpoint import CheckpointError, hf

CONFIG = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 40, "moe_intermediate_size": 24,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "num_experts": 3, "num_experts_per_tok": 2,
}


def tiny_model(seed: int) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG))


def hub_directory(tmp_path):
    """A sharded save_pretrained directory (per-expert tensors)."""
    tiny_model(0).save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(hf.shard_files(tmp_path)) > 1
    return tmp_path


def test_stacked_experts_are_what_load_pretrained_fills(tmp_path):
    directory = hub_directory(tmp_path)
    assert hf.expert_key("model.layers.1.mlp.experts.2.up_proj.weight") == ("model.layers.1.mlp.experts", 2, "up_proj")
    assert any(hf.expert_key(name) for path in hf.shard_files(directory) for name in hf.SafetensorsFile(path).names)
    reader = hf.DirectoryReader(directory)
    assert not any(hf.expert_key(name) for name in reader.names)
    model = tiny_model(1)
    hpnn.load_pretrained(model, directory)
    state = model.state_dict()
    assert set(reader.names) == state.keys()
    for name, tensor in state.items():
        assert (reader.shape(name), reader.dtype(name)) == (tuple(tensor.shape), tensor.dtype), name
        assert torch.equal(reader.read(name), tensor), name


def test_a_missing_expert_weight_is_named(tmp_path):
    directory = hub_directory(tmp_path)
    tensors = {}
    for path in hf.shard_files(directory):
        tensors.update(hf.read_safetensors(path))
        path.unlink()
    (directory / hf.INDEX).unlink()
    del tensors["model.layers.0.mlp.experts.1.up_proj.weight"]
    hf.write_safetensors(tensors, directory / hf.SINGLE)
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.experts: expert weight 1.up_proj is missing"):
        hf.DirectoryReader(directory)
    with pytest.raises(FileNotFoundError, match="pass an HF model directory"):
        hf.shard_files(tmp_path / "nothing")


@pytest.mark.parametrize("entry", [[1, 2], {"dtype": "F32", "shape": [2]},
                                   {"dtype": "F32", "shape": [2], "data_offsets": [0, "8"]}])
def test_a_malformed_header_entry_is_named(tmp_path, entry):
    blob = json.dumps({"w": entry}).encode()
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(8))
    with pytest.raises(CheckpointError, match=r"x.safetensors is not a safetensors file \(tensor w's header entry"):
        hf.SafetensorsFile(tmp_path / "x.safetensors")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_rows_are_read_alone(tmp_path, dtype):
    """What a rank reads for its shard: rows begin:end of a tensor, any of them, none included."""
    tensor = (torch.arange(7 * 3 * 5) % 251).reshape(7, 3, 5).to(dtype)
    hf.write_safetensors({"a": torch.ones(2, dtype=dtype), "t": tensor}, tmp_path / "x.safetensors")
    file = hf.SafetensorsFile(tmp_path / "x.safetensors")
    assert file.shape("t") == (7, 3, 5)
    for begin, end in [(0, 7), (0, 4), (4, 7), (3, 3), (6, 7)]:
        assert torch.equal(file.read_rows("t", begin, end), tensor[begin:end]), (begin, end)
    with pytest.raises(ValueError, match="no rows 5:8"):
        file.read_rows("t", 5, 8)


def test_directory_writer_takes_the_planned_shards_in_order(tmp_path):
    tensors = {f"w{i}": torch.full((8,), float(i)) for i in range(5)}  # 32 bytes each
    writer = hf.DirectoryWriter(tmp_path / "out", tmp_path / "config.json", {n: t.nbytes for n, t in tensors.items()},
                                max_shard_size=64)
    assert writer.shards == hf.shard_plan({n: t.nbytes for n, t in tensors.items()}, 64)
    assert writer.shards == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    with pytest.raises(CheckpointError, match="planned order"):
        writer.write({"w2": tensors["w2"], "w3": tensors["w3"]})
    with pytest.raises(CheckpointError, match="bytes, 32 planned"):
        writer.write({"w0": torch.zeros(4), "w1": tensors["w1"]})
    writer.write({"w0": tensors["w0"], "w1": tensors["w1"]})
    with pytest.raises(CheckpointError, match="1 of 3 shards written"):
        writer.close()
    (tmp_path / "config.json").write_text("{}")
    writer.write({"w2": tensors["w2"], "w3": tensors["w3"]})
    writer.write({"w4": tensors["w4"]})
    writer.close()
    read = {}
    for path in hf.shard_files(tmp_path / "out"):
        read.update(hf.read_safetensors(path))
    assert read.keys() == tensors.keys() and all(torch.equal(read[n], t) for n, t in tensors.items())
