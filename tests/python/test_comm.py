"""Every fabric collective against torch.distributed's Gloo result, on real ranks."""

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

import hyperparallel as hp
from hyperparallel.launch import run

SIZES = [(1,), (7,), (1001,), (65537,), (5, 3), (2, 129)]


def _tolerance(dtype, any_order):
    """Exact where the summation order is Gloo's too (two ranks: a+b); else rounding."""
    if dtype == torch.bfloat16:
        return {"rtol": 1.6e-2, "atol": 1.6e-2}  # one bf16 rounding of the fp32 sum, or two across nodes
    return {"rtol": 1e-6, "atol": 1e-6} if any_order else {"rtol": 0, "atol": 0}


def _padded_gather(local: torch.Tensor, rows: int) -> torch.Tensor:
    """Gloo's all_gather of uneven torch.chunk pieces: pad, gather, cut."""
    world = dist.get_world_size()
    per = -(-rows // world)
    padded = torch.zeros((per, *local.shape[1:]), dtype=local.dtype)
    padded[: local.shape[0]] = local
    gathered = torch.empty((per * world, *local.shape[1:]), dtype=local.dtype)
    dist.all_gather_into_tensor(gathered, padded)
    pieces = [gathered[r * per : r * per + min(per, max(0, rows - r * per))] for r in range(world)]
    return torch.cat(pieces)


def collectives_match_gloo(seed: int) -> dict:
    torch.set_num_threads(1)
    hp.comm.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    hierarchical = hp.comm.get().topology.num_nodes > 1
    zero_copy_bytes = 0
    for dtype in (torch.float32, torch.bfloat16):
        tol = _tolerance(dtype, hierarchical or world > 2)
        for shape in SIZES:
            generator = torch.Generator().manual_seed(seed + 7919 * rank + sum(shape))
            x = torch.randn(shape, generator=generator).to(dtype)
            rows = shape[0]

            ours, theirs = x.clone(), _sum(x)
            hp.comm.all_reduce(ours)
            assert_close(ours, theirs, **tol)
            ours = x.clone()
            hp.comm.all_reduce(ours, op="avg")
            assert_close(ours, (theirs.float() / world).to(dtype), **_tolerance(dtype, True))

            ours, theirs = x.clone(), x.clone()
            hp.comm.broadcast(ours, src=world - 1)
            dist.broadcast(theirs, src=world - 1)
            assert torch.equal(ours, theirs)

            mine = hp.comm.local_rows(x)
            full = torch.full(shape, float("nan"), dtype=dtype)
            hp.comm.all_gather_into_tensor(full, mine.clone())
            expected_full = _padded_gather(mine, rows)
            assert torch.equal(full, expected_full)

            shard = torch.empty_like(hp.comm.local_rows(x))
            hp.comm.reduce_scatter_tensor(shard, x)
            assert_close(shard, hp.comm.local_rows(theirs_sum := _sum(x)), **tol)
            hp.comm.reduce_scatter_tensor(shard, x, op="avg")
            assert_close(shard, hp.comm.local_rows((theirs_sum.float() / world).to(dtype)), **_tolerance(dtype, True))

            # Zero-copy: parameters written in place, gradients in each rank's slot.
            shared = hp.comm.shared_empty(shape, dtype)
            for step in range(3):
                hp.comm.acquire(shared)
                hp.comm.local_rows(shared).copy_(mine * step)
                hp.comm.reset_stats()
                hp.comm.all_gather_shared(shared)
                zero_copy_bytes += hp.comm.stats()["bytes_copied"]
                assert torch.equal(shared, expected_full * step)
            grad = hp.comm.symmetric_empty(shape, dtype)
            for step in range(3):
                hp.comm.acquire(grad)
                grad.copy_(x * step)
                hp.comm.reset_stats()
                hp.comm.reduce_scatter_symmetric(shard, grad)
                zero_copy_bytes += hp.comm.stats()["bytes_copied"]
                assert_close(shard, hp.comm.local_rows(_sum(x * step)), **tol)
    hp.comm.barrier()
    return {"zero_copy_bytes": zero_copy_bytes, "hierarchical": hierarchical, "device_bytes": hp.comm.device_bytes()}


def _sum(x: torch.Tensor) -> torch.Tensor:
    """Gloo's sum over ranks. bf16: Gloo rounds after every addition, we round
    once, so the reference is Gloo's exact gather summed in fp32, rounded once."""
    if x.dtype == torch.bfloat16:
        gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, x)
        return torch.stack([g.float() for g in gathered]).sum(0).to(torch.bfloat16)
    total = x.clone()
    dist.all_reduce(total)
    return total


@pytest.mark.parametrize("nproc", [2, 4])
def test_collectives_match_gloo(nproc):
    results = run(collectives_match_gloo, nproc=nproc, args=(1234,))
    assert sorted(results) == list(range(nproc))
    for result in results.values():
        assert result["zero_copy_bytes"] == 0  # all-gather and reduce-scatter copy nothing in a node
        assert result["device_bytes"] == 0  # shared-memory windows are not device memory


def test_collectives_match_gloo_across_two_nodes():
    results = run(collectives_match_gloo, nproc=2, nnodes=2, args=(99,))
    assert sorted(results) == [0, 1, 2, 3]
    assert all(result["hierarchical"] for result in results.values())


def wrong_inputs() -> str:
    hp.comm.init()
    out = torch.empty(10)
    with pytest.raises(RuntimeError, match=r"owns rows \[.*so in needs 5 elements, not 4"):
        hp.comm.all_gather_into_tensor(out, torch.empty(4))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        hp.comm.all_reduce(torch.ones(3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="not in shared memory"):
        hp.comm.all_gather_shared(torch.empty(4))
    grad = hp.comm.symmetric_empty((4,), torch.float32)
    with pytest.raises(RuntimeError, match="out is on meta but in is on cpu"):  # a device shard, a CPU window
        hp.comm.reduce_scatter_symmetric(torch.empty(2, device="meta"), grad)
    hp.comm.barrier()
    return "ok"


def test_wrong_inputs_get_errors_that_name_the_fix():
    assert run(wrong_inputs, nproc=2) == {0: "ok", 1: "ok"}
