"""HF Trainer with hyperparallel (HPTrainer) on 2 real ranks against HF's Trainer in one process.

Same data order on both sides (the 2-rank run's global batch is the one-process run's batch),
fp32: per-step losses within 1e-5 for 10 steps with AdamW (a tiny Qwen3-MoE, hp's fused
modules, gradient accumulation, clipping, activation checkpointing) and with hp's Muon against torch.optim.Muon (a tiny
dense Qwen3); the saved HF directory loads in transformers and gives the trained model's
logits; a run resumed from a checkpoint continues with the uninterrupted run's losses.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Qwen3Config,
    Qwen3MoeConfig,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from hyperparallel.launch import run

STEPS, WORLD, PER_RANK, ACCUMULATION, SEQ = 10, 2, 2, 2, 16
SAMPLES = STEPS * WORLD * PER_RANK * ACCUMULATION
COMMON = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "initializer_range": 0.1}
CONFIGS = {
    "moe": lambda: Qwen3MoeConfig(**COMMON, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "dense": lambda: Qwen3Config(**COMMON),
}
PROBE = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(7))


def make_model(kind: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[kind](), attn_implementation="sdpa")


def dataset() -> list[dict[str, torch.Tensor]]:
    """Counting sequences (each token is the previous one plus a per-row step), so the loss falls."""
    generator = torch.Generator().manual_seed(1)
    starts = torch.randint(0, 128, (SAMPLES, 1), generator=generator)
    steps = torch.randint(1, 4, (SAMPLES, 1), generator=generator)
    ids = (starts + steps * torch.arange(SEQ)) % 128
    return [{"input_ids": row, "labels": row} for row in ids]


def training_args(out: str, per_device: int, **overrides) -> TrainingArguments:
    values = {
        "output_dir": out, "max_steps": STEPS, "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": ACCUMULATION, "learning_rate": 3e-3, "lr_scheduler_type": "cosine",
        "warmup_steps": 2, "weight_decay": 0.1, "max_grad_norm": 0.5, "logging_steps": 1, "save_strategy": "no",
        "report_to": "none", "seed": 3, "use_cpu": True, "disable_tqdm": True, "dataloader_num_workers": 0,
        "optim": "adamw_torch",
    }
    values.update(overrides)
    return TrainingArguments(**values)


class Losses(TrainerCallback):
    """The per-step losses Trainer logs (averaged over the ranks' micro-batches)."""

    def __init__(self):
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def reference_run(kind: str, optimizer: str, out: str, overrides: dict) -> tuple[list[float], torch.Tensor]:
    """HF's Trainer in one process on the 2-rank run's global batches, with AdamW or torch.optim.Muon."""
    torch.set_num_threads(1)
    model = make_model(kind)
    args = training_args(out, WORLD * PER_RANK, **overrides)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[(losses := Losses())])
    if optimizer == "muon":
        from hyperparallel.integrations.transformers import HPArguments

        trainer.optimizer = _torch_muon_adamw(model, args, HPArguments(), trainer.get_decay_parameter_names(model))
    trainer.train()
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits
    return losses.losses, logits


def _torch_muon_adamw(model, args, hp_args, decay_names):
    """The split hp's muon_adamw makes, with torch.optim.Muon (the numerics hp's Muon reproduces)."""
    from hyperparallel.integrations.transformers import ChainedOptimizer
    from hyperparallel.optim import muon_param_split

    muon_params, adamw_params = muon_param_split(model)
    names = {id(p): name for name, p in model.named_parameters()}
    groups = [
        {"params": [p for p in adamw_params if names[id(p)] in decay_names], "weight_decay": args.weight_decay},
        {"params": [p for p in adamw_params if names[id(p)] not in decay_names], "weight_decay": 0.0},
    ]
    muon = torch.optim.Muon(
        muon_params, lr=args.learning_rate, weight_decay=args.weight_decay, momentum=hp_args.muon_momentum,
        nesterov=hp_args.muon_nesterov, ns_steps=hp_args.muon_ns_steps, adjust_lr_fn=hp_args.muon_adjust_lr_fn,
    )
    adamw = torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
    )
    return ChainedOptimizer([muon, adamw])


