"""hp.checkpoint on real ranks: hp.fully_shard models with Muon + AdamW state, saved at 2
ranks; resumed bitwise; read by torch DCP and reading DCP's; resharded to 1, 3, 4 ranks
and a 2x2 HSDP mesh."""

from __future__ import annotations

import pathlib
import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import hyperparallel as hp
import hyperparallel.checkpoint
import hyperparallel.optim
from hyperparallel.launch import run

# Dim 0 of many parameters does not divide 2, 3 or 4 (vocab 101, 3 experts, 16-row k_proj).
CONFIG = {
    "vocab_size": 101, "hidden_size": 48, "intermediate_size": 40, "moe_intermediate_size": 24,
    "num_hidden_layers": 2, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16,
    "num_experts": 3, "num_experts_per_tok": 2, "max_position_embeddings": 64, "torch_dtype": "float32",
}
SAVE_AT, STEPS = 2, 4


def build(mesh=None):
    torch.set_num_threads(1)
    hp.comm.init()
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG))
    for layer in model.model.layers:
        hp.fully_shard(layer, mesh=mesh)
    hp.fully_shard(model, mesh=mesh)
    muon, adamw = hyperparallel.optim.muon_with_adamw(model, lr=1e-2)
    return model, muon, adamw


def state_of(model, muon, adamw, step: int) -> dict:
    return {
        "model": model.state_dict(),
        "optim": {"muon": muon.state_dict(), "adamw": adamw.state_dict()},
        "step": step,
        "rng": torch.get_rng_state(),
        "loader": {"epoch": 0, "position": step * 2, "order": [3, 1, 2]},
    }


def apply_state(model, muon, adamw, state) -> None:
    model.load_state_dict(state["model"])
    muon.load_state_dict(state["optim"]["muon"])
    adamw.load_state_dict(state["optim"]["adamw"])
    torch.set_rng_state(state["rng"])


def init_optimizer_state(model, opts) -> None:
    """Create every optimizer's state (zero grads, lr 0) so that a load has tensors to fill."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for opt in opts:
        lrs = [g["lr"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"] = 0.0
        opt.step()
        for g, lr in zip(opt.param_groups, lrs):
            g["lr"] = lr
        opt.zero_grad()


def train_step(model, opts, step: int) -> float:
    rank = dist.get_rank()
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(100 * step + rank))
    noise = torch.rand(()).item() * 1e-3  # draws from the global RNG: resumes must restore it
    loss = model(ids, labels=ids).loss * (1 + noise)
    loss.backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()
    return loss.item()


def full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def snapshot(model, muon, adamw) -> dict:
    out = {f"model.{k}": full(v).clone() for k, v in model.state_dict().items()}
    for name, opt in (("muon", muon), ("adamw", adamw)):
        for index, state in opt.state_dict()["state"].items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"{name}.{index}.{key}"] = full(value).clone()
    return out


def save_run(root: str) -> dict:
    """Uninterrupted run at 2 ranks; checkpoints after SAVE_AT steps with hp and with DCP."""
    model, muon, adamw = build()
    losses = [train_step(model, (muon, adamw), s) for s in range(SAVE_AT)]
    manager = hp.checkpoint.CheckpointManager(pathlib.Path(root) / "hp", keep_last=2)
    manager.save(SAVE_AT, state_of(model, muon, adamw, SAVE_AT))
    dcp.save(state_of(model, muon, adamw, SAVE_AT), checkpoint_id=str(pathlib.Path(root) / "dcp"))
    saved = snapshot(model, muon, adamw)
    losses += [train_step(model, (muon, adamw), s) for s in range(SAVE_AT, STEPS)]
    return {"losses": losses, "saved": saved, "rng": torch.get_rng_state()}


def resume_run(root: str) -> dict:
    """Fresh processes: resume from hp's checkpoint, and cross-read hp's and DCP's checkpoints."""
    root = pathlib.Path(root)
    model, muon, adamw = build()
    init_optimizer_state(model, (muon, adamw))
    state = state_of(model, muon, adamw, 0)
    step = hp.checkpoint.CheckpointManager(root / "hp").load_latest(state)
    apply_state(model, muon, adamw, state)
    loaded = snapshot(model, muon, adamw)
    loader = state["loader"]
    losses = [train_step(model, (muon, adamw), s) for s in range(step, STEPS)]

    # DCP reads ours; we read DCP's: both give the same values.
    cross = {}
    for reader, source in (("dcp", root / "hp" / f"step_{SAVE_AT:08d}"), ("hp", root / "dcp")):
        m, mu, ad = build()
        init_optimizer_state(m, (mu, ad))
        other = state_of(m, mu, ad, 0)
        if reader == "dcp":
            dcp.load(other, checkpoint_id=str(source))
        else:
            hp.checkpoint.load(other, source)
        apply_state(m, mu, ad, other)
        cross[reader] = (snapshot(m, mu, ad), other["step"], other["loader"])
    return {"step": step, "loaded": loaded, "losses": losses, "loader": loader, "cross": cross}


def reshard_run(root: str, hsdp: bool) -> dict:
    mesh = None
    if hsdp:
        topology = hp.comm.init().topology
        mesh = init_device_mesh("cpu", (topology.num_nodes, topology.local_world_size),
                                mesh_dim_names=("replicate", "shard"))
    model, muon, adamw = build(mesh)
    init_optimizer_state(model, (muon, adamw))
    state = state_of(model, muon, adamw, 0)
    hp.checkpoint.load(state, pathlib.Path(root) / "hp" / f"step_{SAVE_AT:08d}")
    apply_state(model, muon, adamw, state)
    return {"loaded": snapshot(model, muon, adamw), "step": state["step"],
            "local_rows": model.model.embed_tokens.weight.to_local().shape[0]}


