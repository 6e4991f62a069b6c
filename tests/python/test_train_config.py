"""hyperparallel train: bad input gets a clear error naming the key and the fix; nothing is overwritten.

Every case goes through the real command (``hyperparallel.cli.main``) in this process:
the checks run before any rank starts.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from hyperparallel.cli import main
from hyperparallel.trainer.config import ConfigError, load_config, resolve_device
from hyperparallel.trainer.data import TokenLoader
from hyperparallel.trainer.run import check_output, clear_output
from hyperparallel.trainer.tokenize import prepare

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "examples" / "default.yaml"


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def _base(tmp_path: Path) -> list[str]:
    return [f"model.config={REPO / 'examples/tiny-moe.config.json'}",
            f"data.prepare.text=[{REPO / 'examples/data/stories.txt'}]",
            f"data.tokens={tmp_path / 'data/tokens.bin'}", f"output.dir={tmp_path / 'out'}"]


def _train(args: list[str], capsys) -> tuple[int, str]:
    status = main(["train", *args])
    captured = capsys.readouterr()
    return status, captured.err + captured.out


def test_misspelt_key_suggests_the_nearest(tmp_path, capsys):
    status, err = _train([str(DEFAULT), *_base(tmp_path), "optim.lrr=1e-3", "--dry-run"], capsys)
    assert status == 2
    assert "'optim.lrr' is unknown; did you mean 'optim.lr'?" in err
    cfg = _config(tmp_path, "trian:\n  steps: 10\nmodel:\n  config: x.json\n")
    status, err = _train([str(cfg)], capsys)
    assert status == 2 and "'trian' is unknown; did you mean 'train'?" in err
    cfg = _config(tmp_path, "model:\n  config: x.json\n  activation_checkpoint: true\n")
    with pytest.raises(ConfigError, match="did you mean 'model.activation_checkpointing'"):
        load_config(cfg)


def test_wrong_type_names_key_and_expected_type(tmp_path, capsys):
    status, err = _train([str(DEFAULT), *_base(tmp_path), "train.steps=ten"], capsys)
    assert status == 2
    assert "config key 'train.steps' must be an integer, got 'ten' (str) (the default is 100)" in err
    with pytest.raises(ConfigError, match="'model.patch' must be true/false, got 'yes please'"):
        load_config(DEFAULT, ["model.patch=yes please"])
    with pytest.raises(ConfigError, match="'optim.name' must be one of muon, adamw; got 'sgd'"):
        load_config(DEFAULT, ["optim.name=sgd"])
    # YAML 1.1 reads 3e-4 as a string; a number key takes it.
    assert load_config(DEFAULT, ["optim.lr=3e-4"]).optim.lr == 3e-4
    # ... and off, yes or 2024-01-05 as a boolean or a date: a string key takes them as written.
    cfg = load_config(DEFAULT, ["output.dir=off", "data.tokens=2024-01-05.bin", "model.patch=no"])
    assert (cfg.output.dir, cfg.data.tokens, cfg.model.patch) == ("off", "2024-01-05.bin", False)
    cfg = load_config(DEFAULT, ["output.dir=2024-01-05"])
    assert cfg.output.dir == "2024-01-05"


def test_values_and_overrides_a_run_could_not_use(tmp_path, capsys):
    for override, message in {
        "optim.betas=[0.9,0.99": "the value is not valid YAML",
        "optim.betas=[1.5,0.9]": "'optim.betas' must be two numbers in [0, 1)",
        "optim.ns_steps=-2": "'optim.ns_steps' must be a number >= 0",
        "optim.min_lr_ratio=5": "'optim.min_lr_ratio' is the final lr over the peak: at most 1",
        "optim.lr=.nan": "'optim.lr' must be a number >= 0, got nan",
    }.items():
        status, err = _train([str(DEFAULT), *_base(tmp_path), override, "--dry-run"], capsys)
        assert status == 2 and message in err, override
    # A section whose keys are all commented out still takes dotted overrides.
    cfg = _config(tmp_path, f"model:\n  config: {REPO / 'examples/tiny-moe.config.json'}\ncheckpoint:\n  # every: 4\n")
    assert load_config(cfg, ["checkpoint.every=2"]).checkpoint.every == 2


def test_a_model_the_run_cannot_build_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "no-type.json").write_text('{"hidden_size": 3}')
    status, err = _train([str(DEFAULT), *_base(tmp_path), f"model.config={tmp_path / 'no-type.json'}", "--dry-run"],
                         capsys)
    assert status == 2 and "is not a transformers model config" in err
    llama = {"model_type": "llama", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    (tmp_path / "llama.json").write_text(json.dumps(llama))
    status, err = _train([str(DEFAULT), *_base(tmp_path), f"model.config={tmp_path / 'llama.json'}", "--dry-run"],
                         capsys)
    assert status == 2 and "not llama; set model.patch=false" in err


def test_batch_not_divisible_by_world(tmp_path, capsys):
    status, err = _train([str(DEFAULT), *_base(tmp_path), "--nproc", "3"], capsys)
    assert status == 2
    assert "train.global_batch=16 is not divisible by train.micro_batch x world size = 8 x 3 = 24" in err
    assert "or run on 1 / 2 ranks" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal where torch sees no GPU")
def test_cuda_without_a_gpu_is_refused_and_auto_takes_the_cpu(tmp_path, capsys):
    status, err = _train([str(DEFAULT), *_base(tmp_path), "train.device=cuda", "--dry-run"], capsys)
    assert status == 2
    assert "train.device is cuda but torch" in err and "sees no GPU" in err and "set train.device=cpu" in err
    with pytest.raises(ConfigError, match="'train.device' must be one of auto, cpu, cuda; got 'gpu'"):
        load_config(DEFAULT, ["train.device=gpu"])
    cfg = load_config(DEFAULT)
    assert cfg.train.device == "auto" and resolve_device(cfg) == "cpu"
    status, out = _train([str(DEFAULT), *_base(tmp_path), "--dry-run"], capsys)
    assert status == 0 and "over 1 ranks (CPU)" in out and "peak RSS per rank" in out


def test_missing_files(tmp_path, capsys):
    status, err = _train([str(tmp_path / "nope.yaml")], capsys)
    assert status == 2 and f"config file {tmp_path / 'nope.yaml'} does not exist" in err
    status, err = _train([str(DEFAULT), *_base(tmp_path), f"model.config={tmp_path}/missing.json"], capsys)
    assert status == 2 and "model.config:" in err and "missing.json does not exist" in err
    status, err = _train([str(DEFAULT), *_base(tmp_path), f"data.prepare.text=[{tmp_path}/gone.txt]"], capsys)
    assert status == 2 and "data.prepare.text:" in err and "gone.txt does not exist" in err
    status, err = _train([str(DEFAULT), *_base(tmp_path), "data.prepare.text=[]"], capsys)
    assert status == 2 and "data.tokens:" in err and "hyperparallel data prepare" in err
    with pytest.raises(ConfigError, match="set exactly one of 'model.config'"):
        load_config(DEFAULT, ["model.pretrained=/tmp"])


def test_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    status, err = _train([str(DEFAULT), *_base(tmp_path)], capsys)
    assert status == 2
    assert "already holds a run" in err and "pass --overwrite" in err
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'
    # `data prepare` does not replace a token file either.
    tokens = tmp_path / "t.bin"
    tokens.write_bytes(b"keep")
    status = main(["data", "prepare", str(REPO / "examples/data/stories.txt"), "--out", str(tokens)])
    assert status == 2 and "pass --overwrite" in capsys.readouterr().err
    assert tokens.read_bytes() == b"keep"


def test_overwrite_deletes_only_a_runs_outputs_once_every_check_passed(tmp_path, capsys):
    text = tmp_path / "small.txt"
    text.write_text((REPO / "examples/data/stories.txt").read_text()[:50_000])
    tokens = tmp_path / "small.bin"
    prepare([str(text)], tokens, tokenizer="bpe", vocab_size=300)
    config = json.loads((REPO / "examples/tiny-moe.config.json").read_text())
    (tmp_path / "vocab100.json").write_text(json.dumps({**config, "vocab_size": 100}))
    out = tmp_path / "out"
    (out / "checkpoints/step_00000004").mkdir(parents=True)
    for name in ("metrics.jsonl", "NOTES.md"):
        (out / name).write_text("keep")
    # A check that fails late (the tokens' vocabulary against the model's) deletes nothing.
    status, err = _train([str(DEFAULT), f"model.config={tmp_path / 'vocab100.json'}", f"data.tokens={tokens}",
                          f"output.dir={out}", "--overwrite"], capsys)
    assert status == 2 and "vocabulary of 300" in err
    assert sorted(p.name for p in out.iterdir()) == ["NOTES.md", "checkpoints", "metrics.jsonl"]
    cfg = load_config(DEFAULT, [f"output.dir={out}"])
    clear_output(cfg)  # what --overwrite does just before the ranks start
    assert [p.name for p in out.iterdir()] == ["NOTES.md"]
    # The user's own files are no run: training may start beside them.
    assert check_output(cfg, overwrite=False) == "fresh"


def test_text_that_makes_no_token_file(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("\n\n")
    status, err = _train([str(DEFAULT), *_base(tmp_path), f"data.prepare.text=[{tmp_path / 'empty.txt'}]"], capsys)
    assert status == 2 and "hold no text" in err
    assert not any((tmp_path / "data").iterdir())  # nothing a later run would take for data
    status = main(["data", "prepare", str(REPO / "examples/data/stories.txt"), "--out", str(tmp_path / "x.json")])
    assert status == 2 and "name it NAME.bin" in capsys.readouterr().err


def test_loader_shards_deterministically_and_resumes(tmp_path):
    text = tmp_path / "small.txt"
    shutil.copy(REPO / "examples/data/stories.txt", text)
    text.write_text(text.read_text()[:200_000])
    tokens = tmp_path / "small.bin"
    meta = prepare([str(text)], tokens, tokenizer="bpe", vocab_size=300)
    assert meta["vocab_size"] == 300 and meta["eos_id"] == 1
    # An HF tokenizer from a directory (the one just trained) gives the same token file.
    (tmp_path / "tok").mkdir()
    shutil.copy(tmp_path / "small.tokenizer.json", tmp_path / "tok" / "tokenizer.json")
    assert main(["data", "prepare", str(text), "--out", str(tmp_path / "again.bin"),
                 "--tokenizer", str(tmp_path / "tok")]) == 0
    assert (tmp_path / "again.bin").read_bytes() == tokens.read_bytes()

    def batches(world: int, steps: int, start: int = 0) -> list[np.ndarray]:
        loaders = [TokenLoader(tokens, seq_len=32, global_batch=8, micro_batch=8 // world // (2 if world == 1 else 1),
                               dp_rank=r, dp_size=world, seed=5) for r in range(world)]
        accumulation = 8 // (world * loaders[0].micro_batch_size)
        out = []
        for loader in loaders:
            loader.load_state_dict({**loader.state_dict(), "position": start})
        for _ in range(steps):
            rows = [loader.micro_batch(m).numpy() for m in range(accumulation) for loader in loaders]
            out.append(np.concatenate(rows))
            for loader in loaders:
                loader.advance()
        return out

    one, two = batches(1, 70), batches(2, 70)  # several epochs of the small file
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)  # the global batch does not depend on the world size
    resumed = batches(2, 10, start=60 * 8)
    for a, b in zip(two[60:], resumed):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(one[0], one[1])
    other_seed = TokenLoader(tokens, seq_len=32, global_batch=8, micro_batch=4, dp_rank=0, dp_size=2, seed=6)
    with pytest.raises(ValueError, match="needs the same token file, data.seq_len and data.seed"):
        other_seed.load_state_dict({**TokenLoader(tokens, seq_len=32, global_batch=8, micro_batch=4, dp_rank=0,
                                                  dp_size=2, seed=5).state_dict(), "position": 80})


def test_a_bad_token_file_is_a_one_line_error(tmp_path, capsys):
    """Not made by `data prepare`, garbage beside a valid .json, truncated: refused before any rank starts."""
    text = tmp_path / "small.txt"
    text.write_text((REPO / "examples/data/stories.txt").read_text()[:50_000])
    good = tmp_path / "good.bin"
    prepare([str(text)], good, tokenizer="bpe", vocab_size=300)
    stray = tmp_path / "stray.bin"
    stray.write_bytes(good.read_bytes())  # the right bytes, but no .json beside them
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 255, good.stat().st_size, dtype=np.uint8).tobytes())
    shutil.copy(good.with_suffix(".json"), garbage.with_suffix(".json"))
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(good.read_bytes()[:-100])
    shutil.copy(good.with_suffix(".json"), truncated.with_suffix(".json"))
    expected = {stray: "no metadata (stray.json is missing", garbage: "has no token file header",
                truncated: "is truncated or was overwritten"}
    for tokens, problem in expected.items():
        status, err = _train([str(DEFAULT), *_base(tmp_path)[:1], f"data.tokens={tokens}",
                              f"output.dir={tmp_path / 'out'}", "--dry-run"], capsys)
        assert status == 2 and err.count("\n") == 1, err
        assert err.startswith(f"hyperparallel train: data.tokens: {tokens}") and problem in err, err
        assert "hyperparallel data prepare" in err
    assert main(["train", str(DEFAULT), *_base(tmp_path)[:1], f"data.tokens={good}", "--dry-run",
                 f"output.dir={tmp_path / 'out'}"]) == 0


def test_pretrained_directory_loads_its_weights(tmp_path, capsys):
    import torch

    from hyperparallel.trainer import model as model_lib

    fresh = load_config(DEFAULT, ["model.seed=7"])
    saved = model_lib.build(fresh)
    saved.save_pretrained(tmp_path / "hf")
    cfg = load_config(DEFAULT, ["model.config=null", f"model.pretrained={tmp_path / 'hf'}"])
    loaded = model_lib.build(cfg)  # seed 0 weights, then the directory's
    for (name, a), (_, b) in zip(saved.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    status, out = _train([str(DEFAULT), "model.config=null", f"model.pretrained={tmp_path / 'hf'}",
                          *_base(tmp_path)[1:], "--dry-run"], capsys)
    assert status == 0 and f"weights from {tmp_path / 'hf'}" in out


def test_token_vocabulary_larger_than_the_model(tmp_path, capsys):
    import json

    text = tmp_path / "small.txt"
    text.write_text((REPO / "examples/data/stories.txt").read_text()[:100_000])
    prepare([str(text)], tmp_path / "t.bin", tokenizer="bpe", vocab_size=400)
    model = json.loads((REPO / "examples/tiny-moe.config.json").read_text())
    (tmp_path / "small-vocab.json").write_text(json.dumps({**model, "vocab_size": 300}))
    status, err = _train([str(DEFAULT), *_base(tmp_path), f"model.config={tmp_path / 'small-vocab.json'}",
                          f"data.tokens={tmp_path / 't.bin'}"], capsys)
    assert status == 2
    assert "has a vocabulary of 400 but the model's vocab_size is 300" in err
    assert not (tmp_path / "out").exists()


def test_resume_drops_a_metrics_line_a_crash_cut_short(tmp_path):
    from hyperparallel.trainer.report import Metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 7.5}\n{"step": 2, "loss": 7.1}\n{"step": 3, "lo')
    Metrics(path, keep_until=2).close()
    assert path.read_text() == '{"step": 1, "loss": 7.5}\n{"step": 2, "loss": 7.1}\n'


def test_progress_ends_at_stop_at(capsys):
    from hyperparallel.trainer.report import Progress

    progress = Progress(400, 0, 45, 10, True)  # train.steps 400, train.stop_at 45, no terminal
    for step in range(1, 46):
        progress.update(step, 1.0, 1e-3, 100.0)
    progress.close()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[1] for line in lines] == ["1/400", "10/400", "20/400", "30/400", "40/400", "45/400"]


def sharded_build(overrides_list: list[list[str]]) -> list[dict]:
    """The trainer's model on this rank (built on the meta device, sharded, each rank filling its
    rows), gathered whole, for each list of config overrides."""
    import torch.distributed as dist

    import hyperparallel as hp
    from hyperparallel.trainer import model as model_lib

    torch.set_num_threads(1)
    hp.comm.init()
    states = []
    for overrides in overrides_list:
        cfg = load_config(DEFAULT, overrides)
        model = model_lib.build_sharded(cfg, model_lib.build_mesh("cpu"), torch.device("cpu"))
        assert model.get_input_embeddings().weight.to_local().shape[0] < model.config.vocab_size
        states.append({
            **{k: v.full_tensor() for k, v in model.state_dict().items()},
            **{k: v.clone() for k, v in model.named_buffers()},
            "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        })
        dist.barrier()
    return states


def test_sharded_build_is_the_whole_build_at_any_world_size(tmp_path):
    """The trainer builds its model on the meta device and each rank fills only its own rows, fresh
    (HF's init from model.seed) or from model.pretrained: the same weights (and RoPE buffers) as the
    whole model built in one process. Also a dense Qwen3 with tied embeddings (drawn once, as HF
    does: the padding row stays zero), and a Nemotron-H whose mamba mixer's init draws again into
    its child's weight (its layer's parameters are whole until the layer is done)."""
    from transformers import NemotronHConfig

    from hyperparallel.launch import run
    from hyperparallel.trainer import model as model_lib

    config = json.loads((REPO / "examples/tiny-moe.config.json").read_text())
    dense = {k: v for k, v in config.items() if "expert" not in k and k not in ("router_aux_loss_coef", "output_router_logits")}
    (tmp_path / "tied.json").write_text(json.dumps({**dense, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                                                    "tie_word_embeddings": True}))
    model_lib.build(load_config(DEFAULT, ["model.seed=7"])).save_pretrained(tmp_path / "hf")
    NemotronHConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=16, chunk_size=16,
                    layers_block_type=["linear_attention", "mlp"], vocab_size=257, max_position_embeddings=128,
                    use_mamba_kernels=False).save_pretrained(tmp_path / "nemotron")
    variants = [
        ["model.seed=3", "model.activation_checkpointing=true", "model.mixed_precision=bfloat16"],
        ["model.config=null", f"model.pretrained={tmp_path / 'hf'}"],
        [f"model.config={tmp_path / 'tied.json'}"],
        ["model.patch=false", f"model.config={tmp_path / 'nemotron' / 'config.json'}"],
    ]
    wholes = []
    for overrides in variants:
        whole = model_lib.build(load_config(DEFAULT, overrides))
        wholes.append({**whole.state_dict(), **dict(whole.named_buffers()),
                       "tied": whole.get_output_embeddings().weight is whole.get_input_embeddings().weight})
    assert wholes[2]["tied"] and not wholes[0]["tied"]
    assert not wholes[2]["model.embed_tokens.weight"][0].any()  # pad_token_id 0
    for states in run(sharded_build, nproc=2, args=(variants,)).values():
        for overrides, state, whole in zip(variants, states, wholes):
            assert state.keys() == whole.keys(), overrides
            for key, value in whole.items():
                assert value == state[key] if key == "tied" else torch.equal(value, state[key]), (overrides, key)