def hp_run(kind: str, optimizer: str, patch: bool, out: str, save: str | None, resume: str | None = None,
           overrides: dict | None = None, pretrained: tuple[str, str] | None = None):
    """One rank of HPTrainer; returns its logged losses and the trained model's logits on PROBE.
    ``pretrained``: (loader, directory): the model is ``from_pretrained(directory)``'s, sharded
    before the trainer, or ``from_pretrained_meta(directory)``'s, which the trainer shards and fills."""
    import torch.distributed as dist

    from hyperparallel.integrations import transformers as integration
    from hyperparallel.integrations.transformers import HPArguments, HPTrainer

    torch.set_num_threads(1)
    if pretrained is None:
        model = make_model(kind)
    elif pretrained[0] == "from_pretrained":
        model = integration.from_pretrained(pretrained[1], patch=patch)
    else:
        model = integration.from_pretrained_meta(pretrained[1])
        model.gradient_checkpointing_enable()  # a meta model is changed as any, before it has values
    overrides = overrides or {}
    evaluating = overrides.get("eval_strategy", "no") != "no"
    trainer = HPTrainer(
        model=model, args=training_args(out, PER_RANK, **overrides), train_dataset=dataset(),
        eval_dataset=dataset()[:8] if evaluating else None, callbacks=[(losses := Losses())],
        hp_args=HPArguments(patch=patch, optimizer=optimizer),
    )
    trainer.train(resume_from_checkpoint=resume)
    if save:
        trainer.save_model(save)
    with torch.no_grad():
        logits = trainer.model(input_ids=PROBE).logits
    dist.barrier()
    return losses.losses, logits


def _assert_losses_equal(got: list[float], expected: list[float]) -> None:
    assert len(got) == len(expected) == STEPS, (got, expected)
    worst = max(abs(a - b) for a, b in zip(got, expected))
    assert worst <= 1e-5, f"largest per-step loss difference {worst:.3g}: {got} vs {expected}"