def assert_same(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    results = run(save_run, nproc=2, args=(str(root),))
    return root, results


def test_resume_reproduces_uninterrupted_losses_and_dcp_interop(saved):
    root, original = saved
    results = run(resume_run, nproc=2, args=(str(root),))
    for rank, result in results.items():
        assert result["step"] == SAVE_AT
        assert_same(result["loaded"], original[rank]["saved"])
        assert result["loader"] == {"epoch": 0, "position": SAVE_AT * 2, "order": [3, 1, 2]}
        assert result["losses"] == original[rank]["losses"][SAVE_AT:]  # bitwise
        for reader in ("dcp", "hp"):
            values, step, loader = result["cross"][reader]
            assert_same(values, original[rank]["saved"])
            assert step == SAVE_AT and loader["position"] == SAVE_AT * 2


@pytest.mark.parametrize("nproc,nnodes", [(3, 1), (4, 1), (2, 2)])
def test_reshard_on_load(saved, nproc, nnodes):
    root, original = saved
    results = run(reshard_run, nproc=nproc, nnodes=nnodes, args=(str(root), nnodes > 1))
    for result in results.values():
        assert result["step"] == SAVE_AT
        assert_same(result["loaded"], original[0]["saved"])
    assert sum(r["local_rows"] for r in results.values()) == CONFIG["vocab_size"] * nnodes


def test_reshard_to_one_plain_process(saved):
    """2 sharded ranks -> one process without torch.distributed: plain tensors."""
    root, original = saved
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG))
    state = {"model": model.state_dict(), "step": 0}
    hp.checkpoint.load(state, root / "hp" / f"step_{SAVE_AT:08d}")
    model.load_state_dict(state["model"])
    assert state["step"] == SAVE_AT
    for key, value in model.state_dict().items():
        assert torch.equal(value, original[0]["saved"][f"model.{key}"]), key


def saves_in_flight(root: str) -> list[float]:
    """Three async saves started back to back on every rank, then waited for."""
    hp.comm.init()
    pending = [hp.checkpoint.async_save({"w": torch.full((1 << 16,), float(10 * i)), "step": i},
                                        f"{root}/c{i}") for i in range(3)]
    for save in pending:
        save.result(timeout=120)
    values = []
    for i in range(3):
        state = {"w": torch.zeros(1 << 16), "step": -1}
        hp.checkpoint.load(state, f"{root}/c{i}")
        assert state["step"] == i
        values.append(state["w"][0].item())
    return values


def test_async_saves_in_flight_together(tmp_path):
    """Each rank's background saves run in the order it started them: two at once would
    interleave their collectives (a hang, or garbage) on the group they share."""
    for values in run(saves_in_flight, nproc=2, args=(str(tmp_path),)).values():
        assert values == [0.0, 10.0, 20.0]


def sharded_async_save(root: str) -> bool:
    """An hp.fully_shard model's state (DTensor shards) saved in the background while a step changes
    the parameters in place: the checkpoint holds them as they were at the call."""
    from hyperparallel.checkpoint._storage import Writer

    model, muon, adamw = build()
    before = {key: value.to_local().clone() for key, value in model.state_dict().items()}
    stepped, write_data = threading.Event(), Writer.write_data
    Writer.write_data = lambda self, plan, planner: stepped.wait(60) and write_data(self, plan, planner)
    pending = hp.checkpoint.async_save({"model": model.state_dict()}, f"{root}/ckpt")
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(tokens, labels=tokens).loss.backward()
    muon.step()
    adamw.step()
    stepped.set()  # the files are written only now, after the step changed the parameters
    pending.result(timeout=120)
    Writer.write_data = write_data
    changed = any(not torch.equal(value.to_local(), before[key]) for key, value in model.state_dict().items())
    fresh, _, _ = build()
    state = {"model": fresh.state_dict()}
    hp.checkpoint.load(state, f"{root}/ckpt")
    return changed and all(torch.equal(value.to_local(), before[key]) for key, value in state["model"].items())


def test_async_save_of_shards_holds_them_as_at_the_call(tmp_path):
    assert all(run(sharded_async_save, nproc=2, args=(str(tmp_path),)).values())


def column_blocks(root: str) -> tuple[bool, list[int]]:
    """A tensor saved whole, loaded as Shard(1) halves: each rank's block is strided in the
    saved item. Returns whether the block arrived, and the byte counts the loader read."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from hyperparallel import _C

    hp.comm.init()
    mesh = init_device_mesh("cpu", (2,))
    state = {"w": distribute_tensor(torch.zeros(4, 6, 5), mesh, [Shard(1)])}
    reads, read_into = [], _C.ckpt_read_into
    _C.ckpt_read_into = lambda requests, threads: (reads.extend(t.nbytes for *_, t in requests),
                                                   read_into(requests, threads))
    try:
        hp.checkpoint.load(state, root)
    finally:
        _C.ckpt_read_into = read_into
    mine = torch.arange(120.0).reshape(4, 6, 5)[:, 3 * dist.get_rank():3 * dist.get_rank() + 3]
    return torch.equal(state["w"].to_local(), mine), [n for n in reads if n]


def test_a_strided_block_reads_only_the_run_that_holds_it(tmp_path):
    """Rank 0's block [:, 0:3] of a (4, 6, 5) float32 tensor spans elements 0..104 of it,
    rank 1's [:, 3:6] elements 15..119: 105 of the 120, not the whole item."""
    hp.checkpoint.save({"w": torch.arange(120.0).reshape(4, 6, 5)}, tmp_path / "c")
    for arrived, reads in run(column_blocks, nproc=2, args=(str(tmp_path / "c"),)).values():
        assert arrived and reads == [105 * 4]
