"""hp.nn.load_pretrained: HF checkpoint directories (single file, sharded, per-expert or stacked) into patched models."""

import json

import pytest
import torch
from safetensors.torch import save_file
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

import hyperparallel.nn as hpnn

MOE = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 64,
    "initializer_range": 0.1,
}


def model_from(config, seed):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key].to(sb[key].dtype), sb[key]), key


@pytest.mark.parametrize("shard_size", ["20KB", "100MB"])
def test_loads_save_pretrained_checkpoints(tmp_path, shard_size):
    """save_pretrained writes per-expert tensors; sharded with an index file, or one file."""
    config = Qwen3MoeConfig(**MOE)
    source = model_from(config, seed=0)
    source.save_pretrained(tmp_path, max_shard_size=shard_size)
    sharded = (tmp_path / "model.safetensors.index.json").exists()
    assert sharded == (shard_size == "20KB")
    target = model_from(config, seed=1)
    hpnn.patch(target)
    result = hpnn.load_pretrained(target, tmp_path)
    assert result == hpnn.LoadResult([], [])
    assert_same_weights(target, source)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(target(input_ids=ids).logits, source(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_loads_stacked_expert_tensors_into_bfloat16(tmp_path):
    config = Qwen3MoeConfig(**MOE)
    source = model_from(config, seed=2)
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, tmp_path / "model.safetensors")
    config.save_pretrained(tmp_path)
    target = model_from(config, seed=3).to(torch.bfloat16)
    hpnn.patch(target)
    hpnn.load_pretrained(target, tmp_path)
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value.to(torch.bfloat16)), key


def test_tied_embeddings_and_base_model(tmp_path):
    config = Qwen3Config(**{k: v for k, v in MOE.items() if "expert" not in k}, tie_word_embeddings=True)
    source = model_from(config, seed=4)
    source.save_pretrained(tmp_path)
    target = model_from(config, seed=5)
    hpnn.patch(target)
    hpnn.load_pretrained(target, tmp_path)
    assert_same_weights(target, source)
    base = model_from(config, seed=6).model
    hpnn.load_pretrained(base, tmp_path, strict=False)
    assert_same_weights(base, source.model)


def test_mismatches_are_errors(tmp_path):
    config = Qwen3MoeConfig(**MOE)
    source = model_from(config, seed=7)
    state = {k: v.contiguous() for k, v in source.state_dict().items()}
    del state["model.layers.1.mlp.experts.down_proj"]
    save_file(state, tmp_path / "model.safetensors")
    config.save_pretrained(tmp_path)
    target = model_from(config, seed=8)
    with pytest.raises(KeyError, match="model.layers.1.mlp.experts.down_proj"):
        hpnn.load_pretrained(target, tmp_path)
    result = hpnn.load_pretrained(target, tmp_path, strict=False)
    assert result.missing_keys == ["model.layers.1.mlp.experts.down_proj"]

    saved = json.loads((tmp_path / "config.json").read_text())
    saved["num_experts"] = 8
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="num_experts=8"):
        hpnn.load_pretrained(target, tmp_path)
