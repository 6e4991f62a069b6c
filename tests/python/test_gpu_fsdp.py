"""hp.fully_shard on CUDA against one process on the same GPU, on real ranks (several ranks may
share one GPU: they map each other's memory through CUDA IPC, which tests everything but the
bandwidth of NVLink)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from test_fsdp import MICRO, batches, make_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import hyperparallel as hp
from hyperparallel.launch import run

pytestmark = pytest.mark.gpu

# Same inputs, same bits: CUDA's atomics-based kernels (index_add in MoE routing) would add a
# run-to-run wobble that is not ours. Set at import, before any rank touches CUDA (ranks import
# this file to find their function); only where there is CUDA, so that a CPU suite collecting
# this file does not run its other tests in deterministic mode.
if torch.cuda.is_available():
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)

STEPS = 20


def _device() -> torch.device:
    device = hp.comm.device()
    torch.cuda.set_device(device)
    return device


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter whole, on the CPU. Shards travel as CPU objects over the default group:
    DTensor.full_tensor() over Gloo on CUDA tensors segfaulted in torch 2.11 (a Gloo CUDA
    all-gather; NCCL, which real GPU jobs use, is not affected)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {name: (p.to_local() if isinstance(p, DTensor) else p).detach().float().cpu().clone()
                for name, p in model.named_parameters()}
    local = {name: (p.to_local() if isinstance(p, DTensor) else p).detach().float().cpu()
             for name, p in model.named_parameters()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    per_node = hp.comm.get().topology.local_world_size
    full = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            # Rows are chunked over one node's ranks (HSDP replicates them across nodes).
            shards = everyone[:per_node] if p.device_mesh.ndim == 2 else everyone
            full[name] = torch.cat([shard[name] for shard in shards])
        else:
            full[name] = local[name].clone()
    return full


def train(model, data, rank: int, world: int, device, clip: float | None = None, held: bool = False) -> list[float]:
    """AdamW steps; each rank takes its rows of every global batch; the mean loss over ranks.
    ``held`` (HSDP): two micro-batches a step, all-reduced across nodes once (set_requires_all_reduce)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for batch in data:
        mine = batch[rank * MICRO : (rank + 1) * MICRO].to(device)
        if held:
            loss = 0
            for index, micro in enumerate(mine.chunk(2)):
                model.set_requires_all_reduce(index == 1)
                part = model(micro, labels=micro).loss / 2
                part.backward()
                loss = loss + part.detach()
                assert index == 1 or all(p.grad is None for p in model.parameters())
        else:
            loss = model(mine, labels=mine).loss
            loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        total = loss.detach().float().cpu().reshape(1)
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
        opt.step()
        opt.zero_grad()
    return losses


