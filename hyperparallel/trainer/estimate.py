"""``--dry-run``: the plan of a run and its memory per rank, without running it.

Memory is what the OS will count for each rank (peak resident set size), in parts:

- **runtime**: the interpreter, torch, transformers and hyperparallel once imported,
  measured in a fresh interpreter that imports the same modules, plus what a rank adds
  before the model exists (process group, fabric, thread pools; a measured constant);
- **parameters**: the full fp32 parameters live once per node in shared memory, and
  every rank reads all of them in forward, so every rank's RSS counts them; with bf16
  mixed precision forward and backward read a bf16 copy instead, and a rank touches
  only its own rows of the fp32 parameters;
- **gradients**: this rank's fp32 shard of every gradient, the full gradients of the
  group being reduced (autograd's, and this rank's slot of the node's gradient window,
  of which it also reads its rows in every other slot);
- **optimizer state**: AdamW's two moments and Muon's momentum for this rank's rows,
  and Muon's node-shared bf16 matrices (this rank's rows and the matrices it
  orthogonalises) with its Newton-Schulz workspace;
- **activations**: the tensors autograd keeps between forward and backward for one
  micro-batch, measured by running the model's forward on fake tensors (shapes only,
  no memory) and counting what autograd saves; with activation checkpointing, each
  decoder layer keeps its input and one layer is recomputed at a time; plus the
  logits' gradient buffers at the start of backward;
- **data**: the memory-mapped token file's pages.

On GPUs (``train.device`` resolving to cuda) the estimate is of the device memory a
rank's GPU holds for it, in the same parts: the CUDA context (the driver's) and the
library workspaces (torch's allocator);
this rank's fp32 shard of the parameters (peer-mapped), with bf16 mixed precision its
bf16 copy of its rows for its peers (none on one GPU alone), and the full parameters of
the root and of two decoder layers (the one computing, the one prefetched); the fp32
gradient shard, autograd's full gradients and the reduce-scatter buffers of two groups
(none on one GPU alone); AdamW's moments and Muon's momentum for this rank's rows,
Muon's peer-mapped bf16 rows and owned matrices, and its Newton-Schulz temporaries (at
most 512 MiB at a time); the activations traced as on the CPU, with the caching
allocator's slack. On one GPU alone Muon's bf16 copies and temporaries exist only during
the step, after the activations are gone, in memory the next forward reuses: the larger
of the two counts. The token file stays in host memory. All but the CUDA context is
what the rank allocates itself (:meth:`Estimate.allocated`), which the trainer measures
(torch's caching allocator's peak and hyperparallel's peer-mapped buffers): the context
is the driver's, and ranks sharing a GPU see each other's in the device's count.
"""

from __future__ import annotations

import functools
import math
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from hyperparallel.trainer import model as model_lib
from hyperparallel.trainer.config import Config, resolve_device
from hyperparallel.trainer.report import MIB, human

# What a rank loads on first use beyond this process's imports: MKL/oneDNN kernels
# (mapped library pages grow by ~35 MiB over a rank's first step), the reducer thread's
# malloc arena, Gloo's buffers. Measured on 2 ranks: the default config and a
# 44M-parameter MoE (fp32, with and without activation checkpointing).
RANK_OVERHEAD_BYTES = 60 * MIB
# The allocator keeps freed blocks for reuse; peak RSS runs above the live bytes by
# about this fraction of what the step allocates and frees (activations, gradients).
ALLOCATOR_SLACK = 0.15
# A GPU rank's fixed parts: the CUDA context with torch's kernels loaded (the driver's
# memory, outside torch's allocator), and cuBLAS's and cuDNN's workspaces (in it). Not
# yet measured on a GPU by this estimate's test (test_gpu_train).
CUDA_CONTEXT_BYTES = 500 * MIB
CUDA_WORKSPACE_BYTES = 100 * MIB
# Muon on a GPU: Newton-Schulz's temporaries are at most this much at a time (see
# csrc/optim/newton_schulz.cpp's kDeviceGroupBytes).
NS_DEVICE_GROUP_BYTES = 512 * MIB


