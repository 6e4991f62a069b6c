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


def load_into_sharded(directory: str, stacked_directory: str) -> dict:
    """One rank's model built on the meta device, sharded by hp.fully_shard (and one by torch's
    FSDP2), then loaded: each parameter's whole, gathered from the ranks' rows."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import hyperparallel as hp

    torch.set_num_threads(1)
    hp.comm.init()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    config = Qwen3MoeConfig.from_pretrained(directory)
    gathered = {}
    for label, shard, source in [("hp", hp.fully_shard, directory), ("hp-stacked", hp.fully_shard, stacked_directory),
                                 ("torch", torch_fully_shard, directory)]:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        hpnn.patch(model)
        for layer in model.model.layers:
            shard(layer, mesh=mesh)
        shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        assert hpnn.load_pretrained(model, source) == hpnn.LoadResult([], [])
        gathered[label] = {k: v.full_tensor() for k, v in model.state_dict().items()}
        rows = model.model.layers[0].mlp.experts.gate_up_proj.to_local().shape[0]
        assert rows == (2 if dist.get_rank() == 0 else 1)  # 3 experts over 2 ranks
    return gathered


def test_sharded_models_load_their_rows(tmp_path):
    """A model too large for one rank is built on the meta device and sharded; each rank then reads
    only its rows of every tensor (its experts of a per-expert checkpoint). Uneven sizes: 3 experts
    and 63 token rows over 2 ranks."""
    from hyperparallel.launch import run

    config = Qwen3MoeConfig(**{**MOE, "num_experts": 3, "vocab_size": 63})
    source = model_from(config, seed=9)
    source.save_pretrained(tmp_path / "per-expert", max_shard_size="20KB")
    (tmp_path / "stacked").mkdir()
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, tmp_path / "stacked" / "model.safetensors")
    config.save_pretrained(tmp_path / "stacked")
    expected = source.state_dict()
    for gathered in run(load_into_sharded, nproc=2, args=(str(tmp_path / "per-expert"), str(tmp_path / "stacked"))).values():
        for label, state in gathered.items():
            assert state.keys() == expected.keys(), label
            for key, value in expected.items():
                assert torch.equal(state[key], value), (label, key)