def one_process(world: int, param_dtype=None, steps: int = STEPS, micro: int = 1) -> tuple[list[float], dict]:
    """The reference: the whole global batch in one process on the same GPU, the loss as the mean
    of per-rank means (the objective the ranks optimise), each rank's in ``micro`` micro-batches
    as the ranks run them (the GEMMs' shapes, and so their sums' order, the same)."""
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    model = make_model().to(device)
    if param_dtype is not None:
        model = model.to(param_dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for batch in batches(world, steps):
        batch = batch.to(device)
        loss = sum(model(b, labels=b).loss for b in batch.chunk(world * micro)) / (world * micro)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, full_params(model)


def hp_on_cuda(reshard, mp: bool, nodes: int = 1, param_dtype=None, held: bool = False) -> tuple:
    hp.comm.init()
    device = _device()
    rank, world = dist.get_rank(), dist.get_world_size()
    topology = hp.comm.get().topology
    if nodes > 1:
        mesh = init_device_mesh("cuda", (topology.num_nodes, topology.local_world_size),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cuda", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else MixedPrecisionPolicy()
    model = make_model().to(device)
    if param_dtype is not None:
        model = model.to(param_dtype)
    for layer in model.model.layers:
        hp.fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    hp.fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    assert all(isinstance(p, DTensor) and p.device.type == "cuda" for p in model.parameters())
    losses = train(model, batches(world), rank, world, device, held=held)
    memory = torch.cuda.max_memory_allocated(device)
    return losses, full_params(model), memory


def assert_params_close(got: dict, expected: dict, atol: float) -> None:
    assert got.keys() == expected.keys()
    worst = max((got[k] - expected[k]).abs().max().item() for k in got)
    assert worst <= atol, f"largest parameter difference {worst:.3g} > {atol}"


def assert_equal_to_one_process(results: dict, world: int, label: str, micro: int = 1) -> list[float]:
    """Every rank's losses (within 1e-5) and full parameters (1e-4) against the one-process run of
    ``world`` ranks' batches (``micro`` micro-batches each); returns its losses."""
    expected_losses, expected_params = one_process(world=world, micro=micro)
    for losses, params, _ in results.values():
        worst = max(abs(a - b) for a, b in zip(losses, expected_losses))
        print(f"{label}: max |loss diff| vs one process {worst:.3g}")
        assert worst <= 1e-5
        assert_params_close(params, expected_params, 1e-4)
    return expected_losses


@pytest.mark.parametrize("reshard", [True, False])
def test_fp32_training_on_two_ranks_equals_one_process(reshard):
    results = run(hp_on_cuda, nproc=2, args=(reshard, False))
    expected_losses = assert_equal_to_one_process(results, 2, f"reshard_after_forward={reshard}")
    assert expected_losses[-1] < expected_losses[0] - 1.0  # it learned


def test_fp32_training_on_one_rank_equals_one_process():
    # Alone on its node a rank reduces its own gradients in place (no gradient window).
    assert_equal_to_one_process(run(hp_on_cuda, nproc=1, args=(True, False)), 1, "1 rank")


@pytest.mark.parametrize("per_node", [2, 1])
def test_hsdp_on_cuda_equals_one_process(per_node, monkeypatch):
    # 2 nodes. With one rank per node each rank scales its own gradients, then HSDP's all-reduce
    # sums the nodes'; its simulated nodes share the GPU, which NCCL refuses: Gloo.
    if per_node == 1:
        monkeypatch.setenv("HP_CROSS_NODE_BACKEND", "gloo")
    results = run(hp_on_cuda, nproc=per_node, nnodes=2, args=(None, False, 2))
    assert_equal_to_one_process(results, 2 * per_node, f"HSDP 2 nodes x {per_node}")


def test_hsdp_accumulation_all_reduces_once_on_cuda():
    # set_requires_all_reduce(False) on the first of two micro-batches: held within the node.
    results = run(hp_on_cuda, nproc=2, nnodes=2, args=(None, False, 2, None, True))
    assert_equal_to_one_process(results, 4, "HSDP 2 nodes x 2, all-reduce once per 2 micro-batches", micro=2)


def assert_within_bf16_noise(results: dict, reference: list[float], noise: float, label: str) -> None:
    """Every rank's losses within twice ``noise`` (a bf16 run's own deviation) of ``reference``."""
    for losses, _, _ in results.values():
        worst = max(abs(a - b) for a, b in zip(losses, reference))
        print(f"{label}: max |loss diff| {worst:.3g}, bound from {noise:.3g}")
        assert worst <= 2 * noise + 1e-3


def test_hsdp_one_rank_per_node_bf16_parameters(monkeypatch):
    # bf16 shards: each node's rank scales its gradients in float32 and rounds them to bf16 (the
    # window kernel's arithmetic), then the nodes' all-reduce; within bf16's own deviation.
    monkeypatch.setenv("HP_CROSS_NODE_BACKEND", "gloo")
    results = run(hp_on_cuda, nproc=1, nnodes=2, args=(None, False, 2, torch.bfloat16))
    expected, _ = one_process(world=2, param_dtype=torch.bfloat16)
    fp32, _ = one_process(world=2)
    bf16_deviation = max(abs(a - b) for a, b in zip(expected, fp32))
    assert_within_bf16_noise(results, expected, bf16_deviation, "bf16 parameters, HSDP 2 nodes x 1 rank vs one "
                             "process (bound: bf16 vs fp32 in one process)")
    assert all(losses[-1] < losses[0] - 1.0 for losses, _, _ in results.values())  # it learned


def torch_fsdp2_bf16(world: int) -> list[float]:
    """torch's FSDP2 with bf16 mixed precision on one rank (NCCL runs one rank per GPU), on the
    global batches of ``world`` ranks."""
    dist.init_process_group("cpu:gloo,cuda:nccl")
    device = _device()
    mesh = init_device_mesh("cuda", (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = make_model().to(device)
    for layer in model.model.layers:
        torch_fully_shard(layer, mesh=mesh, mp_policy=policy)
    torch_fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for batch in batches(world):
        batch = batch.to(device)
        loss = sum(model(b, labels=b).loss for b in batch.chunk(world)) / world
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    return losses


@pytest.mark.parametrize("world", [2, 1])
def test_bf16_mixed_precision_within_fsdp2s_own_deviation(world):
    # Alone on its node (world 1) a rank keeps no bf16 copy of its shard: it casts straight into
    # the full parameters.
    ours = run(hp_on_cuda, nproc=world, args=(True, True))
    theirs = run(torch_fsdp2_bf16, nproc=1, args=(world,))[0]
    reference, _ = one_process(world=world)
    their_deviation = max(abs(a - b) for a, b in zip(theirs, reference))
    # Both round the same parameters to bf16; they differ in where the fp32 sums happen.
    assert_within_bf16_noise(ours, reference, their_deviation, f"bf16 vs fp32, hp at {world} ranks (bound: torch "
                             "FSDP2's)")


def clip_and_checkpoint(path: str, asynchronous: bool) -> tuple:
    hp.comm.init()
    device = _device()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))

    def build():
        model = make_model().to(device)
        for layer in model.model.layers:
            hp.fully_shard(layer, mesh=mesh)
        hp.fully_shard(model, mesh=mesh)
        return model

    model = build()
    data = batches(world, 6)
    first = train(model, data[:3], rank, world, device, clip=0.5)
    if asynchronous:  # staged to the host before it returns: the training after changes nothing saved
        pending = hp.checkpoint.async_save({"model": model.state_dict()}, path)
        after_save = train(model, data[3:], rank, world, device, clip=0.5)
        pending.result()
    else:
        hp.checkpoint.save({"model": model.state_dict()}, path)
        after_save = train(model, data[3:], rank, world, device, clip=0.5)
    fresh = build()
    state = {"model": fresh.state_dict()}
    hp.checkpoint.load(state, path)
    fresh.load_state_dict(state["model"])
    assert all(p.device.type == "cuda" for p in fresh.parameters())
    after_load = train(fresh, data[3:], rank, world, device, clip=0.5)
    return first, after_save, after_load


@pytest.mark.parametrize("asynchronous", [False, True])
def test_clip_grad_norm_and_checkpoint_on_cuda_shards(tmp_path, asynchronous):
    results = run(clip_and_checkpoint, nproc=2, args=(str(tmp_path / "ckpt"), asynchronous))
    for first, after_save, after_load in results.values():
        assert first[-1] < first[0]
        # Training resumed from the checkpoint repeats the run that continued after saving
        # (fresh AdamW moments on both sides).
        assert max(abs(a - b) for a, b in zip(after_save, after_load)) <= 1e-5