@dataclass
class Estimate:
    """Bytes per rank by part (see the module docstring); ``total`` is the peak estimate
    (``total_is`` says of what: resident memory, or a GPU's memory)."""

    parts: dict[str, int] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    total_is: str = "peak RSS per rank"

    @property
    def total(self) -> int:
        """The peak estimate: the sum of the parts."""
        return sum(self.parts.values())

    @property
    def allocated(self) -> int:
        """What the trainer measures of the total: all of it on the CPU (peak RSS); on a GPU all
        but the CUDA context, which is the driver's (the rank's allocator peak and its
        peer-mapped buffers)."""
        return self.total - self.parts.get("CUDA context", 0)

    def table(self) -> str:
        """The parts as aligned lines, with the total."""
        width = max(len(k) for k in self.parts)
        rows = [f"    {name:<{width}}  {value / MIB:9.1f} MiB   {self.notes.get(name, '')}"
                for name, value in self.parts.items()]
        rows.append(f"    {'total':<{width}}  {self.total / MIB:9.1f} MiB   {self.total_is}")
        return "\n".join(rows)


def _fake_model(cfg: Config, dtype: torch.dtype, device: str):
    """The model (patched, in ``dtype``, on ``device``) made of fake tensors: shapes without memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model = model_lib.build(cfg, device=device, dtype=dtype, weights=False)
    return model, mode


def activation_bytes(cfg: Config, device: str) -> tuple[int, int, int]:
    """(saved bytes of one micro-batch's forward, of which in decoder layers, the largest saved tensor).

    The forward runs on fake tensors of ``device`` (what autograd saves depends on the
    kernels: flash attention keeps no attention matrix); every tensor autograd saves is
    counted once (views share a storage), parameters excluded.
    """
    dtype = torch.bfloat16 if cfg.model.mixed_precision == "bfloat16" else torch.float32
    model, mode = _fake_model(cfg, dtype, device)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, int] = {}
    in_layers = [0]
    inside = [False]

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in params and key not in saved:
            saved[key] = storage.nbytes()
            if inside[0]:
                in_layers[0] += storage.nbytes()
        return t

    def enter(*_):
        inside[0] = True

    def leave(*_):
        inside[0] = False

    hooks = []
    for layer in model_lib.decoder_layers(model):
        hooks.append(layer.register_forward_pre_hook(enter))
        hooks.append(layer.register_forward_hook(leave))
    with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ids = torch.zeros(cfg.train.micro_batch, cfg.data.seq_len, dtype=torch.long, device=device)
        model(input_ids=ids, labels=ids)
    for hook in hooks:
        hook.remove()
    return sum(saved.values()), in_layers[0], max(saved.values(), default=0)


def _groups(model: nn.Module) -> list[int]:
    """Parameter count of each FSDP group: each decoder layer, then the rest (the root)."""
    layers = model_lib.decoder_layers(model)
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    return [*sizes, sum(p.numel() for p in model.parameters()) - sum(sizes)]


@functools.cache
def runtime_bytes() -> int:
    """RSS of a fresh interpreter once it has imported what a rank imports.

    Measured in a child process: this process may hold far more than a rank starts
    with (a test session, a notebook that has built models).
    """
    probe = ("import torch.distributed.checkpoint, transformers, hyperparallel.nn, hyperparallel.optim\n"
             "from hyperparallel._memory import rss_bytes\n"
             "print(rss_bytes())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def estimate(cfg: Config, world: int) -> Estimate:
    """Peak memory per rank for ``cfg`` on ``world`` ranks (one node): resident memory on the
    CPU, device memory on a GPU (whichever ``train.device`` resolves to)."""
    from hyperparallel.optim import muon_param_split

    model = model_lib.build(cfg, device="meta")
    n = sum(p.numel() for p in model.parameters())
    groups = _groups(model)
    bf16 = cfg.model.mixed_precision == "bfloat16"
    compute_size = 2 if bf16 else 4
    if cfg.optim.name == "muon":
        muon, adamw = muon_param_split(model)
        n_muon, n_adamw = sum(p.numel() for p in muon), sum(p.numel() for p in adamw)
        largest_matrix = max((p[0].numel() if p.ndim == 3 else p.numel() for p in muon), default=0)
    else:
        n_muon, n_adamw, largest_matrix = 0, n, 0
    share = 1 / world
    device = resolve_device(cfg)
    total_act, layer_act, largest = activation_bytes(cfg, device)
    layers = len(model_lib.decoder_layers(model))
    if cfg.model.activation_checkpointing:
        hidden = model.config.hidden_size
        layer_inputs = layers * cfg.train.micro_batch * cfg.data.seq_len * hidden * (2 if bf16 else 4)
        activations = total_act - layer_act + layer_inputs + layer_act // max(1, layers)
        act_note = "layer inputs + one layer recomputed + the rest (fake-tensor trace)"
    else:
        activations = total_act
        act_note = f"{cfg.train.micro_batch} x {cfg.data.seq_len} tokens (fake-tensor trace)"
    biggest_group = max(groups)
    if device == "cuda":
        layer_group = max(groups[:-1], default=0)
        return _device_estimate(
            n=n, world=world, bf16=bf16, root=groups[-1], layer=layer_group, n_muon=n_muon, n_adamw=n_adamw,
            activations=activations, act_note=act_note, transient=2 * largest,
        )
    grads = (
        n * share * 4  # sharded fp32 gradients
        + 2 * biggest_group * compute_size  # autograd's full gradients in flight
        + 2 * biggest_group * 4 * (1 + (world - 1) * share)  # gradient windows: own slot + own rows elsewhere
    )
    optimizer = n_adamw * share * 8 + n_muon * share * 4
    if n_muon:
        optimizer += n_muon * 2 * 2 * share  # shared bf16 matrices: own rows, owned matrices
        optimizer += 6 * largest_matrix * 4  # Newton-Schulz workspace of one batch
    transient = 2 * largest  # the logits' gradient and softmax buffers at the start of backward
    parts = {
        "runtime": runtime_bytes() + RANK_OVERHEAD_BYTES,
        # bf16: forward and backward read the bf16 copy; of the fp32 parameters a rank
        # touches only its own rows (the optimizer's update, the copy it writes).
        "parameters": int(n * 2 + n * 4 * share) if bf16 else n * 4,
        "gradients": int(grads),
        "optimizer state": int(optimizer),
        "activations": int(activations + transient + ALLOCATOR_SLACK * (activations + grads)),
        "data": _data_bytes(cfg),
    }
    notes = {
        "runtime": "interpreter, torch, transformers, hyperparallel (measured) + rank set-up",
        "parameters": (f"{human(n)}: node-shared bf16 copy read whole, 1/{world} of the fp32 ones" if bf16
                       else f"{human(n)} fp32, node-shared, read whole by every rank"),
        "gradients": f"1/{world} fp32 shard + the largest group ({human(biggest_group)}) in flight",
        "optimizer state": (f"Muon {human(n_muon)} (momentum shard, shared bf16), AdamW {human(n_adamw)} (2 moments)"
                            if n_muon else f"AdamW {human(n_adamw)}: two moments of 1/{world}"),
        "activations": act_note,
        "data": "memory-mapped token file",
    }
    return Estimate(parts, notes)


def _device_estimate(*, n: int, world: int, bf16: bool, root: int, layer: int, n_muon: int, n_adamw: int,
                     activations: int, act_note: str, transient: int) -> Estimate:
    """The GPU's parts (see the module docstring): sizes in parameters, ``activations`` in bytes."""
    share = 1 / world
    alone = world == 1  # no peers: no bf16 shard copy, no reduce-scatter windows, Muon's copies lent
    compute_size = 2 if bf16 else 4
    full = (root + 2 * layer) * compute_size  # unsharded: the root, the layer computing, the one prefetched
    grads = n * share * 4 + 2 * layer * compute_size  # shard, autograd's
    if not alone:
        grads += 2 * layer * 4  # the reduce-scatter windows
    optimizer = n_adamw * share * 8 + n_muon * share * 4
    newton_schulz = min(NS_DEVICE_GROUP_BYTES, int(n_muon * share * 8)) if n_muon else 0  # its temporaries
    step = 0  # what only the optimizer step holds, beside no activations
    if not alone:
        optimizer += n_muon * share * 2 * 2 + newton_schulz  # peer-mapped bf16: own rows, owned matrices
    elif n_muon:
        step = n_muon * 2 + newton_schulz  # bf16 copies of every matrix, lent for the step
    held = activations + transient + ALLOCATOR_SLACK * (activations + grads)
    parts = {
        "CUDA context": CUDA_CONTEXT_BYTES,
        "workspaces": CUDA_WORKSPACE_BYTES,
        "parameters": int(n * share * 4 + (n * share * 2 if bf16 and not alone else 0) + full),
        "gradients": int(grads),
        "optimizer state": int(optimizer),
        "activations": int(max(held, step)),
    }
    if step > held:
        act_note = f"less than Muon's step on one GPU: bf16 copies of {human(n_muon)} parameters, Newton-Schulz"
    muon_note = "momentum" if alone else "momentum shard, peer-mapped bf16, Newton-Schulz"
    notes = {
        "CUDA context": "the driver's, with torch's kernels loaded (not in the trainer's measured peak)",
        "workspaces": "cuBLAS's and cuDNN's",
        "parameters": (f"1/{world} of {human(n)} fp32" + (" + its bf16 copy" if bf16 and not alone else "")
                       + f", full root + 2 layers ({human(root + 2 * layer)}) unsharded"),
        "gradients": f"1/{world} fp32 shard + 2 layers' full gradients"
                     + ("" if alone else " and reduce-scatter buffers"),
        "optimizer state": (f"Muon {human(n_muon)} ({muon_note}), AdamW {human(n_adamw)} (2 moments)" if n_muon
                            else f"AdamW {human(n_adamw)}: two moments of 1/{world}"),
        "activations": act_note,
    }
    return Estimate(parts, notes, "peak GPU memory per rank")


def allocated_or_none(cfg: Config, world: int) -> int | None:
    """:attr:`Estimate.allocated` for the trainer's summary, beside what it measures; None where
    the estimate fails (it is a report line, never a reason not to train)."""
    try:
        return estimate(cfg, world).allocated
    except Exception:  # noqa: BLE001
        return None


def _data_bytes(cfg: Config) -> int:
    path = Path(cfg.data.tokens)
    if path.is_file():
        return path.stat().st_size
    # Not made yet: about one token per 4 bytes of text, 2 bytes a token.
    return sum(Path(t).stat().st_size for t in cfg.data.prepare.text if Path(t).is_file()) // 2


def dry_run(cfg: Config, world: int) -> str:
    """The plan and the memory estimate, as printed by ``hyperparallel train --dry-run``."""
    model = model_lib.build(cfg, device="meta")
    params = model_lib.count_params(model)
    groups = _groups(model)
    accumulation = cfg.accumulation(world)
    tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
    est = estimate(cfg, world)
    gpu = resolve_device(cfg) == "cuda"
    mc = model.config
    experts = getattr(mc, "num_experts", 0)
    moe = f", {experts} experts top-{mc.num_experts_per_tok}" if experts else ""
    opt = ("Muon (hidden matrices, expert stacks) + AdamW (embeddings, head, norms)" if cfg.optim.name == "muon"
           else "AdamW")
    checkpoint = (f"every {cfg.checkpoint.every} steps" if cfg.checkpoint.every else "no periodic") + (
        " + final" if cfg.checkpoint.final else "") + f", keep {cfg.checkpoint.keep_last}"
    lines = [
        "hyperparallel train --dry-run: the plan",
        (f"  model       {type(model).__name__}: {human(params['total'])} params "
         f"({human(params['active'])} active per token), {mc.num_hidden_layers} layers, hidden {mc.hidden_size}"
         f"{moe}, vocab {mc.vocab_size}; {model_lib.describe_source(cfg)}"),
        (f"  modules     {'hp.nn fused (patch on)' if cfg.model.patch else 'stock HF (patch off)'}, "
         f"activation checkpointing {'on' if cfg.model.activation_checkpointing else 'off'}, "
         f"{cfg.model.mixed_precision}"),
        (f"  sharding    hp.fully_shard over {world} ranks ({'GPUs' if gpu else 'CPU'}): {len(groups) - 1} decoder "
         f"layers + root "
         f"({len(groups)} groups, largest {human(max(groups))} params)"),
        (f"  batch       {cfg.train.global_batch} sequences x {cfg.data.seq_len} tokens = {tokens_per_step:,} tokens "
         f"per step: {cfg.train.micro_batch} per rank x {accumulation} micro-batches x {world} ranks"),
        (f"  run         {cfg.train.steps} steps = {human(cfg.train.steps * tokens_per_step)} tokens"
         + (f" (stopping at {cfg.train.stop_at})" if cfg.train.stop_at else "")),
        (f"  optimizer   {opt}; lr {cfg.optim.lr:g}, warm-up {cfg.optim.warmup_steps}, cosine to "
         f"{cfg.optim.lr * cfg.optim.min_lr_ratio:g}; clip {cfg.train.max_grad_norm:g}"),
        (f"  data        {cfg.data.tokens}" + ("" if Path(cfg.data.tokens).is_file() else
                                               f" (made from {', '.join(cfg.data.prepare.text)})")),
        f"  checkpoints {checkpoint}, in {Path(cfg.output.dir) / 'checkpoints'}",
        "",
        f"{'GPU memory' if gpu else 'memory'} per rank (estimate):",
        est.table(),
        (f"  x {world} ranks: {est.total * world / MIB / 1024:.2f} GiB of GPU memory in all (ranks sharing a GPU "
         "add up)" if gpu else
         f"  x {world} ranks on this node: {est.total * world / MIB / 1024:.2f} GiB RSS in all (shared pages "
         f"counted once per rank; the node holds parameters once: {math.ceil(params['total'] * 4 / MIB)} MiB)"),
    ]
    return "\n".join(lines)