def test_adamw_matches_one_process_and_saves_a_loadable_hf_directory(tmp_path):
    """Each rank accumulates 2 micro-batches of 2 and reduces once, recomputing each layer in backward
    (HF's activation checkpointing); one process takes 2 batches of 4 and keeps its activations."""
    expected, expected_logits = run(reference_run, 1, ("moe", "hf", str(tmp_path / "ref"), {}))[0]
    save = tmp_path / "hf"
    results = run(hp_run, WORLD, ("moe", "hf", True, str(tmp_path / "hp"), str(save), None,
                                  {"activation_checkpointing": True}))
    got, logits = results[0]
    assert results[1][0] == got  # every rank logs the same (gathered) loss
    _assert_losses_equal(got, expected)
    assert expected[-1] < expected[0] - 0.1  # it trains
    assert sorted(p.name for p in save.iterdir()) == [
        "config.json", "generation_config.json", "model-00001-of-00001.safetensors",
        "model.safetensors.index.json", "training_args.bin",
    ]
    loaded = AutoModelForCausalLM.from_pretrained(save, attn_implementation="sdpa")
    assert type(loaded).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        reloaded = loaded(input_ids=PROBE).logits
    torch.testing.assert_close(reloaded, logits, atol=1e-5, rtol=0)  # the trained model, in stock modules
    torch.testing.assert_close(reloaded, expected_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("loader", ["from_pretrained", "from_pretrained_meta"])
def test_a_model_loaded_sharded_trains_as_one_loaded_whole(tmp_path, loader):
    """from_pretrained builds the model on the meta device and each rank reads only its rows of the
    HF directory; HPTrainer takes it sharded and trains it as one process trains the same weights.
    from_pretrained_meta leaves the sharding and reading to HPTrainer (LlamaFactory's way: the model
    is changed between loading and training), with the same result."""
    make_model("moe").save_pretrained(tmp_path / "pretrained")
    expected, _ = run(reference_run, 1, ("moe", "hf", str(tmp_path / "ref"), {}))[0]
    results = run(hp_run, WORLD, ("moe", "hf", True, str(tmp_path / "hp"), None, None, None,
                                  (loader, str(tmp_path / "pretrained"))))
    _assert_losses_equal(results[0][0], expected)


def save_in_shards(out: str, device_type: str = "cpu") -> None:
    import hyperparallel as hp
    from hyperparallel.integrations.transformers import save_pretrained, shard_model

    model = make_model("moe")
    if device_type == "cuda":
        torch.cuda.set_device(hp.comm.device())
        model = model.to(hp.comm.device())
    shard_model(model, patch=True)
    save_pretrained(model, out, max_shard_size=16 << 10)


def test_save_pretrained_writes_a_shard_file_at_a_time(tmp_path):
    """Every rank gathers one safetensors file's tensors at a time to rank 0, which writes it: the
    files hold the model's weights, tied and stacked as transformers' own save."""
    run(save_in_shards, WORLD, (str(tmp_path / "hf"),))
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(files) > 3 and files[-1].endswith(f"-of-{len(files):05d}.safetensors"), files
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info
    expected = make_model("moe").state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def meta_then_blocked_save(directory: str, blocked: str):
    from hyperparallel.integrations.transformers import from_pretrained_meta, save_pretrained, shard_model

    model = from_pretrained_meta(directory)
    assert model.training  # as from_config leaves it; HF's from_pretrained would give eval mode
    shard_model(model)  # no device: this rank's
    full = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
    try:
        save_pretrained(model, blocked)
    except Exception as error:  # noqa: BLE001 (returned for the test to read)
        return full, f"{type(error).__name__}: {error}"
    return full, None


def test_a_meta_model_sharded_by_hand_is_filled_and_a_failed_save_fails_every_rank(tmp_path):
    """shard_model fills a from_pretrained_meta model (what the optimizer refusal tells users to call).
    A save rank 0 cannot write raises on every rank instead of leaving the others in a gather."""
    make_model("moe").save_pretrained(tmp_path / "pretrained")
    (tmp_path / "blocked").write_text("a file where the directory should go")
    results = run(meta_then_blocked_save, WORLD, (str(tmp_path / "pretrained"), str(tmp_path / "blocked")))
    expected = make_model("moe").state_dict()
    for full, _ in results.values():
        assert full.keys() <= expected.keys()
        for name, tensor in full.items():
            assert torch.equal(tensor, expected[name]), name
    assert results[0][1].startswith(("FileExistsError", "NotADirectoryError")), results[0][1]
    assert "rank 0 failed writing the HF directory" in results[1][1], results[1][1]

    from hyperparallel.integrations.transformers import from_pretrained_meta

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "pretrained" / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no safetensors weights .* save_pretrained"):
        from_pretrained_meta(tmp_path / "bin")


def test_muon_matches_torch_muon_in_one_process(tmp_path):
    """Newton–Schulz (in bf16, as torch's) turns a last-bit change of its input into a visible one
    (test_muon_distributed.py), so here the two runs compute the same gradients bit for bit: each
    rank one micro-batch of 2 and one process those two in turn (a + b either way), unclipped."""
    unclipped = {"max_grad_norm": 1e3}
    one_process = {**unclipped, "per_device_train_batch_size": PER_RANK, "gradient_accumulation_steps": WORLD}
    expected, _ = run(reference_run, 1, ("dense", "muon", str(tmp_path / "ref"), one_process))[0]
    got, _ = run(hp_run, WORLD, ("dense", "muon", False, str(tmp_path / "hp"), None, None,
                                 {**unclipped, "gradient_accumulation_steps": 1}))[0]
    _assert_losses_equal(got, expected)
    assert expected[-1] < expected[0] - 0.1


def test_resume_from_a_checkpoint_continues_the_run(tmp_path):
    """Evaluated before each save too: a forward without backward leaves the root's full parameters
    registered, and the checkpoint must still hold the shards the optimizer steps."""
    out = tmp_path / "run"
    every_5 = {"save_strategy": "steps", "save_steps": 5, "eval_strategy": "steps", "eval_steps": 5}
    whole, logits = run(hp_run, WORLD, ("moe", "muon", True, str(out), None, None, every_5))[0]
    checkpoint = out / "checkpoint-5"
    assert (checkpoint / "hyperparallel" / ".metadata").is_file() and (checkpoint / "config.json").is_file()
    resumed, resumed_logits = run(hp_run, WORLD, ("moe", "muon", True, str(tmp_path / "again"), None,
                                                  str(checkpoint)))[0]
    assert len(resumed) == STEPS - 5
    worst = max(abs(a - b) for a, b in zip(resumed, whole[5:]))
    assert worst <= 1e-6, (resumed, whole[5:])
    torch.testing.assert_close(resumed_logits, logits, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("overrides", "hp_options", "given", "named"),
    [
        ({"fp16": True}, {}, False, "`fp16`"),
        ({}, {"optimizer": "muon"}, True, "HPArguments(optimizer='hf')"),
        ({}, {"optimizer": "hf"}, True, "shard_model"),
    ],
)
def test_refusals_name_the_option(tmp_path, overrides, hp_options, given, named):
    from hyperparallel.integrations.transformers import HPArguments, HPTrainer

    model = make_model("dense")
    optimizers = (torch.optim.AdamW(model.parameters()), None) if given else (None, None)
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        HPTrainer(model=model, args=training_args(str(tmp_path), PER_RANK, use_cpu=False, **overrides),
                  train_dataset=dataset(), optimizers=optimizers, hp_args=HPArguments(**hp_options))


def test_fsdp_in_accelerates_config_is_refused(tmp_path, monkeypatch):
    from hyperparallel.integrations.transformers import HPTrainer

    monkeypatch.setitem(os.environ, "ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="`fsdp`"):
        HPTrainer(model=make_model("dense"), args=training_args(str(tmp_path), PER_RANK), train_dataset=dataset())


def test_arguments_that_miss_the_launched_ranks_are_refused(tmp_path, monkeypatch):
    """Under torchrun on a machine without GPUs, HF's TrainingArguments see one process unless use_cpu."""
    from hyperparallel.integrations.transformers import HPTrainer

    monkeypatch.setitem(os.environ, "WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="`use_cpu=True`"):
        HPTrainer(model=make_model("dense"), args=training_args(str(tmp_path), PER_RANK, use_cpu=False),
                  train_dataset=dataset())
