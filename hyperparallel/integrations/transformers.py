"""HuggingFace ``Trainer`` with hyperparallel underneath.

:class:`HPTrainer` is ``transformers.Trainer`` that, instead of handing the model to
accelerate's DDP/FSDP wrapping, shards it with ``hp.fully_shard`` (each decoder layer, then
the root) and optionally swaps in hp's fused modules (``hp.nn.patch``). Everything else is
the Trainer's own loop, data sharding, logging and callbacks, with these pieces swapped:

- the optimizer: hp's Muon for the hidden matrices and expert stacks + AdamW for the rest
  (:class:`HPArguments` ``optimizer="muon"``), or whatever the Trainer would build or is
  given (``optimizer="hf"``); either way it steps the sharded (DTensor) parameters;
- gradient accumulation reduces only on the last micro-batch (``set_requires_gradient_sync``);
- gradient-norm clipping spans the shards of every rank;
- :meth:`HPTrainer.save_model` gathers the shards and writes an HF directory (config.json and
  safetensors) that ``from_pretrained`` loads;
- checkpoints (``checkpoint-N``) hold, besides that directory, the model and optimizer shards
  in ``hyperparallel/`` (``hp.checkpoint``: torch DCP's format, reshardable), which
  ``resume_from_checkpoint`` loads.

:class:`HPTrainerMixin` does the same for any ``Trainer`` subclass (``class
MyTrainer(HPTrainerMixin, SFTTrainer)``). Nothing here assumes the CPU: the model shards
on the device its parameters are on.

Example (``torchrun --nproc-per-node 2 train.py``)::

    from transformers import AutoModelForCausalLM, TrainingArguments
    from hyperparallel.integrations.transformers import HPArguments, HPTrainer

    model = AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-0.6B")
    args = TrainingArguments("out", max_steps=100, per_device_train_batch_size=4, learning_rate=2e-4)
    trainer = HPTrainer(model=model, args=args, train_dataset=dataset, hp_args=HPArguments(patch=True))
    trainer.train()
    trainer.save_model()   # out/: config.json, model-0000i-of-0000n.safetensors, the index
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
from collections import ChainMap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME

import hyperparallel as hp
from hyperparallel._log import log
from hyperparallel.checkpoint import hf
from hyperparallel.trainer.model import decoder_layers

# Inside a checkpoint-N directory: the model and optimizer shards (hp.checkpoint).
STATE_DIR = "hyperparallel"


@dataclass
class HPArguments:
    """What hyperparallel does under the Trainer (in LlamaFactory, the config's ``hyperparallel:`` keys).

    Attributes:
        patch: swap the model's RMSNorms, attention, MLPs and MoE router/experts for hp's fused
            modules (``hp.nn.patch``: Qwen3 and Qwen3-MoE). For another model the run warns and
            keeps the model's own modules.
        optimizer: ``"muon"``: ``hp.optim.Muon`` for the hidden matrices and expert stacks, torch
            AdamW for embeddings, output head, norms and biases, both with the TrainingArguments'
            ``learning_rate`` and schedule, ``weight_decay`` (none on norms and biases, as HF),
            ``adam_beta1/2`` and ``adam_epsilon``. ``"hf"``: the optimizer the Trainer builds
            (``TrainingArguments.optim``) or is given (``optimizers``, ``optimizer_cls_and_kwargs``).
        muon_momentum, muon_nesterov, muon_ns_steps, muon_adjust_lr_fn: ``hp.optim.Muon``'s
            ``momentum``, ``nesterov``, ``ns_steps`` and ``adjust_lr_fn`` (``"match_rms_adamw"``
            lets Muon share AdamW's learning rate).

    Example::

        HPArguments(patch=True, optimizer="muon", muon_momentum=0.95)
    """

    patch: bool = False
    optimizer: Literal["muon", "hf"] = "muon"
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_adjust_lr_fn: str | None = "match_rms_adamw"

    def __post_init__(self) -> None:
        if self.optimizer not in ("muon", "hf"):
            raise ValueError(
                f"hyperparallel: optimizer {self.optimizer!r}: use 'muon' (hp's Muon + AdamW) or 'hf' "
                "(the Trainer's own, TrainingArguments.optim)"
            )


class ChainedOptimizer(torch.optim.Optimizer):
    """Several torch optimizers stepped as one, for code that takes one (HF's Trainer, LR schedulers).

    ``param_groups`` are the optimizers' own group dicts, so a scheduler setting ``lr`` sets
    it for them; ``state`` reads through to theirs. ``state_dict()`` holds each one's.

    Example::

        opt = ChainedOptimizer([hp.optim.Muon(matrices, lr=2e-3), torch.optim.AdamW(rest, lr=2e-3)])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        loss.backward(); opt.step(); sched.step(); opt.zero_grad()
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        groups = [group for optimizer in self.optimizers for group in optimizer.param_groups]
        # torch's bookkeeping (hooks, the step wrapper schedulers look for), then the real groups.
        super().__init__([{"params": group["params"]} for group in groups], {})
        self.param_groups = groups
        self.state = ChainMap(*(optimizer.state for optimizer in self.optimizers))

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = state_dict["optimizers"]
        if len(states) != len(self.optimizers):
            raise ValueError(f"ChainedOptimizer: a state of {len(states)} optimizers for {len(self.optimizers)}")
        for optimizer, state in zip(self.optimizers, states):
            optimizer.load_state_dict(state)


def shard_model(
    model: nn.Module, *, patch: bool = False, bf16: bool = False, device: str | torch.device | None = None
) -> hp.nn.PatchReport | None:
    """What :class:`HPTrainer` does to its model, in place; collective over the job's ranks.

    ``hp.nn.patch`` when ``patch`` (a model it does not support keeps its modules, with a
    warning), then ``hp.fully_shard`` on each decoder layer and on the root, over a mesh of
    every rank on the device the parameters are on (HSDP across nodes). ``bf16``: bf16
    compute with fp32 gradient reduction (``hp.MixedPrecisionPolicy``). ``device``: where a model
    built on the meta device is sharded to (default: where the parameters are; for a meta model,
    this rank's device, ``hp.comm.device()``); a :func:`from_pretrained_meta` model is then
    filled, each rank reading its rows of the weights. Call it yourself to build an optimizer on
    the sharded parameters before making the trainer.

    Returns the patch report, or None without ``patch``.

    Raises:
        TypeError: the model has no decoder layers to shard (``model.model.layers``).

    Example::

        shard_model(model, patch=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = HPTrainer(model=model, args=args, optimizers=(opt, None), hp_args=HPArguments(optimizer="hf"))
    """
    try:
        layers = decoder_layers(model)
    except TypeError:
        raise TypeError(
            f"hyperparallel cannot shard {type(model).__name__}: it shards HF decoder-only models, one group per "
            "decoder layer in model.model.layers (Qwen3, Qwen3-MoE, Llama, Mistral, ...)"
        ) from None
    report = None
    if patch:
        try:
            report = hp.nn.patch(model)
            log.info("%s", report)
        except TypeError as error:
            log.warning("patch: %s; training with the model's own modules", error)
    meta = _unfilled(model)
    if device is None:
        device = hp.comm.device() if meta else next(model.parameters()).device
    device = torch.device(device)
    mesh = _mesh(device)
    policy = (
        hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
        else hp.MixedPrecisionPolicy()
    )
    # Activation checkpointing (HF checkpoints a layer's forward, inside its hooks) recomputes the
    # layer in backward from the parameters it then holds. On a device hp unshards them before
    # the layer's backward; on the CPU keep the full ones registered, which costs no memory (they
    # live in node-shared memory either way).
    reshard = False if device.type == "cpu" else None
    for layer in layers:
        hp.fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    hp.fully_shard(model, mesh=mesh, mp_policy=policy)
    if meta:
        log.info("%s built on the meta device: sharded, then each rank reads its rows of %s",
                 type(model).__name__, model._hp_weights)
        _fill(model, device)
    return report


def from_pretrained(
    directory: str | os.PathLike, *, patch: bool = False, bf16: bool = False, device: str | torch.device = "cpu"
) -> nn.Module:
    """The HF causal LM in local directory ``directory``, sharded as :class:`HPTrainer` shards
    (:func:`shard_model`) without ever being whole in one rank's memory; collective.

    ``from_pretrained`` loads the whole model on every rank first. This builds it on the meta
    device (:func:`from_pretrained_meta`), shards it onto ``device``, and each rank reads only its
    own rows of the directory's tensors (``hp.nn.load_pretrained``), so a model may be as large as
    the job's memory. The weights are fp32, as training keeps them (``bf16``: bf16 compute, as in
    shard_model).

    Example (``torchrun --nproc-per-node 8 train.py``)::

        model = from_pretrained("Qwen3-30B-A3B/", patch=True, bf16=True, device="cuda")
        trainer = HPTrainer(model=model, args=args, train_dataset=dataset)
    """
    model = from_pretrained_meta(directory)
    device = torch.device(device)
    if device.type == "cuda":
        device = hp.comm.device() if device.index is None else device
        torch.cuda.set_device(device)
    shard_model(model, patch=patch, bf16=bf16, device=device)
    return model


def from_pretrained_meta(
    directory: str | os.PathLike, *, config=None, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False
) -> nn.Module:
    """The HF causal LM in local directory ``directory`` built on the meta device: its modules,
    config and generation config, no values yet. :class:`HPTrainer` (any :class:`HPTrainerMixin`)
    given it shards it onto the training device and has each rank read only its rows of the
    directory's tensors: the model is never whole in one rank's memory. Until then it may be
    changed as any model (gradient checkpointing, dtypes, hooks) but not run.

    ``config``: the model's config, when changed from the directory's (``AutoConfig``);
    ``dtype``: the parameters' (fp32, as training keeps them).

    Example (``torchrun --nproc-per-node 8 train.py``)::

        model = from_pretrained_meta("Qwen3-30B-A3B/")
        model.gradient_checkpointing_enable()
        trainer = HPTrainer(model=model, args=args, train_dataset=dataset, hp_args=HPArguments(patch=True))
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory} has no config.json: pass a local HF model directory")
    if not hf.has_safetensors(directory):
        raise FileNotFoundError(
            f"{directory} has no safetensors weights ({hf.SINGLE} or {hf.INDEX}), which each rank reads its rows "
            "of: save the model with transformers' save_pretrained (safetensors by default), or load it whole with "
            "AutoModelForCausalLM.from_pretrained"
        )
    if config is None:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    config._name_or_path = str(directory)  # as from_pretrained leaves it
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(directory)
    model._hp_weights = directory
    return model


def _unfilled(model: nn.Module) -> bool:
    """Whether ``model`` is :func:`from_pretrained_meta`'s and has no values yet (sharded or
    not); any other model with parameters on the meta device is refused."""
    if getattr(model, "_hp_weights", None) is not None:
        return True
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(
            f"hyperparallel: {type(model).__name__} is on the meta device with no weights to load: build it with "
            "hyperparallel.integrations.transformers.from_pretrained_meta(directory), or give it values"
        )
    return False


def _fill(model: nn.Module, device: torch.device) -> None:
    """A sharded :func:`from_pretrained_meta` model's values: the buffers' memory on ``device``
    (the shards have theirs), then each rank's rows of the directory's tensors."""
    from hyperparallel.trainer.model import load_weights

    model.to_empty(device=device)
    load_weights(model, model._hp_weights)
    del model._hp_weights


def _mesh(device: torch.device) -> DeviceMesh:
    """Every rank, on ``device``'s type: 1-D within a node, (nodes, ranks per node) for HSDP."""
    topology = hp.comm.init().topology
    if topology.num_nodes > 1:
        return init_device_mesh(
            device.type, (topology.num_nodes, topology.local_world_size), mesh_dim_names=("replicate", "shard")
        )
    return init_device_mesh(device.type, (topology.world_size,))


def save_pretrained(model: nn.Module, out: str | os.PathLike, max_shard_size: int = 5 << 30) -> None:
    """Write ``model`` (sharded by hp.fully_shard or not) as an HF directory; collective.

    Rank 0 writes ``config.json`` (and ``generation_config.json``), the safetensors shards and
    their index with hyperparallel's C++ writer (:class:`hyperparallel.checkpoint.hf.DirectoryWriter`),
    one shard file at a time: every rank gathers that file's full tensors to rank 0 (on the CPU),
    so no rank ever holds more of the model than one file (``max_shard_size``). Tied weights are
    written once, as ``save_pretrained`` does.

    Example::

        save_pretrained(model, "out")
        AutoModelForCausalLM.from_pretrained("out")
    """
    _reshard(model)
    state = get_model_state_dict(model)  # this rank's shards, HF's names
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    tied -= {name for name, _ in model.named_parameters()}
    sizes = {name: t.numel() * t.element_size() for name, t in state.items() if name not in tied}
    writes = not dist.is_initialized() or dist.get_rank() == 0
    with tempfile.TemporaryDirectory() as staging:
        def start() -> hf.DirectoryWriter:
            config = copy.deepcopy(model.config)
            config.architectures = [_hf_class(model).__name__]
            config.save_pretrained(staging)
            return hf.DirectoryWriter(out, Path(staging) / "config.json", sizes, max_shard_size)

        writer = _on_rank0(writes, start)
        # Every rank plans the same shards (from the global shapes); only rank 0 keeps what it gathers.
        for names in hf.shard_plan(sizes, max_shard_size):
            tensors = {name: _gathered(state[name], writes) for name in names}
            _on_rank0(writes, lambda tensors=tensors: writer.write(tensors))
        _on_rank0(writes, lambda: writer.close())

    def finish() -> None:
        generation = getattr(model, "generation_config", None)
        if generation is not None and model.can_generate():
            generation.save_pretrained(out)

    _on_rank0(writes, finish)


def _gathered(tensor: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """The full tensor on the CPU where ``keep``; collective for a DTensor (every rank calls it).

    A GPU's shards are gathered from host memory where the mesh's groups move CUDA tensors with
    Gloo (as ``hp.comm.init()`` starts the default group, and wherever ranks share a GPU): Gloo
    stages them through the host anyway, and its CUDA all-gather segfaulted in torch 2.11
    (docs/gpu.md). Over NCCL they are gathered on the GPU."""
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        if tensor.device.type != "cpu" and any(
            "nccl" not in str(dist.get_backend(mesh.get_group(dim))) for dim in range(mesh.ndim)
        ):
            tensor = tensor.detach().to("cpu")  # the local shard on the host, under the same mesh
        tensor = tensor.full_tensor()
    return tensor.detach().cpu() if keep else None


def _on_rank0(here: bool, action):
    """``action()`` where ``here`` (rank 0), its failure raised on every rank: the others would
    otherwise wait for rank 0 in the next gather. Collective."""
    result, error = None, None
    if here:
        try:
            result = action()
        except Exception as raised:  # noqa: BLE001 (re-raised below, on every rank)
            error = raised
    if dist.is_initialized():
        said = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(said, src=0)
        if error is None and said[0] is not None:
            raise RuntimeError(f"hyperparallel: rank 0 failed writing the HF directory: {said[0]}")
    if error is not None:
        raise error
    return result


def _reshard(model: nn.Module) -> None:
    """Register the sharded parameters in every hp group. A forward without backward (evaluation)
    leaves the root's full parameters registered until the next backward, and state dicts and
    optimizers name the sharded ones."""
    for module in model.modules():
        if isinstance(module, hp.FSDPModule):
            module.reshard()


def _hf_class(model: nn.Module) -> type:
    """The model's transformers class (hp.fully_shard gives it a subclass, HP<name>)."""
    return next(cls for cls in type(model).__mro__ if not issubclass(cls, hp.FSDPModule))


class _AcceleratorMixin:
    """accelerate's Accelerator, told that a model sharded by hp.fully_shard places, shards and
    reduces itself: no DDP (which rejects DTensor parameters), no ``.to()``; ``no_sync`` skips
    the reduction; the gradient norm spans every rank's shards."""

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        if isinstance(model, hp.FSDPModule):
            # Evaluation mode prepares autocast and torch.compile only: exactly what remains.
            return super().prepare_model(model, device_placement=False, evaluation_mode=True)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module):
        if not isinstance(model, hp.FSDPModule):
            with super().no_sync(model):
                yield
            return
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2):
        parameters = list(parameters)
        if not any(isinstance(p, DTensor) for p in parameters):
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        self.unscale_gradients()
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm


_ACCELERATOR_CLASSES: dict[type, type] = {}


def _accelerator_class(cls: type) -> type:
    if cls not in _ACCELERATOR_CLASSES:
        _ACCELERATOR_CLASSES[cls] = type(f"HP{cls.__name__}", (_AcceleratorMixin, cls), {})
    return _ACCELERATOR_CLASSES[cls]


class HPTrainerMixin:
    """The hyperparallel part of :class:`HPTrainer`, for any ``transformers.Trainer`` subclass.

    Put it first: ``class MyTrainer(HPTrainerMixin, SomeTrainer)``. The constructor takes the
    base's arguments plus ``hp_args`` (:class:`HPArguments`) and shards the model when the base's
    constructor is done (a model already sharded by :func:`shard_model` is kept as it is; one
    from :func:`from_pretrained_meta` is sharded onto the training device and each rank reads its
    rows of the weights).

    Refused, each with the option named: DeepSpeed or FSDP in the TrainingArguments (hp shards
    the model itself), ``fp16`` (hp's mixed precision is ``bf16``: bf16 compute, fp32
    reduction), a PEFT (LoRA) model (hp trains every parameter), a model without decoder
    layers, and an optimizer made before the model was sharded.
    """

    def __init__(self, *args, hp_args: HPArguments | None = None, **kwargs) -> None:
        self.hp_args = hp_args or HPArguments()
        training_args = kwargs["args"] if "args" in kwargs else (args[1] if len(args) > 1 else None)
        model = kwargs["model"] if "model" in kwargs else (args[0] if args else None)
        if training_args is not None:
            _check_training_args(training_args)
        if model is not None:
            _check_model(model)
        super().__init__(*args, **kwargs)
        if self.hp_args.optimizer == "muon" and (self.optimizer is not None or self.optimizer_cls_and_kwargs):
            raise ValueError(
                "hyperparallel: an optimizer was given to the trainer and HPArguments(optimizer='muon') builds hp's "
                "Muon + AdamW: pass HPArguments(optimizer='hf') to train with yours"
            )
        if self.optimizer is not None and not isinstance(self.model, hp.FSDPModule):
            raise ValueError(
                "hyperparallel: the optimizer given to the trainer was made before the model was sharded, and "
                "hp.fully_shard replaces the parameters it holds: shard first (hyperparallel.integrations."
                "transformers.shard_model(model)) and build the optimizer then, or pass "
                "optimizer_cls_and_kwargs=(cls, kwargs) instead"
            )
        self.patch_report = self._shard(self.model)

    def _shard(self, model: nn.Module) -> hp.nn.PatchReport | None:
        if isinstance(model, hp.FSDPModule):
            if _unfilled(model):  # sharded by hp.fully_shard itself
                _fill(model, self.args.device)
            return None
        _check_model(model)
        return shard_model(model, patch=self.hp_args.patch, bf16=self.args.bf16,
                           device=self.args.device if _unfilled(model) else None)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator.__class__ = _accelerator_class(type(self.accelerator))

    def call_model_init(self, *args, **kwargs) -> nn.Module:
        model = super().call_model_init(*args, **kwargs)
        self._shard(model)
        return model

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        # The shards stay where hp.fully_shard put them; a meta model is sharded onto the device.
        if not isinstance(model, hp.FSDPModule) and not _unfilled(model):
            super()._move_model_to_device(model, device)

    def create_optimizer(self, model: nn.Module | None = None):
        if self.hp_args.optimizer == "muon" and self.optimizer is None:
            model = model if model is not None else self.model
            self.optimizer = muon_adamw(model, self.args, self.hp_args, self.get_decay_parameter_names(model))
        return super().create_optimizer(model)

    # -- saving and resuming ---------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the model as an HF directory (:func:`save_pretrained`), the tokenizer and the
        TrainingArguments beside it; collective (every rank calls it, rank 0 writes)."""
        if not isinstance(self.model, hp.FSDPModule):
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        save_pretrained(self.model, output_dir)
        if self.args.should_save:
            tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
            if tokenizer is not None:
                tokenizer.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")
        return None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not isinstance(self.model, hp.FSDPModule):
            return super()._save_optimizer_and_scheduler(output_dir)
        _reshard(self.model)
        state = {
            "model": get_model_state_dict(self.model),
            "optim": get_optimizer_state_dict(self.model, self._torch_optimizers()),
        }
        hp.checkpoint.save(state, Path(output_dir) / STATE_DIR)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        model = model if model is not None else self.model
        if not isinstance(model, hp.FSDPModule):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        _reshard(model)
        state = {"model": get_model_state_dict(model)}
        hp.checkpoint.load(state, _state_dir(resume_from_checkpoint))
        set_model_state_dict(model, state["model"])
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not isinstance(self.model, hp.FSDPModule):
            return super()._load_optimizer_and_scheduler(checkpoint)
        _reshard(self.model)
        optimizers = self._torch_optimizers()
        state = {"optim": get_optimizer_state_dict(self.model, optimizers)}
        hp.checkpoint.load(state, _state_dir(checkpoint))
        set_optimizer_state_dict(self.model, optimizers, state["optim"])
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
        return None

    def _load_best_model(self) -> None:
        if not isinstance(self.model, hp.FSDPModule):
            return super()._load_best_model()
        self._load_from_checkpoint(self.state.best_model_checkpoint)
        return None

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers behind the trainer's (accelerate wraps it; Muon + AdamW are chained)."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        return list(optimizer.optimizers) if isinstance(optimizer, ChainedOptimizer) else [optimizer]


class HPTrainer(HPTrainerMixin, Trainer):
    """``transformers.Trainer`` training with hyperparallel (see the module docstring).

    Takes the Trainer's arguments and ``hp_args`` (:class:`HPArguments`); run it under
    ``torchrun`` (one process is a one-rank job).

    Example::

        trainer = HPTrainer(model=model, args=TrainingArguments("out", max_steps=10), train_dataset=data,
                            hp_args=HPArguments(patch=True, optimizer="muon"))
        trainer.train()
        trainer.save_model()
    """


def muon_adamw(model: nn.Module, args, hp_args: HPArguments, decay_names: Sequence[str]) -> ChainedOptimizer:
    """hp's Muon for the hidden matrices and expert stacks and AdamW for the rest
    (``hp.optim.muon_param_split``), set from the TrainingArguments ``args``; parameters not
    named in ``decay_names`` (norms, biases: ``Trainer.get_decay_parameter_names``) get no
    weight decay.

    Example::

        opt = muon_adamw(model, training_args, HPArguments(), trainer.get_decay_parameter_names(model))
    """
    muon_params, adamw_params = hp.optim.muon_param_split(model)
    names = {id(p): name for name, p in model.named_parameters()}
    decay = set(decay_names)
    groups = [
        {"params": [p for p in adamw_params if names[id(p)] in decay], "weight_decay": args.weight_decay},
        {"params": [p for p in adamw_params if names[id(p)] not in decay], "weight_decay": 0.0},
    ]
    optimizers: list[torch.optim.Optimizer] = []
    if muon_params:
        optimizers.append(hp.optim.Muon(
            muon_params, lr=args.learning_rate, weight_decay=args.weight_decay, momentum=hp_args.muon_momentum,
            nesterov=hp_args.muon_nesterov, ns_steps=hp_args.muon_ns_steps, adjust_lr_fn=hp_args.muon_adjust_lr_fn,
        ))
    groups = [group for group in groups if group["params"]]
    if groups:
        optimizers.append(torch.optim.AdamW(
            groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
        ))
    return ChainedOptimizer(optimizers)


def _check_training_args(args) -> None:
    """TrainingArguments that ask for another way to shard or a precision hp does not give, or that
    do not see the ranks torchrun started."""
    if args.deepspeed:
        raise ValueError(
            "hyperparallel: `deepspeed` is set in the training arguments; hyperparallel shards the model itself "
            "(hp.fully_shard): remove `deepspeed`"
        )
    if args.fsdp or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        raise ValueError(
            "hyperparallel: `fsdp` is set (in the training arguments or accelerate's config); hyperparallel shards "
            "the model itself (hp.fully_shard): remove `fsdp`"
        )
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if args.world_size != launched:
        raise ValueError(
            f"hyperparallel: the training arguments see {args.world_size} process(es) but {launched} were launched: "
            "HF's Trainer runs distributed on the CPU only when told, set `use_cpu=True`"
        )
    if args.fp16:
        raise ValueError(
            "hyperparallel: `fp16` is set; hyperparallel's mixed precision is bf16 (bf16 compute, fp32 gradient "
            "reduction): set `bf16` instead, or neither for fp32"
        )


def _check_model(model: nn.Module) -> None:
    if getattr(model, "peft_config", None) is not None:
        raise ValueError(
            f"hyperparallel: {type(model).__name__} carries PEFT (LoRA) adapters; hyperparallel trains every "
            "parameter (full fine-tuning): train the base model"
        )


def _state_dir(checkpoint: str | os.PathLike) -> Path:
    path = Path(checkpoint) / STATE_DIR
    if not path.is_dir():
        raise FileNotFoundError(
            f"{checkpoint} has no {STATE_DIR}/ (the model and optimizer shards HPTrainer saves): resume from a "
            "checkpoint HPTrainer wrote, or start afresh"
        )
    return path


__all__ = ["STATE_DIR", "ChainedOptimizer", "HPArguments", "HPTrainer", "HPTrainerMixin", "from_pretrained",
           "from_pretrained_meta", "muon_adamw", "save_pretrained", "shard_model"]
